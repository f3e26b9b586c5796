"""PyTorch Lightning with a decentralized optimizer: `DecentralizedStrategy` starts the peers' process group as
Lightning's DDP strategy does, keeps the model out of DDP and puts the chosen dpsgd algorithm around the optimizer
`configure_optimizers` returns; the LR schedule, bf16 autocast, gradient clipping and accumulation stay Lightning's,
and ModelCheckpoint keeps every peer's own state.

    torchrun --standalone --nproc-per-node 4 examples/lightning_blobs.py --algorithm dpsgd
    torchrun --standalone --nproc-per-node 4 examples/lightning_blobs.py --algorithm diloco --topology ring
    python examples/lightning_blobs.py --devices 4                # Lightning starts the 4 processes itself

With `--check-against-library-loop` every peer also replays the batches it trained on through the library's own
loop (examples/library_loop.py: the same seed, optimizer, accumulation, clipping, bf16 and schedule) and prints
the largest difference of the parameters, which is below 1e-6.
"""

from __future__ import annotations

import argparse
import os

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd.integrations.lightning import DecentralizedStrategy

PERIOD_OF = {"diloco": {"period": 4}, "local_sgd": {"period": 4}}  # a short round for a short run


def blobs(samples: int = 2048, classes: int = 4, features: int = 16) -> TensorDataset:
    """Gaussian blobs, one per class: the same on every peer (one seed); Lightning gives each peer its share."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(classes, (samples,), generator=g)
    return TensorDataset(centers[y] + torch.randn(samples, features, generator=g), y)


class Classifier(pl.LightningModule):
    def __init__(self, lr: float = 0.1, recorder=None) -> None:
        super().__init__()
        self.lr = lr
        self.recorder = recorder  # for --check-against-library-loop: keeps each batch
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        if self.recorder is not None:
            self.recorder.record(batch)
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # the mean over the peers
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self):
        return DataLoader(blobs(), batch_size=32, shuffle=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="dpsgd", help="a dpsgd algorithm: dpsgd, allreduce, diloco, sgp, ...")
    parser.add_argument("--topology", default="ring", help="of topologies.make (sgp: directed_exponential)")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("WORLD_SIZE", 1)), help="peers")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--check-against-library-loop", action="store_true", help="see the module's doc")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    strategy = DecentralizedStrategy(args.algorithm, topology=args.topology, options=PERIOD_OF.get(args.algorithm))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.epochs,
        precision="bf16-mixed",
        gradient_clip_val=1.0,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    recorder = None
    if args.check_against_library_loop:
        from library_loop import Recorder

        recorder = Recorder()
    model = Classifier(recorder=recorder)
    trainer.fit(model)
    x, y = blobs().tensors
    with torch.no_grad():
        accuracy = (model.net(x).argmax(1) == y).float().mean().item()
    sent = sum(opt.comm.stats.bytes_sent for opt in strategy.distributed_optimizers)
    if trainer.is_global_zero:
        print(
            f"{args.algorithm} in Lightning on {trainer.world_size} peers, {trainer.global_step} steps: "
            f"peer 0's accuracy {accuracy:.3f}, {sent / 1e6:.2f} MB sent"
        )
    if recorder is not None:
        check(model, recorder, args, strategy.distributed_optimizers[0].comm, steps=trainer.global_step)


def check(model: Classifier, recorder, args, comm, steps: int) -> None:
    """The library loop on the batches `model` trained on, from the same seed: the same training by hand."""
    from library_loop import Reference
    from library_loop import check as compare

    reference = Reference(
        build=Classifier,
        base=lambda net: torch.optim.SGD(net.parameters(), lr=net.lr, momentum=0.9),
        loss=lambda net, batch: torch.nn.functional.cross_entropy(net.net(batch[0]), batch[1]),
        schedule=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps),
        accumulate=2,
        clip=1.0,
        bf16=True,
    )
    compare(model, reference, recorder, args.algorithm, args.topology, PERIOD_OF.get(args.algorithm), comm)


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:  # a refused algorithm, topology or option: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
