"""Runs that differ only by seed, summarized: the mean and a Student-t confidence interval per configuration.

With n seeds, the interval is mean +- t_{(1+c)/2, n-1} * s / sqrt(n), s the sample standard deviation (n - 1 in
the denominator): the interval a reviewer expects for a handful of seeds, wider than the normal one when n is small.
One seed gives a mean and no interval. Quantities that cannot be negative (times, bytes, distances, losses) or
exceed 1 (accuracies) have their plotted bands cut at those limits (`clipped_band`); tables keep the symmetric
half width, which `describe` puts in words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


def half_width(values: Sequence[float], confidence: float = CONFIDENCE) -> float:
    """Half the width of the Student-t interval for the mean of `values` (nan for fewer than 2 values)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(values)
    if n < 2:
        return math.nan
    std_error = float(np.std(values, ddof=1)) / math.sqrt(n)
    return float(stats.t.ppf((1 + confidence) / 2, df=n - 1)) * std_error


def mean_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """(mean, half width): the interval is mean - half width to mean + half width."""
    if len(values) == 0:
        raise ValueError("no values: an interval needs at least one run")
    return float(np.mean(values)), half_width(values, confidence)


def summarize(summaries: list[dict]) -> dict:
    """One summary for runs of one configuration: every numeric key that varies between them becomes its mean,
    with `KEY_ci95` the interval's half width; other keys (the same in all, or not numbers) keep the first run's
    value; `seeds` counts the runs."""
    out = dict(summaries[0])
    for key, first in summaries[0].items():
        values = [s.get(key) for s in summaries]
        if isinstance(first, bool) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            continue
        if key == "seed" or len(set(values)) == 1:
            continue  # the grouping key itself (a mean of seeds means nothing), or a setting such as peers
        out[key], ci = mean_interval(values)
        if not math.isnan(ci):
            out[f"{key}_ci95"] = ci
    if len(summaries) > 1:
        out.pop("seed", None)
    out["seeds"] = len(summaries)
    return out


def describe(seeds: list[int]) -> str:
    """What the reported ± means, for rows over these numbers of seeds: one sentence for a caption."""
    several = sorted({n for n in seeds if n > 1})
    if not several:
        return "One seed per row: values are single runs, with no interval."
    counts = " or ".join(str(n) for n in several)
    text = (
        f"± is the half width of the {CONFIDENCE:.0%} Student-t interval of the mean over a row's {counts} seeds "
        f"(t(0.975, n-1) s / sqrt(n), s the sample standard deviation)"
    )
    return text + ("; rows of one seed have no interval." if min(seeds) == 1 else ".")


def band(curves: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """Pointwise mean and interval half width of curves of one configuration, over their common length."""
    length = min(len(c) for c in curves)
    stacked = np.array([c[:length] for c in curves], dtype=float)
    means = stacked.mean(axis=0)
    if len(curves) < 2:
        return means, np.zeros(length)
    return means, np.array([half_width(stacked[:, i]) for i in range(length)])


def clipped_band(
    curves: list[list[float]], low: float | None = 0.0, high: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pointwise mean and the interval's lower and upper edges, cut at `low` and `high` (None: no limit): a band of
    losses or times never reaches below 0, one of accuracies never above 1."""
    means, half = band(curves)
    lower, upper = means - half, means + half
    if low is not None:
        lower = np.maximum(lower, low)
    if high is not None:
        upper = np.minimum(upper, high)
    return means, lower, upper
