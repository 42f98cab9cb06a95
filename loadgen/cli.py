"""``tessera trace synth``, ``tessera simulate`` and ``tessera replay``.

Arguments are checked here, once, by building the config dataclasses; handlers import
numpy, matplotlib and the SDK only when they run, so ``tessera --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from loadgen.trace.dists import LENGTH_SYNTAX

_LENGTH_HELP = f"token-length distribution: {LENGTH_SYNTAX} (a bare N means const:N)"


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    _register_trace(subparsers)
    _register_simulate(subparsers)
    from loadgen.replay.cli import register_replay
    register_replay(subparsers)


# ---------------------------------------------------------------- trace synth

def _register_trace(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="synthesize RAG request traces (JSONL)")
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser(
        "synth", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="write a Zipf RAG trace",
        description=(
            "Write a synthetic RAG trace: a corpus of N documents with Zipf(alpha) popularity\n"
            "(document d has rank d+1); each request takes K distinct documents by popularity\n"
            "in random order (or K independent draws with --with-replacement), then a private\n"
            "suffix. Arrivals: gamma inter-arrival gaps with mean 1/rate and shape = burstiness\n"
            "(1: Poisson; <1: burstier; as vllm bench serve).\n\n"
            "Length distributions: " + LENGTH_SYNTAX + "\n"
            "  e.g. --doc-tokens const:512  --suffix-tokens uniform:16:64  --output-tokens\n"
            "  lognormal:128:64 (lognormal takes the mean and std of the lengths themselves).\n\n"
            "Output: JSONL in the Mooncake trace format (timestamp in ms, input_length,\n"
            "output_length, hash_ids = prefix-chained 512-token block ids) plus \"chunks\"\n"
            "([{\"doc\": id, \"tokens\": n}, ...] in prompt order) and \"suffix_tokens\"."))
    p.add_argument("--docs", type=int, default=1000, help="corpus size N (default 1000)")
    p.add_argument("--alpha", type=_float, default=1.1, help="Zipf skew (default 1.1; 0 = uniform)")
    p.add_argument("--chunks-per-request", type=int, default=5, metavar="K", help="default 5")
    p.add_argument("--with-replacement", action="store_true",
                   help="K independent draws (a document may repeat in a request)")
    p.add_argument("--doc-tokens", default="const:512", help=_LENGTH_HELP + " (default const:512)")
    p.add_argument("--suffix-tokens", default="const:32", help="default const:32")
    p.add_argument("--output-tokens", default="const:64", help="default const:64")
    p.add_argument("--rate", type=_float, default=1.0, help="requests/s (default 1; inf: all at 0)")
    p.add_argument("--burstiness", type=_float, default=1.0, help="gamma shape (default 1: Poisson)")
    p.add_argument("--requests", type=int, default=1000, metavar="M", help="default 1000")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("-o", "--output", required=True, help="trace file to write (JSONL)")
    p.set_defaults(handler=_synth_handler)


def synth_config_from_args(args: argparse.Namespace):
    from loadgen.trace import LengthDist, SynthConfig
    return SynthConfig(
        docs=args.docs, alpha=args.alpha, chunks_per_request=args.chunks_per_request,
        doc_tokens=LengthDist.parse(args.doc_tokens), suffix_tokens=LengthDist.parse(args.suffix_tokens),
        output_tokens=LengthDist.parse(args.output_tokens), rate=args.rate,
        burstiness=args.burstiness, requests=args.requests, seed=args.seed,
        with_replacement=args.with_replacement)


def _synth_handler(args: argparse.Namespace) -> int:
    from loadgen.trace import synthesize, write_trace
    cfg = synth_config_from_args(args)
    n = write_trace(args.output, synthesize(cfg))
    print(f"wrote {n} requests to {args.output}: {cfg.describe()}", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- simulate

def _register_simulate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "simulate", formatter_class=argparse.RawDescriptionHelpFormatter,
        help="chunk-KV cache hit ratio of a trace under a reuse policy (no model)",
        description=(
            "Replay a trace's chunk accesses against a KV cache of a given byte budget.\n"
            "Policies: prefix (reuse the leading cached run of chunks), position_aware (a\n"
            "replica per start position), tessera (one position-agnostic copy per chunk),\n"
            "oracle_static_agnostic / oracle_static_aware (the most used chunks, or (chunk,\n"
            "position) pairs the trace has, held from the start; each still misses its first use).\n"
            "Budgets: 1GB = 10^9 bytes, 10GiB = 10*2^30, 4e9 (bytes), or unlimited.\n"
            "Model shapes: llama3-8b, llama3-70b, llama3.2-1b, qwen3-8b, mistral-7b or\n"
            "LAYERS:KV_HEADS:HEAD_DIM[:DTYPE_BYTES].\n\n"
            "--sweep prints a budget x trace table of hit ratios (default policies prefix,\n"
            "position_aware, tessera). With TRACE: by --budgets over that trace. Without: over\n"
            "synthetic traces, one per --alphas, made by the recipe options below (defaults:\n"
            "1GB,10GB,50GB,unlimited x 1.1,1.5,2.1; 100000 docs, 4 chunks/request of 512\n"
            "tokens, 10000 requests, seed 0). An option that the command as given would not\n"
            "use is refused."))
    p.add_argument("trace", nargs="?", help="trace JSONL, plain or gzip (ours or Mooncake)")
    p.add_argument("--policy", help="one policy or a comma-separated list (default tessera; "
                                     "with --sweep: prefix,position_aware,tessera)")
    p.add_argument("--budget-bytes", help="cache budget, or a comma-separated list (e.g. "
                                          "1e9,4e9,16e9): one result per budget (default 10GB)")
    p.add_argument("--model-shape", default="llama3-8b", help="KV shape (default llama3-8b)")
    p.add_argument("--eviction", default="lru", choices=("lru", "lfu", "s3fifo"),
                   help="eviction for the dynamic policies (default lru)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    s = p.add_argument_group("sweep")
    s.add_argument("--sweep", action="store_true", help="run the paper-shaped sweep")
    s.add_argument("--budgets", help="comma-separated (default 1GB,10GB,50GB,unlimited)")
    # The synthetic trace recipe; None: not given (then refused with TRACE, defaulted without).
    s.add_argument("--alphas", help="comma-separated Zipf skews (default 1.1,1.5,2.1)")
    s.add_argument("--docs", type=int)
    s.add_argument("--chunks-per-request", type=int)
    s.add_argument("--doc-tokens")
    s.add_argument("--requests", type=int)
    s.add_argument("--seed", type=int)
    s.add_argument("--with-replacement", action="store_true", default=None)
    s.add_argument("-o", "--output", help="sweep: also write OUTPUT.md and OUTPUT.json")
    p.set_defaults(handler=_simulate_handler)


def _simulate_handler(args: argparse.Namespace) -> int:
    from loadgen.sim.cli_run import check_simulate_args, run_simulate, run_sweep_command
    check_simulate_args(args)
    return run_sweep_command(args) if args.sweep else run_simulate(args)

