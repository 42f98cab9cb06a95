"""``tessera replay TRACE --target ADDR [--rate R | --concurrency C] [--compare m1,m2] -o DIR``."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import shlex
import sys

from loadgen.replay.target import MODES
from services import env

_SDK_MISSING = ("tessera replay --target ADDR drives the cluster through its SDK (services.sdk), "
                "which this tree does not have yet; --target fake runs the load generator against "
                "an in-process synthetic target (made-up latencies) instead")


def register_replay(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "replay", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="replay a trace against the cluster and report TTFT, TPOT, throughput, hit ratios",
        description=(
            "Replay a trace (ours or Mooncake) against a target, one mode or several side by side.\n"
            "Arrivals follow the trace's timestamps, or --rate (Poisson, or gamma with\n"
            "--burstiness), or a closed loop of --concurrency requests. Writes per-request JSONL\n"
            "and summary JSON per mode, summary.md with every mode side by side, and PNG plots\n"
            "(TTFT CDF, hit ratio over time) under -o. --offset K --limit N replay requests\n"
            "K..K+N-1 of the trace (each keeps its index in the trace).\n\n"
            "Exits 1 when more than --max-error-rate of a mode's requests fail (default 0: any\n"
            "failure), after writing the report; the first errors go to stderr.\n\n"
            "--target fake[:key=value,...] is an in-process stand-in with made-up delays\n"
            "(settings: base_ms, compute_us_per_token, dram_us_per_token, gpu_us_per_token,\n"
            "copy_us_per_token, tpot_ms, gpu_tokens, dram_tokens, fail_every)."))
    p.add_argument("trace", help="trace JSONL")
    p.add_argument("--target", required=True, help="cluster gateway address, or fake[:settings]")
    sched = p.add_mutually_exclusive_group()
    sched.add_argument("--rate", type=float, help="re-time arrivals at R requests/s")
    sched.add_argument("--concurrency", type=int, help="closed loop: C requests in flight")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape with --rate (1: Poisson)")
    p.add_argument("--duration", type=float, help="stop sending new requests after S seconds")
    p.add_argument("--offset", type=int, default=0, metavar="K", help="skip the first K requests (default 0)")
    p.add_argument("--limit", type=int, metavar="N", help="replay at most N requests (default: all)")
    p.add_argument("--max-error-rate", type=float, default=0.0, metavar="F",
                   help="exit 1 when more than this fraction of a mode's requests fail (default 0)")
    p.add_argument("--mode", default="tessera", choices=MODES, help="serving mode (default tessera)")
    p.add_argument("--compare", help=f"comma-separated modes to replay one after another ({','.join(MODES)})")
    p.add_argument("--slo", help="goodput objectives in ms, e.g. ttft:500,tpot:50 (also e2el:MS)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="token ids drawn below this (default: the cluster's vocabulary; 32000 for fake)")
    p.add_argument("--token-low", type=int, default=0, help="token ids drawn at or above this (default 0)")
    p.add_argument("--token-seed", type=int, default=0, help="seed of document token ids (default 0)")
    p.add_argument("--max-in-flight", type=int, default=256, help="open-loop worker threads (default 256)")
    p.add_argument("-o", "--output", required=True, help="results folder")
    p.set_defaults(handler=_replay_handler)


def resolve_target(spec: str):
    """The object replay drives for ``--target``: the fake, or a running cluster through the SDK."""
    if spec == "fake" or spec.startswith("fake:"):
        from loadgen.replay.fake import FakeTarget, FakeTargetConfig
        return FakeTarget(FakeTargetConfig.parse(spec))
    if importlib.util.find_spec("services.sdk") is None:
        raise ValueError(_SDK_MISSING)
    from loadgen.replay.cluster_target import ClusterTarget
    from services.sdk import Client, TesseraError

    token = env.read("TESSERA_TOKEN")
    try:  # one short Stats call first: a wrong address fails in seconds, not at the first request
        with Client(spec, token=token, timeout=10.0, retries=1) as probe:
            probe.stats()
    except TesseraError as exc:
        raise ValueError(f"cannot reach the cluster at {spec}: {exc}") from None
    return ClusterTarget(spec, token=token)


def _command(args: argparse.Namespace) -> str:
    parts = ["tessera", "replay", args.trace, "--target", args.target]
    for flag in ("rate", "concurrency", "duration", "slo", "limit"):
        if getattr(args, flag) is not None:
            parts += [f"--{flag}", str(getattr(args, flag))]
    if args.offset:
        parts += ["--offset", str(args.offset)]
    parts += ["--compare", args.compare] if args.compare else ["--mode", args.mode]
    if args.rate is not None and args.burstiness != 1.0:
        parts += ["--burstiness", str(args.burstiness)]
    parts += ["--vocab-size", str(args.vocab_size), "-o", args.output]
    return " ".join(shlex.quote(p) for p in parts)


def _replay_handler(args: argparse.Namespace) -> int:
    from loadgen.replay.compare import replay_modes
    from loadgen.replay.metrics import Slo
    from loadgen.replay.report import summary_table, write_report
    from loadgen.replay.runner import ReplayConfig, selected
    from loadgen.trace import read_trace

    modes = [m.strip() for m in args.compare.split(",") if m.strip()] if args.compare else [args.mode]
    if not modes:
        raise ValueError("--compare names no mode")
    cfg = ReplayConfig(mode=modes[0], rate=args.rate, burstiness=args.burstiness,
                       concurrency=args.concurrency, duration_s=args.duration,
                       max_in_flight=args.max_in_flight, vocab_size=args.vocab_size or 32000,
                       token_low=args.token_low, token_seed=args.token_seed,
                       offset=args.offset, limit=args.limit)
    if not 0 <= args.max_error_rate <= 1:
        raise ValueError(f"--max-error-rate must be a fraction in [0, 1], got {args.max_error_rate:g}")
    slo = Slo.parse(args.slo) if args.slo else None
    trace = read_trace(args.trace)
    window = selected(trace, cfg)
    target = resolve_target(args.target)
    if args.vocab_size is None:
        args.vocab_size = getattr(target, "vocab_size", None) or 32000
    cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
    runs, summaries = replay_modes(trace, target, cfg, modes, slo)
    part = "" if len(window) == len(trace) else f" (requests {window.start}..{window.stop - 1})"
    about = f"Trace: {args.trace}, {len(window)} of {len(trace)} requests{part}; target: {args.target}."
    paths = write_report(args.output, runs, summaries, _command(args), about)
    print(summary_table(summaries))
    print(f"wrote {paths['summary_md']}, per-mode folders and plots under {args.output}", file=sys.stderr)
    failures = too_many_errors(runs, args.max_error_rate)
    if failures:
        print("\n".join(failures), file=sys.stderr)
        return 1
    return 0


def too_many_errors(runs, max_rate: float, shown: int = 5) -> list[str]:
    """Lines for stderr naming each run whose failed fraction is over ``max_rate`` and its first
    ``shown`` errors by request index; [] when every run is within it."""
    lines = []
    for run in runs:
        failed = [r for r in run.records if not r.ok]
        if not run.records or len(failed) / len(run.records) <= max_rate:
            continue
        lines.append(f"tessera replay: error: mode {run.mode}: {len(failed)} of {len(run.records)} requests "
                     f"failed ({100 * len(failed) / len(run.records):.1f}%, over --max-error-rate "
                     f"{max_rate:g}); the first {min(shown, len(failed))}:")
        lines += [f"  request {r.index}: {r.error.partition(chr(10))[0][:300]}" for r in failed[:shown]]
    return lines
