"""gather_rotate: the Triton kernel against the twin, and the twin against rotating each key alone."""

import pytest
import torch
from kernel_checks import DTYPE_NAME, TOL, rel_err

from kernels.rope import apply_rope, gather_rotate, rope_inv_freq

# blocks in the pool, block size, KV heads, head_dim, entries gathered, dtype
CASES = [(9, 16, 8, 128, 5, torch.bfloat16), (7, 5, 3, 64, 4, torch.float32), (3, 1, 1, 32, 6, torch.float16),
         (4, 64, 2, 64, 1, torch.float32), (5, 16, 1, 96, 0, torch.float32)]


@pytest.mark.parametrize("n,bs,h,d,e,dtype", CASES, ids=[f"N{c[0]}-BS{c[1]}-H{c[2]}-D{c[3]}-E{c[4]}-{DTYPE_NAME[c[5]]}"
                                                          for c in CASES])
def test_triton_matches_twin(n, bs, h, d, e, dtype):
    g = torch.Generator().manual_seed(3)
    k = torch.randn((n, bs, h, d), generator=g).to(dtype)
    v = torch.randn((n, bs, h, d), generator=g).to(dtype)
    ids = torch.randint(0, n, (e,), generator=g, dtype=torch.int32)  # repeats allowed, any order
    offs = torch.randint(0, 65536, (e,), generator=g, dtype=torch.int32)
    offs[:1] = 0
    inv = rope_inv_freq(d, 500000.0)
    want_k, want_v = gather_rotate(k, v, ids, offs, inv)
    got_k, got_v = gather_rotate(k, v, ids, offs, inv, backend="triton")
    assert got_k.shape == (e * bs, h, d) and got_k.dtype == dtype and torch.equal(got_v, want_v)
    if e:
        assert rel_err(got_k, want_k) <= TOL[dtype]
        # offset 0 leaves the block's keys bit for bit as they are
        assert torch.equal(got_k[:bs], k[int(ids[0])])


def test_twin_rotates_each_block_by_its_offset():
    inv = rope_inv_freq(64, 10000.0)
    k, v = torch.randn(6, 4, 2, 64), torch.randn(6, 4, 2, 64)
    ids = torch.tensor([5, 0, 5], dtype=torch.int32)
    offs = torch.tensor([3, 700, 12], dtype=torch.int32)
    got_k, got_v = gather_rotate(k, v, ids, offs, inv)
    for j, (b, o) in enumerate(zip(ids.tolist(), offs.tolist())):
        want = apply_rope(k[b], torch.full((4,), o), inv)  # the 4 slots of block b, each rotated by o
        torch.testing.assert_close(got_k[4 * j:4 * j + 4], want)
        assert torch.equal(got_v[4 * j:4 * j + 4], v[b])


def test_refuses_bad_layouts():
    inv = rope_inv_freq(64, 10000.0)
    k = torch.randn(4, 8, 2, 64)
    ids = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguously"):
        gather_rotate(k.transpose(1, 2), k.transpose(1, 2), ids, ids, inv, backend="triton")
    with pytest.raises(ValueError, match="inverse frequencies"):
        gather_rotate(k, k, ids, ids, inv[:8], backend="triton")



SLOT_CASES = [(37, 8, 128, 53, torch.bfloat16), (11, 3, 64, 7, torch.float32), (5, 1, 32, 1, torch.float16),
              (9, 2, 96, 0, torch.float32)]


@pytest.mark.parametrize("m,h,d,s,dtype", SLOT_CASES, ids=[f"M{c[0]}-H{c[1]}-D{c[2]}-S{c[3]}-{DTYPE_NAME[c[4]]}"
                                                         for c in SLOT_CASES])
def test_single_slots_as_one_slot_blocks(m, h, d, s, dtype):
    """A layer's flat slots [M, H, D] viewed as [M, 1, H, D]: slots in any order, repeats allowed, each key
    rotated by its own offset (the CacheBlend graph's one key per position), Triton against the twin."""
    g = torch.Generator().manual_seed(4)
    k = torch.randn((m, h, d), generator=g).to(dtype)
    v = torch.randn((m, h, d), generator=g).to(dtype)
    slots = torch.randint(0, m, (s,), generator=g)
    offs = torch.randint(0, 65536, (s,), generator=g)
    offs[:1] = 0
    inv = rope_inv_freq(d, 500000.0)
    k1, v1 = k.view(m, 1, h, d), v.view(m, 1, h, d)
    want_k, want_v = gather_rotate(k1, v1, slots, offs, inv)
    got_k, got_v = gather_rotate(k1, v1, slots, offs, inv, backend="triton")
    assert got_k.shape == (s, h, d) and got_k.dtype == dtype and torch.equal(got_v, want_v)
    assert torch.equal(want_v, v[slots])
    if s:
        assert rel_err(got_k, want_k) <= TOL[dtype]
        assert torch.equal(got_k[0], k[int(slots[0])])  # offset 0 leaves the key bit for bit as it is
        torch.testing.assert_close(want_k, apply_rope(k[slots], offs, inv))
