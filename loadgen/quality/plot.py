"""Longgen accuracy against the decode budget, as a PNG (matplotlib, headless)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def plot_budget_curve(results: dict[str, dict], path: str | Path, title: str = "",
                      context_tokens: int | None = None) -> Path:
    """``results`` as ``longgen_eval.as_json`` gives them -> ``path``: accuracy against ``budget_tokens``
    (log scale) for quest and for retro (one line per window), dense as a horizontal line; modes without a page
    budget (retrieval) are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float]]] = {}
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name, r in results.items():
        if r["policy"] == "dense":
            ax.axhline(r["accuracy"], color="black", linestyle="--", linewidth=1, label=f"dense ({r['accuracy']:.3f})")
            continue
        if r.get("budget_tokens") is None:     # retrieval's k is no page budget: its figures are in the JSON
            continue
        label = r["policy"] if r["retro_window"] is None else f"{r['policy']} w={r['retro_window']}"
        series.setdefault(label, []).append((r["budget_tokens"], r["accuracy"]))
    for label, points in sorted(series.items()):
        points.sort()
        ax.plot([b for b, _ in points], [a for _, a in points], marker="o", label=label)
    if series:
        ax.set_xscale("log", base=2)
        budgets = sorted({b for points in series.values() for b, _ in points})
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.minorticks_off()
    if context_tokens:
        ax.axvline(context_tokens, color="grey", linewidth=0.8, linestyle=":", label=f"prompt ({context_tokens} tokens)")
    ax.set_xlabel("budget_tokens (keys per KV head and layer)")
    ax.set_ylabel("answer accuracy")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)       # a long title on two lines, not cut off
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out
