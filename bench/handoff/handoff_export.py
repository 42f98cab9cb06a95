"""The prefill hand-off's export on the engine thread: wall time, ops and host syncs around the first token.

A prefill worker runs requests one after another on one engine thread; what ``Engine.prefill_handoff``
does after the first token is sampled (``on_logits``: here an argmax read on the host, a sync like the
worker's sampling) holds up the next request. This meter runs ``prefill_handoff`` in a reuse mode (all
chunks resident, as after warm-up) and reports, per pass:
  after   engine-thread time from ``on_logits`` returning to ``prefill_handoff`` returning (the export and
          the release of the sequence), its aten ops, the ops that launch a kernel or a copy on CUDA, and
          its host syncs;
  before  the export's own work before ``on_logits`` (calls into services.handoff.export made then):
          it delays the first token by that much;
  gpu     (CUDA) from ``on_logits`` returning until the GPU has finished the export's work.
Syncs: on CUDA torch's sync debug mode counts them (as bench/engine/engine.py's count_syncs does); on the
CPU the ops that would sync on CUDA are counted instead (nonzero, item, unique, Tensor.tolist, and
``torch.tensor(..., device=...)`` from a Python list).

    .venv/bin/python bench/handoff/handoff_export.py [--baseline]                  # CPU: a small random Llama, 32 layers
    python3 bench/handoff/handoff_export.py --device cuda [--baseline] [--contend]  # Llama-3-8B shape, bf16 (GPU)

``--baseline`` also runs the export as it was before it was staged (tests/handoff/handoff_reference.py),
interleaved with the current one pass by pass.

``--contend`` (CUDA) runs a second process issuing matmuls on the same GPU while measuring: the GPU is
then time-sliced between two processes as in the cluster benchmark (prefill and decode workers sharing
one GPU), and each host sync waits for this process's turn.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import services.engine.engine as engine_mod  # noqa: E402
import services.handoff.export as handoff_mod  # noqa: E402
from services.engine import Engine, ModelConfig  # noqa: E402
from services.engine.model.tiny import random_weights, tiny_config  # noqa: E402

SYNC = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero", "unique", "_unique2"}
FREE = {"empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
        "new_empty_strided.default", "lift_fresh.default", "alias.default", "view.default", "_unsafe_view.default"}
CONTEND = ("import torch\na = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
           "while True:\n    for _ in range(50):\n        a @ a\n    torch.cuda.synchronize()\n")


class OpMeter(TorchDispatchMode):
    """Counts aten ops, launching ops (views and bare allocations left out) and likely syncs while on."""

    def __init__(self, phase):
        super().__init__()
        self.phase = phase          # () -> "before" / "after" / None (not counted)
        self.ops, self.launches, self.syncs = Counter(), Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        phase = self.phase()
        if phase is not None:
            self.ops[phase] += 1
            if not func.is_view and func.__name__ not in FREE:
                self.launches[phase] += 1
            base = func._schema.name.split("::")[-1]
            if base in SYNC:
                self.syncs[f"{phase}: {base}"] += 1
        return out


def build(args) -> Engine:
    if args.device == "cuda":
        from bench.engine.engine import LLAMA3_8B
        from bench.engine_host.host_ops import llama_shapes

        cfg = ModelConfig.from_hf_dict(dict(LLAMA3_8B, num_hidden_layers=args.layers))
        g = torch.Generator(device="cuda").manual_seed(0)
        state = {name: (torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
                        if not name.endswith("norm.weight") else torch.ones(shape, device="cuda", dtype=torch.bfloat16))
                 for name, shape in llama_shapes(cfg).items()}
        return Engine.from_state_dict(cfg, state, device="cuda", dtype=torch.bfloat16, kv_cache_bytes=12 << 30)
    cfg = tiny_config("llama3", num_layers=args.layers, vocab_size=1024, hidden_size=args.hidden,
                      intermediate_size=2 * args.hidden, num_heads=4, num_kv_heads=2, head_dim=args.hidden // 4)
    return Engine.from_state_dict(cfg, random_weights(cfg, 0), device="cpu", dtype=torch.float32,
                                  static_tails=True, kv_cache_bytes=256 << 20)


class Timed:
    """Wraps the functions engine.py imports from services.handoff.wire: host time of their outermost
    calls, split at the first token (``first`` set by the caller)."""

    def __init__(self, cuda_syncs: bool = False):
        self.before = 0.0
        self.first = False
        self.cuda_syncs = cuda_syncs    # sync debug mode on inside these calls (before the first token)
        self.depth = 0
        self._saved = {}
        for name in dir(engine_mod):
            fn = getattr(engine_mod, name)
            if callable(fn) and getattr(fn, "__module__", None) == handoff_mod.__name__ and not isinstance(fn, type):
                self._saved[name] = fn
                setattr(engine_mod, name, self._wrap(fn))

    def _wrap(self, fn):
        def call(*a, **kw):
            self.depth += 1
            watch = self.cuda_syncs and not self.first and self.depth == 1
            if watch:
                torch.cuda.set_sync_debug_mode("warn")
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
                if not self.first and not self.depth:
                    self.before += time.perf_counter() - t0
                if watch:
                    torch.cuda.set_sync_debug_mode("default")
        return call

    def restore(self):
        for name, fn in self._saved.items():
            setattr(engine_mod, name, fn)


class Baseline:
    """While on: prefill_handoff exports as before the staging (tests/handoff/handoff_reference.py)."""

    def __enter__(self):
        from tests.handoff.handoff_reference import reference_export

        self._saved = engine_mod.stage_export, engine_mod.export_sequence
        engine_mod.stage_export = lambda fwd, seq, logits: None
        engine_mod.export_sequence = (lambda fwd, seq, logits, fp, kv_on_device=False, staged=None:
                                      reference_export(fwd, seq, logits, fp, kv_on_device))
        return self

    def __exit__(self, *exc):
        engine_mod.stage_export, engine_mod.export_sequence = self._saved


def one_pass(eng: Engine, chunks, suffix, mode: str, ratio: float, kv_on_device: bool, meter: bool,
             baseline: bool = False):
    if baseline:
        with Baseline():
            return one_pass(eng, chunks, suffix, mode, ratio, kv_on_device, meter)
    cuda = eng.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timed = Timed(cuda_syncs=cuda and meter)
    phase = lambda: "after" if timed.first else ("before" if timed.depth else None)  # noqa: E731
    counter = OpMeter(phase) if meter else None
    marks = {}
    tolist, tensor = torch.Tensor.tolist, torch.tensor
    host_reads = Counter()

    def count_tolist(self, *a, **kw):
        if counter is not None and phase():
            host_reads[f"{phase()}: tolist"] += 1
        return tolist(self, *a, **kw)

    def count_tensor(data, *a, **kw):
        if counter is not None and phase() and kw.get("device") is not None and not isinstance(data, torch.Tensor):
            host_reads[f"{phase()}: tensor(list, device)"] += 1
        return tensor(data, *a, **kw)

    def on_logits(logits):
        int(logits.argmax())           # the worker's sampling reads the token on the host: a sync
        marks["first"], marks["first_cpu"] = time.perf_counter(), time.thread_time()
        timed.first = True
        if cuda and meter:
            torch.cuda.set_sync_debug_mode("warn")

    sync()
    if meter:
        torch.Tensor.tolist, torch.tensor = count_tolist, count_tensor
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if counter is not None:
                    counter.__enter__()
                t0 = time.perf_counter()
                _, h = eng.prefill_handoff(chunks, suffix, mode=mode, recompute_ratio=ratio, on_logits=on_logits,
                                           kv_on_device=kv_on_device)
                t_end, t_end_cpu = time.perf_counter(), time.thread_time()
            finally:
                if counter is not None:
                    counter.__exit__(None, None, None)
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            sync()
            t_gpu = time.perf_counter()
    finally:
        torch.Tensor.tolist, torch.tensor = tolist, tensor
        timed.restore()
    row = {"after_ms": (t_end - marks["first"]) * 1e3, "after_cpu_ms": (t_end_cpu - marks["first_cpu"]) * 1e3,
           "before_ms": timed.before * 1e3,
           "gpu_ms": (t_gpu - marks["first"]) * 1e3, "pass_ms": (t_end - t0) * 1e3,
           "private_tokens": sum(lv.positions.numel() for lv in h.layers)}
    if meter:
        syncs = Counter(counter.syncs)
        syncs.update(host_reads)
        row.update(ops=dict(counter.ops), launches=dict(counter.launches), likely_syncs=dict(syncs))
        if cuda:
            hits = [w for w in caught if "synchroniz" in str(w.message)]
            row["cuda_syncs"] = len(hits)
            row["cuda_sync_sites"] = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in hits})
    return row


def report(row: dict) -> str:
    line = (f"{row['mode']}@{row['ratio']} {row['export']}: after the first token {row['after_ms']:.3f} ms "
            f"({row['after_cpu_ms']:.3f} ms thread CPU; GPU done {row['gpu_ms']:.3f} ms), export before it "
            f"{row['before_ms']:.3f} ms; pass {row['pass_ms']:.1f} ms; {row['private_tokens']} private token-layers\n"
            f"  ops after/before the first token: {row['ops'].get('after', 0)}/{row['ops'].get('before', 0)}, "
            f"launches {row['launches'].get('after', 0)}/{row['launches'].get('before', 0)}; "
            f"likely syncs {row['likely_syncs'] or 'none'}")
    if "cuda_syncs" in row:
        line += f"\n  CUDA syncs in the export: {row['cuda_syncs']} at {row['cuda_sync_sites']}"
    return line


def interleaved(run, variants: list[str], reps: int, times: tuple[str, ...]) -> list[dict]:
    """``run(variant, meter) -> dict`` for each variant: twice to warm up, ``reps`` times interleaved (a busy
    machine slows every variant alike), then once metered. A row per variant: its name, the medians of
    ``times`` and the metered call's other fields."""
    for variant in variants:
        run(variant, False)
        run(variant, False)
    timed = {v: [] for v in variants}
    for _ in range(reps):
        for variant in variants:
            timed[variant].append(run(variant, False))
    rows = []
    for variant in variants:
        metered = run(variant, True)
        rows.append({"variant": variant, **{k: statistics.median(r[k] for r in timed[variant]) for k in times},
                     **{k: v for k, v in metered.items() if k not in times}})
    return rows


@contextlib.contextmanager
def contention(on: bool):
    """With ``on`` (``--contend``, CUDA), a second process issues matmuls on the GPU while the block runs, so
    that the GPU is time-sliced as between the cluster's two workers; yields whether it does."""
    other = subprocess.Popen([sys.executable, "-c", CONTEND]) if on else None
    if other is not None:
        time.sleep(3.0)
    try:
        yield other is not None
    finally:
        if other is not None:
            other.kill()
            other.wait()


def request(args) -> tuple[list[list[int]], list[int]]:
    """The measured request: ``--chunks`` chunks of ``--chunk-tokens`` and a ``--suffix-tokens`` suffix."""
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, 1000, (args.chunk_tokens,), generator=g).tolist() for _ in range(args.chunks)]
    return chunks, torch.randint(0, 1000, (args.suffix_tokens,), generator=g).tolist()


def add_shared_args(ap: argparse.ArgumentParser) -> None:
    """The options this meter and bench/handoff/handoff_import.py share: model and request shape (see ``build``),
    repetitions, GPU contention and the JSON record."""
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=64, help="the CPU model's width")
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--contend", action="store_true", help="CUDA: a second process keeps the GPU busy")
    ap.add_argument("--json", help="also write the rows here")


def parse_shared(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed options; --device cuda without a CUDA device stops here."""
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device")
    return args


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shared_args(ap)
    ap.add_argument("--modes", default="tessera@0.15,tessera@0")
    ap.add_argument("--host-kv", action="store_true", help="copy the K/V to the host (kv_on_device=False)")
    ap.add_argument("--baseline", action="store_true",
                    help="also the export as it was before (tests/handoff/handoff_reference.py), interleaved")
    args = parse_shared(ap)
    chunks, suffix = request(args)
    eng = build(args)
    kv_on_device = args.device == "cuda" and not args.host_kv
    variants = ["reference", "staged"] if args.baseline else ["staged"]
    times = ("after_ms", "after_cpu_ms", "before_ms", "gpu_ms", "pass_ms")
    rows = []
    with contention(args.contend) as contended, torch.no_grad():
        print(f"{args.device}, {eng.cfg.num_layers} layers, {args.chunks} x {args.chunk_tokens} + {args.suffix_tokens} "
              f"tokens, kv_on_device={kv_on_device}{', GPU contended' if contended else ''}", flush=True)
        for spec in args.modes.split(","):
            mode, _, ratio = spec.partition("@")
            ratio = float(ratio or 0.0)
            run = lambda variant, meter: one_pass(eng, chunks, suffix, mode, ratio, kv_on_device,  # noqa: E731
                                                  meter, baseline=variant == "reference")
            for row in interleaved(run, variants, args.reps, times):   # chunks resident, graphs captured
                rows.append({"mode": mode, "ratio": ratio, "export": row.pop("variant"), **row})
                print(report(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
