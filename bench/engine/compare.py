"""The engine and decode figures of two trees side by side (bench/engine/before_after.sh's four files): per row,
before, after and after / before, and whether every row is within a tolerance (default 3%).

    python3 bench/engine/compare.py DIR [--tolerance 0.03] [--md OUT.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def engine_rows(doc: dict) -> dict[str, float]:
    """{backend mode@ratio: ms} of an engine benchmark file (rows with an error left out)."""
    return {f"{r['backend']} {r['mode']}@{r['ratio']}": r["seconds"] * 1e3 for r in doc["rows"] if "seconds" in r}


def decode_rows(doc: dict) -> dict[str, float]:
    """{batch B ratio R graphs G: ms per step} of a decode benchmark file."""
    return {f"decode batch {r['batch']} r={r['ratio']} graphs {r['graphs']}": r["ms_per_step"]
            for r in doc["rows"] if "ms_per_step" in r}


def table(folder: Path, tolerance: float) -> tuple[list[dict], bool]:
    rows, ok = [], True
    for suite, read in (("engine", engine_rows), ("decode", decode_rows)):
        before = read(json.loads((folder / f"{suite}_before.json").read_text()))
        after = read(json.loads((folder / f"{suite}_after.json").read_text()))
        for key in before:
            if key not in after:
                rows.append({"row": key, "before_ms": before[key], "after_ms": None, "ratio": None, "within": False})
                ok = False
                continue
            ratio = after[key] / before[key]
            within = abs(ratio - 1) <= tolerance
            ok &= within
            rows.append({"row": key, "before_ms": before[key], "after_ms": after[key], "ratio": ratio,
                         "within": within})
    return rows, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--tolerance", type=float, default=0.03)
    ap.add_argument("--md", type=Path, help="also write the table as Markdown here")
    args = ap.parse_args()
    rows, ok = table(args.folder, args.tolerance)
    lines = ["| row | before (ms) | after (ms) | after / before | within |", "|---|---:|---:|---:|---|"]
    for r in rows:
        after = "missing" if r["after_ms"] is None else f"{r['after_ms']:.2f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['row']} | {r['before_ms']:.2f} | {after} | {ratio} | {'yes' if r['within'] else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    print(f"every row within {args.tolerance:.0%}: {ok}")
    if args.md:
        args.md.write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
