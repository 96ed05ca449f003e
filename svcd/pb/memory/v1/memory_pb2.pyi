from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Scope(_message.Message):
    __slots__ = ("org_id", "agent_id", "subject")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    agent_id: str
    subject: str
    def __init__(self, org_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., subject: _Optional[str] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("model", "vector")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    model: str
    vector: bytes
    def __init__(self, model: _Optional[str] = ..., vector: _Optional[bytes] = ...) -> None: ...

class Memory(_message.Message):
    __slots__ = ("id", "org_id", "agent_id", "subject", "content", "metadata_json", "source", "source_request_id", "created_at", "updated_at", "embedding_model", "dimensions")
    ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SUBJECT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_MODEL_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    id: str
    org_id: str
    agent_id: str
    subject: str
    content: str
    metadata_json: str
    source: str
    source_request_id: str
    created_at: str
    updated_at: str
    embedding_model: str
    dimensions: int
    def __init__(self, id: _Optional[str] = ..., org_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., subject: _Optional[str] = ..., content: _Optional[str] = ..., metadata_json: _Optional[str] = ..., source: _Optional[str] = ..., source_request_id: _Optional[str] = ..., created_at: _Optional[str] = ..., updated_at: _Optional[str] = ..., embedding_model: _Optional[str] = ..., dimensions: _Optional[int] = ...) -> None: ...

class AddMemoryRequest(_message.Message):
    __slots__ = ("scope", "content", "metadata_json", "source", "source_request_id", "embedding")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    content: str
    metadata_json: str
    source: str
    source_request_id: str
    embedding: Embedding
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., content: _Optional[str] = ..., metadata_json: _Optional[str] = ..., source: _Optional[str] = ..., source_request_id: _Optional[str] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class GetMemoryRequest(_message.Message):
    __slots__ = ("scope", "id")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    id: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., id: _Optional[str] = ...) -> None: ...

class ListMemoriesRequest(_message.Message):
    __slots__ = ("scope", "limit", "after")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    limit: int
    after: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., limit: _Optional[int] = ..., after: _Optional[str] = ...) -> None: ...

class ListMemoriesResponse(_message.Message):
    __slots__ = ("memories", "has_more")
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    HAS_MORE_FIELD_NUMBER: _ClassVar[int]
    memories: _containers.RepeatedCompositeFieldContainer[Memory]
    has_more: bool
    def __init__(self, memories: _Optional[_Iterable[_Union[Memory, _Mapping]]] = ..., has_more: _Optional[bool] = ...) -> None: ...

class UpdateMemoryRequest(_message.Message):
    __slots__ = ("scope", "id", "content", "metadata_json", "embedding")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    id: str
    content: str
    metadata_json: str
    embedding: Embedding
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., id: _Optional[str] = ..., content: _Optional[str] = ..., metadata_json: _Optional[str] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class DeleteMemoryRequest(_message.Message):
    __slots__ = ("scope", "id")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    id: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., id: _Optional[str] = ...) -> None: ...

class DeleteMemoryResponse(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DeleteScopeRequest(_message.Message):
    __slots__ = ("scope",)
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ...) -> None: ...

class DeleteScopeResponse(_message.Message):
    __slots__ = ("memories_deleted", "observations_deleted")
    MEMORIES_DELETED_FIELD_NUMBER: _ClassVar[int]
    OBSERVATIONS_DELETED_FIELD_NUMBER: _ClassVar[int]
    memories_deleted: int
    observations_deleted: int
    def __init__(self, memories_deleted: _Optional[int] = ..., observations_deleted: _Optional[int] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("scope", "query", "k", "min_score", "mode", "text")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MIN_SCORE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    query: Embedding
    k: int
    min_score: float
    mode: str
    text: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., query: _Optional[_Union[Embedding, _Mapping]] = ..., k: _Optional[int] = ..., min_score: _Optional[float] = ..., mode: _Optional[str] = ..., text: _Optional[str] = ...) -> None: ...

class ScoredMemory(_message.Message):
    __slots__ = ("memory", "score")
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    memory: Memory
    score: float
    def __init__(self, memory: _Optional[_Union[Memory, _Mapping]] = ..., score: _Optional[float] = ...) -> None: ...

class SearchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ScoredMemory]
    def __init__(self, results: _Optional[_Iterable[_Union[ScoredMemory, _Mapping]]] = ...) -> None: ...

class SearchManyRequest(_message.Message):
    __slots__ = ("searches",)
    SEARCHES_FIELD_NUMBER: _ClassVar[int]
    searches: _containers.RepeatedCompositeFieldContainer[SearchRequest]
    def __init__(self, searches: _Optional[_Iterable[_Union[SearchRequest, _Mapping]]] = ...) -> None: ...

class SearchOutcome(_message.Message):
    __slots__ = ("response", "code", "details")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    response: SearchResponse
    code: int
    details: str
    def __init__(self, response: _Optional[_Union[SearchResponse, _Mapping]] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class SearchManyResponse(_message.Message):
    __slots__ = ("outcomes",)
    OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    outcomes: _containers.RepeatedCompositeFieldContainer[SearchOutcome]
    def __init__(self, outcomes: _Optional[_Iterable[_Union[SearchOutcome, _Mapping]]] = ...) -> None: ...

class ObservedMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Observation(_message.Message):
    __slots__ = ("scope", "request_id", "messages", "key", "ended_at")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    scope: Scope
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ObservedMessage]
    key: str
    ended_at: str
    def __init__(self, scope: _Optional[_Union[Scope, _Mapping]] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ObservedMessage, _Mapping]]] = ..., key: _Optional[str] = ..., ended_at: _Optional[str] = ...) -> None: ...

class QueueObservationsRequest(_message.Message):
    __slots__ = ("observations",)
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    observations: _containers.RepeatedCompositeFieldContainer[Observation]
    def __init__(self, observations: _Optional[_Iterable[_Union[Observation, _Mapping]]] = ...) -> None: ...

class QueuedObservation(_message.Message):
    __slots__ = ("request_id", "org_id", "id", "queued_now", "key", "refused")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_NOW_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    org_id: str
    id: str
    queued_now: bool
    key: str
    refused: str
    def __init__(self, request_id: _Optional[str] = ..., org_id: _Optional[str] = ..., id: _Optional[str] = ..., queued_now: _Optional[bool] = ..., key: _Optional[str] = ..., refused: _Optional[str] = ...) -> None: ...

class QueueObservationsResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: _containers.RepeatedCompositeFieldContainer[QueuedObservation]
    def __init__(self, queued: _Optional[_Iterable[_Union[QueuedObservation, _Mapping]]] = ...) -> None: ...

class ClaimObservationsRequest(_message.Message):
    __slots__ = ("owner", "limit", "lease_seconds")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    owner: str
    limit: int
    lease_seconds: float
    def __init__(self, owner: _Optional[str] = ..., limit: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ClaimedObservation(_message.Message):
    __slots__ = ("id", "scope", "request_id", "messages", "attempts", "lease_expires_at", "lease_token")
    ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    id: str
    scope: Scope
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ObservedMessage]
    attempts: int
    lease_expires_at: str
    lease_token: str
    def __init__(self, id: _Optional[str] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ..., request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ObservedMessage, _Mapping]]] = ..., attempts: _Optional[int] = ..., lease_expires_at: _Optional[str] = ..., lease_token: _Optional[str] = ...) -> None: ...

class ClaimObservationsResponse(_message.Message):
    __slots__ = ("observations",)
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    observations: _containers.RepeatedCompositeFieldContainer[ClaimedObservation]
    def __init__(self, observations: _Optional[_Iterable[_Union[ClaimedObservation, _Mapping]]] = ...) -> None: ...

class CompleteObservationRequest(_message.Message):
    __slots__ = ("org_id", "id", "owner", "lease_token")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    id: str
    owner: str
    lease_token: str
    def __init__(self, org_id: _Optional[str] = ..., id: _Optional[str] = ..., owner: _Optional[str] = ..., lease_token: _Optional[str] = ...) -> None: ...

class CompleteObservationResponse(_message.Message):
    __slots__ = ("completed",)
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    completed: bool
    def __init__(self, completed: _Optional[bool] = ...) -> None: ...

class ReleaseObservationRequest(_message.Message):
    __slots__ = ("org_id", "id", "owner", "retry_after_seconds", "count_attempt", "failed", "reason", "lease_token")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    id: str
    owner: str
    retry_after_seconds: float
    count_attempt: bool
    failed: bool
    reason: str
    lease_token: str
    def __init__(self, org_id: _Optional[str] = ..., id: _Optional[str] = ..., owner: _Optional[str] = ..., retry_after_seconds: _Optional[float] = ..., count_attempt: _Optional[bool] = ..., failed: _Optional[bool] = ..., reason: _Optional[str] = ..., lease_token: _Optional[str] = ...) -> None: ...

class ReleaseObservationResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewObservationLeaseRequest(_message.Message):
    __slots__ = ("org_id", "id", "owner", "lease_token", "lease_seconds")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    id: str
    owner: str
    lease_token: str
    lease_seconds: float
    def __init__(self, org_id: _Optional[str] = ..., id: _Optional[str] = ..., owner: _Optional[str] = ..., lease_token: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class ExtractedMemory(_message.Message):
    __slots__ = ("content", "embedding")
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    content: str
    embedding: Embedding
    def __init__(self, content: _Optional[str] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class StoreObservationRequest(_message.Message):
    __slots__ = ("org_id", "id", "owner", "lease_token", "lease_seconds", "scope", "request_id", "memories", "dedupe_score")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    DEDUPE_SCORE_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    id: str
    owner: str
    lease_token: str
    lease_seconds: float
    scope: Scope
    request_id: str
    memories: _containers.RepeatedCompositeFieldContainer[ExtractedMemory]
    dedupe_score: float
    def __init__(self, org_id: _Optional[str] = ..., id: _Optional[str] = ..., owner: _Optional[str] = ..., lease_token: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., scope: _Optional[_Union[Scope, _Mapping]] = ..., request_id: _Optional[str] = ..., memories: _Optional[_Iterable[_Union[ExtractedMemory, _Mapping]]] = ..., dedupe_score: _Optional[float] = ...) -> None: ...

class StoreObservationResponse(_message.Message):
    __slots__ = ("stored", "added_ids", "updated")
    STORED_FIELD_NUMBER: _ClassVar[int]
    ADDED_IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    added_ids: _containers.RepeatedScalarFieldContainer[str]
    updated: int
    def __init__(self, stored: _Optional[bool] = ..., added_ids: _Optional[_Iterable[str]] = ..., updated: _Optional[int] = ...) -> None: ...

class RenewObservationLeaseResponse(_message.Message):
    __slots__ = ("renewed", "lease_expires_at")
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    renewed: bool
    lease_expires_at: str
    def __init__(self, renewed: _Optional[bool] = ..., lease_expires_at: _Optional[str] = ...) -> None: ...
