"""The Llama-family decoder math, split at the attention call so that the engine decides which
tokens attend to which KV (paged, deferred RoPE) and which tokens are computed at all.

  h -> attention_inputs(layer, h, pos) -> q, k, v      (norm, projections, Qwen3 q/k norm, RoPE)
     -> [engine: write k, v to paged slots; paged attention over the request's block table]
     -> finish_layer(layer, h, attn) -> h             (o_proj + residual, MLP + residual)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.rope import apply_rope, rope_cos_sin, rope_inv_freq, rotate
from services.engine.config import ModelConfig
from services.engine.weights import LayerWeights, ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class Transformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, rope_backend: str = "torch"):
        self.cfg = cfg
        self.w = weights
        self.rope_backend = rope_backend
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(weights.embed.device)
        self.scale = cfg.head_dim ** -0.5
        self._rope_memo: tuple | None = None  # (pos, cos, sin): one table per pass, not per layer

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if self.rope_backend != "torch":
            return apply_rope(x, pos, self.inv_freq, backend=self.rope_backend)
        memo = self._rope_memo
        if memo is None or memo[0] is not pos:
            cos, sin = rope_cos_sin(pos, self.inv_freq)
            memo = self._rope_memo = (pos, cos[:, None, :], sin[:, None, :])
        return rotate(x, memo[1], memo[2])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.embed[ids]  # [T, hidden]

    def attention_inputs(self, layer: int, h: torch.Tensor, pos: torch.Tensor | None, rope=None):
        """h [T, hidden] at global positions pos [T] -> q [T, Hq, D], k, v [T, Hkv, D] (q, k rotated).

        ``rope`` = (cos, sin) [T, 1, D/2] given instead of ``pos`` by static (graph-captured) passes."""
        cfg, lw = self.cfg, self.w.layers[layer]
        x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
        t = x.shape[0]
        q = F.linear(x, lw.q_proj, lw.q_bias).view(t, cfg.num_heads, cfg.head_dim)
        k = F.linear(x, lw.k_proj, lw.k_bias).view(t, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(x, lw.v_proj, lw.v_bias).view(t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
        if rope is not None:
            return rotate(q, *rope), rotate(k, *rope), v
        return self._rope(q, pos), self._rope(k, pos), v

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual attention output and the SwiGLU MLP. attn [T, Hq, D] -> h [T, hidden]."""
        lw: LayerWeights = self.w.layers[layer]
        h = h + F.linear(attn.reshape(attn.shape[0], -1), lw.o_proj)
        x = rms_norm(h, lw.post_norm, self.cfg.rms_norm_eps)
        return h + F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> fp32 logits [T, vocab]."""
        return F.linear(rms_norm(h, self.w.norm, self.cfg.rms_norm_eps), self.w.lm_head).float()
