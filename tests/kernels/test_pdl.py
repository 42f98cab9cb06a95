"""kernels/pdl.py under KernelOptions.pdl: when a launch is a programmatic dependent launch, that every kernel of the layer asks
it, and that with the switch on the interpreter falls back to plain launches with the same bits.

Triton's interpreter cannot run griddepcontrol (gdc_wait raises there), so a launcher that passed PDL=True
under it would fail these tests; the PDL variants themselves are compiled for sm_90 by the compile scripts
(compile_sm90.py, compile_fused_sm90.py, compile_linear_sm90.py --pdl) and timed by bench/pdl_stack/pdl_stack.py --chain.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from kernels import pdl
from kernels.linear import triton as klt
from kernels.options import KernelOptions, using

# these run Triton kernels on CPU tensors: only the interpreter can (a GPU run of the suite sets TRITON_INTERPRET=0)
interpreted_only = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                      reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1")

CUDA0 = torch.device("cuda", 0)  # a device object only: nothing here touches a GPU


@pytest.fixture
def switch(monkeypatch):
    """The option on, compiled Triton, capability 9.0 (each test turns one condition off)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(pdl, "capability", lambda device: (9, 0))
    with using(KernelOptions(pdl=True)):
        yield monkeypatch


def test_launch_kwargs_when_every_condition_holds(switch):
    assert pdl.active(CUDA0)
    assert pdl.launch_kwargs(CUDA0) == {"PDL": pdl.WAIT_FIRST, "launch_pdl": True}
    switch.setattr(pdl, "capability", lambda device: (10, 0))  # later architectures too
    assert pdl.launch_kwargs(CUDA0) == {"PDL": pdl.WAIT_FIRST, "launch_pdl": True}


@pytest.mark.parametrize("condition", ["switch off", "interpreter", "cpu", "capability 8.0", "capability 8.9"])
def test_no_pdl_unless_every_condition_holds(switch, condition):
    device, options = CUDA0, KernelOptions()
    if condition == "switch off":
        options = KernelOptions(pdl=False)
    elif condition == "interpreter":
        switch.setenv("TRITON_INTERPRET", "1")
    elif condition == "cpu":
        device = torch.device("cpu")
    else:
        major, minor = condition.split()[1].split(".")
        switch.setattr(pdl, "capability", lambda d: (int(major), int(minor)))
    with using(options):
        assert not pdl.active(device)
        assert pdl.launch_kwargs(device) == {}


def test_the_option_is_on_by_default_and_scoped():
    """On since measured faster at ratio 0 on an H100 (bench/pdl_stack/README.md); ``using`` sets it for its block
    only, and a thread that sets nothing launches with the defaults."""
    import threading

    assert KernelOptions().pdl and KernelOptions().tma
    seen = []
    with using(KernelOptions(pdl=False)):
        assert not pdl.active(CUDA0)
        worker = threading.Thread(target=lambda: seen.append(pdl.current().pdl))
        worker.start()
        worker.join(timeout=30)
    assert seen == [True]
    with pytest.raises(ValueError, match="pdl must be True or False"):
        KernelOptions(pdl=1)
    with pytest.raises(TypeError, match="takes a KernelOptions"):
        with using({"pdl": False}):
            pass


def test_gemm_prefetch_depth_follows_the_option(switch):
    assert klt.pdl_steps(CUDA0) == klt.PDL_PREFETCH_STEPS == 2
    with using(KernelOptions(pdl=False)):
        assert klt.pdl_steps(CUDA0) == -1


def test_gemm_plan_turns_pdl_on_for_one_split_compiled_launches(switch):
    from kernels.linear.config import LinearConfig

    one, split = LinearConfig(16, 32, 32), LinearConfig(16, 32, 32, split_k=2)
    consts = klt._plan(16, 64, 256, torch.bfloat16, one, False, False, pdl=2)[4]
    assert consts["PDL"] == pdl.WAIT_FIRST and consts["launch_pdl"] and consts["PREFETCH_STEPS"] == 2
    assert not klt._plan(16, 64, 256, torch.bfloat16, split, False, False, pdl=2)[4]["PDL"]  # split K: not PDL
    assert "launch_pdl" not in klt._plan(16, 64, 256, torch.bfloat16, one, False, False, pdl=-1)[4]


def _chain_module():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "pdl_stack"))
    import pdl_stack

    return pdl_stack


def _layer_outputs(ps, inp):
    s = inp["first_suffix_block"]
    h = ps.chain_forward(inp).clone()
    return [h] + [x[s:].clone() for lw in inp["layers"] for x in (lw["k"], lw["v"])]


@interpreted_only
@pytest.mark.slow
def test_every_layer_kernel_asks_the_switch_and_falls_back_in_the_interpreter(monkeypatch):
    """The whole layer chain (bench/pdl_stack/pdl_stack.py --chain's tiny shape: rms_norm, q|k|v GEMM, qkv_heads into the
    cache, paged prefill attention with KV splits, LSE merge, o GEMM, add_rms_norm, gate|up SwiGLU GEMM, down
    GEMM): with the switch on every launcher consults it, none launches PDL in the interpreter, and every
    output (hidden state, written KV rows) is the same bits as with the switch off."""
    ps = _chain_module()
    inp = ps.chain_inputs(ps.CHAIN_SHAPES["tiny"], 1, torch.device("cpu"), torch.bfloat16)
    off = _layer_outputs(ps, inp)
    asked = []
    real_active = pdl.active
    monkeypatch.setattr(pdl, "active", lambda device: asked.append(device.type) or real_active(device))
    with using(KernelOptions(pdl=True)):
        on = _layer_outputs(ps, inp)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    assert torch.isfinite(off[0].float()).all()
    # the layer: rms_norm, 4 GEMMs, qkv_heads, attention, merge, add_rms_norm = 9; the key bounds once
    assert len(asked) == 9 + 1 and set(asked) == {"cpu"}


@interpreted_only
@pytest.mark.parametrize("all_parts", [False, True])
def test_merge_and_norms_same_bits_with_the_switch_on(monkeypatch, all_parts):
    from kernels.fused import triton as kf
    from kernels.lse_merge.triton import merge_rows

    x, r, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    outs, lses = torch.randn(3, 20, 32), torch.randn(3, 20)
    lses[1, :4] = float("-inf")

    def run():
        return [kf.rms_norm(x, w, 1e-5), *kf.add_rms_norm(x, r, w, 1e-5), *merge_rows(outs, lses, torch.float32,
                                                                                          all_parts=all_parts)]

    with using(KernelOptions(pdl=False)):
        off = run()
    with using(KernelOptions(pdl=True)):
        assert all(torch.equal(a, b) for a, b in zip(off, run()))



def _pdl_builds(monkeypatch, mode: int) -> list[str]:
    """From here on every layer kernel but the GEMMs launches with PDL=mode under the interpreter, its
    griddepcontrol calls (the interpreter has none) replaced by Python that records them, in order, in the list
    returned ("wait", "launch")."""
    calls = []
    monkeypatch.setattr(pdl, "gdc_wait", lambda: calls.append("wait"))
    monkeypatch.setattr(pdl, "gdc_launch_dependents", lambda: calls.append("launch"))
    monkeypatch.setattr(pdl, "launch_kwargs", lambda device: {"PDL": mode})
    return calls


def _check_order(calls: list[str], mode: int) -> None:
    """Every program waited once, then let the next kernel in once."""
    pair = ["wait", "launch"]
    assert calls and len(calls) % 2 == 0
    assert all(calls[i:i + 2] == pair for i in range(0, len(calls), 2)), calls[:8]


@interpreted_only
@pytest.mark.parametrize("mode", [pdl.WAIT_FIRST])
@pytest.mark.slow
def test_pdl_builds_of_the_layer_give_the_same_bits(monkeypatch, mode):
    """The PDL builds' own code (weights read before the wait, everything else after it) gives the plain builds'
    bits, the next kernel let in after the wait: the chain's layer (table cos/sin, KV splits
    merged by the loop merge)."""
    ps = _chain_module()
    inp = ps.chain_inputs(ps.CHAIN_SHAPES["tiny"], 1, torch.device("cpu"), torch.bfloat16, seed=1)
    off = _layer_outputs(ps, inp)
    calls = _pdl_builds(monkeypatch, mode)
    on = _layer_outputs(ps, inp)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    _check_order(calls, mode)


@interpreted_only
@pytest.mark.parametrize("mode", [pdl.WAIT_FIRST])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_pdl_builds_of_qkv_heads_by_positions_and_the_merge_of_all_parts(monkeypatch, qk_norm, mode):
    """The variants the chain does not take: rotation by positions * inv_freq, Qwen3's q/k norms (their
    weights read before the wait), k and v returned, and the merge that loads every part at once."""
    from kernels.fused import KVWrite
    from kernels.fused import triton as kf
    from kernels.lse_merge.triton import merge_rows

    t, hq, hkv, d = 5, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
    pos, inv = torch.arange(7, 7 + t), 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    norms = dict(q_norm=torch.randn(d, dtype=torch.bfloat16), k_norm=torch.randn(d, dtype=torch.bfloat16)) \
        if qk_norm else {}
    outs, lses = torch.randn(3, 20, 32), torch.randn(3, 20)
    lses[1, :4] = float("-inf")

    def run():
        kc, vc = torch.zeros(2, 4, hkv, d, dtype=torch.bfloat16), torch.zeros(2, 4, hkv, d, dtype=torch.bfloat16)
        write = KVWrite(kc, vc, torch.tensor([0, 0, 1, 1, 1]), torch.tensor([0, 3, 1, 2, 0]))
        q, k, v = kf.qkv_heads(qkv, hq, hkv, positions=pos, inv_freq=inv, write=write, **norms)
        return [q, k, v, kc, vc, *merge_rows(outs, lses, torch.bfloat16, all_parts=True)]

    off = run()
    calls = _pdl_builds(monkeypatch, mode)
    assert all(torch.equal(a, b) for a, b in zip(off, run()))
    _check_order(calls, mode)
