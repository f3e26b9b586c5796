"""bloc97/DeMo's demo.py (DeMo, a torch.optim.SGD subclass) on n gloo processes, fixed inputs: its sign steps.

Usage: python tools/fidelity/demo_bloc97.py DEMO_CHECKOUT tests/fixtures/demo_bloc97.npz
(DEMO_CHECKOUT: a clone of https://github.com/bloc97/DeMo; needs torch and einops.)

Inputs: float32 parameters W (96, 80) and b (96,), flat x0 = default_rng(0).normal(size=7776) (W's entries,
then b's) cast to float32; at step k peer i's gradient is x - c[k, i], c = default_rng(1).normal(size=(5, n,
7776)) cast to float32. Per case: the sign step of each of the 5 steps (p.grad after DeMo.step, the same on
every peer; checked here) and the parameters after the last step."""

from __future__ import annotations

import os
import sys

import common
import numpy as np

SEED, STEPS, SHAPES = 0, 5, ((96, 80), (96,))
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
CASES = {  # name -> (peers, lr, DeMo keywords): the reference's defaults where not named
    "n2": (2, 1e-3, {}),
    "n4": (4, 1e-3, {}),
    "n4_wd": (4, 0.01, {"weight_decay": 0.1, "compression_decay": 0.9, "compression_topk": 8, "compression_chunk": 16}),
}


def inputs(n: int):
    x0 = np.random.default_rng(SEED).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(SEED + 1).normal(size=(STEPS, n, NUMEL)).astype(np.float32)
    return x0, c


def peer(rank, n, port, checkout, case, tmp):
    import torch

    sys.path.insert(0, checkout)
    import demo

    common.init(rank, n, port)
    _, lr, options = CASES[case]
    x0, c = inputs(n)
    params, at = [], 0
    for shape in SHAPES:
        size = int(np.prod(shape))
        params.append(torch.nn.Parameter(torch.from_numpy(x0[at : at + size].reshape(shape).copy())))
        at += size
    opt = demo.DeMo(params, lr=lr, **options)
    signs, xs = [], []
    for k in range(STEPS):
        x = torch.cat([p.detach().reshape(-1) for p in params])
        g = x - torch.from_numpy(c[k, rank])
        at = 0
        for p in params:
            p.grad = g[at : at + p.numel()].reshape(p.shape).clone()
            at += p.numel()
        opt.step()
        signs.append(torch.cat([p.grad.reshape(-1) for p in params]).numpy().astype(np.int8))
        xs.append(torch.cat([p.detach().reshape(-1) for p in params]).numpy().copy())
    np.savez(f"{tmp}.rank{rank}.npz", signs=np.array(signs), x=np.array(xs))


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    arrays = {}
    for case, (n, _, _) in CASES.items():
        common.spawn(peer, n, checkout, case, out)
        ranks = [np.load(f"{out}.rank{r}.npz") for r in range(n)]
        for r in ranks[1:]:  # every peer takes the same sign step
            assert np.array_equal(r["signs"], ranks[0]["signs"]) and np.array_equal(r["x"], ranks[0]["x"])
        arrays[f"{case}_signs"] = ranks[0]["signs"]
        arrays[f"{case}_x"] = ranks[0]["x"][-1]
        for r in range(n):
            os.remove(f"{out}.rank{r}.npz")
    meta = {
        "repo": "https://github.com/bloc97/DeMo",
        "file": "demo.py (class DeMo)",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "cases": {case: {"peers": n, "lr": lr, "options": options} for case, (n, lr, options) in CASES.items()},
        "stubbed": "only the process group (gloo on 127.0.0.1, one process per peer)",
    }
    common.write(out, meta, arrays)
