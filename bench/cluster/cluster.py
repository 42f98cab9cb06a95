"""Cluster benchmark (GPU): one Zipf trace replayed through the SDK in full, prefix, blend_copy and
tessera mode, for each skew, on a Llama-3-8B-shaped model with random weights.

One prefill and one decode worker share the GPU (half a GPU each in Ray's accounting), one KV store
shard holds chunks in DRAM. The device chunk cache is set below a fifth of the trace's hot set
(``--chunk-cache-bytes``) so that the store tier matters. Each mode starts cold (ResetCaches).
With ``--register-corpus`` the reuse modes (tessera, blend_copy) start from the state a RAG deployment
serves in: every document of the trace registered ahead of time (RegisterChunks: computed once and
written to the store, CacheBlend's setting), then the workers' device caches dropped; the time to
register is reported, not counted. ``--host-cache-bytes`` gives each worker its host-memory chunk tier.
Targets (issue #5): tessera p50 TTFT >= 3x lower than full, throughput >= 2.5x full, p50 TTFT
>= 1.3x lower than blend_copy.

    python3 bench/cluster/cluster.py --out bench/cluster/cluster    # writes cluster.json, cluster.md, runs/
    python3 bench/cluster/cluster.py --shape tiny --requests 16     # CPU smoke run of the same code path
    python3 bench/cluster/cluster.py --no-ray --layers 8 --requests 48   # no Ray: one process per service

``--rates R1,R2,...`` adds an open-loop sweep: per skew and mode, one set-up (reset, corpus
registration), then the trace replayed with Poisson arrivals at each rate, lowest first (each rate
starts from the caches the previous one left), sending stopped after ``--max-seconds-per-rate``.
It writes a table per skew (p50/p90 TTFT, achieved req/s and requests done per mode, the target
ratios at each rate) and OUT_rates_alpha<A>.png. With ``--rates`` the closed-loop pass runs only
when ``--concurrency`` (or ``--rate``) is also given.

    python3 bench/cluster/cluster.py --rates 2,4,6,8,10,12 --register-corpus --out bench/cluster/rates

``--no-ray`` starts the same services as child processes of this one (services/launch/local.py),
for machines where Ray cannot be installed. OUT.json and OUT.md are rewritten after every mode, so
a run stopped early keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# bench/ is on the path as this script's folder (behind the repository: bench/kernels/kernels.py must not hide kernels/)
from cluster_probe import (BUDGET_HEADER, WORKER_HEADER, GpuSampler, WorkerMeter, budget_line, chunk_sources,  # noqa: E402
                           delta, per_worker, time_budget, worker_line)
from cluster_rates import RATE_RATIOS, parse_rates, rate_sweep_md, sweep_rates, sweep_summaries  # noqa: E402

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
    hidden_act="silu", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def _commit() -> str:
    """The tree's commit: TESSERA_COMMIT when set (a device copy's git metadata may be stale), else git's HEAD."""
    import os
    import subprocess

    if os.environ.get("TESSERA_COMMIT"):
        return os.environ["TESSERA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class CorpusTarget:
    """The cluster target, whose ``reset()`` before a reuse mode also registers ``corpus`` (token lists)
    and then drops the device caches only: the store (and the workers' host tiers) keep the chunks."""

    def __init__(self, target, corpus: list[list[int]], batch: int = 8) -> None:
        self.target, self.corpus, self.batch = target, corpus, batch
        self.mode: str | None = None
        self.register_seconds: dict[str, float] = {}

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def client(self):
        return self.target.client

    def generate(self, request):
        return self.target.generate(request)

    def reset(self) -> None:
        from services.prefill.worker import REUSE_MODES    # the modes whose chunks the store keeps

        self.target.reset()
        if self.mode not in REUSE_MODES:
            return
        t0 = time.monotonic()
        for i in range(0, len(self.corpus), self.batch):
            stored = self.client.register_chunks(self.corpus[i:i + self.batch])
            if not all(c.stored for c in stored):
                raise RuntimeError(f"registering the corpus: {sum(not c.stored for c in stored)} chunk(s) not stored")
        self.client.reset_caches(device_only=True)
        self.register_seconds[self.mode] = time.monotonic() - t0
        print(f"registered {len(self.corpus)} documents for {self.mode} in {self.register_seconds[self.mode]:.1f} s",
              flush=True)

    def close(self) -> None:
        self.target.close()


class Prepared:
    """A target whose set-up already ran: replay_modes would reset one that has ``reset``, and the
    counters and GPU samples of a mode must cover its replay only."""

    def __init__(self, target) -> None:
        self.target = target

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    def generate(self, request):
        return self.target.generate(request)


def write_random_llama(path: Path, layers: int, seed: int = 0) -> Path:
    """config.json + one safetensors file per layer (drawn on the GPU, bf16), so memory stays small."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]

    def normal(*shape, std):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16).cpu()

    save_file({"model.embed_tokens.weight": normal(vocab, hid, std=1.0), "model.norm.weight": 1 + normal(hid, std=0.1),
               "lm_head.weight": normal(vocab, hid, std=hid ** -0.5)}, str(path / "model-embed.safetensors"))
    for i in range(layers):
        p = f"model.layers.{i}."
        save_file({p + "input_layernorm.weight": 1 + normal(hid, std=0.1),
                   p + "post_attention_layernorm.weight": 1 + normal(hid, std=0.1),
                   p + "self_attn.q_proj.weight": normal(hq * hd, hid, std=hid ** -0.5),
                   p + "self_attn.k_proj.weight": normal(hkv * hd, hid, std=hid ** -0.5),
                   p + "self_attn.v_proj.weight": normal(hkv * hd, hid, std=hid ** -0.5),
                   p + "self_attn.o_proj.weight": normal(hid, hq * hd, std=(hq * hd) ** -0.5),
                   p + "mlp.gate_proj.weight": normal(inter, hid, std=hid ** -0.5),
                   p + "mlp.up_proj.weight": normal(inter, hid, std=hid ** -0.5),
                   p + "mlp.down_proj.weight": normal(hid, inter, std=inter ** -0.5)},
                  str(path / f"model-layer{i:03d}.safetensors"))
    torch.cuda.empty_cache()        # the workers, not this process, need the GPU's memory
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/cluster/cluster", help="writes OUT.json, OUT.md and OUT-runs/")
    ap.add_argument("--runs-dir", help="per-request records and plots (default: OUT-runs)")
    ap.add_argument("--no-ray", action="store_true", help="start the services as local processes, not Ray actors")
    ap.add_argument("--internal-tls", choices=("on", "off"), default="on",
                    help="mutual TLS between the services (default on, as `tessera up`; off: the A/B of its cost)")
    ap.add_argument("--shape", choices=("llama3-8b", "tiny"), default="llama3-8b")
    ap.add_argument("--model-dir", help="reuse a model directory (default: write one to a temp dir)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--alphas", default="1.1,2.1")
    ap.add_argument("--modes", default="full,prefix,blend_copy,tessera")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, help="closed loop: requests in flight (default 8; not with --rate)")
    ap.add_argument("--rate", type=float, help="open loop instead: Poisson arrivals at this many requests/s "
                    "(a rate below every mode's capacity shows latencies without a saturated queue; throughput then follows the rate)")
    ap.add_argument("--rate-modes", help="modes of the --rates sweep (default: --modes)")
    ap.add_argument("--rates", help="open-loop sweep: comma-separated requests/s, each replayed per mode after one "
                    "set-up; with --rates the closed-loop (or --rate) pass runs only if --concurrency (or --rate) "
                    "is given too")
    ap.add_argument("--max-seconds-per-rate", type=float, default=60.0,
                    help="stop sending new requests after this many seconds of a swept rate (default 60)")
    ap.add_argument("--warmup", type=int, default=8,
                    help="requests replayed in every mode before measuring (kernel compiles, graph captures)")
    # two workers share one 80 GB GPU: 2 x (16 GB weights + 14 GB KV pool) leaves room for activations
    ap.add_argument("--kv-cache-bytes", type=float, help="paged KV pool per worker (default 14e9; --shape tiny: 2e8)")
    # the hot set is --docs x 64 MiB (512 tokens x 128 KiB): 12.8 GB by default; a fifth is 2.56 GB
    ap.add_argument("--chunk-cache-bytes", type=float, help="device chunk cache per worker (default 2e9; --shape tiny: "
                    "2e6, under a fifth of its hot set as well)")
    ap.add_argument("--store-dram-bytes", type=float, help="the store shard's DRAM tier (default 32e9; --shape tiny: 1e9)")
    ap.add_argument("--host-cache-bytes", type=float, default=0,
                    help="each worker's host-memory chunk tier (0: off)")
    ap.add_argument("--warmup-tokens", type=int, default=None,
                    help="the workers' start-up warm-up context (services/engine/graphs/warmup.py; default: the settings' "
                         "defaults; 0: off)")
    ap.add_argument("--decode-step-interval-ms", type=float, default=0.0,
                    help="DecodeSettings.min_step_interval_s, in ms (0: decode steps back to back)")
    ap.add_argument("--admit-during-step", action="store_true",
                    help="DecodeSettings.admit_during_step: decode workers admit hand-offs while a step runs on the GPU")
    ap.add_argument("--no-warmup-sparse", dest="warmup_sparse", action="store_false",
                    help="decode workers warm up dense decode only (the trace decodes densely; a shorter start)")
    ap.add_argument("--prefill", type=int, default=1, help="prefill workers")
    ap.add_argument("--stores", type=int, default=1, help="KV store shards")
    ap.add_argument("--store-loads", choices=("cost", "always", "never"), default="cost",
                    help="prefill workers load a chunk the store holds when the loading controller measured that "
                         "cheaper than computing it (cost, the default), always, or never (every chunk the GPU "
                         "lacks computed: the store path off, for an A/B)")
    ap.add_argument("--decode", type=int, default=1, help="decode workers (they and the prefill workers take the "
                                                          "visible GPUs round-robin: CUDA_VISIBLE_DEVICES picks them)")
    ap.add_argument("--ipc-slab-mb", type=int, default=1024,
                    help="each prefill worker's CUDA IPC slab (PrefillSettings.ipc_slab_bytes); 0: a buffer a hand-off")
    ap.add_argument("--store-shm", choices=("on", "off"), default="on",
                    help="the store shards' DRAM tier in /dev/shm, read by workers on its host (on), or streamed (off)")
    ap.add_argument("--cpu-affinity", choices=("on", "off"), default="on",
                    help="GPU workers bind their threads to their GPU's local CPUs (on), or stay where placed (off)")
    from services.modes import ROUTINGS

    ap.add_argument("--routing", choices=ROUTINGS, default="residency",
                    help="the gateway's choice of prefill worker: chunk residency less load (default), or load only")
    ap.add_argument("--register-corpus", action="store_true",
                    help="register the trace's documents before each reuse mode (then drop device caches)")
    args = ap.parse_args()
    if args.rate is not None and args.concurrency is not None:
        ap.error("give --rate or --concurrency, not both")
    if not args.max_seconds_per_rate > 0:
        ap.error("--max-seconds-per-rate must be > 0")
    try:
        rates = parse_rates(args.rates) if args.rates else []
    except ValueError as exc:
        ap.error(str(exc))
    main_pass = not rates or args.rate is not None or args.concurrency is not None
    concurrency = None if args.rate else (args.concurrency or 8)

    from loadgen.replay import ReplayConfig, replay_modes
    from loadgen.replay.plots import rate_sweep
    from loadgen.replay.report import rate_sweep_rows, summary_table, write_report
    from loadgen.trace import LengthDist, SynthConfig, synthesize
    from loadgen.trace.tokens import doc_token_ids
    from services.cluster.config import ClusterConfig, DecodeSettings, PrefillSettings
    from loadgen.replay.cluster_target import ClusterTarget

    tiny = args.shape == "tiny"
    # sizes for a GPU's memory by default; the tiny CPU model gets sizes a small machine holds
    for name, gpu_default, tiny_default in (("kv_cache_bytes", 14e9, 2e8), ("chunk_cache_bytes", 2e9, 2e6),
                                            ("store_dram_bytes", 32e9, 1e9)):
        if getattr(args, name) is None:
            setattr(args, name, tiny_default if tiny else gpu_default)
    tmp = tempfile.mkdtemp(prefix="tessera-bench-")
    if args.model_dir:
        model = Path(args.model_dir)
    elif tiny:
        from services.engine.model.tiny import write_tiny

        model = write_tiny(Path(tmp) / "tiny")
    else:
        print(f"writing a random Llama-3-8B-shaped model ({args.layers} layers) to {tmp}", flush=True)
        model = write_random_llama(Path(tmp) / "llama3-8b-random", args.layers)
    device, dtype = ("cpu", "float32") if tiny else ("cuda", "bfloat16")
    warm = {} if args.warmup_tokens is None else {"warmup_tokens": args.warmup_tokens}
    cfg = ClusterConfig(model_dir=str(model), device=device, dtype=dtype, kv_cache_bytes=int(args.kv_cache_bytes),
                        chunk_cache_bytes=int(args.chunk_cache_bytes), store_dram_bytes=int(args.store_dram_bytes),
                        store_dir=str(Path(tmp) / "rocksdb"), internal_tls=args.internal_tls == "on",
                        prefill=args.prefill, decode=args.decode, routing=args.routing, stores=args.stores,
                        store_shm=args.store_shm == "on", cpu_affinity=args.cpu_affinity == "on",
                        prefill_settings=PrefillSettings(host_cache_bytes=int(args.host_cache_bytes),
                                                         store_loads=args.store_loads,
                                                         ipc_slab_bytes=args.ipc_slab_mb << 20, **warm),
                        decode_settings=DecodeSettings(host_cache_bytes=int(args.host_cache_bytes),
                                                       min_step_interval_s=args.decode_step_interval_ms / 1e3,
                                                       admit_during_step=args.admit_during_step,
                                                       warmup_sparse=args.warmup_sparse, **warm))
    if args.no_ray:
        from services.launch.local import start_local_cluster

        cluster = start_local_cluster(cfg, progress=print)
    else:
        from services.launch.on_ray import ensure_ray, start_cluster

        ensure_ray(num_cpus=4)
        cluster = start_cluster(cfg, progress=print)
    started = time.monotonic()
    target = ClusterTarget(cluster.gateway_address, timeout=1800)
    vocab = min(target.vocab_size, 128000)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    gpu, gpus = None, 0
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        gpu = f"{gpus} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    launcher = "local processes (--no-ray)" if args.no_ray else "Ray actors"
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "shape": args.shape,
               "layers": args.layers, "device": device, "gpu": gpu, "launcher": launcher,
               "command": " ".join(sys.argv), "requests": args.requests, "docs": args.docs,
               "concurrency": concurrency if main_pass else None, "rate": args.rate,
               "rates": rates, "max_seconds_per_rate": args.max_seconds_per_rate if rates else None,
               "chunk_cache_bytes": args.chunk_cache_bytes,
               "host_cache_bytes": args.host_cache_bytes, "register_corpus": args.register_corpus,
               "internal_tls": args.internal_tls, "commit": _commit(), "runs": [],
               "prefill_workers": args.prefill, "decode_workers": args.decode, "routing": args.routing,
               "stores": args.stores, "store_loads": args.store_loads,
               "store_shm": args.store_shm, "cpu_affinity": args.cpu_affinity,
               "gpus": gpus,
               "rate_sweeps": []}
    shape = args.shape if tiny else f"{args.shape}, {args.layers} layers"
    md = [f"# Cluster benchmark ({shape}, {device})", "",
          f"Date: {results['date']}. Device: {gpu or device}. Services: {launcher}. "
          f"Hand-off transport: {target.client.stats().transport}. Workers: {args.prefill} prefill, "
          f"{args.decode} decode, {args.stores} store shard(s); routing: {args.routing}; store DRAM tier in shared memory: {args.store_shm}; CPU affinity: {args.cpu_affinity}.",
          "Command: `" + " ".join(sys.argv) + "`", ""]
    runs_dir = Path(args.runs_dir or f"{args.out}-runs")

    def save(extra: list[str]) -> None:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{args.out}.json").write_text(json.dumps(results, indent=2))
        Path(f"{args.out}.md").write_text("\n".join(md + extra))

    alphas = [float(a) for a in args.alphas.split(",")]
    sources = results["decode_chunk_sources"] = {}   # alpha/mode -> where the decode worker found shared chunks
    results["transport"] = target.client.stats().transport
    first_alpha = alphas[0]
    try:
        for alpha in alphas:
            trace = synthesize(SynthConfig(
                docs=args.docs, alpha=alpha, chunks_per_request=args.chunks,
                doc_tokens=LengthDist("const", (float(args.chunk_tokens),)),
                suffix_tokens=LengthDist("const", (float(args.suffix_tokens),)),
                output_tokens=LengthDist("const", (float(args.output_tokens),)), rate=float("inf"),
                requests=args.requests, seed=0))
            rcfg = ReplayConfig(mode=modes[0], concurrency=concurrency, rate=args.rate, vocab_size=vocab)
            replay_target = sweep_target = target
            if args.register_corpus:
                docs = sorted({(ch.doc, ch.tokens) for r in trace for ch in r.chunks})
                corpus = [doc_token_ids(d, n, vocab, seed=rcfg.token_seed, low=rcfg.token_low).tolist() for d, n in docs]
                replay_target, sweep_target = CorpusTarget(target, corpus), CorpusTarget(target, corpus)
            if args.warmup and alpha == first_alpha:
                # unmeasured: the first mode would otherwise pay every compile and capture (each mode
                # resets the caches before it is measured, so the warm-up leaves no chunk behind)
                replay_modes(trace[:args.warmup], target, rcfg, modes)
                print(f"warm-up ({args.warmup} requests per mode) done at {time.monotonic() - started:.0f} s",
                      flush=True)
            if main_pass:
                runs, summaries = [], []
                meter, budgets = WorkerMeter(target.client), {}
                for mode in modes:      # one mode at a time, so that a stopped run keeps the modes it finished
                    if replay_target is not target:
                        replay_target.mode = mode
                    replay_target.reset()
                    before = meter.snapshot()
                    # bench/cluster/scale.sh waits for this line before it records the replay (py-spy, GPU contexts)
                    print(f"alpha {alpha:g} {mode}: replay started at {time.monotonic() - started:.0f} s", flush=True)
                    with GpuSampler() as gpu_samples:
                        mode_runs, mode_summaries = replay_modes(trace, Prepared(replay_target), rcfg, [mode])
                    used = delta(meter.snapshot(), before)
                    sources[f"{alpha:g}/{mode}"] = chunk_sources(used)
                    budgets[mode] = time_budget(used, mode_runs[0].duration_s, gpu_samples.busy)
                    budgets[mode]["gpu_busy_pct_by_gpu"] = gpu_samples.by_gpu
                    budgets[mode]["workers"] = per_worker(used, mode_runs[0].duration_s)
                    runs += mode_runs
                    summaries += mode_summaries
                    print(f"alpha {alpha:g} {mode}: done at {time.monotonic() - started:.0f} s", flush=True)
                    results["partial"] = {"alpha": alpha, "summaries": [s.to_json() for s in summaries]}
                    save([f"## Zipf alpha {alpha} (partial: {', '.join(s.mode for s in summaries)})", "",
                          summary_table(summaries), ""])
                write_report(runs_dir / f"alpha{alpha:g}", runs, summaries, " ".join(sys.argv),
                             f"Zipf alpha {alpha}, {args.requests} requests")
                by = {s.mode: s for s in summaries if s.ttft_ms.get("p50")}     # modes where some request succeeded
                checks = {}
                if "full" in by and "tessera" in by:
                    t, f = by["tessera"], by["full"]
                    checks["ttft_p50_vs_full"] = f.ttft_ms["p50"] / t.ttft_ms["p50"]
                    checks["throughput_vs_full"] = t.total_token_throughput / f.total_token_throughput
                    # the same, counted while the load was on (no start-up, no drain); None: no such window
                    steady = t.steady_total_token_throughput, f.steady_total_token_throughput
                    checks["steady_throughput_vs_full"] = steady[0] / steady[1] if all(steady) else None
                if "blend_copy" in by and "tessera" in by:
                    checks["ttft_p50_vs_blend_copy"] = by["blend_copy"].ttft_ms["p50"] / by["tessera"].ttft_ms["p50"]
                results.pop("partial", None)
                registered = getattr(replay_target, "register_seconds", {})
                results["runs"].append({"alpha": alpha, "summaries": [s.to_json() for s in summaries],
                                        "ratios": checks, "register_seconds": registered, "time_budget": budgets})
                md += [f"## Zipf alpha {alpha}", "", summary_table(summaries), "",
                       "Decode worker, shared chunks by source: " + "; ".join(
                           f"{m}: " + ", ".join(f"{k} {v:.0f}"
                                                for k, v in sorted(sources.get(f"{alpha:g}/{m}", {}).items()))
                           for m in modes), "",
                       "Where the time went (the workers' counters over each mode's replay; busy: share of the "
                       "replay's wall time; GPU busy: nvidia-smi's utilisation, any kernel of any process, the mean "
                       "over the run's GPUs; worker CPU: a worker process's CPU time over the replay, 100% = one core, "
                       "the mean over the role's workers):", "",
                       *BUDGET_HEADER, *(budget_line(m, budgets[m]) for m in modes if m in budgets), "",
                       "Hand-offs by transport: " + "; ".join(f"{m}: " + (", ".join(
                           f"{t} {n:.0f}" for t, n in budgets[m]["handoffs_by_transport"].items()) or "-")
                           for m in modes if m in budgets), "",
                       "Admissions whose evicted chunks went back to be read off the decode engine thread (restaged), "
                       "and chunks admissions still read on it: " + "; ".join(
                           f"{m}: {budgets[m].get('decode_restaged', 0):.0f}, "
                           f"{budgets[m].get('decode_admission_reads', 0):.0f}" for m in modes if m in budgets), "",
                       *(line for m in modes if m in budgets and len(budgets[m]["workers"]) > 2 for line in (
                           f"Each worker, {m} (GPU busy by GPU: " + ", ".join(
                               f"{g} {u:.0f}%" for g, u in budgets[m]["gpu_busy_pct_by_gpu"].items()) + "):", "",
                           *WORKER_HEADER, *(worker_line(r) for r in budgets[m]["workers"]), "")),
                       "Ratios (targets: TTFT vs full >= 3, throughput vs full >= 2.5, TTFT vs blend_copy >= 1.3): "
                       + ", ".join(f"{k} " + ("-" if v is None else f"{v:.2f}x") for k, v in checks.items()), ""]
                if registered:
                    md += ["Corpus registered before the mode (not timed): " + ", ".join(
                        f"{m} {sec:.1f} s" for m, sec in registered.items()), ""]
                print("\n".join(md[-4:]), flush=True)
                save([])
            if rates:
                rate_modes = [m.strip() for m in (args.rate_modes or args.modes).split(",") if m.strip()]
                ratios = [r for r in RATE_RATIOS if {r[1], r[2]} <= set(rate_modes)]    # those the modes run allow
                rate_note = dict(requests=args.requests, max_seconds=args.max_seconds_per_rate,
                                 registered=getattr(sweep_target, "register_seconds", {}))

                def partial(mode: str, sweep: dict) -> None:
                    rows = rate_sweep_rows(sweep_summaries(sweep), ratios)
                    print(f"alpha {alpha:g} {mode}: rates done at {time.monotonic() - started:.0f} s", flush=True)
                    results["partial_rates"] = {"alpha": alpha, "rows": rows}
                    save(rate_sweep_md(f"{alpha} (partial: to {mode})", rows, plot=None, **rate_note))

                sweep = sweep_rates(trace, sweep_target, rcfg, rate_modes, rates, args.max_seconds_per_rate, partial)
                for rate, by_mode in sweep.items():
                    write_report(runs_dir / f"alpha{alpha:g}-rate{rate:g}", [run for run, _ in by_mode.values()],
                                 [s for _, s in by_mode.values()], " ".join(sys.argv),
                                 f"Zipf alpha {alpha}, {args.requests} requests, Poisson at {rate:g} req/s")
                rows = rate_sweep_rows(sweep_summaries(sweep), ratios)
                plot = Path(f"{args.out}_rates_alpha{alpha:g}.png")
                plot.parent.mkdir(parents=True, exist_ok=True)
                rate_sweep(rows, plot, f"Zipf alpha {alpha:g}: open loop, Poisson arrivals")
                results.pop("partial_rates", None)
                results["rate_sweeps"].append({
                    "alpha": alpha, "rates": rates, "max_seconds_per_rate": args.max_seconds_per_rate,
                    "rows": rows, "register_seconds": rate_note["registered"], "plot": plot.name,
                    "summaries": {f"{r:g}": [s.to_json() for _, s in by.values()] for r, by in sweep.items()}})
                md += rate_sweep_md(f"{alpha}", rows, plot=plot.name, **rate_note)
                print("\n".join(md[-8:]), flush=True)
                save([])
    finally:
        target.close()
        cluster.stop()
        if not args.no_ray:
            import ray

            ray.shutdown()
    save([])
    print(f"wrote {args.out}.json and {args.out}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
