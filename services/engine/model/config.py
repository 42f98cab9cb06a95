"""Model configuration: read once from a Hugging Face ``config.json`` and validated here.

Supported architectures: LlamaForCausalLM (Llama 2/3, Llama-3.1 ``llama3`` rope scaling),
MistralForCausalLM, Qwen2ForCausalLM (q/k/v bias), Qwen3ForCausalLM (per-head q/k RMSNorm).
Anything else, or another rope type, is refused by name at load.
Both config spellings are read: transformers v4 (``rope_theta`` + ``rope_scaling``) and v5
(``rope_parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str          # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None   # None or {"rope_type": "llama3", "factor": ..., ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False              # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # refused past it: full attention only
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        kind = self.rope_type
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {kind!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")

    @property
    def rope_type(self) -> str:
        s = self.rope_scaling or {}
        return s.get("rope_type", s.get("type", "default"))

    @property
    def family(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, at 2 bytes an element (bf16/fp16)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        archs = d.get("architectures") or []
        if len(archs) != 1:
            raise ValueError(f"config.json must name exactly one architecture, got {archs!r}")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        family = SUPPORTED_ARCHITECTURES[arch]
        params = d.get("rope_parameters")
        if params:  # transformers v5 spelling
            theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        else:
            theta = float(d.get("rope_theta", 10000.0))
            scaling = d.get("rope_scaling")
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        heads = int(d["num_attention_heads"])
        window = d.get("sliding_window")
        if family == "qwen2" and not d.get("use_sliding_window", False):
            window = None
        if family == "qwen3" and not d.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=family == "qwen2" or bool(d.get("attention_bias", False)),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        cfg = Path(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"{cfg} not found: a model directory needs a Hugging Face config.json")
        return cls.from_hf_dict(json.loads(cfg.read_text()))

    def to_hf_dict(self) -> dict:
        """The config.json of this model (transformers v4 spelling, read by v4 and v5)."""
        d = {
            "architectures": [self.architecture],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias if self.family == "llama" else None,
            "sliding_window": self.sliding_window,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "float32",
        }
        if d["attention_bias"] is None:
            del d["attention_bias"]
        if self.family in ("qwen2", "qwen3"):
            d["use_sliding_window"] = False
        return d
