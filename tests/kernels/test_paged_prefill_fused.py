"""Paged prefill with KV splits merged by the split programs themselves (PrefillConfig(merge="fused")):
the same bits as the two-launch path (split partials, then kernels/lse_merge), the twin's result, and the
arrival counters left at zero. Triton's interpreter runs one program at a time, so there the last program
of each (tile, KV head) does the merge."""

import os

import pytest
import torch
from kernel_checks import TOL, assert_lse_close, rel_err
from paged_cases import build, prefill_queries

from kernels.paged_attention import paged_prefill_attention
from kernels.paged_attention import _prefill, _prefill_merge
from kernels.paged_attention._meta import pack
from kernels.paged_attention._prefill import PrefillConfig, launch
from kernels.rope import rope_inv_freq

INV = rope_inv_freq(64, 500000.0)

# (per sequence: chunk lengths, suffix, scattered queries), Hq, Hkv, dtype, hidden fraction, config knobs
CASES = {
    # three sequences (a spare tile past each one's end), a 17-token suffix (partial tile), scattered queries
    "3seqs-odd-splits5": ([([40, 23, 30, 17], 17, 4), ([50], 2, 0), ([1], 1, 0)], 8, 2, torch.float32, 0.1,
                          dict(num_splits=5)),
    # GQA 3 (a padding head in every group of 4 rows), 16 splits over 4 entries: most splits have no key
    "gqa3-empty-splits16": ([([20, 13], 3, 1)], 6, 2, torch.float32, 0.0, dict(num_splits=16)),
    # two splits: the merge's one-ahead load past the last part reads it again
    "splits2": ([([20, 13], 3, 1)], 8, 2, torch.float32, 0.0, dict(num_splits=2)),
    # bf16 partials, the whole-step plan and exact tiles: one sequence of 21 queries (a partial last tile)
    "bf16-steps-narrow-splits3": ([([70, 33, 16], 21, 2)], 8, 2, torch.bfloat16, 0.05,
                                  dict(num_splits=3, plan="steps", exact_tiles=True, narrow_partials=True)),
    # one split: nothing to merge, the kernel writes the output directly
    "splits1": ([([20, 13], 3, 1)], 8, 2, torch.float32, 0.0, dict(num_splits=1)),
}


def _setup(seqs, hq, hkv, dtype, hide):
    case = build([(c, s) for c, s, _ in seqs], 16, hkv, 64, INV, dtype=dtype, hide=hide, base=300)
    q, q_pos, cu_q = prefill_queries(case, [s for _, s, _ in seqs], [n for _, _, n in seqs], hq, dtype)
    packed = pack(case.block_ids, case.offsets, case.masks, 16, INV, with_table=True, cu_entries=case.cu_entries)
    return case, (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, INV, 0.125)


def _twin(case, args):
    q, q_pos, *_, cu_q, _, scale = args
    return paged_prefill_attention(q, q_pos, case.k_cache, case.v_cache, case.slot_pos, case.block_ids, case.offsets,
                                   case.masks, cu_q, case.cu_entries, INV, scale, backend="torch")


def _counters_zero() -> bool:
    return all(int(c.count_nonzero()) == 0 for c in _prefill_merge._COUNTERS.kept.values())


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.slow
def test_fused_merge_equals_two_launches_and_twin(name, monkeypatch):
    seqs, hq, hkv, dtype, hide, knobs = CASES[name]
    case, args = _setup(seqs, hq, hkv, dtype, hide)
    base = dict(block_m=32, min_block_n=32, **knobs)
    out2, lse2 = launch(*args, cfg=PrefillConfig(**base))  # partials, then the merge kernel
    calls = []
    monkeypatch.setattr(_prefill, "merge_rows", lambda *a, **k: calls.append(a))  # the fused path must not merge
    out1, lse1 = launch(*args, cfg=PrefillConfig(**base, merge="fused"))
    assert not calls
    assert out1.dtype == dtype and out1.shape == args[0].shape and lse1.shape == args[0].shape[:2]
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)  # same arithmetic, same order: same bits
    want, want_lse = _twin(case, args)
    assert rel_err(out1, want) <= TOL[dtype]
    assert_lse_close(lse1, want_lse, 50 * TOL[dtype])
    assert _counters_zero()  # the last arriver of each group reset its counter: a replay starts from zero
    again, _ = launch(*args, cfg=PrefillConfig(**base, merge="fused"))
    assert torch.equal(again, out1)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="reorders the interpreter's programs")
@pytest.mark.slow
def test_fused_merge_does_not_depend_on_who_arrives_last(monkeypatch):
    """The interpreter runs a (tile, KV head)'s split programs in split order, so split n-1 arrives last;
    run them reversed and rotated instead (split 0, then a middle split, arriving last): the same bits."""
    from triton.runtime import interpreter

    case, args = _setup([([40, 23], 9, 2), ([30], 5, 0)], 8, 2, torch.float32, 0.1)
    cfg = PrefillConfig(block_m=32, min_block_n=32, num_splits=4, merge="fused")
    first, first_lse = launch(*args, cfg=cfg)
    builder = interpreter.interpreter_builder
    run_split = builder.set_grid_idx
    for order in ((3, 2, 1, 0), (2, 3, 0, 1)):
        # program (x, y, z) runs split order[z]: the last to run (and arrive) is split order[-1] (the other
        # kernels of the call, the key bounds', have one program along z and run as they are)
        monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z, order=order: run_split(
            x, y, order[z] if builder.grid_dim[2] == len(order) else z))
        out, lse = launch(*args, cfg=cfg)
        monkeypatch.undo()
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
    want, _ = _twin(case, args)
    assert rel_err(first, want) <= TOL[torch.float32]
    assert _counters_zero()


def test_fused_merge_queries_that_see_no_key():
    """Queries before every visible key and a sequence with no entries: every split's partial is empty (LSE
    -inf), the merged row is 0 with LSE -inf; the other rows match the twin."""
    case = build([([20], 3), ([], 0)], 16, 2, 64, INV, base=100)
    q = torch.randn(4, 4, 64)
    q_pos = torch.tensor([5, 99, 121, 7], dtype=torch.int32)  # 5 and 99 precede position 100
    cu_q = torch.tensor([0, 3, 4], dtype=torch.int32)
    packed = pack(case.block_ids, case.offsets, case.masks, 16, INV, with_table=False, cu_entries=case.cu_entries)
    args = (q, q_pos, case.k_cache, case.v_cache, case.slot_pos, packed, cu_q, INV, 0.125)
    out, lse = launch(*args, cfg=PrefillConfig(block_m=16, min_block_n=16, num_splits=2, merge="fused"))
    assert torch.equal(out[[0, 1, 3]], torch.zeros_like(out[[0, 1, 3]]))
    assert torch.isneginf(lse[[0, 1, 3]]).all() and torch.isfinite(lse[2]).all()
    want, want_lse = _twin(case, args)
    assert rel_err(out, want) <= TOL[torch.float32]
    assert_lse_close(lse, want_lse, 50 * TOL[torch.float32])
    assert _counters_zero()


def test_short_prefill_fused_through_the_public_call(monkeypatch):
    """SHORT_PREFILL with merge="fused" reaches paged_prefill_packed's short calls (the engine's path)."""
    from kernels.paged_attention import triton as kt

    case, args = _setup([([40, 23], 9, 0)], 8, 2, torch.float32, 0.0)
    short = PrefillConfig(block_m=32, min_block_n=32, num_splits=3, exact_tiles=True, merge="fused")
    monkeypatch.setattr(kt, "SHORT_PREFILL", short)
    monkeypatch.setattr(_prefill, "merge_rows", lambda *a, **k: pytest.fail("a separate merge was launched"))
    out, lse = kt.paged_prefill_packed(*args)
    want, want_lse = _twin(case, args)
    assert rel_err(out, want) <= TOL[torch.float32]
    assert_lse_close(lse, want_lse, 50 * TOL[torch.float32])


def test_arrival_counters_kept_per_device():
    dev = torch.device("cpu")
    kept = _prefill_merge.arrival_counters(dev, 10)
    assert kept is _prefill_merge.arrival_counters(dev, 20) and kept.dtype == torch.int32
    big = _prefill_merge.arrival_counters(dev, _prefill_merge.MAX_GROUPS_COUNTED + 1)
    assert big is not kept and big.numel() == _prefill_merge.MAX_GROUPS_COUNTED + 1 and not big.any()


def test_merge_knob_is_checked():
    assert PrefillConfig(merge="fused").merge == "fused"
    with pytest.raises(ValueError, match="merge"):
        PrefillConfig(merge="tree")
