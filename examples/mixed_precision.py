"""Mixed precision with any algorithm: fp16 autocast with torch.amp.GradScaler, or bf16 autocast (no scaler).
When a peer's scaled gradients overflow, every peer skips that step together (the optimizer agrees on it
with its peers), so no inf reaches a neighbour and no peer waits for one that skipped.

    mpiexec -n 4 python examples/mixed_precision.py --algorithm diloco --precision fp16   # GPUs if present
    python examples/mixed_precision.py --backend local --peers 4 --overflow-at 3          # CPU, in one process

`--overflow-at K` puts an inf in rank 1's gradients at batch K, as an fp16 overflow on one GPU would.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

import dpsgd.comm
import topologies
from dpsgd.optim import ALGORITHMS, build
from dpsgd.shares import ShareSampler


def train(comm, args) -> None:
    device = torch.device(f"cuda:{comm.rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    data = TensorDataset(x, (x[:, :8].sum(1) > 0).long())
    loader = DataLoader(data, batch_size=64, sampler=ShareSampler(data, comm, seed=0), drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Linear(256, 2)).to(device)
    base = torch.optim.AdamW(model.parameters(), lr=3e-3)
    topology = topologies.make("ring", comm.size)
    opt = build(args.algorithm, base, topology=topology, comm=comm, module=model)
    dtype = torch.float16 if args.precision == "fp16" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    batches = 0
    for xb, yb in loader:
        xb, yb = xb.to(device), yb.to(device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
        scaler.scale(loss).backward()
        if batches == args.overflow_at and comm.rank == 1:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.unscale_(opt)  # the true gradients, for clipping
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        scaler.step(opt)  # skipped on every peer if any peer's gradients hold an inf or nan
        scaler.update()
        batches += 1
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    if comm.rank == 0:  # opt.step_count: the steps the peers took together
        print(
            f"{args.algorithm} in {args.precision} on {device.type}: {opt.step_count} steps of {batches} batches "
            f"(the rest skipped by every peer), last loss {loss.item():.3f}, parameters finite: {finite}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mpi", help="mpi (mpiexec, srun), torch (torchrun) or local")
    parser.add_argument("--peers", type=int, default=4, help="peers of the local backend")
    parser.add_argument(
        "--algorithm", default="dpsgd", choices=[n for n, c in ALGORITHMS.items() if not c.asynchronous]
    )
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16"])
    parser.add_argument("--overflow-at", type=int, default=-1, help="a batch where rank 1's gradient overflows")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.backend == "local":
        dpsgd.comm.run_local(args.peers, train, args)
        return
    comm = dpsgd.comm.init(args.backend)
    try:
        train(comm, args)
    finally:
        comm.close()


if __name__ == "__main__":
    main()
