"""Prefill on a table packed into fixed buffers (what CUDA-graph tails replay): padded entries and
padded query rows are inert, refilling the buffers keeps their addresses, bounds are checked on the host."""

import pytest
import torch
from kernel_checks import TOL, assert_lse_close, rel_err
from paged_cases import build, prefill_queries

from kernels.paged_attention import MAX_OFFSET, paged_prefill_attention
from kernels.paged_attention.triton import empty_packed, pack, pack_into, paged_prefill_packed
from kernels.rope import rope_inv_freq


def _padded(case, n_entries, n_rows, q, q_pos, scratch):
    """The case's one sequence padded to n_entries entries (scratch block, no slot visible) and
    n_rows query rows (position -1)."""
    e = case.block_ids.numel()
    pad = n_entries - e
    ids = torch.cat([case.block_ids, torch.full((pad,), scratch, dtype=torch.int32)])
    offs = torch.cat([case.offsets, torch.zeros(pad, dtype=torch.int32)])
    masks = torch.cat([case.masks, torch.zeros(pad, dtype=torch.int64)])
    extra = n_rows - q.shape[0]
    qp = torch.cat([q, 100 * torch.randn(extra, *q.shape[1:]).to(q.dtype)])  # padded rows: any values
    pp = torch.cat([q_pos, torch.full((extra,), -1, dtype=torch.int32)])
    return ids, offs, masks, qp, pp


@pytest.mark.parametrize("bs, dtype", [(16, torch.float32), (32, torch.bfloat16)], ids=["BS16-fp32", "BS32-bf16"])
@pytest.mark.slow
def test_packed_buffers_equal_the_public_call(bs, dtype):
    inv = rope_inv_freq(64, 500000.0)
    n_entries, n_rows = 12, 24
    buf = empty_packed(n_entries, 1, bs, 64, "cpu")
    addresses = [t.data_ptr() for t in (buf.meta, buf.masks, buf.table, buf.group_starts, buf.cu_groups)]
    cu_q = torch.tensor([0, n_rows], dtype=torch.int32)
    cu_e = torch.tensor([0, n_entries], dtype=torch.int32)
    # a larger request first, then a smaller one into the same buffers: nothing stale may leak
    for seed, seq in ((0, ([40, 23], 9)), (1, ([17], 5))):
        case = build([seq], bs, 2, 64, inv, dtype=dtype, hide=0.2, base=1000, gen=torch.Generator().manual_seed(seed))
        q, q_pos, cu = prefill_queries(case, [seq[1]], [3], 4, dtype)
        want, want_lse = paged_prefill_attention(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, case.block_ids,
                                                 case.offsets, case.masks, cu, case.cu_entries, inv, 0.125)
        scratch = case.k_cache.shape[0] - 1
        ids, offs, masks, qp, pp = _padded(case, n_entries, n_rows, q, q_pos, scratch)
        pack_into(buf, ids, offs, masks, bs, inv, cu_e, bounds=(scratch, int(case.offsets.max())))
        for splits in (None, 3):
            out, lse = paged_prefill_packed(qp, pp, case.k_cache, case.v_cache, case.slot_pos, buf, cu_q, inv, 0.125,
                                            num_splits=splits)
            t = q.shape[0]
            assert rel_err(out[:t], want) <= TOL[dtype]
            assert_lse_close(lse[:t], want_lse, 50 * TOL[dtype])
            assert torch.equal(out[t:], torch.zeros_like(out[t:])) and torch.isneginf(lse[t:]).all()
    assert addresses == [t.data_ptr() for t in (buf.meta, buf.masks, buf.table, buf.group_starts, buf.cu_groups)]
    # the same words and groups as the cached pack of the same padded table
    ref = pack(ids, offs, masks, bs, inv, with_table=True, cu_entries=cu_e)
    for a, b in ((buf.meta, ref.meta), (buf.masks, ref.masks), (buf.table, ref.table),
                 (buf.group_starts, ref.group_starts), (buf.cu_groups, ref.cu_groups)):
        assert torch.equal(a, b)


def test_pack_into_refuses_what_does_not_fit():
    inv = rope_inv_freq(64, 10000.0)
    buf = empty_packed(4, 1, 16, 64, "cpu")
    ids, offs, masks = torch.zeros(4, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), torch.ones(4, dtype=torch.int64)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="do not fit a packed table"):
        pack_into(buf, ids[:3], offs[:3], masks[:3], 16, inv, cu)
    with pytest.raises(ValueError, match="another block size"):
        pack_into(buf, ids, offs, masks, 32, inv, cu)
    offs[2] = MAX_OFFSET + 1
    # bounds past the encoding fall back to the device check, which names the offset
    with pytest.raises(ValueError, match=str(MAX_OFFSET + 1)):
        pack_into(buf, ids, offs, masks, 16, inv, cu, bounds=(0, MAX_OFFSET + 1))
    with pytest.raises(ValueError, match=str(MAX_OFFSET + 1)):
        pack_into(buf, ids, offs, masks, 16, inv, cu)
