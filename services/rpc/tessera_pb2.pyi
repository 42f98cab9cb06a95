from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkInput(_message.Message):
    __slots__ = ("text", "tokens", "chunk_id", "namespace")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: TokenIds
    chunk_id: str
    namespace: str
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., chunk_id: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_new_tokens", "stop_token_ids", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class DecodePolicy(_message.Message):
    __slots__ = ("name", "budget_tokens", "dense_layers", "retro_window", "retrieval_k", "sink_tokens", "window_tokens")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DENSE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    RETRO_WINDOW_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_K_FIELD_NUMBER: _ClassVar[int]
    SINK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    name: str
    budget_tokens: int
    dense_layers: int
    retro_window: int
    retrieval_k: int
    sink_tokens: int
    window_tokens: int
    def __init__(self, name: _Optional[str] = ..., budget_tokens: _Optional[int] = ..., dense_layers: _Optional[int] = ..., retro_window: _Optional[int] = ..., retrieval_k: _Optional[int] = ..., sink_tokens: _Optional[int] = ..., window_tokens: _Optional[int] = ...) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("policy", "steps", "pages_visible", "pages_read", "pages_corrected", "keys_scanned", "retrieval_seconds")
    POLICY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PAGES_VISIBLE_FIELD_NUMBER: _ClassVar[int]
    PAGES_READ_FIELD_NUMBER: _ClassVar[int]
    PAGES_CORRECTED_FIELD_NUMBER: _ClassVar[int]
    KEYS_SCANNED_FIELD_NUMBER: _ClassVar[int]
    RETRIEVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    policy: str
    steps: int
    pages_visible: int
    pages_read: int
    pages_corrected: int
    keys_scanned: int
    retrieval_seconds: float
    def __init__(self, policy: _Optional[str] = ..., steps: _Optional[int] = ..., pages_visible: _Optional[int] = ..., pages_read: _Optional[int] = ..., pages_corrected: _Optional[int] = ..., keys_scanned: _Optional[int] = ..., retrieval_seconds: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("chunks", "suffix_text", "suffix_tokens", "sampling", "mode", "recompute_ratio", "request_id", "decode")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TEXT_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkInput]
    suffix_text: str
    suffix_tokens: TokenIds
    sampling: SamplingParams
    mode: str
    recompute_ratio: float
    request_id: str
    decode: DecodePolicy
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkInput, _Mapping]]] = ..., suffix_text: _Optional[str] = ..., suffix_tokens: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., mode: _Optional[str] = ..., recompute_ratio: _Optional[float] = ..., request_id: _Optional[str] = ..., decode: _Optional[_Union[DecodePolicy, _Mapping]] = ...) -> None: ...

class RequestStats(_message.Message):
    __slots__ = ("chunk_tokens_by_tier", "recomputed_tokens", "prompt_tokens", "output_tokens", "queue_seconds", "prefill_seconds", "load_wait_seconds", "loaded_bytes", "handoff_bytes", "transport", "prefill_worker", "decode_worker", "recompute_ratio", "chunk_ids", "load_seconds", "first_token_seconds", "handoff_seconds", "chunk_compute_seconds", "forward_seconds", "decode")
    class ChunkTokensByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CHUNK_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    chunk_tokens_by_tier: _containers.ScalarMap[str, int]
    recomputed_tokens: int
    prompt_tokens: int
    output_tokens: int
    queue_seconds: float
    prefill_seconds: float
    load_wait_seconds: float
    loaded_bytes: int
    handoff_bytes: int
    transport: str
    prefill_worker: str
    decode_worker: str
    recompute_ratio: float
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    load_seconds: float
    first_token_seconds: float
    handoff_seconds: float
    chunk_compute_seconds: float
    forward_seconds: float
    decode: DecodeStats
    def __init__(self, chunk_tokens_by_tier: _Optional[_Mapping[str, int]] = ..., recomputed_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., output_tokens: _Optional[int] = ..., queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., load_wait_seconds: _Optional[float] = ..., loaded_bytes: _Optional[int] = ..., handoff_bytes: _Optional[int] = ..., transport: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., recompute_ratio: _Optional[float] = ..., chunk_ids: _Optional[_Iterable[str]] = ..., load_seconds: _Optional[float] = ..., first_token_seconds: _Optional[float] = ..., handoff_seconds: _Optional[float] = ..., chunk_compute_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., decode: _Optional[_Union[DecodeStats, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    stats: RequestStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ...) -> None: ...

class RegisterChunksRequest(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkInput]
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkInput, _Mapping]]] = ...) -> None: ...

class RegisteredChunk(_message.Message):
    __slots__ = ("chunk_id", "num_tokens", "stored")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    num_tokens: int
    stored: bool
    def __init__(self, chunk_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., stored: _Optional[bool] = ...) -> None: ...

class RegisterChunksResponse(_message.Message):
    __slots__ = ("chunks",)
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[RegisteredChunk]
    def __init__(self, chunks: _Optional[_Iterable[_Union[RegisteredChunk, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("name", "role", "address", "healthy", "in_flight", "resident_chunks", "metrics_url")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    address: str
    healthy: bool
    in_flight: int
    resident_chunks: int
    metrics_url: str
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., in_flight: _Optional[int] = ..., resident_chunks: _Optional[int] = ..., metrics_url: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_position_embeddings", "transport", "workers", "requests_total", "registered_chunks", "metrics_url", "tenant")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_POSITION_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_position_embeddings: int
    transport: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    requests_total: int
    registered_chunks: int
    metrics_url: str
    tenant: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_position_embeddings: _Optional[int] = ..., transport: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., requests_total: _Optional[int] = ..., registered_chunks: _Optional[int] = ..., metrics_url: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class ResetCachesRequest(_message.Message):
    __slots__ = ("device_only",)
    DEVICE_ONLY_FIELD_NUMBER: _ClassVar[int]
    device_only: bool
    def __init__(self, device_only: _Optional[bool] = ...) -> None: ...

class ResetCachesResponse(_message.Message):
    __slots__ = ("chunks_dropped",)
    CHUNKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    chunks_dropped: int
    def __init__(self, chunks_dropped: _Optional[int] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("name", "in_flight", "resident_chunk_ids", "transport", "metrics_url", "model_fingerprint", "host_id", "device_uuid", "ipc_gpus")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_GPUS_FIELD_NUMBER: _ClassVar[int]
    name: str
    in_flight: int
    resident_chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    transport: str
    metrics_url: str
    model_fingerprint: str
    host_id: str
    device_uuid: str
    ipc_gpus: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., in_flight: _Optional[int] = ..., resident_chunk_ids: _Optional[_Iterable[str]] = ..., transport: _Optional[str] = ..., metrics_url: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., host_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., ipc_gpus: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "chunks", "suffix", "mode", "recompute_ratio", "decode_address", "sampling", "chunk_namespaces", "decode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_RATIO_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunks: _containers.RepeatedCompositeFieldContainer[TokenIds]
    suffix: _containers.RepeatedScalarFieldContainer[int]
    mode: str
    recompute_ratio: float
    decode_address: str
    sampling: SamplingParams
    chunk_namespaces: _containers.RepeatedScalarFieldContainer[str]
    decode: DecodePolicy
    def __init__(self, request_id: _Optional[str] = ..., chunks: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., suffix: _Optional[_Iterable[int]] = ..., mode: _Optional[str] = ..., recompute_ratio: _Optional[float] = ..., decode_address: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., chunk_namespaces: _Optional[_Iterable[str]] = ..., decode: _Optional[_Union[DecodePolicy, _Mapping]] = ...) -> None: ...

class PrefillReply(_message.Message):
    __slots__ = ("first_token", "stats", "resident_chunk_ids", "finish_reason")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    stats: RequestStats
    resident_chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    finish_reason: str
    def __init__(self, first_token: _Optional[int] = ..., stats: _Optional[_Union[RequestStats, _Mapping]] = ..., resident_chunk_ids: _Optional[_Iterable[str]] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class WarmRequest(_message.Message):
    __slots__ = ("chunks", "chunk_namespaces")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[TokenIds]
    chunk_namespaces: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunks: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., chunk_namespaces: _Optional[_Iterable[str]] = ...) -> None: ...

class WarmReply(_message.Message):
    __slots__ = ("stored", "resident_chunk_ids")
    STORED_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[bool]
    resident_chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, stored: _Optional[_Iterable[bool]] = ..., resident_chunk_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("chunk_ids",)
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, chunk_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("kept",)
    KEPT_FIELD_NUMBER: _ClassVar[int]
    kept: int
    def __init__(self, kept: _Optional[int] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("device_only", "chunk_ids")
    DEVICE_ONLY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    device_only: bool
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device_only: _Optional[bool] = ..., chunk_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResetReply(_message.Message):
    __slots__ = ("chunks_dropped",)
    CHUNKS_DROPPED_FIELD_NUMBER: _ClassVar[int]
    chunks_dropped: int
    def __init__(self, chunks_dropped: _Optional[int] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("request_id", "kind", "total_bytes", "crc32", "first_token", "kv", "storing", "nixl")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    STORING_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    kind: str
    total_bytes: int
    crc32: int
    first_token: int
    kv: CudaIpcBuffer
    storing: _containers.RepeatedScalarFieldContainer[str]
    nixl: NixlBuffer
    def __init__(self, request_id: _Optional[str] = ..., kind: _Optional[str] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., first_token: _Optional[int] = ..., kv: _Optional[_Union[CudaIpcBuffer, _Mapping]] = ..., storing: _Optional[_Iterable[str]] = ..., nixl: _Optional[_Union[NixlBuffer, _Mapping]] = ...) -> None: ...

class NixlBuffer(_message.Message):
    __slots__ = ("offer", "dtype", "numel")
    OFFER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    offer: bytes
    dtype: str
    numel: int
    def __init__(self, offer: _Optional[bytes] = ..., dtype: _Optional[str] = ..., numel: _Optional[int] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("dtype", "numel", "storage_handle", "storage_size_bytes", "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "device_index", "tensor_offset", "device_uuid", "slab")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMEL_FIELD_NUMBER: _ClassVar[int]
    STORAGE_HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSOR_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    numel: int
    storage_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    device_index: int
    tensor_offset: int
    device_uuid: str
    slab: bool
    def __init__(self, dtype: _Optional[str] = ..., numel: _Optional[int] = ..., storage_handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., device_index: _Optional[int] = ..., tensor_offset: _Optional[int] = ..., device_uuid: _Optional[str] = ..., slab: _Optional[bool] = ...) -> None: ...

class HandoffPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ("received_bytes",)
    RECEIVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    received_bytes: int
    def __init__(self, received_bytes: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "decode")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: SamplingParams
    decode: DecodePolicy
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode: _Optional[_Union[DecodePolicy, _Mapping]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "stats")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    stats: DecodeStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., stats: _Optional[_Union[DecodeStats, _Mapping]] = ...) -> None: ...
