"""
The body sent to a model's provider, made from the client's object
(decisions D9, D12 amended, D13): one function per operation, which the
forwarder sends and a budget's worst case measures
(L{svcd.limits.reservation}), so that what is reserved for is the byte
length of what is sent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from svcd.metering.models import Model


def attemptBody(document: Mapping[str, Any], model: Model, outputCap: int | None = None) -> bytes:
    """
    The body sent to C{model}'s provider for the client's object
    C{document}: C{model} replaced by its C{upstream_model}, a stream's
    C{stream_options.include_usage} set, and, with C{outputCap}, that cap
    (at most the model's own ceiling) under the model's C{cap_field}
    (decisions D12, amended: a budget's worst case holds only if the
    provider is told the cap it assumed). Every other key is kept.

    The edge measures a budget's worst-case prompt with this very function,
    so what is reserved for is the byte length of what is sent.
    """
    outgoing = dict(document)
    outgoing["model"] = model.upstreamModel
    if document.get("stream") is True:
        options = outgoing.get("stream_options")
        options = dict(options) if isinstance(options, dict) else {}
        options["include_usage"] = True
        outgoing["stream_options"] = options
    if outputCap is not None:
        outgoing[model.capField] = min(outputCap, model.outputCeiling)
    return json.dumps(outgoing, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def embeddingsBody(
    document: Mapping[str, Any], model: Model, outputCap: int | None = None
) -> bytes:
    """
    The body sent to C{model}'s provider for the client's embeddings object
    C{document} (decisions D13): C{model} replaced by its C{upstream_model},
    every other key kept. An embedding has no output, so no cap is ever
    added (C{outputCap} is ignored).

    A budget's worst case is measured with this very function, as a chat
    completion's is with L{attemptBody}.
    """
    outgoing = dict(document)
    outgoing["model"] = model.upstreamModel
    return json.dumps(outgoing, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
