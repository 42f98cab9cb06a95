"""Who holds the interpreter lock in each worker process: a summary of a py-spy recording of a whole cluster.

Record (on the device; py-spy is a pip wheel) while a replay runs, every process of the cluster, non-blocking, at a
rate it keeps up with (97 Hz over ten processes fell 19 s behind in 12 s):

    py-spy record --subprocesses --nonblocking --threads --gil --format raw -r 10 -d 20 -o gil.txt -p CLUSTER_PID

``--gil`` samples only the thread holding the lock, so a process's samples over the recording's ticks are the share
of the time its lock was held, and each thread's samples its share of that. Without ``--gil`` the same command
samples every thread that is not idle (one waiting for the lock, or in a blocking call, counts as idle). Processes are
named by what their stacks run (``services/decode``, ``services/prefill``, ``services/kvstore``).

    python3 bench/cluster/spy_summary.py gil.txt[.gz] [--rate 10 --seconds 20] [--top 6]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re
import sys

ROLES = (("services/decode/", "decode"), ("services/prefill/", "prefill"), ("services/kvstore/", "store"),
         ("services/gateway/", "gateway"), ("services/index/", "index"))


def read(path: str):
    """(pid, thread name, frames [outermost first], samples) per line of py-spy's raw (collapsed) output."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack or not n.isdigit():
                continue
            parts = stack.split(";")
            procs = [p for p in parts if p.startswith("process ")]
            # a recording of one process (no --subprocesses) names none: its lines are that process's
            pid = procs[-1].split(":")[0].split()[1] if procs else "recorded"
            if not any(p.startswith("thread ") for p in parts):
                continue
            thread = next((p.split(":", 1)[-1].strip() for p in parts if p.startswith("thread ")), "?")
            frames = [re.sub(r"\(/\S*?/(site-packages/|python3[.\d]*/|(?=services/|kernels/))", "(", p) for p in parts
                      if not p.startswith(("process ", "thread "))]
            yield pid, thread, frames, int(n)


def summarize(path: str) -> dict:
    """Per process: {"role", "samples", "threads": {name: samples}, "frames": {thread: {innermost frame: samples}}},
    the innermost frame being the deepest of this repository's (``services/``, ``kernels/``) where the stack has one."""
    procs: dict[str, dict] = {}
    for pid, thread, frames, n in read(path):
        p = procs.setdefault(pid, {"role": None, "samples": 0, "threads": collections.Counter(),
                                   "frames": collections.defaultdict(collections.Counter)})
        text = ";".join(frames)
        for marker, name in ROLES:
            if marker in text and (p["role"] is None or name == "decode"):
                p["role"] = name
        p["samples"] += n
        p["threads"][thread] += n
        ours = [f for f in frames if "(services/" in f or "(kernels/" in f]
        p["frames"][thread][(ours or frames or ["?"])[-1]] += n
    return procs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recording")
    ap.add_argument("--rate", type=float, default=10.0, help="py-spy's -r")
    ap.add_argument("--seconds", type=float, default=20.0, help="py-spy's -d")
    ap.add_argument("--top", type=int, default=6, help="threads and innermost frames shown a process")
    args = ap.parse_args()
    ticks = args.rate * args.seconds
    procs = summarize(args.recording)
    print(f"{args.recording}: {sum(p['samples'] for p in procs.values())} samples over {ticks:.0f} ticks a process")
    for pid, p in sorted(procs.items(), key=lambda kv: -kv[1]["samples"]):
        n = p["samples"]
        print(f"\nprocess {pid} ({p['role'] or '?'}): {n} samples, {n / ticks:.0%} of the ticks")
        for thread, m in p["threads"].most_common(args.top):
            frames = ", ".join(f"{f} {k}" for f, k in p["frames"][thread].most_common(2))
            print(f"  {m:5d} {m / ticks:5.0%}  {thread}: {frames}"[:240])
    return 0


if __name__ == "__main__":
    sys.exit(main())
