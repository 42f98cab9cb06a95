#!/usr/bin/env bash
# Runs bench/cluster/cluster.py once per configuration, each a fresh cluster on the GPUs it names, `tessera` mode,
# the registered corpus and sizes of bench/cluster/README.md's command; then bench/cluster/scale_report.py merges them.
#
#   bench/cluster/scale.sh MODEL_DIR OUT_DIR NAME:GPUS:PREFILL:DECODE:ROUTING:ALPHAS:REQUESTS:CONCURRENCY[:STORE_SHM[:STORES]] ...
#   e.g. together:0:1:1:residency:1.1:256:32  apart:0,1:1:1:residency:1.1:256:32  x4:0,1,2,3:4:4:load:1.1,2.1:1024:128
#
# GPUS is the CUDA_VISIBLE_DEVICES the cluster starts under: the workers take those GPUs round-robin. STORE_SHM: on
# (default: the store shard's DRAM tier in /dev/shm, read by the workers themselves) or off (streamed over gRPC).
# STORES: KV store shards (default 1). CLUSTER_ARGS (environment): more cluster.py flags for every run, e.g.
# "--store-loads always". PROFILE_DECODE=START,COUNT (environment): the decode workers record a torch-profiler window
# of COUNT steps from step START (TESSERA_TORCH_PROFILE_DECODE); each trace is summarised by profile_summary.py into
# OUT_DIR/NAME-prof/ and then deleted (a trace is megabytes: a device call brings back only so much). SPY=SECONDS
# (environment; py-spy on the PATH, e.g. its wheel installed): once the replay starts, py-spy records every process of
# the cluster for SECONDS at 10 Hz, non-blocking, every busy thread and then only the one holding the interpreter
# lock, into OUT_DIR/NAME-pyspy_{all,gil}.txt.gz, each summarised by spy_summary.py beside it (.txt). SPY_RATE=HZ
# (default 10) samples faster; SPY_ROLE=decode|prefill records one worker of that role alone (the first found; the
# whole cluster at 97 Hz fell behind, one process keeps up), e.g. SPY=10 SPY_RATE=100 SPY_ROLE=decode. Every run also
# writes OUT_DIR/NAME-gpu_apps.txt: 5 s into its replay, the GPU contexts of each process (nvidia-smi) and the host's
# busiest threads.
set -euo pipefail

descendants() {     # PID: its child processes, theirs, and so on
    local child
    for child in $(pgrep -P "$1"); do
        echo "$child"
        descendants "$child"
    done
}
replay_started() {  # NAME [LINE]: wait until run NAME's output has LINE (default: cluster.py's "replay started",
                    # printed after the warm-up and the corpus's registration); false when the run ended (or never
                    # started) before it
    local name=$1 line=${2:-replay started} i
    for i in $(seq 1 900); do
        grep -q "$line" "$out/$name.out" 2>/dev/null && return 0
        [ "$i" -gt 20 ] && ! pgrep -f "cluster.py --no-ray.*--out $out/$name" > /dev/null && return 1
        sleep 1
    done
    return 1
}
spy() {     # NAME SECONDS: once the replay of run NAME starts, record the cluster
    local name=$1 seconds=$2 pid
    # the workers are up once the warm-up is done: find the one to record then (a four-GPU replay lasts ~15 s, less
    # than finding it takes), and record once the replay has started
    replay_started "$name" "warm-up" || return 0
    pid=$(pgrep -n -f "cluster.py --no-ray.*--out $out/$name") || return 0
    local rate=${SPY_RATE:-10} sub=--subprocesses child
    if [ -n "${SPY_ROLE:-}" ]; then     # one worker of that role alone: the first whose stacks run services/ROLE/
        for child in $(descendants "$pid"); do
            if timeout 20 py-spy dump --nonblocking --pid "$child" 2>/dev/null | grep -q "services/$SPY_ROLE/"; then
                pid=$child sub=""
                break
            fi
        done
        [ -z "$sub" ] || { echo "no $SPY_ROLE worker found to record"; return 0; }
    fi
    replay_started "$name" || return 0
    sleep 2
    for kind in all gil; do
        timeout $((seconds * 3)) py-spy record $sub --nonblocking --threads $([ $kind = gil ] && echo --gil) \
            --format raw -r "$rate" -d "$seconds" -o "$out/$name-pyspy_$kind.txt" -p "$pid" > /dev/null 2>&1 || true
        [ -s "$out/$name-pyspy_$kind.txt" ] || continue
        python3 bench/cluster/spy_summary.py "$out/$name-pyspy_$kind.txt" --seconds "$seconds" --rate "$rate" \
            > "$out/$name-pyspy_${kind}_summary.txt" 2>&1 || true
        gzip -f "$out/$name-pyspy_$kind.txt"
    done
}
apps() {    # NAME: 5 s into the replay of run NAME, which processes hold a context on which GPU and how busy each keeps
            # it (nvidia-smi), and the busiest threads of the host: into OUT_DIR/NAME-gpu_apps.txt
    local name=$1
    command -v nvidia-smi > /dev/null || return 0
    replay_started "$name" || return 0
    sleep 5
    {
        nvidia-smi --query-gpu=index,uuid,utilization.gpu,memory.used --format=csv
        nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv
        timeout 20 nvidia-smi pmon -c 3 -s um
        ps -eLo pid,tid,psr,pcpu,comm --sort=-pcpu | head -40
        ps -eo pid,args | grep -E "spawn_main|cluster.py|services" | grep -v grep | cut -c1-160
    } > "$out/$name-gpu_apps.txt" 2>&1 || true
}
model=$1 out=$2
shift 2
mkdir -p "$out"
for spec in "$@"; do
    IFS=: read -r name gpus prefill decode routing alphas requests concurrency shm stores <<<"$spec"
    shm=${shm:-on} stores=${stores:-1}
    echo "=== $name: GPUs $gpus, $prefill prefill + $decode decode, routing $routing, store shm $shm, alphas $alphas, $requests requests, $concurrency clients ($(date -u +%H:%M:%S))"
    prof=()
    if [ -n "${PROFILE_DECODE:-}" ]; then
        mkdir -p "$out/$name-prof"
        prof=(env "TESSERA_TORCH_PROFILE_DECODE=$out/$name-prof,$PROFILE_DECODE")
    fi
    [ -n "${SPY:-}" ] && spy "$name" "$SPY" &
    apps "$name" &
    ${prof[@]+"${prof[@]}"} env CUDA_VISIBLE_DEVICES=$gpus python3 bench/cluster/cluster.py --no-ray --model-dir "$model" --layers 32 \
        --requests "$requests" --warmup 8 --concurrency "$concurrency" --alphas "$alphas" \
        --chunk-cache-bytes 2.5e9 --host-cache-bytes 16e9 --register-corpus --modes tessera --no-warmup-sparse \
        --prefill "$prefill" --decode "$decode" --routing "$routing" --store-shm "$shm" --stores "$stores" \
        --runs-dir "/tmp/runs-$name" --out "$out/$name" ${CLUSTER_ARGS:-} | tee "$out/$name.out" \
        || echo "=== $name failed: $?"
    wait        # the recordings
    if [ -n "${PROFILE_DECODE:-}" ]; then
        for trace in "$out/$name-prof"/*.json.gz; do
            [ -e "$trace" ] || continue
            python3 bench/cluster/profile_summary.py "$trace" --json "${trace%.json.gz}.summary.json" \
                >> "$out/$name-prof/summary.txt" && rm -f "$trace"
        done
    fi
done
