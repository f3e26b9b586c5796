"""Your own training loop with a decentralized optimizer: each peer trains on its share of a dataset (iid or
Dirichlet label skew), gossips with its ring neighbours (D-PSGD), and follows a warmup-then-cosine learning
rate with gradient clipping; BatchNorm's running statistics are rank 0's, as under DDP.

    python -m dpsgd.backends -n 4 examples/own_loop.py           # MPI peers, started with the runtime's settings
    mpiexec -n 4 python examples/own_loop.py                     # MPI peers under your mpiexec (or srun on a cluster)
    torchrun --standalone --nproc-per-node 4 examples/own_loop.py --backend torch
    python examples/own_loop.py --backend local --peers 4        # 4 peers as threads of this process
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import dpsgd.comm
import topologies
from dpsgd.optim import DPSGD
from dpsgd.shares import ShareSampler


def dataset(samples: int = 2048, classes: int = 4, features: int = 16) -> TensorDataset:
    """Gaussian blobs, one per class: the same on every peer (one seed)."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(classes, (samples,), generator=g)
    return TensorDataset(centers[y] + torch.randn(samples, features, generator=g), y)


def train(comm, args) -> float:
    torch.manual_seed(comm.rank)  # seeded apart on purpose: the optimizer brings rank 0's whole model
    data = dataset()
    sampler = ShareSampler(data, comm, partition=args.partition, alpha=0.5, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=True)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    )
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = DPSGD(base, topology=topologies.make("ring", comm.size), comm=comm, module=model, buffers="broadcast")
    steps = args.epochs * len(loader)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=max(1, steps // 10))
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps - max(1, steps // 10))
    schedule = torch.optim.lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[max(1, steps // 10)])
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order of this peer's share each epoch
        for x, y in loader:
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            schedule.step()
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if comm.rank == 0:
        print(f"{comm.size} peers, {args.epochs} epochs ({steps} steps): peer 0's accuracy {accuracy:.3f}")
    return accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mpi", help="mpi (mpiexec, srun), torch (torchrun) or local")
    parser.add_argument("--peers", type=int, default=4, help="peers of the local backend")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--partition", default="iid", help="iid or dirichlet (label skew)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.backend == "local":
        dpsgd.comm.run_local(args.peers, train, args)
        return
    comm = dpsgd.comm.init(args.backend)
    try:
        train(comm, args)
        comm.barrier()  # every peer done with its last exchange before the connections are torn down
    finally:
        comm.close()


if __name__ == "__main__":
    main()
