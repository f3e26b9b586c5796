"""`make(name, n, **options)` and `names()`: the catalogue of built-in topologies."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from . import directed, graphs, schedules
from .base import Topology
from .base_k import base_k

__all__ = ["BUILDERS", "make", "names", "options_of"]

BUILDERS: dict[str, Callable[..., Topology]] = {
    "complete": graphs.complete,
    "ring": graphs.ring,
    "torus": graphs.torus,
    "hypercube": graphs.hypercube,
    "exponential": graphs.exponential,
    "star": graphs.star,
    "erdos_renyi": graphs.erdos_renyi,
    "random_regular": graphs.random_regular,
    "hierarchical": graphs.hierarchical,
    "one_peer_exponential": schedules.one_peer_exponential,
    "random_matching": schedules.random_matching,
    "base_k": base_k,
    "directed_exponential": directed.directed_exponential,
    "one_peer_directed_exponential": directed.one_peer_directed_exponential,
}


def names() -> list[str]:
    """The names `make` accepts."""
    return list(BUILDERS)


def options_of(name: str) -> dict[str, object]:
    """The options `make(name, n, ...)` accepts, with their defaults (None: worked out from n)."""
    if name not in BUILDERS:
        raise ValueError(f"unknown topology {name!r}; choose one of: {', '.join(BUILDERS)}")
    params = inspect.signature(BUILDERS[name]).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def make(name: str, n: int, **options) -> Topology:
    """Build the topology `name` over n peers, validated (see `names()` and `options_of(name)`)."""
    valid = options_of(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        choices = ", ".join(valid) if valid else "none"
        raise ValueError(f"{name}: unknown option(s) {', '.join(unknown)}; valid options: {choices}")
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name}: n (the number of peers) must be an integer >= 1; got {n!r}")
    topology = BUILDERS[name](int(n), **options)
    topology.options = {**options, **topology.options}
    return topology
