"""RoPE: the Triton kernel against the twin, and the twin against an independent fp64 formula."""

import math

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, rel_err

from kernels.rope import apply_rope, rope_inv_freq

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
CASES = [(1, 1, 64, torch.float32), (63, 8, 128, torch.float32), (500, 3, 64, torch.bfloat16),
         (17, 32, 128, torch.float16), (5, 2, 96, torch.float32)]


# the interpreter runs one program per token: the table variant skips the long case
RUNS = [(*c, False) for c in CASES] + [(*c, True) for c in CASES if c[0] <= 100]


@pytest.mark.parametrize("t,h,d,dtype,use_table", RUNS, ids=[
    f"T{t}-H{h}-D{d}-{DTYPE_NAME[dt]}-{'table' if tab else 'computed'}" for t, h, d, dt, tab in RUNS])
def test_triton_matches_twin(t, h, d, dtype, use_table):
    from kernels.rope.triton import apply_rope as triton_rope

    inv = rope_inv_freq(d, 500000.0, LLAMA3)
    x = torch.randn(t, h, d).to(dtype)
    pos = torch.randint(0, 70000, (t,))
    want = apply_rope(x, pos, inv)
    got = triton_rope(x, pos, inv, use_table=use_table)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, want) <= TOL[dtype]
    assert rel_err(apply_rope(x, pos, inv, backend="triton"), want) <= TOL[dtype]


def test_twin_matches_fp64_formula_and_group_action():
    d = 64
    inv = rope_inv_freq(d, 10000.0)
    x = torch.randn(40, 4, d)
    pos = torch.arange(40) * 997
    ang = pos.double()[:, None] * inv.double()[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.double()[..., : d // 2], x.double()[..., d // 2:]
    want = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    # fp32 angles at positions ~4e4 carry ~1e-4 relative error (as in Hugging Face), not a kernel fault
    assert rel_err(apply_rope(x, pos, inv), want) <= 5e-4
    # R_a R_b x == R_{a+b} x: what lets a cached chunk move to any offset
    a, b = torch.randint(0, 30000, (40,)), torch.randint(0, 30000, (40,))
    assert rel_err(apply_rope(apply_rope(x, b, inv), a, inv), apply_rope(x, a + b, inv)) <= 1e-3


def test_llama3_scaling_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=dict(LLAMA3),
                      max_position_embeddings=131072)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(128, 500000.0, LLAMA3)
    assert torch.allclose(got, want.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(got, rope_inv_freq(128, 500000.0))  # scaling changed something
    assert math.isclose(float(got[0]), 1.0)


def test_refuses_bad_shapes():
    from kernels.rope.triton import apply_rope as triton_rope

    inv = rope_inv_freq(64, 10000.0)
    with pytest.raises(ValueError, match="positions"):
        triton_rope(torch.randn(4, 2, 64), torch.arange(3), inv)
    with pytest.raises(ValueError, match="inverse frequencies"):
        triton_rope(torch.randn(4, 2, 32), torch.arange(4), inv)
