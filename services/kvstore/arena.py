"""The shared-memory DRAM tier's arena: chunks' layer files as extents of a few large segment files.

A worker on the store's host maps each segment once and registers it with CUDA once (``segments.SharedSegments``):
a chunk's layers then go from the tier to the GPU at the pinned host-to-device rate, with no staging copy and no
per-chunk registration (pinning a 64 MiB file costs ~2 ms on an H100 host, as much as copying it). A chunk that
finds no room in the arena (larger than a segment, or the arena fragmented) is kept as a file of its own, as before.

An extent is a header page, then the chunk's layer file (``tiers.layer_spans``). The header holds a magic and the
extent's generation: 0 while it is written or after it was freed, else a number no other extent content had. A
reader is told the generation with the offsets, and checks it before it hands on each layer; a freed extent is
reused only after ``grace_s`` seconds, so a reader that checked it and then copies within that time reads what it
checked (an unlinked file's bytes live while it is open; an extent's live for the grace)."""

from __future__ import annotations

import bisect
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

SEGMENT_BYTES = 1 << 30
PAGE = 4096
HEADER = PAGE                   # the extent's header page: the layer file starts page-aligned after it
MAGIC = b"TSRXTNT1"
_HEAD = struct.Struct("<8sQ")   # magic, generation
GENERATION_AT = 8               # the generation's offset within the header
REUSE_GRACE_S = 5.0             # a reader hands on a view no later than 2 s after its read began (client.py)


def _pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


@dataclass(frozen=True, slots=True)
class Extent:
    """[offset, offset + length) of segment ``segment``: the header at ``offset``, the layer file after it."""

    segment: int
    offset: int
    length: int
    generation: int

    @property
    def data(self) -> int:
        return self.offset + HEADER


class FreeList:
    """Free byte ranges of one region: first fit, coalesced on return (a segment's here; a NIXL slab's in
    services/handoff/nixl.py)."""

    def __init__(self, size: int) -> None:
        self.ranges: list[list[int]] = [[0, size]] if size > 0 else []   # [offset, length], by offset, coalesced

    def take(self, length: int) -> int | None:
        for i, (offset, room) in enumerate(self.ranges):      # first fit
            if room >= length:
                if room == length:
                    del self.ranges[i]
                else:
                    self.ranges[i] = [offset + length, room - length]
                return offset
        return None

    def give(self, offset: int, length: int) -> None:
        i = bisect.bisect_left(self.ranges, [offset, 0])
        self.ranges.insert(i, [offset, length])
        if i + 1 < len(self.ranges) and offset + length == self.ranges[i + 1][0]:    # joins the next
            self.ranges[i][1] += self.ranges.pop(i + 1)[1]
        if i > 0 and self.ranges[i - 1][0] + self.ranges[i - 1][1] == offset:       # joins the previous
            self.ranges[i - 1][1] += self.ranges.pop(i)[1]

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self.ranges)


class _Segment:
    def __init__(self, path: str, size: int) -> None:
        self.path, self.size = path, size
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.ftruncate(self.fd, size)
        self.free = FreeList(size)

    def take(self, length: int) -> int | None:
        return self.free.take(length)

    def give(self, offset: int, length: int) -> None:
        self.free.give(offset, length)

    def close(self) -> None:
        os.close(self.fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class Arena:
    """Segment files ``seg-NNNN`` in ``directory``, made as they are needed, together at most ``budget`` bytes; each
    ``segment_bytes`` (the last one smaller when the budget ends first). Thread-safe."""

    def __init__(self, directory: str, budget: int, *, segment_bytes: int = SEGMENT_BYTES,
                 grace_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if segment_bytes < 2 * PAGE:
            raise ValueError(f"segment_bytes {segment_bytes} is under two pages")
        self.directory, self.budget = directory, budget
        self.segment_bytes = _pages(segment_bytes)
        self.grace_s = REUSE_GRACE_S if grace_s is None else grace_s
        self._clock = clock
        self.segments: list[_Segment] = []
        self._resting: deque[tuple[float, int, int, int]] = deque()     # (free from, segment, offset, length)
        self._generation = 0
        self._lock = threading.Lock()
        self.on_segment: Callable[[str, int], None] | None = None     # (path, size) of each segment made

    def path(self, segment: int) -> str:
        return self.segments[segment].path

    @staticmethod
    def is_segment(name: str) -> bool:
        return name.startswith("seg-")

    def allocate(self, nbytes: int) -> Extent | None:
        """An extent for a layer file of ``nbytes`` (its header not yet valid), or None when no segment has room."""
        length = HEADER + _pages(nbytes)
        with self._lock:
            self._wake()
            for index, seg in enumerate(self.segments):
                offset = seg.take(length)
                if offset is not None:
                    return self._stamp(index, offset, length)
            made = sum(seg.size for seg in self.segments)
            size = min(self.segment_bytes, (self.budget - made) // PAGE * PAGE)
            if size < length:
                return None
            index = len(self.segments)
            self.segments.append(_Segment(os.path.join(self.directory, f"seg-{index:04d}"), size))
            if self.on_segment is not None:
                self.on_segment(self.segments[index].path, size)
            return self._stamp(index, self.segments[index].take(length), length)

    def _stamp(self, segment: int, offset: int, length: int) -> Extent:
        self._generation += 1
        extent = Extent(segment, offset, length, self._generation)
        os.pwrite(self.segments[segment].fd, _HEAD.pack(MAGIC, 0), offset)     # not valid until ``seal``
        return extent

    def write(self, extent: Extent, parts: Iterable) -> None:
        """The layer file's bytes, ``parts`` back to back from the extent's data offset; then the header that makes
        the extent readable."""
        fd, at = self.segments[extent.segment].fd, extent.data
        end = extent.offset + extent.length
        for part in parts:
            view = memoryview(part).cast("B")
            if at + view.nbytes > end:
                raise ValueError(f"layer file overruns its extent of {extent.length} bytes")
            while view.nbytes:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
        os.pwrite(fd, _HEAD.pack(MAGIC, extent.generation), extent.offset)

    def generation(self, extent: Extent) -> int:
        magic, generation = _HEAD.unpack(os.pread(self.segments[extent.segment].fd, _HEAD.size, extent.offset))
        return generation if magic == MAGIC else 0

    def release(self, extent: Extent) -> None:
        """The extent's header invalid now, its room reusable after the grace."""
        with self._lock:
            os.pwrite(self.segments[extent.segment].fd, _HEAD.pack(MAGIC, 0), extent.offset)
            self._resting.append((self._clock() + self.grace_s, extent.segment, extent.offset, extent.length))

    def _wake(self) -> None:
        now = self._clock()
        while self._resting and self._resting[0][0] <= now:
            _, segment, offset, length = self._resting.popleft()
            self.segments[segment].give(offset, length)

    def free_bytes(self) -> int:
        """Room reusable now or after the grace, plus segments not yet made (the gauge of fragmentation)."""
        with self._lock:
            made = sum(seg.size for seg in self.segments)
            return (self.budget - made + sum(seg.free.free_bytes for seg in self.segments)
                    + sum(r[3] for r in self._resting))

    def close(self) -> None:
        with self._lock:
            for seg in self.segments:
                seg.close()
            self.segments.clear()
            self._resting.clear()
