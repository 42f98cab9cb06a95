"""Helpers shared by the KV store tests."""

from __future__ import annotations

import torch

MiB = 1 << 20


def make_layers(n_layers=4, tokens=64, heads=2, dim=32, dtype=torch.bfloat16, seed=0):
    """Random normal (k, v) pairs, [tokens, heads, dim] each."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, heads, dim, generator=g).to(dtype), torch.randn(tokens, heads, dim, generator=g).to(dtype))
            for _ in range(n_layers)]


def chunk_nbytes(layers) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_same_layers(got, layers, start: int = 0) -> None:
    """``got`` ((layer, k, v) triples, as a read yields them) is layers [start, start + len(got)) of ``layers`` ((k, v)
    pairs), in order, byte for byte (wherever their tensors lie)."""
    assert [i for i, _, _ in got] == list(range(start, start + len(got)))
    for i, k, v in got:
        assert same_bytes(k.cpu(), layers[i][0]) and same_bytes(v.cpu(), layers[i][1]), f"layer {i} differs"


def assert_roundtrip(client, chunk_id, layers, layer_range=None):
    """get() returns exactly ``layers`` (or the given range), byte for byte, in order."""
    start, stop = layer_range or (0, len(layers))
    got = list(client.get(chunk_id, layers=layer_range))
    assert len(got) == stop - start
    assert_same_layers(got, layers, start)


def tiers_of(client, chunk_id) -> tuple[str, ...]:
    return client.lookup([chunk_id])[0].tiers


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``offset`` of the file at ``path`` with ``mask``, in place (a store's tier damaged under it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))

