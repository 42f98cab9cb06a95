"""The paper-shaped sweep: hit ratio by KV budget x Zipf skew for prefix, position_aware, tessera.

LazyAttention (ICML'26) reports VRAM hit ratios at 1 GB / 10 GB / 50 GB / unlimited of
Llama-3-8B KV and alpha = 1.1 / 1.5 / 2.1. Our trace is synthetic (see ``SweepConfig``), so
the absolute numbers differ; what should hold is the shape: tessera well ahead of
position_aware under a tight budget, the gap closing as the budget grows, prefix far behind.
Given a trace file instead (``trace_file``), the sweep is by budget alone, over that trace.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator

from loadgen.sim.policies import DYNAMIC_POLICIES, SimConfig, SimResult, simulate
from loadgen.sim.shapes import ModelShape, format_bytes, parse_bytes
from loadgen.trace.dists import LengthDist
from loadgen.trace.io import read_trace
from loadgen.trace.model import TraceRequest
from loadgen.trace.synth import SynthConfig, synthesize

DEFAULT_BUDGETS = ("1GB", "10GB", "50GB", "unlimited")
DEFAULT_ALPHAS = (1.1, 1.5, 2.1)


@dataclass(frozen=True, slots=True)
class SweepConfig:
    """Budgets x traces: one synthetic trace per alpha (``trace`` with its alpha replaced), or,
    with ``trace_file``, that file alone (``trace`` and ``alphas`` then unused)."""

    trace: SynthConfig = field(default_factory=lambda: SynthConfig(
        docs=100_000, chunks_per_request=4, doc_tokens=LengthDist("const", (512.0,)),
        suffix_tokens=LengthDist("const", (32.0,)), requests=10_000, seed=0))
    budgets: tuple[str, ...] = DEFAULT_BUDGETS
    alphas: tuple[float, ...] = DEFAULT_ALPHAS
    shape: ModelShape = field(default_factory=lambda: ModelShape.from_name("llama3-8b"))
    eviction: str = "lru"
    policies: tuple[str, ...] = DYNAMIC_POLICIES
    trace_file: str | None = None

    def __post_init__(self) -> None:
        if not self.budgets or not (self.alphas or self.trace_file):
            raise ValueError("a sweep needs at least one budget and one alpha (or a trace file)")
        if not self.policies:
            raise ValueError("a sweep needs at least one policy")
        for b in self.budgets:
            parse_bytes(b)  # refuse a bad budget before any work
        for p in self.policies:
            SimConfig(p, 0, self.shape, self.eviction)

    def trace_labels(self) -> list[str]:
        """One per trace swept, in order: "α=1.1", ...; "" for a trace file."""
        return [""] if self.trace_file else [f"α={a:g}" for a in self.alphas]


def _traces(cfg: SweepConfig) -> Iterator[list[TraceRequest]]:
    """The traces swept, one at a time (a synthetic one is made when its turn comes)."""
    if cfg.trace_file:
        yield read_trace(cfg.trace_file)
        return
    for alpha in cfg.alphas:
        yield synthesize(replace(cfg.trace, alpha=alpha))


def run_sweep(cfg: SweepConfig, on_step=None) -> list[SimResult]:
    """Every (trace, budget, policy) result; ``on_step(description)`` after each simulation."""
    results = []
    for label, trace in zip(cfg.trace_labels(), _traces(cfg)):
        for budget in cfg.budgets:
            for policy in cfg.policies:
                sim = SimConfig(policy, parse_bytes(budget), cfg.shape, cfg.eviction)
                results.append(simulate(trace, sim))
                if on_step is not None:
                    on_step(" ".join(filter(None, (label, budget, policy))))
    return results


def sweep_table(cfg: SweepConfig, results: list[SimResult]) -> str:
    """Markdown: one row per policy (plus tessera / position_aware), one column per budget x trace."""
    budgets = [parse_bytes(b) for b in cfg.budgets]
    labels = cfg.trace_labels()
    cols = [(bi, ai) for bi in range(len(budgets)) for ai in range(len(labels))]
    head = "| policy | " + " | ".join(
        f"{format_bytes(budgets[bi])} {labels[ai]}".strip() for bi, ai in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    # run_sweep's order: trace, then budget, then policy
    n_b, n_p = len(budgets), len(cfg.policies)
    grid = {(p, bi, ai): results[(ai * n_b + bi) * n_p + pi].hit_ratio
            for pi, p in enumerate(cfg.policies) for bi, ai in cols}
    for policy in cfg.policies:
        cells = [f"{100 * grid[policy, bi, ai]:.2f}" for bi, ai in cols]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    if {"tessera", "position_aware"} <= set(cfg.policies):
        ratios = []
        for bi, ai in cols:
            aware = grid["position_aware", bi, ai]
            ratios.append(f"{grid['tessera', bi, ai] / aware:.2f}x" if aware > 0 else "inf")
        lines.append("| tessera / position_aware | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def sweep_report(cfg: SweepConfig, results: list[SimResult], command: str) -> str:
    """The whole markdown document: what was run, on what trace, and the table."""
    t = cfg.trace
    about = (f"- Trace: {cfg.trace_file}, {results[0].requests} requests" if cfg.trace_file
             else f"- Trace (one per alpha): {t.describe(alpha='α')}")
    return "\n".join([
        "# Simulated chunk-KV hit ratio (% of chunk tokens)",
        "",
        f"Command: `{command}`",
        "",
        f"- KV shape: {cfg.shape.name}, {cfg.shape.kv_bytes_per_token} bytes/token "
        f"(budgets in decimal units: 1GB = 10^9 bytes = "
        f"{int(1e9 // cfg.shape.kv_bytes_per_token)} tokens)",
        f"- Eviction: {cfg.eviction}; hit = a chunk served from cache, counted in tokens; "
        "suffixes are never cached, nor the last token of a request of chunks only.",
        about,
        "- position_aware keeps a replica per start position; tessera one copy per document; "
        "prefix reuses only a request's leading run of cached chunks.",
        "",
        sweep_table(cfg, results),
        "",
        "For reference, LazyAttention's table (its own QA trace, Llama-3.1-8B, vLLM): at 1 GB and "
        "alpha = 2.1 Block-Attention 7.27% vs LazyAttention 13.57% (1.87x), at 1 GB and alpha = 1.1 "
        "1.84% vs 3.47%; mid skew 10 GB 21.13% vs 23.89%, 50 GB 26.67% vs 28.44%, no limit 27.38% "
        "vs 29.09%; prefix caching 0-2.16%. Under a tight budget the gap grows with the number of "
        "positions a document takes (chunks per request) and shrinks with skew.",
        "",
    ])
