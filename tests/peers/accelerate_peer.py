"""One rank of tests/test_integrations.py under `torchrun --nproc-per-node 2`: for allreduce, dpsgd and diloco, an
Accelerate loop with DecentralizedAccelerator (bf16, `accumulate()`, `clip_grad_norm_`, a scheduler) and the
library's own loop with the same seeds and data order; the bytes gloo carried during the dpsgd loop; a diloco
loop saved with `save_state` after its third step and resumed by a fresh one with `load_state`.

    torchrun --standalone --nproc-per-node 2 tests/peers/accelerate_peer.py OUT_DIR [--plant ddp]

writes OUT_DIR/rank{r}.json. `--plant ddp` lets Accelerate wrap the model in DDP, `--plant no-peer-files` keeps
Accelerate's own save_state / load_state, to see the tests catch it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate import Accelerator
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, DistributedSampler
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
from dpsgd.integrations.accelerate import DecentralizedAccelerator


def accelerate_loop(name: str, state_dir: Path, stop_after: int = -1, resume: bool = False) -> dict:
    accelerator = DecentralizedAccelerator(
        Algorithm(name, topology="ring", options=OPTIONS[name], timeout_s=60),
        cpu=True,
        mixed_precision="bf16",
        gradient_accumulation_steps=ACCUMULATE,
        step_scheduler_with_optimizer=False,  # stepped once a step below, as the library loop does
    )
    net = model()
    base = torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9)
    net, opt, sched = accelerator.prepare(net, base, schedule(base))
    if resume:
        accelerator.load_state(str(state_dir))
    data = dataset()
    sampler = DistributedSampler(data, accelerator.num_processes, accelerator.process_index, shuffle=True, seed=0)
    comm = accelerator.comm
    sent_before, steps = comm.stats.bytes_sent, 0
    skip = 3 * ACCUMULATE if resume else 0  # the batches the saved run had taken
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for x, y in DataLoader(data, batch_size=BATCH, sampler=sampler):
                if skip:
                    skip -= 1
                    continue
                with accelerator.accumulate(net):
                    loss = torch.nn.functional.cross_entropy(net(x), y)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(net.parameters(), CLIP)
                    opt.step()
                    if accelerator.sync_gradients:
                        sched.step()
                        steps += 1
                    opt.zero_grad()
                if accelerator.sync_gradients and steps == stop_after:
                    accelerator.save_state(str(state_dir))
                    return {"stopped": steps}
    wire, collectives = wire_bytes(prof, accelerator.num_processes)
    traffic = {"steps": steps, "profiled_bytes": wire, "profiled_collectives": collectives}
    return {"params": params(net), "traffic": {**traffic, "counted_bytes": comm.stats.bytes_sent - sent_before}}


def run(out: Path, plant: str = "") -> dict:
    """Every loop of this rank (see the module), with the bug `plant` put in first, if any."""
    if plant == "ddp":
        DecentralizedAccelerator.prepare_model = Accelerator.prepare_model  # type: ignore[method-assign]
    if plant == "no-peer-files":  # Accelerate's own save_state / load_state: rank 0's model and optimizer alone
        DecentralizedAccelerator.save_state = Accelerator.save_state  # type: ignore[method-assign]
        DecentralizedAccelerator.load_state = Accelerator.load_state  # type: ignore[method-assign]
    result: dict = {}
    for name in OPTIONS:
        run = accelerate_loop(name, out / name)
        result[name] = {"accelerate": run["params"], "traffic": run["traffic"]}
        result[name]["library"] = library_loop(name, dpsgd.comm.init("torch"))
    state = out / "state"
    result["stopped"] = accelerate_loop("diloco", state, stop_after=3)
    result["resumed"] = accelerate_loop("diloco", state, resume=True)["params"]
    try:
        DecentralizedAccelerator("adpsgd", cpu=True)
    except ValueError as exc:
        result["adpsgd_refusal"] = str(exc)
    return result


if __name__ == "__main__":
    peer_main(run)
