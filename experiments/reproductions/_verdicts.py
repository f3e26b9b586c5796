"""Verdict rules shared by reproductions: how two configurations' means compare, given their 95% intervals."""

from __future__ import annotations

from experiments.intervals import mean_interval
from experiments.reproduce import Configuration


def compare(a: Configuration, b: Configuration, key: str) -> int:
    """+1 if a's interval for `key` lies wholly above b's, -1 if wholly below, 0 if the two intervals overlap
    (the difference cannot be told from seed noise). A configuration with one seed has no interval: its mean."""
    a_low, a_high = a.mean(key) - a.ci(key), a.mean(key) + a.ci(key)
    b_low, b_high = b.mean(key) - b.ci(key), b.mean(key) + b.ci(key)
    if a_low > b_high:
        return 1
    if a_high < b_low:
        return -1
    return 0


def overall(parts: list[bool]) -> bool | None:
    """A claim made of parts holds if every part holds, does not hold if none does, and partly holds (None) else."""
    return True if all(parts) else False if not any(parts) else None


def paired(a: Configuration, b: Configuration, key: str) -> tuple[float, float, int, int]:
    """a - b seed by seed, over the seeds both ran (a seed fixes the partition, batches and initial model, so the
    pair differs only by the setting): (mean difference, its 95% interval half width, seeds where a is higher,
    seeds compared)."""
    b_values = {r["summary"]["seed"]: r["summary"][key] for r in b.runs}
    differences = [
        r["summary"][key] - b_values[r["summary"]["seed"]] for r in a.runs if r["summary"]["seed"] in b_values
    ]
    if not differences:
        raise LookupError(f"no seed in common between {a.setting} and {b.setting}")
    mean, ci = mean_interval(differences)
    return mean, ci, sum(d > 0 for d in differences), len(differences)
