"""Prefill-to-decode hand-off: private KV and chunk ids only.

A decode worker rebuilds the request's view from a ``Handoff``: shared chunks come from its own
chunk cache, the KV store, or (last resort) are recomputed from the tokens carried here; only the
private KV (suffix, tokens recomputed by the blend step, and everything in modes that do not share
by content id) crosses the wire. Per layer, ``hidden`` lists the chunk tokens whose shared twins
are masked because a private, recomputed copy replaces them.

A hand-off is made by ``export.py`` (on the prefill worker) and rebuilt by ``imports.py`` (``import_sequence``, on
the decode worker); this module is the format between them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch



@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A shared chunk in a request: content id, global start, and its tokens (for recompute)."""

    chunk_id: str
    start: int
    tokens: tuple[int, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True, slots=True)
class LayerView:
    """What one layer sees besides the shared chunks.

    hidden int64 [H]: global positions of chunk tokens masked at this layer;
    positions int64 [P]: global positions of the private tokens visible at this layer;
    k, v [P, Hkv, D]: their KV (keys rotated at their global positions).
    """

    hidden: torch.Tensor
    positions: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True, slots=True)
class Handoff:
    model_fingerprint: str
    chunks: tuple[ChunkRef, ...]
    layers: tuple[LayerView, ...]
    next_pos: int
    logits: torch.Tensor  # [vocab] fp32, to sample the first token
    # every layer's K then V flat, when the layers' k/v are views of it in that order (kv_buffer() is it)
    kv: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # CUDA event recorded on the exporting thread's stream once the K/V gathers are queued: another thread
    # that reads ``kv`` orders its own stream after it, not after whatever that stream queued since (the
    # next request's pass)
    ready: torch.cuda.Event | None = field(default=None, repr=False, compare=False)
    # per layer, a sample of the prefill pass's queries [M, Hq, D] fp16 on the host (rotated at their global
    # positions), when the decode policy builds on them (retrieval); empty otherwise
    queries: tuple[torch.Tensor, ...] = field(default=(), repr=False, compare=False)

    @property
    def private_bytes(self) -> int:
        return sum(lv.k.numel() * lv.k.element_size() * 2 for lv in self.layers)

    def kv_buffer(self) -> torch.Tensor:
        """Every layer's private K then V, flat in one tensor on their device (one allocation to share)."""
        if self.kv is not None:
            return self.kv
        parts = [t.reshape(-1) for lv in self.layers for t in (lv.k, lv.v)]
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def to_bytes(self, with_kv: bool = True) -> bytes:
        """safetensors bytes: tensors plus a JSON header of the chunk refs. ``with_kv=False`` leaves the
        private K/V out (they travel apart, as ``kv_buffer()``; ``from_bytes`` takes them back).

        Every layer's hidden positions travel as one tensor, their positions as another and the K/V as one (with
        each layer's lengths in the header), not as tensors a layer: each torch call gives up the interpreter lock,
        which the worker's engine thread waits for (bench/handoff/README.md), and 32 layers made 64-128 of them."""
        from safetensors.torch import save

        tensors = {"logits": self.logits.detach().float().cpu().contiguous()}
        meta = {"fingerprint": self.model_fingerprint, "next_pos": str(self.next_pos),
                "layers": str(len(self.layers)),
                "chunks": json.dumps([[c.chunk_id, c.start, list(c.tokens)] for c in self.chunks])}
        if self.layers:
            for name in ("hidden", "positions"):
                parts = [getattr(lv, name) for lv in self.layers]
                tensors[name] = torch.cat(parts).to("cpu", torch.int64).contiguous()
                meta[name] = json.dumps([t.numel() for t in parts])
            if with_kv:
                tensors["kv"] = self.kv_buffer().detach().cpu().contiguous()
            k = self.layers[0].k
            meta["kv"] = json.dumps([list(k.shape[1:]), str(k.dtype).removeprefix("torch.")])
        for i, q in enumerate(self.queries):
            tensors[f"{i}.queries"] = q.detach().cpu().contiguous()
        return save(tensors, metadata=meta)

    @staticmethod
    def from_bytes(data: bytes, kv_buffer: torch.Tensor | None = None) -> "Handoff":
        """The inverse of ``to_bytes``; ``kv_buffer``: the K/V a ``with_kv=False`` payload left out. Reads the
        per-layer tensors of payloads made before the layers were packed too."""
        from safetensors.torch import load

        tensors = load(data)
        # the metadata travels in the safetensors header: u64 length, then JSON
        n = int.from_bytes(data[:8], "little")
        meta = json.loads(data[8:8 + n]).get("__metadata__", {})
        if "fingerprint" not in meta:
            raise ValueError("not a Tessera hand-off: its header carries no model fingerprint")
        n_layers = int(meta["layers"])
        if "hidden" in tensors:
            for name in ("hidden", "positions"):
                tensors.update((f"{i}.{name}", t) for i, t in enumerate(_split_packed(tensors.pop(name), meta, name,
                                                                                      n_layers)))
        if kv_buffer is None:
            kv_buffer = tensors.pop("kv", None)
        if kv_buffer is not None:
            tensors.update(_split_kv(kv_buffer, meta, [tensors[f"{i}.positions"].numel() for i in range(n_layers)]))
        missing = [i for i in range(n_layers) if f"{i}.k" not in tensors]
        if missing:
            raise ValueError(f"hand-off carries no K/V for layer {missing[0]} (and no separate buffer was given)")
        layers = tuple(LayerView(tensors[f"{i}.hidden"], tensors[f"{i}.positions"], tensors[f"{i}.k"], tensors[f"{i}.v"])
                       for i in range(n_layers))
        chunks = tuple(ChunkRef(c[0], int(c[1]), tuple(c[2])) for c in json.loads(meta["chunks"]))
        queries = tuple(tensors[f"{i}.queries"] for i in range(n_layers)) if "0.queries" in tensors else ()
        return Handoff(meta["fingerprint"], chunks, layers, int(meta["next_pos"]), tensors["logits"], kv=kv_buffer,
                       queries=queries)


def _split_packed(flat: torch.Tensor, meta: dict, name: str, n_layers: int) -> tuple[torch.Tensor, ...]:
    """A packed tensor (every layer's ``name`` one after another) cut back into the layers' by the header's lengths;
    ValueError if they do not fit."""
    counts = json.loads(meta.get(name, "null"))
    if (not isinstance(counts, list) or len(counts) != n_layers
            or not all(isinstance(c, int) and c >= 0 for c in counts)):
        raise ValueError(f"hand-off header's {name} lengths are not {n_layers} counts: {meta.get(name)!r}")
    if flat.dim() != 1 or flat.numel() != sum(counts):
        raise ValueError(f"hand-off {name} holds {flat.numel()} values, its layers' lengths sum to {sum(counts)}")
    return flat.split(counts)


def _split_kv(buf: torch.Tensor, meta: dict, counts: list[int]) -> dict[str, torch.Tensor]:
    """Cut a ``kv_buffer()`` back into per-layer K and V [P, Hkv, D]; ValueError if it does not fit."""
    (hkv, dim), dtype = json.loads(meta["kv"])
    if str(buf.dtype).removeprefix("torch.") != dtype:
        raise ValueError(f"hand-off K/V buffer is {buf.dtype}, its header says {dtype}")
    want = 2 * sum(counts) * hkv * dim
    if buf.numel() != want:
        raise ValueError(f"hand-off K/V buffer holds {buf.numel()} values, its layers need {want}")
    views = layer_views(buf, counts, torch.Size((hkv, dim)))    # a few calls a run of layers, not two a tensor
    return {f"{i}.{name}": views[2 * i + j] for i in range(len(counts)) for j, name in enumerate(("k", "v"))}


def layer_views(flat: torch.Tensor, counts: list[int], shape) -> list[torch.Tensor]:
    """K then V views [P, *shape] of each layer (P = counts[layer]) laid one after another in ``flat``;
    a few ops per run of layers with one P, not a few per layer."""
    runs = []  # (P, layers)
    for p in counts:
        if runs and runs[-1][0] == p:
            runs[-1][1] += 1
        else:
            runs.append([p, 1])
    out = []
    for (p, n), seg in zip(runs, flat.split([2 * p * n * shape.numel() for p, n in runs])):
        out += seg.view(2 * n, p, *shape).unbind(0)
    return out
