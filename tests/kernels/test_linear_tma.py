"""Skinny GEMM's TMA weight stream (kernels/linear/tma.py, ``LinearConfig.tma``) under the interpreter: the same
bits as the pointer kernel (same tiles, same sums; zeros past N and K where the pointer kernel masks) and the
twin's result, at awkward shapes, for the three launches of a 64-row layer (plain, gate|up SwiGLU, down onto
the residual, with a bias); the fallback to the pointer kernel of a launch TMA cannot take; the
host-side descriptor cache; the config's validation. The sm_90 build (cp.async.bulk.tensor and mbarriers in the
PTX) is checked by ``tests/kernels/compile_linear_sm90.py --tma``."""

import dataclasses
import gc
import os
import weakref

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, rel_err

from kernels.linear import LinearConfig, linear, linear_swiglu
from kernels.linear import tma

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the kernel interpreted")

# (M, N, K): M 1, 7, 64; N not a multiple of the 32-wide test tile (200, 70); K past the last 32-wide step or not
SHAPES = [(1, 200, 96), (7, 70, 80), (64, 200, 112)]
POINTER = LinearConfig(16, 32, 32, num_stages=2)


def _tma(mode: str, **kw) -> LinearConfig:
    return LinearConfig(kw.pop("block_m", 16), kw.pop("block_n", 32), kw.pop("block_k", 32), num_stages=2,
                        tma=mode, **kw)


def _operands(m, n, k, dtype):
    """x [m, k]; w [n, k] a row slice (rows 2..) of a wider weight (row stride k + 16: q|k|v's views)."""
    x = torch.randn(m, k).to(dtype)
    w = (torch.randn(n + 5, k + 16) / k ** 0.5).to(dtype)[2:2 + n, :k]
    return x, w


@pytest.mark.parametrize("mode", ["w", "xw"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
@pytest.mark.parametrize("m,n,k", SHAPES, ids=["M{}-N{}-K{}".format(*s) for s in SHAPES])
def test_plain_equals_pointer_kernel_and_twin(m, n, k, dtype, mode):
    x, w = _operands(m, n, k, dtype)
    cfg = _tma(mode, block_m=64 if m == 64 else 16)
    got = linear(x, w, backend="triton", config=cfg)
    assert got.shape == (m, n) and got.dtype == dtype
    assert torch.equal(got, linear(x, w, backend="triton", config=dataclasses.replace(cfg, tma="off")))
    assert rel_err(got, linear(x, w)) <= TOL[dtype]


@pytest.mark.parametrize("mode", ["w", "xw"])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_down_onto_the_residual_in_place(m, mode):
    """accumulate += act @ down.T in place (the down projection), with a bias, N and K off the tiles."""
    x, w = _operands(m, 72, 112, torch.float32)
    b = torch.randn(72)
    c = 3.0 * torch.randn(m, 72)
    cfg = _tma(mode, block_m=64 if m == 64 else 16)
    want = linear(x, w, b, accumulate=c.clone())
    ptr = linear(x, w, b, accumulate=c.clone(), backend="triton", config=dataclasses.replace(cfg, tma="off"))
    got = linear(x, w, b, accumulate=c, backend="triton", config=cfg)
    assert got.data_ptr() == c.data_ptr()
    assert torch.equal(got, ptr) and rel_err(got, want) <= TOL[torch.float32]


@pytest.mark.parametrize("mode", ["w", "xw"])
@pytest.mark.parametrize("m,inter,k", [(1, 100, 80), (7, 24, 96), (64, 40, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_NAME.get)
def test_swiglu_equals_pointer_kernel_and_twin(m, inter, k, dtype, mode):
    """w = [gate; up]: the up tile of a program is rows n + inter of the one descriptor; the last gate tile
    reaches into up rows (unwritten columns) and the last up tile past 2 * inter (zeros)."""
    x, w = _operands(m, 2 * inter, k, dtype)
    got = linear_swiglu(x, w, backend="triton", config=_tma(mode))
    assert got.shape == (m, inter) and got.dtype == dtype
    assert torch.equal(got, linear_swiglu(x, w, backend="triton", config=POINTER))
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), linear_swiglu(x, w).float(), **tol)


def test_unaligned_operands_take_the_pointer_kernel():
    """A weight whose base or row stride breaks TMA's 16-byte rule runs the pointer kernel (a warning says why),
    with the same result."""
    base = torch.randn(80, 96 + 1)
    cases = {"base": torch.randn(80 * 96 + 1)[1:].view(80, 96),  # 4 bytes past an aligned address
             "row stride": base[:, :96]}  # 97 fp32 a row: 388 bytes
    x = torch.randn(7, 96)
    for what, w in cases.items():
        cfg = _tma("w")
        why = tma.ineligible(x, w, cfg)
        assert why is not None and "16-byte" in why, what
        with pytest.warns(RuntimeWarning, match="without TMA"):
            got = linear(x, w, backend="triton", config=cfg)
        assert torch.equal(got, linear(x, w, backend="triton", config=POINTER))
    x_off = torch.randn(7 * 96 + 1)[1:].view(7, 96)
    w = torch.randn(80, 96)
    assert tma.ineligible(x_off, w, _tma("w")) is None  # x by pointers: any x the pointer kernel takes
    assert "x's base" in tma.ineligible(x_off, w, _tma("xw"))
    assert "box" in tma.ineligible(x, w, _tma("w", block_n=512))
    assert "16-byte" in tma.ineligible(torch.randn(3, 90), torch.randn(1, 90), _tma("w"))  # one row: stride encoded too
    assert "no TMA" in tma.ineligible(x, w, POINTER)


def test_off_the_interpreter_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(tma, "_INTERPRET", False)
    assert "cpu" in tma.ineligible(torch.randn(4, 32), torch.randn(8, 32), _tma("w"))


def test_descriptor_cache_keys_by_content_and_holds_no_tensor(monkeypatch):
    """Off the interpreter a descriptor is built once per (address, shape, strides, dtype, box), over an
    address-only base (the weight can be freed), and the cache keeps at most CACHE_SIZE of them."""
    monkeypatch.setattr(tma, "_INTERPRET", False)
    monkeypatch.setattr(tma, "_CACHE", type(tma._CACHE)())
    monkeypatch.setattr(tma, "CACHE_SIZE", 2)
    w = torch.randn(48, 64)[8:40]  # a row slice: base past the buffer's start
    d = tma.descriptor(w, 32, (16, 32))
    assert d is tma.descriptor(w, 32, (16, 32))
    assert d.base.data_ptr() == w.data_ptr() and d.base.dtype == w.dtype and not isinstance(d.base, torch.Tensor)
    assert list(d.shape) == [32, 64] and list(d.strides) == [64, 1] and list(d.block_shape) == [16, 32]
    assert tma.descriptor(w, 32, (32, 32)) is not d  # another box, another descriptor
    assert tma.descriptor(w, 16, (16, 32)).shape[0] == 16
    assert len(tma._CACHE) == 2  # the oldest (d) dropped
    gone = weakref.ref(w)
    del w, d
    gc.collect()
    assert gone() is None


def test_config_validation_and_literal():
    cfg = LinearConfig(64, 64, 256, num_warps=8, num_stages=4, tma="xw")
    assert eval(cfg.literal(), {"LinearConfig": LinearConfig}) == cfg  # what the bench prints for the table
    assert cfg.short().endswith("tma-xw") and "tma" not in LinearConfig().short() + LinearConfig().literal()
    with pytest.raises(ValueError, match="one split"):
        LinearConfig(split_k=2, tma="w")
    with pytest.raises(ValueError, match="tma must be one of"):
        LinearConfig(tma="on")


_SM90 = """
import sys
from compile_linear_sm90 import compile_tma_variant
from kernels.linear import LinearConfig
for task in [(64, 6144, 4096, LinearConfig(64, 64, 128, num_stages=5, tma="w"), False, False),
             (64, 14336, 4096, LinearConfig(64, 64, 128, num_stages=3, tma="xw"), False, True),
             (64, 4096, 14336, LinearConfig(64, 32, 256, num_stages=4, tma="w"), True, False, 2)]:
    print(compile_tma_variant(task))
"""


@pytest.mark.slow
def test_sm90_build_streams_weights_by_tma():
    """The compiled kernel (this Triton, for an H100, no GPU needed) loads weight tiles with cp.async.bulk.tensor
    completing on mbarriers: q|k|v plain, gate|up SwiGLU with x by TMA too, down onto the residual as a PDL
    launch (no bulk copy before griddepcontrol.wait). A fresh process: the kernels must be compiled, not
    interpreted."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    path = os.pathsep.join(p for p in (str(here), str(here.parents[1]), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=path)
    out = subprocess.run([sys.executable, "-c", _SM90], env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert out.returncode == 0 and len(lines) == 3, out.stderr[-2000:]
    for line in lines:
        assert not line.startswith("FAILED") and "cp.async.bulk.tensor" in line and "stack 0 B" in line, line
    assert " 0 cp.async," in lines[1]  # tma="xw": no pointer copies of x left
    assert "griddepcontrol" in lines[2]


def test_the_tables_64_row_entries_stream_by_tma_unless_switched_off():
    from kernels.linear import plan
    from kernels.options import KernelOptions, using

    shapes = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
    assert all(plan.pick_config(64, n, k).tma == "xw" for n, k in shapes)
    assert plan.swiglu_config(64, 14336, 4096).tma == "xw"
    assert plan.pick_config(8, 6144, 4096).tma == "off"  # measured entries without TMA stay pointer loads
    with using(KernelOptions(tma=False)):
        assert all(plan.pick_config(64, n, k).tma == "off" for n, k in shapes)
        assert plan.pick_config(64, 6144, 4096) == dataclasses.replace(plan.table_config(64, 6144, 4096), tma="off")
    assert plan.pick_config(64, 6144, 4096).tma == "xw"
