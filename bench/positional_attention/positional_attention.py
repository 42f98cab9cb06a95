"""The blend tail's attention call alone (issue #2): kernels/positional_attention on the engine's shape, under
several tile configurations, K and V by pointer loads or tensor descriptors (TMA), against its twin (SDPA with an additive mask) and, for the keys, the per-layer
gather (kernels.rope.gather_rotate over one-slot blocks).

Shape of `tessera@0.15` on bench/engine/engine.py's request: 461 recomputed chunk tokens at scattered sorted positions in
[0, 3072) then 64 suffix tokens (3072..3135), padded to 528 rows (padding at position -1); 3,200 keys (one per
position, 3,136 real); 32 query heads over 8 key heads, head_dim 128, bf16. Each variant is checked against the
twin, then timed warm as a CUDA graph (triton.testing.do_bench_cudagraph, median).

    python3 bench/positional_attention/positional_attention.py [--out DIR/positional_attention.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kernels.positional_attention import positional_attention  # noqa: E402
from kernels.positional_attention import triton as pa  # noqa: E402
from kernels.rope import gather_rotate, rope_inv_freq  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    n_chunk, n_s, n_keys, t = 3072, 64, 3200, 528
    sel = torch.randperm(n_chunk, generator=g)[:461].sort().values
    pos = torch.full((t,), -1, dtype=torch.int64)
    pos[:461] = sel
    pos[464:464 + n_s] = torch.arange(n_chunk, n_chunk + n_s)
    pos = pos.to(dev)
    q = torch.randn(t, 32, 128, generator=g).to(dev, dt)
    k = torch.randn(n_keys, 8, 128, generator=g).to(dev, dt)
    v = torch.randn(n_keys, 8, 128, generator=g).to(dev, dt)
    cache_k = torch.randn(40000, 8, 128, generator=g).to(dev, dt)
    cache_v = torch.randn(40000, 8, 128, generator=g).to(dev, dt)
    slots = torch.randperm(40000, generator=g)[:n_keys].to(dev)
    rots = torch.randint(0, 3000, (n_keys,), generator=g).to(dev)
    inv = rope_inv_freq(128, 500000.0).to(dev)
    scale = 128 ** -0.5
    want = positional_attention(q, pos, k, v, scale)
    rec = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": t, "keys": n_keys, "variants": {}}

    def bench(name, fn, check=None):
        try:
            if check is not None:
                err = float((check().float() - want.float()).abs().max())
            else:
                err = None
            us = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
        except Exception as exc:  # report and go on
            rec["variants"][name] = {"error": repr(exc)[:300]}
            print(f"{name}: FAILED {exc!r}"[:300], flush=True)
            return
        rec["variants"][name] = {"us": us, "max_abs_diff_vs_twin": err}
        print(f"{name:28s} {us:8.1f} us" + (f"  max |diff| vs twin {err:.3g}" if err is not None else ""), flush=True)

    bench("twin (SDPA, mask)", lambda: positional_attention(q, pos, k, v, scale))
    cfgs = [pa.config(t, 4), (64, 128, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 2), (128, 128, 8, 2),
            (128, 64, 4, 2), (128, 64, 8, 3), (32, 64, 4, 2), (64, 32, 4, 2)]
    cfgs += [(128, 128, 8, 3), (64, 128, 4, 3), (128, 64, 8, 4)]
    for tma in (False, True):  # K and V by pointer loads, then through tensor descriptors
        for cfg in cfgs:
            name = "triton M{} N{} w{} s{}".format(*cfg) + (" tma" if tma else "") + \
                (" (default)" if cfg == pa.config(t, 4) and tma == pa.TMA else "")
            bench(name, lambda cfg=cfg, tma=tma: pa.positional_attention(q, pos, k, v, scale, cfg=cfg, tma=tma),
                  check=lambda cfg=cfg, tma=tma: pa.positional_attention(q, pos, k, v, scale, cfg=cfg, tma=tma))
    cache_k, cache_v = cache_k.view(-1, 1, 8, 128), cache_v.view(-1, 1, 8, 128)  # one slot a block
    kf, vf = gather_rotate(cache_k, cache_v, slots, rots, inv, backend="triton")
    kr, vr = gather_rotate(cache_k, cache_v, slots, rots, inv)
    err = float((kf.float() - kr.float()).abs().max())
    bench("gather_rotate one-slot blocks triton", lambda: gather_rotate(cache_k, cache_v, slots, rots, inv, backend="triton"))
    bench("gather_rotate one-slot blocks twin", lambda: gather_rotate(cache_k, cache_v, slots, rots, inv))
    rec["gather_max_abs_diff"] = err
    print(f"gather max |diff| triton vs twin {err:.3g}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rec, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
