"""The attention call of CacheBlend's recompute layers, taken from a real `tessera@0.15` pass (issue #2).

At ratio 0.15 the layers after the check layer run ~525 rows (the recomputed chunk tokens, in position order,
then the suffix) against a table of [recomputed tokens' private entries | every chunk's shared entries, their
recomputed slots hidden | the suffix's entries], one call per layer. bench/engine/README.md's profiles have that call at
~175 us a layer. This builds bench/engine/engine.py's engine (Llama-3-8B shape, random weights, bf16, 6 x 512 + 64),
runs one `tessera@0.15` pass with the engine's static-tail attention wrapped to keep its arguments, and then times
that very call (one layer's K/V, replayed as a CUDA graph) under other PrefillConfigs, each checked against the
engine's own output first:

  engine       the configuration the engine picked (prefill_config of the call's row count)
  nocut        the same without cut_future
  splitsN      N KV splits
  bm128        128-row tiles, 8 warps (bm32: 32-row tiles)
  stages3, nb128   the PrefillConfig knobs of those names (idx32, timed at 162 us, was removed with the knob)

Outcome (H100, 2026-11-22, bench/recompute_attention/2026-11-22_h100_e46e7ff.json / _ab146ad.json): 525 rows, 225 entries in 7 offset groups, a
tile walks at most 57 steps with the cut or without it (1,350 against 1,881 in all); the engine's configuration
170-172 us, without the cut 157-162 (this call has no padding tile), 2 / 4 / 8 splits 184 / 200 / 228, bm128 208,
bm32 284, stages3 181, idx32 162, nb128 187 us. Two kernel variants built for this call and removed after it (commits
5ac72a1 and ab146ad): slot positions read beside the keys every step, 182 us (154 without the cut); every
step masked without the branch on its key bound, 181-218 us. The call's time is not in the steps the cut drops:
its longest tiles set it.

It also reports the table's shape (entries, offset groups, hidden slots) and, per query tile, the steps the
kernel walks with and without the cut (from the key floors on the host).

    python3 bench/recompute_attention/recompute_attention.py [--out DIR/recompute_attention.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine_host"))  # host_ops

from host_ops import bench_request, build_engine  # noqa: E402


def main() -> int:
    from kernels.paged_attention import _prefill
    from kernels.paged_attention import triton as kt

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    eng = build_engine(argparse.Namespace(device="cuda", layers=32, hidden=None), "triton")
    chunks, suffix = bench_request(128000)
    eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15)  # the chunks cached
    got = {}
    paged = kt.paged_prefill_packed

    def keep(q, q_pos, k, v, slot_pos, packed, cu_q, inv, scale, **kw):  # the eager path's call
        if "q" not in got and q.shape[0] > 128:
            got.update(q=q.clone(), q_pos=q_pos.clone(), k=k, v=v, slot_pos=slot_pos.clone(), packed=packed,
                       cu_q=cu_q, inv=inv, scale=scale)
        return paged(q, q_pos, k, v, slot_pos, packed, cu_q, inv, scale, **kw)

    kt.paged_prefill_packed = keep
    static = eng.forward.static_tail
    eng.forward.static_tail = lambda n: False  # eager: the call's own tensors, not a graph's
    try:
        eng.prefill(chunks, suffix, mode="tessera", recompute_ratio=0.15)
    finally:
        kt.paged_prefill_packed = paged
        eng.forward.static_tail = static
    torch.cuda.synchronize()
    q, packed = got["q"], got["packed"]
    n_e = packed.meta.numel()
    masks = packed.masks.long() if not packed.mask_in_word else packed.meta.long() & 0xFFFF
    bs = got["slot_pos"].shape[1]
    shown = sum(bin(int(m) & ((1 << bs) - 1)).count("1") for m in masks.tolist())
    starts = packed.group_starts.tolist()
    n_groups = next(i for i, s in enumerate(starts) if s >= n_e)
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": q.shape[0], "entries": n_e,
           "groups": n_groups, "group_starts": starts[:n_groups + 1], "visible_keys": shown,
           "hidden_slots": n_e * bs - shown, "variants": {}}
    print(f"{q.shape[0]} query rows, {n_e} entries in {n_groups} offset groups {starts[:n_groups + 1]}, "
          f"{shown} visible keys", flush=True)
    # per query tile, the steps walked with and without the cut (host arithmetic over the floors)
    hi, floors = kt.prefill_key_bounds(packed, got["slot_pos"], floors=True)
    fl, pos = floors.tolist(), got["q_pos"].tolist()
    base = kt.prefill_config(q.shape[0])
    block_t = base.block_m // 4
    nb = base.min_block_n // bs
    walked = {"cut": [], "all": []}
    for t0 in range(0, len(pos), block_t):
        q_max = max(pos[t0:t0 + block_t])
        steps_cut = steps_all = 0
        for gi in range(n_groups):
            a, b = starts[gi], starts[gi + 1]
            n = sum(1 for e in range(a, b) if fl[e] <= q_max)
            steps_cut += -(-n // nb)
            steps_all += -(-(b - a) // nb)
        walked["cut"].append(steps_cut)
        walked["all"].append(steps_all)
    rec["steps_per_tile"] = walked
    print(f"steps a tile walks: with the cut {sum(walked['cut'])} in all (max {max(walked['cut'])}), "
          f"without {sum(walked['all'])} (max {max(walked['all'])}), over {len(walked['all'])} tiles", flush=True)

    def run(cfg):
        return _prefill.launch(q, got["q_pos"], got["k"], got["v"], got["slot_pos"], packed, got["cu_q"], got["inv"],
                               got["scale"], cfg=cfg)[0]

    want = run(base)
    cfgs = {"engine": base, "nocut": dataclasses.replace(base, cut_future=False)}
    for s in (1, 2, 4, 8):
        cfgs[f"splits{s}"] = dataclasses.replace(base, num_splits=s)
        cfgs[f"splits{s}-nocut"] = dataclasses.replace(base, num_splits=s, cut_future=False)
    cfgs["bm128"] = dataclasses.replace(base, block_m=128, num_warps=8)
    cfgs["stages3"] = dataclasses.replace(base, num_stages=3)
    cfgs["nb128"] = dataclasses.replace(base, min_block_n=128)
    cfgs["bm32"] = dataclasses.replace(base, block_m=32)
    for name, cfg in cfgs.items():
        try:
            out = run(cfg)
            err = float((out.float() - want.float()).abs().max())
            us = triton.testing.do_bench_cudagraph(lambda cfg=cfg: run(cfg), rep=100, return_mode="median") * 1e3
        except Exception as exc:  # report and go on
            rec["variants"][name] = {"error": repr(exc)[:300]}
            print(f"{name}: FAILED {exc!r}"[:300], flush=True)
            continue
        rec["variants"][name] = {"us": us, "max_abs_diff_vs_engine": err, "config": dataclasses.asdict(cfg)}
        print(f"{name:14s} {us:8.1f} us  max |diff| vs engine {err:.3g}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
