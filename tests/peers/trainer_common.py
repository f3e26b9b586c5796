"""What the integrations' peer scripts share: the data, the model, the schedule and the library's own loop that
each trainer's run must equal (bf16 autocast, gradient accumulation, clipping, a per-step LR schedule)."""

from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import topologies
from dpsgd.optim import ALGORITHMS

OPTIONS = {"allreduce": {}, "dpsgd": {}, "diloco": {"period": 2}}
EPOCHS, BATCH, ACCUMULATE, CLIP, LR = 2, 8, 2, 0.5, 0.1
SAMPLES = 48 * int(os.environ.get("WORLD_SIZE", 1))  # 48 a peer: 6 batches, 3 steps an epoch


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def model() -> torch.nn.Module:
    torch.manual_seed(1 + int(os.environ["RANK"]))  # peers start apart: the optimizer brings rank 0's model
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def schedule(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def params(module: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in module.parameters()]).tolist()


def library_loop(name: str, comm) -> list[float]:
    """The same training in the library's own loop: DPSGD-style construction, the same sampler and steps."""
    net = model()
    base = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    opt = ALGORITHMS[name](base, topology=topologies.make("ring", comm.size), comm=comm, module=net, **OPTIONS[name])
    sched = schedule(opt)
    data = dataset()
    sampler = DistributedSampler(data, num_replicas=comm.size, rank=comm.rank, shuffle=True, seed=0)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(DataLoader(data, batch_size=BATCH, sampler=sampler)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(net(x), y) / ACCUMULATE
            loss.backward()
            if (i + 1) % ACCUMULATE == 0:
                torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP)
                opt.step()
                opt.zero_grad()
                sched.step()
    return params(net)


def wire_bytes(prof, peers: int) -> tuple[int, list[str]]:
    """The bytes this peer put on the wire by the gloo operations a torch profiler recorded (float32 payloads;
    an all-reduce at the ring cost 2 (n-1)/n, as CommStats counts it), and the collectives among them."""
    wire, collectives = 0, []
    for e in prof.events():
        if not e.name.startswith("gloo:") or not e.input_shapes or not e.input_shapes[0]:
            continue
        numel = sum(torch.Size(s).numel() for s in e.input_shapes if s)
        if numel <= 1:  # control scalars: a logged metric's reduction, not a model's payload
            continue
        if e.name == "gloo:send":
            wire += 4 * numel
        elif e.name != "gloo:recv":
            collectives.append(e.name)
            wire += 4 * numel * 2 * (peers - 1) // peers
    return wire, collectives


def peer_main(run) -> None:
    """A peer module run alone under torchrun (`OUT_DIR [--plant P]`): `run(OUT_DIR, P)`'s result in
    OUT_DIR/rank{r}.json (trainers_peer.py runs the three in one launch, as the tests do)."""
    import argparse
    import json
    from pathlib import Path

    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--plant", default="", help="a bug put in on purpose (see the peer module)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = run(args.out, args.plant)
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()
