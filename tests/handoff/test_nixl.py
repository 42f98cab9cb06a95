"""The NIXL data plane on the CPU (services/handoff/nixl.py): another process's registered host memory read over UCX
on loopback lands byte for byte, its sender is notified; a sender that changed the bytes after offering them, or
died before the read, gets the read refused (TransferFailed) in bounded time; malformed offers are refused."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

nixl = pytest.importorskip("services.handoff.nixl")
try:
    nixl.load_nixl()
except nixl.NixlUnavailable as exc:          # the project pins a NIXL package: this is a broken install
    pytest.fail(f"NIXL cannot load: {exc}")

N = 3 * (1 << 18) + 5      # an awkward size: 3 MiB and 20 bytes of float32


def _sender(conn, how: str) -> None:
    """Register K/V-like host tensors, send an offer of them; then, by ``how``: wait for the reader's notification
    ("ok"), change the bytes first ("corrupt"), or exit at once ("die")."""
    from services.handoff.nixl import NixlEndpoint

    ep = NixlEndpoint()
    k = torch.randn(N, generator=torch.Generator().manual_seed(1))
    v = torch.randn(N // 2, generator=torch.Generator().manual_seed(2))
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


def _start(how: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_sender, args=(child, how), daemon=True)
    proc.start()
    assert parent.poll(60), "the sender did not start"
    return proc, parent, nixl.Offer.from_bytes(parent.recv())


def _receiver():
    ep = nixl.NixlEndpoint()
    k, v = torch.zeros(N), torch.zeros(N // 2)
    ep.register([k, v])
    return ep, k, v


def test_a_read_lands_the_offered_bytes_and_notifies_the_sender():
    proc, conn, offer = _start("ok")
    ep, k, v = _receiver()
    try:
        assert conn.recv() == "ready"
        ep.read(offer, [k, v], notify=b"handoff-7 done")
        assert torch.equal(k, torch.randn(N, generator=torch.Generator().manual_seed(1)))
        assert torch.equal(v, torch.randn(N // 2, generator=torch.Generator().manual_seed(2)))
        assert conn.poll(15)
        assert conn.recv() == {ep.name: [b"handoff-7 done"]}
        with pytest.raises(ValueError, match="bytes"):           # the tensors to fill must match the offer
            ep.read(offer, [k])
        conn.send("bye")
    finally:
        proc.join(15)
        ep.close()
    assert proc.exitcode == 0


def test_bytes_changed_after_the_offer_are_refused():
    proc, conn, offer = _start("corrupt")
    ep, k, v = _receiver()
    try:
        assert conn.recv() == "ready"
        with pytest.raises(nixl.TransferFailed, match="checksum"):
            ep.read(offer, [k, v])
        conn.send("bye")
    finally:
        proc.join(15)
        ep.close()


def test_a_sender_gone_before_the_read_fails_it_in_bounded_time():
    proc, conn, offer = _start("die")
    proc.join(30)
    ep, k, v = _receiver()
    try:
        with pytest.raises(nixl.TransferFailed):
            ep.read(offer, [k, v], timeout=5.0)
    finally:
        ep.close()


@pytest.mark.parametrize("blob", [b"", b"NXOF" + b"\0" * 30, nixl.Offer("a", b"m", b"d", 4, 0).to_bytes()[:-1]])
def test_malformed_offers_are_refused(blob):
    with pytest.raises(ValueError):
        nixl.Offer.from_bytes(blob)
