"""
The floor of the gateway benchmark: a bare Klein handler that answers every
POST /v1/chat/completions (and GET /v1/internal/auth-probe) with the same
501 JSON envelope svc-proxy sends, with no middleware, no auth and no Redis.

    python bench/floor.py PORT
"""

from __future__ import annotations

import sys

from klein import Klein
from twisted.internet import reactor
from twisted.web.server import Site

app = Klein()
BODY = (
    b'{"error":{"code":"PROVIDER_NOT_CONFIGURED","message":"No LLM provider is '
    b'configured for this gateway.","request_id":"01a1fe13-c305-7e5a-a047-2746b0df2027",'
    b'"timestamp":"2026-11-21T12:00:00.000Z"}}'
)


@app.route("/v1/chat/completions", methods=["POST"])
@app.route("/v1/internal/auth-probe", methods=["GET"])
def answer(request: object) -> bytes:
    request.setResponseCode(501)  # type: ignore[attr-defined]
    request.setHeader(b"Content-Type", b"application/json")  # type: ignore[attr-defined]
    return BODY


if __name__ == "__main__":
    site = Site(app.resource())
    site.noisy = False
    site.log = lambda request: None  # type: ignore[method-assign]
    # The proxy's accept queue (svcd.proxy.listening.BACKLOG), so that the
    # 256-connection rows compare like with like.
    reactor.listenTCP(int(sys.argv[1]), site, backlog=511, interface="127.0.0.1")  # type: ignore[arg-type]
    reactor.run()
