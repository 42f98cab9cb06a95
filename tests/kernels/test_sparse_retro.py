"""RetroAttention's page sets (kernels/sparse/retro.py): the Triton kernel equals its twin, and the twin keeps exactly
the pages a past query has not seen that existed at its step, ascending and global."""

import pytest
import torch

from kernels.sparse.retro import new_pages


def _case(b, r, hkv, k, w, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(k // 2, 4 * k, (b,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]) + 7      # views need not start at 0
    sel = torch.full((b, hkv, k), -1, dtype=torch.int32)
    for i in range(b):
        for h in range(hkv):
            n = int(torch.randint(0, min(k, int(lens[i])) + 1, (1,), generator=g))
            sel[i, h, :n] = torch.randperm(int(lens[i]), generator=g)[:n].sort().values + int(cu[i])
    seq_of = torch.randint(0, b, (r,), generator=g)
    entries = torch.randint(0, 4 * k, (r,), generator=g)
    seen = torch.randint(-1, 4 * k, (r, hkv, w), generator=g)
    return sel, seq_of, entries, seen, cu


@pytest.mark.parametrize("b, r, hkv, k, w", [(1, 1, 1, 1, 0), (3, 5, 2, 7, 13), (2, 6, 4, 16, 64), (4, 3, 8, 33, 130)])
def test_the_kernel_equals_the_twin(b, r, hkv, k, w):
    case = _case(b, r, hkv, k, w, seed=b * 100 + k)
    want = new_pages(*case, backend="torch")
    got = new_pages(*case, backend="triton")
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_the_twin_keeps_the_unseen_pages_that_existed_at_the_past_step():
    cu = torch.tensor([10, 30])                              # one sequence, its entries from 10 in the step's table
    picked = torch.tensor([[[0, 2, 5, 9, -1]]]) + 10         # one KV head: the pages read now (-1: none)
    picked[0, 0, -1] = -1
    seen = torch.tensor([[[2, -1, 9]], [[-1, -1, -1]]])      # row 0 saw pages 2 and 9; row 1 nothing
    entries = torch.tensor([9, 3])                           # page 9 did not exist at row 0's step; row 1: 0..2
    sel, count = new_pages(picked, torch.tensor([0, 0]), entries, seen, cu)
    assert count.tolist() == [[2], [2]]
    assert sel.tolist() == [[[10, 15, -1, -1, -1]], [[10, 12, -1, -1, -1]]]
