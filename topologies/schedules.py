"""Time-varying undirected topologies in which each peer talks to one peer per step.

`one_peer_exponential` (Ying et al., NeurIPS 2021) cycles through the exponential graph's offsets;
`random_matching` pairs the peers at random at every step. Both give doubly stochastic W(t)
(not necessarily symmetric: in the one-peer exponential graph i receives from i + 2^t and sends to
i - 2^t). The Base-(k+1) graph lives in `base_k`.
"""

from __future__ import annotations

import numpy as np

from . import matrices, options
from .base import Topology
from .graphs import exponential_hops
from .matrices import from_entries

__all__ = ["one_peer_exponential", "random_matching"]


def one_peer_exponential(n: int, *, self_weight: float = 0.5) -> Topology:
    """At step t peer i receives from i + 2^(t mod tau) and sends to i - 2^(t mod tau), tau = ceil(log2 n):
    W(t) = s I + (1 - s) P(t). With the default s = 1/2 the product over one period is exactly
    J = 11^T / n when n is a power of 2."""
    s = options.self_weight("one_peer_exponential", self_weight)
    idx = np.arange(n)
    schedule = []
    for hop in exponential_hops(n):  # tau = ceil(log2 n) of them
        if n > matrices.DENSE_UP_TO:
            values = np.r_[np.full(n, s), np.full(n, 1.0 - s)]
            schedule.append(from_entries(n, np.r_[idx, idx], np.r_[idx, (idx + hop) % n], values))
            continue
        w = s * np.eye(n)
        w[idx, (idx + hop) % n] += 1.0 - s
        schedule.append(w)
    return Topology("one_peer_exponential", schedule or [np.eye(n)], options={"self_weight": s})


def random_matching(n: int, *, seed: int = 0, self_weight: float = 0.5, bipartite: bool = False) -> Topology:
    """At each step a random matching pairs the peers (one sits out when n is odd); paired peers mix
    with weight 1 - self_weight. The matching at step t depends only on (seed, t), so every peer
    computes the same one independently. bipartite=True pairs even peers (active) with odd peers
    (passive) only, as AD-PSGD needs."""
    s = options.self_weight("random_matching", self_weight)
    seed = options.count("random_matching", "seed", seed, 0)
    evens, odds = np.arange(0, n, 2), np.arange(1, n, 2)

    def draw(step: int) -> np.ndarray:
        rng = np.random.default_rng([seed, step])
        if bipartite:
            left, right = rng.permutation(evens)[: odds.size], rng.permutation(odds)
        else:
            order = rng.permutation(n)
            left, right = order[0 : n - 1 : 2], order[1:n:2]
        if n > matrices.DENSE_UP_TO:
            alone = np.setdiff1d(np.arange(n), np.r_[left, right])  # the one left out when n is odd
            rows = np.r_[left, right, left, right, alone]
            cols = np.r_[left, right, right, left, alone]
            values = np.r_[np.full(2 * left.size, s), np.full(2 * left.size, 1.0 - s), np.ones(alone.size)]
            return from_entries(n, rows, cols, values)
        w = np.eye(n)
        w[left, left] = w[right, right] = s
        w[left, right] = w[right, left] = 1.0 - s
        return w

    split = (evens.tolist(), odds.tolist()) if bipartite else None
    return Topology(
        "random_matching",
        draw,
        options={"seed": int(seed), "self_weight": s, "bipartite": bool(bipartite)},
        split=split,
    )
