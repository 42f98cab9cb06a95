"""The tiered chunk store: DRAM -> RocksDB -> S3, budgets, eviction, promotion, integrity.

Invariants (the tests check each):
- A tier's resident bytes never exceed its budget: room is made (victims chosen and forgotten)
  before a chunk is written, and a chunk larger than a bounded tier's whole budget is refused.
- A chunk becomes visible only whole: data is written by one atomic tier call after every layer
  of the put has arrived and passed its checksum.
- Every layer read from every tier is checked against the chunk's checksums before it is served.
  A corrupt entry is dropped from its tier and the read continues from the next tier holding the
  same version; if none does, ``DataLoss``.
- Mutations (admission, eviction, promotion, delete, write-behind flushes) hold one asyncio lock
  and, once started, finish even if the caller is cancelled. Reads take no lock: a DRAM reader
  keeps a reference to the version it opened; a RocksDB or S3 layer of another version fails the
  checksum check, and a re-read of the metadata then tells that race (eviction or replacement:
  the read goes on from a lower tier with the same version, else ``ChunkVanished``) from
  corruption.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.kvstore.chunk import PB_TIER, ChunkMeta, CorruptEntry, LayerData
from services.kvstore.config import StoreConfig
from services.kvstore.policy import Residency
from services.kvstore.tiers import DramTier, LocalFile, RocksDBTier, ShmDramTier
from services.tiers import Tier

if TYPE_CHECKING:
    from services.kvstore.s3tier import S3Tier

log = logging.getLogger(__name__)


class ResourceExhausted(Exception):
    """A chunk larger than a bounded tier's whole budget."""


class DataLoss(Exception):
    """No tier holds a good copy of a chunk that some tier claimed to hold."""


class ChunkVanished(Exception):
    """The chunk was evicted or replaced in its tier during the read and no other tier has the
    version being streamed (maps to ABORTED: the caller may retry)."""


@dataclass(slots=True)
class TierCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    corrupt: int = 0


@dataclass(slots=True)
class TierSlot:
    """One tier: its storage, its budget bookkeeping (None for unbounded S3), its counters."""

    name: Tier
    storage: DramTier | ShmDramTier | RocksDBTier | S3Tier
    residency: Residency | None
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def pb_tier(self) -> int:
        return PB_TIER[self.name]

    @property
    def blocking(self) -> bool:
        return self.name != Tier.DRAM or getattr(self.storage, "blocking", False)


@dataclass(frozen=True, slots=True)
class Location:
    """Where a chunk lives: ``tiers`` fastest first (pb.Tier values); nbytes = K and V bytes."""

    chunk_id: str
    tiers: tuple[int, ...]
    nbytes: int


def shm_room(path: str) -> int:
    """Bytes free on the file system that holds ``path`` (or its nearest existing parent)."""
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class TieredStore:
    def __init__(self, config: StoreConfig) -> None:
        self.config = config
        self.slots: list[TierSlot] = []
        self._lock = asyncio.Lock()
        self._dirty: set[str] = set()          # write-behind: in DRAM, not yet below
        self._flush_queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._flusher: asyncio.Task | None = None
        self._reads: set[asyncio.Future] = set()     # read-aheads in threads, awaited by close()

    async def start(self) -> None:
        cfg = self.config
        dram = DramTier()
        if cfg.dram_dir is not None:
            room = shm_room(cfg.dram_dir)
            # the arena a little over the budget: its segments' tails and the chunks' envelopes take room. Its
            # segments are made as chunks need them, and a worker that registers one with CUDA commits all of its
            # pages: plan /dev/shm for the whole arena
            arena = cfg.dram_bytes + cfg.dram_bytes // 8 if cfg.dram_segment_bytes else cfg.dram_bytes
            if room >= arena:
                dram = await asyncio.to_thread(ShmDramTier, cfg.dram_dir, segment_bytes=cfg.dram_segment_bytes,
                                               arena_bytes=arena)
            else:       # a full or small /dev/shm (a container's is 64 MiB by default) would refuse puts
                log.warning("DRAM tier in the store's own memory: %s has %d bytes free, under the %d its arena takes",
                            cfg.dram_dir, room, arena)
        self.slots.append(TierSlot(Tier.DRAM, dram, Residency(cfg.dram_bytes, cfg.policy)))
        if cfg.rocksdb_dir is not None:
            db = await asyncio.to_thread(RocksDBTier, cfg.rocksdb_dir, sync=cfg.rocksdb_sync)
            slot = TierSlot(Tier.ROCKSDB, db, Residency(cfg.rocksdb_bytes, cfg.policy))
            self.slots.append(slot)
            for chunk_id, nbytes in await asyncio.to_thread(db.scan):
                # A restart with a smaller budget drops the excess (scan order) before serving.
                if not slot.residency.fits(nbytes):
                    await asyncio.to_thread(db.remove, chunk_id)
                    continue
                for victim in slot.residency.victims_for(chunk_id, nbytes):
                    await asyncio.to_thread(db.remove, victim)
                slot.residency.add(chunk_id, nbytes)
            log.info("rocksdb tier at %s: %d chunks, %d bytes", cfg.rocksdb_dir, len(slot.residency.sizes), slot.residency.used)
        if cfg.s3 is not None:
            from services.kvstore.s3tier import S3Tier

            self.slots.append(TierSlot(Tier.S3, await asyncio.to_thread(S3Tier, cfg.s3), None))
        if cfg.write_mode == "behind" and len(self.slots) > 1:
            self._flusher = asyncio.create_task(self._flush_loop())

    async def close(self) -> None:
        if self._reads:                          # reads of cancelled streams still in threads
            await asyncio.wait(list(self._reads))
        if self._flusher is not None:
            self._flush_queue.put_nowait(None)   # drain what is queued, then stop
            await self._flusher
            self._flusher = None
        for slot in self.slots:
            await self._call(slot, slot.storage.close)

    async def _call(self, slot: TierSlot, fn, *args):
        return await asyncio.to_thread(fn, *args) if slot.blocking else fn(*args)

    # ---- writes ---------------------------------------------------------------------------
    def check_admissible(self, nbytes: int) -> None:
        for slot in self.slots:
            if slot.residency is not None and not slot.residency.fits(nbytes):
                raise ResourceExhausted(f"chunk of {nbytes} bytes exceeds the whole {slot.name} budget of {slot.residency.budget} bytes")

    async def put(self, meta: ChunkMeta, layers: tuple[LayerData, ...]) -> list[int]:
        """Store a complete, verified chunk; returns the tiers holding it (pb.Tier values).

        NOTE: once started, a commit runs to its end even if the caller is cancelled (deadline,
        disconnect): a tier write already handed to a thread cannot be stopped, and abandoning the
        bookkeeping half way would leave data on disk that the budget does not count.
        """
        self.check_admissible(meta.nbytes)
        return await asyncio.shield(self._put(meta, layers))

    async def _put(self, meta: ChunkMeta, layers: tuple[LayerData, ...]) -> list[int]:
        async with self._lock:
            targets = self.slots if self.config.write_mode == "through" else self.slots[:1]
            written: list[TierSlot] = []
            try:
                for slot in reversed(targets):      # lowest first: durable before visible in DRAM
                    await self._admit(slot, meta, layers)
                    written.append(slot)
            except BaseException:
                # A tier failed (disk full, S3 down): the put is refused, so no tier may show it.
                for slot in written:
                    if slot.residency is not None:
                        slot.residency.discard(meta.chunk_id)
                    await self._call(slot, slot.storage.remove, meta.chunk_id)
                raise
            if len(targets) < len(self.slots):
                self._dirty.add(meta.chunk_id)
                self._flush_queue.put_nowait(meta.chunk_id)
            else:
                self._dirty.discard(meta.chunk_id)
            return [s.pb_tier for s in targets]

    async def _admit(self, slot: TierSlot, meta: ChunkMeta, layers: tuple[LayerData, ...]) -> None:
        if slot.residency is not None:
            for victim in slot.residency.victims_for(meta.chunk_id, meta.nbytes):
                await self._evict(slot, victim)
        try:
            await self._call(slot, slot.storage.write, meta, layers)
        except BaseException:
            await self._call(slot, slot.storage.remove, meta.chunk_id)   # no half-known state
            raise
        if slot.residency is not None:
            slot.residency.add(meta.chunk_id, meta.nbytes)
        slot.counters.bytes_in += meta.nbytes

    async def _evict(self, slot: TierSlot, chunk_id: str) -> None:
        if slot is self.slots[0] and chunk_id in self._dirty:
            await self._write_down(chunk_id)       # write-behind: copy down before dropping
        await self._call(slot, slot.storage.remove, chunk_id)
        slot.counters.evictions += 1

    async def _write_down(self, chunk_id: str) -> None:
        stored = await self._call(self.slots[0], self.slots[0].storage.get, chunk_id)
        self._dirty.discard(chunk_id)
        if stored is None:
            return
        for slot in reversed(self.slots[1:]):
            await self._admit(slot, stored.meta, stored.layers)

    async def _flush_loop(self) -> None:
        while (chunk_id := await self._flush_queue.get()) is not None:
            async with self._lock:
                if chunk_id in self._dirty:
                    try:
                        await self._write_down(chunk_id)
                    except Exception:
                        log.exception("write-behind of %s failed; it stays in DRAM only", chunk_id)

    async def delete(self, chunk_id: str) -> bool:
        return await asyncio.shield(self._delete(chunk_id))

    async def _delete(self, chunk_id: str) -> bool:
        async with self._lock:
            self._dirty.discard(chunk_id)
            found = False
            for slot in self.slots:
                if slot.residency is not None:
                    if not slot.residency.discard(chunk_id):
                        continue
                elif await self._call(slot, slot.storage.nbytes, chunk_id) is None:
                    continue
                await self._call(slot, slot.storage.remove, chunk_id)
                found = True
            return found

    # ---- reads ----------------------------------------------------------------------------
    async def lookup(self, chunk_ids: list[str]) -> list[Location]:
        out = []
        for chunk_id in chunk_ids:
            tiers, nbytes = [], 0
            for slot in self.slots:
                if slot.residency is not None:
                    size = slot.residency.sizes.get(chunk_id)
                else:
                    size = await self._call(slot, slot.storage.nbytes, chunk_id)
                if size is not None:
                    tiers.append(slot.pb_tier)
                    nbytes = nbytes or size
            out.append(Location(chunk_id, tuple(tiers), nbytes))
        return out

    @property
    def arena(self):
        """The DRAM tier's shared-memory arena (``arena.Arena``), None when the tier has none."""
        return getattr(self.slots[0].storage, "arena", None) if self.slots else None

    async def local_place(self, chunk_id: str) -> tuple[ChunkMeta, LocalFile] | None:
        """(metadata, place) of a chunk held in the DRAM tier's shared-memory arena, for a caller on this host that
        reads it without a Get (counted as a read served: a hit, its bytes out, and the chunk touched); None when the
        arena does not hold it. From the tier's records alone (``ShmDramTier.place``): a lookup of many chunks costs
        no file opened and no thread hop."""
        slot = self.slots[0]
        if self.arena is None or chunk_id not in slot.residency:
            return None
        placed = slot.storage.place(chunk_id)
        if placed is None:
            return None
        meta, place = placed
        slot.counters.hits += 1
        slot.counters.bytes_out += meta.nbytes
        slot.residency.touch(chunk_id)
        return meta, place

    async def open_read(self, chunk_id: str) -> "ReadSession | None":
        """A session streaming the chunk from the fastest tier holding it; None if no tier holds
        it; DataLoss if tiers held it but every copy was corrupt (those copies are dropped)."""
        corrupt: list[Exception] = []
        found = await self._open_from(0, chunk_id, None, count=True, corrupt=corrupt)
        if found is None:
            if corrupt:
                raise DataLoss(f"chunk {chunk_id}: no tier holds a good copy ({corrupt[-1]})")
            return None
        return ReadSession(self, *found)

    async def _open_from(self, start: int, chunk_id: str, expect: ChunkMeta | None, *, count: bool = False,
                         corrupt: list[Exception] | None = None):
        """(slot index, reader) of the first tier at or below ``start`` with a readable copy whose
        metadata equals ``expect`` (when given); corrupt copies met on the way are dropped."""
        for index in range(start, len(self.slots)):
            slot = self.slots[index]
            if slot.residency is not None and chunk_id not in slot.residency:
                slot.counters.misses += count
                continue
            try:
                reader = await self._call(slot, slot.storage.open, chunk_id)
            except CorruptEntry as exc:
                await self.drop_corrupt(index, chunk_id, exc)
                if corrupt is not None:
                    corrupt.append(exc)
                continue
            if reader is None or (expect is not None and reader.meta != expect):
                if reader is not None:
                    reader.close()
                if reader is None and slot.residency is not None:
                    slot.residency.discard(chunk_id)     # bookkeeping said present: forget it
                slot.counters.misses += count
                continue
            slot.counters.hits += count
            if slot.residency is not None:
                slot.residency.touch(chunk_id)
            return index, reader
        return None

    async def drop_corrupt(self, index: int, chunk_id: str, why: Exception) -> None:
        await asyncio.shield(self._drop_corrupt(index, chunk_id, why))

    async def _drop_corrupt(self, index: int, chunk_id: str, why: Exception) -> None:
        slot = self.slots[index]
        log.error("%s tier: corrupt entry %s dropped: %s", slot.name, chunk_id, why)
        slot.counters.corrupt += 1
        async with self._lock:
            if slot.residency is not None:
                slot.residency.discard(chunk_id)
            if slot is self.slots[0] and chunk_id in self._dirty:
                self._dirty.discard(chunk_id)     # its only copy is bad: nothing to write down
            await self._call(slot, slot.storage.remove, chunk_id)

    async def _promote(self, meta: ChunkMeta, layers: tuple[LayerData, ...], source: int) -> None:
        """Copy a chunk read from tier ``source`` into the faster tiers that lack it."""
        await asyncio.shield(self._promote_locked(meta, layers, source))

    async def _promote_locked(self, meta: ChunkMeta, layers: tuple[LayerData, ...], source: int) -> None:
        async with self._lock:
            for slot in reversed(self.slots[:source]):
                if slot.residency is not None and meta.chunk_id not in slot.residency and slot.residency.fits(meta.nbytes):
                    await self._admit(slot, meta, layers)


class ReadSession:
    """Verified layers of one chunk in order; falls back to a lower tier on corruption.

    Call ``layer(i, stop)`` with increasing i, then ``finish()`` (or ``abort()``). ``tier`` is where
    the first layer came from. On RocksDB and S3 the read (and check) of the next layer starts in a
    thread as soon as layer i is handed over, so the disk works while layer i is on the wire. One
    is enough: RocksDB's reads of a chunk are sequential in its blob file and the kernel reads ahead
    of them; several concurrent reads (4 were tried) defeated that read-ahead and were slower cold.
    ``READ_AHEAD`` can be raised where a reader allows concurrent reads. A full read from a lower
    tier is promoted into the faster tiers by ``finish()``.
    """

    READ_AHEAD = 1

    def __init__(self, store: TieredStore, index: int, reader) -> None:
        self.store = store
        self.meta: ChunkMeta = reader.meta
        self.tier: int = store.slots[index].pb_tier
        self._index, self._reader = index, reader
        self._lowest = index
        self._kept: dict[int, LayerData] = {}
        self._ahead: dict[int, asyncio.Future] = {}

    async def layer(self, i: int, stop: int | None = None) -> LayerData:
        while True:
            slot = self.store.slots[self._index]
            try:
                if i in self._ahead:
                    data = await self._ahead.pop(i)
                elif slot.blocking:
                    await self._settle_ahead()
                    data = await asyncio.to_thread(self._read_verified, self._reader, i)
                else:
                    data = self._read_verified(self._reader, i)
                break
            except CorruptEntry as exc:
                await self._settle_ahead()
                self._reader.close()
                changed = await self._changed_under_us(slot)
                if not changed:
                    await self.store.drop_corrupt(self._index, self.meta.chunk_id, exc)
                found = await self.store._open_from(self._index + 1, self.meta.chunk_id, self.meta)
                if found is None:
                    if changed:
                        raise ChunkVanished(f"chunk {self.meta.chunk_id} was evicted or replaced in the {slot.name} tier "
                                            f"during the read (layer {i}); retry") from exc
                    raise DataLoss(f"chunk {self.meta.chunk_id} layer {i}: no tier holds a good copy ({exc})") from exc
                self._index, self._reader = found
                self._lowest = self._index
        slot.counters.bytes_out += self.meta.layer_nbytes(i)
        self._kept[i] = data      # references only; needed if a fallback makes this read a promotion
        if stop is not None and slot.blocking:
            depth = self.READ_AHEAD if getattr(self._reader, "concurrent_reads", False) else 1
            for j in range(i + 1, min(stop, i + 1 + depth)):
                if j not in self._ahead:
                    future = asyncio.ensure_future(asyncio.to_thread(self._read_verified, self._reader, j))
                    future.add_done_callback(_retrieve)
                    self.store._reads.add(future)
                    future.add_done_callback(self.store._reads.discard)
                    self._ahead[j] = future
        return data

    def local_file(self, start: int, stop: int, arena_only: bool = False) -> LocalFile | None:
        """The place a caller on this host reads layers [start, stop) from, when this session reads the
        shared-memory DRAM tier (counted as served: the caller reads them); with ``arena_only``, only an arena
        extent (what a NIXL caller can read)."""
        slot = self.store.slots[self._index]
        if not isinstance(slot.storage, ShmDramTier) or (arena_only and self._reader.extent is None):
            return None
        slot.counters.bytes_out += sum(self.meta.layer_nbytes(i) for i in range(start, stop))
        return slot.storage.local_file(self._reader, start, stop)

    async def _changed_under_us(self, slot: TierSlot) -> bool:
        """True if the tier now holds no copy or another version: a failed check was a race with
        an eviction or replacement, not corruption."""
        try:
            current = await self.store._call(slot, slot.storage.open, self.meta.chunk_id)
        except CorruptEntry:
            return False
        if current is not None:
            current.close()
        return current is None or current.meta != self.meta

    def _read_verified(self, reader, i: int) -> LayerData:
        data = reader.layer(i)
        self.meta.verify_layer(i, data)
        return data

    async def _settle_ahead(self) -> None:
        """Wait out read-aheads nobody will use, so the reader is idle before reuse or close."""
        pending, self._ahead = list(self._ahead.values()), {}
        if pending:
            await asyncio.wait(pending)

    async def finish(self) -> None:
        await self._settle_ahead()
        self._reader.close()
        if self._lowest > 0 and len(self._kept) == self.meta.num_layers:
            layers = tuple(self._kept[i] for i in range(self.meta.num_layers))
            self._kept.clear()
            await self.store._promote(self.meta, layers, self._lowest)

    def abort(self) -> None:
        """Stop without promotion (client gone or error); in-flight read-aheads close the reader."""
        self._kept.clear()
        pending, self._ahead = list(self._ahead.values()), {}
        if pending:
            done = asyncio.gather(*pending, return_exceptions=True)
            done.add_done_callback(lambda _f, r=self._reader: r.close())
        else:
            self._reader.close()


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()    # consumed here; the awaiting side re-raises it if it still cares
