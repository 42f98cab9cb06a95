"""Paged decode: Triton (any number of KV splits) == twin == eager attention at global positions."""

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, assert_lse_close, rel_err
from paged_cases import build, eager_attention

from kernels.paged_attention import paged_decode_attention
from kernels.paged_attention._decode import DecodeConfig, launch
from kernels.paged_attention._meta import pack
from kernels.rope import apply_rope, rope_inv_freq

# per sequence (chunk lengths, suffix), Hq, Hkv, D, BS, dtype, hidden fraction, base offset
CASES = [
    ([([], 1), ([30, 33], 0), ([128, 128, 200], 44)], 8, 2, 128, 16, torch.float32, 0.0, 0),
    ([([63], 2), ([7, 9, 11], 5)], 4, 4, 64, 32, torch.bfloat16, 0.3, 0),
    ([([100, 50], 13)], 8, 1, 64, 64, torch.float16, 0.1, 0),
    ([([70, 40], 3), ([25], 0)], 8, 2, 64, 16, torch.float32, 0.0, 65450),
    # chunks placed past the old 16-bit field (65,535), up to the 131,072 positions of a Llama-3.1-class model
    ([([70, 40], 3), ([25], 0)], 8, 2, 64, 16, torch.float32, 0.0, 130950),
    ([([63, 20], 2)], 4, 2, 64, 16, torch.bfloat16, 0.1, 100000),
]


def _id(c):
    seqs, hq, hkv, d, bs, dtype, hide, base = c
    lens = "-".join(str(sum(ch) + s) for ch, s in seqs)
    return f"B{len(seqs)}-L{lens}-H{hq}x{hkv}-D{d}-BS{bs}-{DTYPE_NAME[dtype]}" + (f"-hide{hide}" if hide else "") + (
        f"-off{base}" if base else "")


def _queries(case, hq, dtype):
    """One query per sequence, rotated at the sequence's next position."""
    d = case.k_cache.shape[-1]
    raw = torch.randn(len(case.length), hq, d)
    pos = torch.tensor(case.length)
    return apply_rope(raw, pos, case.inv_freq).to(dtype), pos


@pytest.mark.parametrize("spec", CASES, ids=[_id(c) for c in CASES])
@pytest.mark.slow
def test_decode_matches_twin_and_eager(spec):
    seqs, hq, hkv, d, bs, dtype, hide, base = spec
    inv = rope_inv_freq(d, 10000.0)
    case = build(seqs, bs, hkv, d, inv, dtype=dtype, hide=hide, base=base)
    q, pos = _queries(case, hq, dtype)
    scale = d ** -0.5
    args = (q, case.k_cache, case.v_cache, case.block_ids, case.offsets, case.masks, case.cu_entries, inv, scale)
    out_t, lse_t = paged_decode_attention(*args, backend="torch")
    results = [paged_decode_attention(*args, backend="triton")]
    for table in (False, True):
        packed = pack(case.block_ids, case.offsets, case.masks, bs, inv, with_table=table)
        for splits in (1, 3, 20):   # 20: past the unrolled merge, every part merged at once
            results.append(launch(q, case.k_cache, case.v_cache, packed, case.cu_entries, inv, scale,
                                  cfg=DecodeConfig(num_splits=splits)))
    for out_k, lse_k in results:
        assert out_k.dtype == dtype and out_k.shape == q.shape
        assert rel_err(out_k, out_t) <= TOL[dtype]
        assert_lse_close(lse_k, lse_t, 50 * TOL[dtype])
    for b in range(len(seqs)):
        k, v, k_pos = case.eager_keys(b)
        want, want_lse = eager_attention(q[b:b + 1].float(), None, k, v, k_pos, scale)
        tol = max(TOL[dtype], 1e-3)  # fp32 angles of positions up to 65k differ by ~1e-4 relative
        assert rel_err(out_t[b:b + 1], want) <= tol
        assert rel_err(results[0][0][b:b + 1], want) <= tol
        assert_lse_close(results[0][1][b:b + 1], want_lse.float(), 50 * tol)


def test_rotation_off_differs_and_empty_sequences():
    """Switching rotation off changes the result (so the timing flag is real); a sequence with no
    entries, or whose every slot is hidden, gets out 0 and lse -inf."""
    inv = rope_inv_freq(64, 10000.0)
    case = build([([40, 24], 0), ([], 0), ([16], 0)], 16, 1, 64, inv)
    case.masks[-1] = 0  # the last sequence's only block is hidden entirely
    q = torch.randn(3, 2, 64)
    packed = pack(case.block_ids, case.offsets, case.masks, 16, inv, with_table=False)
    on, lse_on = launch(q, case.k_cache, case.v_cache, packed, case.cu_entries, inv, 0.125)
    off, _ = launch(q, case.k_cache, case.v_cache, packed, case.cu_entries, inv, 0.125, rotate=False)
    assert rel_err(off[:1], on[:1]) > 1e-3
    for backend in ("torch", "triton"):
        out, lse = paged_decode_attention(q, case.k_cache, case.v_cache, case.block_ids, case.offsets, case.masks,
                                          case.cu_entries, inv, 0.125, backend=backend)
        assert torch.equal(out[1:], torch.zeros_like(out[1:])) and torch.isneginf(lse[1:]).all()
        assert torch.isfinite(lse[0]).all()
