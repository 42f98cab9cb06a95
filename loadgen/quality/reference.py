"""Engine-free accuracy of a TinyLlama: coref prompts under full prefill and full chunk-KV reuse, longgen
targets teacher-forced and generated greedily (dense).

Full reuse (ratio 0) is expressible as one masked forward pass: a chunk whose KV is computed alone
at local positions 0..L-1 gives the same keys and values as the chunk computed in place with an
attention mask that confines it to itself, because RoPE scores depend only on relative position.
The suffix then attends causally to everything. This is the check the engine's ``tessera@0`` must
agree with, and the measure training logs while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loadgen.quality.tasks import FORMS, KINDS, LongGenPrompt, Prompt, TaskConfig, coref_batch, longgen_batch
from loadgen.quality.vocab import vocab


def chunk_spans(cfg: TaskConfig, n_chunks: int, bos_own_chunk: bool = True) -> list[tuple[int, int]]:
    """[start, end) of each reusable chunk in ``<bos> chunk_1 .. chunk_n``.

    With ``bos_own_chunk`` the ``<bos>`` is a one-token chunk of its own (our eval layout: every
    document chunk is then computed alone the same way); otherwise it opens the first chunk.
    """
    L = cfg.chunk_len
    spans = [(1 + c * L, 1 + (c + 1) * L) for c in range(n_chunks)]
    if bos_own_chunk:
        return [(0, 1)] + spans
    return [(0, spans[0][1])] + spans[1:]


def reuse_mask(T: int, spans: list[tuple[int, int]], device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean ``[1, 1, T, T]`` (True = may attend): causal, except chunk tokens see only their chunk."""
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    for start, end in spans:
        mask[start:end, :start] = False
    return mask[None, None]


@dataclass(frozen=True, slots=True)
class Tally:
    """Correct and asked counts per question kind (index into KINDS)."""

    correct: tuple[int, ...]
    asked: tuple[int, ...]

    def accuracy(self) -> dict[str, float]:
        return {k: (c / a if a else float("nan")) for k, c, a in zip(KINDS, self.correct, self.asked)}

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(tuple(map(int.__add__, self.correct, other.correct)), tuple(map(int.__add__, self.asked, other.asked)))


@torch.no_grad()
def reference_tally(
    model: torch.nn.Module,
    prompts: list[Prompt],
    cfg: TaskConfig = TaskConfig(),
    reuse: bool = False,
    bos_own_chunk: bool = True,
    batch: int = 256,
) -> Tally:
    """Teacher-forced accuracy: all questions of a prompt in one pass, argmax over the whole vocabulary.

    All prompts must have ``cfg.max_chunks`` chunks (the held-out shape).
    """
    device = next(model.parameters()).device
    v = vocab()
    correct = [0] * len(KINDS)
    asked = [0] * len(KINDS)
    mask = None
    if reuse:
        mask = reuse_mask(cfg.seq_len, chunk_spans(cfg, cfg.max_chunks, bos_own_chunk), device)
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        if any(len(p.chunks) != cfg.max_chunks for p in part):
            raise ValueError(f"reference_tally needs prompts of {cfg.max_chunks} chunks")
        b = coref_batch(part, cfg, v)
        tokens = torch.from_numpy(b.tokens).to(device)
        targets = torch.from_numpy(b.targets).to(device)
        kinds = torch.from_numpy(b.kinds).to(device)
        hit = model(tokens, mask).argmax(-1) == targets
        for k in range(len(KINDS)):
            sel = kinds == k
            correct[k] += int((hit & sel).sum())
            asked[k] += int(sel.sum())
    return Tally(tuple(correct), tuple(asked))


@dataclass(frozen=True, slots=True)
class ReferencePrefill:
    """What ``ReferenceEngine.prefill`` returns: next-token ``logits [vocab]`` after the suffix."""

    logits: torch.Tensor
    stats: dict


class ReferenceEngine:
    """The modes whose result is exact without a blend step, on a TinyLlama, behind ``Engine.prefill``'s API.

    ``full`` and ``prefix`` are full prefill; the reuse modes (``position_aware``, ``tessera``,
    ``blend_copy``) are full reuse at ratio 0 and full prefill at ratio 1. Any other ratio (and no
    ratio: the engine's default blends) needs the engine.
    It lets eval be checked (and ``tessera@0`` be cross-checked) without ``services.engine``.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.device = next(model.parameters()).device

    @classmethod
    def load(cls, directory: str, device: str = "cpu") -> "ReferenceEngine":
        from loadgen.quality.model import load_hf

        return cls(load_hf(directory, device=device))

    @torch.no_grad()
    def prefill(self, chunks: list[list[int]], suffix: list[int], mode: str = "tessera",
                recompute_ratio: float | None = None) -> ReferencePrefill:
        if mode in ("full", "prefix") or recompute_ratio == 1.0:
            reuse = False
        elif recompute_ratio == 0.0:
            reuse = True
        else:
            raise ValueError(f"the reference engine has no blend step: {mode}@{recompute_ratio} needs services.engine")
        if not suffix:
            raise ValueError("suffix must hold at least one token")
        spans, start = [], 0
        for chunk in chunks:
            spans.append((start, start + len(chunk)))
            start += len(chunk)
        tokens = torch.tensor([[t for c in chunks for t in c] + list(suffix)], device=self.device)
        mask = reuse_mask(tokens.shape[1], spans, self.device) if reuse else None
        return ReferencePrefill(logits=self.model(tokens, mask)[0, -1], stats={"mode": mode, "reuse": reuse})


@torch.no_grad()
def longgen_teacher_forced(model: torch.nn.Module, prompts: list[LongGenPrompt], batch: int = 128) -> dict[str, float]:
    """Teacher-forced accuracy of a longgen target, argmax over the whole vocabulary, per slot role of the prompts'
    form and the end: pair ``{"name": .., "object": .., "end": ..}`` (the questions' names, their objects, the
    closing ``<eos>``); relay adds ``think`` (its ``IT`` slot) and ``adj``. The prompts share one form."""
    forms = {p.form for p in prompts}
    if len(forms) != 1:
        raise ValueError(f"longgen_teacher_forced needs prompts of one form, got {sorted(forms)}")
    roles = FORMS[forms.pop()]
    device = next(model.parameters()).device
    hits = {role: [0, 0] for role in (*roles, "end")}
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        b = longgen_batch(part, vocab())
        tokens = torch.from_numpy(b.tokens).to(device)
        targets = torch.from_numpy(b.targets).to(device)
        slots = torch.from_numpy(b.kinds).long().to(device)
        hit = model(tokens).argmax(-1) == targets
        ends = torch.tensor([len(roles) * len(p.questions) for p in part], device=device)[:, None]
        answer = (slots >= 0) & (slots < ends)          # slots are -1 off the target
        sels = [(role, answer & (slots % len(roles) == at)) for at, role in enumerate(roles)]
        for role, sel in sels + [("end", slots == ends)]:
            hits[role][0] += int((hit & sel).sum())
            hits[role][1] += int(sel.sum())
    return {role: c / n if n else float("nan") for role, (c, n) in hits.items()}


@torch.no_grad()
def longgen_greedy(model: torch.nn.Module, prompts: list[LongGenPrompt], batch: int = 128) -> list[list[int]]:
    """Greedy generations as long as each prompt's target (dense attention, no KV cache: every step one full pass);
    prompts of one batch must have equal lengths (the held-out shape does)."""
    device = next(model.parameters()).device
    v = vocab()
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        part = prompts[i : i + batch]
        seqs = [[v.bos, *(t for c in p.chunks for t in c), *p.suffix(v)] for p in part]
        steps = {len(p.target(v)) for p in part}
        if len({len(s) for s in seqs}) != 1 or len(steps) != 1:
            raise ValueError("longgen_greedy needs prompts of one shape")
        tokens = torch.tensor(seqs, device=device)
        start = tokens.shape[1]
        for _ in range(steps.pop()):
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
        out += tokens[:, start:].tolist()
    return out
