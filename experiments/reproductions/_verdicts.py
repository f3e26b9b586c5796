"""Verdict rules shared by reproductions: how two configurations' means compare, given their 95% intervals."""

from __future__ import annotations

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
