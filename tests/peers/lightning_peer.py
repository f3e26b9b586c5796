"""One rank of tests/test_integrations.py under `torchrun --nproc-per-node 2`: for allreduce, dpsgd and diloco,
a Lightning fit with DecentralizedStrategy (bf16-mixed, gradient accumulation, clipping, a per-step LR
schedule, a checkpoint every epoch) and the library's own loop with the same seeds and data order; the bytes
the profiler saw gloo carry during the dpsgd fit; a fit stopped after its first epoch's checkpoint and resumed.

    torchrun --standalone --nproc-per-node 2 tests/peers/lightning_peer.py OUT_DIR [--plant ddp|no-peer-files]

writes OUT_DIR/rank{r}.json. `--plant` puts a bug in on purpose, to see the tests catch it.
"""

from __future__ import annotations

import os
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader
from trainer_common import (
    ACCUMULATE,
    BATCH,
    CLIP,
    EPOCHS,
    LR,
    OPTIONS,
    dataset,
    library_loop,
    model,
    params,
    peer_main,
    schedule,
    wire_bytes,
)

import dpsgd.comm
from dpsgd.integrations import Algorithm
from dpsgd.integrations.lightning import DecentralizedMetrics, DecentralizedStrategy


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, sync_dist=True)  # a logged metric reduced across peers
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule(opt), "interval": "step"}}

    def train_dataloader(self):  # Lightning puts its DistributedSampler (seed 0) in
        return DataLoader(dataset(), batch_size=BATCH, shuffle=True)


class Overflow(Net):
    """Net whose loss on rank 1 at step 1 is inf: a GradScaler skip on one peer."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("inf") if self.global_step == 1 and self.global_rank == 1 else loss


def fp16_fit(folder: Path) -> dict:
    """16-mixed with its GradScaler (Lightning gives CPU runs bf16 unless the plugin is named) and one overflow."""
    fit = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=DecentralizedStrategy(Algorithm("dpsgd", timeout_s=60)),
        plugins=[pl.plugins.precision.MixedPrecision("16-mixed", "cpu")],
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )
    model = Overflow()
    fit.fit(model)
    return {
        "global_step": fit.global_step,
        "step_count": fit.strategy.distributed_optimizers[0].step_count,
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
        "scale": float(fit.precision_plugin.scaler.get_scale()),
    }


class Traffic(Callback):
    """The bytes gloo carried during training, as the profiler saw its operations, and the optimizer's count."""

    def on_train_start(self, trainer, pl_module):
        self.sent_before = trainer.strategy.distributed_optimizers[0].comm.stats.bytes_sent
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.prof.__enter__()

    def on_train_end(self, trainer, pl_module):
        self.prof.__exit__(None, None, None)
        wire, collectives = wire_bytes(self.prof, trainer.world_size)
        self.result = {
            "steps": trainer.global_step,
            "profiled_bytes": wire,
            "profiled_collectives": collectives,
            "counted_bytes": trainer.strategy.distributed_optimizers[0].comm.stats.bytes_sent - self.sent_before,
        }


class Logged(Callback):
    """What DecentralizedMetrics logged after each optimizer step (it runs before this callback)."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args):
        metrics = trainer.callback_metrics
        if "dpsgd_consensus_distance" in metrics and len(self.rows) < trainer.global_step:
            self.rows.append([float(metrics["dpsgd_consensus_distance"]), float(metrics["dpsgd_bytes_sent"])])


def trainer(name: str, folder: Path, callbacks=(), epochs: int = EPOCHS) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=DecentralizedStrategy(Algorithm(name, options=OPTIONS.get(name) or {}, timeout_s=60)),
        max_epochs=epochs,
        precision="bf16-mixed",
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP,
        callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=-1, every_n_epochs=1), *callbacks],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=folder,
    )


def run(out: Path, plant: str = "") -> dict:
    """Every fit and loop of this rank (see the module), with the bug `plant` put in first, if any."""
    if plant == "ddp":
        DecentralizedStrategy.configure_ddp = DDPStrategy.configure_ddp  # type: ignore[method-assign]
    if plant == "no-peer-files":
        for hook in ("save_checkpoint", "load_checkpoint", "remove_checkpoint"):
            setattr(DecentralizedStrategy, hook, getattr(DDPStrategy, hook))
    work = out / "work"
    result: dict = {}
    for name in OPTIONS:
        # dpsgd: the traffic the profiler sees; diloco: the logged metrics (their own all-reduce, kept off dpsgd's)
        callbacks = {"dpsgd": [Traffic()], "diloco": [DecentralizedMetrics(every_n_steps=1), Logged()]}.get(name, [])
        fit = trainer(name, work / name, callbacks)
        fit.fit(Net())
        result[name] = {"lightning": params(fit.lightning_module), "steps": fit.global_step}
        if name == "dpsgd":
            result[name]["traffic"] = callbacks[0].result
        if name == "diloco":
            result[name]["logged"] = callbacks[1].rows
            result[name]["sent"] = fit.strategy.comm.stats.bytes_sent
        comm = dpsgd.comm.init("torch")  # the group Lightning started
        result[name]["library"] = library_loop(name, comm)
    # stopped after epoch 0's checkpoint, resumed by a fresh trainer: diloco (outer state, a period across it)
    first = sorted((work / "diloco").glob("epoch=0*.ckpt"))[0]
    fit = trainer("diloco", work / "resumed")
    fit.fit(Net(), ckpt_path=first)
    result["resumed"] = {"lightning": params(fit.lightning_module), "from": first.name}
    result["fp16"] = fp16_fit(work / "fp16")
    try:
        trainer("adpsgd", work / "adpsgd")
    except ValueError as exc:
        result["adpsgd_refusal"] = str(exc)
    return result


if __name__ == "__main__":
    peer_main(run)
