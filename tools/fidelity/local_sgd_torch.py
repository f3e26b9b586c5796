"""torch's post-local SGD (torch.distributed.algorithms: DDP with post_localSGD_hook, PostLocalSGDOptimizer, and
PeriodicModelAverager or HierarchicalModelAverager) on 4 gloo processes, fixed inputs: every peer's parameters.

Usage: python tools/fidelity/local_sgd_torch.py tests/fixtures/local_sgd_torch.npz
(the installed torch is the reference: torch/distributed/algorithms/model_averaging/{averagers,
hierarchical_model_averager}.py and ddp_comm_hooks/post_localSGD_hook.py of torch 2.13.0.)

Stubbed: only the process group (gloo on 127.0.0.1, one process per peer). The hook all-reduces the gradients for
the first `warmup` steps (start_localSGD_iter) and leaves them local after (post_local_gradient_allreduce=False);
the averager averages the parameters after each optimizer step when its rule says so.
Inputs: float32 parameters W (8, 12) and b (12,) (a module whose forward returns them flat), flat x0 =
default_rng(0).normal(size=108) (W, then b); at step t peer i's loss is 0.5 ||x - c[t, i]||^2 (gradient x -
c[t, i]), c = default_rng(1).normal(size=(12, 4, 108)) * (1 + i) cast to float32; plain SGD lr 0.05, 12 steps.
Per case: every peer's parameters after every step."""

from __future__ import annotations

import os
import sys

import common
import numpy as np

SHAPES, STEPS, N, LR = ((8, 12), (12,)), 12, 4, 0.05
NUMEL = sum(int(np.prod(s)) for s in SHAPES)
CASES = {  # name -> (averager, its options, warm-up steps of the hook = the averager's warmup_steps)
    "periodic": ("PeriodicModelAverager", {"period": 3}, 2),
    "hierarchical": ("HierarchicalModelAverager", {"period_group_size_dict": {2: 2, 4: 4}}, 4),
    "hierarchical_w2": ("HierarchicalModelAverager", {"period_group_size_dict": {2: 2, 4: 4}}, 2),
}


def inputs():
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, N, NUMEL))
    return x0, (c * (1 + np.arange(N))[None, :, None]).astype(np.float32)


def peer(rank, n, port, case, tmp):
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
    from torch.distributed.algorithms.model_averaging import averagers, hierarchical_model_averager
    from torch.distributed.optim import PostLocalSGDOptimizer

    common.init(rank, n, port)
    kind, options, warmup = CASES[case]
    x0, c = inputs()

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            at = 0
            for name, shape in zip(("w", "b"), SHAPES):
                size = int(np.prod(shape))
                self.register_parameter(
                    name, torch.nn.Parameter(torch.from_numpy(x0[at : at + size].reshape(shape).copy()))
                )
                at += size

        def forward(self):
            return torch.cat([self.w.reshape(-1), self.b])

    model = torch.nn.parallel.DistributedDataParallel(Flat())
    state = PostLocalSGDState(
        process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
    )
    model.register_comm_hook(state, post_localSGD_hook)
    if kind == "PeriodicModelAverager":
        averager = averagers.PeriodicModelAverager(warmup_steps=warmup, **options)
    else:
        averager = hierarchical_model_averager.HierarchicalModelAverager(warmup_steps=warmup, **options)
    opt = PostLocalSGDOptimizer(torch.optim.SGD(model.parameters(), lr=LR), averager)
    xs = []
    for t in range(STEPS):
        opt.zero_grad()
        (0.5 * (model() - torch.from_numpy(c[t, rank])).pow(2).sum()).backward()
        opt.step()
        xs.append(model.module().detach().numpy().copy())
    np.save(f"{tmp}.rank{rank}.npy", np.array(xs))


if __name__ == "__main__":
    import torch

    out = sys.argv[1]
    arrays = {}
    for case in CASES:
        common.spawn(peer, N, case, out)
        arrays[f"{case}_x"] = np.stack([np.load(f"{out}.rank{r}.npy") for r in range(N)], axis=1)
        for r in range(N):
            os.remove(f"{out}.rank{r}.npy")
    meta = {
        "repo": "https://github.com/pytorch/pytorch (the installed torch)",
        "file": "torch/distributed/algorithms/model_averaging/averagers.py, hierarchical_model_averager.py; "
        "torch/distributed/algorithms/ddp_comm_hooks/post_localSGD_hook.py; "
        "torch/distributed/optim/post_localSGD_optimizer.py",
        "commit": f"torch {torch.__version__} (the release's wheel)",
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "lr": LR,
        "cases": {
            case: {
                "peers": N,
                "averager": k,
                "options": {a: str(b) if isinstance(b, dict) else b for a, b in o.items()},
                "warmup": w,
            }
            for case, (k, o, w) in CASES.items()
        },
        "stubbed": __doc__.split("Stubbed: ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
