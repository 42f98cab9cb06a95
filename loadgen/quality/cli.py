"""``tessera quality train|eval``: train a quality model; measure every serving mode's (coref) or decode
policy's (longgen) accuracy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadgen.quality.config import add_train_args, command_line, config_from_args
from loadgen.quality.longgen_eval import DEFAULT_MODES as LONGGEN_MODES
from loadgen.quality.longgen_eval import DEFAULT_QUESTIONS as LONGGEN_QUESTIONS
from loadgen.quality.tasks import FORMS

COMMITTED_MODEL = Path(__file__).resolve().parent / "model"
COMMITTED_LONGGEN_MODEL = Path(__file__).resolve().parent / "model_longgen"
COMMITTED_RELAY_MODEL = Path(__file__).resolve().parent / "model_longgen_relay"   # longgen's relay form
DEFAULT_MODES = "full,position_aware@0,tessera@0,tessera@0.15,blend_copy@0.15,tessera@1"
# per task: the model, modes, prompts and questions an eval takes when not told
EVAL_DEFAULTS = {
    "coref": {"model": COMMITTED_MODEL, "modes": DEFAULT_MODES, "prompts": 300, "questions": 8},
    "longgen": {"model": COMMITTED_LONGGEN_MODEL, "modes": LONGGEN_MODES, "prompts": 100, "questions": LONGGEN_QUESTIONS},
}


def register(subparsers) -> None:
    quality = subparsers.add_parser("quality", help="quality testbed: train the models, measure each mode's accuracy")
    sub = quality.add_subparsers(dest="quality_command", metavar="SUBCOMMAND", required=True)

    train = sub.add_parser("train", help="train a quality model (coref or longgen) and write a Hugging Face Llama directory",
                           description="Generate task + induction data on the fly, train, save config/safetensors/tokenizer.")
    add_train_args(train)
    train.set_defaults(handler=_train)

    ev = sub.add_parser("eval", help="accuracy of each mode: coref through Engine.prefill, longgen through Engine.generate",
                        description="coref: held-out prompts (fixed seed); chunks = [[<bos>], chunk_1..chunk_5], "
                                    "suffix = [Q, NAME] per question; accuracy of the argmax answer by question type. "
                                    "longgen: held-out prompts of 12 chunks, suffix = [Q, N_1..N_K, .], K answers "
                                    "generated greedily in one generation per decode mode; accuracy overall and by "
                                    "answer position (loadgen/quality/longgen_eval.py).")
    ev.add_argument("--task", default="coref", choices=tuple(EVAL_DEFAULTS), help="coref (default) or longgen")
    ev.add_argument("--model", default=None, help="model directory (default: the task's committed model)")
    ev.add_argument("--prompts", type=int, default=None, help="held-out prompts (default: coref 300, longgen 100)")
    ev.add_argument("--modes", default=None,
                    help=f"comma-separated; coref: MODE[@RATIO] (default {DEFAULT_MODES}); longgen: dense, quest@BUDGET, "
                         f"retro@BUDGET[:wWINDOW] (default {LONGGEN_MODES})")
    ev.add_argument("--questions", type=int, default=None,
                    help="coref: questions asked per prompt, kinds in turn (default 8: all); "
                         "longgen: answers per generation, 1..16 (default 14: the suffix fills one block)")
    ev.add_argument("--seed", type=int, default=1, help="held-out prompt seed (default 1)")
    ev.add_argument("--form", default=None, choices=tuple(FORMS),
                    help="longgen: how each answer is laid out (default pair: N O; relay: N IT A O over facts A N O ., "
                         "whose committed model is the default there)")
    ev.add_argument("--dense-layers", type=int, default=None,
                    help="longgen: the first layers the sparse policies keep dense (default 1)")
    ev.add_argument("--prefill", default="full", choices=("full", "tessera"),
                    help="longgen: how the prompt is prefilled (tessera: chunk KV reused, retrieval searches the chunks' "
                         "own indexes)")
    ev.add_argument("--plot", default=None, metavar="FILE.png", help="longgen: accuracy against the budget, as a PNG")
    ev.add_argument("--cross-gap", type=int, default=0,
                    help="harder variant: up to N filler words open a chunk before a cross IT (default 0: the issue's layout)")
    ev.add_argument("--index-host-dtype", default=None, choices=("float32", "bfloat16"),
                    help="longgen: how retrieval modes hold the offloaded keys and values (default float32)")
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
    defaults = EVAL_DEFAULTS[args.task]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, str(value) if name == "model" else value)
    if args.task == "longgen":
        return _eval_longgen(args)
    if args.form is not None:
        raise ValueError("--form is longgen's (--task longgen)")
    if args.dense_layers is not None or args.plot or args.prefill != "full" or args.index_host_dtype is not None:
        raise ValueError("--dense-layers, --plot, --prefill and --index-host-dtype are longgen's (--task longgen)")
    from loadgen.quality.evaluate import as_json, parse_modes, run_eval

    engine_options = {k: v for k, v in (("check_layer", args.check_layer), ("deviation", args.deviation)) if v is not None}
    if engine_options and args.reference:
        raise ValueError("--check-layer/--deviation configure services.engine; they mean nothing with --reference")
    results = run_eval(args.model, args.prompts, parse_modes(args.modes), seed=args.seed, questions=args.questions,
                       device=args.device, reference=args.reference, progress=True,
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


def _eval_longgen(args: argparse.Namespace) -> int:
    from loadgen.quality.longgen_eval import DEFAULT_DENSE_LAYERS, as_json, parse_decode_modes, run_longgen_eval

    coref_only = [flag for flag, given in (("--reference", args.reference), ("--cross-gap", args.cross_gap),
                                           ("--check-layer", args.check_layer is not None),
                                           ("--deviation", args.deviation is not None)) if given]
    if coref_only:
        raise ValueError(f"{', '.join(coref_only)}: coref's flags, not longgen's")
    dense_layers = DEFAULT_DENSE_LAYERS if args.dense_layers is None else args.dense_layers
    form = args.form or "pair"
    if form == "relay" and args.model == str(COMMITTED_LONGGEN_MODEL):
        args.model = str(COMMITTED_RELAY_MODEL)
    results = run_longgen_eval(args.model, args.prompts, parse_decode_modes(args.modes), seed=args.seed,
                               questions=args.questions, dense_layers=dense_layers, device=args.device,
                               progress=True, prefill=args.prefill,
                               index_host_dtype=args.index_host_dtype or "float32", form=form)
    out = as_json(results)
    title = (f"longgen ({form}): {args.prompts} prompts, seed {args.seed}, {args.questions} answers, "
             f"dense_layers {dense_layers}, {args.prefill} prefill, {Path(args.model).name}")
    if args.plot:
        from loadgen.quality.plot import plot_budget_curve
        from loadgen.quality.tasks import LongGenConfig

        task = LongGenConfig(questions=args.questions)
        plot_budget_curve(out, args.plot, title, context_tokens=1 + task.chunk_len * task.max_chunks + args.questions + 2)
    if args.json:
        print(json.dumps(out))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("mode", "accuracy", "names", "all right", "by answer 1..K", "s / generate"):
        table.add_column(col, justify="left" if col in ("mode", "by answer 1..K") else "right")
    for mode, r in out.items():
        table.add_row(mode, f"{r['accuracy']:.3f}", f"{r['name_accuracy']:.3f}", f"{r['prompts_all_right']:.3f}",
                      " ".join(f"{a:.2f}" for a in r["by_answer"]), f"{r['mean_generate_s']:.2f}")
    Console().print(table)
    return 0
