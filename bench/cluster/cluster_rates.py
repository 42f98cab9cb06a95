"""bench/cluster/cluster.py's open-loop rate sweep (``--rates``): the replays, and the markdown of one skew's table.

Per skew and mode: one set-up (the target's reset: caches dropped, with ``--register-corpus`` the
corpus registered), then the trace replayed with Poisson arrivals at each rate, lowest first.
"""

from __future__ import annotations

from dataclasses import replace


# The ratios issue #5 sets targets for, at each rate of a sweep: (metric, numerator mode, denominator mode)
RATE_RATIOS = (("ttft_p50", "full", "tessera"), ("ttft_p50", "blend_copy", "tessera"),
               ("throughput", "tessera", "full"))


def parse_rates(text: str) -> list[float]:
    """``--rates``: comma-separated requests/s, returned distinct and lowest first."""
    try:
        rates = sorted({float(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ValueError(f"--rates takes comma-separated requests/s, e.g. 2,4,8; got {text!r}") from None
    if not rates or not all(0 < r < float("inf") for r in rates):
        raise ValueError(f"--rates needs rates > 0 req/s; got {text!r}")
    return rates


def sweep_rates(trace, target, rcfg, modes, rates, max_seconds, on_mode=None) -> dict:
    """Per mode: one ``target.reset()`` (the corpus registration with a CorpusTarget), then the trace
    open loop at each rate. Returns rate -> mode -> (ReplayRun, Summary); ``on_mode(mode, sweep)``
    after each mode, so that a stopped sweep keeps the modes it finished."""
    from loadgen.replay.compare import replay_rates

    sweep: dict[float, dict] = {r: {} for r in rates}
    for mode in modes:
        if hasattr(target, "mode"):      # a corpus target registers that mode's corpus on reset
            target.mode = mode
        runs, summaries = replay_rates(trace, target, replace(rcfg, mode=mode), rates, duration_s=max_seconds)
        for rate, run, summary in zip(rates, runs, summaries):
            sweep[rate][mode] = (run, summary)
        if on_mode is not None:
            on_mode(mode, sweep)
    return sweep


def sweep_summaries(sweep: dict) -> dict:
    """rate -> mode -> Summary, from ``sweep_rates``' rate -> mode -> (ReplayRun, Summary)."""
    return {rate: {mode: summary for mode, (_, summary) in by_mode.items()} for rate, by_mode in sweep.items()}


def rate_sweep_md(alpha: str, rows: list[dict], requests: int, max_seconds: float, registered: dict,
                  plot: str | None) -> list[str]:
    """The markdown section of one skew's rate sweep (``alpha``: its value, as the heading shows it)."""
    from loadgen.replay.report import rate_sweep_table

    md = [f"## Zipf alpha {alpha}: open-loop rate sweep", "",
          f"Poisson arrivals at each offered rate over the same {requests}-request trace. Each mode is set up once "
          "(caches reset" + (", the corpus registered for a reuse mode" if registered else "") + "), then "
          "replays the rates lowest "
          f"first, each starting from the caches the previous one left. Sending stops after {max_seconds:g} s of "
          "a rate (requests in flight finish): done/sent counts the requests completed and sent, of "
          f"{requests}. Achieved: the steady request throughput (completions per second between the first "
          "completion and the last send; in parentheses, completed / duration where fewer than two requests "
          "completed before the last send, i.e. a short trace sent faster than the mode serves; the plot and "
          "the ratios leave those out). Targets: p50 TTFT full/tessera >= 3, blend_copy/tessera >= 1.3, "
          "req/s tessera/full >= 2.5 (below full's capacity every mode keeps up and the throughput ratio is ~1).",
          "", rate_sweep_table(rows), ""]
    if plot:
        md += [f"![rate sweep, alpha {alpha}]({plot})", ""]
    if registered:
        md += ["Corpus registered before the mode (not timed): " + ", ".join(
            f"{m} {sec:.1f} s" for m, sec in registered.items()), ""]
    return md
