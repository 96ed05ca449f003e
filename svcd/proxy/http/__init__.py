"""
The HTTP edge of svc-proxy: the site that guards connections, the routes
and middleware, the request context, canonical paths and the chat body rules.
"""
