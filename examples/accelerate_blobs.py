"""Hugging Face Accelerate with a decentralized optimizer: `DecentralizedAccelerator` is an `Accelerator` whose
`prepare` keeps the model out of DDP and puts the chosen dpsgd algorithm around the optimizer; Accelerate's mixed
precision, `accumulate()`, `clip_grad_norm_` and `save_state` / `load_state` (every peer's own state) stay as they are.

    torchrun --standalone --nproc-per-node 4 examples/accelerate_blobs.py --algorithm dpsgd
    accelerate launch --cpu --num_processes 4 examples/accelerate_blobs.py --algorithm diloco

With `--check-against-library-loop` every peer also replays the batches it trained on through the library's own
loop (examples/library_loop.py: the same seed, optimizer, accumulation, clipping, bf16 and schedule) and prints
the largest difference of the parameters, which is below 1e-6.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from dpsgd.integrations.accelerate import DecentralizedAccelerator

PERIOD_OF = {"diloco": {"period": 4}, "local_sgd": {"period": 4}}  # a short round for a short run


def blobs(samples: int = 2048, classes: int = 4, features: int = 16) -> TensorDataset:
    """Gaussian blobs, one per class: the same on every peer (one seed); `prepare` gives each peer its share."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(classes, features, generator=g) * 2
    y = torch.randint(classes, (samples,), generator=g)
    return TensorDataset(centers[y] + torch.randn(samples, features, generator=g), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="dpsgd", help="a dpsgd algorithm: dpsgd, allreduce, diloco, sgp, ...")
    parser.add_argument("--topology", default="ring", help="of topologies.make (sgp: directed_exponential)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--state", default="", help="a folder: save_state there at the end, as a checkpoint")
    parser.add_argument("--check-against-library-loop", action="store_true", help="see the module's doc")
    args = parser.parse_args()
    torch.set_num_threads(1)
    accelerator = DecentralizedAccelerator(
        args.algorithm,
        topology=args.topology,
        options=PERIOD_OF.get(args.algorithm),
        cpu=True,
        mixed_precision="bf16",
        gradient_accumulation_steps=2,
    )
    torch.manual_seed(0)
    model = classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(blobs(), batch_size=32, shuffle=True)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    recorder = None
    if args.check_against_library_loop:
        from library_loop import Recorder

        recorder, batches = Recorder(), len(loader)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    for _ in range(args.epochs):
        for x, y in loader:
            if recorder is not None:
                recorder.record((x, y))
            with accelerator.accumulate(model):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
    if args.state:
        accelerator.save_state(args.state)
    x, y = blobs().tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    if accelerator.is_main_process:
        steps = accelerator.distributed_optimizers[0].step_count
        print(
            f"{args.algorithm} in Accelerate on {accelerator.num_processes} peers, {steps} steps: "
            f"peer 0's accuracy {accuracy:.3f}, {accelerator.comm.stats.bytes_sent / 1e6:.2f} MB sent"
        )
    if recorder is not None:
        check(model, recorder, args, accelerator, batches)
    accelerator.end_training()


def classifier() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def check(model, recorder, args, accelerator: DecentralizedAccelerator, batches: int) -> None:
    """The library loop on the batches `model` trained on, from the same seed: the same training by hand (the
    schedule stepped once a peer each step, as Accelerate steps it when each peer's batch is its own)."""
    from library_loop import Reference
    from library_loop import check as compare

    reference = Reference(
        build=classifier,
        base=lambda net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        loss=lambda net, batch: torch.nn.functional.cross_entropy(net(batch[0]).float(), batch[1]),
        schedule=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * batches),
        accumulate=2,
        clip=1.0,
        bf16=True,
        schedule_steps=accelerator.num_processes,
    )
    compare(model, reference, recorder, args.algorithm, args.topology, PERIOD_OF.get(args.algorithm), accelerator.comm)


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:  # a refused algorithm, topology or option: one line, not a traceback
        raise SystemExit(f"error: {exc}") from None
