"""epfml/byzantine-robust-decentralized-optimizer's ClippedGossip (codes/aggregator.py SelfCenteredClipping, over
codes/graph_utils.py Ring with its Metropolis weights) on 5 workers in one process: every worker's model.

Usage: python tools/fidelity/clipped_gossip_epfml.py BRDO_CHECKOUT tests/fixtures/clipped_gossip_epfml.npz
(BRDO_CHECKOUT: a clone of https://github.com/epfml/byzantine-robust-decentralized-optimizer; needs torch, numpy.)

Stubbed: the training loop around the aggregator, restated in the order codes/simulator.py DecentralizedTrainer.train
runs it (every worker's local step on its own model, x_{t+1/2}; then every worker aggregates its own flattened
model with its neighbours' through its aggregator; then every model is replaced by its aggregate), with plain SGD
as the worker's optimizer and the gradient given; the Worker, data loaders and metrics objects are left out.
Inputs: float32 models of 108 entries, x0 = default_rng(0).normal(size=108) on every worker; at step t worker i's
gradient is x - c[t, i], c = default_rng(1).normal(size=(12, 5, 108)) * (1 + i) cast to float32; lr 0.05, 12
steps. Cases: the adaptive radius (tau None: the second largest distance to a neighbour) and a fixed tau 0.5.
Per case: every worker's model after every step."""

from __future__ import annotations

import sys

import common
import numpy as np

N, NUMEL, STEPS, LR = 5, 108, 12, 0.05
CASES = {"adaptive": None, "tau05": 0.5}


def inputs():
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, N, NUMEL))
    return x0, (c * (1 + np.arange(N))[None, :, None]).astype(np.float32)


def run(tau):
    import torch
    from codes.aggregator import SelfCenteredClipping
    from codes.graph_utils import Ring

    graph = Ring(N)
    aggregators = [
        SelfCenteredClipping(graph.nodes[i], graph.metropolis_weight[i, :], tau, worker=None) for i in range(N)
    ]
    x0, c = inputs()
    models = [torch.from_numpy(x0.copy()) for _ in range(N)]
    out = []
    for t in range(STEPS):
        half = [x - LR * (x - torch.from_numpy(c[t, i])) for i, x in enumerate(models)]  # each worker's SGD step
        models = [
            agg(half[i], [half[e.theother(graph.nodes[i]).index] for e in graph.nodes[i].edges])
            for i, agg in enumerate(aggregators)
        ]
        out.append(np.stack([m.numpy().copy() for m in models]))
    return np.array(out)


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    sys.path.insert(0, checkout)
    arrays = {f"{case}_x": run(tau) for case, tau in CASES.items()}
    meta = {
        "repo": "https://github.com/epfml/byzantine-robust-decentralized-optimizer",
        "file": "codes/aggregator.py (SelfCenteredClipping), codes/graph_utils.py (Ring, metropolis_weight)",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "lr": LR,
        "peers": N,
        "cases": CASES,
        "stubbed": __doc__.split("Stubbed: ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
