"""PyTorch Lightning: `DecentralizedStrategy`, Lightning's DDP strategy without DDP. It starts the process group as
`DDPStrategy` does (torchrun, SLURM, or its own launch of `devices` processes), leaves the model unwrapped, so
no gradient all-reduce runs beside the algorithm's exchanges, and puts the chosen dpsgd optimizer around each
optimizer the LightningModule configures. Lightning's LR schedulers, gradient clipping, precision plugins and
gradient accumulation act on the wrapped optimizer as on any other (its `param_groups` are the base's).

Checkpoints: the peers of a decentralized run hold different parameters and optimizer states, so every rank
writes its own file (rank 0 the path Lightning names, rank r `<path>.peer<r>`) and a resume reads its own.

    trainer = lightning.Trainer(strategy=DecentralizedStrategy("dpsgd", topology="ring"), devices=4, ...)

`DecentralizedMetrics`, a callback, logs the bytes each peer sent and the peers' consensus distance.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy

from dpsgd.comm import Communicator
from dpsgd.optim import DistributedOptimizer

from .wrap import Choice, Options, communicator, resolve


def peer_path(filepath: str | Path, rank: int) -> str:
    """Where rank `rank` keeps its part of the checkpoint `filepath` (rank 0: the file itself)."""
    return str(filepath) if rank == 0 else f"{filepath}.peer{rank}"


class DecentralizedStrategy(DDPStrategy):
    """Lightning's DDP strategy with the dpsgd algorithm `algorithm` in place of DDP's gradient all-reduce.

    `algorithm`: a name of dpsgd.optim.ALGORITHMS (with `topology`, a name of `topologies.make`, and the
    algorithm's own options as keywords in `options`), a `dpsgd.integrations.Algorithm`, or a factory
    `(base, comm) -> DistributedOptimizer`; an optimizer that `configure_optimizers` already returns as a dpsgd
    one is kept as it is. Asynchronous algorithms (adpsgd) are refused: Lightning steps every peer together.
    The Algorithm's `timeout_s` bounds every exchange (and the process group, unless `timeout=` is given); the
    other keywords are `DDPStrategy`'s (except its DDP-only ones: a comm hook or model averaging would average the
    model a second time)."""

    strategy_name = "dpsgd"

    def __init__(self, algorithm: Choice = "dpsgd", *, topology: str = "ring", options: Options = None, **ddp_kwargs):
        ddp_only = sorted(
            k
            for k in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")
            if k in ddp_kwargs
        )
        if ddp_only:
            raise ValueError(
                f"DecentralizedStrategy runs no DDP, so {', '.join(ddp_only)} would have nothing to act on: the "
                "dpsgd algorithm does the averaging (for periodic averaging choose algorithm='local_sgd' or 'diloco')"
            )
        # DDPStrategy hands keywords it does not name to DDP, which is never built here: they would vanish
        named = inspect.signature(DDPStrategy.__init__).parameters
        stray = sorted(k for k in ddp_kwargs if k not in named)
        if stray:
            raise ValueError(
                f"DecentralizedStrategy got {', '.join(stray)}, which only DDP would read, and it builds no DDP; "
                "the exchanges' timeout is Algorithm(name, timeout_s=...), the other keywords are DDPStrategy's"
            )
        self.algorithm = resolve(algorithm, "a Lightning Trainer", topology, options)
        self.comm: Communicator | None = None
        ddp_kwargs.setdefault("timeout", timedelta(seconds=self.algorithm.timeout_s))  # the group's, as the exchanges'
        super().__init__(**ddp_kwargs)

    # --- no DDP: the model stays the LightningModule -------------------------------------------------
    def configure_ddp(self) -> None:
        """Leaves the model unwrapped: the algorithm's optimizer, built from rank 0's model, is the only exchange."""

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """The LightningModule's optimizers, each inside the algorithm (schedulers keep the base's param_groups)."""
        super().setup_optimizers(trainer)
        if self.comm is None:
            self.comm = communicator(self.algorithm.timeout_s)
        module = self.lightning_module
        # a resume has loaded each peer's own weights before this (Lightning restores the model first): rank 0's
        # must not overwrite them
        fresh = trainer.ckpt_path is None
        self.optimizers = [self.algorithm.wrap(opt, self.comm, module, fresh) for opt in self.optimizers]
        scaler = getattr(self.precision_plugin, "scaler", None)
        if isinstance(scaler, torch.amp.GradScaler) and not isinstance(scaler, AgreedGradScaler):
            scaler.__class__ = AgreedGradScaler  # the same scaler (its state kept), lowering its scale on agreed skips
        if scaler is None:
            for opt in self.optimizers:
                # no GradScaler (32, bf16-mixed): Lightning clips as for a plain optimizer; with the class's True
                # its precision plugin refuses gradient clipping, taking the optimizer for a fused one. Under
                # 16-mixed the True stays: the scaler hands step() its found_inf, and every peer skips together
                opt._step_supports_amp_scaling = False  # type: ignore[attr-defined]

    @property
    def distributed_optimizers(self) -> list[DistributedOptimizer]:
        """The optimizers that step (each a dpsgd one); their `comm.stats` counts what they sent."""
        return [opt for opt in self.optimizers if isinstance(opt, DistributedOptimizer)]

    # --- checkpoints: one file per peer --------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Every rank writes its own state (the peers differ): rank 0 to `filepath`, rank r beside it."""
        self.checkpoint_io.save_checkpoint(checkpoint, peer_path(filepath, self.global_rank), storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """This rank's own part of the checkpoint `checkpoint_path`."""
        path = peer_path(checkpoint_path, self.global_rank)
        if not Path(path).exists():
            raise FileNotFoundError(
                f"rank {self.global_rank} has no part of the checkpoint {checkpoint_path} (expected {path}): it was "
                f"saved by a run of another size or without DecentralizedStrategy; resume with the same number of "
                "peers and strategy, or load the weights alone with LightningModule.load_from_checkpoint"
            )
        return self.checkpoint_io.load_checkpoint(path, weights_only=weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoint_io.remove_checkpoint(peer_path(filepath, self.global_rank))


class AgreedGradScaler(torch.amp.GradScaler):
    """Lightning's GradScaler under `16-mixed`, as DecentralizedStrategy leaves it: the optimizer's step skips on
    every peer when any peer's gradients overflowed (its `agree_overflow`), and this scaler then lowers its scale
    on every peer too, as DDP's ranks all do, so the peers keep one scale (torch's lowers it only where it saw the
    inf itself)."""

    def step(self, optimizer, *args: Any, **kwargs: Any):
        before = getattr(optimizer, "step_count", None)
        out = super().step(optimizer, *args, **kwargs)
        if before is not None and optimizer.step_count == before:  # skipped, by this peer's inf or another's
            for found in self._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
                found.fill_(1.0)  # what update() reads to lower the scale
        return out


class DecentralizedMetrics(Callback):
    """Logs, every `every_n_steps` optimizer steps, `dpsgd_bytes_sent` (this peer's, since the strategy started its
    optimizers: their `comm.stats`) and `dpsgd_consensus_distance`, (1/n) sum_i |x_i - x_bar|^2 over the peers'
    parameters: one all-reduce of the model on the trainer's process group, a measurement that `bytes_sent` does
    not count. Needs `DecentralizedStrategy`."""

    def __init__(self, every_n_steps: int = 10) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._logged_step = -1

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # counts optimizer steps: a batch that only accumulated keeps it
        if step == self._logged_step or step % self.every_n_steps:
            return
        strategy = trainer.strategy
        if not isinstance(strategy, DecentralizedStrategy) or strategy.comm is None:
            raise TypeError(
                "DecentralizedMetrics reads the dpsgd optimizers of DecentralizedStrategy; "
                f"this Trainer runs {type(strategy).__name__}"
            )
        self._logged_step = step
        distance = consensus_distance(list(pl_module.parameters()), trainer.world_size)
        sent = float(strategy.comm.stats.bytes_sent)
        pl_module.log_dict({"dpsgd_bytes_sent": sent, "dpsgd_consensus_distance": distance}, on_step=True)


@torch.no_grad()
def consensus_distance(params: list[torch.Tensor], peers: int) -> float:
    """(1/n) sum_i |x_i - x_bar|^2 of the peers' `params` (every peer calls it at the same step), in float64."""
    flat = torch.cat([p.detach().flatten().double() for p in params])
    mean = flat.clone()
    dist.all_reduce(mean)
    squared = (flat - mean / peers).pow(2).sum().reshape(1)
    dist.all_reduce(squared)
    return float(squared) / peers
