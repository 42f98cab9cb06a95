"""Triton prefill attention over lazily rotated paged keys (see reference.py for the layout).

One program per (tile of BLOCK_T query tokens of one sequence, KV head). The tile's rows are
(token, group head) pairs, so all GQA heads of a KV head share each K/V tile it loads:
    row r -> token t0 + r // G_PAD, query head h * G + r % G_PAD      (BLOCK_M = BLOCK_T * G_PAD rows)

Deferred RoPE without touching the keys: the outer loop walks the sequence's offset groups (runs
of entries with one offset: a placed chunk, or the private blocks; see _meta.py) and rotates the
query tile BACKWARDS by the group's offset once per group, from the original query in fp32:
    (R_m q) . (R_{o+j} k) == (R_{m-o} q) . (R_j k)
The inner loop is then a plain flash-attention loop over the group's blocks, NB at a time
(BLOCK_N = NB * BS keys): K tiles go from memory to the tensor cores unmodified. (The first
version rotated every K tile forward in registers instead: 38-50% slower, see bench/kernels/README.md.)
The rotated query is carried by the group loop (see the NOTE in the kernel), so tl.dot reads it
from shared memory, as it would a loaded query; PrefillConfig.rot_mode picks when the next group's
rotation is computed (_prefill_query.py).
Causality compares global positions (offset + slot_pos <= q_pos), so queries may be scattered
anywhere in the context (CacheBlend's recomputed tokens), not only a suffix. The mask is applied
only on steps that need it: a key later than the tile's oldest query, a hidden slot, or a group's
partial last step. One small launch before the kernel (step_key_bounds) writes each step's latest
key position, so that the kernel decides this from one int per step, without reading slot positions.
Optional KV splits (flash-decoding style) write fp32 partials that kernels/lse_merge merges (the split programs
merging their own partials measured slower on an H100 and was removed: bench/short_attention/README.md).

With kernels/pdl.py's switch on (sm_90+), the kernel and its key-bounds pass are programmatic dependent
launches: each program waits for the kernel before (griddepcontrol.wait) before its first read.

Tiles are found without a host sync: sequence b owns tile ids [cu_q[b] // BLOCK_T + b, ...), a
tile past the sequence's end does nothing. The grid is Tq // BLOCK_T + B tiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.lse_merge.triton import merge_rows
from kernels.pdl import enter as pdl_enter
from kernels.paged_attention._meta import ID_SHIFT_C, OFFSET_MASK_C, OFFSET_SHIFT_C, PackedTable, dot_f32, sm_count
from kernels.paged_attention._prefill_query import ROT_MODES, cos_sin, join_halves, query_halves, rotate_halves, rotated_query

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
INT32_MAX = tl.constexpr(2**31 - 1)
BOUNDS_BLOCK = 128  # entries per program of _key_bounds_kernel
MERGES = ("loop", "all")


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tile shape: BLOCK_M query rows (tokens x group heads), at least min_block_n keys per step."""

    block_m: int = 64  # defaults: the fastest of bench/kernels/kernels.py's sweep on an H100
    min_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int | None = None  # KV splits (flash-decoding style); None picks from the grid
    # when the next offset group's rotated query is made (_prefill_query.py; every mode compared in
    # bench/kernels/README.md): "prefetch_cs" (the default) loads its cos/sin before the current group's step loop
    # and rotates after it; "early" rotates before the step loop (with rot_narrow the fastest, 1-2%, but about
    # 3.5x the output error in bf16). The other modes timed there ("carried", "split", "prefetch") lost and were
    # removed. What is held across the step loop lands in local memory (L1): the loop has no registers to spare
    rot_mode: str = "prefetch_cs"
    # the rotation's arithmetic in q's 16-bit type (packed two-lane FMAs, cos/sin rounded to it, as
    # Hugging Face's eager RoPE does in bf16 models) instead of fp32: half the instructions after the
    # step loop, but about 3.5x the output error in bf16 (bench/kernels/README.md)
    rot_narrow: bool = False
    # short queries (a 64-token suffix over many chunks: few query tiles, many KV splits; bench/short_attention/):
    # one tile per BLOCK_T tokens when there is one sequence (else one spare tile per sequence, past its end)
    exact_tiles: bool = False
    # how split partials are merged by the second launch (kernels/lse_merge): "loop" over parts or "all" parts
    # loaded at once
    merge: str = "loop"
    min_split_steps: int = 8  # the automatic split count leaves each split at least this many steps
    # (the short-query knobs that measured slower for the 64-token suffix, bench/short_attention/README.md, were
    # removed: splits of whole steps, K/V prefetched to L2, 32-bit step indices, 16-bit split partials)
    # skip each offset group's entries from the first whose visible keys all lie after the tile's latest query
    # (they would add exp(-inf) = 0): read from the table's key floors (step_key_bounds(floors=True)), up to
    # cut_lanes entries of a group at once. Queries scattered over a sequence (CacheBlend's recomputed tokens)
    # otherwise walk every key of it; a suffix after its chunks has nothing to cut. (On for the engine's long
    # calls: kernels/paged_attention/triton.py, prefill_config.)
    cut_future: bool = False
    cut_lanes: int = 256
    # a query tile whose rows are all padding (position -1, as a static tail pads) walks no key (likewise)
    skip_empty_tiles: bool = False

    def __post_init__(self):
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m must be a power of two >= 16, got {self.block_m}")
        if self.rot_mode not in ROT_MODES:
            raise ValueError(f"rot_mode must be one of {ROT_MODES}, got {self.rot_mode!r}")
        if self.merge not in MERGES:
            raise ValueError(f"merge must be one of {MERGES}, got {self.merge!r}")
        if self.cut_lanes < 1 or self.cut_lanes & (self.cut_lanes - 1):
            raise ValueError(f"cut_lanes must be a power of two, got {self.cut_lanes}")


@triton.jit
def _prefill_kernel(
    q_ptr, qpos_ptr, k_ptr, v_ptr, slotpos_ptr, meta_ptr, mask_ptr, tab_ptr, invf_ptr, hi_ptr,
    cu_q_ptr, starts_ptr, cu_g_ptr, out_ptr, lse_ptr,
    n_seqs, n_split, qk_scale,
    stride_qt, stride_qh, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
    stride_kb, stride_ks, stride_kh,
    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BS: tl.constexpr, NB: tl.constexpr,
    D: tl.constexpr, B_PAD: tl.constexpr,
    ROTATE: tl.constexpr, USE_TABLE: tl.constexpr, MASK_IN_WORD: tl.constexpr, DOT_F32: tl.constexpr,
    ROT_MODE: tl.constexpr, ROT_NARROW: tl.constexpr, SEARCH: tl.constexpr, PDL: tl.constexpr = False,
    lo_ptr=None, CUT: tl.constexpr = False, CUT_LANES: tl.constexpr = 1, SKIP_EMPTY: tl.constexpr = False,
):
    BLOCK_M: tl.constexpr = BLOCK_T * G_PAD
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if PDL:  # kernels/pdl.py: every input (the packed table too) may come from a kernel of this pass: wait first
        pdl_enter(PDL)

    # which sequence owns this tile: the last b with cu_q[b] // BLOCK_T + b <= tile
    bi = tl.arange(0, B_PAD)
    starts = tl.load(cu_q_ptr + bi, mask=bi < n_seqs, other=0) // BLOCK_T + bi
    b = tl.sum(((starts <= tile) & (bi < n_seqs)).to(tl.int32), axis=0) - 1
    q_lo = tl.load(cu_q_ptr + b)
    q_hi = tl.load(cu_q_ptr + b + 1)
    g_lo = tl.load(cu_g_ptr + b)
    g_hi = tl.load(cu_g_ptr + b + 1)
    t0 = q_lo + (tile - (q_lo // BLOCK_T + b)) * BLOCK_T
    g_hi = tl.where(t0 < q_hi, g_hi, g_lo)  # a tile past the sequence's end loops zero times
    # this split's share of the sequence's entries
    e_lo = tl.load(starts_ptr + g_lo)
    e_hi = tl.load(starts_ptr + g_hi)
    per = tl.cdiv(e_hi - e_lo, n_split)
    lo = e_lo + split * per
    hi = tl.minimum(lo + per, e_hi)
    if SEARCH:
        # the groups this split's entries [lo, hi) touch (binary searches over the group starts): a split
        # rotates its query only for those, not for every group of the sequence (a short suffix over
        # many chunks runs on many splits, each a group or two wide)
        a = g_lo
        b = g_hi
        while a < b:  # the first group ending after lo
            mid = (a + b) // 2
            if tl.load(starts_ptr + mid + 1) > lo:
                b = mid
            else:
                a = mid + 1
        g_lo = a
        b = g_hi
        while a < b:  # the first group starting at or after hi
            mid = (a + b) // 2
            if tl.load(starts_ptr + mid) >= hi:
                b = mid
            else:
                a = mid + 1
        g_hi = a
        e_lo = tl.load(starts_ptr + g_lo)

    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // G_PAD
    g = r % G_PAD
    row_ok = (tok < q_hi) & (g < G)
    head = h * G + g
    dd = tl.arange(0, D)
    q_row = q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_pos = tl.load(qpos_ptr + tok, mask=row_ok, other=-1)  # a padding row sees nothing
    q_min = tl.min(tl.where(row_ok, q_pos, INT32_MAX), axis=0)  # keys at or before it need no causal mask
    q_max = tl.max(tl.where(row_ok, q_pos, -1), axis=0)  # keys after it are in every row's future
    if SKIP_EMPTY:  # a tile whose rows all sit at position -1 (a static tail's padding) sees no key: no group
        g_hi = tl.where(q_max < 0, g_lo, g_hi)
    q_dtype: tl.constexpr = tl.float32 if DOT_F32 else q_ptr.dtype.element_ty  # the interpreter's dot: fp32
    if ROTATE:
        # NOTE: the rotated query is carried by the group loop (rotated for the next group at the end
        # of each iteration, or before its step loop in "early" mode), so that tl.dot sees a loop
        # argument and reads it from shared memory as it does a loaded query; computed inside the
        # iteration, Triton keeps it in registers and reloads it every step (255 registers and
        # spills, 3-10% slower: bench/kernels/README.md)
        qa = rotated_query(q_ptr, tok, head, row_ok, stride_qt, stride_qh, e_lo, g_lo < g_hi, meta_ptr, tab_ptr,
                           invf_ptr, q_dtype, BLOCK_M, D, USE_TABLE, ROT_NARROW, DOT_F32)
    else:
        qa = tl.load(q_row + dd[None, :], mask=row_ok[:, None], other=0.0).to(q_dtype)  # [BLOCK_M, D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    e_first = e_lo  # group grp is entries e_first..e_next; the group after it ends where starts[grp + 2] says
    e_next = tl.load(starts_ptr + g_lo + 1)
    for grp in range(g_lo, g_hi):
        e_after = tl.load(starts_ptr + grp + 2)  # read a group early: only the next iteration waits for it
        off = ((tl.load(meta_ptr + e_first) >> OFFSET_SHIFT_C) & OFFSET_MASK_C).to(tl.int32)
        e_begin = tl.maximum(e_first, lo)
        e_end = tl.minimum(e_next, hi)
        if CUT:  # the group's entries from the first whose keys all lie after q_max on: in every row's future
            e_end = tl.minimum(e_end, future_cut(lo_ptr, e_first, e_next, q_max, CUT_LANES))
        if ROTATE:  # the next group's rotation ("early"), or its cos/sin ("prefetch_cs"), before this group's steps
            has_next = grp + 1 < g_hi
            if ROT_MODE == "early":
                qn = rotated_query(q_ptr, tok, head, row_ok, stride_qt, stride_qh, e_next, has_next, meta_ptr,
                                   tab_ptr, invf_ptr, q_dtype, BLOCK_M, D, USE_TABLE, ROT_NARROW, DOT_F32)
            else:
                cos_n, sin_n = cos_sin(e_next, has_next, meta_ptr, tab_ptr, invf_ptr, D, USE_TABLE)
                if ROT_NARROW:  # held across the step loop in 16 bits: half the registers
                    cos_n, sin_n = cos_n.to(q_ptr.dtype.element_ty), sin_n.to(q_ptr.dtype.element_ty)
        # a group outside this split's entries loops zero times (no guard around it: with one, Triton 3.6 keeps
        # the softmax in two layouts, ~9% more instructions a step; bench/kernels/README.md)
        m_i, l_i, acc = _group_attention(
            qa, q_pos, q_min, m_i, l_i, acc, off, e_begin, e_end, k_ptr, v_ptr, slotpos_ptr, meta_ptr,
            mask_ptr, hi_ptr, qk_scale, stride_kb, stride_ks, stride_kh, h, BS, NB, D, MASK_IN_WORD, DOT_F32)
        if ROTATE:
            if ROT_MODE == "early":
                qa = qn
            elif grp + 1 < g_hi:
                qn1, qn2 = query_halves(q_ptr, tok, head, row_ok, stride_qt, stride_qh, D, q_ptr.dtype.element_ty)
                r1, r2 = rotate_halves(qn1, qn2, cos_n, sin_n, ROT_NARROW, DOT_F32)
                qa = join_halves(r1, r2, BLOCK_M, D).to(q_dtype)
        e_first = e_next
        e_next = e_after

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    o_rows = tok.to(tl.int64) * stride_ot + head * stride_oh
    l_rows = tok.to(tl.int64) * stride_lt + head
    o_row = out_ptr + split * stride_os + o_rows[:, None]
    tl.store(o_row + dd[None, :], (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + split * stride_ls + l_rows, lse, mask=row_ok)


@triton.jit
def future_cut(lo_ptr, e_first, e_next, q_max, LANES: tl.constexpr):
    """The first entry of group [e_first, e_next) from which on no visible key is at or before q_max, read from
    the group's key floors (lo_ptr: per entry, the earliest visible key position of it and every later entry of
    its group, so non-decreasing along the group: the entries at or before q_max are a prefix). A group longer
    than LANES whose first LANES entries all reach q_max is not cut (e_next)."""
    i = tl.arange(0, LANES)
    floor = tl.load(lo_ptr + e_first + i, mask=e_first + i < e_next, other=INT32_MAX)
    n = tl.sum((floor <= q_max).to(tl.int32), axis=0)
    return tl.where(n == LANES, e_next, e_first + n)


@triton.jit
def _group_attention(qa, q_pos, q_min, m_i, l_i, acc, off, e_begin, e_end, k_ptr, v_ptr, slotpos_ptr, meta_ptr,
                     mask_ptr, hi_ptr, qk_scale, stride_kb, stride_ks, stride_kh, h,
                     BS: tl.constexpr, NB: tl.constexpr, D: tl.constexpr, MASK_IN_WORD: tl.constexpr,
                     DOT_F32: tl.constexpr):
    """Online softmax of the (rotated) query tile qa [BLOCK_M, D] over entries e_begin..e_end of one offset group.

    A step whose keys are all visible and no later than the tile's oldest query (hi[] of its
    entries <= q_min: known from NB uniform loads, no cross-thread reduction) skips the mask and
    reads no slot position; only the others (a group's partial last step, the causal diagonal,
    hidden slots) read slot positions and mask."""
    BLOCK_N: tl.constexpr = NB * BS
    n = tl.arange(0, BLOCK_N)
    slot = n % BS
    dd = tl.arange(0, D)
    for e_start in range(e_begin, e_end, NB):
        e = e_start + n // BS  # [BLOCK_N] entry of each key row
        e_ok = e < e_end
        word = tl.load(meta_ptr + e, mask=e_ok, other=0)
        blk = word >> ID_SHIFT_C
        if MASK_IN_WORD:
            bits = word
        else:
            bits = tl.load(mask_ptr + e, mask=e_ok, other=0)
        vis = (((bits >> slot) & 1) != 0) & e_ok
        k_row = blk * stride_kb + slot * stride_ks + h * stride_kh  # [BLOCK_N] int64
        k = tl.load(k_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        k_hi = tl.load(hi_ptr + e_start, mask=e_start + NB <= e_end, other=INT32_MAX)  # a partial step masks
        if DOT_F32:
            k = k.to(tl.float32)
        qk = tl.dot(qa, tl.trans(k))  # [BLOCK_M, BLOCK_N] fp32, unscaled
        if k_hi > q_min:  # some key is hidden, missing (partial step) or later than some query
            k_pos = off + tl.load(slotpos_ptr + blk * BS + slot, mask=vis, other=0)
            k_pos = tl.where(vis, k_pos, INT32_MAX)
            qk = tl.where(k_pos[None, :] <= q_pos[:, None], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)  # running max of scaled scores (log2 units)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.math.exp2(qk * qk_scale - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        acc = acc * alpha[:, None]
        if DOT_F32:
            acc = tl.dot(p, v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _key_bounds_kernel(meta_ptr, mask_ptr, slotpos_ptr, hi_ptr, n,
                       BS: tl.constexpr, BS_PAD: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
                       MASK_IN_WORD: tl.constexpr, PDL: tl.constexpr = False, lo_ptr=None, LO: tl.constexpr = False):
    """hi[e] = the latest global key position of entries e..e+NB-1 (one step of the prefill loop),
    or INT32_MAX when one of them has a hidden slot or lies past the table's end. LO: also lo[e] = the
    earliest global position of entry e's visible keys (INT32_MAX when it shows none)."""
    if PDL:  # the table was just packed by a kernel: wait for it (kernels/pdl.py)
        pdl_enter(PDL)
    e0 = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, BS_PAD)
    s_ok = s < BS
    hi = tl.full([BLOCK], -1, tl.int32)
    for j in tl.static_range(NB):
        e = e0 + j
        ok = e < n
        word = tl.load(meta_ptr + e, mask=ok, other=0)
        bits = word if MASK_IN_WORD else tl.load(mask_ptr + e, mask=ok, other=0)
        shown = (((bits[:, None] >> s[None, :].to(tl.int64)) & 1) != 0) & s_ok[None, :]
        full = (tl.sum(shown.to(tl.int32), axis=1) == BS) & ok
        pos = tl.load(slotpos_ptr + (word >> ID_SHIFT_C)[:, None] * BS + s[None, :], mask=ok[:, None] & s_ok[None, :],
                      other=0)
        last = ((word >> OFFSET_SHIFT_C) & OFFSET_MASK_C).to(tl.int32) + tl.max(pos, axis=1)
        hi = tl.maximum(hi, tl.where(full, last, INT32_MAX))
        if LO and j == 0:
            first = tl.min(tl.where(shown, pos, INT32_MAX), axis=1)
            first = tl.where(first == INT32_MAX, INT32_MAX, ((word >> OFFSET_SHIFT_C) & OFFSET_MASK_C).to(tl.int32) + first)
            tl.store(lo_ptr + e0, first, mask=ok)
    tl.store(hi_ptr + e0, hi, mask=e0 < n)


def launch(q, q_pos, k_cache, v_cache, slot_pos, packed: PackedTable, cu_q, inv_freq, scale,
           *, rotate: bool = True, cfg: PrefillConfig = PrefillConfig(), key_hi: torch.Tensor | None = None,
           key_floor: torch.Tensor | None = None):
    """Run the prefill kernel on a table packed with its offset groups (pack(..., cu_entries=)).
    ``key_hi`` (and, with cfg.cut_future, ``key_floor``): step_key_bounds of this table at cfg's step, when the
    caller computed them already.
    Returns out [Tq, Hq, D] (q.dtype), lse [Tq, Hq] fp32."""
    if packed.cu_groups is None:
        raise ValueError("prefill needs the table's offset groups: pack it with cu_entries")
    t, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    block_t = max(1, cfg.block_m // g_pad)
    n_seqs = cu_q.numel() - 1
    nb = max(1, cfg.min_block_n // bs)
    n_entries = packed.meta.numel()
    # sequence b's tiles start at cu_q[b] // BLOCK_T + b (no host sync), so each sequence may own one tile past
    # its end; with one sequence the exact count is known
    n_tiles = triton.cdiv(t, block_t) if cfg.exact_tiles and n_seqs == 1 else t // block_t + n_seqs
    nsplit = cfg.num_splits or pick_splits(n_tiles * hkv, n_entries // max(1, n_seqs) // nb, q.device,
                                           cfg.min_split_steps)
    if nsplit == 1:
        out = torch.empty_like(q)
        lse = torch.empty((t, hq), dtype=torch.float32, device=q.device)
    else:  # partial results per split, merged by LSE below
        out = torch.empty((nsplit, t, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((nsplit, t, hq), dtype=torch.float32, device=q.device)
    if t == 0:
        return (out, lse) if nsplit == 1 else (torch.empty_like(q), lse[0])
    if key_hi is None or (cfg.cut_future and key_floor is None):
        bounds = step_key_bounds(packed, slot_pos, bs, nb, floors=cfg.cut_future)
        key_hi, key_floor = bounds if cfg.cut_future else (bounds, None)
    for name, b in (("key_hi", key_hi), ("key_floor", key_floor if cfg.cut_future else None)):
        if b is not None and b.numel() < packed.meta.numel():
            raise ValueError(f"{name} has {b.numel()} bounds for {packed.meta.numel()} entries")
    grid = (n_tiles, hkv, nsplit)
    _prefill_kernel[grid](
        q, q_pos, k_cache, v_cache, slot_pos, packed.meta, packed.masks,
        packed.table if packed.table is not None else packed.meta, inv_freq, key_hi,
        cu_q, packed.group_starts, packed.cu_groups, out, lse,
        n_seqs, nsplit, float(scale) * LOG2E.value,
        q.stride(0), q.stride(1), *(out.stride()[:3] if nsplit > 1 else (0, *out.stride()[:2])),
        *(lse.stride()[:2] if nsplit > 1 else (0, lse.stride(0))),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        G=group, G_PAD=g_pad, BLOCK_T=block_t, BS=bs, NB=nb, D=dim,
        B_PAD=triton.next_power_of_2(n_seqs + 1),
        ROTATE=rotate, USE_TABLE=packed.table is not None, MASK_IN_WORD=packed.mask_in_word,
        DOT_F32=dot_f32(q.dtype), ROT_MODE=cfg.rot_mode, ROT_NARROW=cfg.rot_narrow, SEARCH=nsplit > 1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl.launch_kwargs(q.device),
        **(dict(lo_ptr=key_floor, CUT=True, CUT_LANES=cfg.cut_lanes) if cfg.cut_future else {}),
        **(dict(SKIP_EMPTY=True) if cfg.skip_empty_tiles else {}),
    )
    if nsplit == 1:
        return out, lse
    merged, merged_lse = merge_rows(out.reshape(nsplit, t * hq, dim), lse.reshape(nsplit, t * hq), q.dtype,
                                    all_parts=cfg.merge == "all")
    return merged.reshape(t, hq, dim), merged_lse.reshape(t, hq)


def step_key_bounds(packed: PackedTable, slot_pos: torch.Tensor, bs: int, nb: int, floors: bool = False):
    """int32 [max(E, 1)]: per entry e, the latest global key position of entries e..e+nb-1, or
    INT32_MAX when one of them hides a slot or lies past the end (one launch, no sync).
    ``floors``: (that, the key floors int32 [max(E, 1)]): per entry, the earliest visible key position of it
    and of every later entry of its offset group (INT32_MAX: none), what the kernel's CUT reads (a few more
    launches, no sync)."""
    n_entries = packed.meta.numel()
    key_hi = torch.empty(max(1, n_entries), dtype=torch.int32, device=slot_pos.device)
    # (written for every entry by the bounds kernel: no fill; with no entry nothing reads it)
    key_lo = torch.empty(max(1, n_entries), dtype=torch.int32, device=slot_pos.device) if floors else None
    if n_entries:
        _key_bounds_kernel[(triton.cdiv(n_entries, BOUNDS_BLOCK),)](
            packed.meta, packed.masks, slot_pos, key_hi, n_entries, BS=bs, BS_PAD=triton.next_power_of_2(bs),
            NB=nb, BLOCK=BOUNDS_BLOCK, MASK_IN_WORD=packed.mask_in_word, lo_ptr=key_lo, LO=floors,
            **pdl.launch_kwargs(slot_pos.device))
    if not floors:
        return key_hi
    if n_entries:
        key_lo = group_suffix_min(key_lo, packed.group_starts)
    return key_hi, key_lo


def group_suffix_min(x: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """x int32 [E] (values below 2**31) -> per entry, the minimum of x over it and the later entries of its group
    (groups: runs [starts[g], starts[g + 1]) of a non-decreasing int32 starts padded with E). On the device,
    without a sync: each value lifted by its group's index times 2**32, so that a running minimum taken from
    the end restarts at every group."""
    n = x.numel()
    gid = torch.searchsorted(starts, torch.arange(n, dtype=starts.dtype, device=x.device), right=True).long() - 1
    lift = gid * (1 << 32)
    return (torch.cummin((x.long() + lift).flip(0), 0).values.flip(0) - lift).to(torch.int32)


def pick_splits(programs: int, steps: int, device, min_steps: int = 8) -> int:
    """KV splits so that about two programs run per SM, each with at least min_steps steps of keys. (A 64-token
    suffix over 6 x 512 cached tokens on an H100, bench/short_attention/README.md: 3 splits of ~17 steps
    34.2 us, 6 of ~9 steps 30.9 us, 12 of ~4 steps 41.2 us; each split searches its own offset groups.)"""
    want = triton.cdiv(2 * sm_count(device), max(1, programs))
    return max(1, min(want, steps // max(1, min_steps)))
