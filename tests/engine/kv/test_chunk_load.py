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


def test_write_runs_of_some_layers_and_of_streamed_layers():
    """A whole chunk (every layer, in order, as StreamedLayer items) takes the all-layer views; some layers, or
    layers out of order, take one view a layer: both land where write_run puts them, in no other slot."""
    from services.engine.kv.loader import StreamedLayer

    items = _layers(3, 6, 2, 8, seed=1)
    for given in ([StreamedLayer(*it) for it in items], [items[2], items[0]], items[1:]):
        a = BlockPool(3, 9, 4, 2, 8, torch.device("cpu"), torch.float32)
        b = BlockPool(3, 9, 4, 2, 8, torch.device("cpu"), torch.float32)
        a.write_runs(slice(4, 6), given)
        for layer, k, v in given:
            b.write_run(layer, slice(4, 6), k, v)
        assert torch.equal(a.k_all, b.k_all) and torch.equal(a.v_all, b.v_all)
        assert a.k_all.count_nonzero() == a.v_all.count_nonzero() == len(given) * 6 * 2 * 8
    a.write_runs(slice(0, 1), [])   # nothing to write: nothing written


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


def test_write_layers_equals_a_write_a_layer():
    """A run of layers with one set of slots written by two indexed stores == one write a layer; the hand-off's
    layers (views of one buffer, as layer_views cuts them) are stacked without a copy, tensors apart are not."""
    from services.handoff.imports import _runs, _stacked
    from services.handoff.wire import layer_views

    g = torch.Generator().manual_seed(3)
    flat = torch.randn(2 * 3 * 5 * 2 * 8, generator=g)
    kv = layer_views(flat, [5, 5, 5], torch.Size([2, 8]))        # K0 V0 K1 V1 K2 V2, 5 tokens each
    ks, vs = kv[0::2], kv[1::2]
    k_all, v_all = _stacked(ks), _stacked(vs)
    assert k_all.data_ptr() == ks[0].data_ptr() and all(torch.equal(k_all[i], ks[i]) for i in range(3))
    assert torch.equal(v_all, torch.stack(vs))
    apart = [torch.randn(5, 2, 8, generator=g) for _ in range(3)]   # separate storages: a copy would stack them
    assert _stacked(apart) is None and _stacked(ks[:1]) is None and _stacked(ks[::-1]) is None
    a = BlockPool(3, 9, 4, 2, 8, torch.device("cpu"), torch.float32)
    b = BlockPool(3, 9, 4, 2, 8, torch.device("cpu"), torch.float32)
    block, slot = torch.tensor([7, 7, 2, 2, 2]), torch.tensor([0, 3, 1, 2, 0])
    a.write_layers(slice(0, 3), block, slot, k_all, v_all)
    for layer in range(3):
        b.write(layer, block, slot, ks[layer], vs[layer])
    assert torch.equal(a.k_all, b.k_all) and torch.equal(a.v_all, b.v_all) and a.k_all.count_nonzero() > 0
    assert _runs([0, 1, 1, 1, 2, 1]) == [(0, 1), (1, 4), (4, 5), (5, 6)] and _runs([]) == []


def test_a_pass_standing_for_a_loads_checks_counts_it_as_waiting():
    """The gate's ``settled`` and ``finish`` stand waiting for a checked-later load's checks (an arena read's, on
    the GPU) as ``wait`` does for a layer: that time is the pass's load wait (a request's ``load_wait_seconds``)."""
    import time

    def slow_check():
        time.sleep(0.05)

    load = ChunkLoad("c" * 12, [1, 2], iter(_layers(2, 2, 1, 4)), lambda *a: pytest.fail("per-layer write"),
                     2, local=True, write_many=lambda items: None, verify=slow_check)
    load.issue()
    gate = LayerGate([load], lambda ld: pytest.fail("recomputed"))
    assert gate.wait_seconds == 0.0
    assert gate.settled(0.0)
    assert gate.wait_seconds >= 0.05
    gate.finish()                           # checked once already: nothing more to wait for
    assert 0.05 <= gate.wait_seconds < 0.5 and gate.failed == 0
