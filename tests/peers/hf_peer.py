"""One rank of tests/test_integrations.py under `torchrun --nproc-per-node 2`: a tiny GPT-2 (built from a config,
no download) trained by DecentralizedTrainer with allreduce, dpsgd and diloco, the batches it saw recorded, then
the same batches through the library's own loop from the same start; the bytes gloo carried during training.

    torchrun --standalone --nproc-per-node 2 tests/peers/hf_peer.py OUT_DIR [--plant ddp]

writes OUT_DIR/rank{r}.json. `--plant ddp` lets the Trainer's Accelerator wrap the model in DDP.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from torch.profiler import ProfilerActivity, profile
from trainer_common import OPTIONS, params, peer_main, wire_bytes

import dpsgd.comm
import topologies
from dpsgd.integrations import Algorithm
from dpsgd.integrations.accelerate import DecentralizedAccelerator
from dpsgd.integrations.transformers import DecentralizedTrainer
from dpsgd.optim import ALGORITHMS

LR, CLIP, STEPS = 0.05, 1.0, 4


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(1 + int(os.environ["RANK"]))  # apart: the optimizer brings rank 0's model
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        rows = 32 * int(os.environ["WORLD_SIZE"])  # 32 a peer: 8 batches of 4
        self.ids = torch.randint(32, (rows, 12), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Recording(DecentralizedTrainer):
    """Keeps each batch it computed a loss on, and the token count it was normalised by."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list = []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        self.seen.append(({k: v.clone() for k, v in inputs.items()}, num_items_in_batch))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


class Traffic(transformers.TrainerCallback):
    """The profiler from the first step to the last (the optimizer built, and its initial broadcast done)."""

    def __init__(self, trainer_box: list) -> None:
        self.box = trainer_box

    def on_train_begin(self, args, state, control, **kwargs):
        self.sent_before = self.box[0].accelerator.comm.stats.bytes_sent
        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        self.prof.__enter__()

    def on_train_end(self, args, state, control, **kwargs):
        self.prof.__exit__(None, None, None)
        comm = self.box[0].accelerator.comm
        self.wire, self.collectives = wire_bytes(self.prof, comm.size)
        self.counted = comm.stats.bytes_sent - self.sent_before


def library_loop(name: str, seen, comm) -> list[float]:
    model = tiny_gpt2()
    base = torch.optim.SGD(model.parameters(), lr=LR)
    topology = topologies.make("ring", comm.size)
    opt = ALGORITHMS[name](base, topology=topology, comm=comm, module=model, **OPTIONS[name])
    for inputs, items in seen:
        loss = model(**inputs, num_items_in_batch=items).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return params(model)


def run(out: Path, plant: str = "") -> dict:
    """For allreduce, dpsgd and diloco: the Trainer's run and the library loop on its batches (see the module)."""
    if plant == "ddp":
        DecentralizedAccelerator.prepare_model = Accelerator.prepare_model  # type: ignore[method-assign]
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=CLIP,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    result: dict = {}
    for name in OPTIONS:
        model = tiny_gpt2()
        box: list = []
        traffic = Traffic(box)
        trainer = Recording(
            model=model,
            args=args,
            train_dataset=Tokens(),
            # the base the algorithm wraps (without it: the Trainer's AdamW)
            optimizers=(torch.optim.SGD(model.parameters(), lr=LR), None),
            callbacks=[traffic],
            algorithm=Algorithm(name, options=OPTIONS[name], timeout_s=60),
        )
        box.append(trainer)
        trainer.train()
        opt = trainer.distributed_optimizer
        result[name] = {
            "trainer": params(trainer.model),
            "model_class": type(trainer.model_wrapped).__name__,
            "optimizer": type(opt).__name__,
            "step_count": opt.step_count,
            "global_step": trainer.state.global_step,
            "profiled_bytes": traffic.wire,
            "profiled_collectives": traffic.collectives,
            "counted_bytes": traffic.counted,
            "library": library_loop(name, trainer.seen, dpsgd.comm.init("torch")),
        }
    try:
        DecentralizedTrainer(model=tiny_gpt2(), args=args, algorithm="adpsgd")
    except ValueError as exc:
        result["adpsgd_refusal"] = str(exc)
    return result


if __name__ == "__main__":
    peer_main(run)
