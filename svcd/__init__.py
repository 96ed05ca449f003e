"""svc: a tenant-aware LLM gateway (svc-proxy and svc-auth)."""
