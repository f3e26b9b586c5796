"""gensyn-ai/noloco's NoLoCo optimizer (src/noloco/sparse_optimizer_c.py, SparseOptimizerC: the class its
noloco configs name, e.g. configs/no_reduce_exp/C4/c4_noloco_mean_100m_8.yaml) on n gloo processes, fixed inputs.

Usage: python tools/fidelity/noloco_gensyn.py NOLOCO_CHECKOUT tests/fixtures/noloco_gensyn.npz
(NOLOCO_CHECKOUT: a clone of https://github.com/gensyn-ai/noloco; needs torch and numpy.)

Stubbed: only the process group (gloo on 127.0.0.1, one process per peer; dp_group is the world).
Inputs: float32 parameters W (8, 12) and b (12,), flat x0 = default_rng(0).normal(size=108) (W, then b); at
step t peer i's gradient is x - c[t, i], c = default_rng(1).normal(size=(12, n, 108)) * (1 + i) cast to float32;
the reference's inner Adam at lr 0.01, number_of_local_steps 3, local_group_size 2, outer_lr 0.7, outer_momentum
0.5 (its configs' values), 12 steps. Per case: every peer's parameters after every step."""

from __future__ import annotations

import os
import sys

import common
import numpy as np

SHAPES, STEPS = ((8, 12), (12,)), 12
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
OPTIONS = {"local_group_size": 2, "number_of_local_steps": 3, "outer_lr": 0.7, "outer_momentum": 0.5, "lr": 0.01}
CASES = {"n2": 2, "n4": 4}


def inputs(n: int):
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, n, NUMEL))
    return x0, (c * (1 + np.arange(n))[None, :, None]).astype(np.float32)


def peer(rank, n, port, checkout, tmp):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, f"{checkout}/src")
    from noloco.sparse_optimizer_c import SparseOptimizerC

    common.init(rank, n, port)
    x0, c = inputs(n)
    model = torch.nn.Module()
    at = 0
    for name, shape in zip(("w", "b"), SHAPES):
        size = int(np.prod(shape))
        model.register_parameter(name, torch.nn.Parameter(torch.from_numpy(x0[at : at + size].reshape(shape).copy())))
        at += size
    opt = SparseOptimizerC(model, dist.group.WORLD, **OPTIONS)
    xs = []
    for t in range(STEPS):
        x = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        g, at = x - torch.from_numpy(c[t, rank]), 0
        for p in model.parameters():
            p.grad = g[at : at + p.numel()].reshape(p.shape).clone()
            at += p.numel()
        opt.step()
        xs.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy())
    np.save(f"{tmp}.rank{rank}.npy", np.array(xs))


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    arrays = {}
    for case, n in CASES.items():
        common.spawn(peer, n, checkout, out)
        arrays[f"{case}_x"] = np.stack([np.load(f"{out}.rank{r}.npy") for r in range(n)], axis=1)  # (steps, n, numel)
        for r in range(n):
            os.remove(f"{out}.rank{r}.npy")
    meta = {
        "repo": "https://github.com/gensyn-ai/noloco",
        "file": "src/noloco/sparse_optimizer_c.py (SparseOptimizerC)",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "options": OPTIONS,
        "cases": {case: {"peers": n} for case, n in CASES.items()},
        "stubbed": "only the process group (gloo on 127.0.0.1, one process per peer; dp_group is the world)",
    }
    common.write(out, meta, arrays)
