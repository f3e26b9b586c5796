"""Compressed update rules against independent numpy references, on the local backend: Choco with every
codec, and DPSGD, AllReduce, DiLoCo and Streaming DiLoCo on a compressing communicator (dpsgd.comm.codecs),
each written here from its equations on the least-squares problem of tests/peers/quadratic.py. Each
option's trajectory is also shown to differ from its neighbour's reference (top_k from random_k, int8
from fp16, fp16 from bf16, sign from qsgd), so a codec swapped for another one fails."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from peers import quadratic as q
from peers import suite_peer as s
from reference import grads

import topologies
from dpsgd.comm import codecs, run_local
from dpsgd.optim import DPSGD, AllReduce, Choco, DiLoCo, StreamingDiLoCo

N, STEPS, LR = 4, 12, 0.05
OPTIONS = {"top_k": {"ratio": 0.4}, "random_k": {"ratio": 0.4, "seed": 3}, "qsgd": {"levels": 4, "seed": 1}}
NEIGHBOUR = {"top_k": "random_k", "random_k": "top_k", "sign": "qsgd", "qsgd": "sign", "int8": "fp16"}
NEIGHBOUR.update({"fp16": "bf16", "bf16": "fp16"})


# --- the codecs in numpy: what a receiver decodes -------------------------------------------------------
def bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 -> bfloat16 (nearest even, on the bit pattern) -> float64, as torch converts."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)).astype(np.float64)


def decoded(name: str, v: np.ndarray, key: tuple, rescale: bool = True) -> np.ndarray:
    n, o = v.size, OPTIONS.get(name, {})
    if name in ("top_k", "random_k"):
        k = min(n, max(1, math.ceil(o["ratio"] * n - 1e-9)))
        if name == "top_k":
            idx = np.argsort(-np.abs(v), kind="stable")[:k]
        else:  # the positions are the codec's random draw from (seed, key): taken as given
            idx = codecs.RandomK(o["ratio"], o["seed"]).indices(n, key, "cpu").numpy()
        out = np.zeros_like(v)
        out[idx] = v[idx]
        return out
    if name == "sign":
        return np.abs(v).sum() / n * np.where(v < 0, -1.0, 1.0)
    if name == "qsgd":  # the uniform draws are the codec's, from (seed, key)
        u = torch.rand(n, generator=codecs._generator(o["seed"], key, torch.device("cpu")), dtype=torch.float64)
        s, norm = o["levels"], np.linalg.norm(v)
        scaled = np.abs(v) / norm * s
        level = np.clip(np.floor(scaled) + (u.numpy() < scaled - np.floor(scaled)), 0, s)
        tau = 1 + min(n / s**2, math.sqrt(n) / s) if rescale else 1.0
        return np.where(v < 0, -level, level) * (norm / (s * tau))
    if name == "int8":
        scale = np.abs(v).max() / 127
        return np.clip(np.round(v / scale), -127, 127) * scale if scale > 0 else np.zeros_like(v)
    if name == "fp16":
        return v.astype(np.float32).astype(np.float16).astype(np.float64)
    return bf16(v)


def rows(name, x, tag, **kw):
    return np.stack([decoded(name, x[i], (i, *tag), **kw) for i in range(len(x))])


def mean(name, v, memory, call):
    """The compressed all-reduce mean of the rows of v (n, d): reduce-scatter of chunks, each encoded by its
    sender and error-fed, then all-gather of the owners' encoded, error-fed chunk means."""
    n, d = v.shape
    size = math.ceil(d / n)
    u = np.zeros((n, n * size))
    u[:, :d] = v + memory.get("sent", 0)
    chunks = u.reshape(n, n, size)
    sent = chunks.copy()
    for i in range(n):
        for r in range(1, n):
            sent[i, (i + r) % n] = decoded(name, chunks[i, (i + r) % n], (i, call, r), rescale=False)
    memory["sent"] = (u - sent.reshape(n, -1))[:, :d]
    owned = np.stack([sum(sent[(k - r) % n, k] for r in range(n)) / n for k in range(n)]) + memory.get("owned", 0)
    final = np.stack([decoded(name, owned[k], (k, call, n), rescale=False) for k in range(n)])
    memory["owned"] = owned - final
    return final.reshape(-1)[:d]


# --- the rules in numpy ------------------------------------------------------------------------------
def ref_choco(name, A, b, x, W, gamma=0.5):
    x_hat, out = np.zeros_like(x), []
    for t in range(STEPS):
        x = x - LR * grads(A, b, x)
        x_hat = x_hat + rows(name, x - x_hat, (t,))
        x = x + gamma * (W @ x_hat - x_hat)
        out.append(x.copy())
    return out


def ref_dpsgd(name, A, b, x, W):  # order cta: x <- x - q + W q + d, q = Q(x^k)
    out = []
    for k in range(STEPS):
        qx = rows(name, x, (k + 1,))
        x = x - LR * grads(A, b, x) - qx + W @ qx
        out.append(x.copy())
    return out


def ref_allreduce(name, A, b, x, W):
    memory, out = {}, []
    for k in range(STEPS):
        g = grads(A, b, x)
        m = mean(name, np.concatenate([g[:, 3:], g[:, :3]], 1), memory, k + 1)  # last parameter first
        x = x - LR * np.concatenate([m[2:], m[:2]])
        out.append(x.copy())
    return out


def ref_diloco(name, A, b, x, W, period=3, alpha=0.7, beta=0.9):
    anchor, u, memory, out, calls = x.mean(0), 0.0, {}, [], 0
    for t in range(1, STEPS + 1):
        x = x - LR * grads(A, b, x)
        if t % period == 0:
            calls += 1
            G = anchor - (anchor - mean(name, anchor - x, memory, calls))
            u = beta * u + G
            anchor = anchor - alpha * (G + beta * u)
            x = np.tile(anchor, (len(x), 1))
        out.append(x.copy())
    return out


def fragments(name: str) -> int:
    """Two fragments of 3 and 2 entries are chunks of 1 entry over 4 peers, which int8 and top_k send whole:
    those codecs are checked on one fragment (chunks of 2)."""
    return 2 if name in ("fp16", "bf16") else 1


def ref_streaming(name, A, b, x, W, period=4, delay=1, alpha=0.5, lr=0.7, beta=0.9):
    """Fragment p of F (numpy.array_split's ranges) starts a sync after steps t = (p + 1) period / F - delay
    (mod period) and completes it `delay` steps later."""
    F = fragments(name)
    h, anchor, u, memories, flight, out, calls = period // F, x.mean(0), np.zeros(5), [{} for _ in range(F)], {}, [], 0
    parts = [slice(int(c[0]), int(c[-1]) + 1) for c in np.array_split(np.arange(5), F)]
    for t in range(1, STEPS + 1):
        x = x - LR * grads(A, b, x)
        for p in range(F):
            if (t - (p + 1) * h + delay) % period == 0:
                calls += 1
                flight[p] = mean(name, anchor[parts[p]] - x[:, parts[p]], memories[p], calls)
            if t > delay and (t - (p + 1) * h) % period == 0:
                md, part = flight.pop(p), parts[p]
                u[part] = beta * u[part] + md
                anchor[part] = anchor[part] - lr * (md + beta * u[part])
                x[:, part] = alpha * x[:, part] + (1 - alpha) * anchor[part]
        out.append(x.copy())
    return out


def spec(name):
    return {"name": name, **{k: v for k, v in OPTIONS.get(name, {}).items()}}


OPTIMIZERS = {
    "choco": lambda name, params, comm, topo: Choco(
        torch.optim.SGD(params, lr=LR), topology=topo, comm=comm, compressor=name, gamma=0.5, **OPTIONS.get(name, {})
    ),
    "dpsgd": lambda name, params, comm, topo: DPSGD(torch.optim.SGD(params, lr=LR), topology=topo, comm=comm),
    "allreduce": lambda name, params, comm, topo: AllReduce(torch.optim.SGD(params, lr=LR), comm=comm),
    "diloco": lambda name, params, comm, topo: DiLoCo(torch.optim.SGD(params, lr=LR), comm=comm, period=3),
    "streaming_diloco": lambda name, params, comm, topo: StreamingDiLoCo(
        torch.optim.SGD(params, lr=LR), comm=comm, period=4, fragments=fragments(name), delay=1
    ),
}
REFERENCES = {
    "choco": ref_choco,
    "dpsgd": ref_dpsgd,
    "allreduce": ref_allreduce,
    "diloco": ref_diloco,
    "streaming_diloco": ref_streaming,
}
CASES = (
    [("choco", c) for c in ("top_k", "random_k", "sign", "qsgd", "int8", "fp16", "bf16")]
    + [(rule, c) for rule in ("dpsgd", "allreduce", "diloco", "streaming_diloco") for c in ("int8", "fp16", "top_k")]
    + [("streaming_diloco", "bf16")]
)


@pytest.mark.parametrize("rule,name", CASES, ids=[f"{r}-{c}" for r, c in CASES])
def test_trajectory_equals_numpy_reference(rule, name):
    topo = topologies.make("ring", N)

    def peer(comm):
        params, loss = s.model(comm)
        wrapped = comm if rule == "choco" else codecs.wrap(comm, spec(name))
        opt = OPTIMIZERS[rule](name, params, wrapped, topo)
        return s.run(opt, params, loss, STEPS)

    # broadcast_initial: every peer starts from rank 0's x0
    A, b, x0 = q.problem(N)
    start = np.tile(x0[0], (N, 1))
    got = np.stack([np.array(t) for t in run_local(N, peer)], axis=1)  # (steps, n, d)
    want = np.array(REFERENCES[rule](name, A, b, start, topo.mixing_matrix()))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-10)
    neighbour = np.array(REFERENCES[rule](NEIGHBOUR[name], A, b, start, topo.mixing_matrix()))
    assert np.abs(got - neighbour).max() > 1e-8  # the check tells this codec from its neighbour
