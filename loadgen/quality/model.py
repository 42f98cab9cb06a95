"""A small Llama for training, in plain torch, saved as a Hugging Face ``LlamaForCausalLM`` directory.

Same math as transformers' Llama (RMSNorm in fp32, NeoX rotate-half RoPE, GQA with kv head j
serving query heads j*g..j*g+g-1, SwiGLU, untied lm_head) and the same parameter names, so the
saved directory loads unchanged in ``transformers`` and in ``services.engine``. This copy exists
for training (fused SDPA, an optional attention mask) and as the engine-free reference in eval.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 268
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 640
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 1024

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate) < 1:
            raise ValueError(f"model sizes must be positive: {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if (self.hidden // self.heads) % 2:
            raise ValueError("head_dim must be even for rotate-half RoPE")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def hf_config(self, dtype: str) -> dict:
        """config.json of the equivalent ``LlamaForCausalLM`` (``rope_theta`` also at top level for older readers)."""
        from loadgen.quality.vocab import vocab

        v = vocab()
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_positions,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": v.bos,
            "eos_token_id": v.eos,
            "pad_token_id": v.pad,
            "dtype": dtype,
            "torch_dtype": dtype,
        }

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelConfig":
        rope = cfg.get("rope_parameters") or {}
        return cls(
            vocab_size=cfg["vocab_size"], hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"], kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            intermediate=cfg["intermediate_size"], rope_theta=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rms_eps=cfg.get("rms_norm_eps", 1e-6), max_positions=cfg.get("max_position_embeddings", 1024),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_tables(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[T, head_dim]`` for integer ``positions [T]`` (computed in fp32)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=positions.device).float() / cfg.head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ``[B, H, T, D]`` rotated NeoX style (first half / second half pairs)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.heads * d, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.heads, c.head_dim).transpose(1, 2)      # [B, H, T, D]
        k = self.k_proj(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)   # [B, Hkv, T, D]
        v = self.v_proj(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = c.heads // c.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, c.heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden, cfg.rms_eps)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.rms_eps)


class TinyLlama(nn.Module):
    """``forward(tokens [B, T], mask [B|1, 1, T, T] bool or None) -> logits [B, T, V]``.

    ``mask`` None means causal. A boolean mask (True = may attend) expresses chunk-local attention:
    see ``evaluate.reuse_mask``. Positions are always 0..T-1.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        T = tokens.shape[1]
        cos, sin = rope_tables(self.cfg, torch.arange(T, device=tokens.device))
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.model.norm(x))

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def save_hf(model: TinyLlama, directory: str | Path, dtype: str = "float16") -> Path:
    """Write config.json, model.safetensors (HF names) and tokenizer.json into ``directory``."""
    from safetensors.torch import save_file

    from loadgen.quality.vocab import save_tokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", _DTYPES[dtype]).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(model.cfg.hf_config(dtype), indent=2) + "\n")
    save_tokenizer(out)
    return out


def load_hf(directory: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> TinyLlama:
    """Load a directory written by ``save_hf`` (or any HF Llama of the same shape) into a TinyLlama."""
    from safetensors.torch import load_file

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds no config.json")
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    model = TinyLlama(cfg)
    state = load_file(str(path / "model.safetensors"))
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval()
