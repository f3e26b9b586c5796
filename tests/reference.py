"""Independent numpy references of the update rules (DESIGN.md), written from the equations."""

from __future__ import annotations

import numpy as np


def grads(A, b, x):
    """Per-peer gradients of f_i(x_i) = 1/(2 m) ||A_i x_i - b_i||^2; x has shape (n, d)."""
    m = A.shape[1]
    return np.einsum("nmd,nm->nd", A, np.einsum("nmd,nd->nm", A, x) - b) / m


def sgd_increment(g, buf, lr, momentum):
    """torch.optim.SGD's step: buf <- momentum * buf + g (buf = g at the first step); d = -lr buf."""
    buf = g.copy() if buf is None or momentum == 0 else momentum * buf + g
    return -lr * buf, buf


def run(algorithm, A, b, x0, steps, lr, momentum, mixing=None, order="cta"):
    """Trajectory (steps, n, d). mixing(k) gives W at step k."""
    x, buf, out = x0.copy(), None, []
    for k in range(steps):
        g = grads(A, b, x)
        if algorithm == "allreduce":
            g = np.broadcast_to(g.mean(0), g.shape)
            d, buf = sgd_increment(g, buf, lr, momentum)
            x = x + d
        elif order == "cta":
            d, buf = sgd_increment(g, buf, lr, momentum)
            x = mixing(k) @ x + d
        else:
            d, buf = sgd_increment(g, buf, lr, momentum)
            x = mixing(k) @ (x + d)
        out.append(x.copy())
    return np.array(out)
