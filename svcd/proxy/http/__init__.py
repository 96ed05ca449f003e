"""
The HTTP edge of svc-proxy: the site that guards connections, the resource
that routes requests and writes answers, the routes and middleware, the
request context, canonical paths and the bodies' rules.
"""
