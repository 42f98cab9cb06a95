"""Accuracy of every serving mode on held-out coref prompts, through ``Engine.prefill``.

Layout of one request (documented choice): ``chunks = [[<bos>], chunk_1, .., chunk_5]`` and
``suffix = [Q, NAME]``; the answer is the argmax of the next-token logits over the whole
vocabulary. ``<bos>`` is its own one-token chunk, standing for the shared system prefix, so every
document chunk is reused the same way (computed alone, no sink token before it). Each question is
asked on its own: ``Q NAME`` straight after the chunks is exactly where training puts a prompt's
first question, and leaving out the earlier questions keeps the request the same for every
question of a prompt, so an engine that caches chunk KV computes each chunk once.

A mode is ``NAME`` or ``NAME@RATIO`` (``tessera@0.15``); the ratio is passed as
``recompute_ratio``, and a bare name uses the engine's default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from loadgen.quality.reference import Tally
from loadgen.quality.tasks import KINDS, Fact, Prompt, TaskConfig, heldout_prompts
from loadgen.quality.vocab import vocab

MODE_NAMES = ("full", "prefix", "position_aware", "blend_copy", "tessera")


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    ratio: float | None  # None: the engine's default

    @classmethod
    def parse(cls, text: str) -> "Mode":
        name, _, ratio = text.strip().partition("@")
        if name not in MODE_NAMES:
            raise ValueError(f"unknown mode {name!r}; expected one of {', '.join(MODE_NAMES)} (optionally @RATIO)")
        if not ratio:
            return cls(name, None)
        try:
            r = float(ratio)
        except ValueError:
            raise ValueError(f"mode {text!r}: ratio {ratio!r} is not a number") from None
        if not 0.0 <= r <= 1.0:
            raise ValueError(f"mode {text!r}: ratio must be in [0, 1]")
        return cls(name, r)

    def __str__(self) -> str:
        return self.name if self.ratio is None else f"{self.name}@{self.ratio:g}"


def parse_modes(text: str) -> list[Mode]:
    modes = [Mode.parse(t) for t in text.split(",") if t.strip()]
    if not modes:
        raise ValueError("no modes given")
    return modes


def select_questions(prompt: Prompt, k: int) -> list[Fact]:
    """Up to ``k`` of the prompt's questions, taking the kinds in turn so that a small k still asks cross."""
    by_kind = {kind: [f for f in prompt.question_facts() if f.kind == kind] for kind in KINDS}
    picked: list[Fact] = []
    while len(picked) < k and any(by_kind.values()):
        for kind in KINDS:
            if by_kind[kind] and len(picked) < k:
                picked.append(by_kind[kind].pop(0))
    return picked


@dataclass(frozen=True, slots=True)
class ModeResult:
    """One mode's tally, its answers (argmax token per question, in asking order) and the mean
    wall time and process CPU time of one ``prefill`` call in seconds (CPU time is the steadier
    figure on a shared machine)."""

    mode: str
    tally: Tally
    answers: tuple[int, ...]
    mean_prefill_s: float
    mean_prefill_cpu_s: float


def evaluate_modes(
    engine,
    modes: list[Mode],
    prompts: list[Prompt],
    questions: int = 8,
    progress: bool = True,
) -> list[ModeResult]:
    """Ask every selected question of every prompt in every mode through ``engine.prefill``."""
    import torch
    from tqdm import tqdm

    v = vocab()
    asked = [(p, select_questions(p, questions)) for p in prompts]
    total = sum(len(q) for _, q in asked) * len(modes)
    bar = tqdm(total=total, desc="eval", disable=not progress, dynamic_ncols=True)
    results = []
    for mode in modes:
        kwargs = {} if mode.ratio is None else {"recompute_ratio": mode.ratio}
        correct, count = [0] * len(KINDS), [0] * len(KINDS)
        answers: list[int] = []
        seconds = cpu_seconds = 0.0
        bar.set_postfix(mode=str(mode))
        for prompt, facts in asked:
            chunks = [[v.bos]] + [list(c) for c in prompt.chunks]
            for fact in facts:
                t0, c0 = time.perf_counter(), time.process_time()
                r = engine.prefill(chunks=chunks, suffix=[v.question, fact.name], mode=mode.name, **kwargs)
                seconds += time.perf_counter() - t0
                cpu_seconds += time.process_time() - c0
                answers.append(int(torch.argmax(r.logits)))
                k = KINDS.index(fact.kind)
                correct[k] += int(answers[-1] == fact.obj)
                count[k] += 1
            bar.update(len(facts))
        tally = Tally(tuple(correct), tuple(count))
        n = max(1, len(answers))
        results.append(ModeResult(str(mode), tally, tuple(answers), seconds / n, cpu_seconds / n))
    bar.close()
    return results


def load_engine(model_dir: str, device: str = "cpu", reference: bool = False, engine_options: dict | None = None):
    """``services.engine.Engine`` in fp32 (``engine_options`` go to ``Engine.load``), or the ReferenceEngine."""
    import torch

    if reference:
        from loadgen.quality.reference import ReferenceEngine

        return ReferenceEngine.load(model_dir, device=device)
    try:
        from services.engine import Engine
    except ImportError as exc:
        raise ValueError(f"services.engine.Engine is not available ({exc}); use --reference") from None
    return Engine.load(model_dir, device=device, dtype=torch.float32, **(engine_options or {}))


def run_eval(model_dir: str, n_prompts: int, modes: list[Mode], seed: int = 1, questions: int = 8,
             device: str = "cpu", reference: bool = False, progress: bool = True,
             engine_options: dict | None = None, cross_gap: int = 0) -> list[ModeResult]:
    if n_prompts < 1:
        raise ValueError("--prompts must be at least 1")
    if not 1 <= questions <= TaskConfig().questions:
        raise ValueError(f"--questions must be in 1..{TaskConfig().questions}")
    engine = load_engine(model_dir, device, reference, engine_options)
    prompts = heldout_prompts(seed, n_prompts, TaskConfig(cross_gap=cross_gap))
    return evaluate_modes(engine, modes, prompts, questions, progress)


def as_json(results: list[ModeResult]) -> dict[str, dict[str, float]]:
    """``{"<mode>": {"direct": acc, "local": acc, "cross": acc}}``, accuracies in [0, 1] (None: none asked)."""
    return {r.mode: {k: (None if a != a else a) for k, a in r.tally.accuracy().items()} for r in results}
