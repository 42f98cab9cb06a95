"""A hand-off's K/V from a prefill worker's GPU to a decode worker on another GPU of the host, three ways, against
the ceilings measured in the same run.

The parent is the prefill worker, a spawned child the decode worker of the second GPU (that GPU first in its
CUDA_VISIBLE_DEVICES, as the launcher starts one). Per repetition the parent makes a fresh buffer of the hand-off's
size on its GPU and hands it over:
- ``ipc``: shares the buffer itself (``cuda_ipc.share``); the child opens it on the sender's GPU and copies it onto
  its own (``cuda_ipc.copy_out``), timed from the wire message to the bytes landed;
- ``ipc slab`` (what a worker does now): copies it into a piece of its CUDA IPC slab (``share_from_slab``, timed on
  the parent) and the child copies the piece out of the slab it opened once (timed on the child); the row is the sum;
- ``ipc slab`` opens the slab on the receiver's own GPU, read peer to peer (``cuda_ipc.open_on``); ``ipc slab on
  sender`` on the sender's GPU, the copy queued on that GPU's stream, as a receiver did before;
- ``nixl``: copies it into a piece of its NIXL slab and offers it (``nixl.offer_from_slab``: the copy and the CRC-32
  on the GPU, timed on the parent); the child reads it with NIXL (UCX) into a piece of its own registered slab,
  checks the CRC-32 there and copies it out (``nixl.read_via_slab``, timed on the child); the row is the sum.
  Only where a NIXL package loads; the row says why not otherwise.
Peers in the same run, one process: the same copy between the two GPUs without IPC (the link's ceiling), the copy on
one GPU (what a hand-off between workers sharing a GPU costs), and the path the gRPC stream's bytes take at best,
device to pinned host memory and back onto the other GPU.

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
    """The decode worker's side: each message is landed on this process's GPU (how: its first item); its seconds go
    back with a sum of its first bytes (that they arrived whole)."""
    import torch

    from services.handoff.cuda_ipc import copy_out
    from services.rpc import tessera_pb2 as pb

    dev = torch.device("cuda", 0)
    torch.ones(1, device=dev)
    while (msg := conn.recv()) is not None:
        how, wire = msg[0], msg[1]
        try:
            t0 = time.perf_counter()
            if how == "nixl":
                from services.handoff import nixl

                got = nixl.read_via_slab(nixl.process_endpoint(), nixl.Offer.from_bytes(wire), torch.bfloat16,
                                         msg[2], dev, timeout=30.0)
            else:
                got = copy_out(pb.CudaIpcBuffer.FromString(wire), dev, on_sender=how == "ipc_on_sender")
            torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
            conn.send((seconds, float(got[:4096].float().sum()), str(got.device)))
            del got
        except Exception as exc:        # noqa: BLE001 - reported as the row's error, the other rows go on
            conn.send((None, repr(exc), ""))


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
    ap.add_argument("--ways", default="ipc,ipc_slab,ipc_slab_on_sender,nixl",
                    help="ipc, ipc_slab (opened on the receiver's GPU, as a decode worker does), ipc_slab_on_sender "
                         "(opened on the sender's GPU, as before), nixl")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    from services.handoff.cuda_ipc import gpu_order, process_ipc_slab, share, share_from_slab
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
    ways = [w for w in args.ways.split(",") if w]
    slab = process_ipc_slab(a, 1 << 30)
    endpoint, no_nixl = None, "not asked for"
    if "nixl" in ways:
        try:
            from services.handoff import nixl

            endpoint, no_nixl = nixl.process_endpoint(), ""
        except Exception as exc:        # noqa: BLE001 - not installed, no UCX plugin: the row says so
            endpoint, no_nixl = None, f"{type(exc).__name__}: {exc}"
    rows = []
    for mib in (int(x) for x in args.mib.split(",")):
        n = mib * (1 << 20) // 2
        src = torch.randn(n, device=a, dtype=torch.bfloat16)
        want = float(src[:4096].float().sum())

        def handed(how: str, src: torch.Tensor) -> tuple[list[float], list[float], bool, str]:
            """(the child's seconds, the parent's, every landing equal, an error) over the repetitions."""
            child_s, parent_s, ok = [], [], True
            for i in range(args.reps + 2):
                buf = src + 0 if i else src.clone()       # a fresh buffer a hand-off, as kv_buffer() makes one
                torch.cuda.synchronize(a)
                t0 = time.perf_counter()
                piece = None
                if how == "ipc":
                    msg = ("ipc", share(buf).SerializeToString())
                elif how in ("ipc_slab", "ipc_slab_on_sender"):
                    piece, shared = share_from_slab(buf, slab)
                    msg = ("ipc" if how == "ipc_slab" else "ipc_on_sender", shared.SerializeToString())
                else:
                    try:
                        piece, offer = nixl.offer_from_slab(endpoint, buf)
                    except Exception as exc:       # noqa: BLE001 - e.g. UCX cannot register GPU memory here
                        return child_s, parent_s, False, f"offer: {type(exc).__name__}: {exc}"
                    msg = ("nixl", offer.to_bytes(), n)
                sent = time.perf_counter() - t0
                parent.send(msg)
                seconds, s, where = parent.recv()
                if piece is not None:
                    if how == "nixl":
                        nixl.release(endpoint, piece)
                    else:
                        slab.give(piece)
                if seconds is None:
                    return child_s, parent_s, False, s
                if i >= 2:                                # the first two open the peer GPU's context and P2P access
                    child_s.append(seconds)
                    parent_s.append(sent)
                ok = ok and s == want and where.endswith(":0")
                del buf
            return child_s, parent_s, ok, ""

        row = {"mib": mib, "bytes": n * 2}
        for how in ways:
            if how == "nixl" and endpoint is None:
                row["nixl_error"] = no_nixl
                continue
            child_s, parent_s, ok, err = handed(how, src)
            row[f"{how}_landed_equal"] = ok
            if err:
                row[f"{how}_error"] = err
                continue
            total = [c + (p if how != "ipc" else 0.0) for c, p in zip(child_s, parent_s)]
            row[f"{how}_ms_p50"] = statistics.median(total) * 1e3
            row[f"{how}_ms_max"] = max(total) * 1e3
            row[f"{how}_sender_ms_p50"] = statistics.median(parent_s) * 1e3
            row[f"{how}_receiver_ms_p50"] = statistics.median(child_s) * 1e3
            row[f"{how}_gbs"] = n * 2 / statistics.median(total) / 1e9
        on_b = torch.empty_like(src, device=b)
        on_a = torch.empty_like(src)
        pinned = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        peer = _timed(lambda: on_b.copy_(src), args.reps)
        same = _timed(lambda: on_a.copy_(src), args.reps)
        host = _timed(lambda: (pinned.copy_(src), on_b.copy_(pinned)), args.reps)

        def gbs(xs):
            return n * 2 / statistics.median(xs) / 1e9

        row.update(peer_copy_gbs=gbs(peer), same_gpu_copy_gbs=gbs(same), through_pinned_host_gbs=gbs(host))
        row["landed_equal"] = all(row.get(f"{h}_landed_equal", True) for h in ways)
        rows.append(row)
        said = ", ".join(f"{h} {row[f'{h}_ms_p50']:.2f} ms p50 = {row[f'{h}_gbs']:.1f} GB/s" if f"{h}_ms_p50" in row
                         else f"{h}: {row.get(f'{h}_error', '?')}" for h in ways)
        print(f"{mib} MiB: {said} (landed equal: {row['landed_equal']}); in-process GPU to GPU "
              f"{row['peer_copy_gbs']:.1f} GB/s, on one GPU {row['same_gpu_copy_gbs']:.1f}, through pinned host "
              f"{row['through_pinned_host_gbs']:.1f}", flush=True)
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
