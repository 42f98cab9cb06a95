"""positional_attention: the Triton kernel against the twin, and the twin against plain causal attention and
against attention over each query's visible keys alone."""

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DTYPE_NAME, TOL, rel_err

from kernels.positional_attention import positional_attention
from kernels.positional_attention import triton as pa_triton

# query tokens, keys, query heads, key heads, head_dim, dtype
CASES = [(37, 53, 8, 2, 32, torch.float32), (5, 200, 4, 1, 64, torch.bfloat16), (70, 70, 2, 2, 24, torch.float16),
         (1, 9, 4, 4, 16, torch.float32), (0, 12, 4, 2, 32, torch.float32)]


def _inputs(t, s, hq, hkv, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn((t, hq, d), generator=g).to(dtype)
    k = torch.randn((s, hkv, d), generator=g).to(dtype)
    v = torch.randn((s, hkv, d), generator=g).to(dtype)
    # scattered positions in any order, some past the last key (they see every key), some negative (none)
    pos = torch.randint(-3, s + 5, (t,), generator=g)
    return q, pos, k, v


@pytest.mark.parametrize("t,s,hq,hkv,d,dtype", CASES, ids=[f"T{c[0]}-S{c[1]}-Hq{c[2]}-Hkv{c[3]}-D{c[4]}-"
                                                         f"{DTYPE_NAME[c[5]]}" for c in CASES])
def test_triton_matches_twin(t, s, hq, hkv, d, dtype):
    q, pos, k, v = _inputs(t, s, hq, hkv, d, dtype, seed=5)
    want = positional_attention(q, pos, k, v, d ** -0.5)
    for cfg in (None, (16 * (hq // hkv), 16, 4, 1)):  # the default tiles, and small ones (many blocks, many tiles)
        got = pa_triton.positional_attention(q, pos, k, v, d ** -0.5, cfg=cfg)
        if cfg is not None:  # K and V through tensor descriptors where they can be (a power-of-2 head_dim)
            torch.testing.assert_close(pa_triton.positional_attention(q, pos, k, v, d ** -0.5, cfg=cfg, tma=True), got,
                                       rtol=0, atol=0)
        assert got.shape == q.shape and got.dtype == dtype
        if t:
            assert rel_err(got, want) <= TOL[dtype]
            assert torch.equal(got[pos < 0], torch.zeros_like(got[pos < 0]))


def test_twin_in_order_is_plain_causal_attention():
    q, _, k, v = _inputs(40, 40, 8, 2, 32, torch.float32, seed=6)
    got = positional_attention(q, torch.arange(40), k, v, 0.2)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                          scale=0.2, enable_gqa=True).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_twin_is_attention_over_each_querys_visible_keys():
    q, pos, k, v = _inputs(12, 30, 4, 2, 16, torch.float32, seed=7)
    got = positional_attention(q, pos, k, v, 0.25)
    for i, p in enumerate(pos.tolist()):
        if p < 0:
            assert torch.equal(got[i], torch.zeros_like(got[i]))
            continue
        kk, vv = k[:p + 1].repeat_interleave(2, dim=1), v[:p + 1].repeat_interleave(2, dim=1)
        w = torch.softmax(torch.einsum("hd,shd->hs", q[i], kk) * 0.25, dim=-1)
        torch.testing.assert_close(got[i], torch.einsum("hs,shd->hd", w, vv), rtol=1e-5, atol=1e-5)


def test_refuses_bad_shapes():
    q, pos, k, v = _inputs(4, 8, 6, 2, 16, torch.float32, seed=8)
    with pytest.raises(ValueError, match="power-of-2"):
        positional_attention(q, pos, k, v, 0.25, backend="triton")  # 3 query heads per key head
    with pytest.raises(ValueError, match="multiple"):
        positional_attention(q[:, :5], pos, k, v, 0.25)
    with pytest.raises(ValueError, match="q_pos"):
        positional_attention(q, pos[:3], k, v, 0.25)
    with pytest.raises(ValueError, match="unknown backend"):
        positional_attention(q, pos, k, v, 0.25, backend="cuda")
