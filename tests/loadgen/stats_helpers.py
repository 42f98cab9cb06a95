"""Goodness-of-fit arithmetic for the load-generator tests (no scipy)."""

from __future__ import annotations

import math

import numpy as np

Z_999 = 3.0902  # standard normal quantile at 0.999


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Chi-square quantile by the Wilson-Hilferty approximation (good to ~1% for df >= 3)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def chi2_statistic(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed ``counts`` against ``probs``.

    Bins are taken in order and the tail is pooled until every bin expects >= min_expected.
    """
    n = counts.sum()
    expected = probs * n
    obs_bins, exp_bins, o_acc, e_acc = [], [], 0.0, 0.0
    for o, e in zip(counts, expected):
        o_acc += o
        e_acc += e
        if e_acc >= min_expected:
            obs_bins.append(o_acc)
            exp_bins.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:  # leftover tail joins the last bin
        obs_bins[-1] += o_acc
        exp_bins[-1] += e_acc
    obs, exp = np.array(obs_bins), np.array(exp_bins)
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1
