"""What ``tessera simulate`` does once its arguments are parsed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from loadgen.sim.policies import SimConfig, SimResult, simulate
from loadgen.sim.shapes import ModelShape, format_bytes, parse_bytes
from loadgen.sim.sweep import SweepConfig, run_sweep, sweep_report
from loadgen.trace import LengthDist, SynthConfig, read_trace


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.console import Console
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                    disable=not sys.stderr.isatty())


def _result_line(r: SimResult) -> str:
    return (f"{r.policy:<24} {r.eviction:<7} budget {format_bytes(r.budget_bytes):>10}  "
            f"hit ratio {100 * r.hit_ratio:6.2f}%  ({r.hit_tokens}/{r.chunk_tokens} chunk tokens, "
            f"{r.chunk_hits}/{r.chunk_accesses} chunks)  inserted {format_bytes(r.inserted_bytes)}  "
            f"evicted {format_bytes(r.evicted_bytes)} in {r.evictions} evictions  "
            f"peak {format_bytes(r.peak_bytes)}")


def run_simulate(args: argparse.Namespace) -> int:
    shape = ModelShape.from_name(args.model_shape)
    budget = parse_bytes(args.budget_bytes)
    configs = [SimConfig(p.strip(), budget, shape, args.eviction)
               for p in args.policy.split(",") if p.strip()]
    if not configs:
        raise ValueError("--policy names no policy")
    trace = read_trace(args.trace)
    results = []
    with _progress() as bar:
        for cfg in configs:
            task = bar.add_task(cfg.policy, total=len(trace))
            results.append(simulate(trace, cfg, progress=lambda: bar.advance(task)))
    if args.json:
        payload = results[0].to_json() if len(results) == 1 else {
            "trace": str(args.trace), "results": [r.to_json() for r in results]}
        print(json.dumps(payload))
    else:
        print(f"{args.trace}: {len(trace)} requests, {shape.name} "
              f"({shape.kv_bytes_per_token} B/token)")
        for r in results:
            print(_result_line(r))
    return 0


def sweep_config_from_args(args: argparse.Namespace) -> SweepConfig:
    trace = SynthConfig(
        docs=args.docs, chunks_per_request=args.chunks_per_request,
        doc_tokens=LengthDist.parse(args.doc_tokens), requests=args.requests, seed=args.seed,
        with_replacement=args.with_replacement)
    try:
        alphas = tuple(float(a) for a in args.alphas.split(",") if a.strip())
    except ValueError:
        raise ValueError(f"--alphas must be comma-separated numbers, got {args.alphas!r}") from None
    budgets = tuple(b.strip() for b in args.budgets.split(",") if b.strip())
    return SweepConfig(trace=trace, budgets=budgets, alphas=alphas,
                       shape=ModelShape.from_name(args.model_shape), eviction=args.eviction)


def sweep_command(cfg: SweepConfig) -> str:
    """The command line that reproduces ``cfg`` (every option spelled out)."""
    t = cfg.trace
    return " ".join([
        "tessera simulate --sweep", f"--budgets {','.join(cfg.budgets)}",
        f"--alphas {','.join(f'{a:g}' for a in cfg.alphas)}", f"--docs {t.docs}",
        f"--chunks-per-request {t.chunks_per_request}", f"--doc-tokens {t.doc_tokens.spec()}",
        f"--requests {t.requests}", f"--seed {t.seed}", f"--model-shape {cfg.shape.name}",
        f"--eviction {cfg.eviction}", *(["--with-replacement"] if t.with_replacement else [])])


def run_sweep_command(args: argparse.Namespace) -> int:
    cfg = sweep_config_from_args(args)
    command = sweep_command(cfg)
    total = len(cfg.alphas) * len(cfg.budgets) * len(cfg.policies)
    with _progress() as bar:
        task = bar.add_task("sweep", total=total)
        results = run_sweep(cfg, on_step=lambda d: bar.update(task, advance=1, description=d))
    report = sweep_report(cfg, results, command)
    payload = {"command": command, "trace": cfg.trace.describe(alpha="α"),
               "model_shape": cfg.shape.name, "kv_bytes_per_token": cfg.shape.kv_bytes_per_token,
               "eviction": cfg.eviction, "alphas": list(cfg.alphas), "budgets": list(cfg.budgets),
               "results": [dict(r.to_json(), alpha=a) for r, a in zip(
                   results, [a for a in cfg.alphas for _ in range(total // len(cfg.alphas))])]}
    if args.json:
        print(json.dumps(payload))
    else:
        print(report)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".md").write_text(report)
        out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
        print(f"wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)
    return 0
