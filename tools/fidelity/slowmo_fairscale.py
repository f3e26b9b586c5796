"""fairscale's SlowMo (fairscale 0.4.13, fairscale/experimental/nn/data_parallel/gossip/distributed.py:
SlowMoDistributedDataParallel with its LocalSGD base) on 4 gloo processes, fixed inputs: every peer's parameters.

Usage: python tools/fidelity/slowmo_fairscale.py tests/fixtures/slowmo_fairscale.npz
(needs `pip install --no-deps fairscale==0.4.13` beside torch.)

Stubbed: the process group (gloo on 127.0.0.1, one process per peer; nprocs_per_node 1, so every peer is a
node) and torch.cuda.synchronize (a no-op here: fairscale's create_process_group calls it, and there is no GPU).
The loop is the class docstring's: forward, backward, optimizer.step(), net.perform_slowmo(optimizer).
Case "init_first" also calls net._init_global_momentum_buffers(optimizer) before the first step (the code's
comment: "In an ideal implementation, this would be called by the caller"), so the slow momentum's first anchor is
the initial model; "as_documented" does not, and the anchor is the model after the first local step.
Inputs: float32 parameters W (8, 12) and b (12,), flat x0 = default_rng(0).normal(size=108) (W, then b); at step t
peer i's loss is 0.5 ||x - c[t, i]||^2, c = default_rng(1).normal(size=(12, 4, 108)) * (1 + i) cast to float32;
plain SGD lr 0.05; localsgd_frequency 3, slowmo_frequency 6 (fairscale's defaults: 3 and 48), slowmo_momentum 0.5,
slowmo_lr 1.0 (its defaults); 12 steps. Per case: every peer's parameters after every step."""

from __future__ import annotations

import os
import sys

import common
import numpy as np

SHAPES, STEPS, N, LR = ((8, 12), (12,)), 12, 4, 0.05
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
OPTIONS = {"localsgd_frequency": 3, "slowmo_frequency": 6, "slowmo_momentum": 0.5, "slowmo_lr": 1.0}
CASES = ("init_first", "as_documented")


def inputs():
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, N, NUMEL))
    return x0, (c * (1 + np.arange(N))[None, :, None]).astype(np.float32)


def peer(rank, n, port, case, tmp):
    import torch
    from fairscale.experimental.nn.data_parallel import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

    common.init(rank, n, port)
    torch.cuda.synchronize = lambda *args, **kwargs: None  # fairscale's helpers wait for a GPU there is not
    x0, c = inputs()

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            at = 0
            for name, shape in zip(("w", "b"), SHAPES):
                size = int(np.prod(shape))
                value = torch.from_numpy(x0[at : at + size].reshape(shape).copy())
                self.register_parameter(name, torch.nn.Parameter(value))
                at += size

        def forward(self, x):
            return torch.cat([self.w.reshape(-1), self.b]) + 0 * x

    net = SlowMoDistributedDataParallel(
        Flat(), nprocs_per_node=1, slowmo_base_algorithm=SlowMoBaseAlgorithm.LOCALSGD, **OPTIONS
    )
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    if case == "init_first":
        net._init_global_momentum_buffers(opt)
    xs = []
    for t in range(STEPS):
        opt.zero_grad()
        (0.5 * (net(torch.zeros(1)) - torch.from_numpy(c[t, rank])).pow(2).sum()).backward()
        opt.step()
        net.perform_slowmo(opt)
        xs.append(torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy().copy())
    np.save(f"{tmp}.rank{rank}.npy", np.array(xs))


if __name__ == "__main__":
    import fairscale

    out = sys.argv[1]
    arrays = {}
    for case in CASES:
        common.spawn(peer, N, case, out)
        arrays[f"{case}_x"] = np.stack([np.load(f"{out}.rank{r}.npy") for r in range(N)], axis=1)
        for r in range(N):
            os.remove(f"{out}.rank{r}.npy")
    meta = {
        "repo": "https://github.com/facebookresearch/fairscale (the PyPI release)",
        "file": "fairscale/experimental/nn/data_parallel/gossip/distributed.py (SlowMoDistributedDataParallel)",
        "commit": f"fairscale {fairscale.__version__} (PyPI wheel)",
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "options": OPTIONS,
        "lr": LR,
        "cases": {case: {"peers": N} for case in CASES},
        "stubbed": __doc__.split("Stubbed: ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
