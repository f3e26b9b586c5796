"""epfml/quasi-global-momentum's D2 (code/pcode/optim/decentralized_d2.py, class SGD) and gradient tracking
(code/pcode/optim/decentralized_sgd_with_gradient_tracking.py, class SGD), with its ring (pcode/utils/topology.py
RingGraph) and pcode/utils/communication.py DecentralizedAggregation, on 5 gloo processes.

Usage: python tools/fidelity/d2_gt_epfml.py QGM_CHECKOUT tests/fixtures/d2_gt_epfml.npz
(QGM_CHECKOUT: a clone of https://github.com/epfml/quasi-global-momentum; needs torch, numpy, scipy, networkx.)

Stubbed: the process group (gloo on 127.0.0.1, one process per peer) and the bit2byte module (a CUDA extension
pcode/utils/sparsification.py imports for its sign packing; these use only its get_n_bits, a byte count). The
`conf` the optimizers read is a namespace with the graph (RingGraph of 5 on the CPU: 1/3 each; a ring of 4 has the
eigenvalue -1/3 that D2 refuses), is_centralized False, epoch_ 0, local_index (0 at the first step and counted up
after each, as create_scheduler.py's scheduler does: D2's first step is plain), comm_device "cpu" and
graph_topology "ring"; the timer a null context. Parameter groups are one per tensor with name, param_size and
nelement, as pcode/create_optimizer.py makes them, momentum 0 (the rules' plain form).
Inputs: float32 parameters W (8, 12) and b (12,), flat x0 = default_rng(0).normal(size=108) (W, then b); at step t
peer i's gradient is x - c[t, i], c = default_rng(1).normal(size=(12, 5, 108)) * (1 + i) cast to float32; lr 0.05,
12 steps. Per case: every peer's parameters after every step."""

from __future__ import annotations

import contextlib
import os
import sys
import types

import common
import numpy as np

SHAPES, STEPS, N, LR = ((8, 12), (12,)), 12, 5, 0.05
CLASSES = {"d2": "decentralized_d2", "gradient_tracking": "decentralized_sgd_with_gradient_tracking"}
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def inputs():
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, N, NUMEL))
    return x0, (c * (1 + np.arange(N))[None, :, None]).astype(np.float32)


def peer(rank, n, port, checkout, case, tmp):
    import torch

    common.init(rank, n, port)
    sys.modules["bit2byte"] = types.ModuleType("bit2byte")
    sys.path.insert(0, f"{checkout}/code")
    import importlib

    from pcode.utils.topology import RingGraph

    SGD = importlib.import_module(f"pcode.optim.{CLASSES[case]}").SGD

    x0, c = inputs()
    params, groups, at = [], [], 0
    for name, shape in zip(("w", "b"), SHAPES):
        size = int(np.prod(shape))
        p = torch.nn.Parameter(torch.from_numpy(x0[at : at + size].reshape(shape).copy()))
        params.append(p)
        groups.append({"params": [p], "name": name, "param_size": p.size(), "nelement": p.nelement()})
        at += size
    graph = RingGraph(n, 1, ",".join(["0"] * n), "cpu", False, rank, rng_state=None, topology_conf=None)
    conf = types.SimpleNamespace(
        graph=graph, slow_buffer_conf=None, is_centralized=False, epoch_=0, local_index=0, comm_device="cpu",
        graph_topology="ring",
    )  # fmt: skip
    opt = SGD(groups, lr=LR, momentum=0.0, conf=conf)
    timer = lambda *args, **kwargs: contextlib.nullcontext()  # noqa: E731
    xs = []
    for t in range(STEPS):
        x = torch.cat([p.detach().reshape(-1) for p in params])
        g, at = x - torch.from_numpy(c[t, rank]), 0
        for p in params:
            p.grad = g[at : at + p.numel()].reshape(p.shape).clone()
            at += p.numel()
        opt.step(timer=timer)
        conf.local_index += 1
        xs.append(torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy())
    np.save(f"{tmp}.rank{rank}.npy", np.array(xs))


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    arrays = {}
    for case in CLASSES:
        common.spawn(peer, N, checkout, case, out)
        arrays[f"{case}_x"] = np.stack([np.load(f"{out}.rank{r}.npy") for r in range(N)], axis=1)
        for r in range(N):
            os.remove(f"{out}.rank{r}.npy")
    meta = {
        "repo": "https://github.com/epfml/quasi-global-momentum",
        "file": "code/pcode/optim/decentralized_d2.py (SGD), "
        "code/pcode/optim/decentralized_sgd_with_gradient_tracking.py (SGD)",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "lr": LR,
        "peers": N,
        "stubbed": __doc__.split("Stubbed: ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
