"""Compile the skinny-GEMM kernel (kernels/linear) for an H100 (sm_90) without a GPU, for every kernel
variant of bench/skinny_gemm/skinny_gemm.py's sweep on Llama-3-8B's projections (bf16), printing the variants that
fail or spill (see compile_sm90.py for what this catches).

    python tests/kernels/compile_linear_sm90.py [--quick] [--jobs N] [--pdl] [--tma]

``--pdl``: the launches of a 64-row (and 8-row) layer as kernels/pdl.py's switch makes them (programmatic dependent
launch, PDL_PREFETCH_STEPS weight steps asked for before the wait) beside the same launches without, each
PDL build checked for griddepcontrol in its PTX.
``--tma``: every kernel of bench/skinny_gemm/skinny_gemm.py --tma-ab (the TMA weight stream, kernels/linear/tma.py, and the
pointer configs beside it), every one printed; a TMA build fails here unless its PTX loads the weight tiles with
cp.async.bulk.tensor completing on mbarriers (and, with tma="xw", holds no cp.async of x left), or it needs more
shared memory than an H100 has.

(``bench/skinny_gemm/skinny_gemm.py --compile-only`` runs the same.) With the device's Triton 3.6: put an unpacked
Triton 3.6 wheel first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]
from compile_sm90 import TARGET, loads_before_wait, pdl_check, resources  # noqa: E402  (sets TRITON_INTERPRET=0 first)


H100_SHARED = 227 * 1024  # bytes of shared memory a block may take on sm_90


def tma_ptx_check(ptx: str, x_too: bool) -> str:
    """The TMA build's PTX, counted: bulk tensor copies, mbarrier waits and byte-count arrivals, cp.async left
    (x's pointer loads), wgmma / mma.sync; or 'FAILED ...' when a TMA piece is missing."""
    import re

    count = {name: len(re.findall(pat, ptx)) for name, pat in (
        ("cp.async.bulk.tensor", r"cp\.async\.bulk\.tensor"), ("mbarrier.try_wait", r"mbarrier\.try_wait"),
        ("mbarrier.arrive.expect_tx", r"mbarrier\.arrive\.expect_tx"), ("cp.async", r"cp\.async\.c[ag]\."),
        ("wgmma", r"wgmma\.mma_async"), ("mma.sync", r"mma\.sync"))}
    text = ", ".join(f"{v} {k}" for k, v in count.items())
    if not (count["cp.async.bulk.tensor"] and count["mbarrier.try_wait"] and count["mbarrier.arrive.expect_tx"]):
        return f"FAILED no TMA weight stream in the PTX ({text})"
    if x_too and count["cp.async"]:
        return f"FAILED tma='xw' left cp.async loads ({text})"
    return text


def _build(fn, sig: dict, constexprs: dict, attrs: dict, opts: dict):
    """The kernel compiled for sm_90, or 'FAILED ...' (reported with the variant, then counted)."""
    import triton
    from triton.compiler import ASTSource

    try:
        return triton.compile(ASTSource(fn, sig, constexprs=constexprs, attrs=attrs), target=TARGET, options=opts)
    except Exception as exc:
        return f"FAILED {exc!r}"[:500]


def _report(kern, pdl: bool, ptx: str = "") -> str:
    """A compiled variant's resources (and ``ptx`` counts), or 'FAILED ...' when a PDL build reads upstream data
    or issues a bulk copy (x may be written by the kernel before) ahead of griddepcontrol.wait."""

    asm = kern.asm["ptx"]
    wrong = pdl_check(asm, pdl)
    if pdl and not wrong:
        head = asm.split("griddepcontrol.wait")[0]
        wrong = "a bulk tensor copy before griddepcontrol.wait" if "cp.async.bulk.tensor" in head else None
    if wrong:
        return f"FAILED {wrong}"
    wait = f"  griddepcontrol, {loads_before_wait(asm)} loads/prefetches before the wait" if pdl else ""
    return f"{resources(kern.asm['cubin'])}  shared {kern.metadata.shared} B{ptx}{wait}"


def _plain_arg(i: int, name: str, values: dict, ptr_types: dict, sig: dict, attrs: dict, constexprs: dict) -> None:
    """Signature entry of a kernel argument as a launch specialises it: pointers 16-byte aligned (bf16 unless
    ptr_types names another element type), an integer 1 a constant, other integers i32 (16-divisible ones marked
    so)."""
    if name.endswith("_ptr"):
        sig[name] = "*" + ptr_types.get(name, "bf16")
        attrs[(i,)] = [["tt.divisibility", 16]]
    elif values[name] == 1:
        sig[name], constexprs[name] = "constexpr", 1
    else:
        sig[name] = "i32"
        if values[name] % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]


def compile_tma_variant(task) -> str:
    """Compile one launch of kernels/linear/tma.py's kernel as ``tma.launch`` makes it (descriptors of the
    config's boxes, pointers 16-byte aligned, integer arguments specialised as Triton does at launch); its
    resources and PTX counts, or 'FAILED ...'."""
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    from kernels.linear import tma

    m, n, k, cfg, acc, swiglu, pdl = (*task, False, -1)[:7]
    consts = tma._consts(m, k, torch.bfloat16, cfg, False, acc, swiglu, pdl)
    opts = {o: consts.pop(o) for o in ("num_warps", "num_stages")}
    consts.pop("launch_pdl", None)
    fn = tma._linear_tma_kernel
    values = dict(M=m, N=n, K=k, stride_xm=k, stride_wn=k, stride_cm=n, stride_om=n)
    boxes = dict(w_desc=(cfg.block_n, cfg.block_k), x_desc=(cfg.block_m, cfg.block_k) if consts["X_TMA"] else None)
    sig, attrs, constexprs = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        elif name in boxes:
            if boxes[name] is None:
                sig[name], constexprs[name] = "constexpr", None
            else:
                sig[name] = f"tensordesc<bf16[{boxes[name][0]}, {boxes[name][1]}]>"
        else:
            _plain_arg(i, name, values, {}, sig, attrs, constexprs)
    kern = _build(fn, sig, constexprs, attrs, opts)
    if isinstance(kern, str):
        return kern
    if kern.metadata.shared > H100_SHARED:
        return f"FAILED shared memory {kern.metadata.shared} B > {H100_SHARED} B"
    ptx = tma_ptx_check(kern.asm["ptx"], consts["X_TMA"])
    if ptx.startswith("FAILED"):
        return ptx
    return _report(kern, consts["PDL"], f"  PTX: {ptx}")


def compile_variant(task) -> str:
    """Compile one (m, n, k, cfg, accumulate[, swiglu[, pdl]]) launch as ``kernels.linear.triton.linear``
    (or ``linear_swiglu``, n then the activation's width) would make it: pointers 16-byte aligned, integer
    arguments that are multiples of 16 marked so, those equal to 1 constants (Triton's launch-time
    specialisation); its resources, or 'FAILED ...'."""
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    from kernels.linear import triton as kt

    m, n, k, cfg, acc, swiglu, pdl = (*task, False, -1)[:7]
    if cfg.tma != "off":
        return compile_tma_variant(task)
    _, mode, _, ints, consts = kt._plan(m, n, k, torch.bfloat16, cfg, False, acc, swiglu=swiglu, pdl=pdl)
    opts = {o: consts.pop(o) for o in ("num_warps", "num_stages")}
    consts.pop("launch_pdl", None)  # a launch option, not a constexpr
    fn = kt._linear_kernel
    values = dict(zip(fn.arg_names[7:], (*ints, k, k, n, n)))  # then the strides of x, w, accumulate, out
    ptr_types = dict(ws_ptr="fp32" if mode else "bf16", cnt_ptr="i32" if mode == 2 else "bf16")
    sig, attrs, constexprs = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
        else:
            _plain_arg(i, name, values, ptr_types, sig, attrs, constexprs)
    kern = _build(fn, sig, constexprs, attrs, opts)
    return kern if isinstance(kern, str) else _report(kern, consts["PDL"])


def pdl_variants() -> list[tuple]:
    """A layer's GEMM launches at 64 and 8 rows (q|k|v, o, o onto the residual, gate|up SwiGLU, down onto the
    residual) with the configs the kernel picks, without PDL and as kernels/pdl.py's switch launches them
    (kernels.linear.triton.PDL_PREFETCH_STEPS)."""
    from kernels.linear import triton as kt

    tasks = []
    for m in (64, 8):
        launches = [(m, 6144, 4096, kt.pick_config(m, 6144, 4096), False, False),
                    (m, 4096, 4096, kt.pick_config(m, 4096, 4096), False, False),
                    (m, 4096, 4096, kt.pick_config(m, 4096, 4096), True, False),
                    (m, 14336, 4096, kt.swiglu_config(m, 14336, 4096), False, True),
                    (m, 4096, 14336, kt.pick_config(m, 4096, 14336), True, False)]
        for launch in launches:
            tasks += [(*launch, -1), (*launch, kt.PDL_PREFETCH_STEPS)]
    return tasks


def compile_all(tasks: list, jobs: int, verbose: bool = False) -> int:
    """Compile every task on ``jobs`` processes; print failures and spills (every task with ``verbose``);
    1 if any failed."""
    from concurrent.futures import ProcessPoolExecutor

    import triton

    print(f"{len(tasks)} kernel variants (Triton {triton.__version__} at {Path(triton.__file__).parent})", flush=True)
    failed = spills = 0
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        for task, res in zip(tasks, pool.map(compile_variant, tasks)):
            m, n, k, cfg, acc, swiglu, pdl = (*task, False, -1)[:7]
            bad = res.startswith("FAILED")
            spill = not bad and "stack 0 B" not in res
            failed += bad
            spills += spill
            if bad or spill or verbose:
                kind = "swiglu " * swiglu + ("accumulate " if acc else "") + \
                    (f"pdl+{pdl} " if pdl >= 0 and cfg.split_k == 1 else "")
                print(f"M{m} N{n} K{k} {kind or 'plain '}{cfg.short()}: {res}", flush=True)
    print(f"{len(tasks)} compiled: {failed} failed, {spills} with a stack (spills or locals)")
    return 1 if failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the bench's --quick grid")
    ap.add_argument("--pdl", action="store_true", help="a layer's launches without and with PDL, all printed")
    ap.add_argument("--tma", action="store_true", help="bench/skinny_gemm/skinny_gemm.py --tma-ab's kernels, all printed")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.pdl:
        return compile_all(pdl_variants(), args.jobs, verbose=True)
    sys.path.append(str(Path(__file__).resolve().parents[2] / "bench" / "skinny_gemm"))  # after the repo
    if args.tma:
        from skinny_gemm import TMA_AB_CASES, tma_ab_variants

        return compile_all(tma_ab_variants(TMA_AB_CASES), args.jobs, verbose=True)
    from skinny_gemm import MS, SHAPES, variants

    return compile_all(list(variants(SHAPES, MS, args.quick).values()), args.jobs)


if __name__ == "__main__":
    sys.exit(main())
