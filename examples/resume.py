"""Resume from a checkpoint: every peer saves its model, optimizer, scheduler and place in its data share
every few steps (dpsgd.checkpoint: written atomically, marked complete once every peer's file is there); a
restarted run continues from the newest complete step, with the same numbers as a run never stopped.

    mpiexec -n 4 python examples/resume.py --dir ckpt --stop-after 10   # stops after step 10 (a crash)
    mpiexec -n 4 python examples/resume.py --dir ckpt                   # continues from step 10
    python examples/resume.py --backend local --peers 4 --dir ckpt      # the same, as threads of one process
"""

from __future__ import annotations

import argparse
import hashlib
import threading
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import dpsgd.checkpoint
import dpsgd.comm
import topologies
from dpsgd.optim import SGP
from dpsgd.shares import ShareSampler

BATCH = 16
SEEDING = threading.Lock()  # peers of the local backend are threads: one seeds and draws at a time


def train(comm, args) -> str:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 10, generator=g)
    data = TensorDataset(x, x @ torch.randn(10, 1, generator=g))
    sampler = ShareSampler(data, comm, seed=0)
    steps_per_epoch = len(sampler) // BATCH
    with SEEDING:  # the same initial model in every run (and rank 0's on every peer: broadcast_initial)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    topology = topologies.make("one_peer_directed_exponential", comm.size)
    opt = SGP(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), topology=topology, comm=comm)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=steps_per_epoch, gamma=0.5)
    step = 0
    restored = dpsgd.checkpoint.restore(comm, args.dir)  # the newest step every peer completed, or None
    if restored is not None:
        step, state = restored
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        if comm.rank == 0:
            print(f"resumed from step {step}")
    total = args.epochs * steps_per_epoch
    while step < total:
        epoch, done = divmod(step, steps_per_epoch)
        sampler.set_epoch(epoch, start=done * BATCH)  # the rest of this epoch, in the same order
        for xb, yb in DataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(xb), yb).backward()
            opt.step()
            schedule.step()
            step += 1
            if step % args.every == 0:
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "schedule": schedule.state_dict()}
                dpsgd.checkpoint.save(comm, args.dir, step, state)
            if step == args.stop_after:
                if comm.rank == 0:
                    print(f"stopped after step {step}, as a crash would; run again without --stop-after to resume")
                return "stopped"
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    if comm.rank == 0:
        print(f"{step} steps; peer 0's parameters {digest}")
    return digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="mpi", help="mpi (mpiexec, srun), torch (torchrun) or local")
    parser.add_argument("--peers", type=int, default=4, help="peers of the local backend")
    parser.add_argument("--dir", type=Path, required=True, help="the checkpoint folder")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--every", type=int, default=5, help="steps between checkpoints")
    parser.add_argument("--stop-after", type=int, default=-1, help="stop after this step, as a crash would")
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
