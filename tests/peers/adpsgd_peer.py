"""Short randomized AD-PSGD episodes on a least-squares problem, and a numpy replay of their events.

Imported by tests/test_adpsgd.py (local backend) and run as a script under real launchers:
`python tests/peers/adpsgd_peer.py BACKEND OUT_DIR EPISODES SEED` runs EPISODES episodes (each drawn
from SEED and its index, the same draw on every rank) and writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

import topologies
from dpsgd.optim import ADPSGD

DIM, ROWS = 4, 5
TOPOLOGIES = [
    ("ring", {}),
    ("star", {}),
    ("hypercube", {}),
    ("torus", {}),
    ("base_k", {}),
    ("random_matching", {"bipartite": True}),
    ("erdos_renyi", {}),
]


def problem(n: int, seed: int):
    """Peer i holds f_i(x) = 1/(2 ROWS) ||A_i x - b_i||^2 and starts at its own x0_i."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, ROWS, DIM)), rng.normal(size=(n, ROWS)), rng.normal(size=(n, DIM))


def gradient(A_i, b_i, x):
    return A_i.T @ (A_i @ x - b_i) / ROWS


def bipartite_topologies(n: int) -> list[tuple[str, dict]]:
    out = []
    for name, opts in TOPOLOGIES:
        try:
            topologies.make(name, n, **opts).bipartite()
        except ValueError:
            continue
        out.append((name, opts))
    return out


def draw(n: int, seed: int) -> dict:
    """One episode's settings (the same on every peer: drawn from the seed alone)."""
    rng = random.Random(seed)
    name, opts = rng.choice(bipartite_topologies(n))
    budget = rng.choice(["steps", "steps", "samples", "seconds"])
    return {
        "seed": seed,
        "topology": name,
        "options": opts,
        "budget": budget,
        "steps": rng.randint(1, 6),
        "samples": rng.randint(1, 5 * n),
        "seconds": rng.uniform(0.002, 0.02),
        "lr": rng.choice([0.0, 0.05]),
        "jitter_s": rng.choice([0.0, 0.0002, 0.001]),
        "compute_s": rng.choice([0.0, 0.0005, 0.002]),
    }


def episode(comm, spec: dict) -> dict:
    """Run one episode on this peer; return x0, the final x, the logged events and the measurements."""
    A, b, x0 = problem(comm.size, spec["seed"])
    topo = topologies.make(spec["topology"], comm.size, **spec["options"]) if comm.size > 1 else None
    w = torch.nn.Parameter(torch.tensor(x0[comm.rank]))
    A_i, b_i = torch.tensor(A[comm.rank]), torch.tensor(b[comm.rank])
    opt = ADPSGD(
        torch.optim.SGD([w], lr=spec["lr"]),
        comm=comm,
        topology=topo,
        budget=spec["budget"],
        seed=spec["seed"],
        jitter_s=spec["jitter_s"],
        record_events=True,
        broadcast_initial=False,
    )
    opt.set_budget(steps=spec["steps"], samples=spec["samples"], seconds=spec["seconds"], samples_per_step=1)
    rng = random.Random(spec["seed"] * 31 + comm.rank)
    comm.barrier()
    opt.start()
    while not opt.should_stop():
        opt.zero_grad()
        (0.5 / ROWS * (A_i @ w - b_i).pow(2).sum()).backward()
        if spec["compute_s"]:
            time.sleep(rng.uniform(0, spec["compute_s"]))
        opt.step()
    opt.finish()
    return {
        "x0": x0[comm.rank].tolist(),
        "x": w.detach().tolist(),
        "events": [list(e) for e in opt.events],
        "measurements": opt.measurements(),
    }


def replay(spec: dict, results: list[dict]) -> np.ndarray:
    """Replay every peer's logged events with numpy and return the final parameters (n, DIM).

    A peer's log lists, in the order they changed its live parameters, its own steps (x_i += -lr
    grad f_i(x_hat_i), x_hat_i the value at its previous step) and its averagings, each named
    (active, id, passive) on both sides. An averaging happens when it is next on both sides' logs;
    if none can happen the logs are inconsistent (a torn or lost averaging) and this raises."""
    n = len(results)
    A, b, _ = problem(n, spec["seed"])
    x = np.array([r["x0"] for r in results], dtype=np.float64)
    snap = x.copy()
    logs = [[tuple(e) for e in r["events"]] for r in results]
    pos = [0] * n
    while any(pos[i] < len(logs[i]) for i in range(n)):
        progressed = False
        for i in range(n):
            while pos[i] < len(logs[i]):
                ev = logs[i][pos[i]]
                if ev[0] == "step":
                    x[i] = x[i] - spec["lr"] * gradient(A[i], b[i], snap[i])
                    snap[i] = x[i]
                    pos[i] += 1
                    progressed = True
                    continue
                _, active, _, passive = ev
                j = passive if i == active else active
                if pos[j] < len(logs[j]) and logs[j][pos[j]] == ev:
                    x[i] = x[j] = (x[i] + x[j]) * 0.5
                    pos[i] += 1
                    pos[j] += 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = [logs[i][pos[i] : pos[i] + 1] for i in range(n)]
            raise AssertionError(f"inconsistent event logs: peers stuck at {stuck}")
    return x


if __name__ == "__main__":
    import dpsgd.comm

    torch.set_num_threads(1)
    backend, out_dir, episodes, seed = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    comm = dpsgd.comm.init(backend, timeout_s=30)
    out = []
    for e in range(episodes):
        spec = draw(comm.size, seed * 1000 + e)
        out.append({"spec": spec, **episode(comm, spec)})
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(out))
    comm.barrier()
    comm.close()
