"""The check behind the trainers' examples' `--check-against-library-loop`: the batches a trainer computed a loss
on are recorded (with the RNG state at each, for dropout), then replayed from the same seeded start through the
library's own loop (a hand-written torch loop: the same base optimizer in the same dpsgd algorithm, the same
accumulation, clipping, autocast and LR schedule), and each peer prints the largest difference between the
trainer's final parameters and the loop's. The examples import this module only when asked for the check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import topologies
from dpsgd.optim import ALGORITHMS


@dataclass
class Recorder:
    """Each batch a trainer computes a loss on, with the CPU RNG state just before it (`record` in the step)."""

    batches: list = field(default_factory=list)

    def record(self, batch) -> None:
        clone = {k: v.clone() for k, v in batch.items()} if isinstance(batch, dict) else [v.clone() for v in batch]
        self.batches.append((clone, torch.get_rng_state()))


@dataclass
class Reference:
    """How the trainer trained, for the library loop to train so: `build` the model (seeded here as the
    example seeds it), `base` its optimizer, `loss(model, batch)` of one batch; accumulate `accumulate`
    batches a step (the loss divided by it), clip to `clip`, autocast to bf16 if `bf16`, and step the
    schedule `schedule(base)` `schedule_steps` times after each step."""

    build: Callable[[], torch.nn.Module]
    base: Callable[[torch.nn.Module], torch.optim.Optimizer]
    loss: Callable[[torch.nn.Module, object], torch.Tensor]
    schedule: Callable[[torch.optim.Optimizer], object]
    accumulate: int = 1
    clip: float = 0.0
    bf16: bool = False
    schedule_steps: int = 1
    seed: int = 0


def params(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().float() for p in module.parameters()])


def library_loop(ref: Reference, batches: list, algorithm: str, topology: str, options: dict | None, comm):
    """The model `ref` builds, trained on `batches` (a Recorder's) by ALGORITHMS[algorithm] in a plain loop."""
    torch.manual_seed(ref.seed)
    net = ref.build()
    base = ref.base(net)
    opt = ALGORITHMS[algorithm](
        base, topology=topologies.make(topology, comm.size), comm=comm, module=net, **(options or {})
    )
    schedule = ref.schedule(base)
    saved = torch.get_rng_state()
    for i, (batch, rng) in enumerate(batches):
        torch.set_rng_state(rng)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if ref.bf16 else contextlib.nullcontext()
        with autocast:
            loss = ref.loss(net, batch)
        (loss.float() / ref.accumulate).backward()
        if (i + 1) % ref.accumulate == 0 or i + 1 == len(batches):
            if ref.clip:
                torch.nn.utils.clip_grad_norm_(net.parameters(), ref.clip)
            opt.step()
            opt.zero_grad()
            for _ in range(ref.schedule_steps):
                schedule.step()
    torch.set_rng_state(saved)
    return net


def check(trained: torch.nn.Module, ref: Reference, recorder: Recorder, algorithm, topology, options, comm) -> float:
    """Print (every peer) and return the largest difference of `trained` from the library loop's parameters."""
    net = library_loop(ref, recorder.batches, algorithm, topology, options, comm)
    difference = (params(trained) - params(net)).abs().max().item()
    line = f"peer {comm.rank}: largest difference from the library loop {difference:.3g}"
    print(f"{line} ({len(recorder.batches)} batches replayed)\n", end="", flush=True)  # one write: peers' don't mix
    return difference
