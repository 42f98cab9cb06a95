"""The block pool's bookkeeping: lowest ids first, runs of consecutive blocks for chunks, refused frees,
and a chunk written onto a run by plain copies equal to the indexed write."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv.block_pool import BlockPool, PoolExhausted


def _pool(n=12, bs=4, layers=2):
    return BlockPool(layers, n, bs, 2, 8, torch.device("cpu"), torch.float32)


def test_allocation_hands_out_low_ids_and_finds_runs():
    pool = _pool()
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 9
    b = pool.allocate(4)
    pool.free([a[1], b[1]])                       # holes at 1 and 4: free = 1, 4, 7..11
    assert pool.allocate(2) == [1, 4]             # plain allocation fills holes, lowest first
    assert pool.allocate(3, contiguous=True) == [7, 8, 9]
    pool.free([0])
    assert pool.allocate(2, contiguous=True) == [10, 11]
    # no run of 2 left (only block 0 is free): contiguous falls back, exhaustion is refused
    assert pool.num_free == 1
    with pytest.raises(PoolExhausted):
        pool.allocate(2, contiguous=True)
    assert pool.allocate(1, contiguous=True) == [0] and pool.num_free == 0


def test_bad_frees_are_refused_and_change_nothing():
    pool = _pool()
    ids = pool.allocate(3)
    for bad, match in (([ids[0], ids[0]], "twice"), ([5], "freed twice or never allocated"), ([99], "not in the pool"),
                       ([-1], "not in the pool")):
        with pytest.raises(RuntimeError, match=match):
            pool.free(bad)
        assert pool.num_free == 9
    pool.free(ids)
    assert pool.num_free == 12
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(ids[:1])


def test_run_detection():
    pool = _pool()
    assert pool.run([3, 4, 5]) == slice(3, 6)
    assert pool.run([7]) == slice(7, 8)
    assert pool.run([3, 5, 4]) is None and pool.run([3, 4, 6]) is None and pool.run([]) is None


def test_write_run_equals_indexed_write():
    torch.manual_seed(0)
    a, b = _pool(), _pool()
    n = 10                                        # 3 blocks of 4: the last one partly filled
    blocks = a.allocate(3, contiguous=True)
    assert b.allocate(3, contiguous=True) == blocks and a.run(blocks) is not None
    idx = torch.arange(n)
    block, slot = torch.tensor(blocks)[idx // 4], idx % 4
    for layer in range(2):
        k, v = torch.randn(n, 2, 8), torch.randn(n, 2, 8)
        a.write_run(layer, a.run(blocks), k, v)
        b.write(layer, block, slot, k, v)
        assert torch.equal(a.k[layer], b.k[layer]) and torch.equal(a.v[layer], b.v[layer])
        assert torch.equal(a.k[layer][blocks[0]:blocks[-1] + 1].reshape(-1, 2, 8)[:n], k)
