"""NoLoCo, DeMo, SparseLoCo and DES-LOC on the default workload (digits, MLP) and on data=text_corpus (a small
transformer): one peer's parameters after STEPS training steps of each case, built as a run builds them.

Imported by tests/test_frontier_workloads.py (local backend, fleet) and run as a script under real launchers:
`python tests/peers/frontier_workloads_peer.py BACKEND OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runs.py

import runs  # noqa: E402

from dpsgd.build import build_peer  # noqa: E402
from dpsgd.config import parse

STEPS = 5  # every rule communicates by step 3 (periods below)
# short periods, so that every rule communicates within STEPS
OPTIONS = {
    "noloco": {"period": 3},
    "demo": {},
    "sparseloco": {"period": 3},
    "desloc": {"param_period": 2, "momentum_period": 3, "variance_period": 4},
}
TEXT = {"name": "text_corpus", "num_samples": 256, "seq_len": 32, "test_fraction": 0.1, "partition": "iid"}
TRANSFORMER = {"name": "transformer", "dim": 32, "layers": 1, "heads": 2}
CASES = [(algorithm, workload) for algorithm in OPTIONS for workload in ("digits", "text_corpus")]


def config(algorithm: str, workload: str, peers: int = 4, backend: str = "local") -> dict:
    cfg = runs.experiment(runs.algorithm(algorithm, **OPTIONS[algorithm]), "ring", peers, backend)
    if algorithm == "demo":
        cfg["optimizer"]["lr"] = 0.003
    if workload == "text_corpus":
        cfg["data"], cfg["model"], cfg["batch_size"] = dict(TEXT), dict(TRANSFORMER), 8
    return cfg


def parameters(comm, algorithm: str, workload: str) -> list[float]:
    peer = build_peer(comm, parse(config(algorithm, workload, comm.size, comm.backend)))
    for step in range(1, STEPS + 1):
        peer.step(step)
    return torch.cat([p.detach().reshape(-1) for p in peer.model.parameters()]).tolist()


def all_parameters(comm) -> dict:
    return {f"{a}-{w}": parameters(comm, a, w) for a, w in CASES}


if __name__ == "__main__":
    from runner import main

    main(all_parameters)
