from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class ChecksumAlgorithm(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHECKSUM_UNSPECIFIED: _ClassVar[ChecksumAlgorithm]
    CHECKSUM_CRC32: _ClassVar[ChecksumAlgorithm]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]
    TIER_ROCKSDB: _ClassVar[Tier]
    TIER_S3: _ClassVar[Tier]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
CHECKSUM_UNSPECIFIED: ChecksumAlgorithm
CHECKSUM_CRC32: ChecksumAlgorithm
TIER_UNSPECIFIED: Tier
TIER_DRAM: Tier
TIER_ROCKSDB: Tier
TIER_S3: Tier

class LayerShape(_message.Message):
    __slots__ = ("k_shape", "v_shape")
    K_SHAPE_FIELD_NUMBER: _ClassVar[int]
    V_SHAPE_FIELD_NUMBER: _ClassVar[int]
    k_shape: _containers.RepeatedScalarFieldContainer[int]
    v_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k_shape: _Optional[_Iterable[int]] = ..., v_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ChunkHeader(_message.Message):
    __slots__ = ("chunk_id", "model_fingerprint", "num_layers", "dtype", "layers", "checksum_algorithm", "layer_checksums", "layer_start", "layer_stop", "tier")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_STOP_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    model_fingerprint: str
    num_layers: int
    dtype: DType
    layers: _containers.RepeatedCompositeFieldContainer[LayerShape]
    checksum_algorithm: ChecksumAlgorithm
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_stop: int
    tier: Tier
    def __init__(self, chunk_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., num_layers: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., layers: _Optional[_Iterable[_Union[LayerShape, _Mapping]]] = ..., checksum_algorithm: _Optional[_Union[ChecksumAlgorithm, str]] = ..., layer_checksums: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_stop: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class LayerFrame(_message.Message):
    __slots__ = ("layer_index", "data", "end_of_layer", "checksum", "padding")
    LAYER_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_OF_LAYER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PADDING_FIELD_NUMBER: _ClassVar[int]
    layer_index: int
    data: bytes
    end_of_layer: bool
    checksum: int
    padding: bytes
    def __init__(self, layer_index: _Optional[int] = ..., data: _Optional[bytes] = ..., end_of_layer: _Optional[bool] = ..., checksum: _Optional[int] = ..., padding: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "frame")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    frame: LayerFrame
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., frame: _Optional[_Union[LayerFrame, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored_bytes", "tiers", "already_stored")
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    stored_bytes: int
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    already_stored: bool
    def __init__(self, stored_bytes: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., already_stored: _Optional[bool] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("chunk_id", "layer_start", "layer_stop", "local_host", "nixl")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_STOP_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HOST_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    layer_start: int
    layer_stop: int
    local_host: str
    nixl: bool
    def __init__(self, chunk_id: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_stop: _Optional[int] = ..., local_host: _Optional[str] = ..., nixl: _Optional[bool] = ...) -> None: ...

class NixlLayers(_message.Message):
    __slots__ = ("agent", "metadata", "descs", "header_descs", "generation")
    AGENT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DESCS_FIELD_NUMBER: _ClassVar[int]
    HEADER_DESCS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    agent: str
    metadata: bytes
    descs: bytes
    header_descs: bytes
    generation: int
    def __init__(self, agent: _Optional[str] = ..., metadata: _Optional[bytes] = ..., descs: _Optional[bytes] = ..., header_descs: _Optional[bytes] = ..., generation: _Optional[int] = ...) -> None: ...

class LocalLayers(_message.Message):
    __slots__ = ("path", "offsets", "generation", "header")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    path: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    header: int
    def __init__(self, path: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ..., header: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "frame", "local", "nixl")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    NIXL_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    frame: LayerFrame
    local: LocalLayers
    nixl: NixlLayers
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., frame: _Optional[_Union[LayerFrame, _Mapping]] = ..., local: _Optional[_Union[LocalLayers, _Mapping]] = ..., nixl: _Optional[_Union[NixlLayers, _Mapping]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("chunk_ids", "local_host")
    CHUNK_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HOST_FIELD_NUMBER: _ClassVar[int]
    chunk_ids: _containers.RepeatedScalarFieldContainer[str]
    local_host: str
    def __init__(self, chunk_ids: _Optional[_Iterable[str]] = ..., local_host: _Optional[str] = ...) -> None: ...

class LocalChunk(_message.Message):
    __slots__ = ("header", "layers")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    header: ChunkHeader
    layers: LocalLayers
    def __init__(self, header: _Optional[_Union[ChunkHeader, _Mapping]] = ..., layers: _Optional[_Union[LocalLayers, _Mapping]] = ...) -> None: ...

class ChunkLocation(_message.Message):
    __slots__ = ("chunk_id", "found", "tiers", "nbytes", "local")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    found: bool
    tiers: _containers.RepeatedScalarFieldContainer[Tier]
    nbytes: int
    local: LocalChunk
    def __init__(self, chunk_id: _Optional[str] = ..., found: _Optional[bool] = ..., tiers: _Optional[_Iterable[_Union[Tier, str]]] = ..., nbytes: _Optional[int] = ..., local: _Optional[_Union[LocalChunk, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("chunks", "arena_directory")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ARENA_DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkLocation]
    arena_directory: str
    def __init__(self, chunks: _Optional[_Iterable[_Union[ChunkLocation, _Mapping]]] = ..., arena_directory: _Optional[str] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("chunk_id",)
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    def __init__(self, chunk_id: _Optional[str] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "budget_bytes", "resident_bytes", "chunks", "hits", "misses", "evictions", "bytes_in", "bytes_out", "corrupt_entries")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    budget_bytes: int
    resident_bytes: int
    chunks: int
    hits: int
    misses: int
    evictions: int
    bytes_in: int
    bytes_out: int
    corrupt_entries: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., budget_bytes: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., corrupt_entries: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "policy", "write_mode")
    TIERS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    WRITE_MODE_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    policy: str
    write_mode: str
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., policy: _Optional[str] = ..., write_mode: _Optional[str] = ...) -> None: ...
