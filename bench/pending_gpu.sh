#!/usr/bin/env bash
# The GPU measurements that options built but not yet timed wait for, in one device call (~9 minutes on an H100,
# each step bounded): the engine with every layer kernel as a PDL launch and with the norms in the skinny GEMMs,
# the PDL kernel chain alone, the norm prologue GEMM by GEMM, and the self-merging attention splits cold.
# Every bench checks its variants' results before timing them. usage: bash bench/pending_gpu.sh OUTDIR
set -u
out=${1:?usage: bash bench/pending_gpu.sh OUTDIR}
mkdir -p "$out"
step() {
    local limit=$1
    shift
    echo "== $* (at most ${limit}s)"
    timeout "$limit" "$@" 2>&1 | grep -v Warning | tail -30
    echo "== exit ${PIPESTATUS[0]}"
}
step 200 python3 bench/engine.py --backends triton,triton:pdlall,triton:normed --graphs on \
    --modes full@0.0,tessera@0.15,tessera@0.0 --out "$out/engine_pending.json"
step 150 python3 bench/pdl_stack.py --chain --out "$out/pdl_chain.json"
step 120 python3 bench/skinny_gemm.py --norm-ab --out "$out/skinny_norm_ab.json"
step 60 python3 bench/short_attention.py --set fused --new 64 --out "$out/short_attention_fused.json"
