"""The layer views a decode worker's helper threads make for each hand-off and each chunk they stage, two ways: a few
torch calls a group of layers (what the code does) against three calls a tensor (the per-layer slicing it replaced,
kept here as the peer). Each torch call gives up the interpreter lock, which the worker's engine thread then may wait
for (bench/handoff/lock_wait.py), so the calls are counted beside the time.

- an arena read of an 8B-shaped chunk (32 layers of K, V [512, 8, 128] bf16) in ``_groups``' groups (8, 8, 8, 4, 2,
  2), by ``client._group_views``;
- a hand-off's K/V buffer (32 layers of 3,136 private tokens), cut by ``wire._split_kv``;
- and, one way only (as the tree has it), a whole hand-off parsed (``Handoff.from_bytes``: what else a decode
  worker's helper spends its calls on) and made (``Handoff.to_bytes``, on a prefill worker's hand-off thread).

    .venv/bin/python bench/handoff/helper_views.py --json F
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import timeit
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.handoff import wire  # noqa: E402
from services.kvstore import client  # noqa: E402
from services.kvstore.chunk import ChunkMeta  # noqa: E402

LAYERS, TOKENS, HKV, DIM, PRIVATE = 32, 512, 8, 128, 3136


class Calls(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def arena_read() -> tuple:
    shape = (TOKENS, HKV, DIM)
    n = 2 * TOKENS * HKV * DIM * 2
    meta = ChunkMeta("c" * 64, "m", "bfloat16", (shape,) * LAYERS, (shape,) * LAYERS)
    groups = client._groups([(i, i * n, n) for i in range(LAYERS)])
    data = [torch.zeros(len(g) * n, dtype=torch.uint8) for g in groups]

    def grouped():
        return [client._group_views(d, g, meta, torch.bfloat16) for d, g in zip(data, groups)]

    def per_layer():
        out = []
        for d, g in zip(data, groups):
            lo = g[0][1]
            out.append([(i, d[o - lo:o - lo + n // 2].view(torch.bfloat16).reshape(shape),
                         d[o - lo + n // 2:o - lo + n].view(torch.bfloat16).reshape(shape)) for i, o, _ in g])
        return out

    return grouped, per_layer


def handoff_buffer() -> tuple:
    counts = [PRIVATE] * LAYERS
    meta = {"kv": json.dumps([[HKV, DIM], "bfloat16"])}
    buf = torch.zeros(2 * sum(counts) * HKV * DIM, dtype=torch.bfloat16)

    def grouped():
        return wire._split_kv(buf, meta, counts)

    def per_layer():
        out, at = {}, 0
        for i, p in enumerate(counts):
            for name in ("k", "v"):
                out[f"{i}.{name}"] = buf[at:at + p * HKV * DIM].view(p, HKV, DIM)
                at += p * HKV * DIM
        return out

    return grouped, per_layer


def parsed_handoff() -> tuple:
    """A hand-off as a decode worker's helper parses it (``Handoff.from_bytes`` of a payload without its K/V, the K/V
    buffer given apart, as CUDA IPC delivers it): 32 layers of 525 private tokens (a 64-token suffix and 15% of 3,072
    chunk tokens recomputed), 461 hidden chunk positions each, the logits of a 128,256-token vocabulary."""
    from services.handoff.wire import ChunkRef, Handoff, LayerView

    private, hidden = 525, 461
    kv = torch.zeros(2 * LAYERS * private * HKV * DIM, dtype=torch.bfloat16)
    views = wire.layer_views(kv, [private] * LAYERS, torch.Size((HKV, DIM)))
    layers = tuple(LayerView(torch.arange(hidden), torch.arange(private), views[2 * i], views[2 * i + 1])
                   for i in range(LAYERS))
    chunks = tuple(ChunkRef(f"{i:064x}", i * TOKENS, tuple(range(TOKENS))) for i in range(6))
    payload = Handoff("m", chunks, layers, 6 * TOKENS + 64, torch.zeros(128256), kv=kv).to_bytes(with_kv=False)

    def parse():
        return Handoff.from_bytes(payload, kv)

    def serialize():
        return Handoff("m", chunks, layers, 6 * TOKENS + 64, torch.zeros(128256), kv=kv).to_bytes(with_kv=False)

    return parse, serialize


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--number", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for what, make in (("arena read, 32 layers in 6 groups", arena_read), ("hand-off K/V buffer, 32 layers",
                                                                            handoff_buffer)):
        grouped, per_layer = make()
        row = {"what": what}
        for name, f in (("per_layer", per_layer), ("grouped", grouped)):
            counter = Calls()
            with counter:
                f()
            times = timeit.repeat(f, number=args.number, repeat=args.repeat)
            row[name] = {"torch_calls": counter.n, "us_min": min(times) / args.number * 1e6,
                         "us_median": sorted(times)[len(times) // 2] / args.number * 1e6}
        rows.append(row)
        print(f"{what}: per layer {row['per_layer']['torch_calls']} torch calls, {row['per_layer']['us_min']:.1f} us; "
              f"grouped {row['grouped']['torch_calls']} calls, {row['grouped']['us_min']:.1f} us "
              f"({row['per_layer']['us_min'] / row['grouped']['us_min']:.2f}x)", flush=True)
    # one way only, as the tree has it: what a decode worker's helper spends parsing each hand-off, and a prefill
    # worker's hand-off thread making it (run the script in another tree to compare)
    parse, serialize = parsed_handoff()
    for what, f in (("a hand-off parsed, 32 layers (Handoff.from_bytes, K/V apart)", parse),
                    ("a hand-off serialized, 32 layers (Handoff.to_bytes, K/V apart)", serialize)):
        counter = Calls()
        with counter:
            f()
        times = timeit.repeat(f, number=max(1, args.number // 10), repeat=args.repeat)
        row = {"what": what, "as_is": {"torch_calls": counter.n, "us_min": min(times) / max(1, args.number // 10) * 1e6}}
        rows.append(row)
        print(f"{row['what']}: {counter.n} torch calls, {row['as_is']['us_min']:.1f} us", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "command": "bench/handoff/helper_views.py " + " ".join(sys.argv[1:]),
                                               "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
