"""Compile the fused layer kernels (kernels/fused) for an H100 (sm_90) without a GPU, with the
signatures of the engine's Llama-3-8B benchmark (bf16, 32 query / 8 KV heads, head_dim 128, hidden
4096), printing each kernel's registers, spills and shared memory (see compile_sm90.py); ``-pdl`` variants
are the programmatic-dependent-launch builds, checked for griddepcontrol in their PTX.

    python tests/kernels/compile_fused_sm90.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_sm90 import PDL_SUFFIX, compile_all, compile_kernel  # noqa: E402  (sets TRITON_INTERPRET=0 first)


def kernels():
    from kernels.fused.triton import _qkv_heads_kernel, _rms_norm_kernel, _silu_mul_kernel, _write_kv_kernel

    for res in (False, True):  # (-pdl: the programmatic-dependent-launch builds, kernels/pdl.py)
        for pdl in (0, 1):
            yield f"rms-norm{'-add' if res else ''}{PDL_SUFFIX[pdl]}", lambda res=res, pdl=pdl: compile_kernel(
                _rms_norm_kernel, dict(x_ptr="bf16", res_ptr="bf16", w_ptr="bf16", out_ptr="bf16", res_out_ptr="bf16"),
                dict(BLOCK=4096, HAS_RES=res, PDL=pdl), scalars=dict(eps="fp32"), num_warps=8)
    yield "silu-mul", lambda: compile_kernel(_silu_mul_kernel, dict(gu_ptr="bf16", out_ptr="bf16"), dict(BLOCK=1024))
    qkv_ptrs = dict(qkv_ptr="bf16", q_ptr="bf16", k_ptr="bf16", v_ptr="bf16", cos_ptr="fp32", sin_ptr="fp32",
                    pos_ptr="i64", invf_ptr="fp32", qn_ptr="bf16", kn_ptr="bf16", kc_ptr="bf16", vc_ptr="bf16",
                    blk_ptr="i64", slot_ptr="i64")
    # the engine's layer passes: k, v only into the cache; the plain split: k, v returned, no cache
    for table in (False, True):
        for norm in (False, True):
            for to_cache in (True, False):
                for pdl in (0, 1) if to_cache else (0,):
                    yield f"qkv-heads{'-table' if table else '-pos'}{'-qknorm' if norm else ''}" \
                          f"{'-cache' if to_cache else ''}{PDL_SUFFIX[pdl]}", \
                        lambda table=table, norm=norm, to_cache=to_cache, pdl=pdl: compile_kernel(
                            _qkv_heads_kernel, qkv_ptrs,
                            dict(HALF=64, BLOCK_H=16, BLOCK_D2=64, USE_TABLE=table, QK_NORM=norm,
                                 KV_OUT=not to_cache, TO_CACHE=to_cache, PDL=pdl), scalars=dict(eps="fp32"))
    yield "write-kv", lambda: compile_kernel(
        _write_kv_kernel, dict(k_ptr="bf16", v_ptr="bf16", kc_ptr="bf16", vc_ptr="bf16", blk_ptr="i64",
                               slot_ptr="i64"), dict(BLOCK=1024))


def main() -> int:
    return 1 if compile_all(kernels(), width=30) else 0


if __name__ == "__main__":
    sys.exit(main())
