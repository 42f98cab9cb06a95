"""Triton sparse decode attention: each (row, KV head) attends only to the entries its selection names.

The decode kernel's scheme (kernels/paged_attention/_decode.py) over a selection instead of a sequence: one
program per (row, KV head, split) walks its run of sel[r, h, :count[r, h]] NB entries per step; the tl.dot rows
are (lane j, group head g) pairs, lane j attending only to the j-th entry of each step; the query is rotated
BACKWARDS by an entry's offset (from the original fp32 query) only when some lane's offset changes, so a run of
selected pages of one chunk rotates once. Only the selected pages' keys and values are read.

Each step's table reads (sel -> block id, slot mask, offset: two dependent loads) are issued one step ahead, while
the step before it computes, and a step's keys and values are requested before its query is rotated: a step waits
for one load (its K/V), not for a chain of four.

Rows are independent of sequences (a past query with its own selection is a row like any other). Splits cut every
(row, head) selection into runs of PER entries (a whole number of steps) from its start, so a selection shorter than
its width leaves the last splits empty; the split count fills the device's program slots about once (few rows: one
step a program), and partials (fp32) are merged by kernels/lse_merge only when there are several. The block table
is read as given (block_ids and offsets int32 or int64, masks int64): a step reads at most 24 bytes an entry besides
its keys, so no packed table is built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.lse_merge.triton import merge_attention
from kernels.paged_attention._decode import attend_tile, merge_lanes, split_outputs
from kernels.paged_attention._meta import dot_f32, sm_count

LOG2E = tl.constexpr(1.4426950408889634)


@dataclass(frozen=True, slots=True)
class AttendConfig:
    """Launch shape. lanes: entries a step (tl.dot rows = lanes x G_PAD, at least 16); splits (None: picked) cut
    each selection into runs of whole steps so that rows x KV heads x splits fill about waves x SMs x
    programs_per_sm programs, never below one step a program."""

    # measured on an H100 (bench/decode/sparse_kernels.py's sweep): 8 warps beat 4 at every shape by 0-8%; Triton's
    # pipelining (3 stages) gains 5-11% from 4 steps a program on and loses up to 84% at one or two
    num_warps: int = 8
    num_stages: int | None = None  # None: 3 from pipelined_from steps a program on, else 1
    pipelined_from: int = 4
    lanes: int | None = None      # None: 16 tl.dot rows' worth (16 // G_PAD), at most 64 keys a step
    waves: float = 1.0
    programs_per_sm: int = 2      # the split count's program slots an SM (the one that was measured)
    num_splits: int | None = None
    maxnreg: int | None = None    # a register cap (more programs an SM, spills): benchmark sweeps

    def __post_init__(self):
        if self.num_splits is not None and self.num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {self.num_splits}")
        if self.lanes is not None and (self.lanes < 1 or self.lanes & (self.lanes - 1)):
            raise ValueError(f"lanes must be a power of two, got {self.lanes}")


@triton.jit
def _step_table(sel_row, ids_ptr, mask_lo_ptr, off_ptr, k_start, hi, n, slot, j, BS: tl.constexpr):
    """A step's table reads: each key's block id and slot-mask word [BLOCK_N] int32 (the 32-bit half of its entry's
    int64 mask that holds the slot's bit; 0 past the run) and each lane's offset [ROWS]."""
    kk = k_start + n // BS  # [BLOCK_N] the selection slot of each key
    k_ok = kk < hi
    e = tl.load(sel_row + kk, mask=k_ok, other=0)
    blk = tl.load(ids_ptr + e, mask=k_ok, other=0).to(tl.int32)   # int32 or int64 tables
    # NOTE: int32 halves, not the int64 masks: with int64 [BLOCK_N] masks the kernel compiled for sm_90 hit the
    # 255-register cap (Triton 3.6), with int32 ones it needs 243
    bits = tl.load(mask_lo_ptr + 2 * e + slot // 32, mask=k_ok, other=0)
    lane_sel = k_start + j
    e_row = tl.load(sel_row + lane_sel, mask=lane_sel < hi, other=0)  # [ROWS]
    off = tl.load(off_ptr + e_row, mask=lane_sel < hi, other=0).to(tl.int32)
    return blk, bits, off


@triton.jit
def _rotate(q_row, off, invf_ptr, d, row_ok, ROWS: tl.constexpr, G_PAD: tl.constexpr, D2: tl.constexpr):
    """Each lane's query heads [ROWS, D2] x 2 rotated BACKWARDS by its offset, from the original query (fp32 math:
    no error accumulates over steps), in the query's dtype for tl.dot. cos / sin once a lane ([LANES, D2]), not once a
    row: a lane's G_PAD rows share them."""
    LANES: tl.constexpr = ROWS // G_PAD
    lane_off = tl.max(tl.reshape(off, [LANES, G_PAD]), axis=1)   # a lane's rows hold one offset
    ang = lane_off.to(tl.float32)[:, None] * tl.load(invf_ptr + d)[None, :]   # [LANES, D2]
    cos = tl.reshape(tl.broadcast_to(tl.cos(ang)[:, None, :], [LANES, G_PAD, D2]), [ROWS, D2])
    sin = tl.reshape(tl.broadcast_to(tl.sin(ang)[:, None, :], [LANES, G_PAD, D2]), [ROWS, D2])
    q1 = tl.load(q_row + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_row + D2 + d[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    return (q1 * cos + q2 * sin).to(q_row.dtype.element_ty), (q2 * cos - q1 * sin).to(q_row.dtype.element_ty)


@triton.jit
def _step_flags(flag_ptr, past, h, stride_fr, stride_fh, k_start, hi, j, c, row_ok, KINDS: tl.constexpr):
    """Per row, may it attend its lane's entry of the step at k_start: current rows (kind 0) always; a past row
    (kind c >= 1) where its flag (int8 [R, Hkv, K], by selection slot) is set. [ROWS] bool."""
    if KINDS == 1:
        return row_ok
    at = k_start + j
    ok = row_ok & (c > 0) & (at < hi)
    fl = tl.load(flag_ptr + past * stride_fr + h * stride_fh + at, mask=ok, other=0)
    return row_ok & ((c == 0) | (fl != 0))


@triton.jit
def attend_run(q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_lo_ptr, invf_ptr, sel_row, r_id, h, lo, hi, qk_scale,
               stride_qr, stride_qh, stride_kb, stride_ks, stride_kh,
               qp_ptr, flag_ptr, stride_pr, stride_ph, stride_fr, stride_fh,
               G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BS: tl.constexpr,
               D2: tl.constexpr, DOT_F32: tl.constexpr, P: tl.constexpr, KINDS: tl.constexpr):
    """Row r_id's query at KV head h over the entries sel_row[lo:hi] (their K/V read NB a step, the query rotated
    back by each entry's offset): the lanes' running (m_i, l_i, acc), [ROWS], [ROWS], [ROWS, D], not yet merged.
    With P past rows a row (KINDS = next power of two of 1 + P, else 1 and the past arguments unused), each lane's
    rows are KINDS kinds of G_PAD group heads: kind 0 row r_id's query (q_ptr), kind c its past row r_id * P + c - 1
    (qp_ptr), which attends an entry only where flag_ptr says it is new to it: one read of each page serves both.
    The sparse decode kernel and RetroAttention's layer (_retro.py: the current and past rows at once) attend
    through it."""
    BLOCK_N: tl.constexpr = NB * BS
    RPL: tl.constexpr = KINDS * G_PAD    # rows a lane
    # row r = (lane j, kind c, group head g): lane j attends to the j-th selected entry of every step
    r = tl.arange(0, ROWS)
    j = r // RPL
    c = (r // G_PAD) % KINDS
    g = r % G_PAD
    row_ok = (j < NB) & (g < G) & (c <= P)
    d = tl.arange(0, D2)
    dd = tl.arange(0, 2 * D2)
    heads = (h * G + g)[:, None]
    past = r_id.to(tl.int64) * P + c - 1       # kind c's past row (kind 0: unused)
    if KINDS == 1:
        q_row = q_ptr + r_id.to(tl.int64) * stride_qr + heads * stride_qh
    else:
        q_row = tl.where((c == 0)[:, None], q_ptr + r_id.to(tl.int64) * stride_qr + heads * stride_qh,
                         qp_ptr + tl.maximum(past, 0)[:, None] * stride_pr + heads * stride_ph)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, 2 * D2], tl.float32)
    n = tl.arange(0, BLOCK_N)
    slot = n % BS
    blk, bits, off = _step_table(sel_row, ids_ptr, mask_lo_ptr, off_ptr, lo, hi, n, slot, j, BS)
    act = _step_flags(flag_ptr, past, h, stride_fr, stride_fh, lo, hi, j, c, row_ok, KINDS)
    qr1, qr2 = _rotate(q_row, off, invf_ptr, d, row_ok, ROWS, RPL, D2)
    prev = off
    for k_start in range(lo, hi, NB):
        vis = ((bits >> (slot % 32)) & 1) != 0
        k_row = blk.to(tl.int64) * stride_kb + slot * stride_ks + h * stride_kh  # [BLOCK_N] int64
        k1 = tl.load(k_ptr + k_row[:, None] + d[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D2]
        k2 = tl.load(k_ptr + k_row[:, None] + D2 + d[None, :], mask=vis[:, None], other=0.0)
        v = tl.load(v_ptr + k_row[:, None] + dd[None, :], mask=vis[:, None], other=0.0)  # [BLOCK_N, D]
        own = (j[:, None] == (n // BS)[None, :]) & vis[None, :] & act[:, None]  # lane j sees only its own entry
        # the next step's table (and flags), in flight while this step computes (past the run: nothing is read)
        blk, bits, off = _step_table(sel_row, ids_ptr, mask_lo_ptr, off_ptr, k_start + NB, hi, n, slot, j, BS)
        act = _step_flags(flag_ptr, past, h, stride_fr, stride_fh, k_start + NB, hi, j, c, row_ok, KINDS)
        m_i, l_i, acc = attend_tile(qr1, qr2, k1, k2, v, own, qk_scale, m_i, l_i, acc, DOT_F32)
        # the next step's query, once this step's keys are dead (registers): rotated again only for a new chunk
        if (k_start + NB < hi) & (tl.max((off != prev).to(tl.int32), axis=0) > 0):
            qr1, qr2 = _rotate(q_row, off, invf_ptr, d, row_ok, ROWS, RPL, D2)
            prev = off
    return m_i, l_i, acc


@triton.jit
def _sparse_decode_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_ptr, sel_ptr, cnt_ptr, invf_ptr, out_ptr, lse_ptr,
    qk_scale, per,
    stride_qr, stride_qh, stride_kb, stride_ks, stride_kh, stride_sr, stride_sh, stride_cr,
    stride_os, stride_or, stride_oh, stride_ls, stride_lr,
    G: tl.constexpr, G_PAD: tl.constexpr, NB: tl.constexpr, ROWS: tl.constexpr, BS: tl.constexpr,
    D2: tl.constexpr, DOT_F32: tl.constexpr,
):
    r_id = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    n_sel = tl.load(cnt_ptr + r_id.to(tl.int64) * stride_cr + h)
    lo = split * per
    hi = tl.minimum(lo + per, n_sel)
    sel_row = sel_ptr + r_id.to(tl.int64) * stride_sr + h * stride_sh
    mask_lo_ptr = mask_ptr.to(tl.pointer_type(tl.int32))  # little-endian: word 2e is entry e's low 32 bits

    m_i, l_i, acc = attend_run(q_ptr, k_ptr, v_ptr, ids_ptr, off_ptr, mask_lo_ptr, invf_ptr, sel_row, r_id, h, lo,
                               hi, qk_scale, stride_qr, stride_qh, stride_kb, stride_ks, stride_kh,
                               q_ptr, cnt_ptr, 0, 0, 0, 0, G, G_PAD, NB, ROWS, BS, D2, DOT_F32, 0, 1)
    dd = tl.arange(0, 2 * D2)

    out, lse = merge_lanes(m_i, l_i, acc, ROWS, G_PAD, D2)   # the lanes of each group head, by log-sum-exp
    gg = tl.arange(0, G_PAD)
    g_ok = gg < G
    o_row = out_ptr + split * stride_os + r_id.to(tl.int64) * stride_or + (h * G + gg)[:, None] * stride_oh
    tl.store(o_row + dd[None, :], out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])
    tl.store(lse_ptr + split * stride_ls + r_id.to(tl.int64) * stride_lr + h * G + gg, lse, mask=g_ok)


def pick_splits(cfg: AttendConfig, n_rows: int, n_kv_heads: int, width: int, lanes: int, device) -> tuple[int, int]:
    """(splits, entries a split) for selections of ``width`` entries (sel.shape[2]; no host sync for the counts):
    the fewest steps a program such that rows x heads x splits fit about waves x SMs x programs_per_sm programs."""
    steps = max(1, triton.cdiv(width, lanes))
    if cfg.num_splits is not None:
        iters = triton.cdiv(steps, cfg.num_splits)
    else:
        slots = int(cfg.waves * sm_count(device) * cfg.programs_per_sm)
        iters = triton.cdiv(steps, max(1, min(steps, slots // max(1, n_rows * n_kv_heads))))
    return triton.cdiv(steps, iters), iters * lanes


def launch(q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, scale,
           *, cfg: AttendConfig = AttendConfig(), spare: int | None = None):
    """Inputs checked by triton.py. Returns out [R, Hq, D] (q.dtype), lse [R, Hq] fp32; with ``spare``, the splits'
    fp32 parts unmerged, [S + spare, R, Hq, D] and [S + spare, R, Hq], the last ``spare`` unwritten."""
    n_rows, hq, dim = q.shape
    _, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    g_pad = triton.next_power_of_2(group)
    nb = cfg.lanes or max(1, min(16 // g_pad, 64 // bs))
    nsplit, per = pick_splits(cfg, n_rows, hkv, sel.shape[2], nb, q.device)
    stages = cfg.num_stages or (3 if per // nb >= cfg.pipelined_from else 1)
    if spare is None:
        out, lse, o_strides, l_strides = split_outputs(q, nsplit)
    else:
        out = torch.empty((nsplit + spare, n_rows, hq, dim), dtype=torch.float32, device=q.device)
        lse = torch.empty((nsplit + spare, n_rows, hq), dtype=torch.float32, device=q.device)
        o_strides, l_strides = (out.stride(0), out.stride(1), out.stride(2)), (lse.stride(0), lse.stride(1))
    if n_rows:
        _sparse_decode_kernel[(n_rows, hkv, nsplit)](
            q, k_cache, v_cache, block_ids, offsets, masks, sel, count, inv_freq, out, lse,
            float(scale) * LOG2E.value, per,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            sel.stride(0), sel.stride(1), count.stride(0), *o_strides, *l_strides,
            G=group, G_PAD=g_pad, NB=nb, ROWS=max(16, nb * g_pad), BS=bs, D2=dim // 2,
            DOT_F32=dot_f32(q.dtype), num_warps=cfg.num_warps, num_stages=stages,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
        )
    if nsplit == 1 or spare is not None:
        return out, lse
    return merge_attention(out, lse, q.dtype)     # (past the unrolled merge's parts, every part loaded at once)
