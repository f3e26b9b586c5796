"""Hugging Face Accelerate: `DecentralizedAccelerator`, an `Accelerator` whose `prepare` leaves the model out of DDP
(so no gradient all-reduce runs beside the algorithm's exchanges) and puts the chosen dpsgd optimizer around each
optimizer it prepares. Accelerate's mixed precision (its autocast, and fp16's GradScaler, whose skip every peer
agrees on), `accumulate()`, `clip_grad_norm_` and schedulers work as with `Accelerator`; `save_state` /
`load_state` also keep each peer's own model and optimizer (the peers differ; Accelerate writes rank 0's alone).

    accelerator = DecentralizedAccelerator("dpsgd", topology="ring", mixed_precision="bf16")
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from dpsgd.comm import Communicator
from dpsgd.optim import DistributedOptimizer

from .wrap import Algorithm, Choice, Options, communicator, resolve

PEER_FILE = "dpsgd_peer{rank}.pt"  # each peer's own model and optimizer states, beside Accelerate's files


class DecentralizedAccelerator(Accelerator):
    """`Accelerator` with the dpsgd algorithm `algorithm` in place of DDP: a name of dpsgd.optim.ALGORITHMS (with
    `topology`, a name of `topologies.make`, and the algorithm's own `options`), a `dpsgd.integrations.Algorithm`,
    or a factory `(base, comm) -> DistributedOptimizer`. Asynchronous algorithms (adpsgd) are refused. The other
    keywords are `Accelerator`'s. Prepare the model before its optimizer (`prepare(model, optimizer, ...)`): the
    optimizer then brings rank 0's whole model state to every peer, buffers included, as DDP does."""

    def __init__(self, algorithm: Choice = "dpsgd", *, topology: str = "ring", options: Options = None, **kwargs: Any):
        self.algorithm = resolve(algorithm, "an Accelerate training loop", topology, options)
        self._dpsgd_comm: Communicator | None = None
        super().__init__(**kwargs)

    @classmethod
    def take_over(cls, accelerator: Accelerator, algorithm: Algorithm) -> DecentralizedAccelerator:
        """`accelerator`, made by someone else before it prepared anything, turned into this class in place: the
        Transformers Trainer builds its own `Accelerator` from many settings inside one method, and this keeps them
        all (the class adds methods and three attributes, nothing that `Accelerator.__init__` sets up)."""
        if accelerator._models or accelerator._optimizers:
            raise RuntimeError("take_over needs an Accelerator that has prepared no model or optimizer yet")
        accelerator.__class__ = cls
        taken: DecentralizedAccelerator = accelerator
        taken.algorithm, taken._dpsgd_comm = algorithm, None
        return taken

    @property
    def comm(self) -> Communicator:
        """This process's communicator over Accelerate's process group (its `stats` count what was sent)."""
        if self._dpsgd_comm is None:
            self._dpsgd_comm = communicator(self.algorithm.timeout_s)
        return self._dpsgd_comm

    def prepare_model(
        self, model: torch.nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        """Mixed precision and device placement as Accelerate's, without the DDP wrapper (its `evaluation_mode`)."""
        model = super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        model.train(model.training)  # evaluation_mode changes no mode; said here, as the name reads otherwise
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        """The optimizer inside the algorithm, then Accelerate's wrapper (accumulation, GradScaler) around it."""
        module = self._models[-1] if len(self._models) == 1 else None  # whose buffers follow rank 0's
        wrapped = self.algorithm.wrap(optimizer, self.comm, module)
        return super().prepare_optimizer(wrapped, device_placement=device_placement)

    @property
    def distributed_optimizers(self) -> list[DistributedOptimizer]:
        return [opt.optimizer for opt in self._optimizers if isinstance(opt.optimizer, DistributedOptimizer)]

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> str:
        """Accelerate's `save_state`, and each peer's own model and optimizer states in `dpsgd_peer<rank>.pt`."""
        location = super().save_state(output_dir, safe_serialization=safe_serialization, **kwargs)
        os.makedirs(location, exist_ok=True)
        own = {
            "models": [self.unwrap_model(m).state_dict() for m in self._models],
            "optimizers": [opt.optimizer.state_dict() for opt in self._optimizers],
        }
        torch.save(own, Path(location) / PEER_FILE.format(rank=self.process_index))
        self.wait_for_everyone()  # the checkpoint is whole once every peer's file is there
        return location

    def load_state(self, input_dir: str | None = None, **kwargs: Any) -> None:
        """Accelerate's `load_state` (schedulers, scaler, RNG, data position), then this peer's own states."""
        super().load_state(input_dir, **kwargs)
        folder = Path(input_dir) if input_dir is not None else None
        if folder is None:  # Accelerate's automatic naming: the newest checkpoint folder, as its load_state took
            base = Path(self.project_dir) / "checkpoints"
            folder = max(base.iterdir(), key=lambda p: int(p.name.rsplit("_", 1)[-1]))
        path = folder / PEER_FILE.format(rank=self.process_index)
        if not path.exists():
            raise FileNotFoundError(
                f"peer {self.process_index} has no state in {folder} (expected {path.name}): it was saved by a run "
                "of another size or by a plain Accelerator; resume with the same number of peers and "
                "DecentralizedAccelerator"
            )
        own = torch.load(path, map_location="cpu", weights_only=True)  # load_state_dict copies to each tensor's device
        for model, state in zip(self._models, own["models"]):
            self.unwrap_model(model).load_state_dict(state)
        for opt, state in zip(self._optimizers, own["optimizers"]):
            opt.optimizer.load_state_dict(state)
