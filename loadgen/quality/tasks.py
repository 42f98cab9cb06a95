"""The quality tasks (coref, longgen) and the induction data that makes them trainable.

A prompt is ``<bos>``, then chunks of ``chunk_len`` tokens, then questions ``Q NAME`` answered by
``OBJ``. Every name in a prompt has exactly one fact, of one of three kinds:

- **direct**  ``NAME OBJ .``
- **local**   ``NAME arrives . [filler]* IT OBJ .`` inside one chunk;
- **cross**   ``NAME arrives .`` ends chunk c and ``IT OBJ .`` opens chunk c+1.

``IT`` always means the most recently mentioned name: between a ``NAME arrives .`` and its ``IT``
there is only filler. Names and objects are drawn fresh for every prompt, so the answer can only be
read from the context. A cross fact is the one that chunk-KV reuse breaks: computed alone, chunk
c+1 cannot see which name its ``IT`` refers to.

The longgen task (``LongGenConfig``, below) asks many questions over a long context, answered one
after another in one generation.

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
    adj: int = -1   # token id of the word before the name (longgen's relay form), -1 where there is none


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
    ``kinds[b, t]`` says what is predicted at t, -1 where nothing is (induction batches have no
    kinds): for coref the question type (index into KINDS), for longgen the target slot (question i's slots
    start at ``i * len(FORMS[form])``, in its form's order; the end follows the last).
    ``barred`` (longgen's relay form in training, else None): int64 ``[B, R, 4]`` rows ``(t, lo, hi, col)``, position
    t of prompt b attends none of ``lo..hi-1`` nor ``col`` (-1: none); padding rows are ``(0, 0, 0, -1)``.
    """

    tokens: np.ndarray   # int64 [B, T]
    targets: np.ndarray  # int64 [B, T]
    kinds: np.ndarray    # int8  [B, T]
    induction: bool
    barred: np.ndarray | None = None


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


def induction_batch(rng: random.Random, cfg: TaskConfig | LongGenConfig, batch: int, v: Vocab | None = None,
                    seq_len: int | None = None) -> Batch:
    """``<bos> S S`` with S a random segment of 4..(T-1)//2 tokens; loss on the repeat. T is ``seq_len``
    (default: the task's ``cfg.seq_len``).

    The first token of the repeat is unpredictable, so loss starts at the second.
    """
    v = v or vocab()
    T = seq_len or cfg.seq_len
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


# ---------------------------------------------------------------------------------------------- longgen
#
# A prompt is ``<bos>``, chunks of ``chunk_len`` tokens holding ``facts_per_chunk`` facts ``NAME OBJ .``
# each (plus distractors ``NAME arrives .`` that repeat a fact's name without an object, and filler),
# then the suffix ``Q N_1 .. N_K .``; the target generation answers every question in order,
# ``N_1 O_1 N_2 O_2 .. N_K O_K <eos>``. Each step must both find the next question in the suffix and
# look its fact up far back in the context, so a page a sparse decode step leaves out costs an answer,
# and what a wrong step leaves in the hidden state rides on into the next ones.

MAX_POSITIONS = 1024  # the quality model's (model.ModelConfig.max_positions): prompt + generation must fit

# How a longgen generation lays out each question's answer (the target slots of one question, in order):
#   pair   ``N O``        the answer follows its name (the lookup is the name step's own);
#   relay  ``N IT A O``   facts read ``A N O .``: the name step says ``IT``, the next says the word before the name
#                         (A), and the one after says the object, two steps after the lookup the name step could make.
# The relay form is one where RetroAttention can count: the name step's own output (IT) needs nothing its lookup
# reads, the object step reads that lookup two steps later, and the IT step loads the fact's page again (to read A
# beside the name), so its pages can correct a lookup that missed them. Its model is trained so that the object does
# come through the name step (``LongGenConfig.bar_object``; loadgen/quality/README.md).
FORMS = {"pair": ("name", "object"), "relay": ("name", "think", "adj", "object")}


@dataclass(frozen=True, slots=True)
class LongGenConfig:
    """Shape of longgen prompts; ``max_chunks`` chunks and ``questions`` answers are the held-out/eval
    shape (training draws 1..max_chunks chunks a batch and 1..questions answers a prompt); ``form`` lays out each
    answer (``FORMS``)."""

    chunk_len: int = 64
    max_chunks: int = 12
    facts_per_chunk: int = 4
    questions: int = 16
    p_distractor: float = 0.5   # chance, per fact slot of a chunk, of a ``NAME arrives .`` with a fact's name
    form: str = "pair"
    bar_object: float = 0.9     # relay, in training: chance that an object step attends neither the chunks nor IT

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {self.form!r}")
        # The fullest chunk: its facts and as many distractors (3 tokens each).
        need = (self.fact_len + 3) * self.facts_per_chunk
        if self.facts_per_chunk < 1 or self.chunk_len < need:
            raise ValueError(f"chunk_len {self.chunk_len} cannot hold {self.facts_per_chunk} facts and as many "
                             f"distractors; need >= {need} (facts_per_chunk >= 1)")
        facts = self.max_chunks * self.facts_per_chunk
        most = 64 if self.form != "relay" else 48   # names; relay draws two objects a fact, of 96
        if self.max_chunks < 1 or facts > most:
            raise ValueError(f"max_chunks x facts_per_chunk must be in 1..{most} in form {self.form} (one name "
                             f"each), got {facts}")
        if not 1 <= self.questions <= facts:
            raise ValueError(f"questions must be in 1..{facts} (the facts of a full prompt), got {self.questions}")
        if not 0 <= self.p_distractor <= 1 or not 0 <= self.bar_object <= 1:
            raise ValueError("p_distractor and bar_object are probabilities")
        if self.seq_len > MAX_POSITIONS:
            raise ValueError(f"a full prompt and its generation take {self.seq_len} positions, past {MAX_POSITIONS}")

    @property
    def fact_len(self) -> int:
        return 4 if self.form == "relay" else 3

    @property
    def seq_len(self) -> int:
        """Positions of a full prompt and its target: bos + chunks + ``Q N_1..N_K .`` + the answers and ``<eos>``."""
        return 1 + self.chunk_len * self.max_chunks + (self.questions + 2) + (len(FORMS[self.form]) * self.questions + 1)


@dataclass(frozen=True, slots=True)
class LongGenPrompt:
    """One longgen prompt. ``chunks`` hold token ids without ``<bos>``; ``facts`` are all "direct"
    (``chunk`` states the object); ``questions`` index ``facts`` in asking order; ``form`` lays out the answers."""

    chunks: tuple[tuple[int, ...], ...]
    facts: tuple[Fact, ...]
    questions: tuple[int, ...]
    form: str = "pair"

    def question_facts(self) -> list[Fact]:
        return [self.facts[i] for i in self.questions]

    def suffix(self, v: Vocab) -> list[int]:
        """``Q N_1 .. N_K .``: the questions, in the order they are to be answered."""
        return [v.question, *(f.name for f in self.question_facts()), v.stop]

    def target(self, v: Vocab) -> list[int]:
        """Each question's slots in its form's order (pair: ``N_i O_i``; relay: ``N_i IT A_i O_i``), then ``<eos>``: question i's slots start at ``i * len(FORMS[form])``."""
        word = {"name": lambda f: f.name, "object": lambda f: f.obj, "think": lambda f: v.pronoun,
                "adj": lambda f: f.adj}
        return [word[role](f) for f in self.question_facts() for role in FORMS[self.form]] + [v.eos]

    def slots_right(self, role: str, generated: list[int]) -> list[bool]:
        """Per question, in asking order: is the generated token at its ``role`` slot the one the target has there?
        Slots are positions of the generation, whatever came before them, so one step that derails (a skipped or
        repeated name) costs every later answer; a generation that stopped early has none."""
        roles = FORMS[self.form]
        if role not in roles:
            raise ValueError(f"form {self.form} has no {role!r} slot (it has {', '.join(roles)})")
        target, stride, at = self.target(vocab()), len(roles), roles.index(role)
        return [len(generated) > stride * i + at and generated[stride * i + at] == target[stride * i + at]
                for i in range(len(self.questions))]

    def answers_right(self, generated: list[int]) -> list[bool]:
        """Per question: is the generated token at its object slot its object?"""
        return self.slots_right("object", generated)

    def names_right(self, generated: list[int]) -> list[bool]:
        """Per question: is the token at its name slot its name (the model kept its place in the list)?"""
        return self.slots_right("name", generated)


def _lay_out(rng: random.Random, segments: list[list[int]], length: int, fillers: tuple[int, ...]) -> tuple[int, ...]:
    """``segments`` in random order with filler words between them (never inside one), ``length`` tokens in all."""
    rng.shuffle(segments)
    gaps: list[list[int]] = [[] for _ in range(len(segments) + 1)]
    for _ in range(length - sum(len(s) for s in segments)):
        gaps[rng.randrange(len(gaps))].append(rng.choice(fillers))
    tokens = gaps[0]
    for segment, filler in zip(segments, gaps[1:]):
        tokens += segment + filler
    return tuple(tokens)


def make_longgen_prompt(rng: random.Random, cfg: LongGenConfig, n_chunks: int, n_questions: int,
                        v: Vocab | None = None) -> LongGenPrompt:
    """Draw one prompt of ``n_chunks`` chunks and ``n_questions`` questions with fresh names and objects."""
    v = v or vocab()
    n_facts = n_chunks * cfg.facts_per_chunk
    if not 1 <= n_questions <= n_facts:
        raise ValueError(f"{n_chunks} chunks hold {n_facts} facts: cannot ask {n_questions} questions")
    relay = cfg.form == "relay"
    names, objects = rng.sample(v.names, n_facts), rng.sample(v.objects, 2 * n_facts if relay else n_facts)
    facts = tuple(Fact("direct", names[i], objects[i], i // cfg.facts_per_chunk, objects[n_facts + i] if relay else -1)
                  for i in range(n_facts))
    # Distractors: up to facts_per_chunk a chunk, each a different fact's name (before or after its fact).
    n_distract = [sum(rng.random() < cfg.p_distractor for _ in range(cfg.facts_per_chunk)) for _ in range(n_chunks)]
    distract = iter(rng.sample(names, sum(n_distract)))
    chunks = []
    for c in range(n_chunks):
        segments = [([f.adj] if relay else []) + [f.name, f.obj, v.stop]
                    for f in facts[c * cfg.facts_per_chunk:(c + 1) * cfg.facts_per_chunk]]
        segments += [[next(distract), v.verb, v.stop] for _ in range(n_distract[c])]
        chunks.append(_lay_out(rng, segments, cfg.chunk_len, v.fillers))
    return LongGenPrompt(tuple(chunks), facts, tuple(rng.sample(range(n_facts), n_questions)), cfg.form)


def longgen_heldout(seed: int, n: int, cfg: LongGenConfig = LongGenConfig()) -> list[LongGenPrompt]:
    """``n`` prompts of the eval shape (``max_chunks`` chunks, ``questions`` answers) from a stream no training
    run draws from."""
    rng = random.Random(f"longgen-heldout-{seed}")
    v = vocab()
    return [make_longgen_prompt(rng, cfg, cfg.max_chunks, cfg.questions, v) for _ in range(n)]


def longgen_batch(prompts: list[LongGenPrompt], v: Vocab | None = None, bar_object: float = 0.0,
                  rng: random.Random | None = None) -> Batch:
    """Teacher-forced ``<bos> chunks Q N_1..N_K .`` and the target (pair: ``N_1 O_1 .. N_K O_K <eos>``), padded to
    the longest; loss on the target (from the suffix's last token on), ``kinds`` its slot.

    ``bar_object`` (relay prompts; ``rng`` draws): the chance that a step saying an object (input ``A_i``) may attend
    neither the chunks nor the step before (input ``IT``), so that the object reaches it only through the name
    step's own lookup, two steps back. Without it the model trained here looks the object up again at the object
    step itself (its name two tokens back; ablation in loadgen/quality/README.md), and a past step's lookup counts
    for nothing; barred always, it learns nothing of what an unbarred step sees, and fails there."""
    v = v or vocab()
    seqs, starts = [], []
    for p in prompts:
        seq = [v.bos, *(t for c in p.chunks for t in c), *p.suffix(v)]
        starts.append(len(seq) - 1)          # predicts the target's first token
        seqs.append(seq + p.target(v))
    T = max(len(s) for s in seqs)
    tokens = np.full((len(prompts), T), v.pad, dtype=np.int64)
    targets = np.full((len(prompts), T), IGNORE, dtype=np.int64)
    kinds = np.full((len(prompts), T), -1, dtype=np.int8)
    for b, (seq, start) in enumerate(zip(seqs, starts)):
        tokens[b, : len(seq)] = seq
        targets[b, start : len(seq) - 1] = seq[start + 1 :]
        kinds[b, start : len(seq) - 1] = np.arange(len(seq) - 1 - start)
    barred = None
    if bar_object:
        if any(p.form != "relay" for p in prompts) or rng is None:
            raise ValueError("bar_object is for relay prompts, with an rng")
        stride, at = len(FORMS["relay"]), FORMS["relay"].index("object")
        barred = np.zeros((len(prompts), max(len(p.questions) for p in prompts), 4), dtype=np.int64)
        barred[..., 3] = -1
        for b, (p, start) in enumerate(zip(prompts, starts)):
            chunks_end = 1 + sum(len(c) for c in p.chunks)
            for i in range(len(p.questions)):
                if rng.random() < bar_object:
                    t = start + stride * i + at          # predicts question i's object; its input is A_i
                    barred[b, i] = (t, 1, chunks_end, t - 1)
    return Batch(tokens, targets, kinds, induction=False, barred=barred)


def bar_mask(barred, T: int):
    """``[B, 1, T, T]`` bool attention mask (True = may attend) from ``Batch.barred`` as a torch tensor: causal, but
    for the barred columns of its rows (the model's ``mask`` argument)."""
    import torch

    B = barred.shape[0]
    cols = torch.arange(T, device=barred.device)
    t, lo, hi, col = barred.unbind(-1)
    off = ((cols >= lo[..., None]) & (cols < hi[..., None])) | (cols == col[..., None])      # [B, R, T]
    mask = torch.ones(T, T, dtype=torch.bool, device=barred.device).tril().expand(B, T, T).clone()
    b = torch.arange(B, device=barred.device)[:, None].expand_as(t)
    mask[b, t] = mask[b, t] & ~off
    return mask[:, None]


def sample_longgen_batch(rng: random.Random, cfg: LongGenConfig, batch: int, v: Vocab | None = None) -> Batch:
    """Training batch: 1..max_chunks chunks (one count a batch, so it pads to its own length), each prompt
    1..questions answers (at most its facts)."""
    v = v or vocab()
    n_chunks = rng.randint(1, cfg.max_chunks)
    most = min(cfg.questions, n_chunks * cfg.facts_per_chunk)
    return longgen_batch([make_longgen_prompt(rng, cfg, n_chunks, rng.randint(1, most), v) for _ in range(batch)], v,
                         bar_object=cfg.bar_object if cfg.form == "relay" else 0.0, rng=rng)

