"""The training steps the benchmarks time: their synthetic classification task (an MLP, seeded batches), one
step (`train_step`), the median time of one on this core (`step_time`), and a run of steps of a distributed
optimizer, under the network emulator or not (`timed_steps`)."""

from __future__ import annotations

import time
from types import SimpleNamespace

CLASSES = 10


def mlp(inputs: int, hidden: list[int], seed: int = 0, dtype=None):
    """dpsgd's MLP from `inputs` features through `hidden` widths to CLASSES classes, seeded."""
    from dpsgd import models

    model = models.build("mlp", (inputs,), CLASSES, seed, hidden=hidden)
    return model if dtype is None else model.to(dtype)


def batches(rank: int, size: int, inputs: int, seed: int = 0, count: int = 1, dtype=None) -> list:
    """`count` (inputs, labels) batches of `size` samples of peer `rank`; any peer can make any peer's batches."""
    import torch

    g = torch.Generator().manual_seed(1_000_003 * seed + rank)
    return [
        (torch.randn(size, inputs, generator=g, dtype=dtype), torch.randint(0, CLASSES, (size,), generator=g))
        for _ in range(count)
    ]


def flat_params(module):
    """Every parameter of `module`, flattened into one vector."""
    import torch

    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def train_step(module, opt, x, y) -> float:
    """One step: gradients zeroed, forward, cross-entropy, backward, `opt.step()`; returns the seconds spent in
    `opt.step()` (for AllReduce the wait for the gradients' all-reduce and the update; for DDP, whose all-reduce ends
    inside backward, the update alone)."""
    import torch.nn.functional as F

    opt.zero_grad(set_to_none=True)
    F.cross_entropy(module(x), y).backward()
    t0 = time.perf_counter()
    opt.step()
    return time.perf_counter() - t0


def step_time(model, x, y, repeats: int = 5, update: bool = True) -> float:
    """Median seconds of one step of `model` on (x, y) on this core after one untimed: forward, backward and a plain
    SGD update (`update=False`: forward and backward alone)."""
    import torch

    opt = (
        torch.optim.SGD(model.parameters(), lr=0.01)
        if update
        else SimpleNamespace(zero_grad=model.zero_grad, step=lambda: None)
    )
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        train_step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
    later = sorted(times[1:])
    return later[len(later) // 2]


def timed_steps(opt, model, x, y, steps: int, overlap: bool = False, net=None) -> tuple[float, float, float | None]:
    """`steps` training steps of a distributed optimizer on one batch, its peers starting together (a barrier; with
    `net`, an emulator, its clock starts there too): (wall seconds until the last step returned, seconds of forward
    and backward in them, the emulated clock then or None). An asynchronous optimizer runs within a budget of
    `steps` and finishes after the last (its closing handshake counted in none of the three)."""
    import torch

    asynchronous = opt.asynchronous  # no global step: its own pace within a budget
    if asynchronous:
        opt.set_budget(steps=steps)
    opt.comm.barrier()
    if net is not None:
        net.clock.reset()
    computing = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        if overlap:
            opt.start_communication()  # x^k travels while the gradient is computed
        if net is not None:
            net.start_compute()
        c0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        computing += time.perf_counter() - c0
        if net is not None:
            net.finish_compute()
        opt.step()
    wall = time.perf_counter() - t0
    emulated = net.clock.elapsed() if net is not None else None
    if asynchronous:
        opt.finish()
    return wall, computing, emulated
