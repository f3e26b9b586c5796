"""One rank of the PowerSGD parity check: the same small MLP, data and seeds trained by torch's DDP with
its PowerSGD hook and by dpsgd's AllReduce(compression=powersgd), on the same gloo world.

`python tests/peers/powersgd_peer.py torch OUT_DIR` writes OUT_DIR/rank{r}.json: for each case (rank,
start_iter), both final parameter lists, the exact all-reduce's, our bytes sent and the order of the
parameters in DDP's bucket."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import dpsgd.comm
from dpsgd.comm import codecs
from dpsgd.optim import AllReduce

CASES = [(1, 2), (4, 3)]  # (rank, start_iter): rank 1 orthogonalizes by Gram-Schmidt, rank 4 by QR
STEPS = 8


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # every rank and both runs start from the same weights
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(16, 32, generator=gen), torch.randn(16, 10, generator=gen)


def train(net, opt, rank: int) -> list[list[float]]:
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach().reshape(-1).tolist() for p in net.parameters()]


def main() -> None:
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[2])
    comm = dpsgd.comm.init("torch", timeout_s=60, dist_backend="gloo")
    results = []
    for rank, start_iter in CASES:
        net = model()
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter)
        order: list[int] = []
        index = {id(p): i for i, p in enumerate(net.parameters())}

        def hook(state, bucket, order=order, index=index):
            order[:] = [index[id(p)] for p in bucket.parameters()]
            return psgd.powerSGD_hook(state, bucket)

        ddp.register_comm_hook(state, hook)
        torch_params = train(ddp, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), comm.rank)
        net = model()
        spec = {"name": "powersgd", "rank": rank, "start_iter": start_iter}
        opt = AllReduce(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), comm=codecs.wrap(comm, spec))
        sent_before = comm.stats.bytes_sent
        ours = train(net, opt, comm.rank)
        sent = comm.stats.bytes_sent - sent_before
        net = model()
        exact = train(net, AllReduce(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), comm=comm), comm.rank)
        results.append({"torch": torch_params, "ours": ours, "exact": exact, "bucket_order": order, "bytes": sent})
    (out_dir / f"rank{comm.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    comm.close()


if __name__ == "__main__":
    main()
