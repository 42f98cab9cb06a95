"""Skinny GEMM (kernels/linear): the Triton kernel against its plain-torch twin under the interpreter
(awkward shapes, strided weight views, bias, accumulate, every split-K path), the twin against
torch's own matmul, the config table and bad input."""

import os

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, rel_err

from kernels.linear import LinearConfig, linear, supported
from kernels.linear import triton as kt
from kernels.linear.config import CONFIGS as CONFIGS_TABLE

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# (M, N, K): M 1..100; N and K not multiples of the 32-wide test tiles (K a multiple of 16 or not)
SHAPES = [(1, 70, 80), (3, 100, 96), (17, 33, 48), (64, 96, 112), (100, 40, 64)]
SMALL = LinearConfig(16, 32, 32, num_stages=2)
CONFIGS = {  # every path: one split; splits reduced on last arrival or by a kernel; an uneven last split
    "s1": SMALL,
    "s2-arrive": LinearConfig(16, 32, 32, split_k=2, num_stages=2),
    "s3-kernel": LinearConfig(16, 32, 16, split_k=3, reduce="kernel", num_stages=2),
    "s4-m32": LinearConfig(32, 16, 16, split_k=4, num_stages=2),
}


def _operands(m, n, k, dtype, bias=False, acc=False):
    """x [m, k]; w [n, k] as a strided row slice of a bigger weight (as q|k|v's views); bias, accumulate."""
    x = torch.randn(m, k).to(dtype)
    big = torch.randn(n + 7, k + 16).to(dtype)  # row stride k + 16, rows 3.. of it
    w = big[3:3 + n, :k]
    assert w.stride() == (k + 16, 1)
    b = torch.randn(n).to(dtype) if bias else None
    c = (3.0 * torch.randn(m, n)).to(dtype) if acc else None
    return x, w, b, c


@pytest.mark.parametrize("m,n,k", SHAPES, ids=["M{}-N{}-K{}".format(*s) for s in SHAPES])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_twin_fp32(m, n, k, name):
    x, w, b, _ = _operands(m, n, k, torch.float32, bias=name == "s2-arrive")
    want = linear(x, w, b)
    got = linear(x, w, b, backend="triton", config=CONFIGS[name])
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel_err(got, want) <= TOL[torch.float32]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("bias", [False, True])
def test_accumulate_in_place(name, bias):
    x, w, b, c = _operands(17, 100, 96, torch.float32, bias=bias, acc=True)
    want = linear(x, w, b, accumulate=c.clone())
    assert rel_err(want, c + x @ w.t() + (b if bias else 0)) <= TOL[torch.float32]  # the twin adds onto c
    c_before = c.clone()
    got = linear(x, w, b, accumulate=c, backend="triton", config=CONFIGS[name])
    assert got.data_ptr() == c.data_ptr()  # in place, returned
    assert rel_err(got, want) <= TOL[torch.float32]
    assert not torch.equal(c, c_before)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("name", ["s1", "s2-arrive", "s3-kernel"])
def test_half_dtypes(dtype, name):
    x, w, b, c = _operands(17, 100, 96, dtype, bias=True, acc=True)
    want = linear(x, w, b)
    got = linear(x, w, b, backend="triton", config=CONFIGS[name])
    assert got.dtype == dtype
    assert rel_err(got, want) <= TOL[dtype]  # the interpreter's bf16 casts truncate: within rounding
    want_c = linear(x, w, accumulate=c.clone())
    got_c = linear(x, w, accumulate=c.clone(), backend="triton", config=CONFIGS[name])
    assert rel_err(got_c, want_c) <= TOL[dtype]
    if dtype == torch.float16 or not INTERPRETED:  # one rounding of the same fp32 value, bar summation order
        assert (got.float() - want.float()).abs().max() <= 2 * want.float().abs().max() * 2 ** -10


def test_strided_rows_of_x_and_accumulate():
    """x and accumulate as row slices of wider buffers (a row stride past their width)."""
    x = torch.randn(5, 96)[:, :64]
    w = torch.randn(40, 64)
    c_base = torch.randn(5, 56)
    c = c_base[:, 8:48]
    outside = torch.cat([c_base[:, :8], c_base[:, 48:]], dim=1)
    want = linear(x, w, accumulate=c.clone())
    got = linear(x, w, accumulate=c, backend="triton", config=CONFIGS["s2-arrive"])
    assert got.data_ptr() == c.data_ptr() and rel_err(got, want) <= TOL[torch.float32]
    assert torch.equal(torch.cat([c_base[:, :8], c_base[:, 48:]], dim=1), outside)  # columns beside it untouched
    assert rel_err(linear(x, w, backend="triton", config=SMALL), x @ w.t()) <= TOL[torch.float32]


def test_split_reduction_is_deterministic_and_counters_reset():
    """Repeated last-arrival launches give the same bits (fixed split order) and leave every counter 0."""
    x, w, b, _ = _operands(3, 70, 80, torch.float32, bias=True)
    cfg = LinearConfig(16, 32, 16, split_k=5, num_stages=2)
    first = linear(x, w, b, backend="triton", config=cfg)
    for _ in range(2):
        assert torch.equal(linear(x, w, b, backend="triton", config=cfg), first)
    assert int(kt._COUNTERS.kept[x.device].abs().sum()) == 0
    by_kernel = linear(x, w, b, backend="triton", config=LinearConfig(16, 32, 16, split_k=5, reduce="kernel"))
    assert torch.equal(by_kernel, first)  # the same partials summed in the same order


def test_split_plan_covers_k_without_empty_splits():
    for k in (16, 80, 96, 4096, 14336):
        for bk in (16, 64, 256):
            for s in (1, 2, 3, 8):
                per, n = kt.split_plan(k, bk, s)
                assert per % bk == 0 and (n - 1) * per < k <= n * per and n <= s


def test_twin_matches_torch_and_config_table():
    x, w, b, _ = _operands(5, 24, 32, torch.bfloat16, bias=True)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x.float(), w.float(), b.float()).to(x.dtype))
    assert kt.pick_config(64, 4096, 14336) == kt.heuristic_config(64, 4096, 14336) or (4096, 14336) in CONFIGS_TABLE
    cfg = kt.heuristic_config(64, 4096, 14336)
    assert cfg.block_m == 64 and cfg.split_k > 1  # 64 N tiles alone would leave half an H100 idle
    assert kt.heuristic_config(1, 128256, 4096).split_k == 1
    assert eval(cfg.literal(), {"LinearConfig": LinearConfig}) == cfg  # what the bench prints for the table


def test_supported(monkeypatch):
    wq = torch.zeros(6144, 4096, dtype=torch.bfloat16)  # Llama-3-8B's q|k|v: the kernel's up to 32 rows
    x = torch.zeros(8, 4096, dtype=torch.bfloat16)
    assert supported(x, wq) == INTERPRETED  # CPU tensors: only under the interpreter
    assert not supported(x.float(), wq.float())
    assert not supported(torch.zeros(129, 4096, dtype=torch.bfloat16), wq)
    assert not supported(x[:, :4088], wq[:, :4088])  # K not a multiple of 16
    x, w, _, _ = _operands(8, 96, 128, torch.bfloat16)
    assert not supported(x, w)  # a shape the table does not list: cuBLAS (no measurement says otherwise)
    # the measured table: Llama-3-8B's o_proj goes to the kernel at 8 and 64 rows; an entry of None keeps cuBLAS
    wo = torch.zeros(4096, 4096, dtype=torch.bfloat16)
    assert supported(torch.zeros(8, 4096, dtype=torch.bfloat16), wo) == INTERPRETED
    assert supported(torch.zeros(64, 4096, dtype=torch.bfloat16), wo) == INTERPRETED
    assert not supported(torch.zeros(128, 4096, dtype=torch.bfloat16), wo)
    monkeypatch.setitem(CONFIGS_TABLE, (4096, 4096), ((8, CONFIGS_TABLE[(4096, 4096)][0][1]), (128, None)))
    assert supported(torch.zeros(8, 4096, dtype=torch.bfloat16), wo) == INTERPRETED
    assert not supported(torch.zeros(64, 4096, dtype=torch.bfloat16), wo)


def test_bad_input():
    x, w, b, c = _operands(3, 20, 32, torch.float32, bias=True, acc=True)
    with pytest.raises(ValueError, match="differ in K"):
        linear(x, w[:, :16])
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        linear(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="fp32/fp16/bf16"):
        linear(x.to(torch.int32), w.to(torch.int32))
    with pytest.raises(ValueError, match="unit stride along K"):
        linear(torch.randn(32, 3).t(), w)
    with pytest.raises(ValueError, match="unit stride along K"):
        linear(x, torch.randn(64, 20)[::2].t())
    with pytest.raises(ValueError, match="bias must be"):
        linear(x, w, b[:10])
    with pytest.raises(ValueError, match="accumulate must be"):
        linear(x, w, accumulate=c.t())
    with pytest.raises(ValueError, match=r"x \[M, K\]"):
        linear(x[0], w)
    with pytest.raises(ValueError, match="unknown backend"):
        linear(x, w, backend="cublas")
    with pytest.raises(ValueError, match="power of two"):
        LinearConfig(block_n=48)
    with pytest.raises(ValueError, match="reduce"):
        LinearConfig(split_k=2, reduce="atomic")


@pytest.mark.parametrize("m, inter, k", [(1, 24, 32), (17, 40, 80), (64, 16, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_the_twin_and_the_unfused_pair(m, inter, k, dtype):
    """One launch streaming gate and up rows together == the twin == the unfused projection + silu_mul (as the
    model ran them), for awkward sizes (a tile past the last column, K past the last step), fp32 and bf16."""
    from kernels.fused import silu_mul
    from kernels.linear import linear_swiglu

    x, w, _, _ = _operands(m, 2 * inter, k, dtype)
    x = (x.float() / k ** 0.5).to(dtype)  # gate and up ~ N(0, 1), where silu bends
    want = linear_swiglu(x, w)
    unfused = silu_mul(linear(x, w))
    got = linear_swiglu(x, w, backend="triton", config=LinearConfig(16, 16, 32, num_stages=2))
    assert got.dtype == dtype and got.shape == (m, inter)
    # fp32: the sums' order alone; bf16: gate, up, silu and the product each rounded, a 1-ulp difference in a
    # rounded gate or up (another summation order) moves the result by a few ulps
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    torch.testing.assert_close(unfused.float(), want.float(), **tol)
    with pytest.raises(ValueError, match="even count"):
        linear_swiglu(x, w[:-1])
    with pytest.raises(ValueError, match="one split"):
        linear_swiglu(x, w, backend="triton", config=LinearConfig(16, 16, 32, split_k=2))
