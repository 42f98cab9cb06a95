"""What ``tessera simulate`` does once its arguments are parsed."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from loadgen.sim.policies import SimConfig, SimResult, simulate
from loadgen.sim.shapes import ModelShape, format_bytes, parse_bytes
from loadgen.sim.sweep import SweepConfig, run_sweep, sweep_report
from loadgen.trace import LengthDist, read_trace

# Options that describe the sweep's synthetic traces (argparse leaves them None when not given).
_RECIPE = ("--alphas", "--docs", "--chunks-per-request", "--doc-tokens", "--requests", "--seed",
           "--with-replacement")


def _given(args: argparse.Namespace, flags) -> list[str]:
    return [f for f in flags if getattr(args, f.lstrip("-").replace("-", "_")) is not None]


def _items(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def check_simulate_args(args: argparse.Namespace) -> None:
    """Refuse, in one line, an option that the command as given would not use."""
    if args.sweep:
        if args.budget_bytes is not None:
            raise ValueError("--sweep takes its budgets from --budgets, not --budget-bytes")
        recipe = _given(args, _RECIPE)
        if args.trace and recipe:
            raise ValueError(f"--sweep with TRACE sweeps budgets over that trace; {', '.join(recipe)} "
                             "describe synthetic traces: drop them, or drop TRACE")
        return
    if not args.trace:
        raise ValueError("give a TRACE file, or --sweep")
    sweep_only = _given(args, ("--budgets", *_RECIPE, "--output"))
    if sweep_only:
        raise ValueError(f"{', '.join(sweep_only)} only apply to --sweep")


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
    budgets = [parse_bytes(b) for b in _items(args.budget_bytes or "10GB")]
    policies = _items(args.policy or "tessera")
    if not budgets or not policies:
        raise ValueError("--budget-bytes names no budget" if not budgets else "--policy names no policy")
    configs = [SimConfig(p, b, shape, args.eviction) for p in policies for b in budgets]
    trace = read_trace(args.trace)
    results = []
    with _progress() as bar:
        for cfg in configs:
            task = bar.add_task(f"{cfg.policy} {format_bytes(cfg.budget_bytes)}", total=len(trace))
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
    """The sweep the arguments ask for; an option not given keeps ``SweepConfig``'s default."""
    base = SweepConfig()
    given = {k: v for k, v in (("docs", args.docs), ("chunks_per_request", args.chunks_per_request),
                               ("requests", args.requests), ("seed", args.seed),
                               ("with_replacement", args.with_replacement)) if v is not None}
    if args.doc_tokens is not None:
        given["doc_tokens"] = LengthDist.parse(args.doc_tokens)
    alphas = base.alphas
    if args.alphas is not None:
        try:
            alphas = tuple(float(a) for a in _items(args.alphas))
        except ValueError:
            raise ValueError(f"--alphas must be comma-separated numbers, got {args.alphas!r}") from None
    return SweepConfig(
        trace=replace(base.trace, **given), alphas=alphas,
        budgets=tuple(_items(args.budgets)) if args.budgets is not None else base.budgets,
        policies=tuple(_items(args.policy)) if args.policy is not None else base.policies,
        shape=ModelShape.from_name(args.model_shape), eviction=args.eviction, trace_file=args.trace)


def sweep_command(cfg: SweepConfig) -> str:
    """The command line that reproduces ``cfg`` (every option spelled out)."""
    t = cfg.trace
    common = [f"--budgets {','.join(cfg.budgets)}", f"--policy {','.join(cfg.policies)}",
              f"--model-shape {cfg.shape.name}", f"--eviction {cfg.eviction}"]
    if cfg.trace_file:
        return " ".join(["tessera simulate", shlex.quote(cfg.trace_file), "--sweep", *common])
    return " ".join([
        "tessera simulate --sweep", common[0],
        f"--alphas {','.join(f'{a:g}' for a in cfg.alphas)}", f"--docs {t.docs}",
        f"--chunks-per-request {t.chunks_per_request}", f"--doc-tokens {t.doc_tokens.spec()}",
        f"--requests {t.requests}", f"--seed {t.seed}", *common[1:],
        *(["--with-replacement"] if t.with_replacement else [])])


def run_sweep_command(args: argparse.Namespace) -> int:
    cfg = sweep_config_from_args(args)
    command = sweep_command(cfg)
    total = len(cfg.trace_labels()) * len(cfg.budgets) * len(cfg.policies)
    with _progress() as bar:
        task = bar.add_task("sweep", total=total)
        results = run_sweep(cfg, on_step=lambda d: bar.update(task, advance=1, description=d))
    report = sweep_report(cfg, results, command)
    rows = [r.to_json() for r in results]
    if not cfg.trace_file:   # run_sweep's order: alpha, then budget, then policy
        per_alpha = len(cfg.budgets) * len(cfg.policies)
        rows = [dict(row, alpha=cfg.alphas[i // per_alpha]) for i, row in enumerate(rows)]
    payload = {"command": command,
               "trace": cfg.trace_file or cfg.trace.describe(alpha="α"),
               "model_shape": cfg.shape.name, "kv_bytes_per_token": cfg.shape.kv_bytes_per_token,
               "eviction": cfg.eviction, "budgets": list(cfg.budgets),
               **({} if cfg.trace_file else {"alphas": list(cfg.alphas)}), "results": rows}
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
