"""The Transformers Trainer with a decentralized optimizer: `DecentralizedTrainer` is a `Trainer` whose model stays
out of DDP and whose optimizer (here SGD with momentum, given in `optimizers=`; without it the Trainer's AdamW) is
wrapped in the chosen dpsgd algorithm. A tiny GPT-2 built from a config (nothing is downloaded) learns a repeating
character sequence; each peer reads its own share of it, as the Trainer's sampler deals them.

    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_tiny_gpt2.py --algorithm dpsgd
    torchrun --standalone --nproc-per-node 4 examples/hf_trainer_tiny_gpt2.py --algorithm diloco

With `--check-against-library-loop` every peer also replays the batches it trained on (with the RNG state of
each, for dropout) through the library's own loop (examples/library_loop.py: the same seed, optimizer, clipping
and schedule) and prints the largest difference of the parameters, which is below 1e-6.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

from dpsgd.integrations.transformers import DecentralizedTrainer

PERIOD_OF = {"diloco": {"period": 4}, "local_sgd": {"period": 4}}  # a short round for a short run
TEXT = "the quick brown fox jumps over the lazy dog. " * 40


class Characters(torch.utils.data.Dataset):
    """Windows of 32 characters of TEXT, as token ids (one per character)."""

    def __init__(self, window: int = 32) -> None:
        self.vocab = sorted(set(TEXT))
        ids = torch.tensor([self.vocab.index(c) for c in TEXT])
        self.windows = ids.unfold(0, window, window // 2)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i):
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="dpsgd", help="a dpsgd algorithm: dpsgd, allreduce, diloco, sgp, ...")
    parser.add_argument("--topology", default="ring", help="of topologies.make (sgp: directed_exponential)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--check-against-library-loop", action="store_true", help="see the module's doc")
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = Characters()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(data.vocab), n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    trainer_class, recorder = DecentralizedTrainer, None
    if args.check_against_library_loop:
        from library_loop import Recorder

        recorder = Recorder()
        trainer_class = recording_trainer(recorder)
    with tempfile.TemporaryDirectory() as out:
        training = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=8,
            max_steps=args.steps,
            learning_rate=0.1,
            lr_scheduler_type="cosine",
            max_grad_norm=1.0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            seed=0,
        )
        trainer = trainer_class(
            model=model,
            args=training,
            train_dataset=data,
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), None),
            algorithm=args.algorithm,
            topology=args.topology,
            algorithm_options=PERIOD_OF.get(args.algorithm),
        )
        result = trainer.train()
    if trainer.is_world_process_zero():
        sent = trainer.accelerator.comm.stats.bytes_sent
        print(
            f"{args.algorithm} in the Trainer on {training.world_size} peers, {trainer.state.global_step} steps: "
            f"peer 0's mean training loss {result.training_loss:.3f}, {sent / 1e6:.2f} MB sent"
        )
    if recorder is not None:
        check(trainer, config, recorder, args)


def recording_trainer(recorder) -> type:
    """DecentralizedTrainer keeping each batch (and the token count it is normalised by) in `recorder`."""

    class Recording(DecentralizedTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            items = {} if num_items_in_batch is None else {"num_items_in_batch": torch.as_tensor(num_items_in_batch)}
            recorder.record({**inputs, **items})
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    return Recording


def check(trainer: DecentralizedTrainer, config, recorder, args) -> None:
    """The library loop on the batches the Trainer trained on, from the same seed: the same training by hand."""
    from library_loop import Reference
    from library_loop import check as compare

    def loss(net, batch):
        net.train()  # the Trainer's mode: dropout on, its masks drawn from the recorded RNG state
        return net(**batch).loss

    reference = Reference(
        build=lambda: transformers.GPT2LMHeadModel(config),
        base=lambda net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        loss=loss,
        schedule=lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 0, args.steps),
        clip=1.0,
    )
    comm = trainer.accelerator.comm
    compare(trainer.model, reference, recorder, args.algorithm, args.topology, PERIOD_OF.get(args.algorithm), comm)


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:  # a refused algorithm, topology or option: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
