"""The short prefill attention asking L2 for the next GEMM's weight (paged_prefill_packed(l2_prefetch=)): each
program's share tiles the tensor's bytes, the results do not change, bad arguments are refused by name, and
the engine's static tails pass each layer's o projection weight when kernels.paged_attention's switch is on.

The prefetch itself is PTX (compiled out in the interpreter): bench/l2_prefetch.py --compile-only shows it
in the sm_90 build, and --attention times it on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from paged_cases import build, prefill_queries

import kernels.paged_attention as pa
from kernels.paged_attention import _prefill
from kernels.paged_attention.triton import pack, paged_prefill_packed, prefill_key_bounds
from kernels.rope import rope_inv_freq

LANES = 32


@triton.jit
def _record_kernel(pf_ptr, rec_ptr, pf_bytes, pf_share, LANES: tl.constexpr, STEP: tl.constexpr,
                   BULK: tl.constexpr, ROUNDS: tl.constexpr):
    """Every program's rounds of the kernel's prefetch loop, recorded instead of issued."""
    _prefill.l2_prefetch_share(pf_ptr, pf_bytes, pf_share, tl.program_id(0), LANES, STEP, BULK, rec_ptr, ROUNDS)


def _asked(t: torch.Tensor, programs: int, mode: str, bulk_bytes: int = 64):
    """(plan, sorted [(offset, size, program)] of every lane a launch of ``programs`` programs would ask L2 for)."""
    plan = _prefill.l2_plan(t, programs, _prefill.PrefillConfig(l2_mode=mode, l2_bulk_bytes=bulk_bytes),
                            interpreted=False)
    rounds = triton.cdiv(plan.share, LANES * plan.step)
    rec = torch.full((programs, rounds, LANES, 2), -7, dtype=torch.int64)
    _record_kernel[(programs,)](plan.ptr, rec, plan.n_bytes, plan.share, LANES=LANES, STEP=plan.step,
                                BULK=plan.bulk, ROUNDS=rounds)
    prog = torch.arange(programs)[:, None, None, None].expand(programs, rounds, LANES, 1)
    rows = torch.cat([rec, prog], dim=3).reshape(-1, 3)
    rows = rows[rows[:, 0] >= 0]  # lanes past a program's share (-1) and rounds it never ran (-7) asked for nothing
    return plan, sorted(map(tuple, rows.tolist()))


@pytest.mark.parametrize("mode, numel, dtype, programs", [
    ("bulk", 1000, torch.bfloat16, 7),     # 2000 bytes: not a multiple of a line, nor of a program's share
    ("bulk", 4099, torch.float32, 3),      # several rounds a program
    ("lines", 1000, torch.bfloat16, 7),
    ("lines", 37, torch.uint8, 5),         # fewer lines than programs: some programs ask for nothing
])
def test_shares_tile_the_bytes(mode, numel, dtype, programs):
    t = torch.zeros(numel, dtype=dtype)
    plan, asked = _asked(t, programs, mode)
    n_bytes = numel * t.element_size()
    assert plan.bulk == (mode == "bulk") and plan.share % _prefill.L2_LINE == 0
    # bulk prefetches ask for 16-byte multiples at 16-byte aligned addresses: the last n_bytes % 16 bytes are left
    assert plan.n_bytes == (n_bytes // 16 * 16 if plan.bulk else n_bytes)
    assert asked[0][0] == 0
    for (off, size, p), (nxt, _, _) in zip(asked, asked[1:] + [(plan.n_bytes, 0, 0)]):
        assert off + size == nxt  # contiguous, no byte asked for twice
        assert 0 < size <= plan.step
        assert p * plan.share <= off and off + size <= (p + 1) * plan.share  # within the program's own share
        if plan.bulk:
            assert off % 16 == 0 and size % 16 == 0
        else:
            assert off % _prefill.L2_LINE == 0


def test_unaligned_tensor_is_asked_for_by_lines():
    t = torch.zeros(301, dtype=torch.uint8)[3:]  # 3 bytes past an aligned allocation
    plan = _prefill.l2_plan(t, 4, _prefill.PrefillConfig(l2_mode="bulk"), interpreted=False)
    assert not plan.bulk and plan.step == _prefill.L2_LINE and plan.n_bytes == 298
    assert _prefill.l2_plan(t, 4, _prefill.PrefillConfig(), interpreted=True) is None  # interpreter: compiled out
    assert _prefill.l2_plan(None, 4, _prefill.PrefillConfig(), interpreted=False) is None


def _short_case(dtype=torch.bfloat16):
    """An awkward short prefill: block size 16, 3 KV heads of group 3 (padded to 4), two sequences of
    odd lengths over hidden slots; the packed arguments of paged_prefill_packed."""
    inv = rope_inv_freq(32, 10000.0)
    seqs = [([23, 17, 9], 5), ([31], 11)]
    case = build(seqs, 16, 3, 32, inv, dtype=dtype, hide=0.2, base=600, gen=torch.Generator().manual_seed(3))
    q, q_pos, cu_q = prefill_queries(case, [5, 11], [2, 0], 9, dtype)
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=True, cu_entries=case.cu_entries)
    return (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, inv, 32 ** -0.5)


@pytest.mark.parametrize("splits", [None, 3])
def test_outputs_equal_with_and_without_prefetch(splits):
    args = _short_case()
    key_hi = prefill_key_bounds(args[5], args[4])
    weight = torch.randn(96, 40, dtype=torch.bfloat16)
    plain, plain_lse = paged_prefill_packed(*args, num_splits=splits, key_hi=key_hi)
    hinted, hinted_lse = paged_prefill_packed(*args, num_splits=splits, key_hi=key_hi, l2_prefetch=weight)
    assert torch.equal(hinted, plain) and torch.equal(hinted_lse, plain_lse)
    assert plain.abs().sum() > 0  # the case attends to something


def test_bad_l2_prefetch_refused_by_name():
    args = _short_case()
    with pytest.raises(ValueError, match="l2_prefetch must be a tensor"):
        paged_prefill_packed(*args, l2_prefetch=[1, 2, 3])
    with pytest.raises(ValueError, match="l2_prefetch must be contiguous"):
        paged_prefill_packed(*args, l2_prefetch=torch.zeros(8, 6).t())
    with pytest.raises(ValueError, match="l2_prefetch is on meta"):
        paged_prefill_packed(*args, l2_prefetch=torch.zeros(8, device="meta"))
    with pytest.raises(ValueError, match="l2_mode"):
        _prefill.PrefillConfig(l2_mode="tma")
    with pytest.raises(ValueError, match="l2_bulk_bytes"):
        _prefill.PrefillConfig(l2_bulk_bytes=24)
    with pytest.raises(ValueError, match="fraction"):
        pa.l2_head(torch.zeros(4), 0.0)


def test_l2_head_is_a_leading_view():
    w = torch.arange(12.0).reshape(3, 4)
    half = pa.l2_head(w, 0.5)
    assert half.data_ptr() == w.data_ptr() and half.tolist() == list(range(6))
    assert pa.l2_head(w, 1.0).numel() == 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from services.engine.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=7)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_engine_switch_passes_the_o_weight_and_changes_nothing(tiny_llama, monkeypatch, fraction):
    """Static Triton tails with kernels.paged_attention.L2_PREFETCH_NEXT on: every layer's attention call gets
    (the leading fraction of) that layer's o_proj, the exact tensor finish_layer's o GEMM reads, and the logits
    are the same bits as with the switch off."""
    from kernels.paged_attention import triton as kt
    from services.engine import Engine

    seen = []
    real = kt.paged_prefill_packed

    def spy(*args, l2_prefetch=None, **kw):
        seen.append((args[2].data_ptr(), l2_prefetch))
        return real(*args, l2_prefetch=l2_prefetch, **kw)

    monkeypatch.setattr(kt, "paged_prefill_packed", spy)
    monkeypatch.setattr(pa, "L2_PREFETCH_FRACTION", fraction)
    g = torch.Generator().manual_seed(70)
    chunks = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 21)]
    suffix = torch.randint(0, 256, (6,), generator=g).tolist()
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(pa, "L2_PREFETCH_NEXT", on)
        eng = Engine.load(tiny_llama, attention_backend="triton", static_tails=True)
        eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0)  # computes the chunks
        seen.clear()
        logits[on] = eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.0).logits
        pool, layers = eng.forward.pool, eng.forward.model.w.layers
        assert len(seen) == len(layers)  # one attention call a layer, all through the static tail
        for layer, (k_ptr, hint) in enumerate(seen):
            assert k_ptr == pool.k[layer].data_ptr()
            if not on:
                assert hint is None
                continue
            w = layers[layer].o_proj
            assert hint.data_ptr() == w.data_ptr() and hint.numel() == int(w.numel() * fraction)
    assert torch.equal(logits[True], logits[False])
