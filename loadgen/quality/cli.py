"""``tessera quality train|eval``: train the coref model; measure every serving mode's accuracy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadgen.quality.config import add_train_args, command_line, config_from_args

COMMITTED_MODEL = Path(__file__).resolve().parent / "model"
DEFAULT_MODES = "full,position_aware@0,tessera@0,tessera@0.15,blend_copy@0.15,tessera@1"


def register(subparsers) -> None:
    quality = subparsers.add_parser("quality", help="coref quality testbed: train the model, measure each mode's accuracy")
    sub = quality.add_subparsers(dest="quality_command", metavar="SUBCOMMAND", required=True)

    train = sub.add_parser("train", help="train the coref model and write a Hugging Face Llama directory",
                           description="Generate coref + induction data on the fly, train, save config/safetensors/tokenizer.")
    add_train_args(train)
    train.set_defaults(handler=_train)

    ev = sub.add_parser("eval", help="accuracy by question type for each mode, through Engine.prefill",
                        description="Held-out coref prompts (fixed seed); chunks = [[<bos>], chunk_1..chunk_5], "
                                    "suffix = [Q, NAME] per question; accuracy of the argmax answer by question type.")
    ev.add_argument("--model", default=str(COMMITTED_MODEL), help="model directory (default: the committed model)")
    ev.add_argument("--prompts", type=int, default=300, help="held-out prompts (default 300)")
    ev.add_argument("--modes", default=DEFAULT_MODES, help=f"comma-separated MODE[@RATIO] (default {DEFAULT_MODES})")
    ev.add_argument("--questions", type=int, default=8, help="questions asked per prompt, kinds in turn (default 8: all)")
    ev.add_argument("--seed", type=int, default=1, help="held-out prompt seed (default 1)")
    ev.add_argument("--cross-gap", type=int, default=0,
                    help="harder variant: up to N filler words open a chunk before a cross IT (default 0: the issue's layout)")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--check-layer", type=int, default=None, help="engine blend check layer (default: the engine's)")
    ev.add_argument("--deviation", default=None, help="engine HKVD metric: k, v or kv (default: the engine's)")
    ev.add_argument("--reference", action="store_true",
                    help="use the engine-free reference (full, position_aware and ratios 0 and 1 only)")
    ev.add_argument("--json", action="store_true", help='print {"<mode>": {"direct": acc, "local": acc, "cross": acc}}')
    ev.set_defaults(handler=_eval)


def _train(args: argparse.Namespace) -> int:
    from loadgen.quality.train import train

    cfg = config_from_args(args)
    train(cfg, command=command_line(cfg))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from loadgen.quality.evaluate import as_json, parse_modes, run_eval

    engine_options = {k: v for k, v in (("check_layer", args.check_layer), ("deviation", args.deviation)) if v is not None}
    if engine_options and args.reference:
        raise ValueError("--check-layer/--deviation configure services.engine; they mean nothing with --reference")
    results = run_eval(args.model, args.prompts, parse_modes(args.modes), seed=args.seed, questions=args.questions,
                       device=args.device, reference=args.reference, progress=not args.json,
                       engine_options=engine_options, cross_gap=args.cross_gap)
    if args.json:
        print(json.dumps(as_json(results)))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"coref accuracy: {args.prompts} prompts, seed {args.seed}, {Path(args.model).name}")
    for col in ("mode", "direct", "local", "cross", "wall ms / prefill", "CPU ms / prefill"):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        acc = r.tally.accuracy()
        table.add_row(r.mode, *(f"{acc[k]:.3f}" for k in ("direct", "local", "cross")), f"{1000 * r.mean_prefill_s:.1f}",
                      f"{1000 * r.mean_prefill_cpu_s:.1f}")
    Console().print(table)
    return 0
