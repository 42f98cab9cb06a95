"""What a torch call on one thread costs while another thread of the process runs Python, by the interpreter's switch
interval: the wait to get the interpreter lock back that every torch call (which gives it up) may pay.

A thread calls ``t.add_(1)`` on a 16-element CPU tensor for a while; beside it, 0, 1 or 3 threads either spin pure
Python without pause (``spin``) or run Python in bursts of ``--burst-ms`` with a sleep as long between (``bursts``,
as ``handoff_import.py --busy 0.5`` does). Per switch interval (``sys.setswitchinterval``) and load, the median over
``--rounds`` rounds of the mean time a call.

    .venv/bin/python bench/handoff/lock_wait.py --intervals 5,1,0.5,0.2 --rounds 3 --json F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch


def load(stop: threading.Event, kind: str, burst_s: float) -> None:
    while not stop.is_set():
        t0, x = time.perf_counter(), 0
        while time.perf_counter() - t0 < burst_s:
            x += 1
        if kind == "bursts":
            time.sleep(burst_s)


def call_us(seconds: float) -> float:
    t, n = torch.zeros(16), 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        t.add_(1)
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--intervals", default="5,1,0.5,0.2", help="switch intervals, ms")
    ap.add_argument("--threads", default="0,1,3")
    ap.add_argument("--kinds", default="spin,bursts")
    ap.add_argument("--burst-ms", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=0.5, help="how long a round's calls run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    rows = []
    try:
        for kind in args.kinds.split(","):
            for n in (int(x) for x in args.threads.split(",")):
                if n == 0 and kind != args.kinds.split(",")[0]:
                    continue           # no load is the same whatever its kind
                for ms in (float(x) for x in args.intervals.split(",")):
                    sys.setswitchinterval(ms / 1e3)
                    runs = []
                    for _ in range(args.rounds):
                        stop = threading.Event()
                        th = [threading.Thread(target=load, args=(stop, kind, args.burst_ms / 1e3)) for _ in range(n)]
                        for t in th:
                            t.start()
                        runs.append(call_us(args.seconds))
                        stop.set()
                        for t in th:
                            t.join()
                    row = {"load": kind if n else "none", "threads": n, "switch_ms": ms,
                           "call_us_median": statistics.median(runs), "call_us": runs}
                    rows.append(row)
                    print(f"{row['load']:>6} x {n}, switch {ms:g} ms: {row['call_us_median']:10.1f} us a torch call "
                          f"(rounds {', '.join(f'{r:.1f}' for r in runs)})", flush=True)
    finally:
        sys.setswitchinterval(default)
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                               "command": "bench/handoff/lock_wait.py " + " ".join(sys.argv[1:]),
                                               "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
