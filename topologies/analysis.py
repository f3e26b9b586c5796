"""How fast a topology mixes: spectral gap, consensus steps, exact averaging, degree, a summary.

Notation: W(t) is the mixing matrix at step t, Pi_t = W(t-1) ... W(1) W(0) the product after t
steps (x_t = Pi_t x_0), J = 11^T / n the averaging matrix. For push-sum (column stochastic W) the
peers' estimates are z_t = x_t / w_t with weights w_t = Pi_t 1, so the operator that maps x_0 to the
estimates is Z_t = diag(Pi_t 1)^-1 Pi_t; for doubly stochastic W it is Pi_t itself. Consensus is
measured by ||Z_t - J||_2, the worst-case factor by which the distance to the average shrinks.

A topology that keeps sparse matrices (more than `matrices.DENSE_UP_TO` peers) gets its spectral gap from
ARPACK (scipy.sparse.linalg) on the product over one period applied as a sequence of sparse products; the
consensus figures still multiply dense (n, n) products and stay for moderate n.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.sparse.linalg import LinearOperator, eigs, eigsh

from .base import TOL, Topology
from .matrices import is_sparse, is_symmetric, positive

__all__ = [
    "consensus_curve",
    "consensus_steps",
    "degree",
    "describe",
    "exact_averaging_steps",
    "is_column_stochastic",
    "is_doubly_stochastic",
    "spectral_gap",
]

RANDOM_WINDOW = 32  # steps of a random schedule that stand for "one period" in the figures below
NOISE = 1e-12  # eigenvalue moduli below this are rounding noise of an exact average


def is_doubly_stochastic(w, tol: float = TOL) -> bool:
    """Non-negative, rows and columns summing to 1 within tol."""
    w = w if is_sparse(w) else np.asarray(w, dtype=np.float64)
    return bool(
        ((w.data if is_sparse(w) else w) >= 0).all()
        and np.allclose(w.sum(axis=0), 1.0, rtol=0, atol=tol)
        and np.allclose(w.sum(axis=1), 1.0, rtol=0, atol=tol)
    )


def is_column_stochastic(w, tol: float = TOL) -> bool:
    """Non-negative, columns summing to 1 within tol (push-sum)."""
    w = w if is_sparse(w) else np.asarray(w, dtype=np.float64)
    return bool(((w.data if is_sparse(w) else w) >= 0).all() and np.allclose(w.sum(axis=0), 1.0, rtol=0, atol=tol))


def _steps(topology: Topology) -> int:
    """Steps that make up one period (a fixed window for random schedules)."""
    return topology.period if topology.period is not None else RANDOM_WINDOW


def _product(topology: Topology, steps: int) -> np.ndarray:
    p = np.eye(topology.n)
    for t in range(steps):
        p = topology._matrix(t) @ p
    return p


def _second_modulus(w: np.ndarray) -> float:
    """The second largest eigenvalue modulus (0 for n = 1)."""
    if w.shape[0] == 1:
        return 0.0
    ev = np.linalg.eigvalsh(w) if np.array_equal(w, w.T) else np.linalg.eigvals(w)
    return float(np.sort(np.abs(ev))[-2])


def _second_modulus_sparse(matrices: list, doubly: bool) -> float:
    """|lambda_2| of the product P = W(p-1) ... W(0) of sparse matrices, by ARPACK on P applied to vectors.
    Doubly stochastic: the largest modulus of P - J (P's spectrum with its eigenvalue 1 replaced by 0; J = 11^T / n),
    from Lanczos when P is symmetric; otherwise the second of P's two largest moduli."""
    n = matrices[0].shape[0]
    if n <= 3:  # ARPACK wants k < n - 1
        return _second_modulus(np.linalg.multi_dot([np.eye(n), *(w.toarray() for w in reversed(matrices))]))

    def product(x: np.ndarray) -> np.ndarray:
        for w in matrices:
            x = w @ x
        return x

    v0 = np.random.default_rng(0).random(n)  # fixed start: the same figure on every call
    if not doubly:
        op = LinearOperator((n, n), matvec=product, dtype=np.float64)
        return float(np.sort(np.abs(eigs(op, k=2, which="LM", v0=v0, return_eigenvectors=False)))[0])
    deflated = LinearOperator((n, n), matvec=lambda x: product(x) - x.mean(), dtype=np.float64)
    if len(matrices) == 1 and is_symmetric(matrices[0]):
        return float(np.abs(eigsh(deflated, k=1, which="LM", v0=v0, return_eigenvectors=False)).max())
    return float(np.abs(eigs(deflated, k=1, which="LM", v0=v0, return_eigenvectors=False)).max())


def spectral_gap(w_or_topology) -> float:
    """1 - |lambda_2|, the second largest eigenvalue modulus, of a matrix or a static topology.

    Time-varying topology of period p: 1 - |lambda_2(P)|^(1/p) with P = W(p-1) ... W(0) the product
    over one period, i.e. the asymptotic per-step rate (eigenvalue moduli, not singular values, so
    that the static case is the special case p = 1; `consensus_steps` gives the worst case). A random
    schedule uses the product of its first 32 steps. Moduli below 1e-12 count as 0 (an exact average),
    so a finite-time topology has gap 1. Ring with weights 1/3: (2/3)(1 - cos(2 pi / n)), n >= 3.
    """
    if not isinstance(w_or_topology, Topology):
        if is_sparse(w_or_topology):
            modulus = _second_modulus_sparse([w_or_topology], is_doubly_stochastic(w_or_topology))
            return 1.0 if modulus < NOISE else 1.0 - modulus
        return 1.0 - _second_modulus(np.asarray(w_or_topology, dtype=np.float64))
    steps = _steps(w_or_topology)
    stored = [w_or_topology._stored(t) for t in range(steps)]
    if any(is_sparse(w) for w in stored):
        modulus = _second_modulus_sparse(
            [w_or_topology.sparse_mixing_matrix(t) for t in range(steps)], not w_or_topology.directed
        )
    else:
        modulus = _second_modulus(_product(w_or_topology, steps))
    return 1.0 if modulus < NOISE else 1.0 - modulus ** (1.0 / steps)


def _estimates(product: np.ndarray) -> np.ndarray | None:
    """Z = diag(Pi 1)^-1 Pi, or None while some peer's push-sum weight is still 0."""
    mass = product.sum(axis=1)
    return product / mass[:, None] if (mass > 0).all() else None


def _within(product: np.ndarray, eps: float) -> bool:
    """||Z - J||_2 <= eps; the Frobenius norm skips the SVD when the answer is clearly no."""
    z = _estimates(product)
    if z is None:
        return False
    err = z - 1.0 / z.shape[0]
    if np.linalg.norm(err) > eps * math.sqrt(z.shape[0]):
        return False
    return bool(np.linalg.norm(err, 2) <= eps)


def consensus_curve(topology: Topology, steps: int) -> np.ndarray:
    """||Z_t - J||_2 for t = 0..steps (inf while a push-sum weight is 0)."""
    out, p = [], np.eye(topology.n)
    for t in range(steps + 1):
        z = _estimates(p)
        out.append(np.inf if z is None else float(np.linalg.norm(z - 1.0 / topology.n, 2)))
        p = topology._matrix(t) @ p
    return np.array(out)


def consensus_steps(topology: Topology, eps: float = 1e-3, *, max_steps: int = 1_000_000) -> int | None:
    """The smallest t with ||Z_t - J||_2 <= eps: steps after which the distance to the average has
    shrunk by eps whatever the starting values. Exact (products of the actual matrices); None if
    not reached within max_steps.

    Doubly stochastic schedules never increase ||Pi_t - J||_2, so periodic ones are searched by
    repeated squaring of the period product (fast for slow mixers such as large rings); the others
    step by step.
    """
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps}")
    n = topology.n
    if _within(np.eye(n), eps):
        return 0
    period = topology.period
    if period is None or not all(is_doubly_stochastic(topology._matrix(t)) for t in range(period)):
        p = np.eye(n)
        for t in range(max_steps):
            p = topology._matrix(t) @ p
            if _within(p, eps):
                return t + 1
        return None
    powers = [_product(topology, period)]  # powers[k] = P^(2^k)
    while not _within(powers[-1], eps):
        if period * 2 ** (len(powers) - 1) > max_steps:
            return None
        powers.append(powers[-1] @ powers[-1])
    done, q = np.eye(n), 0  # largest q with P^q still outside eps
    for k in reversed(range(len(powers) - 1)):
        candidate = powers[k] @ done
        if not _within(candidate, eps):
            done, q = candidate, q + 2**k
    t = q * period  # the answer lies in the next period (later only if rounding disagrees at the edge)
    while t < max_steps:
        done = topology._matrix(t) @ done
        t += 1
        if _within(done, eps):
            return t
    return None


def exact_averaging_steps(topology: Topology, tol: float = 1e-10) -> int | None:
    """The step t after which Z_t equals J to tol (max entry), or None if the topology only averages
    asymptotically.

    A finite-time schedule of period p has P - J nilpotent, so it is exact within n periods; there
    its error drops from a macroscopic value to rounding noise in one step, while an asymptotic one
    crosses tol geometrically. The first step within tol is therefore exact only if its error is
    below 1e-4 times the step before's. Random schedules are followed for n steps.
    """
    n = topology.n
    horizon = n * (topology.period or 1)
    if topology.period is not None:  # cheap exit for slow mixers: P^(2^K), 2^K >= n, not near J
        p = _product(topology, topology.period)
        for _ in range(max(n - 1, 1).bit_length()):
            p = p @ p
        z = _estimates(p)
        if z is None or np.abs(z - 1.0 / n).max() > tol:
            return None
    p, before = np.eye(n), np.abs(np.eye(n) - 1.0 / n).max()
    if before <= tol:
        return 0
    for t in range(horizon):
        p = topology._matrix(t) @ p
        z = _estimates(p)
        err = np.inf if z is None else np.abs(z - 1.0 / n).max()
        if err <= tol:
            return t + 1 if err <= 1e-4 * before else None
        before = err
    return None


def degree(topology: Topology) -> int:
    """Messages a peer sends per step: the largest out-degree over peers and the steps of one period
    (the first 32 steps of a random schedule)."""
    most = 0
    for t in range(_steps(topology)):
        rows, cols = positive(topology._stored(t))
        most = max(most, int(np.bincount(cols[rows != cols], minlength=topology.n).max()))
    return most


def describe(topology: Topology, eps: float = 1e-3) -> dict:
    """A record of the topology and how it mixes (see the functions above for the definitions)."""
    try:
        topology.bipartite()
        bipartite = True
    except ValueError:
        bipartite = False
    return {
        "name": topology.name,
        "n": topology.n,
        "options": dict(topology.options),
        "directed": topology.directed,
        "period": topology.period,
        "degree": degree(topology),
        "spectral_gap": spectral_gap(topology),
        "eps": eps,
        "consensus_steps": consensus_steps(topology, eps),
        "exact_averaging_steps": exact_averaging_steps(topology),
        "bipartite": bipartite,
    }
