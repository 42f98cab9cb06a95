"""Which step of a relay answer reads what: attention ablations on the reference model (teacher-forced).

In the relay form (loadgen/quality/tasks.py) question i is answered ``N_i IT A_i O_i`` from a fact ``A_i N_i O_i .``.
RetroAttention can only help an answer that reads a past step's lookup, so this shows where the object and the
word before the name come from: each row bars some steps' attention (at some layers) from some positions and
scores the teacher-forced argmax of every slot over held-out prompts.

    .venv/bin/python bench/quality/relay_paths.py [--model DIR] [--prompts 40] [--out FILE.json]

Steps are named by their input: the name step (input N_i, says IT), the IT step (says A_i), the A step (says O_i).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from loadgen.quality.cli import COMMITTED_RELAY_MODEL  # noqa: E402
from loadgen.quality.model import load_hf, rope_tables  # noqa: E402
from loadgen.quality.tasks import FORMS, LongGenConfig, longgen_heldout  # noqa: E402
from loadgen.quality.vocab import vocab  # noqa: E402

ROLES = FORMS["relay"]
STEP = {"name step": 1, "IT step": 2, "A step": 3}   # the slot each step predicts (its input is the slot before)


def bars():
    """(label, step, what it may not attend: "chunks" or another step, the layers barred)."""
    yield "nothing barred", None, None, ()
    for first in (0, 1, 2):
        yield f"A step: the name step, layers >= {first}", "A step", "name step", tuple(range(first, 4))
    for step in ("A step", "name step", "IT step"):
        for layer in range(4):
            yield f"{step}: the chunks, layer {layer}", step, "chunks", (layer,)


@torch.no_grad()
def ablate(model, prompts, step, what, layers) -> dict[str, float]:
    v, stride = vocab(), len(ROLES)
    hits = dict.fromkeys(ROLES, 0)
    n = 0
    for p in prompts:
        prompt = [v.bos, *(t for c in p.chunks for t in c), *p.suffix(v)]
        seq = prompt + p.target(v)
        T, start, chunks_end = len(seq), len(prompt) - 1, 1 + sum(len(c) for c in p.chunks)
        masks = [torch.ones(T, T, dtype=torch.bool).tril() for _ in range(4)]
        for i in range(len(p.questions) if step else 0):
            row = start + stride * i + STEP[step]          # the row that predicts this step's slot
            cols = slice(1, chunks_end) if what == "chunks" else row - (STEP[step] - STEP[what])
            for layer in layers:
                masks[layer][row, cols] = False
        cos, sin = rope_tables(model.cfg, torch.arange(T))
        x = model.model.embed_tokens(torch.tensor([seq]))
        for layer, block in enumerate(model.model.layers):
            x = block(x, cos, sin, masks[layer][None, None])
        pred = model.lm_head(model.model.norm(x))[0].argmax(-1).tolist()
        target = p.target(v)
        for i in range(len(p.questions)):
            for at, role in enumerate(ROLES):
                hits[role] += pred[start + stride * i + at] == target[stride * i + at]
        n += len(p.questions)
    return {role: hits[role] / n for role in ROLES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(COMMITTED_RELAY_MODEL))
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    model = load_hf(args.model).float().eval()
    prompts = longgen_heldout(args.seed, args.prompts, LongGenConfig(questions=14, form="relay"))
    rows = []
    print(f"{'barred':44s} " + " ".join(f"{r:>6s}" for r in ROLES))
    for label, step, what, layers in bars():
        acc = ablate(model, prompts, step, what, layers)
        rows.append({"barred": label, **acc})
        print(f"{label:44s} " + " ".join(f"{acc[r]:6.3f}" for r in ROLES), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "prompts": args.prompts, "seed": args.seed,
                                              "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
