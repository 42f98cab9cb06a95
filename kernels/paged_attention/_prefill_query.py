"""The prefill kernel's query tile, rotated BACKWARDS by an offset group's offset (see _prefill.py).

    R_{-off} q = [q1 c + q2 s, q2 c - q1 s]     (rotate-half layout, q = [q1 | q2], c|s of off * inv_freq)

Split in pieces so that the kernel can load the NEXT group's cos/sin before the current group's step loop and
rotate after it (ROT_MODE "prefetch_cs", the default), or rotate the next group's query before the step loop
("early"). The rotation modes are timed against each other by bench/kernels/kernels.py --rotation
(bench/kernels/README.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.paged_attention._meta import OFFSET_MASK_C, OFFSET_SHIFT_C

ROT_MODES = ("prefetch_cs", "early")


@triton.jit
def cos_sin(e_first, valid, meta_ptr, tab_ptr, invf_ptr, D: tl.constexpr, USE_TABLE: tl.constexpr):
    """cos, sin [D/2] fp32 of the offset of entry e_first; valid=False (no such group) reads nothing
    and gives the identity (cos 1, sin 0)."""
    D2: tl.constexpr = D // 2
    dh = tl.arange(0, D2)
    ok = tl.full([D2], 0, tl.int32) < valid.to(tl.int32)  # [D2] copies of valid
    if USE_TABLE:
        cos = tl.load(tab_ptr + e_first * D + dh, mask=ok, other=1.0)
        sin = tl.load(tab_ptr + e_first * D + D2 + dh, mask=ok, other=0.0)
    else:
        off = ((tl.load(meta_ptr + e_first + 0 * dh, mask=ok, other=0) >> OFFSET_SHIFT_C) & OFFSET_MASK_C).to(tl.float32)
        ang = off * tl.load(invf_ptr + dh)
        cos = tl.cos(ang)
        sin = tl.sin(ang)
    return cos, sin


@triton.jit
def query_halves(q_ptr, tok, head, row_ok, stride_qt, stride_qh, D: tl.constexpr, dtype: tl.constexpr):
    """The raw query tile as its rotate-half halves q1, q2 [BLOCK_M, D/2] converted to dtype, read as
    one contiguous [BLOCK_M, 2, D/2] load (the split is a register renaming). Its addresses are
    computed here, not hoisted and held across the group loop."""
    D2: tl.constexpr = D // 2
    q_row = q_ptr + tok.to(tl.int64)[:, None, None] * stride_qt + head[:, None, None] * stride_qh
    q_half = q_row + tl.arange(0, 2)[None, :, None] * D2 + tl.arange(0, D2)[None, None, :]
    q = tl.load(q_half, mask=row_ok[:, None, None], other=0.0).to(dtype)  # [BLOCK_M, 2, D2]
    return tl.split(tl.permute(q, (0, 2, 1)))


@triton.jit
def rotate_halves(q1, q2, cos, sin, NARROW: tl.constexpr = False, EMULATE: tl.constexpr = False):
    """R_{-off} of the halves, r1, r2 [BLOCK_M, D/2]: in fp32, or (NARROW) in q's own 16-bit type
    (packed two-lane FMAs, no conversions: a quarter of the instructions, about twice the rounding
    error of the fp32 path). EMULATE: the same roundings done in fp32, for Triton's interpreter,
    whose bf16 arithmetic is wrong (NaNs)."""
    if NARROW and EMULATE:
        dt: tl.constexpr = q1.dtype
        q1, q2 = q1.to(tl.float32), q2.to(tl.float32)
        c = cos.to(dt).to(tl.float32)[None, :]
        s = sin.to(dt).to(tl.float32)[None, :]
        r1 = q1 * c + (q2 * s).to(dt).to(tl.float32)  # a rounded product, then a fused multiply-add
        r2 = q2 * c - (q1 * s).to(dt).to(tl.float32)
        r1, r2 = r1.to(dt), r2.to(dt)
    elif NARROW:
        c = cos.to(q1.dtype)[None, :]
        s = sin.to(q1.dtype)[None, :]
        r1 = q1 * c + q2 * s
        r2 = q2 * c - q1 * s
    else:
        q1 = q1.to(tl.float32)
        q2 = q2.to(tl.float32)
        r1 = q1 * cos[None, :] + q2 * sin[None, :]
        r2 = q2 * cos[None, :] - q1 * sin[None, :]
    return r1, r2


@triton.jit
def join_halves(r1, r2, BLOCK_M: tl.constexpr, D: tl.constexpr):
    """[r1 | r2] as one [BLOCK_M, D] tile (a register renaming in Triton 3.6's linear layouts)."""
    return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (BLOCK_M, D))


@triton.jit
def rotated_query(q_ptr, tok, head, row_ok, stride_qt, stride_qh, e_first, valid, meta_ptr, tab_ptr, invf_ptr,
                  out_dtype: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, USE_TABLE: tl.constexpr,
                  NARROW: tl.constexpr = False, EMULATE: tl.constexpr = False):
    """The query tile rotated backwards by the offset of the group starting at entry e_first, in fp32
    from the original query (re-read from memory, an L1/L2 hit, rather than kept live): [BLOCK_M, D] of
    out_dtype."""
    cos, sin = cos_sin(e_first, valid, meta_ptr, tab_ptr, invf_ptr, D, USE_TABLE)
    q1, q2 = query_halves(q_ptr, tok, head, row_ok, stride_qt, stride_qh, D,
                          q_ptr.dtype.element_ty if NARROW else tl.float32)
    r1, r2 = rotate_halves(q1, q2, cos, sin, NARROW, EMULATE)
    return join_halves(r1, r2, BLOCK_M, D).to(out_dtype)
