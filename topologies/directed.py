"""Directed topologies with column stochastic W, for push-sum (SGP, Assran et al. 2019).

Peer j sends to j + 2^k (mod n) and keeps a share of its own value; the shares of each sender sum
to 1 (column stochastic), the received weights need not.
"""

from __future__ import annotations

import numpy as np

from . import matrices, options
from .base import Topology
from .graphs import exponential_hops
from .matrices import from_entries

__all__ = ["directed_exponential", "one_peer_directed_exponential"]


def directed_exponential(n: int, *, self_weight: float | None = None) -> Topology:
    """Static: peer j sends to j + 2^k (mod n) for every 2^k < n. Each sender splits its value evenly
    over itself and its receivers, or keeps `self_weight` and splits the rest over the receivers."""
    hops = exponential_hops(n)
    s = 1.0 / (len(hops) + 1) if self_weight is None else options.self_weight("directed_exponential", self_weight)
    idx = np.arange(n)
    if n > matrices.DENSE_UP_TO:
        rows = np.concatenate([idx] + [(idx + hop) % n for hop in hops])
        values = np.r_[np.full(n, s), np.full(n * len(hops), (1.0 - s) / len(hops))]
        w = from_entries(n, rows, np.tile(idx, len(hops) + 1), values)
        return Topology("directed_exponential", [w], directed=True, options={"self_weight": s})
    w = s * np.eye(n) if hops else np.eye(n)
    for hop in hops:
        w[(idx + hop) % n, idx] += (1.0 - s) / len(hops)
    return Topology("directed_exponential", [w], directed=True, options={"self_weight": s})


def one_peer_directed_exponential(n: int, *, self_weight: float = 0.5) -> Topology:
    """At step t peer j sends to j + 2^(t mod tau) (mod n), tau = ceil(log2 n), keeping `self_weight`."""
    s = options.self_weight("one_peer_directed_exponential", self_weight)
    idx = np.arange(n)
    schedule = []
    for hop in exponential_hops(n):
        if n > matrices.DENSE_UP_TO:
            values = np.r_[np.full(n, s), np.full(n, 1.0 - s)]
            schedule.append(from_entries(n, np.r_[idx, (idx + hop) % n], np.r_[idx, idx], values))
            continue
        w = s * np.eye(n)
        w[(idx + hop) % n, idx] += 1.0 - s
        schedule.append(w)
    return Topology("one_peer_directed_exponential", schedule or [np.eye(n)], directed=True, options={"self_weight": s})
