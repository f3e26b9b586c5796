"""Training steps under the emulated network, for the tests of its clock (test_netem, test_netem_hosts,
test_cost_model)."""

from __future__ import annotations

import torch

from dpsgd.comm.netem import NetworkEmulator


def emulated_steps(comm, make, numel: int, network: dict, steps: int, lr: float = 0.1) -> tuple[float, float]:
    """`steps` steps of the optimizer `make(base, comm)` on the quadratic ||w||^2 (`numel` parameters drawn with
    the peer's rank as seed) under `network`: this peer's emulated seconds, and those it waited on the emulated
    network. An optimizer with `overlap` starts its exchange before the computation, as a training loop does."""
    torch.manual_seed(comm.rank)
    net = NetworkEmulator.from_config(network, comm.rank, comm.size)
    comm.attach_network(net)
    w = torch.nn.Parameter(torch.randn(numel))
    opt = make(torch.optim.SGD([w], lr=lr), comm)
    comm.barrier()
    net.clock.reset()
    for _ in range(steps):
        if getattr(opt, "overlap", False):
            opt.start_communication()
        net.start_compute()
        opt.zero_grad()
        w.pow(2).sum().backward()
        net.finish_compute()
        opt.step()
    return net.clock.elapsed(), comm.stats.emulated_wait_s
