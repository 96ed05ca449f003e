from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ValidateTokenRequest(_message.Message):
    __slots__ = ("access_token",)
    ACCESS_TOKEN_FIELD_NUMBER: _ClassVar[int]
    access_token: str
    def __init__(self, access_token: _Optional[str] = ...) -> None: ...

class ValidateTokenResponse(_message.Message):
    __slots__ = ("org_id", "permissions", "agent_id", "user_id", "token_id", "expires_at", "org_limits", "org_budget", "org_memory_settings")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    ORG_LIMITS_FIELD_NUMBER: _ClassVar[int]
    ORG_BUDGET_FIELD_NUMBER: _ClassVar[int]
    ORG_MEMORY_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    permissions: int
    agent_id: str
    user_id: str
    token_id: str
    expires_at: str
    org_limits: Limits
    org_budget: Budget
    org_memory_settings: MemorySettings
    def __init__(self, org_id: _Optional[str] = ..., permissions: _Optional[int] = ..., agent_id: _Optional[str] = ..., user_id: _Optional[str] = ..., token_id: _Optional[str] = ..., expires_at: _Optional[str] = ..., org_limits: _Optional[_Union[Limits, _Mapping]] = ..., org_budget: _Optional[_Union[Budget, _Mapping]] = ..., org_memory_settings: _Optional[_Union[MemorySettings, _Mapping]] = ...) -> None: ...

class ValidateAgentRequest(_message.Message):
    __slots__ = ("agent_id", "org_id")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    org_id: str
    def __init__(self, agent_id: _Optional[str] = ..., org_id: _Optional[str] = ...) -> None: ...

class ValidateAgentResponse(_message.Message):
    __slots__ = ("agent_id", "org_id", "status", "agent_limits", "agent_budget", "agent_memory_settings")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    AGENT_LIMITS_FIELD_NUMBER: _ClassVar[int]
    AGENT_BUDGET_FIELD_NUMBER: _ClassVar[int]
    AGENT_MEMORY_SETTINGS_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    org_id: str
    status: str
    agent_limits: Limits
    agent_budget: Budget
    agent_memory_settings: MemorySettings
    def __init__(self, agent_id: _Optional[str] = ..., org_id: _Optional[str] = ..., status: _Optional[str] = ..., agent_limits: _Optional[_Union[Limits, _Mapping]] = ..., agent_budget: _Optional[_Union[Budget, _Mapping]] = ..., agent_memory_settings: _Optional[_Union[MemorySettings, _Mapping]] = ...) -> None: ...

class Budget(_message.Message):
    __slots__ = ("nano_usd", "period", "version")
    NANO_USD_FIELD_NUMBER: _ClassVar[int]
    PERIOD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    nano_usd: int
    period: str
    version: int
    def __init__(self, nano_usd: _Optional[int] = ..., period: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class MemorySettings(_message.Message):
    __slots__ = ("recall", "observe", "version", "observe_mode")
    RECALL_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OBSERVE_MODE_FIELD_NUMBER: _ClassVar[int]
    recall: bool
    observe: bool
    version: int
    observe_mode: str
    def __init__(self, recall: _Optional[bool] = ..., observe: _Optional[bool] = ..., version: _Optional[int] = ..., observe_mode: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("rpm", "tpm", "max_output_tokens", "version")
    RPM_FIELD_NUMBER: _ClassVar[int]
    TPM_FIELD_NUMBER: _ClassVar[int]
    MAX_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rpm: int
    tpm: int
    max_output_tokens: int
    version: int
    def __init__(self, rpm: _Optional[int] = ..., tpm: _Optional[int] = ..., max_output_tokens: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class CreateTokenRequest(_message.Message):
    __slots__ = ("name", "permissions", "agent_id", "expires_in_seconds")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    permissions: int
    agent_id: str
    expires_in_seconds: int
    def __init__(self, name: _Optional[str] = ..., permissions: _Optional[int] = ..., agent_id: _Optional[str] = ..., expires_in_seconds: _Optional[int] = ...) -> None: ...

class CreateTokenResponse(_message.Message):
    __slots__ = ("token", "info")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    token: str
    info: TokenInfo
    def __init__(self, token: _Optional[str] = ..., info: _Optional[_Union[TokenInfo, _Mapping]] = ...) -> None: ...

class RevokeTokenRequest(_message.Message):
    __slots__ = ("token_id",)
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    def __init__(self, token_id: _Optional[str] = ...) -> None: ...

class RevokeTokenResponse(_message.Message):
    __slots__ = ("token_id", "revoked")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    revoked: bool
    def __init__(self, token_id: _Optional[str] = ..., revoked: _Optional[bool] = ...) -> None: ...

class ListTokensRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTokensResponse(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[TokenInfo]
    def __init__(self, tokens: _Optional[_Iterable[_Union[TokenInfo, _Mapping]]] = ...) -> None: ...

class TokenInfo(_message.Message):
    __slots__ = ("token_id", "org_id", "name", "agent_id", "user_id", "permissions", "expires_at", "revoked", "created_at")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    PERMISSIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    token_id: str
    org_id: str
    name: str
    agent_id: str
    user_id: str
    permissions: int
    expires_at: str
    revoked: bool
    created_at: str
    def __init__(self, token_id: _Optional[str] = ..., org_id: _Optional[str] = ..., name: _Optional[str] = ..., agent_id: _Optional[str] = ..., user_id: _Optional[str] = ..., permissions: _Optional[int] = ..., expires_at: _Optional[str] = ..., revoked: _Optional[bool] = ..., created_at: _Optional[str] = ...) -> None: ...

class WatchChangesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Change(_message.Message):
    __slots__ = ("known_token_ids", "snapshot_complete", "token_changed", "agent_changed", "heartbeat", "limits_changed", "budget_changed", "memory_settings_changed")
    KNOWN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_CHANGED_FIELD_NUMBER: _ClassVar[int]
    AGENT_CHANGED_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    BUDGET_CHANGED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_SETTINGS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    known_token_ids: bytes
    snapshot_complete: SnapshotComplete
    token_changed: bytes
    agent_changed: bytes
    heartbeat: Heartbeat
    limits_changed: LimitsChanged
    budget_changed: BudgetChanged
    memory_settings_changed: MemorySettingsChanged
    def __init__(self, known_token_ids: _Optional[bytes] = ..., snapshot_complete: _Optional[_Union[SnapshotComplete, _Mapping]] = ..., token_changed: _Optional[bytes] = ..., agent_changed: _Optional[bytes] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., limits_changed: _Optional[_Union[LimitsChanged, _Mapping]] = ..., budget_changed: _Optional[_Union[BudgetChanged, _Mapping]] = ..., memory_settings_changed: _Optional[_Union[MemorySettingsChanged, _Mapping]] = ...) -> None: ...

class MemorySettingsChanged(_message.Message):
    __slots__ = ("org_id", "agent_id", "settings")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    org_id: bytes
    agent_id: bytes
    settings: MemorySettings
    def __init__(self, org_id: _Optional[bytes] = ..., agent_id: _Optional[bytes] = ..., settings: _Optional[_Union[MemorySettings, _Mapping]] = ...) -> None: ...

class BudgetChanged(_message.Message):
    __slots__ = ("org_id", "agent_id", "budget")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    BUDGET_FIELD_NUMBER: _ClassVar[int]
    org_id: bytes
    agent_id: bytes
    budget: Budget
    def __init__(self, org_id: _Optional[bytes] = ..., agent_id: _Optional[bytes] = ..., budget: _Optional[_Union[Budget, _Mapping]] = ...) -> None: ...

class UsageRow(_message.Message):
    __slots__ = ("request_id", "org_id", "agent_id", "token_id", "model_requested", "model", "provider", "upstream_model", "stream", "outcome", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "tokens_from", "cost_nano_usd", "price_version", "started_at_us", "duration_us", "ledger_id", "kind", "parent_request_id", "memories", "cache_write_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROVIDER_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_MODEL_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FROM_FIELD_NUMBER: _ClassVar[int]
    COST_NANO_USD_FIELD_NUMBER: _ClassVar[int]
    PRICE_VERSION_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_US_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PARENT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORIES_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    org_id: str
    agent_id: str
    token_id: str
    model_requested: str
    model: str
    provider: str
    upstream_model: str
    stream: bool
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    tokens_from: str
    cost_nano_usd: int
    price_version: str
    started_at_us: int
    duration_us: int
    ledger_id: str
    kind: str
    parent_request_id: str
    memories: int
    cache_write_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., org_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., token_id: _Optional[str] = ..., model_requested: _Optional[str] = ..., model: _Optional[str] = ..., provider: _Optional[str] = ..., upstream_model: _Optional[str] = ..., stream: _Optional[bool] = ..., outcome: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., tokens_from: _Optional[str] = ..., cost_nano_usd: _Optional[int] = ..., price_version: _Optional[str] = ..., started_at_us: _Optional[int] = ..., duration_us: _Optional[int] = ..., ledger_id: _Optional[str] = ..., kind: _Optional[str] = ..., parent_request_id: _Optional[str] = ..., memories: _Optional[int] = ..., cache_write_tokens: _Optional[int] = ...) -> None: ...

class RecordUsageRequest(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: _containers.RepeatedCompositeFieldContainer[UsageRow]
    def __init__(self, rows: _Optional[_Iterable[_Union[UsageRow, _Mapping]]] = ...) -> None: ...

class RecordUsageResponse(_message.Message):
    __slots__ = ("recorded", "duplicates", "rejected")
    RECORDED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    recorded: int
    duplicates: int
    rejected: _containers.RepeatedCompositeFieldContainer[RejectedUsageRow]
    def __init__(self, recorded: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[RejectedUsageRow, _Mapping]]] = ...) -> None: ...

class RejectedUsageRow(_message.Message):
    __slots__ = ("index", "reason", "detail")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    index: int
    reason: str
    detail: str
    def __init__(self, index: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class GetSpendRequest(_message.Message):
    __slots__ = ("org_id", "agent_id", "since_unix", "until_unix")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    UNTIL_UNIX_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    agent_id: str
    since_unix: int
    until_unix: int
    def __init__(self, org_id: _Optional[str] = ..., agent_id: _Optional[str] = ..., since_unix: _Optional[int] = ..., until_unix: _Optional[int] = ...) -> None: ...

class GetSpendResponse(_message.Message):
    __slots__ = ("cost_nano_usd",)
    COST_NANO_USD_FIELD_NUMBER: _ClassVar[int]
    cost_nano_usd: int
    def __init__(self, cost_nano_usd: _Optional[int] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ("agent_id", "since", "until", "by")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    since: str
    until: str
    by: str
    def __init__(self, agent_id: _Optional[str] = ..., since: _Optional[str] = ..., until: _Optional[str] = ..., by: _Optional[str] = ...) -> None: ...

class UsageSum(_message.Message):
    __slots__ = ("key", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "reasoning_tokens", "cost_usd", "cache_write_tokens")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASONING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_USD_FIELD_NUMBER: _ClassVar[int]
    CACHE_WRITE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    key: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int
    cost_usd: str
    cache_write_tokens: int
    def __init__(self, key: _Optional[str] = ..., requests: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., reasoning_tokens: _Optional[int] = ..., cost_usd: _Optional[str] = ..., cache_write_tokens: _Optional[int] = ...) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("org_id", "since", "until", "by", "rows", "total")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    org_id: str
    since: str
    until: str
    by: str
    rows: _containers.RepeatedCompositeFieldContainer[UsageSum]
    total: UsageSum
    def __init__(self, org_id: _Optional[str] = ..., since: _Optional[str] = ..., until: _Optional[str] = ..., by: _Optional[str] = ..., rows: _Optional[_Iterable[_Union[UsageSum, _Mapping]]] = ..., total: _Optional[_Union[UsageSum, _Mapping]] = ...) -> None: ...

class LimitsChanged(_message.Message):
    __slots__ = ("org_id", "agent_id", "limits")
    ORG_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    org_id: bytes
    agent_id: bytes
    limits: Limits
    def __init__(self, org_id: _Optional[bytes] = ..., agent_id: _Optional[bytes] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class SnapshotComplete(_message.Message):
    __slots__ = ("token_count",)
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    token_count: int
    def __init__(self, token_count: _Optional[int] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
