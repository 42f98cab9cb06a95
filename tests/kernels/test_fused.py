"""Fused layer kernels (kernels/fused): each Triton kernel against its plain-torch twin under the
interpreter, the twins against Hugging Face's modules, and one model layer run both ways."""

import os

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, rel_err

from kernels.fused import KVWrite, add_rms_norm, qkv_heads, rms_norm, silu_mul, write_kv
from kernels.rope import rope_cos_sin, rope_inv_freq

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (tokens, hidden): T = 1, 3, 63, 500; hidden not a power of two; the interpreter runs a program a row
NORM_CASES = [(1, 96), (3, 200), (63, 64), (500, 40)]


def _runs(cases, fmt):
    """Every case in every dtype, except the long (T = 500) ones: fp32 only (interpreter time)."""
    runs = [(*c, dt) for c in cases for dt in DTYPES if c[0] < 500 or dt == torch.float32]
    return dict(argvalues=runs, ids=[fmt(*r[:-1]) + "-" + DTYPE_NAME[r[-1]] for r in runs])


@pytest.mark.parametrize("t,n,dtype", **_runs(NORM_CASES, "T{}-N{}".format))
def test_rms_norm_matches_twin(t, n, dtype):
    from kernels.fused import triton as kt

    x = torch.randn(t, n).to(dtype)
    w = (1.0 + 0.3 * torch.randn(n)).to(dtype)
    want = rms_norm(x, w, 1e-5)
    got = kt.rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype == dtype and got.shape == x.shape
    assert rel_err(got, want) <= TOL[dtype]
    assert rel_err(rms_norm(x, w, 1e-5, backend="triton"), want) <= TOL[dtype]


@pytest.mark.parametrize("t,n,dtype", **_runs(NORM_CASES, "T{}-N{}".format))
def test_add_rms_norm_matches_twin(t, n, dtype):
    from kernels.fused import triton as kt

    x, res = torch.randn(t, n).to(dtype), (3.0 * torch.randn(t, n)).to(dtype)
    w = (1.0 + 0.3 * torch.randn(n)).to(dtype)
    want_y, want_h = add_rms_norm(x, res, w, 1e-6)
    got_y, got_h = kt.add_rms_norm(x, res, w, 1e-6)
    if dtype == torch.bfloat16 and INTERPRETED:  # the interpreter truncates fp32 -> bf16 casts
        assert rel_err(got_h, want_h) <= TOL[dtype]
    else:
        assert torch.equal(got_h, want_h)  # one rounded add either way: bit-equal
    assert rel_err(got_y, want_y) <= TOL[dtype]
    assert got_h.data_ptr() not in (x.data_ptr(), res.data_ptr())  # inputs are never written


def test_norm_of_strided_rows_and_heads():
    """A [T, H, D] view with padded rows (per-head norm) and a batch of rows with a row stride."""
    from kernels.fused import triton as kt

    base = torch.randn(7, 5, 48)
    x = base[:, 1:4, :40]  # rows of 40 inside rows of 48: not viewable flat, made contiguous
    w = torch.randn(40)
    assert rel_err(kt.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)) <= TOL[torch.float32]
    rows = torch.randn(9, 80)[:, :64]  # row stride 80
    w = torch.randn(64)
    assert rel_err(kt.rms_norm(rows, w, 1e-6), rms_norm(rows, w, 1e-6)) <= TOL[torch.float32]


def test_rms_norm_twin_is_hugging_face():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hf = LlamaRMSNorm(72, eps=1e-5)
    with torch.no_grad():
        hf.weight.copy_(1.0 + 0.2 * torch.randn(72))
    hf = hf.to(torch.bfloat16)
    x = torch.randn(11, 72).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, hf.weight, 1e-5), hf(x))  # cast back, THEN scaled: same bits


SILU_CASES = [(1, 40), (3, 100), (63, 24), (500, 12)]


@pytest.mark.parametrize("t,i,dtype", **_runs(SILU_CASES, "T{}-I{}".format))
def test_silu_mul_matches_twin(t, i, dtype):
    from kernels.fused import triton as kt

    gu = (2.0 * torch.randn(t, 2 * i)).to(dtype)
    want = silu_mul(gu)
    got = kt.silu_mul(gu, block=32)  # several column blocks, the last one partial
    assert got.dtype == dtype and got.shape == (t, i)
    assert rel_err(got, want) <= TOL[dtype]
    assert rel_err(silu_mul(gu, backend="triton"), want) <= TOL[dtype]
    gate, up = gu.float().chunk(2, dim=-1)
    assert rel_err(want, torch.nn.functional.silu(gate) * up) <= TOL[dtype]


# (T, Hq, Hkv, D, q/k norm): GQA groups 1, 2 and 4, head_dim 32/64/96, mixed head blocks
QKV_CASES = [(1, 4, 4, 64, False), (3, 8, 2, 32, True), (63, 6, 2, 96, False), (500, 2, 1, 32, True)]


QKV_RUNS = _runs(QKV_CASES, lambda t, hq, hkv, d, n: f"T{t}-Hq{hq}-Hkv{hkv}-D{d}" + ("-qknorm" if n else ""))
QKV_RUNS = dict(  # both ways of giving the rotation; the long case by positions only
    argvalues=[(*r, by) for r in QKV_RUNS["argvalues"] for by in ("table", "positions") if r[0] < 500 or by == "positions"],
    ids=[f"{i}-{by}" for r, i in zip(QKV_RUNS["argvalues"], QKV_RUNS["ids"]) for by in ("table", "positions")
         if r[0] < 500 or by == "positions"])


def _qkv_inputs(t, hq, hkv, d, qk_norm, dtype, rope_by):
    """Random fused q|k|v rows [t, (hq + 2 hkv) d], the rotation (cos/sin tables or positions) and,
    with qk_norm, q/k norm weights: the keyword arguments of qkv_heads."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d).to(dtype)
    inv = rope_inv_freq(d, 500000.0)
    pos = torch.randint(0, 9000, (t,))
    norms = dict(q_norm=(1 + 0.2 * torch.randn(d)).to(dtype), k_norm=(1 + 0.2 * torch.randn(d)).to(dtype)) \
        if qk_norm else {}
    if rope_by == "table":
        cos, sin = rope_cos_sin(pos, inv)
        return qkv, dict(cos=cos[:, None, :], sin=sin[:, None, :]), norms
    return qkv, dict(positions=pos, inv_freq=inv), norms


@pytest.mark.parametrize("t,hq,hkv,d,qk_norm,dtype,rope_by", **QKV_RUNS)
@pytest.mark.slow
def test_qkv_heads_matches_twin(t, hq, hkv, d, qk_norm, dtype, rope_by):
    from kernels.fused import triton as kt

    qkv, rope, norms = _qkv_inputs(t, hq, hkv, d, qk_norm, dtype, rope_by)
    want = qkv_heads(qkv, hq, hkv, eps=1e-6, **rope, **norms)
    got = kt.qkv_heads(qkv, hq, hkv, eps=1e-6, block_h=4, **rope, **norms)  # blocks straddle q|k|v
    for g, w, h in zip(got, want, (hq, hkv, hkv)):
        assert g.shape == (t, h, d) and g.dtype == dtype and g.is_contiguous()
        assert rel_err(g, w) <= TOL[dtype]
    assert torch.equal(got[2], want[2])  # v is copied, untouched


# (T, Hq, Hkv, D, q/k norm, activations' dtype, cache dtype, block size): odd token counts, GQA 1/4,
# head_dim 64/128, a block size that is no power of two, and caches in another dtype than the activations
KV_WRITE_CASES = [
    (1, 4, 4, 64, False, torch.float32, torch.float32, 16, "positions"),
    (7, 8, 2, 64, True, torch.bfloat16, torch.bfloat16, 16, "table"),
    (13, 8, 2, 128, False, torch.bfloat16, torch.float32, 5, "positions"),
    (21, 4, 1, 64, True, torch.float32, torch.bfloat16, 4, "table"),
    (9, 8, 4, 128, True, torch.float16, torch.float16, 16, "positions"),
]
KV_WRITE_IDS = [f"T{t}-Hq{hq}-Hkv{hkv}-D{d}" + ("-qknorm" if n else "") + f"-{DTYPE_NAME[dt]}-cache{DTYPE_NAME[ct]}"
                f"-BS{bs}-{by}" for t, hq, hkv, d, n, dt, ct, bs, by in KV_WRITE_CASES]


def _to_cache(x: torch.Tensor, dtype: torch.dtype, triton: bool) -> torch.Tensor:
    """x cast to the cache's dtype as the writer under test casts it: the interpreted Triton kernel
    truncates fp32 to bf16 (a GPU rounds to nearest, as torch does)."""
    if triton and INTERPRETED and x.dtype == torch.float32 and dtype == torch.bfloat16:
        return (x.view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return x.to(dtype)


def _scattered(t: int, n_blocks: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """T distinct (block, slot) pairs spread over the pool in no order."""
    flat = torch.randperm(n_blocks * bs)[:t]
    return flat // bs, flat % bs


def _caches(n_blocks, bs, hkv, d, dtype):
    """Random normal caches (never zeros: a row written to the wrong place must show)."""
    return torch.randn(n_blocks, bs, hkv, d).to(dtype), torch.randn(n_blocks, bs, hkv, d).to(dtype)


def _assert_written(kc, vc, before, blk, slot, k, v, triton: bool):
    """Rows (blk, slot) of the caches hold k, v bit for bit; every other row is as it was."""
    assert torch.equal(kc[blk, slot], _to_cache(k, kc.dtype, triton))
    assert torch.equal(vc[blk, slot], _to_cache(v, vc.dtype, triton))
    rest = torch.ones(kc.shape[:2], dtype=torch.bool)
    rest[blk, slot] = False
    assert torch.equal(kc[rest], before[0][rest]) and torch.equal(vc[rest], before[1][rest])


@pytest.mark.parametrize("t,hq,hkv,d,qk_norm,dtype,cache_dtype,bs,rope_by", KV_WRITE_CASES, ids=KV_WRITE_IDS)
def test_qkv_heads_writes_the_cache(t, hq, hkv, d, qk_norm, dtype, cache_dtype, bs, rope_by):
    """With a KVWrite, the kernel and the twin store exactly the k, v they return (cast to the cache's
    dtype) at the given slots and touch no other row; without the k, v outputs, q and the cache are the
    same bits."""
    from kernels.fused import triton as kt

    n_blocks = -(-t // bs) + 3
    qkv, rope, norms = _qkv_inputs(t, hq, hkv, d, qk_norm, dtype, rope_by)
    blk, slot = _scattered(t, n_blocks, bs)
    kc0, vc0 = _caches(n_blocks, bs, hkv, d, cache_dtype)
    plain = qkv_heads(qkv, hq, hkv, eps=1e-6, **rope, **norms)
    results = {}
    for name, fn in (("twin", qkv_heads), ("triton", kt.qkv_heads)):
        kc, vc = kc0.clone(), vc0.clone()
        q, k, v = fn(qkv, hq, hkv, eps=1e-6, write=KVWrite(kc, vc, blk, slot), **rope, **norms)
        _assert_written(kc, vc, (kc0, vc0), blk, slot, k, v, triton=name == "triton")
        kc2, vc2 = kc0.clone(), vc0.clone()
        q2, k2, v2 = fn(qkv, hq, hkv, eps=1e-6, write=KVWrite(kc2, vc2, blk, slot), return_kv=False, **rope, **norms)
        assert k2 is None and v2 is None
        assert torch.equal(q2, q) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
        results[name] = q, k, v, kc, vc
    for got, want in zip(results["twin"][:3], plain):  # the write changes nothing the twin returns
        assert torch.equal(got, want)
    for g, w in zip(results["triton"][:3], results["twin"][:3]):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape
        assert rel_err(g, w) <= TOL[dtype]
    assert torch.equal(results["triton"][2], results["twin"][2])  # v is a copy either way
    for g, w in zip(results["triton"][3:], results["twin"][3:]):  # the written rows, in the cache's dtype
        assert rel_err(g[blk, slot], w[blk, slot]) <= max(TOL[dtype], TOL[cache_dtype])


WRITE_KV_CASES = [(1, 1, 64, torch.float32, torch.float32, 16), (19, 2, 64, torch.bfloat16, torch.bfloat16, 5),
                  (40, 8, 128, torch.float32, torch.bfloat16, 16), (9, 4, 128, torch.bfloat16, torch.float32, 4)]


@pytest.mark.parametrize("t,hkv,d,dtype,cache_dtype,bs", WRITE_KV_CASES,
                         ids=[f"T{t}-Hkv{h}-D{d}-{DTYPE_NAME[dt]}-cache{DTYPE_NAME[ct]}-BS{bs}"
                              for t, h, d, dt, ct, bs in WRITE_KV_CASES])
def test_write_kv_matches_twin(t, hkv, d, dtype, cache_dtype, bs):
    """write_kv (one kernel for K and V) stores what the twin's indexed assignments store, from strided
    inputs (rows of a longer tensor, a transposed one), touching no other row."""
    from kernels.fused import triton as kt

    n_blocks = -(-t // bs) + 2
    blk, slot = _scattered(t, n_blocks, bs)
    k = torch.randn(t + 3, hkv, d).to(dtype)[3:]  # rows of a longer tensor
    v = torch.randn(hkv, t, d).to(dtype).transpose(0, 1)  # not viewable as rows: copied
    kc0, vc0 = _caches(n_blocks, bs, hkv, d, cache_dtype)
    for fn in (write_kv, kt.write_kv):
        kc, vc = kc0.clone(), vc0.clone()
        fn(k, v, KVWrite(kc, vc, blk, slot))
        _assert_written(kc, vc, (kc0, vc0), blk, slot, k, v, triton=fn is kt.write_kv)
    kc, vc = kc0.clone(), vc0.clone()
    write_kv(k[:0], v[:0], KVWrite(kc, vc, blk[:0], slot[:0]), backend="triton")  # nothing to write
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_kv_write_refuses_bad_destinations():
    from kernels.fused import triton as kt

    qkv, kc, vc = torch.randn(3, 4 * 16), torch.randn(2, 4, 1, 16), torch.randn(2, 4, 1, 16)
    blk, slot = torch.tensor([0, 1, 1]), torch.tensor([3, 0, 2])
    rope = dict(positions=torch.arange(3), inv_freq=torch.ones(8))
    for fn in (qkv_heads, kt.qkv_heads):
        with pytest.raises(ValueError, match="int64"):
            fn(qkv, 2, 1, write=KVWrite(kc, vc, blk.int(), slot), **rope)
        with pytest.raises(ValueError, match=r"int64 \[3\]"):
            fn(qkv, 2, 1, write=KVWrite(kc, vc, blk[:2], slot[:2]), **rope)
        with pytest.raises(ValueError, match="alike"):
            fn(qkv, 2, 1, write=KVWrite(kc, vc[:, :, :, :8], blk, slot), **rope)
        with pytest.raises(ValueError, match="contiguous"):
            fn(qkv, 2, 1, write=KVWrite(kc, vc.transpose(0, 1).contiguous().transpose(0, 1), blk, slot), **rope)
    for fn in (write_kv, kt.write_kv):
        with pytest.raises(ValueError, match="both"):
            fn(torch.randn(3, 1, 16), torch.randn(3, 1, 8), KVWrite(kc, vc, blk, slot))
        with pytest.raises(ValueError, match="alike"):
            fn(torch.randn(3, 2, 8), torch.randn(3, 2, 8), KVWrite(kc, vc, blk, slot))


def test_qkv_twin_is_hugging_face_qwen3_order():
    """Twin: per-head RMSNorm then rotate-half, against transformers' Qwen3 pieces (fp32)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    t, hq, hkv, d = 5, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d)
    qn, kn = Qwen3RMSNorm(d, eps=1e-6), Qwen3RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        qn.weight.copy_(1 + 0.2 * torch.randn(d))
        kn.weight.copy_(1 + 0.2 * torch.randn(d))
    inv = rope_inv_freq(d, 10000.0)
    pos = torch.arange(t) * 7
    q, k, v = qkv_heads(qkv, hq, hkv, positions=pos, inv_freq=inv, q_norm=qn.weight.detach(),
                        k_norm=kn.weight.detach(), eps=1e-6)
    ang = pos.float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    with torch.no_grad():
        hq_, hk_ = qkv[:, :hq * d].view(1, t, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(1, t, hkv, d)
        want_q, want_k = apply_rotary_pos_emb(qn(hq_).transpose(1, 2), kn(hk_).transpose(1, 2),
                                              emb.cos()[None], emb.sin()[None])
    assert rel_err(q, want_q[0].transpose(0, 1)) <= 1e-6
    assert rel_err(k, want_k[0].transpose(0, 1)) <= 1e-6
    assert torch.equal(v, qkv[:, (hq + hkv) * d:].view(t, hkv, d))


def test_refuses_bad_input():
    from kernels.fused import triton as kt

    with pytest.raises(ValueError, match="weight"):
        kt.rms_norm(torch.randn(3, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        kt.add_rms_norm(torch.randn(3, 8), torch.randn(3, 9), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="gate"):
        kt.silu_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="either"):
        kt.qkv_heads(torch.randn(2, 4 * 8), 2, 1)
    with pytest.raises(ValueError, match="Hq"):
        kt.qkv_heads(torch.randn(2, 30), 2, 1, positions=torch.arange(2), inv_freq=torch.ones(4))
    with pytest.raises(ValueError, match="backend"):
        rms_norm(torch.randn(2, 4), torch.ones(4), 1e-6, backend="cuda")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_layer_same_on_both_backends(arch):
    """One layer of the engine's Transformer with the Triton kernels equals it with the twins: rotation
    by positions (rope_backend triton) and by tables, the MLP half, and the final norm + logits."""
    from services.engine.model.layers import Transformer
    from services.engine.model.tiny import random_weights, tiny_config
    from services.engine.model.weights import weights_from_tensors

    cfg = tiny_config(arch)
    w = weights_from_tensors(random_weights(cfg, 3), cfg, torch.device("cpu"), torch.float32)
    twin = Transformer(cfg, w, rope_backend="triton", kernel_backend="torch")
    fused = Transformer(cfg, w, rope_backend="triton", kernel_backend="triton")
    h, pos = torch.randn(6, cfg.hidden_size), torch.arange(40, 46)
    cos, sin = rope_cos_sin(pos, twin.inv_freq)
    rope = (cos[:, None, :], sin[:, None, :])
    for got, want in [(fused.attention_inputs(1, h, pos), twin.attention_inputs(1, h, pos)),
                      (fused.attention_inputs(1, h, None, rope=rope), twin.attention_inputs(1, h, None, rope=rope))]:
        for g, x in zip(got, want):
            assert rel_err(g, x) <= TOL[torch.float32]
    attn = torch.randn(6, cfg.num_heads, cfg.head_dim)
    h_before = h.clone()
    out = fused.finish_layer(1, h, attn)
    assert torch.equal(h, h_before)  # the residual is accumulated into a new tensor
    assert rel_err(out, twin.finish_layer(1, h, attn)) <= TOL[torch.float32]
    assert rel_err(fused.logits(out), twin.logits(out)) <= TOL[torch.float32]
