"""Accuracy of the decode policies on held-out longgen prompts, through ``Engine.generate`` (greedy).

Layout of one request (documented choice): ``chunks = [[<bos>], chunk_1, .., chunk_C]``,
``suffix = [Q, N_1, .., N_K, .]``, ``mode="full"`` (the prompt is prefilled exactly, so what a mode
changes is its decode steps alone), ``max_new_tokens`` the target's length (2K + 1 in the pair form). Answer i is
right iff the generated token at question i's object slot (2i + 1 in the pair form) is its object
(``LongGenPrompt.answers_right``): slots are positions in the generation, so a step that derails costs every later
answer, as in LongGenBench.

A mode is ``dense``, ``quest@B``, ``retro@B[:wN]`` or ``retrieval@K[:sS][:wW]``: B is ``budget_tokens`` (the
keys one KV head attends per layer, in whole pages of the engine's block size), N is ``retro_window`` (the past
queries that later steps' pages correct; the engine's default without it). The sparse policies leave their first
``dense_layers`` layers dense. For retrieval, K is ``retrieval_k`` (keys a CPU index retrieves per query head and
layer; 0: the static set alone, StreamingLLM's baseline), S ``sink_tokens`` and W ``window_tokens`` (the static
set; the engine's defaults without them, which cover most of this task's 785-token prompt).

Imports nothing heavy at module level (``tessera --help`` reads its defaults).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loadgen.quality.tasks import FORMS
from loadgen.quality.vocab import vocab
from services.modes import DECODE_PARAMS, DECODE_POLICIES

DEFAULT_MODES = "dense,quest@32,quest@64,quest@128,quest@256,quest@512"
DEFAULT_DENSE_LAYERS = 1  # of the model's 4 (README.md says why)
# NOTE: 14 answers make the suffix ``Q N_1..N_14 .`` exactly one 16-token block. A suffix that spills into a
# second, nearly empty block leaves its last question's key there, where Quest's bound (tight over 2 keys,
# loose over 16) never wins a page: the last answer is then lost at every budget short of all pages.
DEFAULT_QUESTIONS = 14


@dataclass(frozen=True, slots=True)
class DecodeMode:
    """One decode policy (services/modes.py DECODE_POLICIES) with its parameters: ``budget`` (budget_tokens)
    for the policies that take one (quest, retro), ``window`` (retro_window) for retro only, None where not
    given."""

    policy: str
    budget: int | None = None
    window: int | None = None
    k: int | None = None         # retrieval: retrieval_k, sink_tokens, window_tokens
    sink: int | None = None
    recent: int | None = None

    @classmethod
    def parse(cls, text: str) -> "DecodeMode":
        spec = text.strip()
        policy, at, rest = spec.partition("@")
        budget, colon, window = rest.partition(":")
        if policy not in DECODE_POLICIES:
            raise ValueError(f"unknown decode mode {spec!r}; expected dense, quest@BUDGET, retro@BUDGET[:wWINDOW] or "
                             "retrieval@K[:sSINK][:wWINDOW]")
        if policy == "retrieval":
            return cls._retrieval(spec, at, rest)
        takes = DECODE_PARAMS[policy]
        if "budget_tokens" not in takes:
            if at:
                raise ValueError(f"mode {spec!r}: {policy} attends to every key and takes no budget")
            return cls(policy)
        if not budget:
            raise ValueError(f"mode {spec!r}: {policy} needs a budget of tokens, as {policy}@256")
        b = _positive(spec, "budget", budget)
        if not colon:
            return cls(policy, b)
        if "retro_window" not in takes:
            raise ValueError(f"mode {spec!r}: {policy} takes no window (:wN)")
        if not window.startswith("w"):
            raise ValueError(f"mode {spec!r}: the window is written :wN, as retro@{b}:w2")
        return cls(policy, b, _positive(spec, "window", window[1:]))

    @classmethod
    def _retrieval(cls, spec: str, at: str, rest: str) -> "DecodeMode":
        parts = rest.split(":")
        if not at or not parts[0]:
            raise ValueError(f"mode {spec!r}: retrieval needs its k, as retrieval@100 (0: the static set alone)")
        k = _positive(spec, "k", parts[0], low=0)
        given: dict[str, int] = {}
        for part in parts[1:]:
            name = {"s": "sink", "w": "recent"}.get(part[:1])
            if name is None or name in given:
                raise ValueError(f"mode {spec!r}: after the k come :sSINK and :wWINDOW (tokens), once each")
            given[name] = _positive(spec, "sink" if name == "sink" else "window", part[1:], low=0)
        return cls("retrieval", k=k, **given)

    def generate_args(self, dense_layers: int) -> dict:
        """The keyword arguments of ``Engine.generate`` (and ``Engine.decode_policy``) for this mode."""
        args = {"decode": self.policy}
        if self.policy == "retrieval":
            args["retrieval_k"] = self.k
            if self.sink is not None:
                args["sink_tokens"] = self.sink
            if self.recent is not None:
                args["window_tokens"] = self.recent
            return args
        if self.budget is not None:
            args.update(budget_tokens=self.budget, dense_layers=dense_layers)
        if self.window is not None:
            args["retro_window"] = self.window
        return args

    def __str__(self) -> str:
        if self.policy == "retrieval":
            return (f"retrieval@{self.k}" + ("" if self.sink is None else f":s{self.sink}")
                    + ("" if self.recent is None else f":w{self.recent}"))
        if self.budget is None:
            return self.policy
        return f"{self.policy}@{self.budget}" + ("" if self.window is None else f":w{self.window}")


def _positive(spec: str, what: str, text: str, low: int = 1) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"mode {spec!r}: {what} {text!r} is not a whole number") from None
    if n < low:
        raise ValueError(f"mode {spec!r}: {what} must be at least {low}, got {n}")
    return n


def parse_decode_modes(text: str) -> list[DecodeMode]:
    modes = [DecodeMode.parse(t) for t in text.split(",") if t.strip()]
    if not modes:
        raise ValueError("no modes given")
    if len({str(m) for m in modes}) != len(modes):
        raise ValueError(f"a mode is given twice in {text!r}")
    return modes


@dataclass(frozen=True, slots=True)
class GenResult:
    """One mode over the prompts: ``right[p][i]`` whether prompt p's answer i is right, ``names[p][i]``
    whether its name slot held question i's name, ``generations[p]`` the tokens, and the mean wall time
    of one ``generate`` call in seconds. ``pages``: what the decode steps read over every prompt (``DecodeStats``:
    steps, pages_visible, pages_read, pages_corrected), so that a policy's work is seen beside its accuracy (a Retro
    mode whose answers equal Quest's still shows the pages its past tokens were corrected with)."""

    mode: DecodeMode
    right: tuple[tuple[bool, ...], ...]
    names: tuple[tuple[bool, ...], ...]
    generations: tuple[tuple[int, ...], ...]
    mean_generate_s: float
    pages: dict[str, int] = field(default_factory=dict)
    index_host_dtype: str | None = None     # retrieval: how the engine held the offloaded K/V (float32, bfloat16)
    adj: tuple[tuple[bool, ...], ...] = ()   # relay form: whether each question's adj slot held the word before its name

    def accuracy(self) -> float:
        return sum(map(sum, self.right)) / sum(map(len, self.right))

    def by_answer(self) -> list[float]:
        """Accuracy at answer positions 1..K."""
        return [sum(col) / len(col) for col in zip(*self.right)]

    def as_json(self) -> dict:
        return {
            "policy": self.mode.policy, "budget_tokens": self.mode.budget, "retro_window": self.mode.window,
            "retrieval_k": self.mode.k, "sink_tokens": self.mode.sink, "window_tokens": self.mode.recent,
            "accuracy": self.accuracy(), "by_answer": self.by_answer(),
            "name_accuracy": sum(map(sum, self.names)) / sum(map(len, self.names)),
            "prompts_all_right": sum(map(all, self.right)) / len(self.right),
            "mean_generate_s": self.mean_generate_s,
            **({} if self.index_host_dtype is None else {"index_host_dtype": self.index_host_dtype}),
            **({"adj_accuracy": sum(map(sum, self.adj)) / sum(map(len, self.adj))} if self.adj else {}),
            **self._pages_json(),
        }

    def _pages_json(self) -> dict:
        """Per decode step, the pages (KV blocks, per KV head and layer) a dense step would read, those this policy
        read, and those a Retro step attended for past tokens that had not seen them."""
        steps = self.pages.get("steps", 0)
        if not steps:
            return {}
        return {"decode_steps": steps,
                "pages_visible_per_step": self.pages["pages_visible"] / steps,
                "pages_read_per_step": self.pages["pages_read"] / steps,
                "pages_corrected_per_step": self.pages["pages_corrected"] / steps}


def check_modes(engine, modes: list[DecodeMode], dense_layers: int) -> None:
    """Every mode against the engine before any runs: ValueError naming the mode for one the engine cannot
    serve (an unknown policy, a budget under one page, a parameter the policy does not take)."""
    for mode in modes:
        args = mode.generate_args(dense_layers)
        try:
            engine.decode_policy(args.pop("decode"), **args)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"mode {mode}: the engine cannot run it: {exc}") from None


def evaluate_decode_modes(engine, modes: list[DecodeMode], prompts, dense_layers: int = DEFAULT_DENSE_LAYERS,
                          progress: bool = True, prefill: str = "full") -> list[GenResult]:
    """Generate every prompt's answers greedily in every mode through ``engine.generate``, the prompt prefilled in
    ``prefill`` mode ("full": exactly; "tessera": each chunk's cached KV reused, so a retrieval decode searches the
    chunks' own indexes)."""
    from tqdm import tqdm

    check_modes(engine, modes, dense_layers)
    v = vocab()
    bar = tqdm(total=len(prompts) * len(modes), desc="eval", disable=not progress, dynamic_ncols=True)
    results = []
    for mode in modes:
        bar.set_postfix(mode=str(mode))
        right, names, adj, gens, seconds = [], [], [], [], 0.0
        pages = dict.fromkeys(("steps", "pages_visible", "pages_read", "pages_corrected"), 0)
        for p in prompts:
            t0 = time.perf_counter()
            stats: dict = {}
            out = engine.generate(chunks=[[v.bos]] + [list(c) for c in p.chunks], suffix=p.suffix(v),
                                  max_new_tokens=len(p.target(v)), mode=prefill, stats=stats,
                                  **mode.generate_args(dense_layers))
            seconds += time.perf_counter() - t0
            for key in pages:
                pages[key] += int(stats.get(key, 0))
            right.append(tuple(p.answers_right(out)))
            names.append(tuple(p.names_right(out)))
            if "adj" in FORMS[p.form]:
                adj.append(tuple(p.slots_right("adj", out)))
            gens.append(tuple(out))
            bar.update(1)
        held = engine.forward.options.index_host_dtype if mode.policy == "retrieval" else None
        results.append(GenResult(mode, tuple(right), tuple(names), tuple(gens), seconds / len(prompts), pages, held,
                                 tuple(adj)))
    bar.close()
    return results


def run_longgen_eval(model_dir: str, n_prompts: int, modes: list[DecodeMode], seed: int = 1,
                     questions: int = DEFAULT_QUESTIONS,
                     dense_layers: int = DEFAULT_DENSE_LAYERS, device: str = "cpu",
                     progress: bool = True, prefill: str = "full",
                     index_host_dtype: str = "float32", form: str = "pair") -> list[GenResult]:
    """``index_host_dtype``: how a retrieval mode's offloaded keys and values are held (EngineOptions'); ``form``: how
    the prompts lay out their answers (tasks.FORMS)."""
    from loadgen.quality.evaluate import load_engine
    from loadgen.quality.tasks import LongGenConfig, longgen_heldout
    from services.engine import EngineOptions

    if n_prompts < 1:
        raise ValueError("--prompts must be at least 1")
    if form not in FORMS:
        raise ValueError(f"--form must be one of {', '.join(FORMS)}, got {form!r}")
    if not 1 <= questions <= LongGenConfig().questions:
        raise ValueError(f"--questions must be in 1..{LongGenConfig().questions}")
    if dense_layers < 0:
        raise ValueError("--dense-layers must be at least 0")
    # every step searches the built indexes (none scans its layers while they build: a timing-dependent mix)
    options = EngineOptions(index_host_dtype=index_host_dtype, decode_while_building=False)
    engine = load_engine(model_dir, device, engine_options={"options": options})
    prompts = longgen_heldout(seed, n_prompts, LongGenConfig(questions=questions, form=form))
    if prefill not in ("full", "tessera"):
        raise ValueError(f"--prefill must be full or tessera, got {prefill!r}")
    return evaluate_decode_modes(engine, modes, prompts, dense_layers, progress, prefill)


def as_json(results: list[GenResult]) -> dict[str, dict]:
    """``{"<mode>": {"accuracy": .., "by_answer": [1..K], "name_accuracy": .., ...}}``."""
    return {str(r.mode): r.as_json() for r in results}
