"""What registering the store's arena segments with CUDA costs a worker (``kvstore.segments``): cudaHostRegister of
a 1 GiB shared-memory segment, read-only, with and without the portable flag (portable maps it for every GPU the
process sees, not only its own), one process alone and then several processes at once, each with every GPU of the
host visible and its own first, as the launcher starts workers.

    python3 bench/kvstore/register.py --gib 4 --procs 1,8 --json bench/kvstore/DATE_DEVICE_COMMIT_register.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

FLAGS = {"read-only, portable": 8 | 1, "read-only": 8}


def _worker(gpu: int, paths: list[str], flags: int, start, out) -> None:
    import numpy as np
    import torch

    torch.cuda.set_device(gpu)
    torch.ones(1, device="cuda")
    maps = []
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        maps.append(mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ))
        os.close(fd)
    arrays = [np.frombuffer(m, dtype=np.uint8) for m in maps]
    cudart = torch.cuda.cudart()
    start.wait()
    seconds = []
    for a in arrays:
        t0 = time.perf_counter()
        rc = int(cudart.cudaHostRegister(a.ctypes.data, a.nbytes, flags))
        seconds.append(time.perf_counter() - t0)
        if rc:
            out.put((gpu, None, f"cudaHostRegister returned {rc}"))
            return
    for a in arrays:
        cudart.cudaHostUnregister(a.ctypes.data)
    out.put((gpu, seconds, ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=int, default=4, help="segments of 1 GiB each process registers")
    ap.add_argument("--procs", default="1,8", help="processes registering at once (spread over the GPUs)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    n_gpus = torch.cuda.device_count()
    paths = []
    for i in range(args.gib):
        p = f"/dev/shm/tessera-register-bench-{i}"
        with open(p, "wb") as f:
            f.truncate(1 << 30)
        with open(p, "r+b") as f:           # touch every page, as a store's written segment is
            m = mmap.mmap(f.fileno(), 1 << 30)
            for off in range(0, 1 << 30, 1 << 24):
                m[off:off + (1 << 24)] = b"\1" * (1 << 24)
            m.close()
        paths.append(p)
    ctx = mp.get_context("spawn")
    rows = []
    try:
        for procs in (int(x) for x in args.procs.split(",")):
            for name, flags in FLAGS.items():
                start, out = ctx.Event(), ctx.Queue()
                ps = [ctx.Process(target=_worker, args=(i % n_gpus, paths, flags, start, out)) for i in range(procs)]
                for p in ps:
                    p.start()
                time.sleep(3 + procs)          # every process up, its maps made
                t0 = time.perf_counter()
                start.set()
                got = [out.get(timeout=600) for _ in ps]
                wall = time.perf_counter() - t0
                for p in ps:
                    p.join(60)
                errors = [e for _, s, e in got if s is None]
                per = [x for _, s, _ in got if s for x in s]
                row = {"procs": procs, "flags": name, "gib_each": args.gib, "wall_s": wall,
                       "ms_per_gib_p50": statistics.median(per) * 1e3 if per else None,
                       "ms_per_gib_max": max(per) * 1e3 if per else None, "errors": errors}
                rows.append(row)
                print(f"{procs} process(es), {name}: {row['ms_per_gib_p50']} ms a GiB p50 (max {row['ms_per_gib_max']}), "
                      f"all done in {wall:.2f} s {errors or ''}", flush=True)
    finally:
        for p in paths:
            os.unlink(p)
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
              "device": f"{n_gpus} x {torch.cuda.get_device_name(0)}", "commit": os.environ.get("TESSERA_COMMIT", ""),
              "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
