"""The skinny GEMM's TMA weight stream (Hopper): the one-split kernel of kernels/linear/triton.py with its weight
tiles (and, with ``LinearConfig.tma == "xw"``, its x tiles) loaded through tensor descriptors.

On sm_90 a descriptor load in the pipelined K loop becomes ``cp.async.bulk.tensor`` into shared memory, one
thread issuing a whole box and an mbarrier counting its bytes in, where the pointer path spends a 16-byte
cp.async, and its address arithmetic, per thread per chunk. Same sums and epilogues as the pointer kernel (the
twin: reference.py; the jit pieces both share: common.py): plain, + bias, onto ``accumulate``, gate|up SwiGLU and
the PDL prologue. Rows past N and columns past K come in as zeros (the descriptor's bounds), so the weight stream
needs neither masks nor the pointer path's row wrap.

Descriptors are built on the host (``triton.tools.tensor_descriptor.TensorDescriptor``) and cached by content:
(address, shape, strides, dtype, box). Their base is an address-only stand-in (``_Base``), so the cache holds
no tensor alive; an entry is a pure function of its key, so one found for a freed and reused address is the
descriptor a fresh build would give. A graph replay reuses the 128-byte tensor map captured with the launch,
and an eager call costs a dict lookup (the launcher still encodes the map, ~1 us). Under the interpreter
the base must be the tensor itself: built per call there.

Eligible (``ineligible`` says why not, and the caller takes the pointer path): a CUDA device of compute
capability >= 9.0 or the interpreter, one K split, the operand's base address and row stride 16-byte aligned
(TMA's rule), unit stride along K, boxes of at most 256 per dimension.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.linear.common import INTERPRET as _INTERPRET
from kernels.linear.common import dot_consts, dots, epilogue, pdl_consts, prefetch_rows, swiglu_act
from kernels.linear.config import LinearConfig
from kernels.pdl import enter as pdl_enter

MAX_BOX = 256  # elements per box dimension (cuTensorMapEncodeTiled's limit)
MIN_CAPABILITY = (9, 0)  # the tensor memory accelerator: Hopper and later
CACHE_SIZE = 4096  # descriptors kept (a Llama-3-8B engine uses ~130 weights' and a few activations')


@triton.jit
def _linear_tma_kernel(x_ptr, x_desc, w_ptr, w_desc, b_ptr, c_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                       stride_cm, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                       ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                       UPCAST: tl.constexpr, X_TMA: tl.constexpr, SWIGLU: tl.constexpr = False,
                       PDL: tl.constexpr = False, PREFETCH_STEPS: tl.constexpr = 0):
    """Program (M tile, N tile), one split: acc = x[tile rows] @ w[tile rows].T over all of K, then the
    pointer kernel's MODE 0 epilogue. w_desc: w [N, K] (SWIGLU: [2N, K], gate then up) in [BLOCK_N, BLOCK_K]
    boxes; x_desc (X_TMA): x [M, K] in [BLOCK_M, BLOCK_K] boxes, else x is read through x_ptr (masked).
    PDL and PREFETCH_STEPS as in kernels/linear/triton.py's _linear_kernel."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if PREFETCH_STEPS > 0:  # the weights are never written: asked for before the wait (PDL)
        rn = (offs_n % N).to(tl.int64)
        prefetch_rows(w_ptr, rn, 0, tl.minimum(K, PREFETCH_STEPS * BLOCK_K), stride_wn, BLOCK_N, BLOCK_K)
        if SWIGLU:
            prefetch_rows(w_ptr, rn + N, 0, tl.minimum(K, PREFETCH_STEPS * BLOCK_K), stride_wn, BLOCK_N, BLOCK_K)
    if PDL:
        pdl_enter(PDL)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if X_TMA:  # rows past M and columns past K arrive as zeros
            a = x_desc.load([off_m, k])
        elif EVEN_K:
            a = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        else:
            a = tl.load(x_ptrs, mask=m_ok[:, None] & ((k + offs_k) < K)[None, :], other=0.0)
        b = w_desc.load([off_n, k])  # rows past N (past 2N: SWIGLU's up) and columns past K: zeros
        if SWIGLU:
            bu = w_desc.load([off_n + N, k])
        if not SWIGLU:
            bu = b  # (unused)
        acc, acc_u = dots(a, b, bu, acc, acc_u, PRECISION, UPCAST, SWIGLU)
        x_ptrs += BLOCK_K
    ok = m_ok[:, None] & n_ok[None, :]
    if SWIGLU:
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 swiglu_act(acc, acc_u, out_ptr.dtype.element_ty), mask=ok)
    else:
        epilogue(acc, offs_m, offs_n, n_ok, ok, b_ptr, c_ptr, out_ptr, stride_cm, stride_om, HAS_BIAS, ACCUMULATE)


@dataclass(frozen=True, slots=True)
class _Base:
    """What a TensorDescriptor reads of its base tensor (the address, the element type), without the tensor."""

    ptr: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.ptr


_CACHE: collections.OrderedDict[tuple, TensorDescriptor] = collections.OrderedDict()


def descriptor(t: torch.Tensor, rows: int, block: tuple[int, int]) -> TensorDescriptor:
    """A [rows, K] descriptor over t's first ``rows`` rows (t [>= rows, K], unit stride along K) in ``block``
    boxes: cached by content on a device (least recently used dropped past CACHE_SIZE), built per call under the
    interpreter."""
    shape, strides = [rows, t.shape[1]], [t.stride(0), 1]
    if _INTERPRET:
        return TensorDescriptor(t, shape, strides, list(block))
    key = (t.device, t.data_ptr(), rows, t.shape[1], t.stride(0), t.dtype, block)
    desc = _CACHE.get(key)
    if desc is None:
        desc = _CACHE[key] = TensorDescriptor(_Base(t.data_ptr(), t.dtype), shape, strides, list(block))
        if len(_CACHE) > CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return desc


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _aligned(t: torch.Tensor) -> bool:
    """TMA's rule for a [rows, K] operand: base and row stride (encoded even for one row) multiples of 16 bytes."""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and \
        (t.shape[1] <= 1 or t.stride(1) == 1)


def ineligible(x: torch.Tensor, w: torch.Tensor, cfg: LinearConfig) -> str | None:
    """Why the TMA kernel cannot run this launch (the caller then takes the pointer path), or None."""
    if cfg.tma == "off":
        return "the config asks for no TMA"
    if cfg.split_k != 1:
        return f"split_k={cfg.split_k}: the TMA kernel runs one split"
    if x.device.type == "cuda":
        if _capability(x.device) < MIN_CAPABILITY:
            return f"compute capability {_capability(x.device)} < {MIN_CAPABILITY} (no TMA)"
    elif not _INTERPRET:
        return f"{x.device.type} tensors (TMA: CUDA, or the interpreter)"
    if max(cfg.block_n, cfg.block_k) > MAX_BOX or (cfg.tma == "xw" and cfg.block_m > MAX_BOX):
        return f"a box past {MAX_BOX} elements a dimension ({cfg.short()})"
    if not _aligned(w):
        return (f"the weight's base (address % 16 = {w.data_ptr() % 16}) or row stride ({w.stride(0)} elements of "
                f"{w.element_size()} B) is not 16-byte aligned")
    if cfg.tma == "xw" and not _aligned(x):
        return (f"x's base (address % 16 = {x.data_ptr() % 16}) or row stride ({x.stride(0)} elements) is not "
                f"16-byte aligned")
    return None


def _consts(m: int, k: int, dtype: torch.dtype, cfg: LinearConfig, bias: bool, accumulate: bool, swiglu: bool,
            pdl: int) -> dict:
    """The kernel's constexprs and launch options (``pdl`` as kernels/linear/triton.py's ``linear`` takes it)."""
    return dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, HAS_BIAS=bias, ACCUMULATE=accumulate,
                EVEN_K=k % cfg.block_k == 0, **dot_consts(dtype), X_TMA=cfg.tma == "xw", SWIGLU=swiglu,
                **pdl_consts(pdl), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: LinearConfig, *, bias: torch.Tensor | None,
           accumulate: torch.Tensor | None, swiglu: bool, pdl: int) -> torch.Tensor:
    """Run the TMA kernel into ``out`` [M, N] (N: the activation's width with ``swiglu``, w then [2N, K]);
    ``accumulate`` [M, N] (then ``out`` itself) added before the rounding. The launch must be eligible
    (``ineligible`` is None) and validated by the caller (kernels.linear)."""
    m, k = x.shape
    n = out.shape[1]
    consts = _consts(m, k, x.dtype, cfg, bias is not None, accumulate is not None, swiglu, pdl)
    w_desc = descriptor(w, 2 * n if swiglu else n, (cfg.block_n, cfg.block_k))
    x_desc = descriptor(x, m, (cfg.block_m, cfg.block_k)) if consts["X_TMA"] else None
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    b = bias if bias is not None else out  # unread without HAS_BIAS (c likewise without ACCUMULATE)
    c = accumulate if accumulate is not None else out
    _linear_tma_kernel[grid](x, x_desc, w, w_desc, b, c, out, m, n, k, x.stride(0), w.stride(0), c.stride(0),
                             out.stride(0), **consts)
    return out


def warmup(m: int, n: int, k: int, dtype: torch.dtype, cfg: LinearConfig, *, bias: bool = False,
           accumulate: bool = False, swiglu: bool = False, pdl: int = -1, stride_w: int | None = None) -> None:
    """Compile (into Triton's cache) the kernel such a launch runs, without tensors or a launch (the bench
    compiles its grid on many processes with this): contiguous x, out and accumulate, w of row stride
    ``stride_w`` (default K), descriptors over address-only bases; ``pdl`` as ``launch`` takes it."""
    consts = _consts(m, k, dtype, cfg, bias, accumulate, swiglu, pdl)
    sw = k if stride_w is None else stride_w
    w_desc = TensorDescriptor(_Base(0, dtype), [2 * n if swiglu else n, k], [sw, 1], [cfg.block_n, cfg.block_k])
    x_desc = TensorDescriptor(_Base(0, dtype), [m, k], [k, 1], [cfg.block_m, cfg.block_k]) \
        if consts["X_TMA"] else None
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _linear_tma_kernel.warmup(dtype, x_desc, dtype, w_desc, dtype, dtype, dtype, m, n, k, k, sw, n, n,
                              grid=grid, **consts)
