"""Quest sparse decode: Triton == twin for page bounds, page scores, selection and sparse attention (and their launch
configurations); the twin == the plain per-sequence Quest decode the engine ran before these kernels (kept below as
the oracle); a page's score bounds its best q·k wherever it is placed; a selection of every page == dense paged
decode."""

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, assert_lse_close, rel_err
from paged_cases import build

from kernels.paged_attention import paged_decode_attention
from kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq, rotate
from kernels.sparse import _attend, _bounds, _scores, _select, bound_pages, page_scores, reference, select_pages
from kernels.lse_merge import merge_attention
from kernels.sparse import sparse_decode_attention, sparse_decode_parts
from kernels.sparse._attend import AttendConfig
from kernels.sparse._scores import ScoresConfig
from services.engine.kv.block_pool import BlockPool


# -- the oracle: services/engine/decode/quest.py's plain-torch Quest decode as it was before these kernels,
# one sequence at a time, with per-entry fp32 bounds computed from the pool (+inf / -inf over no visible key)

def quest_page_scores(q, kmin, kmax, offsets, inv_freq):
    """q [Hq, D] of one sequence, per-entry bounds [E, Hkv, D] -> fp32 [E, Hkv]."""
    e, hkv, d = kmax.shape
    cos, sin = rope_cos_sin(offsets.long(), inv_freq)
    qr = rotate(q.float()[None].expand(e, -1, -1), cos[:, None, :], -sin[:, None, :]).view(e, hkv, -1, d)
    bound = torch.maximum(qr * kmax[:, :, None, :], qr * kmin[:, :, None, :]).sum(-1).amax(-1)
    return torch.where(torch.isfinite(kmax).all(-1), bound, float("-inf"))


def quest_select(scores, budget_pages):
    """scores [E, Hkv] of one sequence -> bool [E, Hkv]: the last page and the budget_pages - 1 best others."""
    e, hkv = scores.shape
    chosen = torch.zeros(e, hkv, dtype=torch.bool)
    chosen[-1] = True
    others = min(budget_pages - 1, e - 1)
    if others > 0:
        chosen[:-1].scatter_(0, torch.topk(scores[:-1], others, dim=0).indices, True)
    return chosen


def quest_attention(q, k_cache, v_cache, block_ids, offsets, masks, cu_entries, inv_freq, scale, budget_pages):
    """Every key of each sequence scored and attended, the unselected pages masked out. -> (out, chosen per seq)."""
    _, hq, d = q.shape
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    bits = torch.arange(bs, dtype=torch.int64)
    out, chosen_all = torch.empty_like(q), []
    for b in range(q.shape[0]):
        lo, hi = int(cu_entries[b]), int(cu_entries[b + 1])
        ids, offs = block_ids[lo:hi].long(), offsets[lo:hi].long()
        visible = ((masks[lo:hi].long()[:, None] >> bits) & 1).bool()
        k_pages, v_pages = k_cache[ids].float(), v_cache[ids].float()
        hidden = ~visible[:, :, None, None]
        kmin, kmax = k_pages.masked_fill(hidden, float("inf")).amin(1), k_pages.masked_fill(hidden, float("-inf")).amax(1)
        chosen = quest_select(quest_page_scores(q[b], kmin, kmax, offs, inv_freq), budget_pages)
        chosen_all.append(chosen)
        cos, sin = rope_cos_sin(offs, inv_freq)
        keys = rotate(k_pages, cos[:, None, None, :], sin[:, None, None, :])
        logits = torch.einsum("hgd,ebhd->hgeb", q[b].float().view(hkv, hq // hkv, d), keys) * scale
        allowed = visible[None, :, :] & chosen.t()[:, :, None]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        p = torch.softmax(logits.reshape(hkv, hq // hkv, -1), dim=-1)
        out[b] = torch.einsum("hgn,nhd->hgd", p, v_pages.reshape(-1, hkv, d)).reshape(hq, d).to(q.dtype)
    return out, chosen_all


# per sequence (chunk lengths, suffix), Hq, Hkv, D, BS, dtype, hidden fraction, base offset
CASES = [
    ([([30, 33], 2), ([], 1), ([64, 40], 20)], 4, 4, 64, 16, torch.float32, 0.0, 0),
    ([([63], 2), ([7, 9, 11], 5)], 4, 2, 128, 32, torch.bfloat16, 0.3, 70000),
    # chunks past the 16-bit offsets, up to the 131,072 positions of a Llama-3.1-class model
    ([([100, 50], 13)], 8, 2, 64, 16, torch.float16, 0.1, 130900),
    ([([70, 40], 3), ([25], 0)], 8, 2, 128, 16, torch.float32, 0.2, 65500),
    # 64-slot pages: mask bits past 32, bit 63 the int64's sign
    ([([90], 40)], 4, 2, 64, 64, torch.bfloat16, 0.2, 200),
]


def _id(c):
    seqs, hq, hkv, d, bs, dtype, hide, base = c
    lens = "-".join(str(sum(ch) + s) for ch, s in seqs)
    return f"B{len(seqs)}-L{lens}-H{hq}x{hkv}-D{d}-BS{bs}-{DTYPE_NAME[dtype]}" + (f"-hide{hide}" if hide else "") + (
        f"-off{base}" if base else "")


def _setup(spec):
    seqs, hq, hkv, d, bs, dtype, hide, base = spec
    inv = rope_inv_freq(d, 10000.0)
    case = build(seqs, bs, hkv, d, inv, dtype=dtype, hide=hide, base=base)
    q = apply_rope(torch.randn(len(seqs), hq, d), torch.tensor(case.length), inv).to(dtype)
    kmin, kmax = reference.page_bounds(case.k_cache, case.block_ids, case.masks)
    return case, q, kmin, kmax, inv


def _table(case):
    return case.block_ids, case.offsets, case.masks


def _check_selection(sel, count, scores, cu, budget):
    """Every row: ascending global indices inside its sequence, its last entry when that scores > -inf, no -inf
    entry, at most budget of them, -1 past count."""
    bounds = cu.tolist()
    for b in range(len(bounds) - 1):
        lo, hi = bounds[b], bounds[b + 1]
        for h in range(sel.shape[1]):
            n = int(count[b, h])
            row = sel[b, h]
            assert n <= budget and (row[n:] == -1).all()
            got = row[:n].long()
            assert (got[1:] > got[:-1]).all() and ((got >= lo) & (got < hi)).all()
            assert (scores[got, h] > float("-inf")).all()
            if hi > lo and scores[hi - 1, h] > float("-inf"):
                assert n and int(got[-1]) == hi - 1
            finite = int((scores[lo:hi - 1, h] > float("-inf")).sum()) if hi > lo else 0
            assert n == min(budget - 1, finite) + int(hi > lo and bool(scores[hi - 1, h] > float("-inf")))


def _selected_sums(sel, count, scores):
    """Per (sequence, KV head), the sum of the selected scores (fp64): equal for any tie-breaking."""
    k = torch.arange(sel.shape[2])
    taken = k < count[:, :, None]
    heads = torch.arange(sel.shape[1])[None, :, None]
    vals = scores.double()[sel.clamp_min(0).long(), heads]
    return torch.where(taken, vals, 0.0).sum(-1)


@pytest.mark.parametrize("spec", CASES, ids=[_id(c) for c in CASES])
def test_page_scores_match_twin_and_quest(spec):
    case, q, _, _, inv = _setup(spec)
    case.masks[1] = 0  # an entry that shows nothing scores -inf
    kmin, kmax = reference.page_bounds(case.k_cache, case.block_ids, case.masks)
    args = (q, kmin, kmax, *_table(case), case.cu_entries, inv)
    want = page_scores(*args, backend="torch")
    got = page_scores(*args, backend="triton")
    assert got.dtype == torch.float32 and got.shape == (case.block_ids.numel(), kmax.shape[1])
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and torch.equal(torch.isneginf(want),
                                                                                  (case.masks == 0)[:, None].expand_as(want))
    fin = torch.isfinite(want)
    torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-4)
    # the plain Quest scores, one sequence at a time on fp32 bounds per entry
    for b in range(q.shape[0]):
        lo, hi = int(case.cu_entries[b]), int(case.cu_entries[b + 1])
        ids = case.block_ids[lo:hi].long()
        plain = quest_page_scores(q[b], kmin[ids].float(), kmax[ids].float(), case.offsets[lo:hi], inv)
        torch.testing.assert_close(want[lo:hi], plain, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
def test_page_score_bounds_best_key_at_any_offset(dtype):
    """One set of blocks placed at several offsets: each entry's score >= max over its visible keys and the KV
    head's query heads of q·(R_offset k); equal where a block shows one slot (then kmin == kmax == k)."""
    d, bs, hq, hkv, n_blocks = 64, 16, 4, 2, 5
    inv = rope_inv_freq(d, 500000.0)
    k_cache = torch.randn(n_blocks, bs, hkv, d).to(dtype)
    place = torch.tensor([0, 1, 4097, 65537, 131000])
    block_ids = torch.arange(n_blocks).repeat(place.numel()).to(torch.int32)
    offsets = place.repeat_interleave(n_blocks).to(torch.int32)
    block_masks = torch.randint(1, 1 << bs, (n_blocks,))
    block_masks[::2] = 1 << 3  # blocks 0, 2, 4 show one slot
    masks = block_masks[block_ids.long()]  # a block shows the same slots wherever it is placed
    cu = torch.tensor([0, block_ids.numel()], dtype=torch.int32)
    q = apply_rope(torch.randn(1, hq, d), torch.tensor([131072]), inv).to(dtype)
    kmin, kmax = reference.page_bounds(k_cache, block_ids, masks)
    cos, sin = rope_cos_sin(offsets.long(), inv)
    keys = rotate(k_cache[block_ids.long()].double(), cos[:, None, None].double(), sin[:, None, None].double())
    dots = torch.einsum("ebhd,hgd->ebhg", keys, q[0].double().view(hkv, hq // hkv, d)).amax(-1)  # [E, BS, Hkv]
    vis = ((masks[:, None] >> torch.arange(bs)) & 1).bool()
    best = dots.masked_fill(~vis[:, :, None], float("-inf")).amax(1)  # [E, Hkv]
    one = (masks == 1 << 3)[:, None].expand_as(best)
    for backend in ("torch", "triton"):
        score = page_scores(q, kmin, kmax, block_ids, offsets, masks, cu, inv, backend=backend).double()
        assert (score >= best - 1e-4).all()
        torch.testing.assert_close(score[one], best[one], rtol=1e-5, atol=1e-4)
        assert (score[~one] > best[~one] + 1e-3).any()  # a bound over several keys is loose somewhere


def _random_scores(counts, hkv, gen):
    """Scores of sequences of the given entry counts: normal, some rounded to few values (ties), some -inf."""
    e = sum(counts)
    s = torch.randn(e, hkv, generator=gen)
    s = torch.where(torch.rand(e, hkv, generator=gen) < 0.3, s.round(), s)
    s[torch.rand(e, hkv, generator=gen) < 0.15] = float("-inf")
    return s, torch.tensor([0] + counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("budget", [1, 2, 7, 64])
@pytest.mark.slow
def test_select_matches_twin(budget):
    gen = torch.Generator().manual_seed(budget)
    scores, cu = _random_scores([0, 1, 2, 9, 40, 0, 23], 3, gen)
    scores[cu[4] - 1, 0] = float("-inf")  # a sequence whose last entry shows nothing for one head
    want = select_pages(scores, cu, budget, backend="torch")
    _check_selection(*want, scores, cu, budget)
    for got in (select_pages(scores, cu, budget, backend="triton"), _select.launch(scores, cu, budget, max_block=16)):
        assert got[0].shape == (cu.numel() - 1, 3, budget) and got[0].dtype == torch.int32
        _check_selection(*got, scores, cu, budget)
        assert torch.equal(got[1], want[1])
        torch.testing.assert_close(_selected_sums(*got, scores), _selected_sums(*want, scores))


def test_select_twin_matches_quest():
    """Without -inf pages the twin picks what the plain Quest selection picks."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(30, 2, generator=gen)
    cu = torch.tensor([0, 12, 30], dtype=torch.int32)
    sel, count = select_pages(scores, cu, 5)
    for b in range(2):
        chosen = quest_select(scores[cu[b]:cu[b + 1]], 5)  # bool [E_b, Hkv]
        for h in range(2):
            want = torch.nonzero(chosen[:, h]).flatten() + int(cu[b])
            assert torch.equal(sel[b, h, :count[b, h]].long(), want)


@pytest.mark.parametrize("spec", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.slow
def test_sparse_attention_matches_twin(spec):
    """Rows that are not sequences (past queries with their own selections), random subsets, empty rows,
    one and several KV splits."""
    case, _, _, _, inv = _setup(spec)
    _, hq, hkv, d, _, dtype, _, _ = spec
    gen = torch.Generator().manual_seed(5)
    e, rows, width = case.block_ids.numel(), 5, 6
    sel = torch.full((rows, hkv, width), -1, dtype=torch.int32)
    count = torch.randint(0, width + 1, (rows, hkv), generator=gen, dtype=torch.int32)
    count[0] = 0  # a row that attends nothing
    for r in range(rows):
        for h in range(hkv):
            n = min(int(count[r, h]), e)
            count[r, h] = n
            sel[r, h, :n] = torch.randperm(e, generator=gen)[:n].sort().values.to(torch.int32)
    q = apply_rope(torch.randn(rows, hq, d, generator=gen), torch.randint(0, 131072, (rows,), generator=gen), inv)
    q = q.to(dtype)
    args = (q, case.k_cache, case.v_cache, *_table(case), sel, count, inv, d ** -0.5)
    want, want_lse = sparse_decode_attention(*args, backend="torch")
    assert torch.equal(want[0], torch.zeros_like(want[0])) and torch.isneginf(want_lse[0]).all()
    results = [sparse_decode_attention(*args, backend="triton")]
    results += [_attend.launch(q, case.k_cache, case.v_cache, case.block_ids, case.offsets, case.masks, sel, count,
                               inv, d ** -0.5, cfg=AttendConfig(num_splits=s)) for s in (1, 3)]
    for out, lse in results:
        assert out.dtype == dtype and out.shape == q.shape
        assert rel_err(out, want) <= TOL[dtype]
        assert_lse_close(lse, want_lse, 50 * TOL[dtype])


@pytest.mark.parametrize("spec", CASES[:2], ids=[_id(c) for c in CASES[:2]])
def test_parts_and_a_spare_merge_to_attention_over_the_union(spec):
    """Retrieval decode's one merge: the static attention's parts (its KV splits, unmerged) and a spare part filled
    with attention over other entries merge, in one call to q's dtype, to attention over both sets; the parts alone
    (the spare empty) merge to ``sparse_decode_attention``'s answer."""
    case, _, _, _, inv = _setup(spec)
    _, hq, hkv, d, _, dtype, _, _ = spec
    gen = torch.Generator().manual_seed(11)
    e, rows = case.block_ids.numel(), 3
    perm = torch.stack([torch.stack([torch.randperm(e, generator=gen) for _ in range(hkv)]) for _ in range(rows)])
    cut = e // 2

    def selection(idx):
        return idx.sort(-1).values.to(torch.int32), torch.full((rows, hkv), idx.shape[-1], dtype=torch.int32)

    (sel_a, cnt_a), (sel_b, cnt_b), (sel_all, cnt_all) = (selection(perm[..., :cut]), selection(perm[..., cut:]),
                                                          selection(perm))
    q = apply_rope(torch.randn(rows, hq, d, generator=gen), torch.randint(0, 131072, (rows,), generator=gen), inv)
    q = q.to(dtype)
    table = (case.k_cache, case.v_cache, *_table(case))
    want, want_lse = sparse_decode_attention(q, *table, sel_all, cnt_all, inv, d ** -0.5)
    alone, alone_lse = sparse_decode_attention(q, *table, sel_a, cnt_a, inv, d ** -0.5)
    other, other_lse = reference.sparse_decode_attention(q, *table, sel_b, cnt_b, inv, d ** -0.5,
                                                         exact_dtype=torch.float32)
    runs = [(backend, sparse_decode_parts(q, *table, sel_a, cnt_a, inv, d ** -0.5, spare=1, backend=backend))
            for backend in ("torch", "triton")]
    runs += [("triton", _attend.launch(q, *table, sel_a, cnt_a, inv, d ** -0.5, cfg=AttendConfig(num_splits=3),
                                       spare=1))]
    for backend, (outs, lses) in runs:
        assert outs.dtype == lses.dtype == torch.float32 and outs.shape[1:] == q.shape
        outs[-1], lses[-1] = 0.0, float("-inf")               # empty: the parts alone
        out, lse = merge_attention(outs, lses, backend=backend, out_dtype=dtype)
        assert out.dtype == dtype and rel_err(out, alone) <= TOL[dtype]
        assert_lse_close(lse, alone_lse, 50 * TOL[dtype])
        outs[-1], lses[-1] = other, other_lse
        out, lse = merge_attention(outs, lses, backend=backend, out_dtype=dtype)
        assert out.dtype == dtype and rel_err(out, want) <= TOL[dtype]
        assert_lse_close(lse, want_lse, 50 * TOL[dtype])
    with pytest.raises(ValueError, match="spare"):
        sparse_decode_parts(q, *table, sel_a, cnt_a, inv, d ** -0.5, spare=-1)


@pytest.mark.parametrize("spec", CASES[1:3], ids=[_id(c) for c in CASES[1:3]])
@pytest.mark.slow
def test_selecting_every_page_is_dense_decode(spec):
    case, q, kmin, kmax, inv = _setup(spec)
    d = q.shape[2]
    dense, dense_lse = paged_decode_attention(q, case.k_cache, case.v_cache, *_table(case), case.cu_entries, inv,
                                              d ** -0.5)
    budget = int((case.cu_entries[1:] - case.cu_entries[:-1]).max())
    for backend in ("torch", "triton"):
        scores = page_scores(q, kmin, kmax, *_table(case), case.cu_entries, inv, backend=backend)
        sel, count = select_pages(scores, case.cu_entries, budget, backend=backend)
        out, lse = sparse_decode_attention(q, case.k_cache, case.v_cache, *_table(case), sel, count, inv, d ** -0.5,
                                           backend=backend)
        assert rel_err(out, dense) <= TOL[q.dtype]
        assert_lse_close(lse, dense_lse, 50 * TOL[q.dtype])


def test_pipeline_matches_quest_attention():
    """Scores, selection and sparse attention of the twin (and the kernels) == the plain Quest decode
    under a budget that drops pages (no page hidden whole, no ties: the same pages are kept)."""
    spec = ([([70, 40], 3), ([25], 9)], 8, 2, 64, 16, torch.float32, 0.0, 1000)
    case, q, kmin, kmax, inv = _setup(spec)
    want, chosen = quest_attention(q, case.k_cache, case.v_cache, *_table(case), case.cu_entries, inv, 0.125, 3)
    assert not all(c.all() for c in chosen)
    for backend in ("torch", "triton"):
        scores = page_scores(q, kmin, kmax, *_table(case), case.cu_entries, inv, backend=backend)
        sel, count = select_pages(scores, case.cu_entries, 3, backend=backend)
        out, _ = sparse_decode_attention(q, case.k_cache, case.v_cache, *_table(case), sel, count, inv, 0.125,
                                         backend=backend)
        assert rel_err(out, want) <= TOL[torch.float32]


# -- page bounds (BlockPool.bound at every sparse layer of a decode step)

BOUND_CASES = [  # N blocks, BS, Hkv, D, dtype
    (9, 16, 2, 64, torch.bfloat16),
    (7, 5, 3, 32, torch.float32),      # 5 slots (padded to 8), 96 key columns (a tile of 128)
    (6, 64, 1, 128, torch.float16),    # 64-slot blocks
]


@pytest.mark.parametrize("spec", BOUND_CASES, ids=lambda c: f"N{c[0]}-BS{c[1]}-H{c[2]}-D{c[3]}-{DTYPE_NAME[c[4]]}")
def test_bound_pages_match_twin(spec, monkeypatch):
    """Rows naming one block twice (overlapping and disjoint slots: the union), a block shown by no slot of any of
    its rows (+inf / -inf), blocks not named (untouched), a scan over the ids in steps of 2; int32 and int64 ids."""
    n, bs, hkv, d, dtype = spec
    gen = torch.Generator().manual_seed(n)
    k = torch.randn(n, bs, hkv, d, generator=gen).to(dtype)
    blocks = torch.tensor([3, 1, 3, 5, 0, 5, 3])
    visible = torch.rand(blocks.numel(), bs, generator=gen) < 0.4
    visible[[3, 5]] = False            # block 5: no slot
    visible[4] = False
    visible[4, bs - 1] = True          # block 0: its last slot only
    init = torch.randn(n, hkv, d, generator=gen).to(dtype)
    want_min, want_max = init.clone(), init.clone()
    bound_pages(k, want_min, want_max, blocks, visible, backend="torch")
    assert torch.isposinf(want_min[5]).all() and torch.isneginf(want_max[5]).all()
    assert torch.equal(want_min[0], k[0, bs - 1]) and torch.equal(want_min[2], init[2])
    for ids in (blocks, blocks.to(torch.int32)):
        got_min, got_max = init.clone(), init.clone()
        bound_pages(k, got_min, got_max, ids, visible, backend="triton")
        assert torch.equal(got_min, want_min) and torch.equal(got_max, want_max)
    monkeypatch.setattr(_bounds, "MAX_SCAN", 2)   # the union scan over several steps
    got_min, got_max = init.clone(), init.clone()
    bound_pages(k, got_min, got_max, blocks, visible, backend="triton")
    assert torch.equal(got_min, want_min) and torch.equal(got_max, want_max)


def test_block_pool_bound_dispatches_to_its_backend():
    """BlockPool.bound runs the pool's kernels ("triton": one launch) with the twin's result, and nothing for no
    block."""
    pools = [BlockPool(2, 6, 16, 2, 64, torch.device("cpu"), torch.bfloat16) for _ in range(2)]
    pools[1].kernels = "triton"
    k = torch.randn(6, 16, 2, 64).to(torch.bfloat16)
    blocks = torch.tensor([4, 2, 4])
    visible = torch.arange(16)[None, :] < torch.tensor([[3], [16], [0]])
    for pool in pools:
        pool.k[1].copy_(k)
        pool.bound(1, blocks, visible)
        pool.bound(1, blocks[:0], visible[:0])
    for layer in (0, 1):
        assert torch.equal(pools[0].kmin[layer], pools[1].kmin[layer])
        assert torch.equal(pools[0].kmax[layer], pools[1].kmax[layer])
    assert torch.equal(pools[1].kmax[1][4], k[4, :3].amax(0))


# -- launch configurations and table dtypes of the kernels

def test_page_scores_configs_and_int64_tables():
    """Head groups (3 KV heads in tiles of 4 and of 2, a partial last group), one entry a program, programs whose
    entries span two sequences, and the int64 tables the decode graphs hold: all equal to the twin."""
    spec = ([([40, 33], 5), ([17], 3)], 6, 3, 64, 16, torch.bfloat16, 0.2, 900)
    case, q, kmin, kmax, inv = _setup(spec)
    want = page_scores(q, kmin, kmax, *_table(case), case.cu_entries, inv, backend="torch")
    fin = torch.isfinite(want)
    ids64, offs64 = case.block_ids.long(), case.offsets.long()
    # programs of one sequence's entries (its query loaded once) and of two (a query an entry), either way
    for cfg in (ScoresConfig(), ScoresConfig(tile=4, max_heads=2, num_warps=2), ScoresConfig(tile=1, max_heads=1),
                ScoresConfig(tile=64, max_heads=4), ScoresConfig(one_query=False)):
        for ids, offs in ((case.block_ids, case.offsets), (ids64, offs64)):
            got = _scores.launch(q, kmin, kmax, ids, offs, case.masks, case.cu_entries, inv, cfg=cfg)
            assert torch.equal(torch.isneginf(got), torch.isneginf(want))
            torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=1e-4)


@pytest.mark.slow
def test_select_radix_widths_and_long_rows():
    """Rows of a few hundred entries with many ties (scores rounded to a handful of values: the bucket holds more
    keys than needed down to the last bit) and distinct ones (an early stop), equal +0.0 and -0.0, NaN, rows of one
    sign in a narrow range (the search starts below their shared bits) and of one value: every radix width, the
    rows in registers and tiled."""
    gen = torch.Generator().manual_seed(11)
    counts = [300, 5, 170]
    scores, cu = _random_scores(counts, 2, gen)
    scores[:120, 1] = scores[:120, 1].round()
    scores[40:60, 0] = torch.where(torch.rand(20, generator=gen) < 0.5, 0.0, -0.0)
    scores[7, 0] = float("nan")
    scores[305:, 0] = 50 + torch.rand(170, generator=gen)         # one sign, one exponent
    scores[305:, 1] = torch.where(scores[305:, 1] > float("-inf"), -3.0, scores[305:, 1])   # one value
    clean = torch.where(scores.isnan(), float("-inf"), scores)
    for budget in (33, 200):
        want = select_pages(clean, cu, budget, backend="torch")
        for bits, block in ((4, 512), (5, 64), (8, 512), (6, 128)):
            got = _select.launch(scores, cu, budget, max_block=block, radix_bits=bits)
            _check_selection(*got, clean, cu, budget)
            assert torch.equal(got[1], want[1])
            torch.testing.assert_close(_selected_sums(*got, clean), _selected_sums(*want, clean))


@pytest.mark.slow
def test_sparse_attention_steps_splits_and_lanes():
    """Selections several steps long (the next step's table read one step ahead), splits past the selection's
    count (empty), more splits than the unrolled merge takes, 8 lanes a step, int64 tables."""
    spec = ([([300, 90], 7)], 4, 2, 64, 16, torch.bfloat16, 0.2, 5000)
    case, _, _, _, inv = _setup(spec)
    _, hq, hkv, d, _, dtype, _, _ = spec
    gen = torch.Generator().manual_seed(9)
    e, rows, width = case.block_ids.numel(), 3, 24
    sel = torch.full((rows, hkv, width), -1, dtype=torch.int32)
    count = torch.tensor([[24, 13], [1, 0], [9, 24]], dtype=torch.int32)
    for r in range(rows):
        for h in range(hkv):
            sel[r, h, :count[r, h]] = torch.randperm(e, generator=gen)[:count[r, h]].sort().values.to(torch.int32)
    q = apply_rope(torch.randn(rows, hq, d, generator=gen), torch.randint(0, 131072, (rows,), generator=gen), inv)
    q = q.to(dtype)
    want, want_lse = sparse_decode_attention(q, case.k_cache, case.v_cache, *_table(case), sel, count, inv, d ** -0.5)
    ids64, offs64 = case.block_ids.long(), case.offsets.long()
    # 6 steps in one split; 24 one-entry splits (past 16: every part merged at once); 8 lanes
    for cfg in (AttendConfig(num_splits=1), AttendConfig(lanes=1, num_splits=24), AttendConfig(lanes=8, num_splits=2)):
        out, lse = _attend.launch(q, case.k_cache, case.v_cache, ids64, offs64, case.masks, sel, count, inv,
                                  d ** -0.5, cfg=cfg)
        assert rel_err(out, want) <= TOL[dtype]
        assert_lse_close(lse, want_lse, 50 * TOL[dtype])
    assert _attend.pick_splits(AttendConfig(lanes=1, num_splits=24), rows, hkv, width, 1, q.device) == (24, 1)
    # picked: the fewest steps a program that fit the program slots (the CPU counts 4 SMs: 8 slots, 2 steps)
    assert _attend.pick_splits(AttendConfig(), 1, 2, 24, 4, q.device) == (3, 8)


@pytest.mark.slow
def test_sparse_kernels_compile_for_sm90():
    """The interpreter runs what the GPU compiler may refuse (an if whose branches give a name two shapes): the
    sparse and Retro kernels are compiled for an H100 here, in a process of their own (TRITON_INTERPRET=0)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("compile_sm90.py")
    for only in ("sparse", "retro"):
        done = subprocess.run([sys.executable, str(script), "--only", only], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.count(" ok ") >= (4 if only == "sparse" else 2), done.stdout
