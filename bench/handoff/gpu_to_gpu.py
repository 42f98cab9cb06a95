"""A hand-off's K/V from a prefill worker's GPU to a decode worker on another GPU of the host (CUDA IPC, copied GPU to
GPU), against the ceilings measured in the same run.

The parent is the prefill worker: per repetition it concatenates a fresh buffer of the hand-off's size on its GPU and
shares it (``cuda_ipc.share``); a spawned child started as the launcher starts a decode worker of the second GPU (that
GPU first in its CUDA_VISIBLE_DEVICES) opens it and copies it onto its own GPU (``cuda_ipc.copy_out``), timing the
call from the wire message to the bytes landed. Peers in the same run, one process: the same copy between the two
GPUs without IPC (the link's ceiling), the copy on one GPU (what a hand-off between workers sharing a GPU costs), and
the path the gRPC stream's bytes take at best, device to pinned host memory and back onto the other GPU.

    python3 bench/handoff/gpu_to_gpu.py --mib 69,256 --reps 20 --json bench/handoff/DATE_DEVICE_COMMIT_gpu_to_gpu.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _child(conn) -> None:
    """The decode worker's side: each message is copied out onto this process's GPU; its seconds go back."""
    import torch

    from services.handoff.cuda_ipc import copy_out
    from services.rpc import tessera_pb2 as pb

    dev = torch.device("cuda", 0)
    torch.ones(1, device=dev)
    while (wire := conn.recv()) is not None:
        t0 = time.perf_counter()
        got = copy_out(pb.CudaIpcBuffer.FromString(wire), dev)
        seconds = time.perf_counter() - t0
        conn.send((seconds, float(got[:4096].float().sum()), str(got.device)))
        del got


def _timed(fn, reps: int) -> list[float]:
    import torch

    out = []
    for _ in range(reps):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", default="69,256", help="hand-off sizes, MiB (69: a tessera@0.15 hand-off of the 8B shape)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from services.handoff.cuda_ipc import gpu_order, share
    from services.launch.local import child_gpus, visible_gpus

    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two GPUs")
    visible = visible_gpus()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child, args=(child,), daemon=True)
    with child_gpus(gpu_order(visible[1], visible)):      # a decode worker of the second GPU, as the launcher starts one
        proc.start()
    a, b = torch.device("cuda", 0), torch.device("cuda", 1)
    rows = []
    for mib in (int(x) for x in args.mib.split(",")):
        n = mib * (1 << 20) // 2
        src = torch.randn(n, device=a, dtype=torch.bfloat16)
        ipc, sums = [], set()
        for i in range(args.reps + 2):
            buf = src + 0 if i else src.clone()       # a fresh buffer a hand-off, as kv_buffer() makes one
            torch.cuda.synchronize(a)
            parent.send(share(buf).SerializeToString())
            seconds, s, where = parent.recv()
            if i >= 2:                                # the first two open the peer GPU's context and P2P access
                ipc.append(seconds)
            sums.add(s)
            del buf
        want = float(src[:4096].float().sum())
        ok = sums == {want} and where.endswith(":0")
        on_b = torch.empty_like(src, device=b)
        on_a = torch.empty_like(src)
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        peer = _timed(lambda: on_b.copy_(src), args.reps)
        same = _timed(lambda: on_a.copy_(src), args.reps)
        host = _timed(lambda: (pinned.copy_(src), on_b.copy_(pinned)), args.reps)
        nbytes = n * 2

        def gbs(xs):
            return nbytes / statistics.median(xs) / 1e9

        row = {"mib": mib, "bytes": nbytes, "landed_equal": ok,
               "ipc_gpu_to_gpu_ms_p50": statistics.median(ipc) * 1e3, "ipc_gpu_to_gpu_ms_max": max(ipc) * 1e3,
               "ipc_gpu_to_gpu_gbs": gbs(ipc), "peer_copy_gbs": gbs(peer), "same_gpu_copy_gbs": gbs(same),
               "through_pinned_host_gbs": gbs(host)}
        rows.append(row)
        print(f"{mib} MiB: IPC GPU to GPU {row['ipc_gpu_to_gpu_ms_p50']:.2f} ms p50 = {row['ipc_gpu_to_gpu_gbs']:.1f} "
              f"GB/s (landed equal: {ok}); in-process GPU to GPU {row['peer_copy_gbs']:.1f} GB/s, on one GPU "
              f"{row['same_gpu_copy_gbs']:.1f}, through pinned host {row['through_pinned_host_gbs']:.1f}", flush=True)
        del src, on_a, on_b, pinned
    parent.send(None)
    proc.join(30)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", "torch": torch.__version__,
              "commit": os.environ.get("TESSERA_COMMIT", ""), "reps": args.reps, "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if all(r["landed_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
