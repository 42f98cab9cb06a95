"""Paged prefill: Triton == twin == eager attention over keys materialised at global positions."""

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, assert_lse_close, rel_err
from paged_cases import build, eager_attention, prefill_queries

from kernels.paged_attention import paged_prefill_attention
from kernels.paged_attention._meta import offset_groups, pack
from kernels.paged_attention._prefill import PrefillConfig, group_suffix_min, launch, step_key_bounds
from kernels.paged_attention._prefill_query import ROT_MODES
from kernels.rope import rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}

# (per sequence: chunk lengths, suffix, scattered queries), Hq, Hkv, D, BS, dtype, hidden fraction, base offset
CASES = [
    ([([63], 1, 0)], 2, 2, 64, 16, torch.float32, 0.0, 0),
    ([([40, 23], 5, 3), ([17], 30, 0)], 8, 2, 128, 32, torch.float32, 0.2, 0),
    ([([100, 37], 20, 4)], 8, 1, 64, 64, torch.bfloat16, 0.1, 0),
    ([([200, 250], 50, 0)], 8, 2, 64, 16, torch.float16, 0.0, 0),
    ([([60, 75], 10, 2), ([1], 1, 0)], 4, 1, 64, 16, torch.float32, 0.0, 65400),
    # past the old 16-bit field: a chunk crossing 65,536, and chunks near the 131,072 positions of Llama-3.1
    ([([60, 75], 10, 2), ([1], 1, 0)], 4, 1, 64, 16, torch.float32, 0.0, 65500),
    ([([60, 75], 10, 2)], 4, 2, 64, 16, torch.bfloat16, 0.1, 130900),
]


def _id(c):
    seqs, hq, hkv, d, bs, dtype, hide, base = c
    t = sum(sum(ch) + s for ch, s, _ in seqs)
    return f"B{len(seqs)}-T{t}-H{hq}x{hkv}-D{d}-BS{bs}-{DTYPE_NAME[dtype]}" + (f"-hide{hide}" if hide else "") + (
        f"-off{base}" if base else "")


def _run(case, q, q_pos, cu_q, scale, backend):
    return paged_prefill_attention(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, case.block_ids,
                                   case.offsets, case.masks, cu_q, case.cu_entries, case.inv_freq, scale,
                                   backend=backend)


@pytest.mark.parametrize("spec", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.slow
def test_prefill_matches_twin_and_eager(spec):
    seqs, hq, hkv, d, bs, dtype, hide, base = spec
    inv = rope_inv_freq(d, 500000.0, LLAMA3)
    case = build([(c, s) for c, s, _ in seqs], bs, hkv, d, inv, dtype=dtype, hide=hide, base=base)
    q, q_pos, cu_q = prefill_queries(case, [s for _, s, _ in seqs], [n for _, _, n in seqs], hq, dtype)
    scale = d ** -0.5
    out_t, lse_t = _run(case, q, q_pos, cu_q, scale, "torch")
    out_k, lse_k = _run(case, q, q_pos, cu_q, scale, "triton")
    assert out_k.dtype == dtype and lse_k.dtype == torch.float32 and out_k.shape == q.shape
    assert rel_err(out_k, out_t) <= TOL[dtype]
    assert_lse_close(lse_k, lse_t, 50 * TOL[dtype])
    # cos/sin from the table, KV split in 3 parts merged by LSE, smaller tiles: same result (a split's groups
    # outside its entries loop zero times)
    packed = pack(case.block_ids, case.offsets, case.masks, bs, inv, with_table=True, cu_entries=case.cu_entries)
    out_s, lse_s = launch(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, scale,
                          cfg=PrefillConfig(block_m=32, min_block_n=32, num_splits=3))
    assert rel_err(out_s, out_t) <= TOL[dtype]
    assert_lse_close(lse_s, lse_t, 50 * TOL[dtype])
    # both against attention over the whole K rotated eagerly at global positions
    for b in range(len(seqs)):
        k, v, k_pos = case.eager_keys(b)
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        want, want_lse = eager_attention(q[rows].float(), q_pos[rows], k, v, k_pos, scale)
        tol = max(TOL[dtype], 1e-3)  # fp32 angles of positions up to 65k differ by ~1e-4 relative
        assert rel_err(out_t[rows], want) <= tol
        assert rel_err(out_k[rows], want) <= tol
        assert_lse_close(lse_k[rows], want_lse.float(), 50 * tol)


def test_queries_that_see_no_key():
    """Queries before every visible key, and a sequence with no entries: out 0, lse -inf."""
    inv = rope_inv_freq(64, 10000.0)
    case = build([([20], 3), ([], 0)], 16, 2, 64, inv, base=100)
    q = torch.randn(4, 4, 64)
    q_pos = torch.tensor([5, 99, 121, 7], dtype=torch.int32)  # 5 and 99 precede position 100
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)
    for backend in ("torch", "triton"):
        out, lse = _run(case, q, q_pos, cu_q, 0.125, backend)
        assert torch.equal(out[[0, 1, 3]], torch.zeros_like(out[[0, 1, 3]]))
        assert torch.isneginf(lse[[0, 1, 3]]).all() and torch.isfinite(lse[2]).all()
        assert out[2].abs().sum() > 0


def test_rotation_is_applied():
    """A chunk moved to another offset changes the result (the kernel does not ignore offsets)."""
    inv = rope_inv_freq(64, 10000.0)
    case = build([([48], 0)], 16, 1, 64, inv)
    q = torch.randn(2, 2, 64)
    q_pos = torch.tensor([60, 61], dtype=torch.int32)
    cu_q = torch.tensor([0, 2], dtype=torch.int32)
    base, _ = _run(case, q, q_pos, cu_q, 0.125, "triton")
    case.offsets += 5
    moved, _ = _run(case, q, q_pos, cu_q, 0.125, "triton")
    want, _ = _run(case, q, q_pos, cu_q, 0.125, "torch")
    assert rel_err(moved, base) > 1e-3
    assert rel_err(moved, want) <= TOL[torch.float32]


def test_offset_groups():
    """Runs of one offset inside each sequence; empty sequences own no group."""
    offsets = torch.tensor([0, 0, 7, 7, 7, 0, 3, 3, 3, 0], dtype=torch.int32)
    cu = torch.tensor([0, 4, 4, 6, 10, 10], dtype=torch.int32)  # sequences of 4, 0, 2, 4, 0 entries
    starts, cu_groups = offset_groups(offsets, cu)
    # seq0: [0,1] [2,3]; seq2: [4] [5]; seq3: [6,7,8] [9]
    assert starts.tolist()[:7] == [0, 2, 4, 5, 6, 9, 10] and set(starts.tolist()[7:]) == {10}
    assert cu_groups.tolist() == [0, 2, 2, 4, 6, 6]


@pytest.mark.parametrize("bs,nb", [(16, 4), (32, 2), (64, 1)])
def test_step_key_bounds(bs, nb):
    """The per-step bound that lets the kernel skip masking: the latest key position over entries
    e..e+nb-1, or INT32_MAX when any of them hides a slot or lies past the table's end."""
    inv = rope_inv_freq(64, 10000.0)
    case = build([([70, 40], 9), ([33], 50)], bs, 1, 64, inv, hide=0.05 if bs < 64 else 0.0, base=1000)
    packed = pack(case.block_ids, case.offsets, case.masks, bs, inv, with_table=False, cu_entries=case.cu_entries)
    got = step_key_bounds(packed, case.slot_pos, bs, nb)
    ids, offs = case.block_ids.long(), case.offsets.long()
    full = (case.masks.long() == (1 << bs) - 1) if bs < 64 else (case.masks.long() == -1)
    last = offs + case.slot_pos[ids].long().amax(dim=1)
    big = 2**31 - 1
    per_entry = torch.where(full, last, big)
    n = ids.numel()
    want = [max(int(per_entry[e + j]) if e + j < n else big for j in range(nb)) for e in range(n)]
    assert got.tolist() == want
    assert (per_entry < big).any() and (per_entry == big).any()  # both kinds of entry are exercised


def test_group_suffix_min():
    """Per entry, the minimum over it and the later entries of its group; starts padded with E."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 1000, (23,), generator=g, dtype=torch.int32)
    x[[4, 9, 22]] = 2**31 - 1  # entries that show no key
    starts = torch.tensor([0, 5, 6, 12, 23, 23, 23], dtype=torch.int32)
    bounds = starts.tolist()
    want = []
    for e in range(23):
        end = next(b for b in bounds if b > e)
        want.append(min(x[e:end].tolist()))
    assert group_suffix_min(x, starts).tolist() == want


@pytest.mark.parametrize("bs", [16, 64])
def test_key_floors(bs):
    """The floors the kernel cuts future keys by: per entry, the earliest visible key position (offset + slot
    position) of it and of every later entry of its offset group; INT32_MAX where none is visible."""
    inv = rope_inv_freq(64, 10000.0)
    case = build([([70, 40], 9), ([33], 50)], bs, 1, 64, inv, hide=0.3 if bs < 64 else 0.0, base=1000)
    case.masks[0] = 0  # an entry that shows no key (the group's later entries still set its floor)
    packed = pack(case.block_ids, case.offsets, case.masks, bs, inv, with_table=False, cu_entries=case.cu_entries)
    hi, floors = step_key_bounds(packed, case.slot_pos, bs, 2, floors=True)
    assert torch.equal(hi, step_key_bounds(packed, case.slot_pos, bs, 2))
    ids, offs, masks = case.block_ids.long(), case.offsets.long(), case.masks.long()
    big, n = 2**31 - 1, ids.numel()
    first = []
    for e in range(n):
        shown = [s for s in range(bs) if (int(masks[e]) >> s) & 1]
        first.append(min(int(offs[e]) + int(case.slot_pos[ids[e], s]) for s in shown) if shown else big)
    starts = packed.group_starts.tolist()
    want = [min(first[e:next(b for b in starts if b > e)]) for e in range(n)]
    assert floors.tolist() == want
    assert first[0] == big and want[0] < big


@pytest.mark.parametrize("cfg", [PrefillConfig(block_m=32, min_block_n=32), PrefillConfig(block_m=16, min_block_n=16,
                                 num_splits=3), PrefillConfig(block_m=32, min_block_n=32, num_splits=2, exact_tiles=True),
                                 PrefillConfig(block_m=32, min_block_n=32, cut_lanes=2)],
                         ids=["one-split", "3-splits", "2-splits-exact", "2-lanes"])
@pytest.mark.slow
def test_future_cut_gives_the_same_bits(cfg):
    """Skipping a group's entries whose keys all lie after the tile's latest query drops terms exp(-inf) = 0:
    the same bits as walking them (scattered queries, as CacheBlend's recomputed tokens; hidden slots; two
    sequences; a group longer than cut_lanes is not cut)."""
    import dataclasses

    inv = rope_inv_freq(64, 500000.0, LLAMA3)
    case = build([([60, 75, 40], 6), ([50], 9)], 16, 2, 64, inv, dtype=torch.bfloat16, hide=0.2)
    q, q_pos, cu_q = prefill_queries(case, [6, 9], [20, 7], 8, torch.bfloat16)
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=True, cu_entries=case.cu_entries)
    runs = [launch(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 0.125,
                   cfg=dataclasses.replace(cfg, cut_future=cut)) for cut in (True, False)]
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    out_t, _ = _run(case, q, q_pos, cu_q, 0.125, "torch")
    assert rel_err(runs[0][0], out_t) <= TOL[torch.bfloat16]


@pytest.mark.slow
def test_padding_tiles_skipped_with_the_same_bits():
    """A static tail pads its queries with rows at position -1, which see no key: a tile of them walks no group
    (skip_empty_tiles), with the same bits as walking them, and their outputs are 0 with LSE -inf."""
    import dataclasses

    inv = rope_inv_freq(64, 10000.0)
    case = build([([60, 45], 7)], 16, 2, 64, inv, dtype=torch.bfloat16, hide=0.1)
    q, q_pos, cu_q = prefill_queries(case, [7], [12], 8, torch.bfloat16)
    pad = 21  # past two whole 8-token tiles
    q = torch.cat([q, torch.randn(pad, *q.shape[1:]).to(q.dtype)])
    q_pos = torch.cat([q_pos, torch.full((pad,), -1, dtype=torch.int32)])
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=True, cu_entries=case.cu_entries)
    cfg = PrefillConfig(block_m=32, min_block_n=32)
    runs = [launch(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 0.125,
                   cfg=dataclasses.replace(cfg, skip_empty_tiles=skip, cut_future=cut))
            for skip, cut in ((True, True), (False, True), (True, False), (False, False))]
    for out, lse in runs[1:]:
        assert torch.equal(runs[0][0], out) and torch.equal(runs[0][1], lse)
    assert torch.equal(runs[0][0][-pad:], torch.zeros_like(runs[0][0][-pad:]))
    assert torch.isneginf(runs[0][1][-pad:]).all() and torch.isfinite(runs[0][1][:-pad]).all()


def test_cut_lanes_is_checked():
    with pytest.raises(ValueError, match="cut_lanes"):
        PrefillConfig(cut_lanes=3)


# every way of rotating the query (bench/kernels/kernels.py --rotation times them): same result as the twin
ROTATION_VARIANTS = [PrefillConfig(block_m=32, min_block_n=32, rot_mode=m, rot_narrow=n)
                     for m in ROT_MODES for n in (False, True)]


@pytest.mark.parametrize("cfg", ROTATION_VARIANTS, ids=[
    f"{c.rot_mode}{'-narrow' if c.rot_narrow else ''}" for c in ROTATION_VARIANTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.slow
def test_rotation_variants_match_twin(cfg, dtype):
    """Three offset groups and a private suffix per sequence (so a tile rotates its query for several
    groups, the first and last included), hidden slots, GQA 4, scattered queries, a one-token sequence;
    with rotation switched off, each variant computes what the default computes without it."""
    inv = rope_inv_freq(64, 500000.0, LLAMA3)
    case = build([([40, 23, 30], 5), ([1], 1)], 16, 2, 64, inv, dtype=dtype, hide=0.1, base=700)
    q, q_pos, cu_q = prefill_queries(case, [5, 1], [3, 0], 8, dtype)
    want, want_lse = _run(case, q, q_pos, cu_q, 0.125, "torch")
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=dtype != torch.float32,
                  cu_entries=case.cu_entries)  # cos/sin from the table (bf16) or computed (fp32)
    args = (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 0.125)
    out, lse = launch(*args, cfg=cfg)
    assert rel_err(out, want) <= TOL[dtype]
    assert_lse_close(lse, want_lse, 50 * TOL[dtype])
    plain, _ = launch(*args, rotate=False, cfg=PrefillConfig(block_m=32, min_block_n=32))
    assert rel_err(launch(*args, rotate=False, cfg=cfg)[0], plain) <= TOL[dtype]
    assert rel_err(plain, want) > 10 * TOL[dtype]  # the rotation matters in this case


def test_rotation_mode_is_checked():
    for gone in ("carried", "split", "prefetch", "sideways"):  # the modes that lost are refused like any unknown one
        with pytest.raises(ValueError, match="rot_mode"):
            PrefillConfig(rot_mode=gone)


@pytest.mark.parametrize("splits", [2, 5, 16])
@pytest.mark.slow
def test_kv_splits_touch_only_their_groups(splits):
    """KV splits search the offset groups their entries touch: a split narrower than a group, one
    spanning several, and (16 splits over a sequence of 4 entries) splits with no entry at all all
    merge to the twin's result; the key bounds computed once and passed in give the same result."""
    from kernels.paged_attention.triton import paged_prefill_packed, prefill_key_bounds

    inv = rope_inv_freq(64, 500000.0, LLAMA3)
    case = build([([40, 23, 30, 17], 6), ([50], 2), ([1], 1)], 16, 2, 64, inv, dtype=torch.float32, hide=0.1,
                 base=300)
    q, q_pos, cu_q = prefill_queries(case, [6, 2, 1], [4, 0, 0], 8, torch.float32)
    want, want_lse = _run(case, q, q_pos, cu_q, 0.125, "torch")
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=False, cu_entries=case.cu_entries)
    args = (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 0.125)
    out, lse = launch(*args, cfg=PrefillConfig(block_m=32, min_block_n=32, num_splits=splits))
    assert rel_err(out, want) <= TOL[torch.float32]
    assert_lse_close(lse, want_lse, 50 * TOL[torch.float32])
    key_hi = prefill_key_bounds(packed, case.slot_pos)
    out_k, _ = paged_prefill_packed(*args, num_splits=splits, key_hi=key_hi)
    assert rel_err(out_k, want) <= TOL[torch.float32]
    with pytest.raises(ValueError, match="key_hi"):
        paged_prefill_packed(*args, num_splits=splits, key_hi=key_hi[:1])


# the short-query knobs that remain (bench/short_attention/short_attention.py times them): exact tiles, the split
# count, the merge that loads every part at once, 128 keys a step
SHORT_VARIANTS = [
    PrefillConfig(block_m=32, min_block_n=32, num_splits=s, exact_tiles=True, merge=m)
    for s, m in ((2, "loop"), (5, "all"), (8, "all"))] + [
    PrefillConfig(block_m=32, min_block_n=64, num_splits=3, merge="all")]


@pytest.mark.parametrize("cfg", SHORT_VARIANTS, ids=[
    f"splits{c.num_splits}-{c.merge}-n{c.min_block_n}" + ("-exact" if c.exact_tiles else "") for c in SHORT_VARIANTS])
@pytest.mark.slow
def test_short_query_knobs_match_twin(cfg):
    """Several sequences (groups narrower and wider than a split, a one-entry sequence, more splits than
    steps), hidden slots, scattered queries, a 17-token suffix (a partial tile): equal to the twin; then one
    sequence alone, where exact_tiles drops the spare tile."""
    inv = rope_inv_freq(64, 500000.0, LLAMA3)
    case = build([([40, 23, 30, 17], 17), ([50], 2), ([1], 1)], 16, 2, 64, inv, dtype=torch.float32, hide=0.1,
                 base=300)
    q, q_pos, cu_q = prefill_queries(case, [17, 2, 1], [4, 0, 0], 8, torch.float32)
    want, want_lse = _run(case, q, q_pos, cu_q, 0.125, "torch")
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=True, cu_entries=case.cu_entries)
    args = (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 0.125)
    out, lse = launch(*args, cfg=cfg)
    assert rel_err(out, want) <= TOL[torch.float32]
    assert_lse_close(lse, want_lse, 50 * TOL[torch.float32])
    one = build([([70, 33, 16], 21)], 16, 2, 64, inv, dtype=torch.bfloat16, hide=0.05, base=5000)
    q1, p1, cu1 = prefill_queries(one, [21], [2], 8, torch.bfloat16)
    want1, _ = _run(one, q1, p1, cu1, 0.125, "torch")
    packed1 = pack(one.block_ids, one.offsets, one.masks, 16, inv, with_table=True, cu_entries=one.cu_entries)
    out1, _ = launch(q1, p1, one.k_cache, one.v_cache, one.slot_pos, packed1, cu1, inv, 0.125, cfg=cfg)
    assert rel_err(out1, want1) <= TOL[torch.bfloat16]


def test_short_query_knobs_are_checked():
    for gone in ("plan", "prefetch_kv", "index32", "narrow_partials", "group_guard"):  # removed with their variants
        with pytest.raises(TypeError, match=gone):
            PrefillConfig(**{gone: True})
    with pytest.raises(ValueError, match="merge"):
        PrefillConfig(merge="tree")


@pytest.mark.parametrize("min_block_n", [64, 128])
@pytest.mark.slow
def test_short_prefill_config_is_used_for_short_calls(monkeypatch, min_block_n):
    """triton.SHORT_PREFILL configures paged_prefill_packed's calls of few tokens (and only those); key bounds
    computed for the default's step are recomputed when the short configuration steps differently."""
    from kernels.paged_attention import triton as kt

    inv = rope_inv_freq(64, 500000.0, LLAMA3)
    case = build([([200, 150], 9)], 16, 2, 64, inv, dtype=torch.float32, base=900)  # groups of 13 and 10 entries
    case.masks[5] &= ~(1 << 3)  # a slot hidden in the second half of a 128-key step whose first half is whole
    case.masks[19] &= ~(1 << 9)
    q, q_pos, cu_q = prefill_queries(case, [9], [2], 8, torch.float32)
    want, want_lse = _run(case, q, q_pos, cu_q, 0.125, "torch")
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=False, cu_entries=case.cu_entries)
    short = PrefillConfig(block_m=32, min_block_n=min_block_n, num_splits=3, exact_tiles=True, merge="all")
    monkeypatch.setattr(kt, "SHORT_PREFILL", short)
    assert kt.prefill_config(11) == short and kt.prefill_config(11, 2).num_splits == 2
    # longer calls: the default tile, future keys cut and padding tiles skipped (kt.LONG_PREFILL)
    assert kt.prefill_config(kt.SHORT_PREFILL_TOKENS + 1) == PrefillConfig(cut_future=True, skip_empty_tiles=True)
    assert not short.cut_future and not PrefillConfig().cut_future
    key_hi = kt.prefill_key_bounds(packed, case.slot_pos)
    out, lse = kt.paged_prefill_packed(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 0.125,
                                       key_hi=key_hi)
    assert rel_err(out, want) <= TOL[torch.float32]
    assert_lse_close(lse, want_lse, 50 * TOL[torch.float32])
