"""
Forwarding chat completions to OpenAI-compatible providers (decisions D9):

  - L{svcd.proxy.forwarding.providers}: the providers file, read and checked
    at start;
  - L{svcd.proxy.forwarding.upstream}: the request sent upstream over each
    provider's persistent connections, faults and fallbacks, usage,
    metrics and the upstream span;
  - L{svcd.proxy.forwarding.relay}: reading the answer, a bounded body or a
    stream of events relayed with backpressure.
"""
