"""A researcher's own training loop around each distributed optimizer, as torch users write it: two parameter
groups, an LR scheduler, gradient clipping, optionally bf16 autocast or a GradScaler, and a mid-run restore
through torch.save / torch.load(weights_only=True) into a fresh model, optimizer and scheduler.

Imported by tests/test_optim_contract.py (local backend, in process) and run as a script under mpiexec:
`python tests/peers/user_loop_peer.py mpi OUT_DIR` writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import contextlib
import io
import sys
from pathlib import Path

import torch
from torch.optim import lr_scheduler as sched

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import runs  # noqa: E402

import topologies  # noqa: E402
from dpsgd.optim import ALGORITHMS, build  # noqa: E402

STEPS, RESTORE_AT, INF_AT = 10, 4, 2
TOPOLOGY = {"sgp": "directed_exponential"}  # the rest gossip on a ring
SYNCHRONOUS = [name for name, cls in ALGORITHMS.items() if not cls.asynchronous]


def momentum(name: str) -> float:
    """The momentum of the base optimizer the algorithm's yaml steps (conf/optimizer/)."""
    return float(runs.load("optimizer", runs.optimizer_of(name)).get("momentum", 0.0))


def model_for(seed: int) -> torch.nn.Module:
    """A model drawn from its own generator (local-backend peers are threads sharing torch's global RNG)."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
    return model


def whole_model(seed: int) -> torch.nn.Module:
    """Linear, BatchNorm, a frozen Linear: every kind of state a model holds, drawn from its own generator."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 2))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.rand(t.shape, generator=generator) + 0.5)
            else:
                t.fill_(seed)
    model[2].requires_grad_(False)  # frozen: not in any optimizer
    return model


def module_state(comm) -> dict:
    """Each algorithm built with module= on a whole model seeded by this rank: its state afterwards."""
    out = {}
    for name in ALGORITHMS:
        model = whole_model(comm.rank)
        base = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        options = runs.own_options(name)
        topology = topologies.make(TOPOLOGY.get(name, "ring"), comm.size)
        opt = build(name, base, topology=topology, comm=comm, module=model, **options)
        if opt.asynchronous:
            opt.set_budget(steps=0, samples=0)
            opt.finish()
        out[name] = {k: v.double().reshape(-1).tolist() for k, v in model.state_dict().items()}
    return out


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer `rank`'s batch at `step` (a function of both, so a restored loop draws the same batches)."""
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(16, 6, generator=generator)
    return x, torch.stack([x[:, :3].sum(1), x[:, 3:].sum(1) + rank], 1)


def make(comm, name: str, model: torch.nn.Module, head: bool = True, **keywords):
    """Two parameter groups (the head at half the rate, with weight decay) under algorithm `name`
    (`head=False`: the first group only)."""
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.05, "weight_decay": 1e-3},
    ][: 2 if head else 1]
    base = torch.optim.SGD(groups, lr=0.1, momentum=momentum(name))
    options = runs.own_options(name)
    topology = topologies.make(TOPOLOGY.get(name, "ring"), comm.size)
    return build(name, base, topology=topology, comm=comm, **{**options, **keywords})


SCHEDULERS = {
    "step": lambda opt, name: sched.StepLR(opt, step_size=3, gamma=0.5),
    "multistep": lambda opt, name: sched.MultiStepLR(opt, milestones=[2, 7], gamma=0.3),
    "cosine": lambda opt, name: sched.CosineAnnealingLR(opt, T_max=STEPS),
    "onecycle": lambda opt, name: sched.OneCycleLR(
        opt, max_lr=[0.2, 0.1], total_steps=STEPS, cycle_momentum=momentum(name) > 0
    ),
    "warmup": lambda opt, name: sched.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)),
    "sequential": lambda opt, name: sched.SequentialLR(
        opt,
        [sched.LinearLR(opt, start_factor=0.25, total_iters=3), sched.CosineAnnealingLR(opt, T_max=STEPS - 3)],
        milestones=[3],
    ),
    "plateau": lambda opt, name: sched.ReduceLROnPlateau(opt, factor=0.5, patience=0),
}


def flat(model: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def train(comm, name: str, schedule: str, restore_at: int | None = None, bf16: bool = False) -> dict:
    """STEPS steps of the user's loop; at `restore_at`, everything is saved, then loaded into fresh objects
    (a model seeded otherwise: the restore must bring every value back). Returns the parameters, and the lr
    and momentum each step's stepping optimizer (the base) used, with each step's loss."""
    model = model_for(comm.rank)
    opt = make(comm, name, model)
    scheduler = SCHEDULERS[schedule](opt, name)
    used, losses = [], []
    for t in range(STEPS):
        if t == restore_at:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": scheduler.state_dict()}, buf)
            del model, opt, scheduler
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            model = model_for(100 + comm.rank)
            opt = make(comm, name, model)
            scheduler = SCHEDULERS[schedule](opt, name)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            scheduler.load_state_dict(saved["sched"])
        x, y = batch(comm.rank, t)
        opt.zero_grad()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        used.append([(g["lr"], g.get("momentum", 0.0)) for g in opt.base.param_groups])
        losses.append(loss.item())
        opt.step()
        scheduler.step(loss.item()) if schedule == "plateau" else scheduler.step()
    return {"params": flat(model), "used": used, "losses": losses}


def reference_schedule(name: str, schedule: str, losses: list[float]) -> list:
    """The (lr, momentum) a plain torch.optim.SGD over the same groups gets from the same scheduler."""
    model = model_for(0)
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "lr": 0.05, "weight_decay": 1e-3},
    ]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=momentum(name))
    scheduler = SCHEDULERS[schedule](opt, name)
    used = []
    for t in range(STEPS):
        used.append([(g["lr"], g.get("momentum", 0.0)) for g in opt.param_groups])
        opt.step()
        scheduler.step(losses[t]) if schedule == "plateau" else scheduler.step()
    return used


def scaled(comm, name: str, inf: bool) -> list[float]:
    """STEPS steps under torch.amp.GradScaler; with `inf`, rank 1's gradient holds an inf at step INF_AT (an
    fp16 overflow on one GPU). Without it, every peer leaves step INF_AT out (the skip the peers agree on)."""
    model = model_for(comm.rank)
    opt = make(comm, name, model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    if opt.asynchronous:
        opt.set_budget(steps=STEPS, samples=STEPS * comm.size, samples_per_step=1)
    t = 0
    while (not opt.should_stop()) if opt.asynchronous else t < STEPS:
        x, y = batch(comm.rank, t)
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if t == INF_AT and inf and comm.rank == 1:
            model[0].weight.grad[0, 0] = float("inf")
        if inf or t != INF_AT or opt.asynchronous:
            scaler.step(opt)
            scaler.update()
        t += 1
    if opt.asynchronous:
        opt.finish()
    return flat(model)


def all_trajectories(comm) -> dict:
    """Under mpiexec: the user loop with a warmup-then-cosine schedule, bf16 autocast and a mid-run restore for
    every synchronous algorithm, the GradScaler with an inf on one peer and module= for every algorithm."""
    out: dict = {"restore": {}, "scaler": {}, "module": module_state(comm)}
    for name in SYNCHRONOUS:
        out["restore"][name] = {
            "uninterrupted": train(comm, name, "sequential", bf16=True),
            "restored": train(comm, name, "sequential", restore_at=RESTORE_AT, bf16=True),
        }
    for name in ALGORITHMS:
        out["scaler"][name] = {"inf": scaled(comm, name, inf=True)}
        if not ALGORITHMS[name].asynchronous:
            out["scaler"][name]["skipped"] = scaled(comm, name, inf=False)
    return out


if __name__ == "__main__":
    from runner import main

    main(all_trajectories)
