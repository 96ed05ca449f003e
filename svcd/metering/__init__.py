"""
The values a provider call is measured and paid by, shared by the
providers' client (L{svcd.providers}), the limits (L{svcd.limits}) and the
ledger (L{svcd.ledger}): the floor under all three, which import it and
never each other (a test checks it). Plain values and pure functions:
nothing here does I/O, and nothing imports Twisted or gRPC.

  - L{svcd.metering.models}: a model and its provider, as the providers
    file names them (decisions D9, D11, D12, D13);
  - L{svcd.metering.prices}: a model's price and the cost of an answer,
    in nano-dollars (decisions D12);
  - L{svcd.metering.usage}: the tokens a provider counted for an answer;
  - L{svcd.metering.bodies}: the body sent to a model, which the
    forwarder sends and a budget's worst case measures;
  - L{svcd.metering.charges}: what a call's ledger row counts and costs,
    however it ended.

What admits, forwards, settles and bills a call with all three is above
them, L{svcd.metered}.
"""
