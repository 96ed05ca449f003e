"""
The vectors of a provider's embeddings answer, read for the gateway's own
use (decisions D13, and D13 amended, "Vectors never mix"): float32 bytes,
little-endian, as svc-memory stores and searches them, never a Python
float per component of a base64 vector.

A vector memory could not use is the provider's fault (502
UPSTREAM_ERROR, decisions D9's envelope), found here before anything is
stored: an answer that is not one non-empty vector per text, all of one
length; a vector that is not the C{dimensions} the providers file gives
the model; a value that is not a finite float32 (NaN, an infinity, or a
JSON number beyond float32's range from a provider that ignored
C{encoding_format}). The caller's ledger row records the fault with the
provider's usage: the provider was paid.
"""

from __future__ import annotations

import base64
import binascii
import json
import struct

from svcd.common.errors import ApiError, ErrorCode


class _NotFinite(ValueError):
    """
    A vector holds a value that is not a finite float32.
    """


class _OtherLength(ValueError):
    """
    The vectors are not the length the providers file gives the model.
    """


def decodeVectors(body: bytes, count: int, dimensions: int | None = None) -> tuple[bytes, ...]:
    """
    The C{count} vectors of an OpenAI-shaped embeddings answer's body
    (L{vectorsOf}).

    @raise ApiError: 502 UPSTREAM_ERROR when it is not JSON, or as
        L{vectorsOf}.
    """
    try:
        document = json.loads(body)
    except ValueError:
        raise _unreadable() from None
    return vectorsOf(document, count, dimensions)


def vectorsOf(document: object, count: int, dimensions: int | None = None) -> tuple[bytes, ...]:
    """
    The C{count} vectors of an OpenAI-shaped embeddings answer, parsed
    (the forwarder's L{svcd.providers.upstream.Answer.document}: the body
    is not parsed twice), in the order of their C{index}, as float32
    bytes, little-endian: base64 strings decoded as they are (the bytes
    OpenAI encodes), arrays of numbers (a provider that ignored
    C{encoding_format}) packed.

    @param dimensions: the length every vector must have (the model's
        C{dimensions} in the providers file), or None for any length.

    @raise ApiError: 502 UPSTREAM_ERROR when the answer does not hold
        exactly one non-empty vector per text, all of one length (and of
        C{dimensions} when given), every value a finite float32.
    """
    try:
        if not isinstance(document, dict):
            raise ValueError("not an object")
        data = document["data"]
        if not isinstance(data, list) or len(data) != count:
            raise ValueError("not one vector per text")
        vectors: list[bytes | None] = [None] * count
        for item in data:
            index = item["index"]
            if not isinstance(index, int) or not 0 <= index < count or vectors[index] is not None:
                raise ValueError("bad index")
            vectors[index] = _vectorBytes(item["embedding"])
        lengths = {len(vector) for vector in vectors if vector is not None}
        if len(lengths) != 1 or 0 in lengths:
            raise ValueError("vectors of several lengths")
        if dimensions is not None and lengths != {4 * dimensions}:
            raise _OtherLength()
        if not _finite(vectors):
            raise _NotFinite()
    except _OtherLength:
        raise ApiError(
            ErrorCode.UPSTREAM_ERROR,
            "The model provider's embeddings are not as long as the providers file says.",
        ) from None
    except _NotFinite:
        raise ApiError(
            ErrorCode.UPSTREAM_ERROR,
            "The model provider's embeddings hold a value that is not a finite number.",
        ) from None
    except (ValueError, KeyError, TypeError, OverflowError, binascii.Error, struct.error):
        raise _unreadable() from None
    return tuple(vector for vector in vectors if vector is not None)


def _unreadable() -> ApiError:
    return ApiError(ErrorCode.UPSTREAM_ERROR, "The model provider's embeddings could not be read.")


def _vectorBytes(embedding: object) -> bytes:
    if isinstance(embedding, str):
        raw = base64.b64decode(embedding, validate=True)
        if len(raw) % 4:
            raise ValueError("not float32 components")
        return raw
    if isinstance(embedding, list) and all(
        isinstance(each, (int, float)) and not isinstance(each, bool) for each in embedding
    ):
        try:
            return struct.pack(f"<{len(embedding)}f", *embedding)
        except OverflowError:
            # A number beyond float32's range (1e39), or an integer beyond
            # a float's: no float32 holds it.
            raise _NotFinite() from None
    raise ValueError("not a vector")


def _finite(vectors: list[bytes | None]) -> bool:
    """
    Whether every component of C{vectors} is a finite float32: one pass of
    numpy over each vector's bytes, no Python float per component.
    """
    # Imported here, as svcd.memory.records imports it: a module svcctl
    # may read should not cost it numpy's import.
    import numpy

    return all(
        bool(numpy.isfinite(numpy.frombuffer(vector, dtype="<f4")).all())
        for vector in vectors
        if vector is not None
    )
