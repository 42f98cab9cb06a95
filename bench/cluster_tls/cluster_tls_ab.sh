#!/usr/bin/env bash
# The cost of mutual TLS between the services on the GPU serving path: the closed loop of bench/cluster/README.md
# (one prefill and one decode worker sharing the GPU, one store shard, 32 clients, alpha 1.1, `tessera` mode) with
# internal TLS off and on, alternating in one call so that both see the same machine. Writes OUT/tls_<setting>_<i>.*
set -euo pipefail
OUT=${1:?usage: bench/cluster_tls/cluster_tls_ab.sh OUT_DIR [PAIRS]}
PAIRS=${2:-2}
MODEL=${MODEL:-/tmp/m}
if [ ! -f "$MODEL/config.json" ]; then
  python3 -c "import sys; sys.path.insert(0, 'bench/cluster'); from cluster import write_random_llama; from pathlib import Path; write_random_llama(Path('$MODEL'), 32)"
fi
for i in $(seq 1 "$PAIRS"); do
  for tls in off on; do
    python3 bench/cluster/cluster.py --no-ray --model-dir "$MODEL" --layers 32 --requests 256 --warmup 8 --concurrency 32 \
      --alphas 1.1 --chunk-cache-bytes 2.5e9 --host-cache-bytes 16e9 --register-corpus --modes tessera \
      --internal-tls "$tls" --out "$OUT/tls_${tls}_$i" --runs-dir "/tmp/runs_${tls}_$i" 2>&1 | grep -v "^  " | tail -4
  done
done
