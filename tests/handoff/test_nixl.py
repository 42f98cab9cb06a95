"""The NIXL data plane on the CPU (services/handoff/nixl.py): another process's registered host memory read over UCX
on loopback lands byte for byte, its sender is notified; a sender that changed the bytes after offering them, or
died before the read, gets the read refused (TransferFailed) in bounded time; malformed offers are refused.

NIXL loads in child processes only, never in the test process (services/handoff/nixl.py ``nixl_module``: its native
libraries must not share a process with grpc_tools', which the proto drift test loads)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from services.handoff import nixl

try:
    nixl.nixl_module()
except nixl.NixlUnavailable as exc:          # the project pins a NIXL package: this is a broken install
    pytest.fail(f"NIXL is not installed: {exc}")

N = 3 * (1 << 18) + 5      # an awkward size: 3 MiB and 20 bytes of float32


def _kv():
    import torch

    return (torch.randn(N, generator=torch.Generator().manual_seed(1)),
            torch.randn(N // 2, generator=torch.Generator().manual_seed(2)))


def _sender(conn, how: str) -> None:
    """Register K/V-like host tensors, send an offer of them; then, by ``how``: wait for the reader's notification
    ("ok"), change the bytes first ("corrupt"), or exit at once ("die")."""
    from services.handoff.nixl import NixlEndpoint

    ep = NixlEndpoint()
    k, v = _kv()
    ep.register([k, v])
    conn.send(ep.offer([k, v]).to_bytes())
    if how == "die":
        conn.close()
        return
    if how == "corrupt":
        k[12345] += 1.0
    conn.send("ready")
    got = {}
    for _ in range(2000):               # bounded: ~10 s
        got = ep.notifications()
        if got:
            break
        conn.poll(0.005)
    conn.send(got)
    conn.recv()                         # the reader is done: only now may the memory go
    ep.close()


def _reader(conn, offer_bytes: bytes, timeout: float) -> None:
    """Read the offer into registered tensors; send back what happened: ("read", name, landed right, a short
    read's error) or (the error's type name, its text)."""
    import torch

    from services.handoff.nixl import NixlEndpoint, Offer

    ep = NixlEndpoint()
    k, v = torch.zeros(N), torch.zeros(N // 2)
    ep.register([k, v])
    offer = Offer.from_bytes(offer_bytes)
    try:
        ep.read(offer, [k, v], timeout=timeout, notify=b"handoff-7 done")
    except Exception as exc:     # noqa: BLE001 - reported to the test
        conn.send((type(exc).__name__, str(exc)))
        return
    want_k, want_v = _kv()
    try:
        ep.read(offer, [k])
        short = ""
    except ValueError as exc:
        short = str(exc)
    conn.send(("read", ep.name, torch.equal(k, want_k) and torch.equal(v, want_v), short))
    ep.close()


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    return proc, parent


def _run(how: str, timeout: float = 10.0):
    """A sender doing ``how`` and a reader of its offer, each in its own process: (what the reader reported, what
    the sender's notifications held or None)."""
    sender, s_conn = _spawn(_sender, how)
    try:
        assert s_conn.poll(60), "the sender did not start"
        offer = s_conn.recv()
        if how == "die":
            sender.join(30)
        else:
            assert s_conn.poll(30) and s_conn.recv() == "ready"
        reader, r_conn = _spawn(_reader, offer, timeout)
        assert r_conn.poll(60 + timeout), "the reader did not answer"
        result = r_conn.recv()
        reader.join(30)
        notes = None
        if how != "die":
            assert s_conn.poll(30)
            notes = s_conn.recv()
            s_conn.send("bye")
        return result, notes
    finally:
        sender.join(15)
        if sender.is_alive():
            sender.kill()


def test_a_read_lands_the_offered_bytes_and_notifies_the_sender():
    (what, name, right, short), notes = _run("ok")
    assert what == "read" and right
    assert "bytes" in short                       # the tensors to fill must match the offer's size
    assert notes == {name: [b"handoff-7 done"]}


def test_bytes_changed_after_the_offer_are_refused():
    (what, text), _ = _run("corrupt")
    assert what == "TransferFailed" and "checksum" in text


def test_a_sender_gone_before_the_read_fails_it_in_bounded_time():
    (what, _text), _ = _run("die", timeout=5.0)
    assert what == "TransferFailed"


@pytest.mark.parametrize("blob", [b"", b"NXOF" + b"\0" * 30, nixl.Offer("a", b"m", b"d", 4, 0).to_bytes()[:-1]])
def test_malformed_offers_are_refused(blob):
    with pytest.raises(ValueError):
        nixl.Offer.from_bytes(blob)


def test_an_offers_checksum_is_zlibs_on_the_host():
    """crc_of chains the tensors' bytes in order (no NIXL needed: the checksum alone)."""
    import zlib

    import torch

    k, v = _kv()
    want = zlib.crc32(k.numpy().tobytes() + v.numpy().tobytes())
    assert nixl.crc_of([k, v]) == want and nixl.crc_of([torch.cat([k, v])]) == want


@pytest.mark.cuda
def test_an_offers_checksum_over_gpu_tensors_is_computed_there_and_equals_the_hosts():
    """A GPU hand-off buffer is checked on the GPU (kernels.checksum), with the value the host would compute."""

    k, v = _kv()
    assert nixl.crc_of([k.cuda(), v.cuda()]) == nixl.crc_of([k, v])
    assert nixl.crc_of([k.cuda()]) == nixl.crc_of([k])


def _round_kv(r: int):
    import torch

    return torch.randn(N, generator=torch.Generator().manual_seed(100 + r))


def _slab_sender(conn, rounds: int, slab_bytes: int) -> None:
    """Offer ``rounds`` hand-offs' K/V from this process's slab (``offer_from_slab``), one after another, each given
    back (``release``) once the reader is done; report the endpoint's registrations and the slab's state."""
    from services.handoff import nixl as mod

    ep = mod.process_endpoint()
    pieces = []
    for r in range(rounds):
        offered, offer = mod.offer_from_slab(ep, _round_kv(r), slab_bytes)
        pieces.append(bool(slab_bytes) and mod.process_slab().holds(offered))
        conn.send(offer.to_bytes())
        assert conn.recv() == "done"
        mod.release(ep, offered)
    slab = mod.process_slab() if slab_bytes else None
    conn.send((len(ep._registered), ep.registrations, pieces, slab and slab.taken, slab and slab.free_bytes))
    ep.close()


def _slab_reader(conn, rounds: int, slab_bytes: int) -> None:
    """Read each offer into this process's slab (``read_via_slab``); report whether each landed right, the
    endpoint's registrations and the slab's state."""
    import torch

    from services.handoff import nixl as mod

    ep = mod.process_endpoint()
    right = []
    for r in range(rounds):
        offer = mod.Offer.from_bytes(conn.recv())
        got = mod.read_via_slab(ep, offer, torch.float32, N, "cpu", timeout=10.0, slab_bytes=slab_bytes)
        right.append(torch.equal(got, _round_kv(r)) and not (slab_bytes and mod.process_slab().holds(got)))
        conn.send("done")
    slab = mod.process_slab() if slab_bytes else None
    conn.send((len(ep._registered), ep.registrations, right, slab and slab.taken, slab and slab.free_bytes))
    ep.close()


@pytest.mark.parametrize("slab_bytes, in_slab", [(8 << 20, True), (1 << 20, False), (0, False)],
                         ids=["slab", "too-small", "no-slab"])
def test_hand_offs_go_through_slabs_registered_once(slab_bytes, in_slab):
    """Three hand-offs one after another: each side registers its slab once and lends a piece a hand-off; the bytes
    land right and every piece comes back. A hand-off larger than the slab, or one of a worker without a slab
    (``nixl_slab_bytes`` 0), registers memory of its own, as before, and deregisters it after."""
    rounds = 3
    sender, s_conn = _spawn(_slab_sender, rounds, slab_bytes)
    reader, r_conn = _spawn(_slab_reader, rounds, slab_bytes)
    try:
        for _ in range(rounds):
            assert s_conn.poll(60), "the sender made no offer"
            r_conn.send(s_conn.recv())
            assert r_conn.poll(60), "the reader did not read"
            s_conn.send(r_conn.recv())
        assert s_conn.poll(30) and r_conn.poll(30)
        s_regs, s_made, pieces, s_taken, s_free = s_conn.recv()
        r_regs, r_made, right, r_taken, r_free = r_conn.recv()
    finally:
        for proc in (sender, reader):
            proc.join(15)
            if proc.is_alive():
                proc.kill()
    assert right == [True] * rounds and pieces == [in_slab] * rounds
    slabs = int(slab_bytes > 0)
    assert (s_regs, r_regs) == (slabs, slabs)       # the slabs alone: nothing registered per hand-off is left
    assert s_made == r_made == (1 if in_slab else slabs + rounds)      # registered once, or once a hand-off
    if slabs:
        assert (s_taken, r_taken) == (0, 0) and s_free == r_free == slab_bytes
