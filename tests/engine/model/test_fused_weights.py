"""Fused q|k|v and gate|up projections: loaded once, the per-projection weights are views into them,
and the model's layer math is unchanged."""

import pytest
import torch

from services.engine.model.layers import Transformer
from services.engine.model.tiny import random_weights, tiny_config
from services.engine.model.weights import load_weights, weights_from_tensors


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_projections_are_views_of_the_fused_weights(tiny_dirs, arch):
    from safetensors.torch import load_file

    from services.engine.model.config import ModelConfig

    cfg = ModelConfig.from_dir(tiny_dirs[arch])
    w = load_weights(tiny_dirs[arch], cfg, torch.device("cpu"), torch.float32)
    ckpt = load_file(str(tiny_dirs[arch] / "model.safetensors"))
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        assert lw.qkv_proj.shape == ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
        assert lw.gate_up_proj.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
        pairs = [(lw.q_proj, lw.qkv_proj, "self_attn.q_proj.weight"), (lw.k_proj, lw.qkv_proj, "self_attn.k_proj.weight"),
                 (lw.v_proj, lw.qkv_proj, "self_attn.v_proj.weight"), (lw.gate_proj, lw.gate_up_proj, "mlp.gate_proj.weight"),
                 (lw.up_proj, lw.gate_up_proj, "mlp.up_proj.weight")]
        if cfg.attention_bias:
            pairs += [(b, lw.qkv_bias, f"self_attn.{n}_proj.bias") for b, n in zip((lw.q_bias, lw.k_bias, lw.v_bias), "qkv")]
        else:
            assert lw.qkv_bias is None and lw.q_bias is None
        for part, whole, name in pairs:
            assert part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(), name
            assert torch.equal(part, ckpt[p + name]), name
    # nothing held twice: the layers' distinct storages add up to the checkpoint's layer bytes
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for lw in w.layers for t in (getattr(lw, f) for f in lw.__slots__) if t is not None}
    layer_bytes = sum(t.numel() * t.element_size() for n, t in ckpt.items() if n.startswith("model.layers."))
    assert sum(storages.values()) == layer_bytes


def test_wrong_projection_shape_is_refused_by_name():
    cfg = tiny_config("llama")
    tensors = random_weights(cfg, 0)
    tensors["model.layers.2.self_attn.k_proj.weight"] = torch.zeros(3, cfg.hidden_size)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight has shape \(3, 128\)"):
        weights_from_tensors(tensors, cfg, torch.device("cpu"), torch.float32)
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="lacks weight 'model.layers.2.self_attn.k_proj.weight'"):
        weights_from_tensors(tensors, cfg, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_layer_equals_unfused_math(arch):
    """attention_inputs / finish_layer against the layer written out with separate projections."""
    import torch.nn.functional as F

    from kernels.rope import apply_rope
    from kernels.fused.reference import rms_norm

    cfg = tiny_config(arch)
    w = weights_from_tensors(random_weights(cfg, 5), cfg, torch.device("cpu"), torch.float32)
    model = Transformer(cfg, w)
    lw, eps, t = w.layers[2], cfg.rms_norm_eps, 9
    h, pos = torch.randn(t, cfg.hidden_size), torch.arange(100, 100 + t)
    x = rms_norm(h, lw.input_norm, eps)
    q = F.linear(x, lw.q_proj, lw.q_bias).view(t, cfg.num_heads, cfg.head_dim)
    k = F.linear(x, lw.k_proj, lw.k_bias).view(t, cfg.num_kv_heads, cfg.head_dim)
    v = F.linear(x, lw.v_proj, lw.v_bias).view(t, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q, k = rms_norm(q, lw.q_norm, eps), rms_norm(k, lw.k_norm, eps)
    want = apply_rope(q, pos, model.inv_freq), apply_rope(k, pos, model.inv_freq), v
    for got, ref in zip(model.attention_inputs(2, h, pos), want):
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)
    attn = torch.randn(t, cfg.num_heads, cfg.head_dim)
    h1 = h + F.linear(attn.reshape(t, -1), lw.o_proj)
    x = rms_norm(h1, lw.post_norm, eps)
    ref = h1 + F.linear(F.silu(F.linear(x, lw.gate_proj)) * F.linear(x, lw.up_proj), lw.down_proj)
    assert torch.allclose(model.finish_layer(2, h, attn), ref, rtol=1e-5, atol=1e-5)
