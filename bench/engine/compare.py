"""The engine and decode figures of two trees side by side (bench/engine/before_after.sh's four files in each DIR):
per row, before, after and after / before, and whether every row is within a tolerance (default 3%). With several
DIRs (rounds of the same call) each side's figure is the median over the rounds, and the rounds' spread is shown.

    python3 bench/engine/compare.py DIR [DIR ...] [--tolerance 0.03] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def engine_rows(doc: dict) -> dict[str, float]:
    """{backend mode@ratio: ms} of an engine benchmark file (rows with an error left out)."""
    return {f"{r['backend']} {r['mode']}@{r['ratio']}": r["seconds"] * 1e3 for r in doc["rows"] if "seconds" in r}


def decode_rows(doc: dict) -> dict[str, float]:
    """{batch B ratio R graphs G: ms per step} of a decode benchmark file."""
    return {f"decode batch {r['batch']} r={r['ratio']} graphs {r['graphs']}": r["ms_per_step"]
            for r in doc["rows"] if "ms_per_step" in r}


def _side(folders: list[Path], suite: str, side: str, read) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for folder in folders:
        for key, ms in read(json.loads((folder / f"{suite}_{side}.json").read_text())).items():
            out.setdefault(key, []).append(ms)
    return out


def table(folders: list[Path], tolerance: float) -> tuple[list[dict], bool]:
    rows, ok = [], True
    for suite, read in (("engine", engine_rows), ("decode", decode_rows)):
        before, after = _side(folders, suite, "before", read), _side(folders, suite, "after", read)
        for key, runs in before.items():
            b = statistics.median(runs)
            if key not in after:
                rows.append({"row": key, "before_ms": b, "after_ms": None, "ratio": None, "within": False,
                             "before_runs": runs, "after_runs": []})
                ok = False
                continue
            a = statistics.median(after[key])
            ratio = a / b
            within = abs(ratio - 1) <= tolerance
            ok &= within
            rows.append({"row": key, "before_ms": b, "after_ms": a, "ratio": ratio, "within": within,
                         "before_runs": runs, "after_runs": after[key]})
    return rows, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", type=Path, nargs="+")
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--md", type=Path, help="also write the table as Markdown here")
    args = ap.parse_args()
    rows, ok = table(args.folders, args.tolerance)
    lines = ["| row | before (ms) | after (ms) | after / before | within | before, each round | after, each round |",
             "|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        after = "missing" if r["after_ms"] is None else f"{r['after_ms']:.2f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        runs = [", ".join(f"{x:.2f}" for x in r[k]) for k in ("before_runs", "after_runs")]
        lines.append(f"| {r['row']} | {r['before_ms']:.2f} | {after} | {ratio} | {'yes' if r['within'] else 'NO'} "
                     f"| {runs[0]} | {runs[1]} |")
    text = "\n".join(lines)
    print(text)
    print(f"every row within {args.tolerance:.0%}: {ok}")
    if args.md:
        args.md.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
