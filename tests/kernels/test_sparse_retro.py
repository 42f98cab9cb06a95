"""RetroAttention's page sets and correction (kernels/sparse/retro.py): the page-set twin keeps exactly the pages a
past query has not seen that existed at its step, ascending and global; a Retro layer's kernel (the current rows'
sparse attention and their past rows' correction at once) equals its twin, and its past rows' output is attention
over the union of the pages they had seen and the new ones."""

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, assert_lse_close, rel_err
from paged_cases import build

from kernels.rope import apply_rope, rope_inv_freq
from kernels.sparse import _retro, retro_attention, sparse_decode_attention
from kernels.sparse._retro import RetroConfig
from kernels.sparse.retro import new_pages, quest_retro_attention


def test_the_twin_keeps_the_unseen_pages_that_existed_at_the_past_step():
    cu = torch.tensor([10, 30])                              # one sequence, its entries from 10 in the step's table
    picked = torch.tensor([[[0, 2, 5, 9, -1]]]) + 10         # one KV head: the pages read now (-1: none)
    picked[0, 0, -1] = -1
    seen = torch.tensor([[[2, -1, 9]], [[-1, -1, -1]]])      # row 0 saw pages 2 and 9; row 1 nothing
    entries = torch.tensor([9, 3])                           # page 9 did not exist at row 0's step; row 1: 0..2
    sel, count = new_pages(picked, torch.tensor([0, 0]), entries, seen, cu)
    assert count.tolist() == [[2], [2]]
    assert sel.tolist() == [[[10, 15, -1, -1, -1]], [[10, 12, -1, -1, -1]]]


# -- the cases: a step's table, selections, past rows with their seen pages and priors

# per sequence (chunk lengths, suffix), Hq, Hkv, D, BS, dtype, hidden fraction, budget K, past rows, window
ATTN_CASES = [
    ([([300, 90], 7), ([25], 9)], 4, 4, 64, 16, torch.float32, 0.0, 17, 5, 2),
    ([([63], 2), ([7, 9, 11], 5)], 8, 4, 128, 32, torch.bfloat16, 0.3, 4, 7, 3),
    ([([200, 150], 13), ([40], 3), ([20, 20], 1)], 8, 2, 64, 16, torch.bfloat16, 0.1, 20, 6, 4),
    ([([70, 40], 3)], 6, 2, 32, 16, torch.float32, 0.2, 5, 4, 2),           # group of 3 (padded to 4)
    ([([400], 40)], 4, 1, 64, 64, torch.bfloat16, 0.2, 7, 5, 2),            # 64-slot pages
]


def _attn_id(c):
    seqs, hq, hkv, d, bs, dtype, hide, k, r, w = c
    return (f"B{len(seqs)}-H{hq}x{hkv}-D{d}-BS{bs}-{DTYPE_NAME[dtype]}" + (f"-hide{hide}" if hide else "")
            + f"-K{k}-R{r}-w{w}")


def _attn_case(spec, seed=0, per=None):
    """A step's table (3 entries before the first sequence's: a view), each sequence's selection (random pages,
    ascending, -1 past a random count; every page for KV head 0), past rows of each sequence that had all but a few
    of its entries at their step, seen lists that hold some of their selection's pages, other pages and -1 anywhere,
    prior outputs; row 0 sees every page it is offered (nothing new; not in ``per``'s layout with 2 rows), the last is
    a padding row (no entries, prior 0 and -inf). per: ``per`` past rows a sequence, sequence b's rows b * per + c (quest_retro_attention's layout),
    else r rows dealt to the sequences in turn."""
    seqs, hq, hkv, d, bs, dtype, hide, k, r, window = spec
    if per is not None:
        r = per * len(seqs)
    g = torch.Generator().manual_seed(seed)
    inv = rope_inv_freq(d, 10000.0)
    case = build(seqs, bs, hkv, d, inv, dtype=dtype, hide=hide, base=500)
    pad = 3
    ids = torch.cat([case.block_ids[:pad], case.block_ids])
    offs = torch.cat([case.offsets[:pad], case.offsets])
    masks = torch.cat([case.masks[:pad], case.masks])
    cu = case.cu_entries + pad
    lens = (cu[1:] - cu[:-1]).tolist()
    b = len(seqs)
    sel = torch.full((b, hkv, k), -1, dtype=torch.int32)
    for i in range(b):
        for h in range(hkv):
            n = min(k, lens[i]) if h == 0 else int(torch.randint(0, min(k, lens[i]) + 1, (1,), generator=g))
            sel[i, h, :n] = (torch.randperm(lens[i], generator=g)[:n].sort().values + int(cu[i])).to(torch.int32)
    seq_of = torch.arange(r) % b if per is None else torch.arange(r) // per      # every sequence's rows
    entries = (torch.tensor(lens)[seq_of] - torch.randint(0, 3, (r,), generator=g)).clamp_min(0)
    width = (window - 1) * k
    seen = torch.randint(0, 3 * max(lens), (r, hkv, width), generator=g)
    seen[torch.rand(r, hkv, width, generator=g) < 0.3] = -1
    own = sel.long()[seq_of] - cu.long()[seq_of][:, None, None]                 # [R, Hkv, K] within the sequence
    half = torch.rand(r, hkv, k, generator=g) < 0.3
    seen[..., :k] = torch.where(half & (own >= 0), own, seen[..., :k])
    if per is None or r >= 3:
        seen[0, :, :k] = torch.where(own[0] >= 0, own[0], -1)                    # row 0: nothing new
        seen[0, :, k:] = -1
    entries[-1] = 0
    if per is None:
        seq_of[-1] = 0
    q = apply_rope(torch.randn(r, hq, d, generator=g), torch.randint(0, 131072, (r,), generator=g), inv).to(dtype)
    out_in = torch.randn(r, hq, d, generator=g).to(dtype)
    lse_in = torch.randn(r, hq, generator=g) + 2
    out_in[-1], lse_in[-1] = 0, float("-inf")
    return (q, case.k_cache, case.v_cache, ids, offs, masks, sel, seq_of, entries, seen, cu, out_in, lse_in, inv,
            d ** -0.5)


def _attend_sets(q, k_cache, v_cache, ids, offs, masks, inv, scale, pages):
    """Sparse attention (the twin) over each (row, KV head)'s set of pages, given with repeats and -1 anywhere."""
    sets = [[sorted({int(p) for p in row if p >= 0}) for row in rows] for rows in pages.tolist()]
    sel = torch.full((*pages.shape[:2], max(1, max(len(p) for rows in sets for p in rows))), -1, dtype=torch.int32)
    for i, rows in enumerate(sets):
        for h, p in enumerate(rows):
            sel[i, h, :len(p)] = torch.tensor(p, dtype=torch.int32)
    return sparse_decode_attention(q, k_cache, v_cache, ids, offs, masks, sel, (sel >= 0).sum(-1, dtype=torch.int32),
                                   inv, scale)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_past_rows_output_is_attention_over_the_union(backend):
    """A prior output that is attention over the pages a past row has seen (those that existed at its step), merged
    with its new pages == one sparse attention over both sets together; the current rows' output is the sparse
    attention over their selection."""
    spec = ([([70, 40], 3), ([25], 9)], 8, 2, 64, 16, torch.float32, 0.1, 6, 0, 4)
    args, seq_of = _fused_case(spec, seed=4)
    q, q_past, k_cache, v_cache, ids, offs, masks, sel, count, entries, seen, cu, _, _, inv, scale = args
    table = (k_cache, v_cache, ids, offs, masks, inv, scale)
    start = cu.long()[seq_of][:, None, None]
    seen_g = torch.where((seen >= 0) & (seen < entries[:, None, None]), seen + start, -1)    # global entries
    out_in, lse_in = _attend_sets(q_past, *table, seen_g)
    out, lse, out_p, lse_p, count_p = quest_retro_attention(q, q_past, k_cache, v_cache, ids, offs, masks, sel, count,
                                                            entries, seen, cu, out_in, lse_in, inv, scale,
                                                            backend=backend)
    new, _ = new_pages(sel, seq_of, entries, seen, cu)
    assert count_p.sum() > 0
    want, want_lse = _attend_sets(q_past, *table, torch.cat([seen_g, new.long()], -1))
    assert rel_err(out_p, want) <= TOL[torch.float32]
    assert_lse_close(lse_p, want_lse, 1e-4)
    now, now_lse = _attend_sets(q, *table, sel)
    assert rel_err(out, now) <= TOL[torch.float32]
    assert_lse_close(lse, now_lse, 1e-4)


# -- quest_retro_attention: a Retro step's sparse layer, the current rows and their past rows in one launch


def _fused_case(spec, seed):
    """_attn_case's past rows in quest_retro_attention's layout, window - 1 a sequence (2 for one sequence: the last
    row is padding), beside the sequences' own queries and the counts of their selections."""
    seqs, hq, hkv, d, bs, dtype = spec[:6]
    args = _attn_case(spec, seed, per=max(spec[9] - 1, 2 if len(seqs) == 1 else 1))
    g = torch.Generator().manual_seed(seed + 1)
    q = apply_rope(torch.randn(len(seqs), hq, d, generator=g), torch.randint(0, 131072, (len(seqs),), generator=g),
                   args[13]).to(dtype)
    q_past, caches, table, sel, seq_of, entries, seen, cu, prior, inv, scale = (
        args[0], args[1:3], args[3:6], args[6], args[7], args[8], args[9], args[10], args[11:13], args[13], args[14])
    count = (sel >= 0).sum(-1, dtype=torch.int32)
    return (q, q_past, *caches, *table, sel, count, entries, seen, cu, *prior, inv, scale), seq_of


@pytest.mark.parametrize("spec", ATTN_CASES, ids=[_attn_id(c) for c in ATTN_CASES])
def test_quest_retro_attention_kernel_equals_the_twin(spec):
    """The fused kernel against its twin, which is the sparse attention's twin for the current rows and
    retro_attention's for their past rows: the same as the two launches it replaces."""
    args, seq_of = _fused_case(spec, seed=len(spec[0]) * 10 + spec[7])
    q, q_past, dtype = args[0], args[1], spec[5]
    want = quest_retro_attention(*args, backend="torch")
    alone = sparse_decode_attention(q, *args[2:7], args[7], args[8], args[14], args[15])
    past = retro_attention(q_past, *args[2:7], args[7], seq_of, *args[9:])
    for a, b in zip(want, (*alone, *past)):
        assert torch.equal(a, b)
    assert want[4].sum() > 0 and (want[4][-1] == 0).all() and torch.isneginf(want[3][-1]).all()
    ids64, offs64 = args[4].long(), args[5].long()
    results = [quest_retro_attention(*args[:4], *table, *args[6:], backend="triton")
               for table in (args[4:6], (ids64, offs64))]                        # int32 and int64 tables
    # one page a step in one split; 8 pages a step, seen lists 4 at a time; 3 splits; one page a split (more parts
    # than the unrolled merge takes)
    configs = (RetroConfig(lanes=1, num_splits=1), RetroConfig(lanes=8, seen_tile=4, num_splits=1),
               RetroConfig(num_splits=3), RetroConfig(lanes=1, num_splits=20))
    results += [_retro.quest_retro_launch(*args, cfg=cfg) for cfg in configs]
    for got in results:
        out, lse, out_p, lse_p, count_p = got
        assert out.shape == q.shape and out_p.shape == q_past.shape and out.dtype == out_p.dtype == dtype
        assert torch.equal(count_p, want[4])
        assert rel_err(out, want[0]) <= TOL[dtype] and rel_err(out_p, want[2]) <= TOL[dtype]
        assert_lse_close(lse, want[1], 50 * TOL[dtype])
        assert_lse_close(lse_p, want[3], 50 * TOL[dtype])


def test_quest_retro_attention_refuses_a_ragged_past():
    args, _ = _fused_case(ATTN_CASES[0], seed=3)
    with pytest.raises(ValueError, match="whole number"):
        quest_retro_attention(args[0], args[1][:-1], *args[2:], backend="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        quest_retro_attention(args[0].double(), *args[1:], backend="triton")
