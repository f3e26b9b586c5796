"""One training step, whole, in one place: the step's report to the driver and its fault hook, the rate the
`schedule` gives it (dpsgd.schedule), the minibatch's forward and backward in the run's `precision` (fp32, or bf16 /
fp16 autocast; fp16 with a gradient scaler) over `accumulate` micro-batches (their gradients summed), the emulated
compute around them, then `clip_grad_norm` (each peer's own gradient clipped to that norm) and the algorithm's
step. Real peers and the fleet both step through `TrainStep`, so the options mean the same on every backend.

fp16 skips a step whose scaled gradients overflowed, as torch.amp.GradScaler does, but on every peer
together: the peers first agree whether any of them overflowed (the optimizer's `agree_overflow`: one one-number
all-reduce a step, not counted as the algorithm's traffic, which its own check under `GradScaler.step` reuses),
and a peer that did not is made to skip too, its scaler backing off as the others'. No peer waits in an exchange
that another skipped, and no inf reaches a neighbour. On the fleet the one scaler sees every peer's gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dpsgd.schedule import Schedule

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepOptions:
    """The step options of a run (its top-level `precision`, `clip_grad_norm`, `accumulate`)."""

    precision: str = "fp32"
    clip_grad_norm: float | None = None
    accumulate: int = 1

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"unknown precision {self.precision!r}; valid precisions: {', '.join(PRECISIONS)}")
        clip, k = self.clip_grad_norm, self.accumulate
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float) or clip <= 0):
            raise ValueError(f"clip_grad_norm must be a number > 0, or null for no clipping, got {clip!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"accumulate must be a whole number >= 1 (micro-batches per step), got {k!r}")

    def check_batch(self, batch_size: int) -> None:
        """Each step's `batch_size` samples split into `accumulate` equal micro-batches, or a one-line error."""
        if batch_size % self.accumulate:
            raise ValueError(
                f"accumulate={self.accumulate} splits each step's batch_size={batch_size} samples into "
                f"{self.accumulate} equal micro-batches: choose a batch_size divisible by {self.accumulate}"
            )

    def autocast(self, device: torch.device | str):
        """The forward pass's autocast context (none for fp32)."""
        dtype = PRECISIONS[self.precision]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(torch.device(device).type, dtype=dtype)

    def scaler(self, device: torch.device | str) -> torch.amp.GradScaler | None:
        """fp16's gradient scaler (None for fp32 and bf16, whose range needs none)."""
        return torch.amp.GradScaler(torch.device(device).type) if self.precision == "fp16" else None

    def split(self, x: torch.Tensor, y: torch.Tensor, dim: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The minibatch (x, y) as `accumulate` micro-batches along `dim` (the sample axis)."""
        if self.accumulate == 1:
            return [(x, y)]
        return list(zip(x.chunk(self.accumulate, dim), y.chunk(self.accumulate, dim)))


class Stepper:
    """One peer's (or the fleet's) step under StepOptions: `backward(loss)` per micro-batch, then `step()`.
    `peer_axis`: the gradients carry a leading peer axis (the fleet)."""

    def __init__(self, options: StepOptions, optimizer, schedule: Schedule, device, peer_axis=False):
        self.options, self.optimizer, self.schedule = options, optimizer, schedule
        self.peer_axis = peer_axis
        self.scaler = options.scaler(device)
        self.base_lrs = [float(g["lr"]) for g in self.groups]  # the config's rates: the schedule scales these
        self.skipped = 0  # fp16 steps skipped by every peer (an overflow on one of them)

    @property
    def groups(self) -> list[dict]:
        """The parameter groups of the optimizer that steps (looked up each time: load_state_dict replaces them)."""
        return getattr(self.optimizer, "base", self.optimizer).param_groups

    @property
    def lr(self) -> float:
        """The learning rate of the first parameter group now."""
        return float(self.groups[0]["lr"])

    def begin(self, step: int) -> None:
        """Step `step` (1-based) is about to be taken: its rate from the schedule."""
        factor = self.schedule.factor(step)
        for group, lr in zip(self.groups, self.base_lrs):
            group["lr"] = lr * factor

    def backward(self, loss: torch.Tensor) -> None:
        """Gradients of one micro-batch's loss (a mean over its samples), added to those of the others."""
        if self.options.accumulate > 1:
            loss = loss / self.options.accumulate
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for g in self.groups for p in g["params"] if p.grad is not None]

    def step(self) -> None:
        """The algorithm's step on the accumulated gradients: unscaled, clipped, skipped on every peer if any
        peer's overflowed (fp16)."""
        opt = self.optimizer
        if self.scaler is not None:
            grads = self.grads()
            overflow = not all_finite(grads)
            agree = getattr(opt, "agree_overflow", None)  # a plain torch optimizer has no peers to agree with
            if (agree(overflow) if agree is not None else overflow) and not overflow and grads:
                grads[0].view(-1)[0] = float("inf")  # another peer overflowed: the scaler skips here too
            self.scaler.unscale_(opt)
        if self.options.clip_grad_norm is not None:
            clip = clip_stacked if self.peer_axis else torch.nn.utils.clip_grad_norm_
            clip(self.grads_params(), self.options.clip_grad_norm)
        if self.scaler is None:
            opt.step()
            return
        scale = self.scaler.get_scale()
        self.scaler.step(opt)
        self.scaler.update()
        self.skipped += self.scaler.get_scale() < scale

    def grads_params(self) -> list[torch.Tensor]:
        return [p for g in self.groups for p in g["params"] if p.grad is not None]

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.skipped = int(state.get("skipped", 0))


@torch.no_grad()
def all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every entry of `tensors` is finite: one fused pass per device and dtype, read back once (the kernel
    GradScaler.unscale_ checks with, at a scale of 1: a check per tensor cost 5 ms of a CPU MLP step, this 0.2)."""
    found: dict[torch.device, torch.Tensor] = {}
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, _), group in groups.items():
        flag = found.setdefault(device, torch.zeros(1, device=device))
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, torch.ones(1, device=device))
    return not any(bool(flag) for flag in found.values())


@torch.no_grad()
def clip_stacked(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for every peer at once: the gradients carry a leading peer axis and each
    peer's is clipped to `max_norm` by its own norm (the same formula: the norm of the per-tensor norms).
    Returns the (n,) norms before clipping."""
    grads = [p.grad for p in params if p.grad is not None]
    n = grads[0].shape[0]
    norms = torch.linalg.vector_norm(
        torch.stack([torch.linalg.vector_norm(g.reshape(n, -1), dim=1) for g in grads], 1), dim=1
    )
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.reshape(n, *([1] * (g.dim() - 1))).to(g.dtype))
    return norms


class TrainStep:
    """The whole of one step (see the module): `step(k)` takes step k (1, 2, ...; `step()`: the one after the last
    taken) and returns the minibatch loss (a peer's, or the fleet's (n,) losses). `losses(x, y)`: the loss of a
    micro-batch (the fleet: every peer's); `split_dim`: the sample axis of a batch (1 on the fleet, whose batches
    lead with the peer axis); `before`: called with the step first (the driver's report, the fault hook);
    `compute`: the network emulator whose compute clock runs around the forward and backward passes (None: nothing
    emulated)."""

    def __init__(
        self,
        stepper: Stepper,
        batches,
        losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device | str,
        *,
        split_dim: int = 0,
        before: Sequence[Callable[[int], None]] = (),
        compute=None,
    ):
        self.stepper, self.batches, self.losses, self.device = stepper, batches, losses, device
        self.split_dim, self.before, self.compute = split_dim, tuple(before), compute
        self.taken = 0  # the last step taken

    def __call__(self, step: int | None = None) -> torch.Tensor:
        step = self.taken + 1 if step is None else step
        self.taken = step
        for hook in self.before:
            hook(step)
        stepper = self.stepper
        stepper.begin(step)
        x, y = self.batches.next()
        optimizer = stepper.optimizer
        if optimizer.overlap:
            optimizer.start_communication()  # x^k travels while the gradient is computed
        if self.compute is not None:
            self.compute.start_compute()
        optimizer.zero_grad()
        options, total = stepper.options, None
        for xm, ym in options.split(x, y, dim=self.split_dim):
            with options.autocast(self.device):
                losses = self.losses(xm, ym)
            # on the fleet peer i's loss depends on its own weights only: the gradient of the sum is each peer's own
            stepper.backward(losses.sum())
            total = losses.detach() if total is None else total + losses.detach()
        if self.compute is not None:
            self.compute.finish_compute()
        stepper.step()
        assert total is not None  # accumulate >= 1: one micro-batch at least
        return total / options.accumulate if options.accumulate > 1 else total
