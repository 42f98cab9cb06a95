"""The Llama-family decoder math, split at the attention call so that the engine decides which
tokens attend to which KV (paged, deferred RoPE) and which tokens are computed at all.

  h -> attention_inputs(layer, h, pos) -> q, k, v      (norm, projections, Qwen3 q/k norm, RoPE)
     -> [engine: write k, v to paged slots; paged attention over the request's block table]
     (or attention_inputs(layer, h, pos, write=pool.at(layer, block, slot)) -> q: k, v stored in the
      same kernel that makes them)
     -> finish_layer(layer, h, attn) -> h             (o_proj + residual, MLP + residual)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import linear as skinny
from kernels.fused import KVWrite, add_rms_norm, default_backend, qkv_heads, rms_norm, silu_mul
from kernels.rope import rope_cos_sin, rope_inv_freq
from services.engine.model.config import ModelConfig
from services.engine.model.weights import LayerWeights, ModelWeights


class Transformer:
    """``kernel_backend`` runs the layer's elementwise work (kernels/fused): ``triton`` on CUDA when
    Triton imports (the default), the plain-torch twin otherwise. ``rope_backend`` says how q/k are
    rotated when positions are given: ``torch`` from cos/sin tables made once per pass (memoised by
    the position tensor), any other value from the positions inside the kernel (what CUDA graphs
    need: a memo would be frozen into the graph).

    Projections of few rows (short passes, decode steps: at most ``kernels.linear.MAX_M``) go through
    the weight-streaming Triton GEMM (kernels/linear) when the kernel backend is Triton, cuBLAS
    otherwise; ``skinny_gemm=False`` (EngineOptions) keeps every projection on cuBLAS (what benchmarks compare)."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, rope_backend: str = "torch",
                 kernel_backend: str | None = None, skinny_gemm: bool = True):
        self.cfg = cfg
        self.w = weights
        self.rope_backend = rope_backend
        self.kernels = kernel_backend or default_backend(weights.embed.device)
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(weights.embed.device)
        self.scale = cfg.head_dim ** -0.5
        self._rope_memo: tuple | None = None  # (pos, cos, sin): one table per pass, not per layer
        # with the skinny GEMM, gate|up and SiLU*up run in one launch (86 us less GPU time a pass on an H100, the same
        # bits). The RMSNorms in the GEMM's prologue and o onto the residual in its epilogue measured slower there
        # (tessera@0 10.9 against 8.0 ms: bench/HISTORY.md) and are not taken
        self.skinny = self.kernels == "triton" and skinny_gemm

    def _linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                accumulate: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w.T (+ bias), or added onto ``accumulate`` in place: the skinny Triton GEMM where it applies."""
        if self.skinny and skinny.supported(x, w):
            return skinny.linear(x, w, bias, accumulate=accumulate, backend="triton")
        if accumulate is not None:
            return accumulate.addmm_(x, w.t()) if bias is None else accumulate.add_(F.linear(x, w, bias))
        return F.linear(x, w, bias)

    def _rope_table(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memo = self._rope_memo
        if memo is None or memo[0] is not pos:
            cos, sin = rope_cos_sin(pos, self.inv_freq)
            memo = self._rope_memo = (pos, cos[:, None, :], sin[:, None, :])
        return memo[1], memo[2]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.w.embed)  # [T, hidden] (a lighter launch than advanced indexing)

    def attention_inputs(self, layer: int, h: torch.Tensor, pos: torch.Tensor | None, rope=None,
                         write: KVWrite | None = None):
        """h [T, hidden] at global positions pos [T] -> q [T, Hq, D], k, v [T, Hkv, D] (q, k rotated).

        ``rope`` = (cos, sin) [T, 1, D/2] given instead of ``pos`` by static (graph-captured) passes.
        ``write`` (``BlockPool.at``): k and v go straight into that layer's paged cache and are not
        returned (None): the caller only attends with q.
        Three kernels on CUDA: RMSNorm, the q|k|v matmul, and one pass splitting q, k, v with q/k norm
        and RoPE (and the K/V write)."""
        cfg, lw = self.cfg, self.w.layers[layer]
        x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps, backend=self.kernels)
        qkv = self._linear(x, lw.qkv_proj, lw.qkv_bias)  # [T, (Hq + 2*Hkv) * D]
        if rope is None and self.rope_backend == "torch":
            rope = self._rope_table(pos)
        cos, sin = rope if rope is not None else (None, None)
        return qkv_heads(qkv, cfg.num_heads, cfg.num_kv_heads, cos=cos, sin=sin,
                         positions=pos if rope is None else None, inv_freq=self.inv_freq,
                         q_norm=lw.q_norm, k_norm=lw.k_norm, eps=cfg.rms_norm_eps, write=write,
                         return_kv=write is None, backend=self.kernels)

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Residual attention output and the SwiGLU MLP. attn [T, Hq, D] -> h [T, hidden] (a new tensor;
        the input h is not written). Five kernels on CUDA: o_proj, residual add + RMSNorm, the gate|up
        matmul, SiLU*up, and the down matmul accumulating onto the residual (beta = 1); four where the
        skinny GEMM takes gate|up (SiLU*up in its epilogue)."""
        lw: LayerWeights = self.w.layers[layer]
        eps = self.cfg.rms_norm_eps
        a = attn.reshape(attn.shape[0], -1)
        o = self._linear(a, lw.o_proj)
        x, h = add_rms_norm(o, h, lw.post_norm, eps, backend=self.kernels)
        if self.skinny and skinny.supported(x, lw.gate_up_proj):
            act = skinny.linear_swiglu(x, lw.gate_up_proj, backend="triton")  # [T, inter]
        else:
            act = silu_mul(self._linear(x, lw.gate_up_proj), backend=self.kernels)
        # NOTE: h is a fresh tensor (the o GEMM's or add_rms_norm's output): adding in place writes no caller's
        return self._linear(act, lw.down_proj, accumulate=h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] -> fp32 logits [T, vocab]."""
        return self._linear(rms_norm(h, self.w.norm, self.cfg.rms_norm_eps, backend=self.kernels),
                            self.w.lm_head).float()
