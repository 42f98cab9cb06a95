"""bfloat16 storage of offloaded keys and values (services/index/half.py, ``IndexSet(host_dtype="bfloat16")``): the
rounding is torch's (to nearest, ties to even) and widening is exact; an index holding bfloat16 keys answers, id for
id and bit for bit, what a float32 index over the same (rounded) keys answers, on every search path (one query, a
group, a scan, the exact path, the compiled layer call and the thread pool); it round-trips its bytes as bfloat16 and
a blob whose key dtype code is unknown, or whose bfloat16 keys are not finite, is refused; the set holds half the
bytes; and a bad dtype is refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.index import _layer, half
from services.index import format as fmt
from services.index.graph import AttentionIndex
from services.index.heads import IndexSet


def _normal(seed: int, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 1e30])
def test_rounding_is_torchs_and_widening_is_exact(scale):
    x = _normal(1, (257, 33), scale)
    x[0, :4] = [0.0, -0.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8]          # exact ties round to even: 1.0 and 1.0 + 2^-6
    bits = half.to_bf16(x)
    want = torch.from_numpy(x).to(torch.bfloat16)
    np.testing.assert_array_equal(bits, want.view(torch.int16).numpy().view(np.uint16))
    np.testing.assert_array_equal(half.widen(bits), want.float().numpy())
    assert half.widen(bits)[0, 2] == 1.0 and half.widen(bits)[0, 3] == 1.0 + 2 ** -6
    np.testing.assert_array_equal(half.to_bf16(half.widen(bits)), bits)    # what is held rounds to itself
    assert half.finite(bits)
    assert not half.finite(half.to_bf16(np.array([np.inf], np.float32)))
    assert not half.finite(np.array([0x7FC0], np.uint16))                   # a NaN's bits


def test_a_bfloat16_index_answers_as_a_float32_one_over_the_rounded_keys():
    keys, train, values = _normal(2, (1500, 40)), _normal(3, (300, 40)), _normal(4, (1500, 40))
    held = AttentionIndex.build(keys, train, key_dtype="bfloat16")
    peer = AttentionIndex.build(half.widen(half.to_bf16(keys)), train)
    assert held.key_dtype == "bfloat16" and held.keys.dtype == np.uint16 and peer.key_dtype == "float32"
    assert held.nbytes == peer.nbytes - keys.nbytes // 2
    vbits = half.to_bf16(values)
    q, groups = _normal(5, (12, 40)), _normal(6, (5, 4, 40))
    for k, beam in ((10, None), (30, 200), (2000, None)):        # the last: every key, the exact path
        np.testing.assert_array_equal(held.search(q, k, beam=beam)[0], peer.search(q, k, beam=beam)[0])
        for got, want in zip(held.attend(q, vbits, k, 0.2, beam=beam), peer.attend(q, half.widen(vbits), k, 0.2,
                                                                                      beam=beam)):
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(held.search_group(groups, k, beam=beam)[0],
                                      peer.search_group(groups, k, beam=beam)[0])
    for scan in (False, True):
        for got, want in zip(held.attend_group(groups, vbits, 10, 0.2, scan=scan),
                             peer.attend_group(groups, half.widen(vbits), 10, 0.2, scan=scan)):
            np.testing.assert_array_equal(got, want)
    # given its own bits, a build holds them as they are
    again = AttentionIndex.build(held.keys, train, key_dtype="bfloat16")
    np.testing.assert_array_equal(again.keys, held.keys)
    np.testing.assert_array_equal(again.graph.targets, held.graph.targets)


def test_a_bfloat16_index_round_trips_its_bytes_and_damaged_ones_are_refused():
    keys, train = _normal(7, (300, 16)), _normal(8, (60, 16))
    held = AttentionIndex.build(keys, train, key_dtype="bfloat16")
    blob = held.to_bytes()
    back = AttentionIndex.from_bytes(blob)
    assert back.key_dtype == "bfloat16"
    np.testing.assert_array_equal(back.keys, held.keys)
    assert len(blob) == len(AttentionIndex.build(half.widen(held.keys), train).to_bytes()) - keys.nbytes // 2
    fields = list(fmt._HEADER.unpack_from(blob))
    payload = blob[fmt._HEADER.size + fmt.DIGEST_BYTES:]
    for code in (2, 0):    # unknown; float32 named over bfloat16 bytes (the sizes no longer add up)
        fields[2] = code
        header = fmt._HEADER.pack(*fields)
        with pytest.raises(fmt.IndexFormatError, match="key dtype code|header describes"):
            AttentionIndex.from_bytes(fmt.sealed(header, [payload]))
    bad = held.keys.copy()
    bad[3, 3] = 0x7F80                                                        # +inf
    parts = fmt.IndexParts(bad, held.graph.offsets, held.graph.targets, held.graph.entries, held.config.as_dict())
    with pytest.raises(fmt.IndexFormatError, match="non-finite"):
        AttentionIndex.from_bytes(fmt.encode(parts))


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "pool"])
def test_an_index_set_holding_bfloat16_answers_as_float32_over_the_rounded_kv(compiled):
    if compiled:
        _layer.warm("bfloat16")
        assert _layer.ready("bfloat16")
    hkv, hq, d = 2, 8, 24
    keys, values, train = _normal(9, (hkv, 700, d)), _normal(10, (hkv, 700, d)), _normal(11, (hkv, 300, d))
    held = IndexSet(threads=4, compiled=compiled, host_dtype="bfloat16")
    peer = IndexSet(threads=4, compiled=compiled)
    try:
        held.add("a", 0, keys, values, train)
        held.add("b", 0, half.to_bf16(keys[:, :500]), half.to_bf16(values[:, :500]), train)    # bits given: as they are
        for ix in (peer,):
            ix.add("a", 0, half.widen(half.to_bf16(keys)), half.widen(half.to_bf16(values)), train)
            ix.add("b", 0, half.widen(half.to_bf16(keys[:, :500])), half.widen(half.to_bf16(values[:, :500])), train)
        for rows in (["a"], ["a", "b"]):
            q = _normal(12 + len(rows), (len(rows), hq, d))
            got, want = held.attend(0, rows, q, 20, 0.25), peer.attend(0, rows, q, 20, 0.25)
            np.testing.assert_array_equal(got.out, want.out)
            np.testing.assert_array_equal(got.lse, want.lse)
            np.testing.assert_array_equal(got.scanned, want.scanned)
        assert held.calls_by_path()["compiled" if compiled else "pool"] == 2
        assert held.held()[1] * 2 == peer.held()[1]                   # K/V bytes: half
    finally:
        held.close()
        peer.close()


def test_a_bad_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="host_dtype must be one of float32, bfloat16, got 'float16'"):
        IndexSet(host_dtype="float16")
    with pytest.raises(ValueError, match="key_dtype must be one of"):
        AttentionIndex.build(_normal(1, (20, 4)), _normal(2, (5, 4)), key_dtype="int8")
    with pytest.raises(ValueError, match="values must be float32 or bfloat16 bits"):
        AttentionIndex.build(_normal(1, (20, 4)), _normal(2, (5, 4))).attend(_normal(3, (1, 4)),
                                                                             np.zeros((20, 4), np.float16), 3, 1.0)
