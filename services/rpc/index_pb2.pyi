from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tensor(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChunkRun(_message.Message):
    __slots__ = ("chunk_id", "length")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    length: int
    def __init__(self, chunk_id: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class OffloadHeader(_message.Message):
    __slots__ = ("owner", "layer", "kv_shape", "train_shape", "crc32", "chunks", "kv_dtype", "lists_shape", "hold", "keys_held")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    KV_SHAPE_FIELD_NUMBER: _ClassVar[int]
    TRAIN_SHAPE_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LISTS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    KEYS_HELD_FIELD_NUMBER: _ClassVar[int]
    owner: str
    layer: int
    kv_shape: _containers.RepeatedScalarFieldContainer[int]
    train_shape: _containers.RepeatedScalarFieldContainer[int]
    crc32: int
    chunks: _containers.RepeatedCompositeFieldContainer[ChunkRun]
    kv_dtype: str
    lists_shape: _containers.RepeatedScalarFieldContainer[int]
    hold: bool
    keys_held: bool
    def __init__(self, owner: _Optional[str] = ..., layer: _Optional[int] = ..., kv_shape: _Optional[_Iterable[int]] = ..., train_shape: _Optional[_Iterable[int]] = ..., crc32: _Optional[int] = ..., chunks: _Optional[_Iterable[_Union[ChunkRun, _Mapping]]] = ..., kv_dtype: _Optional[str] = ..., lists_shape: _Optional[_Iterable[int]] = ..., hold: _Optional[bool] = ..., keys_held: _Optional[bool] = ...) -> None: ...

class ChunkIndexHeader(_message.Message):
    __slots__ = ("chunk_id", "nbytes")
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    chunk_id: str
    nbytes: int
    def __init__(self, chunk_id: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ChunkIndexPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ChunkIndexHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ChunkIndexHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChunkIndexReply(_message.Message):
    __slots__ = ("length", "layers", "heads", "chunk_indexes", "chunk_index_bytes")
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    HEADS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEXES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    length: int
    layers: int
    heads: int
    chunk_indexes: int
    chunk_index_bytes: int
    def __init__(self, length: _Optional[int] = ..., layers: _Optional[int] = ..., heads: _Optional[int] = ..., chunk_indexes: _Optional[int] = ..., chunk_index_bytes: _Optional[int] = ...) -> None: ...

class OffloadPart(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: OffloadHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[OffloadHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class OffloadReply(_message.Message):
    __slots__ = ("keys", "build_seconds", "index_bytes")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BUILD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    keys: int
    build_seconds: float
    index_bytes: int
    def __init__(self, keys: _Optional[int] = ..., build_seconds: _Optional[float] = ..., index_bytes: _Optional[int] = ...) -> None: ...

class SearchRequest(_message.Message):
    __slots__ = ("layer", "owners", "queries", "k", "scale", "beam")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    BEAM_FIELD_NUMBER: _ClassVar[int]
    layer: int
    owners: _containers.RepeatedScalarFieldContainer[str]
    queries: Tensor
    k: int
    scale: float
    beam: int
    def __init__(self, layer: _Optional[int] = ..., owners: _Optional[_Iterable[str]] = ..., queries: _Optional[_Union[Tensor, _Mapping]] = ..., k: _Optional[int] = ..., scale: _Optional[float] = ..., beam: _Optional[int] = ...) -> None: ...

class SearchReply(_message.Message):
    __slots__ = ("out", "lse", "scanned", "seconds")
    OUT_FIELD_NUMBER: _ClassVar[int]
    LSE_FIELD_NUMBER: _ClassVar[int]
    SCANNED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    out: Tensor
    lse: Tensor
    scanned: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    def __init__(self, out: _Optional[_Union[Tensor, _Mapping]] = ..., lse: _Optional[_Union[Tensor, _Mapping]] = ..., scanned: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ...) -> None: ...

class DropRequest(_message.Message):
    __slots__ = ("owner",)
    OWNER_FIELD_NUMBER: _ClassVar[int]
    owner: str
    def __init__(self, owner: _Optional[str] = ...) -> None: ...

class DropReply(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: int
    def __init__(self, layers: _Optional[int] = ...) -> None: ...

class IndexStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IndexStatus(_message.Message):
    __slots__ = ("owners", "kv_bytes", "index_bytes")
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    INDEX_BYTES_FIELD_NUMBER: _ClassVar[int]
    owners: int
    kv_bytes: int
    index_bytes: int
    def __init__(self, owners: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., index_bytes: _Optional[int] = ...) -> None: ...
