"""The Base-(k+1) graph (Takezawa et al., NeurIPS 2023, "Beyond exponential graph"): a finite
schedule after which every peer holds the exact average, for every n, with at most k peers per step.

Built in three layers, as in the paper:
- k-peer hyper-hypercube, for n whose prime factors are all <= k + 1: write n = f_1 * ... * f_L with
  2 <= f_l <= k + 1; at round l the peers whose mixed-radix digits (radices f_1, f_2, ...) differ
  only in digit l average in cliques of f_l peers. Exact after L rounds.
- simple Base-(k+1) graph, any n: write n in base k + 1, n = sum_l a_l (k+1)^(p_l) with
  p_1 > p_2 > ..., and split the peers into groups V_l of a_l (k+1)^(p_l). (1) Every group averages
  inside by a hyper-hypercube. (2) For l = 1, ..., L - 1 in turn, each peer of the smaller groups
  V_(>l) pairs with one peer of each of the a_l sub-blocks ((k+1)^(p_l) peers each) of V_l and takes
  weight |V_l| / |V_(>=l)| from them; the average of V_(>=l) then sits in V_(>l) and in each
  sub-block of V_l. (3) After its turn, each sub-block of V_l averages inside again by a
  hyper-hypercube, which leaves every peer with the global average.
- Base-(k+1) graph: with n = s * r, s the largest divisor of n whose prime factors are <= k + 1,
  run the simple graph on s blocks of r peers, then hyper-hypercubes across the blocks; keep this
  or the simple graph on all n, whichever is shorter.
The schedule repeats with period equal to its length, so training can keep gossiping after it.
"""

from __future__ import annotations

import numpy as np

from . import options
from .base import Topology

__all__ = ["base_k", "schedule"]


def _factors(m: int, k: int) -> list[int] | None:
    """m as a product of factors in 2..k+1, using the largest first, listed smallest first; None when
    m has a prime factor above k + 1."""
    factors = []
    for f in range(k + 1, 1, -1):
        while m % f == 0:
            factors.append(f)
            m //= f
    return factors[::-1] if m == 1 else None


def _embed(m: int, blocks) -> np.ndarray:
    """An m x m step of local matrices acting on disjoint blocks of peers; the others keep their value."""
    w = np.eye(m)
    for peers, local in blocks:
        w[np.ix_(peers, peers)] = local
    return w


def _hyper_hypercube(m: int, k: int) -> list[np.ndarray]:
    """k-peer hyper-hypercube on m peers (every prime factor of m <= k + 1)."""
    if m == 1:
        return [np.eye(1)]
    factors = _factors(m, k)
    assert factors is not None, "callers check that every prime factor of m is <= k + 1"
    rounds, stride, idx = [], 1, np.arange(m)
    for f in factors:
        firsts = idx[(idx // stride) % f == 0]
        clique = np.full((f, f), 1.0 / f)
        rounds.append(_embed(m, [(first + stride * np.arange(f), clique) for first in firsts]))
        stride *= f
    return rounds


def _simple_base(m: int, k: int, inner_edges: bool) -> list[np.ndarray]:
    """The simple Base-(k+1) graph on m peers."""
    if _factors(m, k) is not None:
        return _hyper_hypercube(m, k)
    digits, rest = [], m
    while rest:
        digits.append(rest % (k + 1))
        rest //= k + 1
    terms = [(digits[p], p) for p in reversed(range(len(digits))) if digits[p]]  # (a, p), largest first
    sizes = [a * (k + 1) ** p for a, p in terms]
    groups = np.split(np.arange(m), np.cumsum(sizes)[:-1])
    last = len(groups) - 1
    # Sub-blocks of (k+1)^p peers; the last group may have p = 0 and is then one block of a < k+1 peers.
    blocks = [g.reshape(a, -1) if p else g.reshape(1, -1) for g, (a, p) in zip(groups, terms, strict=True)]
    settle = [_hyper_hypercube(b.shape[1], k) for b in blocks]

    # (1) every group averages inside; groups done early repeat their rounds, as in the paper
    inside = [_hyper_hypercube(size, k) for size in sizes]
    rounds = [
        _embed(m, [(g, h[r % len(h)]) for g, h in zip(groups, inside, strict=True)])
        for r in range(max(map(len, inside)))
    ]
    settled = [0] * len(groups)  # phase (3) rounds taken by each group
    turn = 0  # the group whose sub-blocks the smaller groups pair with, in phase (2)
    while settled[0] < len(settle[0]):
        step = []
        for gi in range(len(groups)):  # (3) groups past their turn (and the last one) settle
            if gi < turn or gi == last <= turn:
                local = settle[gi][settled[gi] % len(settle[gi])]
                settled[gi] += 1
                step += [(b, local) for b in blocks[gi]]
        w = _embed(m, step)
        if turn < last:  # (2)
            a, share = terms[turn][0], sizes[turn] / sum(sizes[turn:])
            unused = [list(b) for b in blocks[turn]]
            for g in reversed(groups[turn + 1 :]):
                for i in g:
                    for sub in unused:
                        h = sub.pop()
                        w[i, h] = w[h, i] = share / a
                        w[h, h] = 1.0 - share / a
                    w[i, i] = 1.0 - share
            if inner_edges:  # the sub-blocks' idle peers (equal values) average in cliques of k + 1
                idle = [h for sub in unused for h in sub]
                for c in range(0, len(idle) - 1, k + 1):
                    clique = idle[c : c + k + 1]
                    w[np.ix_(clique, clique)] = 1.0 / len(clique)
        rounds.append(w)
        turn += 1
    return rounds


def schedule(n: int, k: int = 1, inner_edges: bool = True) -> list[np.ndarray]:
    """The Base-(k+1) graph's mixing matrices over n peers, in order."""
    simple = _simple_base(n, k, inner_edges)
    rest = n
    for f in range(2, k + 2):
        while rest % f == 0:
            rest //= f
    smooth = n // rest
    if smooth == 1 or rest == 1:
        return simple
    within, across = _simple_base(rest, k, inner_edges), _hyper_hypercube(smooth, k)
    if len(simple) < len(within) + len(across):
        return simple
    grid = np.arange(n).reshape(smooth, rest)  # row b: the contiguous block b
    return [_embed(n, [(row, local) for row in grid]) for local in within] + [
        _embed(n, [(col, local) for col in grid.T]) for local in across
    ]


def base_k(n: int, *, k: int = 1, inner_edges: bool = True) -> Topology:
    """Base-(k+1) graph: exact average after `period` steps for any n, each peer talking to at most k
    peers per step. inner_edges: let peers that would sit idle in a step average among themselves
    (no effect on exactness; more mixing while training)."""
    k = options.count("base_k", "k (peers per step)", k, 1)
    return Topology("base_k", schedule(n, int(k), bool(inner_edges)), options={"k": int(k), "inner_edges": inner_edges})
