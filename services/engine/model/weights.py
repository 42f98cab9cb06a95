"""Read a Hugging Face checkpoint's safetensors (single file or sharded index) into layer weights."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from services.engine.model.config import ModelConfig


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer. Projections are [out_features, in_features] as in nn.Linear.

    q|k|v and gate|up are each stored once, concatenated by rows, so a layer runs one matmul for each
    (as vLLM's merged column-parallel linears do); the per-projection fields are views into them."""

    input_norm: torch.Tensor    # [hidden]
    qkv_proj: torch.Tensor      # [(Hq + 2*Hkv)*D, hidden]: q rows, then k, then v
    o_proj: torch.Tensor        # [hidden, Hq*D]
    post_norm: torch.Tensor     # [hidden]
    gate_up_proj: torch.Tensor  # [2*inter, hidden]: gate rows, then up
    down_proj: torch.Tensor     # [hidden, inter]
    q_proj: torch.Tensor        # [Hq*D, hidden]   views of qkv_proj
    k_proj: torch.Tensor        # [Hkv*D, hidden]
    v_proj: torch.Tensor        # [Hkv*D, hidden]
    gate_proj: torch.Tensor     # [inter, hidden]  views of gate_up_proj
    up_proj: torch.Tensor       # [inter, hidden]
    qkv_bias: torch.Tensor | None = None  # Qwen2, [(Hq + 2*Hkv)*D]
    q_bias: torch.Tensor | None = None    # views of qkv_bias
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None    # Qwen3, [D]
    k_norm: torch.Tensor | None = None


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor        # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor         # [hidden]
    lm_head: torch.Tensor      # [vocab, hidden] (the embedding when tied)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    return files


def fingerprint(path: str | Path) -> str:
    """A content hash that names this model in chunk ids: config, tensor names/shapes and weight bytes
    sampled from every file (the first and last MiB), so that two different checkpoints never share ids."""
    path = Path(path)
    h = hashlib.sha256()
    h.update(json.dumps(json.loads((path / "config.json").read_text()), sort_keys=True).encode())
    for f in _safetensors_files(path):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with f.open("rb") as fh:
            h.update(fh.read(1 << 20))
            if size > 2 << 20:
                fh.seek(size - (1 << 20))
                h.update(fh.read())
    return h.hexdigest()[:32]


def load_weights(path: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> ModelWeights:
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                tensors[name] = fh.get_tensor(name)
    return weights_from_tensors(tensors, cfg, device, dtype, source=str(path))


def state_fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """Fingerprint of in-memory weights: the config and a sample of the embedding and first layer."""
    h = hashlib.sha256(json.dumps(cfg.to_hf_dict(), sort_keys=True).encode())
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        h.update(tensors[name].flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def weights_from_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, device: torch.device,
                         dtype: torch.dtype, source: str = "state dict") -> ModelWeights:
    """Hugging Face-named tensors -> ModelWeights. Tensors already on device/dtype are not copied,
    except q/k/v and gate/up, which are copied once into their concatenated projections."""

    def take(name: str, required: bool = True) -> torch.Tensor | None:
        t = tensors.get(name)
        if t is None:
            if required:
                raise ValueError(f"checkpoint {source} lacks weight {name!r}")
            return None
        return t.to(device=device, dtype=dtype)

    def fused(names: list[str], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """One tensor holding the named ones stacked by rows, then a view of each part: the parts are
        copied straight into place, so loading never holds a part twice on the device."""
        for name, shape in zip(names, shapes):
            if name not in tensors:
                raise ValueError(f"checkpoint {source} lacks weight {name!r}")
            if tuple(tensors[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(tensors[name].shape)}, config says {shape}")
        whole = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), device=device, dtype=dtype)
        views, row = [whole], 0
        for name, shape in zip(names, shapes):
            part = whole[row:row + shape[0]]
            part.copy_(tensors[name])
            views.append(part)
            row += shape[0]
        return views

    hid, inter = cfg.hidden_size, cfg.intermediate_size
    rows = [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        qkv, q, k, v = fused([p + f"self_attn.{n}_proj.weight" for n in "qkv"], [(r, hid) for r in rows])
        gate_up, gate, up = fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(inter, hid)] * 2)
        bias = [None] * 4
        if cfg.attention_bias:
            bias = fused([p + f"self_attn.{n}_proj.bias" for n in "qkv"], [(r,) for r in rows])
        layers.append(LayerWeights(
            input_norm=take(p + "input_layernorm.weight"),
            qkv_proj=qkv, q_proj=q, k_proj=k, v_proj=v,
            o_proj=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up_proj=gate_up, gate_proj=gate, up_proj=up,
            down_proj=take(p + "mlp.down_proj.weight"),
            qkv_bias=bias[0], q_bias=bias[1], k_bias=bias[2], v_bias=bias[3],
            q_norm=take(p + "self_attn.q_norm.weight", cfg.qk_norm),
            k_norm=take(p + "self_attn.k_norm.weight", cfg.qk_norm),
        ))
    embed = take("model.embed_tokens.weight")
    lm_head = take("lm_head.weight", required=not cfg.tie_word_embeddings)
    return ModelWeights(embed=embed, layers=layers, norm=take("model.norm.weight"),
                        lm_head=embed if lm_head is None else lm_head)
