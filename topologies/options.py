"""Checks of builder options, so that a wrong value is refused in one line naming the option."""

from __future__ import annotations

import numbers

__all__ = ["count", "self_weight"]


def self_weight(who: str, value) -> float:
    """A self weight: a number in [0, 1) (a peer that keeps everything never mixes)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) < 1.0:
        raise ValueError(f"{who}: self_weight must be a number in [0, 1) (1 would never mix); got {value!r}")
    return float(value)


def count(who: str, option: str, value, minimum: int) -> int:
    """An integer option such as rows, a degree or a group size, at least `minimum`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{who}: {option} must be an integer >= {minimum}; got {value!r}")
    return int(value)
