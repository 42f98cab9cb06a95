"""Compile the Triton kernels for an H100 (sm_90) on a machine without a GPU: Triton's frontend, LLVM
and ptxas (bundled with Triton) all run on the CPU. Catches what the interpreter accepts and the
compiler does not (non-constexpr globals in a kernel, bad casts, shared memory past the limit) before
a GPU run, and prints each kernel's registers, spills and shared memory.

    python tests/kernels/compile_sm90.py [--only NAME]

Signatures are those of the engine's Llama-3-8B benchmark shapes (bf16, 32 query / 8 KV heads,
head_dim 128, block size 16) with the default configurations. Variants named ``...-pdl`` are the
programmatic-dependent-launch builds (kernels/pdl.py): they fail here unless their PTX holds
griddepcontrol.wait and griddepcontrol.launch_dependents, in that order.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # the kernels must be JIT functions, not interpreted ones
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_kernel(fn, pointers: dict[str, str], constexprs: dict, scalars: dict[str, str] | None = None,
                   num_warps: int = 4, num_stages: int = 3):
    """Compile ``fn`` for sm_90. pointers: arg -> element type ("bf16", "i64", ...); scalars: arg -> type
    (default i32); every other argument must be in constexprs. Pointers are marked 16-byte aligned,
    as Triton marks them at launch for tensors from torch's allocator."""
    scalars = scalars or {}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = scalars.get(name, "i32")
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})


def constexpr_names(fn) -> list[str]:
    return [fn.arg_names[i] for i in fn.constexprs]


def kernels():
    """(name, thunk) of every kernel the engine's prefill path launches on CUDA."""
    from kernels.lse_merge.triton import BLOCK_R, UNROLLED_BLOCK_R, _merge_all_kernel, _merge_kernel
    from kernels.paged_attention import _prefill
    from kernels.paged_attention._meta import PACK_BLOCK, _pack_kernel
    from kernels.positional_attention.triton import _positional_kernel
    from kernels.rope.triton import _gather_rotate_kernel, _rope_kernel

    cfg = _prefill.PrefillConfig()
    d, g, bs = 128, 4, 16
    # pointers by name; any other *_ptr argument a kernel gains is taken as int32
    ptr_types = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", meta_ptr="i64", mask_ptr="i64", tab_ptr="fp32",
                     invf_ptr="fp32", out_ptr="fp32", lse_ptr="fp32")
    known = dict(G=g, G_PAD=g, BLOCK_T=cfg.block_m // g, BS=bs, BS_PAD=bs, NB=max(1, cfg.min_block_n // bs), D=d,
                 B_PAD=2, ROTATE=True, USE_TABLE=True, MASK_IN_WORD=True, DOT_F32=False, BLOCK=256)

    def jit_args(fn, **override):
        """Pointer types and constexpr values of a kernel of the prefill module, by argument name:
        a flag the configuration has (SPLIT_PV -> cfg.split_pv) takes its default."""
        ptrs = {a: override.get(a, ptr_types.get(a, "i32")) for a in fn.arg_names if a.endswith("_ptr")}
        consts = {a: override.get(a, known.get(a, getattr(cfg, a.lower(), False))) for a in constexpr_names(fn)}
        return ptrs, consts

    yield "pack", lambda: compile_kernel(
        _pack_kernel, dict(ids_ptr="i32", off_ptr="i32", mask_ptr="i64", invf_ptr="fp32", meta_ptr="i64", tab_ptr="fp32"),
        dict(D2=d // 2, BLOCK=PACK_BLOCK, WRITE_TABLE=True))
    for out in ("bf16", "fp32"):  # one split writes q's dtype, several write fp32 partials
        yield f"prefill-out-{out}", lambda out=out: compile_kernel(
            _prefill.__dict__["_prefill_kernel"], *jit_args(_prefill._prefill_kernel, out_ptr=out),
            dict(qk_scale="fp32"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for out in ("bf16", "fp32"):  # long calls: each group's entries after the tile's latest query cut (cut_future)
        yield f"prefill-cut-out-{out}", lambda out=out: compile_kernel(
            _prefill._prefill_kernel, *jit_args(_prefill._prefill_kernel, out_ptr=out, CUT=True, SKIP_EMPTY=True,
                                                SEARCH=out == "fp32"),
            dict(qk_scale="fp32"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    yield "prefill-splits-search", lambda: compile_kernel(  # several KV splits: each searches its groups
        _prefill._prefill_kernel, *jit_args(_prefill._prefill_kernel, out_ptr="fp32", SEARCH=True),
        dict(qk_scale="fp32"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    yield "prefill-short-nb8", lambda: compile_kernel(  # the short-query launch at 128 keys a step
        _prefill._prefill_kernel, *jit_args(_prefill._prefill_kernel, out_ptr="fp32", SEARCH=True, NB=8),
        dict(qk_scale="fp32"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for pdl in (0, 1):  # the engine's 64-token suffix launch (SHORT_PREFILL: 8 splits)
        yield f"prefill-short{PDL_SUFFIX[pdl]}", lambda pdl=pdl: compile_kernel(
            _prefill._prefill_kernel, *jit_args(_prefill._prefill_kernel, out_ptr="fp32", SEARCH=True, PDL=pdl),
            dict(qk_scale="fp32"), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    for name, fn in vars(_prefill).items():  # helper kernels of the prefill module (metadata passes)
        if isinstance(fn, triton.runtime.JITFunction) and name != "_prefill_kernel" and \
                any(a.endswith("_ptr") for a in fn.arg_names) and name.endswith("_kernel"):
            yield name.strip("_"), lambda fn=fn: compile_kernel(fn, *jit_args(fn))
            if "PDL" in fn.arg_names:
                yield name.strip("_") + PDL_SUFFIX[1], lambda fn=fn: compile_kernel(fn, *jit_args(fn, PDL=1))
    for pdl in (0, 1):
        sfx = PDL_SUFFIX[pdl]
        yield "lse-merge" + sfx, lambda pdl=pdl: compile_kernel(
            _merge_kernel, dict(outs_ptr="fp32", lses_ptr="fp32", out_ptr="bf16", lse_ptr="fp32"),
            dict(BLOCK_R=BLOCK_R, BLOCK_D=d, PDL=pdl, N_PARTS=0))
        yield "lse-merge-unrolled8" + sfx, lambda pdl=pdl: compile_kernel(
            _merge_kernel, dict(outs_ptr="fp32", lses_ptr="fp32", out_ptr="bf16", lse_ptr="fp32"),
            dict(BLOCK_R=UNROLLED_BLOCK_R, BLOCK_D=d, PDL=pdl, N_PARTS=8))
        yield "lse-merge-all" + sfx, lambda pdl=pdl: compile_kernel(
            _merge_all_kernel, dict(outs_ptr="fp32", lses_ptr="fp32", out_ptr="bf16", lse_ptr="fp32"),
            dict(P_PAD=8, BLOCK_R=8, BLOCK_D=d, PDL=pdl))
        yield "lse-merge-all128" + sfx, lambda pdl=pdl: compile_kernel(   # a dense decode's 99 splits
            _merge_all_kernel, dict(outs_ptr="fp32", lses_ptr="fp32", out_ptr="bf16", lse_ptr="fp32"),
            dict(P_PAD=128, BLOCK_R=1, BLOCK_D=d, PDL=pdl), num_warps=8)
    yield "gather-rotate", lambda: compile_kernel(
        _gather_rotate_kernel, dict(k_ptr="bf16", v_ptr="bf16", ids_ptr="i32", off_ptr="i32", invf_ptr="fp32",
                                    ko_ptr="bf16", vo_ptr="bf16"),
        dict(HALF=d // 2, BLOCK_R=32, BLOCK_D2=d // 2))
    yield "gather-rotate-slots", lambda: compile_kernel(  # one-slot blocks of 8 heads (the blend graph's keys)
        _gather_rotate_kernel, dict(k_ptr="bf16", v_ptr="bf16", ids_ptr="i64", off_ptr="i64", invf_ptr="fp32",
                                    ko_ptr="bf16", vo_ptr="bf16"),
        dict(HALF=d // 2, BLOCK_R=8, BLOCK_D2=d // 2))
    yield "positional", lambda: compile_kernel(
        _positional_kernel, dict(q_ptr="bf16", pos_ptr="i64", k_ptr="bf16", v_ptr="bf16", o_ptr="bf16"),
        dict(k_desc=None, v_desc=None, G=4, D=d, BLOCK_D=d, BLOCK_M=64, BLOCK_N=64, EVEN=True, TMA=False,
             DOT_F32=False), scalars=dict(scale_log2="fp32"))
    yield "rope", lambda: compile_kernel(
        _rope_kernel, dict(x_ptr="bf16", pos_ptr="i64", invf_ptr="fp32", tab_ptr="fp32", out_ptr="bf16"),
        dict(BLOCK_H=8, BLOCK_D2=d // 2, USE_TABLE=False))
    yield from sparse_kernels(d, g, bs)


def sparse_kernels(d: int, g: int, bs: int):
    """Quest's and RetroAttention's decode kernels (kernels/sparse) at the decode graphs' table types (int64 ids and
    offsets), with their default configurations: one split and several."""
    from kernels.sparse import _attend, _retro, _scores, _select

    nb = 16 // g
    attend = dict(G=g, G_PAD=g, NB=nb, ROWS=16, BS=bs, D2=d // 2, DOT_F32=False)
    table = dict(q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", ids_ptr="i64", off_ptr="i64", mask_ptr="i64",
                 invf_ptr="fp32", cnt_ptr="i32", lse_ptr="fp32")
    for out in ("bf16", "fp32"):   # one split writes q's dtype, several fp32 parts
        yield f"sparse-attend-{out}", lambda out=out: compile_kernel(
            _attend._sparse_decode_kernel, {**table, "sel_ptr": "i32", "out_ptr": out}, attend, dict(qk_scale="fp32"),
            num_warps=_attend.AttendConfig().num_warps, num_stages=1)
    cfg = _scores.ScoresConfig()
    yield "sparse-scores", lambda: compile_kernel(
        _scores._scores_kernel, dict(q_ptr="bf16", kmin_ptr="bf16", kmax_ptr="bf16", ids_ptr="i64", off_ptr="i64",
                                     mask_ptr="i64", cu_ptr="i32", invf_ptr="fp32", out_ptr="fp32"),
        dict(G=g, D2=d // 2, BLOCK_E=cfg.tile // 8, HB=8, ONE_QUERY=cfg.one_query), num_warps=cfg.num_warps)
    yield "sparse-select", lambda: compile_kernel(
        _select._select_kernel, dict(scores_ptr="fp32", cu_ptr="i32", sel_ptr="i32", cnt_ptr="i32"),
        dict(BLOCK=2048, PAD_BLOCK=_select.PAD_BLOCK, W=_select.RADIX_BITS,
             FIRST=32 - _select.RADIX_BITS * (31 // _select.RADIX_BITS)), num_warps=8)
    for splits, stages in ((1, 1), (8, 3)):   # the fused kernel, as Retro's decode graphs launch it (window 2)
        ptrs = {**table, "qp_ptr": "bf16", "sel_ptr": "i32", "ent_ptr": "i64", "seen_ptr": "i64", "cu_ptr": "i64",
                "flag_ptr": "i8", "pcnt_ptr": "i32", "oin_ptr": "bf16", "lin_ptr": "fp32",
                "out_ptr": "fp32" if splits > 1 else "bf16"}
        fused = {**attend, "NB": nb // 2, "K": 128, "K_PAD": 128, "WIDTH": 128, "TILE": _retro.SEEN_TILE, "P": 1,
                 "KINDS": 2, "NSPLIT": splits}
        yield f"quest-retro-s{splits}", lambda ptrs=ptrs, fused=fused, stages=stages: compile_kernel(
            _retro._quest_retro_kernel, ptrs, fused, dict(qk_scale="fp32"), num_warps=_retro.RetroConfig().num_warps,
            num_stages=stages)


def resources(cubin: bytes) -> str:
    """Registers, stack (spills land there) and shared memory per the bundled cuobjdump."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    return f"regs {found[1]}  stack {found[2]} B  static shared {found[3]} B" if found else "resources unknown"


PDL_PTX = ("griddepcontrol.wait", "griddepcontrol.launch_dependents")
PDL_SUFFIX = {0: "", 1: "-pdl"}  # a variant's name by its PDL constexpr (kernels/pdl.py's modes)


def pdl_check(ptx: str, expect: bool) -> str | None:
    """What is wrong with a kernel's griddepcontrol instructions (a PDL variant must hold both, the wait
    first; any other variant none), or None."""
    found = [op for op in PDL_PTX if op in ptx]
    if expect and len(found) < len(PDL_PTX):
        return f"PDL variant without {', '.join(op for op in PDL_PTX if op not in found)} in its PTX"
    if not expect and found:
        return f"{', '.join(found)} in a variant built without PDL"
    if expect and ptx.index(PDL_PTX[1]) < ptx.index(PDL_PTX[0]):
        return "griddepcontrol.launch_dependents first in a -pdl variant"
    return None


def is_pdl(name: str) -> bool:
    return name.endswith("-pdl")


def loads_before_wait(ptx: str) -> int:
    """Global loads and L2 prefetches in the PTX before griddepcontrol.wait (what a PDL build may only spend on
    never-written data: weights, norm weights, constant tables; -1 without a wait)."""
    lines = ptx.splitlines()
    at = next((i for i, line in enumerate(lines) if "griddepcontrol.wait" in line), None)
    if at is None:
        return -1
    return sum(("ld.global" in line or "prefetch.global" in line) for line in lines[:at])


def compile_all(named_thunks, only: str | None = None, width: int = 18) -> int:
    """Compile every (name, thunk) whose name contains ``only``, printing each one's resources; the
    number that failed (every kernel is tried and reported; a ``-pdl`` variant whose PTX lacks
    griddepcontrol, or another that has it, fails)."""
    failed = 0
    for name, thunk in named_thunks:
        if only and only not in name:
            continue
        t0 = time.perf_counter()
        try:
            k = thunk()
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"{name:{width}s} FAILED: {exc!r}"[:2000], flush=True)
            continue
        wrong = pdl_check(k.asm["ptx"], is_pdl(name))
        if wrong:
            failed += 1
            print(f"{name:{width}s} FAILED: {wrong}", flush=True)
            continue
        gdc = f"  griddepcontrol in PTX, {loads_before_wait(k.asm['ptx'])} loads before the wait" \
            if is_pdl(name) else ""
        print(f"{name:{width}s} ok  {resources(k.asm['cubin'])}{gdc}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    return failed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="compile only kernels whose name contains this")
    args = ap.parse_args()
    return 1 if compile_all(kernels(), args.only) else 0


if __name__ == "__main__":
    sys.exit(main())
