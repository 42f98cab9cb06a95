"""Merge partial attention results by log-sum-exp (sparse and retrieval decode build on it)."""

from __future__ import annotations

from kernels.lse_merge.reference import merge_attention as merge_attention_reference


def merge_attention(outs, lses, backend: str = "torch", out_dtype=None):
    """outs [P, ..., D], lses [P, ...] -> (out [..., D] (outs' dtype, or ``out_dtype``), lse [...] fp32)."""
    if backend == "torch":
        return merge_attention_reference(outs, lses, out_dtype)
    if backend == "triton":
        from kernels.lse_merge.triton import merge_attention as merge_attention_triton

        return merge_attention_triton(outs, lses, out_dtype)
    raise ValueError(f"unknown backend {backend!r} (torch or triton)")
