"""A decoder layer's elementwise work as three Triton kernels (twin: reference.py, same numerics).

  - ``rms_norm`` / ``add_rms_norm``: one program per row; the residual sum (rounded to the activations'
    dtype, as ``residual + x`` is) is written and normalised in the same pass. Replaces ~6 torch
    kernels (cast, pow, mean, rsqrt-add, mul, cast, mul by weight) and the residual add.
  - ``silu_mul``: silu(gate) * up over the fused gate|up projection's output, read once.
  - ``qkv_heads``: splits the fused q|k|v projection's output into contiguous q, k, v, with Qwen3's
    per-head q/k RMSNorm and RoPE on q and k in the same pass (one program per token and BLOCK_H
    heads of q, k and v together). Replaces ~20 torch kernels of the rotate-half rotation. Given a
    ``KVWrite``, it also stores k and v into the paged cache (replacing the two index writes of
    ``BlockPool.write``), and may skip the k, v outputs when the caller only needs the cache.
  - ``write_kv``: k and v given, stored into the paged cache by one kernel (two index writes in torch).

With kernels/pdl.py's switch on (sm_90+), rms_norm / add_rms_norm and qkv_heads are programmatic dependent
launches: weights first, then griddepcontrol.wait before their inputs (kernels/pdl.py says why the bits match).

No kernel syncs with the host or sizes anything from device data: all are CUDA-graph capturable.
Only long-standing ``tl`` operations are used (the kernels run on Triton 3.6 and later).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.pdl import enter as pdl_enter
from kernels.fused.kv_write import KVWrite


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols,
                     stride_x, stride_res, stride_out, stride_res_out, eps,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row). PDL (kernels/pdl.py): the norm weight (never written) is read before the wait for the
    kernel before, x and the residual after it."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < n_cols
    if PDL:  # the weight first (held across the wait); without PDL it is read where it is used, as before
        w = tl.load(w_ptr + c, mask=ok, other=0.0)
        pdl_enter(PDL)
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_res + c, mask=ok, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)  # residual + x, in x's dtype
        tl.store(res_out_ptr + row * stride_res_out + c, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    y = (xf * inv).to(x_ptr.dtype.element_ty)  # normalised, cast back, THEN scaled (Hugging Face order)
    if not PDL:
        w = tl.load(w_ptr + c, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_out + c, (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, n_inter, stride_gu, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n_inter
    g = tl.load(gu_ptr + row * stride_gu + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_inter + c, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)  # silu rounded, then the product rounded
    tl.store(out_ptr + row * stride_out + c, (s.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _qkv_heads_kernel(qkv_ptr, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, invf_ptr, qn_ptr, kn_ptr,
                      kc_ptr, vc_ptr, blk_ptr, slot_ptr, n_q, n_kv, stride_qkv, stride_cos, stride_sin,
                      block_size, eps, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D2: tl.constexpr,
                      USE_TABLE: tl.constexpr, QK_NORM: tl.constexpr, KV_OUT: tl.constexpr,
                      TO_CACHE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token t, heads [h0, h0 + BLOCK_H) of the q|k|v row): heads < n_q are q, then n_kv k,
    then n_kv v. Each head vector is read as two halves [BLOCK_H, HALF] (rotate-half layout).
    TO_CACHE: k and v heads are also stored at row block[t] * block_size + slot[t] of the caches.
    PDL (kernels/pdl.py): the q/k norm weights and inv_freq (never written) are read before the wait for the
    kernel before; q|k|v, positions, cos/sin and the write slots after it."""
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D2)
    d_ok = d < HALF
    is_q = hh < n_q
    is_k = (hh >= n_q) & (hh < n_q + n_kv)
    is_v = (hh >= n_q + n_kv) & (hh < n_q + 2 * n_kv)
    rot = (is_q | is_k)[:, None]
    ok = (hh < n_q + 2 * n_kv)[:, None] & d_ok[None, :]
    if PDL:  # what no kernel writes first (held across the wait); without PDL read where used, as before
        if QK_NORM:
            w1, w2 = _head_norm_weights(qn_ptr, kn_ptr, d, d_ok, is_q, HALF)
        if not USE_TABLE:
            invf = tl.load(invf_ptr + d, mask=d_ok, other=0.0)
        pdl_enter(PDL)
    src = qkv_ptr + t * stride_qkv + hh[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D2]
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dt = q_ptr.dtype.element_ty
    if QK_NORM:  # Qwen3: RMSNorm over each q/k head's D values, Hugging Face order, before RoPE
        inv = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)[:, None]
        if not PDL:
            w1, w2 = _head_norm_weights(qn_ptr, kn_ptr, d, d_ok, is_q, HALF)
        n1 = ((x1 * inv).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        n2 = ((x2 * inv).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        x1 = tl.where(rot, n1, x1)
        x2 = tl.where(rot, n2, x2)
    if USE_TABLE:
        cos = tl.load(cos_ptr + t * stride_cos + d, mask=d_ok, other=1.0)[None, :]
        sin = tl.load(sin_ptr + t * stride_sin + d, mask=d_ok, other=0.0)[None, :]
    else:
        if not PDL:
            invf = tl.load(invf_ptr + d, mask=d_ok, other=0.0)
        ang = tl.load(pos_ptr + t).to(tl.float32) * invf
        cos = tl.cos(ang)[None, :]
        sin = tl.sin(ang)[None, :]
    y1 = tl.where(rot, x1 * cos - x2 * sin, x1).to(dt)
    y2 = tl.where(rot, x2 * cos + x1 * sin, x2).to(dt)
    # each head goes to its own contiguous output; the other two stores of the head are masked off
    qh = tl.where(is_q, hh, 0)[:, None]
    kh = tl.where(is_k, hh - n_q, 0)[:, None]
    vh = tl.where(is_v, hh - n_q - n_kv, 0)[:, None]
    q_dst = q_ptr + (t * n_q + qh) * (2 * HALF) + d[None, :]
    k_dst = k_ptr + (t * n_kv + kh) * (2 * HALF) + d[None, :]
    v_dst = v_ptr + (t * n_kv + vh) * (2 * HALF) + d[None, :]
    q_ok = ok & is_q[:, None]
    k_ok = ok & is_k[:, None]
    v_ok = ok & is_v[:, None]
    tl.store(q_dst, y1, mask=q_ok)
    tl.store(q_dst + HALF, y2, mask=q_ok)
    if KV_OUT:
        tl.store(k_dst, y1, mask=k_ok)
        tl.store(k_dst + HALF, y2, mask=k_ok)
        tl.store(v_dst, y1, mask=v_ok)
        tl.store(v_dst + HALF, y2, mask=v_ok)
    if TO_CACHE:  # the rows just rounded to the activations' dtype, then cast to the cache's (as .to() twice)
        row = tl.load(blk_ptr + t) * block_size + tl.load(slot_ptr + t)  # int64
        kc_dst = kc_ptr + (row * n_kv + kh) * (2 * HALF) + d[None, :]
        vc_dst = vc_ptr + (row * n_kv + vh) * (2 * HALF) + d[None, :]
        tl.store(kc_dst, y1.to(kc_ptr.dtype.element_ty), mask=k_ok)
        tl.store(kc_dst + HALF, y2.to(kc_ptr.dtype.element_ty), mask=k_ok)
        tl.store(vc_dst, y1.to(vc_ptr.dtype.element_ty), mask=v_ok)
        tl.store(vc_dst + HALF, y2.to(vc_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _head_norm_weights(qn_ptr, kn_ptr, d, d_ok, is_q, HALF: tl.constexpr):
    """Qwen3's per-head norm weights of each head's two halves, q's or k's by head: w1, w2 [BLOCK_H, BLOCK_D2]."""
    qw1 = tl.load(qn_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    qw2 = tl.load(qn_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    kw1 = tl.load(kn_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    kw2 = tl.load(kn_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    return tl.where(is_q[:, None], qw1, kw1), tl.where(is_q[:, None], qw2, kw2)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, blk_ptr, slot_ptr, row_len, stride_k, stride_v, block_size,
                     BLOCK: tl.constexpr):
    """Program (token t, columns [c0, c0 + BLOCK) of its Hkv * D row): k's and v's, to cache row
    block[t] * block_size + slot[t]."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < row_len
    row = tl.load(blk_ptr + t) * block_size + tl.load(slot_ptr + t)  # int64
    k = tl.load(k_ptr + t * stride_k + c, mask=ok)
    v = tl.load(v_ptr + t * stride_v + c, mask=ok)
    tl.store(kc_ptr + row * row_len + c, k.to(kc_ptr.dtype.element_ty), mask=ok)
    tl.store(vc_ptr + row * row_len + c, v.to(vc_ptr.dtype.element_ty), mask=ok)


def _row_warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., n] as rows [R, n] with unit column stride (a view when it can be)."""
    x = x.reshape(-1, n)
    return x if x.stride(1) == 1 or x.shape[0] == 0 else x.contiguous()


def _norm(x, residual, weight, eps):
    n = x.shape[-1]
    if weight.dim() != 1 or weight.numel() != n:
        raise ValueError(f"rms_norm weight {tuple(weight.shape)} does not match the last dimension {n} of x")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}")
    x2 = _rows(x, n)
    rows = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    if rows == 0 or n == 0:
        return out, res_out
    r2 = _rows(residual, n) if residual is not None else x2
    ro2 = res_out.view(-1, n) if res_out is not None else x2
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](x2, r2, weight.contiguous(), out, ro2, n, x2.stride(0), r2.stride(0), n,
                              ro2.stride(0), float(eps), BLOCK=block, HAS_RES=residual is not None,
                              num_warps=_row_warps(block), **pdl.launch_kwargs(x.device))
    return out, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] normalised over its last dimension and scaled by weight [N] (a new tensor)."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x) for x, residual [T, N] in one pass (two new tensors)."""
    return _norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up [T, 2*I] -> silu(gate) * up [T, I] in gate_up's dtype."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul expects gate|up [T, 2*I], got {tuple(gate_up.shape)}")
    t, inter = gate_up.shape[0], gate_up.shape[1] // 2
    gu = gate_up if gate_up.stride(1) == 1 else gate_up.contiguous()
    out = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t == 0 or inter == 0:
        return out
    _silu_mul_kernel[(t, triton.cdiv(inter, block))](gu, out, inter, gu.stride(0), out.stride(0), BLOCK=block)
    return out


def _table(x: torch.Tensor, t: int, half: int) -> torch.Tensor:
    """A cos or sin table broadcastable to [T, 1, D/2] as fp32 rows [T, D/2] with unit column stride."""
    x = x.reshape(t, half)
    if x.dtype != torch.float32:
        x = x.float()
    return x if x.stride(1) == 1 else x.contiguous()


def qkv_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, *, cos: torch.Tensor | None = None,
              sin: torch.Tensor | None = None, positions: torch.Tensor | None = None,
              inv_freq: torch.Tensor | None = None, q_norm: torch.Tensor | None = None,
              k_norm: torch.Tensor | None = None, eps: float = 1e-6, write: KVWrite | None = None,
              return_kv: bool = True, block_h: int = 16):
    """qkv [T, (Hq + 2*Hkv) * D] -> q [T, Hq, D], k, v [T, Hkv, D] (new, contiguous): q and k per-head
    normed (when q_norm/k_norm are given) and rotated by cos/sin tables or by positions * inv_freq.
    ``write``: k and v also stored into the paged cache; ``return_kv=False``: k, v not made (None)."""
    if qkv.dim() != 2 or qkv.shape[1] % (num_heads + 2 * num_kv_heads):
        raise ValueError(f"qkv {tuple(qkv.shape)} is not [T, (Hq + 2*Hkv) * D] for Hq={num_heads}, Hkv={num_kv_heads}")
    t = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    half = d // 2
    if d % 2:
        raise ValueError(f"head_dim {d} must be even for RoPE")
    if (cos is None) == (positions is None):
        raise ValueError("give the rotation either as cos/sin tables or as positions with inv_freq")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if write is not None:
        write.check(t, num_kv_heads, d)
    if qkv.stride(1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    k = v = None
    if return_kv:
        k = torch.empty((t, num_kv_heads, d), dtype=qkv.dtype, device=qkv.device)
        v = torch.empty_like(k)
    if t == 0:
        return q, k, v
    if cos is not None:
        cos_t, sin_t = _table(cos, t, half), _table(sin, t, half)
        pos = invf = cos_t  # unread
    else:
        if positions.shape != (t,) or inv_freq is None or inv_freq.numel() != half:
            raise ValueError(f"positions {tuple(positions.shape)} must be [{t}] with {half} inverse frequencies")
        pos = positions.contiguous()
        invf = inv_freq.to(device=qkv.device, dtype=torch.float32).contiguous()
        cos_t = sin_t = invf  # unread
    qn = q_norm.contiguous() if q_norm is not None else qkv
    kn = k_norm.contiguous() if k_norm is not None else qkv
    k_out, v_out = (k, v) if return_kv else (q, q)  # unread without KV_OUT
    if write is not None:
        kc, vc, blk, slot, bs = write.k_cache, write.v_cache, write.block, write.slot, write.k_cache.shape[1]
    else:
        kc = vc = blk = slot = q  # unread
        bs = 1
    heads = num_heads + 2 * num_kv_heads
    block_h = min(block_h, triton.next_power_of_2(heads))
    _qkv_heads_kernel[(t, triton.cdiv(heads, block_h))](
        qkv, q, k_out, v_out, cos_t, sin_t, pos, invf, qn, kn, kc, vc, blk, slot, num_heads, num_kv_heads,
        qkv.stride(0), cos_t.stride(0), sin_t.stride(0), bs, float(eps),
        HALF=half, BLOCK_H=block_h, BLOCK_D2=triton.next_power_of_2(half),
        USE_TABLE=cos is not None, QK_NORM=q_norm is not None, KV_OUT=return_kv, TO_CACHE=write is not None,
        **pdl.launch_kwargs(qkv.device))
    return q, k, v


def write_kv(k: torch.Tensor, v: torch.Tensor, write: KVWrite, block: int = 1024) -> None:
    """Store k, v [T, Hkv, D] at ``write``'s (block, slot) rows, cast to the cache's dtype: one launch."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must both be [T, Hkv, D]")
    t, n = k.shape[0], k.shape[1] * k.shape[2]
    write.check(t, k.shape[1], k.shape[2])
    if k.device != write.k_cache.device or v.device != write.k_cache.device:
        raise ValueError(f"k, v on {k.device}/{v.device}, the cache on {write.k_cache.device}")
    if t == 0 or n == 0:
        return
    k2, v2 = _rows(k, n), _rows(v, n)
    block = min(block, triton.next_power_of_2(n))
    _write_kv_kernel[(t, triton.cdiv(n, block))](k2, v2, write.k_cache, write.v_cache, write.block, write.slot, n,
                                                k2.stride(0), v2.stride(0), write.k_cache.shape[1], BLOCK=block)
