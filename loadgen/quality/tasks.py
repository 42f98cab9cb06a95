"""The coref task and the induction data that makes it trainable.

A prompt is ``<bos>``, then chunks of ``chunk_len`` tokens, then questions ``Q NAME`` answered by
``OBJ``. Every name in a prompt has exactly one fact, of one of three kinds:

- **direct**  ``NAME OBJ .``
- **local**   ``NAME arrives . [filler]* IT OBJ .`` inside one chunk;
- **cross**   ``NAME arrives .`` ends chunk c and ``IT OBJ .`` opens chunk c+1.

``IT`` always means the most recently mentioned name: between a ``NAME arrives .`` and its ``IT``
there is only filler. Names and objects are drawn fresh for every prompt, so the answer can only be
read from the context. A cross fact is the one that chunk-KV reuse breaks: computed alone, chunk
c+1 cannot see which name its ``IT`` refers to.

Induction data (a random segment followed by an exact repeat, loss on the repeat) is mixed into
training: without it the model sits at chance on coref for thousands of steps.

Everything here is plain Python + numpy (no torch), seeded by ``random.Random``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from loadgen.quality.vocab import Vocab, vocab

KINDS = ("direct", "local", "cross")
IGNORE = -100  # target value that carries no loss (torch's cross_entropy default ignore_index)


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """Shape of coref prompts. ``max_chunks`` prompts are the held-out/eval shape."""

    chunk_len: int = 24
    max_chunks: int = 5
    questions: int = 8
    p_cross: float = 0.75     # chance that a chunk boundary carries a cross fact
    p_local: float = 0.8      # chance that a chunk holds a local fact
    max_local_gap: int = 3    # filler words between ``NAME arrives .`` and ``IT`` in a local fact
    cross_gap: int = 0        # up to this many filler words open chunk c+1 before a cross ``IT`` (0: the layout)

    def __post_init__(self) -> None:
        # The fullest chunk: cross-in (3 + gap) + local (6 + gap) + two directs (6) + cross-out (3).
        need = 18 + self.max_local_gap + self.cross_gap
        if self.cross_gap < 0 or self.chunk_len < need:
            raise ValueError(f"chunk_len {self.chunk_len} cannot hold a chunk's facts; need >= {need} (cross_gap >= 0)")
        if not 1 <= self.max_chunks <= 8:
            raise ValueError(f"max_chunks must be in 1..8, got {self.max_chunks}")
        if not 1 <= self.questions <= 16:
            raise ValueError(f"questions must be in 1..16, got {self.questions}")
        if not (0 <= self.p_cross <= 1 and 0 <= self.p_local <= 1):
            raise ValueError("p_cross and p_local are probabilities")

    @property
    def seq_len(self) -> int:
        """Training sequence length: bos + chunks + ``Q NAME OBJ`` per question."""
        return 1 + self.chunk_len * self.max_chunks + 3 * self.questions


@dataclass(frozen=True, slots=True)
class Fact:
    kind: str       # one of KINDS
    name: int       # token id
    obj: int        # token id
    chunk: int      # chunk that states the object (for cross: the chunk after the name's)


@dataclass(frozen=True, slots=True)
class Prompt:
    """One coref prompt. ``chunks`` hold token ids without ``<bos>``; ``questions`` index ``facts``."""

    chunks: tuple[tuple[int, ...], ...]
    facts: tuple[Fact, ...]
    questions: tuple[int, ...]

    def question_facts(self) -> list[Fact]:
        return [self.facts[i] for i in self.questions]


@dataclass(frozen=True, slots=True)
class Batch:
    """A training/eval batch as numpy arrays, all ``[B, T]``.

    ``targets[b, t]`` is the token to predict at position t (IGNORE where no loss);
    ``kinds[b, t]`` is the question type index into KINDS at answer positions, -1 elsewhere
    (induction batches have no kinds).
    """

    tokens: np.ndarray   # int64 [B, T]
    targets: np.ndarray  # int64 [B, T]
    kinds: np.ndarray    # int8  [B, T]
    induction: bool


def make_prompt(rng: random.Random, cfg: TaskConfig, n_chunks: int, v: Vocab | None = None) -> Prompt:
    """Draw one prompt of ``n_chunks`` chunks with fresh names and objects."""
    v = v or vocab()
    names = iter(rng.sample(v.names, len(v.names)))
    objects = iter(rng.sample(v.objects, len(v.objects)))
    cross = [rng.random() < cfg.p_cross for _ in range(n_chunks - 1)] + [False]
    facts: list[Fact] = []
    chunks: list[tuple[int, ...]] = []
    pending: int | None = None  # name whose ``arrives`` ended the previous chunk
    for c in range(n_chunks):
        head: list[int] = []
        if pending is not None:
            obj = next(objects)
            facts.append(Fact("cross", pending, obj, c))
            head = [v.pronoun, obj, v.stop]
            if cfg.cross_gap:  # drawn only when asked, so the layout keeps its random stream
                head = [rng.choice(v.fillers) for _ in range(rng.randint(0, cfg.cross_gap))] + head
        body: list[list[int]] = []
        if rng.random() < cfg.p_local:
            name, obj = next(names), next(objects)
            gap = [rng.choice(v.fillers) for _ in range(rng.randint(0, cfg.max_local_gap))]
            body.append([name, v.verb, v.stop, *gap, v.pronoun, obj, v.stop])
            facts.append(Fact("local", name, obj, c))
        for _ in range(rng.randint(1, 2)):
            name, obj = next(names), next(objects)
            body.append([name, obj, v.stop])
            facts.append(Fact("direct", name, obj, c))
        rng.shuffle(body)
        tail: list[int] = []
        pending = None
        if cross[c]:
            pending = next(names)
            tail = [pending, v.verb, v.stop]
        # Filler goes between segments, never inside one, so IT still means the last name.
        free = cfg.chunk_len - len(head) - len(tail) - sum(len(s) for s in body)
        gaps: list[list[int]] = [[] for _ in range(len(body) + 1)]
        for _ in range(free):
            gaps[rng.randrange(len(gaps))].append(rng.choice(v.fillers))
        tokens = head + gaps[0]
        for segment, filler in zip(body, gaps[1:]):
            tokens += segment + filler
        tokens += tail
        assert len(tokens) == cfg.chunk_len
        chunks.append(tuple(tokens))
    order = rng.sample(range(len(facts)), min(cfg.questions, len(facts)))
    return Prompt(chunks=tuple(chunks), facts=tuple(facts), questions=tuple(order))


def heldout_prompts(seed: int, n: int, cfg: TaskConfig = TaskConfig()) -> list[Prompt]:
    """``n`` prompts of ``cfg.max_chunks`` chunks from a stream no training run draws from."""
    rng = random.Random(f"coref-heldout-{seed}")
    v = vocab()
    return [make_prompt(rng, cfg, cfg.max_chunks, v) for _ in range(n)]


def coref_batch(prompts: list[Prompt], cfg: TaskConfig, v: Vocab | None = None) -> Batch:
    """Teacher-forced sequences ``<bos> chunks (Q NAME OBJ)*``; loss on each OBJ only."""
    v = v or vocab()
    T = cfg.seq_len
    tokens = np.full((len(prompts), T), v.pad, dtype=np.int64)
    targets = np.full((len(prompts), T), IGNORE, dtype=np.int64)
    kinds = np.full((len(prompts), T), -1, dtype=np.int8)
    for b, p in enumerate(prompts):
        seq = [v.bos]
        for chunk in p.chunks:
            seq.extend(chunk)
        for fact in p.question_facts():
            seq += [v.question, fact.name]
            targets[b, len(seq) - 1] = fact.obj   # predicted from the NAME position
            kinds[b, len(seq) - 1] = KINDS.index(fact.kind)
            seq.append(fact.obj)
        tokens[b, : len(seq)] = seq
    return Batch(tokens, targets, kinds, induction=False)


def sample_coref_batch(rng: random.Random, cfg: TaskConfig, batch: int, v: Vocab | None = None) -> Batch:
    """Training batch: prompts of 1..max_chunks chunks, uniformly."""
    v = v or vocab()
    prompts = [make_prompt(rng, cfg, rng.randint(1, cfg.max_chunks), v) for _ in range(batch)]
    return coref_batch(prompts, cfg, v)


def induction_batch(rng: random.Random, cfg: TaskConfig, batch: int, v: Vocab | None = None) -> Batch:
    """``<bos> S S`` with S a random segment of 4..(T-1)//2 tokens; loss on the repeat.

    The first token of the repeat is unpredictable, so loss starts at the second.
    """
    v = v or vocab()
    T = cfg.seq_len
    pool = v.names + v.objects + v.fillers + (v.pronoun, v.verb, v.stop, v.question)
    tokens = np.full((batch, T), v.pad, dtype=np.int64)
    targets = np.full((batch, T), IGNORE, dtype=np.int64)
    for b in range(batch):
        n = rng.randint(4, (T - 1) // 2)
        segment = [rng.choice(pool) for _ in range(n)]
        seq = [v.bos, *segment, *segment]
        tokens[b, : len(seq)] = seq
        # Position t predicts seq[t + 1]; repeat occupies n+1..2n, loss on its tokens 2..n.
        targets[b, n + 1 : 2 * n] = seq[n + 2 : 2 * n + 1]
    kinds = np.full((batch, T), -1, dtype=np.int8)
    return Batch(tokens, targets, kinds, induction=True)
