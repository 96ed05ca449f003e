"""
Forwarding chat completions to OpenAI-compatible providers (decisions D9).

Three parts: the provider configuration read from C{SVC_PROVIDERS_FILE}
and checked at start (L{svcd.proxy.forwarding.providers}); the upstream
client, which sends each request over a bounded persistent connection pool
per provider; and the stream relay, which passes server-sent events on to
the client as they arrive, pausing the upstream when the client is slow.
"""
