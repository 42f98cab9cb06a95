"""NIXL data plane (issue #23): bytes read straight from a peer's registered memory, the control plane left to gRPC.

A worker makes one ``NixlEndpoint`` (a NIXL agent with the UCX backend) and registers the memory it will expose or
fill once (``register``: its KV pool, the store's DRAM tier, a staging buffer). To hand bytes over, the owner makes an
``Offer`` of some of its registered tensors: its agent's metadata, the tensors' transfer descriptors, their byte
count and their CRC-32. The offer travels over the existing gRPC services (mutual TLS: only cluster members learn
where registered memory is); the receiver ``read``s the offered bytes into its own registered tensors, which NIXL
(UCX) moves without the sender's CPU, and then checks the CRC-32 over what landed (``verified``) before any use: a
transfer that fails, stalls past its deadline or lands other bytes raises ``TransferFailed`` and the caller falls
back (recompute, or the gRPC stream). A notification tells the sender the read is done, so it may reuse the memory.

Hand-offs go through a ``Slab`` per worker and device, registered once: the sender copies a hand-off's K/V into a piece
of its slab and offers that; the receiver reads into a piece of its own and copies them out; both pieces are lent
again. Only a transfer larger than the free room registers memory of its own for that transfer.

What the data plane does not protect: UCX moves the bytes unencrypted; anyone on the network path can read them, and
a peer holding an offer can read the offered memory until it is deregistered (a slab's: while its worker runs,
whatever the piece holds by then). The README's security model says so.

NIXL ships per CUDA major (``nixl-cu12``, ``nixl-cu13``; ``nixl`` picks one); ``load_nixl`` finds whichever is
installed or says why none can be used, and callers report that as the transport's choice.
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass

import torch

from services.handoff.slab import Slab as _Slab, device_key
from services.kvstore.chunk import checksum

log = logging.getLogger(__name__)

_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
_OFFER = struct.Struct("<4sHHIIQI")     # magic, version, reserved, name, metadata, nbytes, crc32 (+ descs length)
_MAGIC = b"NXOF"
_VERSION = 1
_names = itertools.count()


class NixlUnavailable(RuntimeError):
    """No usable NIXL here (not installed, or without its UCX plugin); the text says which."""


class TransferFailed(RuntimeError):
    """A NIXL read that did not land the offered bytes whole and intact in time."""


def nixl_module() -> str:
    """The API module of the first NIXL package installed (``nixl``, ``nixl-cu13``, ``nixl-cu12``), found without
    loading it: its native libraries carry their own protobuf and abseil, which must not share a process with
    another copy (grpc_tools' protoc crashes beside them), so only a process that moves bytes loads it."""
    for name in _MODULES:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            return name
    raise NixlUnavailable("no NIXL package is installed (nixl, nixl-cu13, nixl-cu12)")


def load_nixl():
    """The NIXL Python API module (``nixl_module``), loaded."""
    name = nixl_module()
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise NixlUnavailable(f"{name.split('.')[0]} cannot load: {exc}") from None


@dataclass(frozen=True, slots=True)
class Offer:
    """What a receiver needs to read some of the sender's registered memory: the sender agent's name and metadata,
    the transfer descriptors of the offered tensors (serialized by NIXL), their total bytes and CRC-32."""

    agent: str
    metadata: bytes
    descs: bytes
    nbytes: int
    crc32: int

    def to_bytes(self) -> bytes:
        name = self.agent.encode()
        head = _OFFER.pack(_MAGIC, _VERSION, 0, len(name), len(self.metadata), self.nbytes, self.crc32)
        return head + struct.pack("<I", len(self.descs)) + name + self.metadata + self.descs

    @classmethod
    def from_bytes(cls, blob: bytes) -> "Offer":
        """ValueError for anything ``to_bytes`` did not write (wrong magic or version, lengths that do not add up)."""
        fixed = _OFFER.size + 4
        if len(blob) < fixed:
            raise ValueError(f"a NIXL offer is at least {fixed} bytes, got {len(blob)}")
        magic, version, reserved, n_name, n_meta, nbytes, crc = _OFFER.unpack_from(blob)
        (n_descs,) = struct.unpack_from("<I", blob, _OFFER.size)
        if magic != _MAGIC or version != _VERSION or reserved:
            raise ValueError("not a NIXL offer of this version")
        if fixed + n_name + n_meta + n_descs != len(blob) or not n_name or not n_meta or not n_descs:
            raise ValueError("a NIXL offer's lengths do not add up")
        at = fixed
        name = blob[at:at + n_name].decode()
        at += n_name
        meta = bytes(blob[at:at + n_meta])
        at += n_meta
        return cls(name, meta, bytes(blob[at:at + n_descs]), nbytes, crc)


def crc_of(tensors: list[torch.Tensor]) -> int:
    """CRC-32 over the tensors' bytes in order (what ``verified`` checks on the other side). Host tensors on the
    CPU; GPU tensors where they are (``kernels.checksum``, on the current stream, one sync for the value), so that
    a GPU's hand-off buffer is not copied to the host to be checked."""
    if tensors and all(t.is_cuda for t in tensors):
        from kernels.checksum import crc32_spans

        flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in tensors]
        data = flat[0] if len(flat) == 1 else torch.cat(flat)
        return crc32_spans(data, [0], [data.numel()], backend="triton").item() & 0xFFFFFFFF
    crc = 0
    for t in tensors:
        crc = checksum(memoryview(t.detach().cpu().contiguous().view(torch.uint8).numpy()), crc)
    return crc


class NixlEndpoint:
    """One worker's NIXL agent (UCX backend). ``name``: unique in the cluster (default: a new one of this process).

    Thread safe: a worker's hand-off threads share it (the agent in NIXL's strict thread-sync mode, the
    registrations and peers here under a lock)."""

    def __init__(self, name: str | None = None) -> None:
        api = load_nixl()
        self.name = name or f"tessera-{os.getpid()}-{next(_names)}"
        agent = api.nixl_agent(self.name, api.nixl_agent_config(
            backends=["UCX"], sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        if "UCX" not in agent.backends:
            raise NixlUnavailable(f"NIXL's UCX plugin did not load (plugins: {agent.plugin_list})")
        self.agent = agent
        self._lock = threading.Lock()
        self._registered: list[tuple] = []   # (registration, the tensor it holds when it holds one alone, else None)
        self.registrations = 0               # register calls made (a slab is one; a transfer without one, one each)
        self._peers: dict[int, str] = {}     # CRC-32 of a peer's metadata -> its agent name

    def register(self, tensors: list[torch.Tensor]) -> None:
        """Register contiguous tensors (host or device memory) once: they may then be offered or read into."""
        for t in tensors:
            if not t.is_contiguous() or t.numel() == 0:
                raise ValueError("only non-empty contiguous tensors are registered")
        reg = self.agent.register_memory(tensors)
        with self._lock:
            self._registered.append((reg, tensors[0] if len(tensors) == 1 else None))
            self.registrations += 1

    def offer(self, tensors: list[torch.Tensor]) -> Offer:
        """An offer of registered tensors' bytes (their CRC-32 computed here, on their device)."""
        descs = self.agent.get_xfer_descs(tensors)
        if descs is None:
            raise ValueError("offered tensors must be contiguous and on one device")
        return Offer(self.name, self.agent.get_agent_metadata(), self.agent.get_serialized_descs(descs),
                     sum(t.numel() * t.element_size() for t in tensors), crc_of(tensors))

    def read(self, offer: Offer, into: list[torch.Tensor], timeout: float = 10.0, notify: bytes = b"") -> None:
        """Read the offered bytes into registered tensors of the same total size, then verify them; the sender is
        notified with ``notify`` once they have landed. TransferFailed when the transfer errs, has not finished
        within ``timeout`` seconds, or the bytes that landed fail the offer's CRC-32."""
        size = sum(t.numel() * t.element_size() for t in into)
        if size != offer.nbytes:
            raise ValueError(f"the offer holds {offer.nbytes} bytes, the tensors to fill {size}")
        self.read_descs(offer.agent, offer.metadata, offer.descs, into, timeout, notify)
        self.verified(offer, into)

    def read_descs(self, agent: str, metadata: bytes, descs: bytes, into: list[torch.Tensor], timeout: float = 10.0,
                   notify: bytes = b"") -> None:
        """Read the memory that the serialized transfer descriptors ``descs`` of agent ``agent`` (its ``metadata``)
        name into registered tensors, one per descriptor, unverified: the caller checks what landed.
        TransferFailed when the transfer errs or has not finished within ``timeout`` seconds."""
        local = self.agent.get_xfer_descs(into)
        if local is None:
            raise ValueError("the tensors to fill must be contiguous and on one device")
        try:
            peer = self._peer(agent, metadata)
            remote = self.agent.deserialize_descs(descs)
            handle = self.agent.initialize_xfer("READ", local, remote, peer, notify)
        except ValueError:
            raise
        except Exception as exc:       # NIXL raises its own error types: a peer it cannot reach, a refused request
            self._forget(agent)
            raise TransferFailed(f"NIXL could not read from {agent}: {exc}") from None
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + timeout
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(0)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                self._forget(agent)
                raise TransferFailed(f"the read from {agent} {'failed' if state == 'ERR' else 'timed out'}")
        finally:
            handle.release()

    def descs_of(self, tensors: list[torch.Tensor]) -> bytes:
        """The serialized transfer descriptors of registered tensors (one each), for a peer's ``read_descs``."""
        descs = self.agent.get_xfer_descs(tensors)
        if descs is None:
            raise ValueError("the tensors must be contiguous and on one device")
        return self.agent.get_serialized_descs(descs)

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    @staticmethod
    def verified(offer: Offer, landed: list[torch.Tensor]) -> None:
        """TransferFailed unless the landed bytes have the offer's CRC-32 (checked where they landed)."""
        crc = crc_of(landed)
        if crc != offer.crc32:
            raise TransferFailed(f"the bytes read from {offer.agent} fail the offer's checksum")

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sending agent."""
        return self.agent.get_new_notifs()

    def _peer(self, agent: str, metadata: bytes) -> str:
        key = checksum(metadata)
        with self._lock:
            name = self._peers.get(key)
            if name is None:
                name = self.agent.add_remote_agent(metadata)
                name = name.decode() if isinstance(name, bytes) else name
                if name != agent:
                    raise ValueError(f"the offer names agent {agent!r}, its metadata {name!r}")
                self._peers[key] = name
        return name

    def _forget(self, agent: str) -> None:
        """Drop a peer after a failed transfer (it may be gone): its next offer connects afresh."""
        with self._lock:
            for key, name in list(self._peers.items()):
                if name == agent:
                    del self._peers[key]
                    try:
                        self.agent.remove_remote_agent(name)
                    except Exception:    # noqa: BLE001 - already gone
                        pass

    def deregister(self, tensor: torch.Tensor) -> None:
        """Deregister the registration that holds ``tensor`` (registered alone, by ``register([tensor])``)."""
        with self._lock:
            for i, (reg, alone) in enumerate(self._registered):
                if alone is tensor:
                    del self._registered[i]
                    break
            else:
                raise KeyError("that tensor is not registered here alone")
        self.agent.deregister_memory(reg)

    def close(self) -> None:
        """Deregister everything registered here."""
        with self._lock:
            regs, self._registered = self._registered, []
        for reg, _ in regs:
            self.agent.deregister_memory(reg)


SLAB_BYTES = 512 << 20     # default size of a worker's NIXL hand-off memory, registered once (its settings'
#                            nixl_slab_bytes; a hand-off larger than the free room registers memory of its own)


class Slab(_Slab):
    """Memory registered with an endpoint once and lent out in pieces (``slab.Slab``): a hand-off's K/V are offered
    from a piece, or read into one, instead of from or into memory registered for that hand-off alone (registering
    costs a pinning of the pages, and on a GPU an export of them, per call); where ``take`` gives None, the caller
    registers memory of its own for that transfer, as it would without a slab."""

    def __init__(self, endpoint: NixlEndpoint, nbytes: int, device: torch.device | str = "cpu") -> None:
        super().__init__(nbytes, device)
        endpoint.register([self.data])
        self.endpoint = endpoint


_slabs: dict[str, Slab] = {}
_no_slab: dict[str, str] = {}       # devices where no slab could be made, and why


def process_slab(device: torch.device | str = "cpu", nbytes: int | None = None) -> Slab:
    """This process's slab on ``device``, made at first use with ``nbytes`` (default ``SLAB_BYTES``) and registered
    with ``process_endpoint``; later calls get that one whatever they ask."""
    key = device_key(device)
    with _endpoint_lock:
        slab = _slabs.get(key)
    if slab is None:
        made = Slab(process_endpoint(), SLAB_BYTES if nbytes is None else nbytes, device)
        with _endpoint_lock:
            slab = _slabs.setdefault(key, made)
        if slab is not made:
            made.endpoint.deregister(made.data)
    return slab


def _slab_for(device, nbytes: int | None) -> Slab | None:
    """This process's slab on ``device`` (``process_slab``); None when ``nbytes`` is 0 (no slab: every transfer
    registers its own memory), or (said once in the log) where one cannot be made there."""
    if nbytes == 0:
        return None
    try:
        return process_slab(device, nbytes)
    except Exception as exc:   # noqa: BLE001 - no room or no registration: transfers register their own memory
        key = device_key(device)
        if key not in _no_slab:
            _no_slab[key] = str(exc)
            log.warning("no NIXL slab on %s (%s): hand-offs there register their own memory", key, exc)
        return None


def offer_from_slab(endpoint: NixlEndpoint, kv: torch.Tensor, slab_bytes: int | None = None,
                    ) -> tuple[torch.Tensor, Offer]:
    """An offer of ``kv``'s bytes (contiguous): copied into a piece of this process's slab on its device (made with
    ``slab_bytes`` at first use; 0: none), or, when the slab has no room, ``kv`` registered for this offer alone.
    Returns (what the offer names: give it back with ``release`` once the peer has read it, the offer)."""
    raw = kv.reshape(-1).view(torch.uint8)
    slab = _slab_for(kv.device, slab_bytes)
    piece = None if slab is None else slab.take(raw.numel())
    if piece is None:
        endpoint.register([kv])
        try:
            return kv, endpoint.offer([kv])
        except BaseException:
            endpoint.deregister(kv)
            raise
    try:
        piece.copy_(raw)            # on the caller's stream; the offer's checksum (crc_of) waits for it
        return piece, endpoint.offer([piece])
    except BaseException:
        slab.give(piece)
        raise


def release(endpoint: NixlEndpoint, offered: torch.Tensor) -> None:
    """What ``offer_from_slab`` offered, back: a slab piece to its slab, memory registered alone deregistered."""
    slab = _slabs.get(device_key(offered.device))
    if slab is not None and slab.holds(offered):
        slab.give(offered)
    else:
        endpoint.deregister(offered)


def read_via_slab(endpoint: NixlEndpoint, offer: Offer, dtype: torch.dtype, numel: int, device,
                  timeout: float, notify: bytes = b"", slab_bytes: int | None = None) -> torch.Tensor:
    """The offered bytes read (``NixlEndpoint.read``: checked) into a piece of this process's slab on ``device``
    (made with ``slab_bytes`` at first use; 0: none), then copied out into a tensor of their own (``numel`` of
    ``dtype`` there) and the piece given back; where the slab has no room, into memory registered for this read
    alone."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    slab = _slab_for(device, slab_bytes)
    piece = None if slab is None else slab.take(nbytes)
    if piece is None:
        out = torch.empty(numel, dtype=dtype, device=device)
        endpoint.register([out])
        try:
            endpoint.read(offer, [out], timeout=timeout, notify=notify)
        finally:
            endpoint.deregister(out)
        return out
    try:
        endpoint.read(offer, [piece], timeout=timeout, notify=notify)
        return piece.view(dtype).clone()
    finally:
        slab.give(piece)


_endpoint: NixlEndpoint | None = None
_endpoint_lock = threading.Lock()


def process_endpoint() -> NixlEndpoint:
    """This process's one NIXL endpoint, made on first use (a worker's hand-off threads share it)."""
    global _endpoint
    with _endpoint_lock:
        if _endpoint is None:
            _endpoint = NixlEndpoint()
        return _endpoint
