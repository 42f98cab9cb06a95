"""Skinny GEMM's RMSNorm prologue (``norm=``) and out-of-place residual epilogue (``residual=``): the Triton
kernel under the interpreter against the twin and against the unfused rms_norm kernel + linear, awkward
shapes, split K, SwiGLU, bit-exactness where a row's sum of squares is exact in any order, and bad input."""

import os

import pytest
import torch
from kernel_checks import DTYPE_NAME, rel_err

from kernels.fused import rms_norm
from kernels.linear import LinearConfig, linear, linear_swiglu

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
EPS = 1e-5
ONE = LinearConfig(16, 32, 32, num_stages=2)
CONFIGS = {"s1": ONE, "s2-arrive": LinearConfig(16, 32, 32, split_k=2, num_stages=2),
           "s3-kernel": LinearConfig(16, 32, 16, split_k=3, reduce="kernel", num_stages=2)}
# (M, N, K): M = 1, 3, 17, 64; N and K past the 32-wide test tiles (K also a multiple of 16 or not)
SHAPES = [(1, 70, 80), (3, 100, 96), (17, 33, 48), (64, 40, 72)]
# the result within the dtype's rounding of the same fp32 sums: max |got - want| over max |want|
TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


def _operands(m, n, k, dtype, bias=False):
    """x [m, k] ~ 3 N(0, 1) (rms far from 1), g [k] ~ 1 + 0.3 N(0, 1), w [n, k] a strided row slice of a bigger
    weight scaled so that outputs are ~ N(0, 1), bias [n]."""
    x = (3.0 * torch.randn(m, k)).to(dtype)
    g = (1.0 + 0.3 * torch.randn(k)).to(dtype)
    w = (torch.randn(n + 5, k + 16) / k ** 0.5).to(dtype)[2:2 + n, :k]
    b = torch.randn(n).to(dtype) if bias else None
    return x, g, w, b


@pytest.mark.parametrize("m,n,k", SHAPES, ids=["M{}-N{}-K{}".format(*s) for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
def test_norm_matches_twin_and_the_unfused_pair(m, n, k, dtype):
    """linear(norm=) == the twin, and == the rms_norm kernel then linear (what the model runs today)."""
    x, g, w, b = _operands(m, n, k, dtype, bias=m % 2 == 1)
    want = linear(x, w, b, norm=(g, EPS))
    assert torch.equal(want, linear(rms_norm(x, g, EPS), w, b))  # the twin: kernels/fused's twin, then linear
    got = linear(x, w, b, norm=(g, EPS), backend="triton", config=ONE)
    assert got.shape == (m, n) and got.dtype == dtype
    assert _max_err(got, want) <= TOL[dtype]
    unfused = linear(rms_norm(x, g, EPS, backend="triton"), w, b, backend="triton", config=ONE)
    assert _max_err(got, unfused) <= TOL[dtype]


@pytest.mark.parametrize("name", ["s2-arrive", "s3-kernel"])
def test_norm_with_split_k(name):
    """Every split reads the whole row for its 1/rms, then normalises its own slice of K."""
    x, g, w, b = _operands(17, 100, 96, torch.float32, bias=True)
    want = linear(x, w, b, norm=(g, EPS))
    assert _max_err(linear(x, w, b, norm=(g, EPS), backend="triton", config=CONFIGS[name]), want) <= TOL[torch.float32]


def _exact_rows(m, k, dtype):
    """x whose squares and every partial sum of them are exact in fp32 (multiples of 2^-6 below 2^12): the sum
    of squares, hence 1/rms, is the same in any summation order."""
    return (torch.randint(-8, 9, (m, k)).float() / 8).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("name", ["s1", "s3-kernel"])
def test_norm_prologue_is_bit_exact_where_the_sum_is(dtype, name):
    """w a permutation (one 1 a row): the output is the normalised input itself, so it must equal rms_norm's
    bit for bit once a row's sum of squares cannot depend on its order. Against the twin in fp32 and fp16;
    bf16 against the rms_norm kernel (the interpreter truncates fp32 -> bf16 casts, the twin rounds)."""
    m, k = 17, 80  # K past the last 32-wide step
    x = _exact_rows(m, k, dtype)
    x[3] = 0.0  # a zero row: 1/rms = rsqrt(eps)
    g = (1.0 + 0.3 * torch.randn(k)).to(dtype)
    perm = torch.randperm(k)[:40]
    w = torch.zeros(40, k, dtype=dtype)
    w[torch.arange(40), perm] = 1.0
    got = linear(x, w, norm=(g, EPS), backend="triton", config=CONFIGS[name])
    if dtype == torch.bfloat16 and INTERPRETED:
        normed = rms_norm(x, g, EPS, backend="triton")
    else:
        normed = rms_norm(x, g, EPS)
        assert torch.equal(linear(x, w, norm=(g, EPS)), normed[:, perm])  # the twin, exact likewise
    assert torch.equal(got, normed[:, perm])


@pytest.mark.parametrize("m, inter, k", [(1, 24, 32), (17, 40, 80), (64, 16, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
def test_swiglu_with_norm(m, inter, k, dtype):
    """linear_swiglu(norm=) == the twin, and == the rms_norm kernel then the fused gate|up kernel."""
    x, g, w, _ = _operands(m, 2 * inter, k, dtype)
    cfg = LinearConfig(16, 16, 32, num_stages=2)
    want = linear_swiglu(x, w, norm=(g, EPS))
    assert torch.equal(want, linear_swiglu(rms_norm(x, g, EPS), w))
    got = linear_swiglu(x, w, norm=(g, EPS), backend="triton", config=cfg)
    assert got.dtype == dtype and got.shape == (m, inter)
    unfused = linear_swiglu(rms_norm(x, g, EPS, backend="triton"), w, backend="triton", config=cfg)
    # bf16: gate, up, silu and the product each rounded; a 1-ulp difference in a rounded gate or up (another
    # summation order) moves the result by a few ulps (as test_linear's SwiGLU test)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), unfused.float(), **tol)
    if dtype == torch.bfloat16 and INTERPRETED:  # x, its norm, gate, up, silu, product all truncated (biased
        assert rel_err(got, want) <= 6e-2         # towards 0 by ~2^-9 each), not rounded: further off the twin
    else:
        torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
def test_residual_out_of_place(name, bias):
    """out = residual + x @ w.T (+ bias) in a new tensor, one rounding; residual (and x) unwritten."""
    x, _, w, b = _operands(17, 100, 96, torch.float32, bias=bias)
    res = 3.0 * torch.randn(17, 100)
    before = res.clone()
    want = linear(x, w, b, residual=res)
    torch.testing.assert_close(want, res + x @ w.t() + (b if bias else 0), rtol=1e-5, atol=1e-4)
    got = linear(x, w, b, residual=res, backend="triton", config=CONFIGS[name])
    assert got.data_ptr() != res.data_ptr() and torch.equal(res, before)
    assert _max_err(got, want) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_NAME.get)
def test_residual_with_norm_half_dtypes_and_strided_residual(dtype):
    """The o projection's shape of call at 16-bit, with the norm on as well, the residual a row slice of a wider
    buffer: one rounding of residual + product (fp16: within an ulp of the twin's, bar summation order)."""
    m, n, k = 64, 40, 72
    x, g, w, b = _operands(m, n, k, dtype, bias=True)
    base = (3.0 * torch.randn(m, n + 24)).to(dtype)
    res = base[:, 8:8 + n]
    before = base.clone()
    for norm in (None, (g, EPS)):
        want = linear(x, w, b, norm=norm, residual=res)
        got = linear(x, w, b, norm=norm, residual=res, backend="triton", config=ONE)
        assert got.is_contiguous() and torch.equal(base, before)
        assert _max_err(got, want) <= TOL[dtype]
        if dtype == torch.float16:
            assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -10


def test_bad_input():
    x, g, w, b = _operands(3, 20, 32, torch.float32, bias=True)
    res = torch.randn(3, 20)
    with pytest.raises(ValueError, match=r"norm weight g must be \[32\]"):
        linear(x, w, norm=(g[:16], EPS))
    with pytest.raises(ValueError, match="norm weight g"):
        linear(x, w, norm=(g.to(torch.bfloat16), EPS))
    with pytest.raises(ValueError, match="norm weight g"):
        linear_swiglu(x, w, norm=(g[:-1], EPS), backend="triton")
    with pytest.raises(ValueError, match="eps"):
        linear(x, w, norm=(g, -1e-5))
    with pytest.raises(ValueError, match=r"norm must be \(g, eps\)"):
        linear(x, w, norm=g)
    with pytest.raises(ValueError, match=r"residual must be \[3, 20\]"):
        linear(x, w, residual=res.t())
    with pytest.raises(ValueError, match="residual must be"):
        linear(x, w, residual=res.to(torch.float16), backend="triton")
    with pytest.raises(ValueError, match="residual needs unit stride"):
        linear(x, w, residual=torch.randn(20, 3).t())
    with pytest.raises(ValueError, match="not both"):
        linear(x, w, residual=res, accumulate=res.clone())
