#!/usr/bin/env bash
# The engine and decode benchmarks on two trees in one call on one GPU: BEFORE (a tarball of an older commit's
# services/, kernels/ and its bench scripts, unpacked to a temp dir) and this working tree, alternated:
# engine before, engine after, decode before, decode after. Writes OUT/{engine,decode}_{before,after}.json and
# the logs; bench/engine/compare.py reads the four files into one table of ratios.
#   bash bench/engine/before_after.sh BEFORE.tar OUT
set -euo pipefail
tar_path=$(realpath "$1"); out=$(realpath "$2"); mkdir -p "$out"
before=$(mktemp -d); tar -xf "$tar_path" -C "$before"
here=$PWD
eng_before="$before/bench/engine.py"; [ -f "$eng_before" ] || eng_before="$before/bench/engine/engine.py"
dec_before="$before/bench/decode.py"; [ -f "$dec_before" ] || dec_before="$before/bench/decode/decode.py"
run() { echo "== $1 $(date -u +%H:%M:%S)"; shift; "$@"; }
run "engine before" bash -c "cd $before && PYTHONPATH=$before:${PYTHONPATH:-} python3 $eng_before --backends triton --graphs on --out $out/engine_before.json" > "$out/engine_before.log" 2>&1
run "engine after" bash -c "cd $here && python3 bench/engine/engine.py --backends triton --graphs on --out $out/engine_after.json" > "$out/engine_after.log" 2>&1
run "decode before" bash -c "cd $before && PYTHONPATH=$before:${PYTHONPATH:-} python3 $dec_before --graphs on --batches 8,32 --ratios 0.15 --out $out/decode_before.json" > "$out/decode_before.log" 2>&1
run "decode after" bash -c "cd $here && python3 bench/decode/decode.py --graphs on --batches 8,32 --ratios 0.15 --out $out/decode_after.json" > "$out/decode_after.log" 2>&1
