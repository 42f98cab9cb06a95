"""Chunk loads from this process's memory, written at once on the calling thread (ChunkLoad.issue)."""

import pytest
import torch

from services.engine.kv.block_pool import BlockPool
from services.engine.kv.loader import ChunkLoad, LayerGate


def _layers(n_layers, n, heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(i, torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g))
            for i in range(n_layers)]


def test_write_runs_equals_one_write_run_per_layer():
    a = BlockPool(3, 9, 4, 2, 8, torch.device("cpu"), torch.float32)
    b = BlockPool(3, 9, 4, 2, 8, torch.device("cpu"), torch.float32)
    items = _layers(3, 10, 2, 8)               # 10 tokens over 3 blocks: the last one partly filled
    run = slice(2, 5)
    a.write_runs(run, items)
    for layer, k, v in items:
        b.write_run(layer, run, k, v)
    for layer in range(3):
        assert torch.equal(a.k[layer], b.k[layer]) and torch.equal(a.v[layer], b.v[layer])
    assert a.k[0][2:5].reshape(-1, 2, 8)[:10].equal(items[0][1]) and not a.k[0][5].any()


def test_an_issued_load_is_delivered_before_issue_returns_and_runs_no_thread():
    got = []
    load = ChunkLoad("c" * 12, [1, 2], iter(_layers(2, 2, 1, 4)), lambda *a: pytest.fail("per-layer write"),
                     2, local=True, write_many=got.extend)
    load.issue()
    assert load.ident is None and load.delivered == 2 and load.error is None
    assert [i for i, _, _ in got] == [0, 1] and load.bytes == 2 * 2 * (2 * 1 * 4 * 4)
    gate = LayerGate([load], lambda ld: pytest.fail("recomputed"))
    assert gate.settled(0.0)
    gate.wait(1)
    gate.finish()                               # joins a load that never ran as a thread
    assert gate.failed == 0


@pytest.mark.parametrize("layers", [
    [(0, torch.zeros(1), torch.zeros(1))],                                          # one layer short
    [(1, torch.zeros(1), torch.zeros(1)), (0, torch.zeros(1), torch.zeros(1))],    # out of order
])
def test_a_bad_local_chunk_writes_nothing_and_is_recomputed(layers):
    written, recomputed = [], []
    load = ChunkLoad("c" * 12, [1], iter(layers), lambda *a: None, 2, local=True, write_many=written.extend)
    load.issue()
    assert isinstance(load.error, ValueError) and not written
    gate = LayerGate([load], recomputed.append)
    gate.wait(0)
    assert recomputed == [load] and gate.failed == 1


def test_a_stream_yields_streamed_layers_and_nothing_else():
    """A fetch's stream is typed: StreamedLayer items (unpacking as layer, k, v); a tuple is refused by name, not
    told apart from a pair by its length."""
    from services.engine.kv.loader import as_layers, numbered

    k, v = torch.zeros(2, 1, 4), torch.ones(2, 1, 4)
    items = list(numbered([(k, v), (v, k)]))
    assert [item.layer for item in items] == [0, 1] and items[1].k is v
    layer, kk, vv = items[0]
    assert (layer, kk, vv) == (0, k, v)
    assert list(as_layers(iter(items))) == items
    with pytest.raises(TypeError, match="yields StreamedLayer items, got tuple"):
        list(as_layers(iter([(0, k, v)])))


@pytest.mark.parametrize("passes", [True, False])
def test_a_load_checked_later_is_verified_before_any_layer_is_used_and_recomputed_if_it_fails(passes):
    """``verify`` (a chunk read onto the GPU, its checksums computed there) runs once, at the first wait, settle or
    finish, before the pass reads a layer; a failure is the load's error: the chunk is recomputed, never used."""
    calls, recomputed = [], []

    def verify():
        calls.append(1)
        if not passes:
            raise RuntimeError("checksum mismatch")

    for first in ("wait", "settled", "finish"):
        calls.clear(), recomputed.clear()
        load = ChunkLoad("c" * 12, [1, 2], iter(_layers(2, 2, 1, 4)), lambda *a: None, 2, local=True,
                         write_many=lambda items: None, verify=verify)
        load.issue()
        assert load.delivered == 2 and calls == []          # delivered, not yet checked
        gate = LayerGate([load], recomputed.append)
        if first == "wait":
            gate.wait(0)
        elif first == "settled":
            assert gate.settled(0.0)
        gate.wait(1)
        gate.finish()
        assert calls == [1]                                 # once, whichever came first
        assert (recomputed, gate.failed) == (([], 0) if passes else ([load], 1))
        assert passes or isinstance(load.error, RuntimeError)
