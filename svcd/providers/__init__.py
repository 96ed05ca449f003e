"""
Calling providers, OpenAI-compatible ones (decisions D9) and those of
Anthropic's Messages API (D14), for any daemon that needs to: svc-proxy
forwards its clients' chat completions, embeddings (decisions D13) and
messages through it, and a daemon of Phase 4 calls providers as an
organization with the same client. It imports nothing of svc-proxy (a test checks it).

  - L{svcd.providers.providersfile}: the providers file, read and
    checked at start (its entries by L{svcd.providers.entries}, its
    values by L{svcd.providers.fields}), a leaf;
  - L{svcd.providers.table}: what it yields: the C{[memory]} settings and
    the lookups of a request over the providers and models (the records
    themselves, L{svcd.metering.models}, and their prices,
    L{svcd.metering.prices}, are on the floor the limits and the ledger
    share);
  - L{svcd.providers.routing}: which deployment of a model a request
    tries, and in what order the others and the fallbacks (decisions D15),
    from the state of this proxy (tries in flight, time to the first
    byte, the cooldowns of L{svcd.providers.cooldowns}); pure, clocked by
    its caller;
  - L{svcd.providers.http1}: the HTTP/1.1 client and its connection pool;
  - L{svcd.providers.upstream}: the request sent upstream over each
    provider's persistent connections, its tries over the deployments and
    fallbacks as the router plans them, usage, metrics (through a
    Protocol the daemon's metrics fill) and each try's span;
  - L{svcd.providers.genai}: OpenTelemetry's GenAI conventions on each
    try: its client span's attributes, and the two GenAI histograms,
    recorded while a meter is bound to them (decisions D15);
  - L{svcd.providers.tries}: what the forwarder keeps of each try: which
    can be sent the request and their bodies, the wait for its first
    byte (C{first_byte_timeout}), the deployment metrics' Protocol;
  - L{svcd.providers.links}: one provider's pool of connections and its
    bound on requests in flight;
  - L{svcd.providers.operations}: what a request asks, in the client's
    dialect, and how it is carried to a provider of each C{api} (path,
    body, answer, stream), translated by L{svcd.dialects} where the two
    differ;
  - L{svcd.providers.faults}: an attempt's faults, and a provider's
    refusal mapped to the gateway's error;
  - L{svcd.providers.relay}: reading the answer, a bounded body or a
    stream of events relayed with backpressure;
  - L{svcd.providers.passages}: the streams that are not OpenAI's relayed
    as given (Anthropic's as given, or translated), event by event;
  - L{svcd.providers.records}: what an answer leaves behind for the
    access log, a leaf;
  - L{svcd.providers.vectors}: the vectors of an embeddings answer, read
    for the gateway's own use.

It imports neither the limits nor the ledger: the call that admits,
forwards, settles and bills is above all three, L{svcd.metered}.
"""
