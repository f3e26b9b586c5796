"""gpu-check's tiny trainer runs: D-PSGD inside Lightning, Accelerate and the Transformers Trainer
(dpsgd.integrations) on one device, each in bf16 with gradient clipping, 2 micro-batches a step and a per-step LR
schedule, 4 steps on a world of one peer (one GPU holds one peer of a trainer's process group).

    python -m experiments.bench.gpu_trainers lightning|accelerate|transformers --device cuda

prints one JSON line: the trainer, the steps taken, the last loss, the device of the model's parameters and the
optimizer that stepped. Each trainer is an optional extra (pip install -e '.[lightning]', ...).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

import torch

STEPS, ACCUMULATE, BATCH, CLIP, LR = 4, 2, 8, 1.0, 0.05


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * ACCUMULATE * BATCH, 16, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))


def outcome(trainer: str, steps: int, loss: float, model: torch.nn.Module, optimizer) -> dict:
    device = next(model.parameters()).device.type
    return {"trainer": trainer, "steps": steps, "loss": loss, "device": device, "optimizer": type(optimizer).__name__}


def lightning(device: str) -> dict:
    import lightning.pytorch as pl

    from dpsgd.integrations.lightning import DecentralizedStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.loss = net(), float("nan")

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            self.loss = float(loss.detach())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    module = Module()
    trainer = pl.Trainer(
        accelerator="cuda" if device == "cuda" else "cpu",
        devices=1,
        strategy=DecentralizedStrategy("dpsgd", topology="ring"),
        precision="bf16-mixed",
        gradient_clip_val=CLIP,
        accumulate_grad_batches=ACCUMULATE,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=BATCH))
    return outcome("lightning", trainer.global_step, module.loss, module.net, trainer.optimizers[0])


def accelerate(device: str) -> dict:
    from dpsgd.integrations.accelerate import DecentralizedAccelerator

    accelerator = DecentralizedAccelerator(
        "dpsgd", cpu=device == "cpu", mixed_precision="bf16", gradient_accumulation_steps=ACCUMULATE
    )
    model = net()
    base = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(base, T_max=STEPS)
    loader = torch.utils.data.DataLoader(data(), batch_size=BATCH)
    model, opt, loader, schedule = accelerator.prepare(model, base, loader, schedule)
    steps, loss = 0, float("nan")
    for x, y in loader:
        with accelerator.accumulate(model):
            batch_loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(batch_loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            schedule.step()
            opt.zero_grad()
            steps += accelerator.sync_gradients
            loss = float(batch_loss.detach())
    stepped = accelerator.distributed_optimizers[0]
    accelerator.end_training()
    return outcome("accelerate", steps, loss, model, stepped)


def transformers(device: str) -> dict:
    import transformers as hf

    from dpsgd.integrations.transformers import DecentralizedTrainer

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(32, (STEPS * ACCUMULATE * BATCH, 12), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    torch.manual_seed(0)
    config = hf.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    model = hf.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        args = hf.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=BATCH,
            gradient_accumulation_steps=ACCUMULATE,
            max_steps=STEPS,
            learning_rate=LR,
            lr_scheduler_type="cosine",
            max_grad_norm=CLIP,
            bf16=True,
            use_cpu=device == "cpu",
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = DecentralizedTrainer(model=model, args=args, train_dataset=Tokens(), algorithm="dpsgd")
        result = trainer.train()
    return outcome(
        "transformers", trainer.state.global_step, result.training_loss, model, trainer.distributed_optimizer
    )


TRAINERS = {"lightning": lightning, "accelerate": accelerate, "transformers": transformers}
EXTRAS = {"lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers"}  # the module each needs


def passed(result: dict, device: str) -> bool:
    """The run took its steps on the device with a finite loss, stepped by dpsgd's D-PSGD."""
    ok = result["steps"] == STEPS and math.isfinite(result["loss"]) and result["device"] == device
    return ok and result["optimizer"] == "DPSGD"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trainer", choices=TRAINERS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    print(json.dumps(TRAINERS[args.trainer](args.device)), flush=True)


if __name__ == "__main__":
    main()
