from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_UNSPECIFIED: _ClassVar[Transport]
    TRANSPORT_SHM: _ClassVar[Transport]
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_CUDA_IPC: _ClassVar[Transport]

class BlockStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_STATUS_UNSPECIFIED: _ClassVar[BlockStatus]
    BLOCK_STATUS_RESERVED: _ClassVar[BlockStatus]
    BLOCK_STATUS_PRESENT: _ClassVar[BlockStatus]
    BLOCK_STATUS_IN_PROGRESS: _ClassVar[BlockStatus]
    BLOCK_STATUS_NOT_ADMITTED: _ClassVar[BlockStatus]
    BLOCK_STATUS_NO_SPACE: _ClassVar[BlockStatus]

class BlockOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BLOCK_ORDER_RECENCY: _ClassVar[BlockOrder]
    BLOCK_ORDER_HITS: _ClassVar[BlockOrder]
TRANSPORT_UNSPECIFIED: Transport
TRANSPORT_SHM: Transport
TRANSPORT_INLINE: Transport
TRANSPORT_CUDA_IPC: Transport
BLOCK_STATUS_UNSPECIFIED: BlockStatus
BLOCK_STATUS_RESERVED: BlockStatus
BLOCK_STATUS_PRESENT: BlockStatus
BLOCK_STATUS_IN_PROGRESS: BlockStatus
BLOCK_STATUS_NOT_ADMITTED: BlockStatus
BLOCK_STATUS_NO_SPACE: BlockStatus
BLOCK_ORDER_RECENCY: BlockOrder
BLOCK_ORDER_HITS: BlockOrder

class Hello(_message.Message):
    __slots__ = ("engine_name", "pid", "hostname")
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    engine_name: str
    pid: int
    hostname: str
    def __init__(self, engine_name: _Optional[str] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("hello", "heartbeat")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    heartbeat: Heartbeat
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("pool_id", "shm_path", "size_bytes", "page_size", "cuda_registered")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CUDA_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    shm_path: str
    size_bytes: int
    page_size: int
    cuda_registered: bool
    def __init__(self, pool_id: _Optional[str] = ..., shm_path: _Optional[str] = ..., size_bytes: _Optional[int] = ..., page_size: _Optional[int] = ..., cuda_registered: _Optional[bool] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "pool", "server_version", "limits", "data_socket")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    pool: PoolInfo
    server_version: str
    limits: Limits
    data_socket: str
    def __init__(self, session_id: _Optional[str] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., server_version: _Optional[str] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., data_socket: _Optional[str] = ...) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_batch_blocks", "max_message_bytes", "lease_ttl_ms", "max_namespaces")
    MAX_BATCH_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    max_batch_blocks: int
    max_message_bytes: int
    lease_ttl_ms: int
    max_namespaces: int
    def __init__(self, max_batch_blocks: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., lease_ttl_ms: _Optional[int] = ..., max_namespaces: _Optional[int] = ...) -> None: ...

class NamespaceSpec(_message.Message):
    __slots__ = ("model_id", "tokens_per_block", "kv_dtype", "layout", "num_layers", "num_kv_heads", "head_size", "block_bytes", "chunk_bytes", "tp_size", "tp_rank", "hash_algorithm", "hash_seed", "hash_bytes", "extra", "pp_size", "pp_rank")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    HASH_SEED_FIELD_NUMBER: _ClassVar[int]
    HASH_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokens_per_block: int
    kv_dtype: str
    layout: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_bytes: int
    chunk_bytes: _containers.RepeatedScalarFieldContainer[int]
    tp_size: int
    tp_rank: int
    hash_algorithm: str
    hash_seed: str
    hash_bytes: int
    extra: _containers.ScalarMap[str, str]
    pp_size: int
    pp_rank: int
    def __init__(self, model_id: _Optional[str] = ..., tokens_per_block: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., layout: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_size: _Optional[int] = ..., block_bytes: _Optional[int] = ..., chunk_bytes: _Optional[_Iterable[int]] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., hash_algorithm: _Optional[str] = ..., hash_seed: _Optional[str] = ..., hash_bytes: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ..., pp_size: _Optional[int] = ..., pp_rank: _Optional[int] = ...) -> None: ...

class CudaAllocation(_message.Message):
    __slots__ = ("ipc_handle", "size_bytes", "offset", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    ipc_handle: bytes
    size_bytes: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, ipc_handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class KVRun(_message.Message):
    __slots__ = ("allocation", "offset", "block_stride", "size_bytes")
    ALLOCATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    BLOCK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocation: int
    offset: int
    block_stride: int
    size_bytes: int
    def __init__(self, allocation: _Optional[int] = ..., offset: _Optional[int] = ..., block_stride: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class CudaKVCache(_message.Message):
    __slots__ = ("device_uuid", "allocations", "runs", "num_blocks", "ready_events")
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    allocations: _containers.RepeatedCompositeFieldContainer[CudaAllocation]
    runs: _containers.RepeatedCompositeFieldContainer[KVRun]
    num_blocks: int
    ready_events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, device_uuid: _Optional[str] = ..., allocations: _Optional[_Iterable[_Union[CudaAllocation, _Mapping]]] = ..., runs: _Optional[_Iterable[_Union[KVRun, _Mapping]]] = ..., num_blocks: _Optional[int] = ..., ready_events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("session_id", "spec", "cuda_kv", "monotonic_ns", "replaces")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CUDA_KV_FIELD_NUMBER: _ClassVar[int]
    MONOTONIC_NS_FIELD_NUMBER: _ClassVar[int]
    REPLACES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: NamespaceSpec
    cuda_kv: CudaKVCache
    monotonic_ns: int
    replaces: str
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., cuda_kv: _Optional[_Union[CudaKVCache, _Mapping]] = ..., monotonic_ns: _Optional[int] = ..., replaces: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("namespace", "block_bytes", "pages_per_block", "cuda_registration", "cuda_refused")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGES_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    CUDA_REGISTRATION_FIELD_NUMBER: _ClassVar[int]
    CUDA_REFUSED_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    block_bytes: int
    pages_per_block: int
    cuda_registration: str
    cuda_refused: str
    def __init__(self, namespace: _Optional[str] = ..., block_bytes: _Optional[int] = ..., pages_per_block: _Optional[int] = ..., cuda_registration: _Optional[str] = ..., cuda_refused: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "hashes", "pin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    hashes: bytes
    pin: bool
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ..., hashes: _Optional[bytes] = ..., pin: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("hit_count", "lease_id", "page_ids", "lease_ttl_ms", "checksums")
    HIT_COUNT_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    hit_count: int
    lease_id: int
    page_ids: bytes
    lease_ttl_ms: int
    checksums: bytes
    def __init__(self, hit_count: _Optional[int] = ..., lease_id: _Optional[int] = ..., page_ids: _Optional[bytes] = ..., lease_ttl_ms: _Optional[int] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class LookupBatchRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "queries", "pin")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    queries: _containers.RepeatedScalarFieldContainer[bytes]
    pin: bool
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ..., queries: _Optional[_Iterable[bytes]] = ..., pin: _Optional[bool] = ...) -> None: ...

class LookupBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LookupResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[LookupResponse, _Mapping]]] = ...) -> None: ...

class CudaIpcTarget(_message.Message):
    __slots__ = ("registration_id", "device_block_ids", "deadline_ns", "ready_event")
    REGISTRATION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_NS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    registration_id: str
    device_block_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_ns: int
    ready_event: int
    def __init__(self, registration_id: _Optional[str] = ..., device_block_ids: _Optional[_Iterable[int]] = ..., deadline_ns: _Optional[int] = ..., ready_event: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "lease_id", "hashes", "transport", "cuda_ipc")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    lease_id: int
    hashes: bytes
    transport: Transport
    cuda_ipc: CudaIpcTarget
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ..., lease_id: _Optional[int] = ..., hashes: _Optional[bytes] = ..., transport: _Optional[_Union[Transport, str]] = ..., cuda_ipc: _Optional[_Union[CudaIpcTarget, _Mapping]] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("block_count", "data", "lease_id", "page_ids", "checksums")
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    block_count: int
    data: bytes
    lease_id: int
    page_ids: bytes
    checksums: bytes
    def __init__(self, block_count: _Optional[int] = ..., data: _Optional[bytes] = ..., lease_id: _Optional[int] = ..., page_ids: _Optional[bytes] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "lease_id", "more_lease_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MORE_LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_id: int
    more_lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., more_lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "hashes", "transport", "cuda_ipc")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: str
    hashes: bytes
    transport: Transport
    cuda_ipc: CudaIpcTarget
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[str] = ..., hashes: _Optional[bytes] = ..., transport: _Optional[_Union[Transport, str]] = ..., cuda_ipc: _Optional[_Union[CudaIpcTarget, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "status", "page_ids", "lease_ttl_ms", "committed_count")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    status: _containers.RepeatedScalarFieldContainer[BlockStatus]
    page_ids: bytes
    lease_ttl_ms: int
    committed_count: int
    def __init__(self, reservation_id: _Optional[int] = ..., status: _Optional[_Iterable[_Union[BlockStatus, str]]] = ..., page_ids: _Optional[bytes] = ..., lease_ttl_ms: _Optional[int] = ..., committed_count: _Optional[int] = ...) -> None: ...

class WriteRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id", "index", "offset", "data")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    index: int
    offset: int
    data: bytes
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class WriteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id", "data", "checksums")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    data: bytes
    checksums: bytes
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ..., data: _Optional[bytes] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed_count",)
    COMMITTED_COUNT_FIELD_NUMBER: _ClassVar[int]
    committed_count: int
    def __init__(self, committed_count: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("session_id", "reservation_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reservation_id: int
    def __init__(self, session_id: _Optional[str] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetInfoResponse(_message.Message):
    __slots__ = ("version", "pool", "config", "started_at", "socket_path", "tcp_listen", "metrics_port", "limits")
    class ConfigEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    TCP_LISTEN_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    version: str
    pool: PoolInfo
    config: _containers.ScalarMap[str, str]
    started_at: float
    socket_path: str
    tcp_listen: str
    metrics_port: int
    limits: Limits
    def __init__(self, version: _Optional[str] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., config: _Optional[_Mapping[str, str]] = ..., started_at: _Optional[float] = ..., socket_path: _Optional[str] = ..., tcp_listen: _Optional[str] = ..., metrics_port: _Optional[int] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "blocks", "bytes", "capacity_bytes", "hits", "misses", "hit_ratio", "evictions", "checksum_failures", "io_errors", "stores_paused", "stored_blocks", "loaded_blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    HIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    IO_ERRORS_FIELD_NUMBER: _ClassVar[int]
    STORES_PAUSED_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: str
    blocks: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int
    hit_ratio: float
    evictions: int
    checksum_failures: int
    io_errors: int
    stores_paused: bool
    stored_blocks: int
    loaded_blocks: int
    def __init__(self, tier: _Optional[str] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., hit_ratio: _Optional[float] = ..., evictions: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., io_errors: _Optional[int] = ..., stores_paused: _Optional[bool] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "model_id", "tiers")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    model_id: str
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    def __init__(self, namespace: _Optional[str] = ..., model_id: _Optional[str] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "reserved_bytes", "pinned_blocks", "engines_connected", "pool_used_bytes")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    reserved_bytes: int
    pinned_blocks: int
    engines_connected: int
    pool_used_bytes: int
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., reserved_bytes: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., engines_connected: _Optional[int] = ..., pool_used_bytes: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace", "spec", "blocks", "bytes", "engines", "created_at")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    spec: NamespaceSpec
    blocks: int
    bytes: int
    engines: int
    created_at: float
    def __init__(self, namespace: _Optional[str] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., engines: _Optional[int] = ..., created_at: _Optional[float] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class BlockInfo(_message.Message):
    __slots__ = ("namespace", "hash", "tier", "size_bytes", "hits", "created_at", "last_access_at", "pins")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACCESS_AT_FIELD_NUMBER: _ClassVar[int]
    PINS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hash: bytes
    tier: str
    size_bytes: int
    hits: int
    created_at: float
    last_access_at: float
    pins: int
    def __init__(self, namespace: _Optional[str] = ..., hash: _Optional[bytes] = ..., tier: _Optional[str] = ..., size_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., created_at: _Optional[float] = ..., last_access_at: _Optional[float] = ..., pins: _Optional[int] = ...) -> None: ...

class ListBlocksRequest(_message.Message):
    __slots__ = ("namespace", "order", "page_size", "page_token", "tier")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ORDER_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    order: BlockOrder
    page_size: int
    page_token: str
    tier: str
    def __init__(self, namespace: _Optional[str] = ..., order: _Optional[_Union[BlockOrder, str]] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., tier: _Optional[str] = ...) -> None: ...

class ListBlocksResponse(_message.Message):
    __slots__ = ("blocks", "next_page_token", "total")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockInfo]
    next_page_token: str
    total: int
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., total: _Optional[int] = ...) -> None: ...

class InspectBlockRequest(_message.Message):
    __slots__ = ("namespace", "hash", "tier")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASH_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hash: bytes
    tier: str
    def __init__(self, namespace: _Optional[str] = ..., hash: _Optional[bytes] = ..., tier: _Optional[str] = ...) -> None: ...

class InspectBlockResponse(_message.Message):
    __slots__ = ("block", "page_ids", "checksum_xxh3", "stored_checksum", "checksum")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_XXH3_FIELD_NUMBER: _ClassVar[int]
    STORED_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block: BlockInfo
    page_ids: bytes
    checksum_xxh3: str
    stored_checksum: int
    checksum: int
    def __init__(self, block: _Optional[_Union[BlockInfo, _Mapping]] = ..., page_ids: _Optional[bytes] = ..., checksum_xxh3: _Optional[str] = ..., stored_checksum: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class DeleteBlocksRequest(_message.Message):
    __slots__ = ("namespace", "hashes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    hashes: bytes
    def __init__(self, namespace: _Optional[str] = ..., hashes: _Optional[bytes] = ...) -> None: ...

class DeleteBlocksResponse(_message.Message):
    __slots__ = ("deleted_count",)
    DELETED_COUNT_FIELD_NUMBER: _ClassVar[int]
    deleted_count: int
    def __init__(self, deleted_count: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace", "all")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    all: bool
    def __init__(self, namespace: _Optional[str] = ..., all: _Optional[bool] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("deleted_count",)
    DELETED_COUNT_FIELD_NUMBER: _ClassVar[int]
    deleted_count: int
    def __init__(self, deleted_count: _Optional[int] = ...) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("session_id", "engine_name", "pid", "hostname", "peer", "connected_at", "namespaces", "lookups", "hit_blocks", "miss_blocks", "stored_blocks", "loaded_blocks", "stored_bytes", "loaded_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_AT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_name: str
    pid: int
    hostname: str
    peer: str
    connected_at: float
    namespaces: _containers.RepeatedScalarFieldContainer[str]
    lookups: int
    hit_blocks: int
    miss_blocks: int
    stored_blocks: int
    loaded_blocks: int
    stored_bytes: int
    loaded_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., engine_name: _Optional[str] = ..., pid: _Optional[int] = ..., hostname: _Optional[str] = ..., peer: _Optional[str] = ..., connected_at: _Optional[float] = ..., namespaces: _Optional[_Iterable[str]] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., loaded_bytes: _Optional[int] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineInfo]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineInfo, _Mapping]]] = ...) -> None: ...
