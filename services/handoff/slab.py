"""Memory made once and lent out in pieces, so that a hand-off's bytes need no allocation, registration or export of
their own: the NIXL data plane's registered slab (``nixl.Slab``) and the CUDA IPC slab a prefill worker shares once
with every decode worker of its host (``cuda_ipc.IpcSlab``) are both this."""

from __future__ import annotations

import threading

import torch

SLAB_ALIGN = 4096       # every piece starts at a multiple of this many bytes


def device_key(device) -> str:
    """A device's name with its index ("cuda" is the current GPU's), as its tensors name it: a process's slabs are
    kept by it."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


class Slab:
    """``nbytes`` of memory on ``device`` (pinned on the host when CUDA is there) lent out in pieces, first fit in
    ``SLAB_ALIGN`` bytes (``arena.FreeList``); ``take`` gives None when no piece that large is free, and the caller
    then uses memory of its own. Thread safe."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        from services.kvstore.arena import FreeList

        device = torch.device(device)
        pin = device.type == "cpu" and torch.cuda.is_available()
        self.data = torch.empty(nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.device = device
        self._free = FreeList(nbytes)
        self._lock = threading.Lock()
        self.taken = 0          # pieces lent now

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 piece of ``nbytes`` (> 0), or None when the slab has no such room now."""
        if nbytes <= 0:
            raise ValueError(f"a piece holds at least one byte, not {nbytes}")
        length = -(-nbytes // SLAB_ALIGN) * SLAB_ALIGN
        with self._lock:
            offset = self._free.take(length)
            if offset is None:
                return None
            self.taken += 1
        return self.data[offset:offset + nbytes]

    def give(self, piece: torch.Tensor) -> None:
        """A piece ``take`` lent, back (its bytes may be overwritten by the next taker at once)."""
        offset = self.offset(piece)
        if not (piece.dtype == torch.uint8 and offset % SLAB_ALIGN == 0):
            raise ValueError("that tensor is not a piece of this slab")
        with self._lock:
            self._free.give(offset, -(-piece.numel() // SLAB_ALIGN) * SLAB_ALIGN)
            self.taken -= 1

    def offset(self, t: torch.Tensor) -> int:
        """Where ``t`` starts in the slab, in bytes (ValueError when it is not a view of it)."""
        if not self.holds(t):
            raise ValueError("that tensor is not a piece of this slab")
        return t.data_ptr() - self.data.data_ptr()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this slab's memory."""
        start = self.data.data_ptr()
        return t.device == self.data.device and start <= t.data_ptr() < start + self.data.numel()

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._free.free_bytes
