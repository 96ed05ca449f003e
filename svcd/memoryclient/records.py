"""
What svc-memory and the daemons that call it (svc-proxy, svc-worker) both
hold of memories (decisions D13): the values a call carries (a scope, an
embedding, an observed message), the bounds a caller checks before it
sends, the rules of a vector (L{checkEmbedding}), and the details of the
refusals a client tells apart. What only svc-memory holds (its records,
its other rules) is L{svcd.memory.records}.
"""

from __future__ import annotations

import math
import uuid

import attrs

# A memory's content: 1 to this many characters once trimmed.
MAX_CONTENT_CHARACTERS = 4000
# Its metadata: a JSON object of at most this many bytes, written compactly.
MAX_METADATA_BYTES = 4096
MAX_MODEL_CHARACTERS = 200
MAX_DIMENSIONS = 16384
# An observation (decisions D13): the user's messages after the last
# assistant message and the answer, each at most 16 KiB.
MAX_OBSERVED_MESSAGES = 64
MAX_OBSERVED_MESSAGE_BYTES = 16 * 1024
OBSERVED_ROLES = ("user", "assistant")
# The most searches of one SearchMany: svc-memory refuses more.
MAX_SEARCHES_PER_CALL = 64

# The details of svc-memory's PERMISSION_DENIED for a memory of another
# organization, agent or subject: how its clients tell that refusal (403)
# from a caller's certificate not admitted (a fault of the deployment).
FORBIDDEN_DETAILS = "the id belongs to another organization, agent or subject"
# The details of svc-memory's NOT_FOUND for an observation that a deletion
# of its scope or agent took (decisions D13, amended): how svc-worker tells
# it from one dropped by an operator (svcd/memory/forgetting.py).
FORGOTTEN_DETAILS = "the observation was forgotten"

# QueuedObservation.refused of an observation past its organization's
# SVC_MEMORY_MAX_WAITING_PER_ORG waiting (decisions D13, amended).
QUEUE_FULL = "queue_full"


class InvalidMemory(ValueError):
    """
    A value a memory (or a call about memories) cannot take; C{field}
    names it, the message says why without quoting it (it may be content).
    """

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@attrs.frozen
class Scope:
    """
    Whose memories: an organization, one of its agents, and a subject
    within the agent ("" by default). Nothing of one scope is ever shown to
    another.
    """

    orgID: uuid.UUID
    agentID: uuid.UUID
    subject: str = attrs.field(default="", repr=False)


@attrs.frozen
class Embedding:
    """
    A vector and the model that made it; C{vector} is its float32
    components, little-endian (as the table and an OpenAI base64 embedding
    hold them).
    """

    model: str
    vector: bytes = attrs.field(repr=False)

    @property
    def dimensions(self) -> int:
        return len(self.vector) // 4


@attrs.frozen
class ObservedMessage:
    role: str
    content: str = attrs.field(repr=False)


def checkEmbedding(model: str, vector: bytes) -> Embedding:
    """
    @raise InvalidMemory: no model, a vector that is not whole float32
        components, has none, too many, a component that is not finite,
        or is all zeros (it has no direction to compare).
    """
    checkShape(model, vector)
    # Imported here, not at the top: svcctl reads this module for its
    # memory commands, and numpy would add a fifth of a second to every
    # svcctl command (the daemon has it imported long before).
    import numpy

    # One sum of squares in float64 tells both: it is not finite exactly
    # when a component is not (a float32's square cannot overflow a
    # float64, nor can 16,384 of them), and zero exactly when all are.
    components = numpy.frombuffer(vector, dtype="<f4").astype(numpy.float64)
    checkSquares(float(components @ components))
    return Embedding(model, bytes(vector))


def checkShape(model: str, vector: bytes) -> None:
    if not model or len(model) > MAX_MODEL_CHARACTERS or "\x00" in model:
        raise InvalidMemory("embedding.model", "must be 1 to 200 characters")
    if not vector or len(vector) % 4:
        raise InvalidMemory("embedding.vector", "must be float32 components (4 bytes each)")
    if len(vector) // 4 > MAX_DIMENSIONS:
        raise InvalidMemory("embedding.vector", f"must have at most {MAX_DIMENSIONS} components")


def checkSquares(squares: float) -> None:
    if not math.isfinite(squares):
        raise InvalidMemory("embedding.vector", "must have finite components")
    if squares == 0.0:
        raise InvalidMemory("embedding.vector", "must not be all zeros")
