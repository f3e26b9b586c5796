"""The Transformers `Trainer`: `DecentralizedTrainer`, a `Trainer` whose Accelerator is a
`DecentralizedAccelerator`, so the model is not wrapped in DDP (no gradient all-reduce) and the optimizer that
steps is the chosen dpsgd algorithm around the Trainer's (its default AdamW, or the one given in `optimizers=`).
The Trainer's schedulers, clipping (`max_grad_norm`), gradient accumulation and mixed precision act on it as on
any optimizer.

    trainer = DecentralizedTrainer(model=model, args=args, train_dataset=data, algorithm="dpsgd", topology="ring")

Each peer's loss is over its own tokens (`average_tokens_across_devices` off: DDP's normalisation gathers the
token counts of every peer each step). Checkpoints: the Trainer writes rank 0's model and optimizer alone, so a
resume of a decentralized run is refused; save with DecentralizedAccelerator's `save_state` or Lightning.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer

from .accelerate import DecentralizedAccelerator
from .wrap import Choice, Options, resolve


class DecentralizedTrainer(Trainer):
    """`Trainer` with the dpsgd algorithm `algorithm` in place of DDP: a name of dpsgd.optim.ALGORITHMS (with
    `topology`, a name of `topologies.make`, and the algorithm's own `algorithm_options`), a
    `dpsgd.integrations.Algorithm`, or a factory `(base, comm) -> DistributedOptimizer`. Asynchronous algorithms
    (adpsgd) are refused. The other arguments are `Trainer`'s."""

    def __init__(
        self, *args, algorithm: Choice = "dpsgd", topology: str = "ring", algorithm_options: Options = None, **kw
    ):
        self.dpsgd_algorithm = resolve(algorithm, "a Transformers Trainer", topology, algorithm_options)
        super().__init__(*args, **kw)
        self.args.average_tokens_across_devices = False  # each peer's own mean (see the module)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        self.accelerator = DecentralizedAccelerator.take_over(self.accelerator, self.dpsgd_algorithm)

    @property
    def distributed_optimizer(self):
        """The dpsgd optimizer that steps (once training has started); its `comm.stats` counts what was sent."""
        return getattr(self.optimizer, "optimizer", None)  # inside Accelerate's AcceleratedOptimizer

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        if resume_from_checkpoint and self.args.world_size > 1:
            raise ValueError(
                "DecentralizedTrainer cannot resume from a Trainer checkpoint: the Trainer saves rank 0's model and "
                "optimizer alone, and the peers of a decentralized run differ; checkpoint with "
                "dpsgd.integrations.accelerate.DecentralizedAccelerator.save_state or the Lightning strategy"
            )
        return super().train(resume_from_checkpoint, *args, **kwargs)
