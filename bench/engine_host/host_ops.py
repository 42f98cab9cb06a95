"""Host work of one prefill pass, measured on the CPU: aten ops dispatched and host time per phase.

On a GPU every non-view aten op is a kernel launch (or a copy) that the host issues one by one; a
pass whose GPU work is short (tessera@0: one graph replay) is bound by them. This meter runs the
engine on the CPU with a small random Llama (the request shape of bench/engine/engine.py: 6 chunks x 512
tokens + 64, few layers, static tails forced on as on CUDA) and counts, per phase of one pass:
  ops      every aten op dispatched (TorchDispatchMode), views included;
  launches the ops that would launch a kernel or a copy on CUDA (views and bare allocations left out);
  syncs    ops that would make the host wait for the GPU: item()/tolist()/bool(tensor) (a local
           scalar read), nonzero/masked_select/equal, and a Python scalar written into a tensor
           element (``t[i] = x`` copies a 0-dim host tensor);
  host ms  wall time of the phase's ops and of the Python between them (on the CPU this includes
           the ops' own compute; the model here is small so that it stays a minor part).
Phases are named by the engine function an op comes from (innermost match on the Python stack; ops
inside a static tail's body count as ``tail graph``: on CUDA they are one graph replay). ``before
model`` counts the launches issued before the first model op (embedding, layer 0): on a GPU idle
at the start of a request, the time it waits for its first real work.

    .venv/bin/python bench/engine_host/host_ops.py [--layers 4] [--modes tessera@0.15,tessera@0,prefix] [--json out.json]

On a GPU (``--device cuda``, the Llama-3-8B shape of bench/engine/engine.py unless --layers/--hidden say
otherwise) it also times each pass: ``issue`` = host time until prefill returns (nothing waits for the
GPU at the end of a pass), ``wall`` = until the GPU is done, both after a synchronise; issue close to
wall means the host paced the pass, and its GPU was idle for part of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.engine import Engine  # noqa: E402
from services.engine.model.tiny import random_weights, tiny_config  # noqa: E402

# (phase, qualified names of engine functions): the innermost frame that matches names an op's phase
PHASES = [
    ("validate", {"Engine._validate"}),
    ("place", {"Forward._place", "chunk_id"}),
    ("tables", {"ChunkLayout.__init__", "ChunkLayout.shared_tables", "BlockTable.for_run", "BlockTable.cat",
                "BlockTable.from_host", "Forward._private", "Forward.chunk_table", "host_to_device",
                "RequestTables.__init__", "RequestTables.post_selection", "ChunkEntry.device_view",
                "Forward.chunk_view", "pack"}),
    ("selection", {"select_hkvd", "ChunkLayout.cached_kv", "RequestTables.cached_kv"}),
    ("attention", {"TorchAttention.prefill", "TritonAttention.prefill"}),
    ("kv write", {"BlockPool.write"}),
    ("model", {"Transformer.embed", "Transformer.attention_inputs", "Transformer.finish_layer",
               "Transformer.logits"}),
    ("tail fill", {"StaticTail.fill", "TailCache.run", "TorchStatic.fill", "TritonStatic.fill", "KeyedTails.get"}),
]
GRAPH = "StaticTail._body"
NAME_TO_PHASE = {name: phase for phase, names in PHASES for name in names}
ORDER = ["validate", "place", "tables", "model", "attention", "kv write", "selection", "tail fill", "other",
         "tail graph"]
ALLOC = {"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
         "new_empty_strided.default", "lift_fresh.default", "_to_copy.default"}
SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "_unique2"}


def is_view(func) -> bool:
    return func.is_view or func.__name__ in ("view.default", "_unsafe_view.default", "alias.default")


class HostMeter(TorchDispatchMode):
    """Counts ops, kernel-launching ops, likely syncs and host time per phase while active."""

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.syncs = Counter(), Counter(), Counter()
        self.seconds = defaultdict(float)
        self.sync_sites: Counter = Counter()
        self.before_model = None   # launches before the first model op
        self._launched = 0
        self._last = None

    def _phase(self):
        frame, found, site = sys._getframe(2), None, None
        while frame is not None:
            code = frame.f_code
            if code.co_qualname == GRAPH:
                return "tail graph", site
            if "services/engine" in code.co_filename and site is None:
                site = f"{Path(code.co_filename).name}:{frame.f_lineno}"
            if found is None:
                found = NAME_TO_PHASE.get(code.co_qualname)
            frame = frame.f_back
        return found or "other", site

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        t_in = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        t_done = time.perf_counter()
        phase, site = self._phase()
        self.ops[phase] += 1
        view = is_view(func)
        name = func.__name__
        if not view and name not in ALLOC:
            self.launches[phase] += 1
            self._launched += 1
        base = func._schema.name.split("::")[-1]
        scalar_set = (base in ("copy_", "index_put_") and len(args) > 1 and isinstance(args[1], torch.Tensor)
                      and args[1].dim() == 0 and (base == "index_put_" or args[0].dim() == 0))
        if base in SYNC or scalar_set:
            self.syncs[phase] += 1
            self.sync_sites[f"{site} ({base})"] += 1
        if phase == "model" and self.before_model is None:
            self.before_model = self._launched - 1
        self.seconds[phase] += (t_in - self._last if self._last is not None else 0.0) + (t_done - t_in)
        self._last = time.perf_counter()
        return out


def llama_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """Hugging Face names and shapes of a Llama checkpoint's tensors."""
    hd, hid = cfg.head_dim, cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, hid), "model.norm.weight": (hid,),
              "lm_head.weight": (cfg.vocab_size, hid)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hid,), p + "post_attention_layernorm.weight": (hid,),
                       p + "self_attn.q_proj.weight": (cfg.num_heads * hd, hid),
                       p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, hid),
                       p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, hid),
                       p + "self_attn.o_proj.weight": (hid, cfg.num_heads * hd),
                       p + "mlp.gate_proj.weight": (cfg.intermediate_size, hid),
                       p + "mlp.up_proj.weight": (cfg.intermediate_size, hid),
                       p + "mlp.down_proj.weight": (hid, cfg.intermediate_size)})
    return shapes


def bench_request(vocab: int, chunks: int = 6, chunk_tokens: int = 512, suffix_tokens: int = 64, seed: int = 1):
    """bench/engine/engine.py's request shape: ``chunks`` random chunks of ``chunk_tokens`` ids below ``vocab`` and a
    ``suffix_tokens`` suffix, as lists (the same ids for the same seed)."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(0, vocab, (chunk_tokens,), generator=g).tolist() for _ in range(chunks)]
    return parts, torch.randint(0, vocab, (suffix_tokens,), generator=g).tolist()


def build_engine(args, backend: str) -> Engine:
    if args.device == "cuda":
        from bench.engine.engine import LLAMA3_8B
        from services.engine import ModelConfig

        hf = dict(LLAMA3_8B, num_hidden_layers=args.layers or 32)
        cfg = ModelConfig.from_hf_dict(hf)
        g = torch.Generator(device="cuda").manual_seed(0)
        state = {name: (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
                        if not name.endswith("norm.weight") else torch.ones(shape, device="cuda", dtype=torch.bfloat16))
                 for name, shape in llama_shapes(cfg).items()}
        return Engine.from_state_dict(cfg, state, device="cuda", dtype=torch.bfloat16, attention_backend=backend,
                                      kv_cache_bytes=12 << 30)
    cfg = tiny_config("llama3", num_layers=args.layers, vocab_size=1024, hidden_size=args.hidden,
                      intermediate_size=2 * args.hidden, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4)
    return Engine.from_state_dict(cfg, random_weights(cfg, 0), device="cpu", dtype=torch.float32,
                                  attention_backend=backend, static_tails=True, kv_cache_bytes=256 << 20)


def measure(eng: Engine, chunks, suffix, mode: str, ratio: float, reps: int) -> dict:
    call = lambda: eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)  # noqa: E731
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    call()  # warms the chunk cache and the tails
    call()
    walls, issues, firsts = [], [], []
    model = eng.forward.model
    embed = model.embed
    seen = []
    model.embed = lambda ids: (seen.append(time.perf_counter()), embed(ids))[1]  # the first model op
    replay = torch.cuda.CUDAGraph.replay  # or the first graph replay, where the embedding is inside a graph
    torch.cuda.CUDAGraph.replay = lambda graph: (seen.append(time.perf_counter()), replay(graph))[1]
    try:
        for _ in range(reps):
            sync()
            seen.clear()
            t0 = time.perf_counter()
            call()
            issues.append(time.perf_counter() - t0)
            sync()
            walls.append(time.perf_counter() - t0)
            firsts.append(seen[0] - t0)
    finally:
        del model.embed
        torch.cuda.CUDAGraph.replay = replay
    replay_ms = []
    if cuda:  # host time of each graph launch in one pass
        replay = torch.cuda.CUDAGraph.replay

        def timed_replay(graph):
            t0 = time.perf_counter()
            replay(graph)
            replay_ms.append((time.perf_counter() - t0) * 1e3)

        torch.cuda.CUDAGraph.replay = timed_replay
        try:
            sync()
            call()
            sync()
        finally:
            torch.cuda.CUDAGraph.replay = replay
    meter = HostMeter()
    with meter:
        call()
    sync()
    return {"mode": mode, "ratio": ratio, "wall_ms": statistics.median(walls) * 1e3,
            "issue_ms": statistics.median(issues) * 1e3, "graph_launch_ms": replay_ms,
            "first_model_op_ms": statistics.median(firsts) * 1e3,
            "ops": dict(meter.ops), "launches": dict(meter.launches), "syncs": dict(meter.syncs),
            "host_ms": {k: v * 1e3 for k, v in meter.seconds.items()}, "before_model": meter.before_model,
            "sync_sites": dict(meter.sync_sites.most_common(12))}


def gpu_gaps(eng: Engine, chunks, suffix, mode: str, ratio: float, top: int = 12) -> str:
    """Where the GPU of one pass stands idle: a torch profile's kernels in time order, each gap of 20 us or
    more attributed to the engine function that launched the kernel after it (the GPU waited for it)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e),
                 key=lambda e: e["ts"])
    launches = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime" and "args" in e}
    pyfuncs = [e for e in events if e.get("cat") == "python_function" and "dur" in e
               and ("services/engine" in e["name"] or "kernels/" in e["name"])]
    call = [e for e in events if e.get("cat") == "cpu_op" or e.get("cat") == "python_function"]
    start = min(e["ts"] for e in call)
    busy = sum(e["dur"] for e in gpu)
    gaps, prev_end = [], start
    for e in gpu:
        gap = e["ts"] - prev_end
        if gap >= 20:
            launch = launches.get(e["args"].get("correlation"))
            t = launch["ts"] if launch else e["ts"]
            inner = [p for p in pyfuncs if p["ts"] <= t <= p["ts"] + p["dur"]]
            where = min(inner, key=lambda p: p["dur"])["name"] if inner else "?"
            gaps.append((gap, where.split("/")[-1][:70], e["name"][:40]))
        prev_end = max(prev_end, e["ts"] + e["dur"])
    end = max(e["ts"] + e["dur"] for e in gpu)
    lines = [f"{mode}@{ratio}: GPU busy {busy / 1e3:.2f} ms of {(end - start) / 1e3:.2f} ms from the call's first "
             f"host op to its last kernel; idle {sum(g[0] for g in gaps) / 1e3:.2f} ms in {len(gaps)} gaps >= 20 us"]
    by_site: dict = defaultdict(float)
    for gap, where, _ in gaps:
        by_site[where] += gap
    for where, us in sorted(by_site.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / 1e3:6.2f} ms waiting for {where}")
    return "\n".join(lines)


# host functions of a pass, timed by --timeline: (module, qualified name)
TIMELINE = [
    ("services.engine.engine", "Engine.prefill"), ("services.engine.engine", "Engine._validate"),
    ("services.engine.passes.forward", "Forward._place"), ("services.engine.passes.forward", "chunk_id"),
    ("services.engine.passes.blend", "RequestTables.__init__"), ("services.engine.passes.blend", "RequestTables.shared_base"),
    ("services.engine.model.layers", "Transformer.embed"), ("services.engine.passes.forward", "Forward.run_layers"),
    ("services.engine.graphs.tails", "TailCache.run"), ("services.engine.graphs.tails", "StaticTail.fill"),
    ("services.engine.graphs.tails", "StaticTail.run"), ("services.engine.model.layers", "Transformer.logits"),
    ("services.engine.engine", "Engine.release"), ("services.engine.graphs.reuse_tail", "reuse_tail_pass"),
    ("services.engine.graphs.reuse_tail", "pack"), ("services.engine.graphs.tails", "KeyedTails.get"),
    ("services.engine.graphs.blend_tail", "blend_tail_pass"), ("services.engine.graphs.blend_tail", "pack"),
    ("services.engine.graphs.blend_tail", "applies"), ("services.engine.graphs.reuse_tail", "StagedInputs.load"),
]


def timeline(eng: Engine, chunks, suffix, mode: str, ratio: float, reps: int) -> dict:
    """Unmetered host timeline of a pass: each TIMELINE function's inclusive time and when it first starts
    (from the call's start), by light wrappers (~1 us each); ``graph`` = when the first graph replay is
    issued: on a GPU idle at the start of a request, what the request waits before its real work."""
    import importlib

    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spans: dict[str, list] = defaultdict(list)
    undo = []

    def wrap(owner, attr, name):
        fn = getattr(owner, attr)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spans[name].append((t0, time.perf_counter()))
        setattr(owner, attr, timed)
        undo.append((owner, attr, fn))

    for module, qual in TIMELINE:
        mod = importlib.import_module(module)
        owner, _, attr = qual.rpartition(".")
        wrap(getattr(mod, owner) if owner else mod, attr, qual)
    if cuda:
        wrap(torch.cuda.CUDAGraph, "replay", "graph replay")
    rows: dict[str, list] = defaultdict(list)
    try:
        for i in range(reps + 2):
            sync()
            spans.clear()
            t0 = time.perf_counter()
            eng.prefill(chunks, suffix, mode=mode, recompute_ratio=ratio)
            t_ret = time.perf_counter()
            sync()
            t_end = time.perf_counter()
            if i < 2:
                continue  # warm-up
            rows["returned"].append((t_ret - t0, t_ret - t0))
            rows["GPU done"].append((t_end - t0, t_end - t0))
            for name, s in spans.items():
                rows[name].append((s[0][0] - t0, sum(b - a for a, b in s)))
    finally:
        for owner, attr, fn in reversed(undo):
            setattr(owner, attr, fn)
    return {name: {"start_ms": statistics.median(a for a, _ in v) * 1e3,
                   "total_ms": statistics.median(b for _, b in v) * 1e3} for name, v in rows.items()}


def timeline_table(label: str, tl: dict) -> str:
    lines = [f"{label}: host timeline (median of passes; ms from the call's start)",
             f"  {'function':28s} {'starts at':>9s} {'inclusive':>9s}"]
    for name, r in sorted(tl.items(), key=lambda kv: kv[1]["start_ms"]):
        lines.append(f"  {name:28s} {r['start_ms']:9.3f} {r['total_ms']:9.3f}")
    return "\n".join(lines)


def table(row: dict) -> str:
    lines = [f"{row['mode']}@{row['ratio']}: {row['wall_ms']:.1f} ms a pass unmetered ({row['issue_ms']:.1f} ms "
             f"until it returned); {row['before_model']} launches and {row['first_model_op_ms']:.2f} ms before the first "
             "model op"
             + (f"; graph launches {', '.join(f'{m:.2f}' for m in row['graph_launch_ms'])} ms of host time"
                if row["graph_launch_ms"] else ""),
             f"  {'phase':12s} {'ops':>6s} {'launches':>9s} {'syncs':>6s} {'host ms':>8s}"]
    for phase in ORDER:
        if phase in row["ops"]:
            lines.append(f"  {phase:12s} {row['ops'][phase]:6d} {row['launches'].get(phase, 0):9d} "
                         f"{row['syncs'].get(phase, 0):6d} {row['host_ms'].get(phase, 0.0):8.2f}")
    eager = {k: v for k, v in row["launches"].items() if k != "tail graph"}
    lines.append(f"  {'outside graph':12s} {sum(v for k, v in row['ops'].items() if k != 'tail graph'):6d} "
                 f"{sum(eager.values()):9d} {sum(v for k, v in row['syncs'].items() if k != 'tail graph'):6d} "
                 f"{sum(v for k, v in row['host_ms'].items() if k != 'tail graph'):8.2f}")
    if row["sync_sites"]:
        lines.append("  sync sites: " + ", ".join(f"{k} x{v}" for k, v in row["sync_sites"].items()))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=None, help="4 on the CPU, 32 on CUDA")
    ap.add_argument("--hidden", type=int, default=64, help="the CPU model's width")
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--modes", default="tessera@0.15,tessera@0,prefix@0")
    ap.add_argument("--backends", default="torch", help="torch,triton on CUDA (on a CPU Triton runs only interpreted)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--gaps", action="store_true", help="CUDA: where the GPU stands idle in each pass (profiled)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="also cProfile N passes of each mode and print the functions by own time")
    ap.add_argument("--timeline", action="store_true",
                    help="also an unmetered host timeline of each pass (when each engine function runs, and for how long)")
    args = ap.parse_args()
    if args.device == "cpu":
        args.layers = args.layers or 4
    torch.manual_seed(0)
    chunks, suffix = bench_request(1000, args.chunks, args.chunk_tokens, args.suffix_tokens)
    rows = []
    for backend in args.backends.split(","):
        eng = build_engine(args, backend)
        print(f"backend {backend}, {args.device}, {eng.cfg.num_layers} layers", flush=True)
        with torch.no_grad():
            for spec in args.modes.split(","):
                mode, _, ratio = spec.partition("@")
                rows.append(dict(measure(eng, chunks, suffix, mode, float(ratio or 0.0), args.reps), backend=backend))
                print(table(rows[-1]), flush=True)
                if args.cprofile:
                    import cProfile
                    import pstats

                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(args.cprofile):
                        eng.prefill(chunks, suffix, mode=mode, recompute_ratio=float(ratio or 0.0))
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(30)
                if args.timeline:
                    rows[-1]["timeline"] = timeline(eng, chunks, suffix, mode, float(ratio or 0.0), args.reps)
                    print(timeline_table(f"{backend} {spec}", rows[-1]["timeline"]), flush=True)
                if args.gaps and args.device == "cuda":
                    print(gpu_gaps(eng, chunks, suffix, mode, float(ratio or 0.0)), flush=True)
        del eng
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
