"""Block-table encoding: values that do not fit the packed words are refused, never clamped."""

import pytest
import torch

from kernels.paged_attention import (ID_SHIFT, MAX_BLOCK_ID, MAX_OFFSET, OFFSET_SHIFT, check_encodable,
                                     paged_decode_attention, paged_prefill_attention)
from kernels.paged_attention._meta import pack
from kernels.rope import rope_inv_freq


def test_check_encodable_limits():
    """Every position a Llama-3.1-class model addresses (131,072) is an encodable chunk start; past the field's
    2**24 - 1, refused by value; block ids up to 2**23 - 1 (the word stays a non-negative int64)."""
    assert MAX_OFFSET == (1 << 24) - 1 and MAX_BLOCK_ID == (1 << 23) - 1 and MAX_OFFSET >= 131072
    ids = torch.tensor([0, 5], dtype=torch.int32)
    check_encodable(16, ids, torch.tensor([0, 65536, 131071, MAX_OFFSET], dtype=torch.int32))
    check_encodable(64, torch.tensor([MAX_BLOCK_ID], dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match=f"{MAX_OFFSET + 1} does not fit the 24-bit offset field"):
        check_encodable(16, ids, torch.tensor([0, MAX_OFFSET + 1]))
    with pytest.raises(ValueError, match="-1"):
        check_encodable(16, ids, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="block id"):
        check_encodable(16, torch.tensor([MAX_BLOCK_ID + 1], dtype=torch.int64), torch.tensor([0]))
    with pytest.raises(ValueError, match="block size"):
        check_encodable(65, ids, torch.tensor([0, 0]))


def test_pack_layout_round_trips():
    inv = rope_inv_freq(64, 10000.0)
    ids = torch.tensor([0, 7, MAX_BLOCK_ID], dtype=torch.int64)
    offs = torch.tensor([MAX_OFFSET, 0, 131071], dtype=torch.int32)
    masks = torch.tensor([0xFFFF, 0x00F0, -1], dtype=torch.int64)
    p16 = pack(ids, offs, masks, 16, inv, with_table=True)
    w = p16.meta
    assert (w >= 0).all()
    assert torch.equal(w >> ID_SHIFT, ids) and torch.equal((w >> OFFSET_SHIFT) & MAX_OFFSET, offs.long())
    assert torch.equal(w & 0xFFFF, masks & 0xFFFF) and p16.mask_in_word
    assert torch.allclose(p16.table[:, :32], torch.cos(offs.float()[:, None] * inv))
    p64 = pack(ids, offs, masks, 64, inv, with_table=False)
    assert not p64.mask_in_word and torch.equal(p64.masks, masks) and p64.table is None


@pytest.mark.parametrize("bad", ["offset", "negative", "block_size"])
def test_triton_entry_points_refuse(bad):
    inv = rope_inv_freq(64, 10000.0)
    bs = 128 if bad == "block_size" else 16
    k = torch.randn(2, bs, 1, 64)
    ids = torch.tensor([0, 1], dtype=torch.int32)
    offs = torch.tensor({"offset": [0, MAX_OFFSET + 1], "negative": [-3, 0], "block_size": [0, 0]}[bad], dtype=torch.int32)
    masks = torch.tensor([1, 1], dtype=torch.int64)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    q = torch.randn(1, 1, 64)
    with pytest.raises(ValueError, match="offset|block size"):
        paged_decode_attention(q, k, k, ids, offs, masks, cu, inv, 0.125, backend="triton")
    with pytest.raises(ValueError, match="offset|block size"):
        paged_prefill_attention(q, torch.tensor([5], dtype=torch.int32), k, k, torch.zeros(2, bs, dtype=torch.int32),
                                ids, offs, masks, cu, cu, inv, 0.125, backend="triton")


def test_packed_table_cache_follows_in_place_changes():
    """The pack cache serves every layer of a step, but a table changed in place is packed again."""
    inv = rope_inv_freq(64, 10000.0)
    ids = torch.tensor([3, 4], dtype=torch.int32)
    offs = torch.tensor([10, 10], dtype=torch.int32)
    masks = torch.tensor([0xFFFF, 0x00FF], dtype=torch.int64)
    first = pack(ids, offs, masks, 16, inv, with_table=False)
    assert pack(ids, offs, masks, 16, inv, with_table=False) is first
    offs[1] = 20
    again = pack(ids, offs, masks, 16, inv, with_table=False)
    assert again is not first and int((again.meta[1] >> 16) & 0xFFFF) == 20


def test_empty_table():
    """No entries at all: every query sees nothing (out 0, lse -inf), nothing is launched on garbage."""
    inv = rope_inv_freq(64, 10000.0)
    k = torch.randn(1, 16, 1, 64)
    none32 = torch.zeros(0, dtype=torch.int32)
    cu = torch.tensor([0, 0], dtype=torch.int32)
    q = torch.randn(1, 2, 64)
    out, lse = paged_decode_attention(q, k, k, none32, none32, torch.zeros(0, dtype=torch.int64), cu, inv, 0.125,
                                      backend="triton")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out, lse = paged_prefill_attention(q, torch.tensor([3], dtype=torch.int32), k, k, torch.zeros(1, 16, dtype=torch.int32),
                                       none32, none32, torch.zeros(0, dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int32),
                                       cu, inv, 0.125, backend="triton")
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_inference_mode_tables_are_packed_not_cached():
    """Block tables made under torch.inference_mode carry no version counter: they must still work
    (packed on every call) rather than fail on the cache's version check."""
    import torch

    from kernels.paged_attention import _meta
    from kernels.rope import rope_inv_freq

    inv_freq = rope_inv_freq(64, 10000.0)
    with torch.inference_mode():
        ids = torch.tensor([3, 1], dtype=torch.int32)
        offs = torch.tensor([0, 70], dtype=torch.int32)
        masks = torch.tensor([0xFFFF, 0x00FF], dtype=torch.int64)
        a = _meta.pack(ids, offs, masks, 16, inv_freq, with_table=True)
        b = _meta.pack(ids, offs, masks, 16, inv_freq, with_table=True)
    assert a is not b and torch.equal(a.meta, b.meta)
    assert int(a.meta[1]) == (1 << ID_SHIFT) | (70 << OFFSET_SHIFT) | 0x00FF
