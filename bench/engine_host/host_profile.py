"""cProfile of the host side of real prefill passes on a GPU (issue #2): which Python functions a pass's host
time goes to, for bench/engine/engine.py's request on the Llama-3-8B shape with random weights (bench/engine_host/host_ops.py's
engine). The GPU runs as usual; each pass is synchronised before the next, as bench/engine/engine.py times them.
cProfile's own overhead inflates every figure: compare functions with each other, not with wall times.

    python3 bench/engine_host/host_profile.py [--mode tessera@0.15] [--passes 20] [--top 40] [--out DIR/host_profile.txt]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host_ops import bench_request, build_engine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="tessera@0.15")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    mode, ratio = args.mode.split("@")
    eng = build_engine(argparse.Namespace(device="cuda", layers=32, hidden=None), args.backend)
    chunks, suffix = bench_request(128000)

    def call():
        eng.prefill(chunks, suffix, mode=mode, recompute_ratio=float(ratio))
        torch.cuda.synchronize()

    for _ in range(5):
        call()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.passes):
        call()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    print(text.getvalue())
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(f"{args.passes} passes of {args.mode} ({args.backend}), {torch.cuda.get_device_name()}\n"
                                  + text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
