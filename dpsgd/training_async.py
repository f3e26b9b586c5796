"""The asynchronous training loop (AD-PSGD): one peer's side of an experiment with no global step.

`train_async(comm, cfg, out_dir)` builds the same data share, model and topology as the synchronous
loop (`dpsgd.training.train`, which dispatches here for `algorithm=adpsgd`), then each peer takes
steps at its own pace until the budget is spent: by default the same total number of samples
across peers as the synchronous loop's `epochs` (`algorithm.budget: samples`), or the same number of
steps per peer (`steps`), or `algorithm.seconds` of wall clock (`seconds`). No collective runs while
peers train; rank 0 logs its own view (its steps, train loss, its model's test accuracy) every
`log_every` of its steps. Once every peer has finished (`ADPSGD.finish`), the final record is taken
with collectives: the averaged model's and the peers' test accuracy, consensus distance, traffic,
and the AD-PSGD measurements (steps, averagings, staleness, waiting, throughput) of every peer.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from dpsgd import checkpoint, data, metrics
from dpsgd.build import build_peer
from dpsgd.comm import Communicator

HISTOGRAM_BINS = 16  # staleness 0..15, the last bin holding 15 and more


def train_async(comm: Communicator, cfg: dict, out_dir: str | Path | None = None) -> dict:
    peer = build_peer(comm, cfg)
    split, batches, model, opt = peer.split, peer.batches, peer.model, peer.optimizer
    x_test, y_test, network, shares = peer.x_test, peer.y_test, peer.network, peer.shares

    # the synchronous loop's budget, in the unit the algorithm asks for
    steps_per_epoch, total_steps = peer.steps_per_epoch, peer.total_steps
    opt.set_budget(steps=total_steps, samples=total_steps * batches.batch_size * comm.size,
                   samples_per_step=batches.batch_size)
    log_every = int(cfg.get("log_every") or steps_per_epoch)
    writer = out_dir is not None and comm.rank == 0
    out_dir = Path(out_dir) if out_dir is not None else None
    if cfg.get("resume"):
        raise ValueError("algorithm=adpsgd cannot resume from a checkpoint (an asynchronous run has no common "
                         "step to save at); start a new run")
    log_file = (out_dir / "metrics.jsonl").open("w") if writer else None

    comm.barrier()  # start the clock together
    start = time.perf_counter()
    network.clock.reset()
    opt.start()
    running, seen = 0.0, 0
    try:
        while not opt.should_stop():
            comm.context = f"step {opt.step_count + 1}"
            peer.before_step(opt.step_count + 1)
            running, seen = running + peer.train_step(), seen + 1
            if log_file is not None and opt.step_count % log_every == 0:
                log_file.write(json.dumps(_local_record(opt, model, x_test, y_test, running / seen, start,
                                                        steps_per_epoch, comm.size, network)) + "\n")
                log_file.flush()
                running, seen = 0.0, 0
        opt.finish()
    except BaseException:
        opt.abort()
        raise
    wall_own = time.perf_counter() - start
    comm.context = "final metrics"

    # every peer has finished: collectives are allowed again
    mine = opt.measurements()
    table = metrics.gather_scalars(comm, [mine["steps"], mine["samples"], mine["averagings_initiated"],
                                          mine["averagings_served"], mine["staleness_mean"], mine["staleness_max"],
                                          mine["wait_s"], mine["samples_per_s"], wall_own, network.slowdown.slept_s])
    hist = mine["staleness_histogram"]
    bins = hist[: HISTOGRAM_BINS - 1] + [0] * (HISTOGRAM_BINS - 1 - len(hist[: HISTOGRAM_BINS - 1]))
    bins.append(sum(hist[HISTOGRAM_BINS - 1 :]))
    hists = metrics.gather_scalars(comm, bins)
    wall = float(table[:, 8].max())  # the run lasts until its last peer stopped
    samples = int(table[:, 1].sum())
    steps = [int(v) for v in table[:, 0]]
    record = {
        "step": round(sum(steps) / comm.size),
        "epoch": samples / len(split.x_train),
        "samples": samples,
        "wall_time_s": wall,
        **metrics.snapshot_metrics(comm, model, x_test, y_test, running / seen if seen else float("nan")),
        **metrics.traffic(comm),
        "scope": "all peers",
    }
    total_hist = [int(v) for v in hists.sum(0)]
    steps_total = sum(total_hist)
    per_peer = {
        "roles": _gather_roles(comm, opt.role),
        "steps_per_peer": steps,
        "samples_per_peer": [int(v) for v in table[:, 1]],
        "averagings_initiated_per_peer": [int(v) for v in table[:, 2]],
        "averagings_served_per_peer": [int(v) for v in table[:, 3]],
        "staleness_mean_per_peer": [float(v) for v in table[:, 4]],
        "staleness_max_per_peer": [int(v) for v in table[:, 5]],
        "staleness_histogram_per_peer": [[int(v) for v in row] for row in hists],
        "wait_s_per_peer": [float(v) for v in table[:, 6]],
        "samples_per_s_per_peer": [float(v) for v in table[:, 7]],
        "slowdown_s_per_peer": [float(v) for v in table[:, 9]],
    }
    adpsgd = {
        "budget": opt.budget,
        "averagings": int(table[:, 2].sum()),
        "staleness_mean": sum(k * c for k, c in enumerate(total_hist)) / steps_total if steps_total else 0.0,
        "staleness_max": int(table[:, 5].max()),
        "staleness_histogram": total_hist,  # over all steps of all peers; last bin: >= HISTOGRAM_BINS - 1
        "wait_s_mean": float(table[:, 6].mean()),
        **per_peer,
    }
    summary = {
        **peer.describe(cfg, comm),
        "steps": record["step"],
        **{k: v for k, v in record.items() if k not in ("step", "scope")},
        "wall_time_s": wall,
        "samples_per_s": samples / wall,
        **({"target_accuracy": cfg["target_accuracy"], "steps_to_target": None, "time_to_target_s": None}
           if cfg.get("target_accuracy") is not None else {}),
        "adpsgd": adpsgd,
        "class_histograms": [data.class_histogram(split.y_train[s], split.num_classes) for s in shares],
    }
    if writer:
        totals = {k: v for k, v in adpsgd.items() if not k.endswith("_per_peer")}
        log_file.write(json.dumps({**record, "adpsgd": totals}) + "\n")
        log_file.close()
        checkpoint.write_json_atomic(out_dir / "summary.json", summary)
    return summary


def _gather_roles(comm: Communicator, role: str) -> list[str]:
    names = ("alone", "active", "passive")
    table = metrics.gather_scalars(comm, [float(names.index(role))])
    return [names[int(v)] for v in table[:, 0]]


@torch.no_grad()
def _local_record(opt, model, x_test, y_test, train_loss: float, start: float, steps_per_epoch: int,
                  peers: int, network) -> dict:
    """Rank 0's view while peers train (no collective can run): its steps, its loss, its model."""
    names = [n for n, _ in model.named_parameters()]
    loss, correct, count = metrics.evaluate(model, dict(zip(names, (p.detach() for p in model.parameters()))),
                                            x_test, y_test)
    return {
        "step": opt.step_count,
        "epoch": opt.step_count / steps_per_epoch,
        "samples": opt.step_count * opt.samples_per_step * peers,  # estimated: peers run at their own pace
        "wall_time_s": time.perf_counter() - start,
        "emulated_time_s": network.clock.elapsed() if network.active else None,
        "test_loss": loss / count,
        "test_accuracy": correct / count,  # rank 0's own model (the averaged one needs a collective)
        "peer_test_accuracy_mean": None,
        "peer_test_accuracy_min": None,
        "peer_test_accuracy_max": None,
        "peer_test_loss_mean": None,
        "consensus_distance": None,
        "train_loss": train_loss,
        "mb_sent_per_peer": None,
        "mb_received_per_peer": None,
        "comm_time_s": None,
        "scope": "rank 0",
    }
