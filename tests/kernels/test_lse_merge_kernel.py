"""LSE merge: attention over random partitions of a key set, merged, equals attention over the set."""

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, assert_lse_close, rel_err
from paged_cases import eager_attention

from kernels.lse_merge import merge_attention

CASES = [(1, 4, 4, 64, 3, torch.float32), (63, 8, 2, 128, 5, torch.float32), (5, 8, 1, 64, 4, torch.bfloat16),
         (7, 4, 4, 96, 2, torch.float16)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("t,hq,hkv,d,parts,dtype", CASES,
                         ids=[f"T{t}-H{hq}x{hkv}-D{d}-P{p}-{DTYPE_NAME[dt]}" for t, hq, hkv, d, p, dt in CASES])
def test_merge_of_random_partition_equals_whole(t, hq, hkv, d, parts, dtype, backend):
    s = 97
    q, k, v = torch.randn(t, hq, d), torch.randn(s, hkv, d), torch.randn(s, hkv, d)
    q_pos = torch.randint(0, s, (t,))
    k_pos = torch.randperm(s)
    part = torch.randint(0, parts, (s,))
    part[part == parts - 1] = 0  # the last part is empty: it must add nothing
    outs, lses = [], []
    for i in range(parts):
        sel = part == i
        o, lse = eager_attention(q, q_pos, k[sel], v[sel], k_pos[sel], d ** -0.5)
        outs.append(o.to(dtype))
        lses.append(lse.float())
    out, lse = merge_attention(torch.stack(outs), torch.stack(lses), backend=backend)
    want, want_lse = eager_attention(q, q_pos, k, v, k_pos, d ** -0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, want) <= max(TOL[dtype], 1e-5) * 4
    assert_lse_close(lse, want_lse.float(), 1e-4)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_merge_with_no_key_anywhere(backend):
    outs = torch.randn(3, 2, 5, 64)
    lses = torch.full((3, 2, 5), float("-inf"))
    lses[1, 0, 0] = 0.5
    out, lse = merge_attention(outs, lses, backend=backend)
    assert torch.equal(out[0, 0], outs[1, 0, 0]) or rel_err(out[0, 0], outs[1, 0, 0]) < 1e-6
    assert torch.equal(out.flatten(0, 1)[1:], torch.zeros(9, 64)) and torch.isneginf(lse.flatten()[1:]).all()
    with pytest.raises(ValueError, match="disagree"):
        merge_attention(outs, lses[:, :1], backend=backend)


@pytest.mark.parametrize("parts", [1, 3, 8, 13, 99])
def test_merge_all_parts_at_once_equals_the_loop(parts):
    """merge_rows(all_parts=True) (every part of a row block loaded at once) == the loop and the twin, with
    parts that saw nothing and rows no part saw; D = 96 pads its tile; 99 parts (a dense decode's split count at
    32K, batch 1 on an H100) take one row a program on more warps."""
    from kernels.lse_merge.triton import merge_rows

    outs = torch.randn(parts, 37, 96)
    lses = torch.randn(parts, 37) * 4
    lses[0, :5] = float("-inf")
    lses[:, 5] = float("-inf")
    want, want_lse = merge_attention(outs, lses, backend="torch")
    for all_parts in (False, True):
        out, lse = merge_rows(outs, lses, torch.bfloat16, all_parts=all_parts)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, want) <= TOL[torch.bfloat16]
        assert_lse_close(lse, want_lse, 1e-4)
        assert torch.equal(out[5].float(), torch.zeros(96))


@pytest.mark.parametrize("parts", [2, 8, 17])
def test_unrolled_merge_is_the_loop_bit_for_bit(parts, monkeypatch):
    """Part counts up to UNROLL_PARTS compile the loop unrolled: the same steps in the same order, so the same
    bits as the loop over a runtime count (17 parts take the loop either way)."""
    from kernels.lse_merge import triton as km

    outs = torch.randn(parts, 29, 64)
    lses = torch.randn(parts, 29) * 4
    lses[1, :3] = float("-inf")
    unrolled = km.merge_rows(outs, lses, torch.float32)
    monkeypatch.setattr(km, "UNROLL_PARTS", 0)
    looped = km.merge_rows(outs, lses, torch.float32)
    assert torch.equal(unrolled[0], looped[0]) and torch.equal(unrolled[1], looped[1])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("parts", [3, 21])
def test_merge_to_another_dtype_rounds_once(parts, backend):
    """fp32 parts merged straight to bf16 (``out_dtype``) equal the fp32 merge rounded once; past the unrolled
    merge's part count the Triton merge loads every part at once, and still equals the twin."""
    gen = torch.Generator().manual_seed(parts)
    outs = torch.randn(parts, 3, 7, 64, generator=gen)
    lses = torch.randn(parts, 3, 7, generator=gen) * 4
    lses[1, 0] = float("-inf")        # a part that saw nothing of one row
    want, want_lse = merge_attention(outs.double(), lses.double())
    out, lse = merge_attention(outs, lses, backend=backend, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_err(out, want.to(torch.bfloat16)) <= TOL[torch.bfloat16]
    assert_lse_close(lse, want_lse.float(), 1e-5)
