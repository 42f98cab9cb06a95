"""Storage of the DRAM and RocksDB tiers. Blocking calls: the store runs RocksDB's in a thread.

Each tier stores a chunk as its encoded metadata plus its layers and offers:
``write(meta, layers)`` (atomic: all or nothing), ``open(chunk_id) -> Reader | None``,
``remove(chunk_id)`` and ``scan() -> [(chunk_id, nbytes)]``. Readers return bytes unverified; the
store checks every layer against ``meta.checksums``, so a reader never needs a snapshot to avoid
mixing versions: a layer of another version fails the check, and the store then tells a chunk
that changed under the read (the tier's metadata differs now) from a corrupt one. The RocksDB
tier keeps a chunk's layers in one file beside the database (``RocksDBTier`` says why)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from services.kvstore.arena import Arena, Extent
from services.kvstore.chunk import ChunkMeta, CorruptEntry, LayerData, layer_len, layer_parts
from services.kvstore.wire import ALIGN, FramedLayer, envelope, read_framed_layer
from services.tiers import Tier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredChunk:
    """A chunk as held in DRAM: ``layers[i]`` is K||V bytes of layer i (``meta.layer_nbytes(i)``
    long), possibly as the tuple of frames it arrived in."""

    meta: ChunkMeta
    layers: tuple[LayerData, ...]


class DramTier:
    name = Tier.DRAM

    def __init__(self) -> None:
        self._chunks: dict[str, StoredChunk] = {}

    def write(self, meta: ChunkMeta, layers: tuple[LayerData, ...]) -> None:
        self._chunks[meta.chunk_id] = StoredChunk(meta, tuple(layers))

    def get(self, chunk_id: str) -> StoredChunk | None:
        return self._chunks.get(chunk_id)

    def open(self, chunk_id: str) -> "DramReader | None":
        stored = self._chunks.get(chunk_id)
        return None if stored is None else DramReader(stored)

    def remove(self, chunk_id: str) -> None:
        self._chunks.pop(chunk_id, None)

    def scan(self) -> list[tuple[str, int]]:
        return [(cid, s.meta.nbytes) for cid, s in self._chunks.items()]

    def close(self) -> None:
        self._chunks.clear()


class DramReader:
    # The reader keeps the StoredChunk it opened, so an eviction or a replacement meanwhile
    # neither frees nor mixes the bytes being streamed.
    def __init__(self, stored: StoredChunk) -> None:
        self.meta = stored.meta
        self._layers = stored.layers

    def layer(self, index: int) -> LayerData:
        return self._layers[index]

    def close(self) -> None:
        pass


def _meta_key(chunk_id: str) -> bytes:
    return b"m/" + chunk_id.encode()


def _legacy_layer_prefix(chunk_id: str) -> bytes:
    """Layers were RocksDB values under ``l/<id>/<layer>`` before they moved to files."""
    return b"l/" + chunk_id.encode() + b"/"


def _file_name(chunk_id: str, meta_record: bytes) -> str:
    """A version's layer file: the chunk id and the crc32 its metadata record starts with (a
    replacement with other content gets another name; ids match ``[A-Za-z0-9._-]{1,200}``)."""
    return f"{chunk_id}.{bytes(meta_record[:4]).hex()}"


def _layer_layout(meta: ChunkMeta, align: int = 1) -> list[tuple[int, int, int]]:
    """(offset, head length, length) of each layer's message in the chunk's layer file: the messages back to
    back, each ``wire.frame_layer``'s (envelope, K||V, tail), so a read hands them on as they are; with ``align``,
    each message starts at a multiple of it (an arena's layer files: its K||V bytes are then ``wire.ALIGN``-aligned in
    memory, viewable as tensors in place)."""
    out, offset = [], 0
    for i in range(meta.num_layers):
        offset = -(-offset // align) * align
        nbytes = meta.layer_nbytes(i)
        head, tail = envelope(i, nbytes, True, meta.checksums[i], ALIGN)
        out.append((offset, len(head), len(head) + nbytes + len(tail)))
        offset += out[-1][2]
    return out


def layer_spans(meta: ChunkMeta, align: int = 1) -> list[tuple[int, int]]:
    """(offset, length) of each layer's message in the chunk's layer file (``_layer_layout``)."""
    return [(offset, length) for offset, _, length in _layer_layout(meta, align)]


def layer_data_offsets(meta: ChunkMeta, start: int, stop: int, align: int = 1) -> list[int]:
    """Where the K||V bytes of layers [start, stop) begin in the chunk's layer file (after each message's head)."""
    return [offset + head for offset, head, _ in _layer_layout(meta, align)[start:stop]]


class _LayerFiles:
    """What the tiers that keep each chunk's layers as one file in the directory ``files`` share."""

    files: str

    def read_layer(self, reader: "RocksDBReader", index: int) -> bytes:
        offset, length = reader.spans[index]
        return os.pread(reader.file.fileno(), length, offset)     # short when the file was cut

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.files, name))
        except FileNotFoundError:
            pass


class RocksDBTier(_LayerFiles):
    """The disk tier: RocksDB (rocksdict, raw mode) keeps each chunk's metadata under ``m/<id>``
    (WAL on), and the chunk's layers are one file, ``layers/<id>.<crc>``: each layer as the message
    that carries it whole (``wire.FramedLayer``, what a get sends), back to back.

    Why not RocksDB values (as before): this rocksdict build computes RocksDB's crc32c in software
    (~0.8 GB/s), over the WAL record and again over the blob record of every value, and holds the
    GIL through the whole write: 250-320 ms of CPU per 64 MiB chunk, the store's event loop frozen
    meanwhile. A file write is one kernel copy, with the GIL released; the store checks its own
    crc32 of every layer on every read anyway. Reads are ``pread``s of the open file (GIL released;
    a reader keeps the version it opened even if it is replaced or removed meanwhile).

    A write is committed by its metadata record: the file is complete (and, with ``sync``, on
    disk) before the record is written, so a crash leaves either the old version or the new one
    whole; files no record names (a write cut short) are removed when the tier opens.
    """

    name = Tier.ROCKSDB

    def __init__(self, path: str, *, sync: bool = False) -> None:
        from rocksdict import Options, Rdict, WriteOptions

        os.makedirs(path, exist_ok=True)
        self.files = os.path.join(path, "layers")
        os.makedirs(self.files, exist_ok=True)
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        self._db = Rdict(path, opts)
        self._write_opts = WriteOptions()
        self._write_opts.sync = sync
        self._sync = sync
        self.path = path

    def write(self, meta: ChunkMeta, layers: tuple[LayerData, ...]) -> None:
        from rocksdict import WriteBatch

        record = meta.encode()
        name = _file_name(meta.chunk_id, record)
        write_layer_file(self.files, name, meta, layers, sync=self._sync)
        old = self._db.get(_meta_key(meta.chunk_id))
        batch = WriteBatch(raw_mode=True)
        # The commit: readers find a chunk by this record; it names the file written above.
        self._delete_into(batch, meta.chunk_id)
        batch.put(_meta_key(meta.chunk_id), record)
        self._db.write(batch, self._write_opts)
        if old is not None and _file_name(meta.chunk_id, old) != name:
            self._unlink(_file_name(meta.chunk_id, old))

    def open(self, chunk_id: str) -> "RocksDBReader | None":
        for _ in range(3):
            raw = self._db.get(_meta_key(chunk_id))
            if raw is None:
                return None
            meta = ChunkMeta.decode(raw)
            try:
                file = open(os.path.join(self.files, _file_name(chunk_id, raw)), "rb", buffering=0)
            except FileNotFoundError:
                if self._db.get(_meta_key(chunk_id)) != raw:
                    continue                        # replaced or removed meanwhile: look again
                raise CorruptEntry(f"chunk {chunk_id}: its layer file is missing") from None
            # read front to back: a larger kernel read-ahead window from the first layer on
            os.posix_fadvise(file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            return RocksDBReader(meta, self, file)
        return None

    def remove(self, chunk_id: str) -> None:
        from rocksdict import WriteBatch

        old = self._db.get(_meta_key(chunk_id))
        batch = WriteBatch(raw_mode=True)
        self._delete_into(batch, chunk_id)
        self._db.write(batch, self._write_opts)
        if old is not None:
            self._unlink(_file_name(chunk_id, old))

    @staticmethod
    def _delete_into(batch, chunk_id: str) -> None:
        prefix = _legacy_layer_prefix(chunk_id)
        batch.delete_range(prefix, prefix[:-1] + b"0")   # "/" + 1 == "0": layers an older version stored
        batch.delete(_meta_key(chunk_id))

    def scan(self) -> list[tuple[str, int]]:
        """Chunks present on disk, with sizes. Corrupt metadata records, records whose file is
        missing (or that an older version wrote, layers in RocksDB) and files no record names are
        removed."""
        found, bad, named = [], [], set()
        for key in self._db.keys(from_key=b"m/"):
            if not key.startswith(b"m/"):
                break
            chunk_id = key[2:].decode(errors="replace")
            raw = self._db.get(key)
            try:
                meta = ChunkMeta.decode(raw)
            except CorruptEntry as exc:
                log.warning("rocksdb: dropping %s at start: %s", chunk_id, exc)
                bad.append(chunk_id)
                continue
            name = _file_name(meta.chunk_id, raw)
            if not os.path.exists(os.path.join(self.files, name)):
                log.warning("rocksdb: dropping %s at start: no layer file (lost, or stored by an older version)", chunk_id)
                bad.append(chunk_id)
                continue
            named.add(name)
            found.append((meta.chunk_id, meta.nbytes))
        for chunk_id in bad:
            self.remove(chunk_id)
        if bad:
            self._db.compact_range(None, None)      # frees the space of layers an older version kept in RocksDB
        for name in os.listdir(self.files):
            if name not in named:           # a write cut short, or a version replaced or removed by a crash
                self._unlink(name)
        return found

    def layer_file(self, chunk_id: str) -> str | None:
        """Path of the chunk's layer file (fault-injection tests damage it), None if not stored."""
        raw = self._db.get(_meta_key(chunk_id))
        return None if raw is None else os.path.join(self.files, _file_name(chunk_id, raw))

    def put_raw(self, key: bytes, value: bytes) -> None:
        """Overwrite one raw key (fault-injection tests only)."""
        self._db.put(key, value)

    def close(self) -> None:
        self._db.close()


def layer_file_parts(meta: ChunkMeta, layers: tuple[LayerData, ...], align: int = 1) -> Iterator:
    """The chunk's layer file (``layer_spans``) as bytes-like parts: each layer as the message that carries it whole,
    back to back (each at a multiple of ``align``, zeros between)."""
    at = 0
    for (offset, _, length), (i, data) in zip(_layer_layout(meta, align), enumerate(layers)):
        if offset > at:
            yield bytes(offset - at)
        if isinstance(data, FramedLayer):
            yield data.message
        else:                               # a layer larger than a message: the same bytes, unjoined
            head, tail = envelope(i, layer_len(data), True, meta.checksums[i], ALIGN)
            yield from (head, *layer_parts(data), tail)
        at = offset + length


def layer_file_bytes(meta: ChunkMeta, align: int = 1) -> int:
    """The length of the chunk's layer file."""
    offset, _, length = _layer_layout(meta, align)[-1]
    return offset + length


def write_layer_file(directory: str, name: str, meta: ChunkMeta, layers: tuple[LayerData, ...], *,
                     sync: bool = False, mode: int = 0o644) -> None:
    """The chunk's layer file as ``directory/name``, written under a temporary name and renamed, so a reader finds it
    whole or not at all."""
    temp = os.path.join(directory, f".{name}.{os.urandom(4).hex()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        for part in layer_file_parts(meta, layers):
            _write_all(fd, part)
        if sync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    os.close(fd)
    os.replace(temp, os.path.join(directory, name))
    if sync:
        _fsync_dir(directory)


ARENA_ALIGN = 64     # an arena layer file's messages start at multiples of this (a cache line)


@dataclass(frozen=True, slots=True)
class LocalFile:
    """Where a caller on the store's host reads layers [start, stop) of a chunk: ``offsets`` of their K||V bytes in
    ``path``; in an arena segment, ``generation`` is what the extent's header at ``header`` holds while these bytes
    are the chunk's (``arena``), else 0."""

    path: str
    offsets: list[int]
    generation: int = 0
    header: int = 0


class ShmDramTier(_LayerFiles):
    """The DRAM tier in shared memory: a directory of a memory file system (/dev/shm), owned by the store's user and
    closed to others (0700). Each chunk is one layer file (as the RocksDB tier's, ``layer_spans``): an extent of the
    arena's segments (``arena.Arena``; ``segment_bytes`` 0: no arena), or a file of its own when the arena has no
    room for it. Workers on the store's host read a chunk's layers from it themselves (``Get`` with their host id
    answers with the place, ``LocalLayers``) at memory speed, where the gRPC stream moves ~1.5 GB/s; everyone else is
    streamed the same bytes. The store keeps the metadata; a chunk's place is freed when it is evicted, replaced or
    deleted: a file is unlinked (a reader that opened it keeps its bytes), an extent rests for the arena's grace
    before it is reused. Blocking calls (file writes)."""

    name = Tier.DRAM
    blocking = True
    MARK = ".tessera-dram-tier"     # the directory is a tier's: what it holds may be removed

    def __init__(self, path: str, *, arena_bytes: int = 0, segment_bytes: int = 0) -> None:
        os.makedirs(path, mode=0o700, exist_ok=True)
        names = os.listdir(path)
        if names and self.MARK not in names:
            raise ValueError(f"{path} holds files that are not a Tessera DRAM tier's: give the tier a directory of its "
                             "own (e.g. /dev/shm/tessera-store)")
        os.chmod(path, 0o700)
        self.files = path
        self._chunks: dict[str, tuple[ChunkMeta, str | Extent]] = {}
        for name in names:                  # a store restarted on the same directory starts empty
            if name != self.MARK:
                self._unlink(name)
        open(os.path.join(path, self.MARK), "w").close()
        self.arena = None
        if arena_bytes > 0 and segment_bytes > 0:
            self.arena = Arena(path, arena_bytes, segment_bytes=segment_bytes)
        self.unplaced = 0       # chunks the arena had no room for, kept as files of their own

    def write(self, meta: ChunkMeta, layers: tuple[LayerData, ...]) -> None:
        place: str | Extent | None = None
        if self.arena is not None:
            place = self.arena.allocate(layer_file_bytes(meta, ARENA_ALIGN))
            if place is not None:
                try:
                    self.arena.write(place, layer_file_parts(meta, layers, ARENA_ALIGN))
                except BaseException:
                    self.arena.release(place)
                    raise
            else:
                self.unplaced += 1
        if place is None:
            place = _file_name(meta.chunk_id, meta.encode())
            write_layer_file(self.files, place, meta, layers, mode=0o600)
        old = self._chunks.get(meta.chunk_id)
        self._chunks[meta.chunk_id] = (meta, place)
        if old is not None and old[1] != place:
            self._free(old[1])

    def get(self, chunk_id: str) -> StoredChunk | None:
        reader = self.open(chunk_id)
        if reader is None:
            return None
        try:
            return StoredChunk(reader.meta, tuple(reader.layer(i) for i in range(reader.meta.num_layers)))
        finally:
            reader.close()

    def open(self, chunk_id: str) -> "RocksDBReader | None":
        found = self._chunks.get(chunk_id)
        if found is None:
            return None
        meta, place = found
        if isinstance(place, Extent):
            # the segment stays open and the extent rests for the grace once freed: the read sees this version, or
            # fails its checksums (the store then finds the chunk changed under it)
            reader = RocksDBReader(meta, self, open(self.arena.path(place.segment), "rb", buffering=0), base=place.data,
                                   align=ARENA_ALIGN)
            reader.extent = place
            return reader
        try:
            file = open(os.path.join(self.files, place), "rb", buffering=0)
        except FileNotFoundError:
            raise CorruptEntry(f"chunk {chunk_id}: its shared-memory file is missing") from None
        return RocksDBReader(meta, self, file)

    def place(self, chunk_id: str) -> tuple[ChunkMeta, LocalFile] | None:
        """(metadata, place) of a chunk held in an arena extent, from the tier's own records: no file is opened, so
        it need not leave the event loop; None when the chunk is not in an extent."""
        found = self._chunks.get(chunk_id)
        if found is None or not isinstance(found[1], Extent):
            return None
        meta, extent = found
        return meta, self._extent_file(meta, extent, 0, meta.num_layers)

    def _extent_file(self, meta: ChunkMeta, extent: Extent, start: int, stop: int) -> LocalFile:
        """Where layers [start, stop) of a chunk in ``extent`` lie in its segment."""
        offsets = [extent.data + offset for offset in layer_data_offsets(meta, start, stop, ARENA_ALIGN)]
        return LocalFile(self.arena.path(extent.segment), offsets, extent.generation, extent.offset)

    def local_file(self, reader: "RocksDBReader", start: int, stop: int) -> LocalFile:
        """Where a caller on this host reads layers [start, stop) of the chunk ``reader`` opened."""
        if reader.extent is not None:
            return self._extent_file(reader.meta, reader.extent, start, stop)
        return LocalFile(reader.file.name, layer_data_offsets(reader.meta, start, stop, reader.align))

    def remove(self, chunk_id: str) -> None:
        found = self._chunks.pop(chunk_id, None)
        if found is not None:
            self._free(found[1])

    def _free(self, place: str | Extent) -> None:
        if isinstance(place, Extent):
            self.arena.release(place)
        else:
            self._unlink(place)

    def scan(self) -> list[tuple[str, int]]:
        return [(cid, meta.nbytes) for cid, (meta, _) in self._chunks.items()]

    def close(self) -> None:
        for chunk_id in list(self._chunks):
            self.remove(chunk_id)
        if self.arena is not None:
            self.arena.close()
        self._unlink(self.MARK)
        try:
            os.rmdir(self.files)
        except OSError:
            pass


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        view = view[os.write(fd, view):]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RocksDBReader:
    concurrent_reads = True     # independent preads: several layers may be read at once

    def __init__(self, meta: ChunkMeta, tier: RocksDBTier, file, base: int = 0, align: int = 1) -> None:
        self.meta = meta
        self.file = file               # open: the version stays readable if it is replaced or removed
        self.base, self.align = base, align     # where the layer file starts in ``file``, its messages' alignment
        self.spans = [(base + offset, length) for offset, length in layer_spans(meta, align)]
        self.extent: Extent | None = None
        self._tier = tier

    def layer(self, index: int) -> LayerData | None:
        """The stored layer, unverified: a FramedLayer when its envelope is the expected one, else
        the raw bytes read (the store's check then fails on them)."""
        value = self._tier.read_layer(self, index)
        framed = read_framed_layer(value, index, self.meta.layer_nbytes(index), self.meta.checksums[index])
        return value if framed is None else framed

    def close(self) -> None:
        self.file.close()
