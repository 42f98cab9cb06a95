"""Merge partial attention results by log-sum-exp, plain torch (twin of ``kernels/lse_merge/triton.py``).

Attention over a key set split into parts P_1..P_n equals the merge of the parts' results:
  lse = log Σ_i exp(lse_i),   out = Σ_i exp(lse_i - lse) · out_i.
A part that saw no key has lse -inf and contributes nothing; if no part saw a key, out is 0, lse -inf.
"""

from __future__ import annotations

import torch


def merge_attention(outs: torch.Tensor, lses: torch.Tensor,
                    out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [P, ..., D], lses [P, ...] (fp32) -> out [..., D] (outs.dtype, or ``out_dtype``), lse [...] fp32."""
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} disagree")
    lses = lses.to(torch.float32)
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - safe.unsqueeze(0))  # [P, ...]; exp(-inf) = 0 for empty parts
    out = (weights.unsqueeze(-1) * outs.to(torch.float32)).sum(dim=0)
    return out.to(outs.dtype if out_dtype is None else out_dtype), lse
