"""An experiment on the fleet: `train_fleet(cfg, out_dir)` is `dpsgd.training.train` for
`backend=fleet`. It runs all peers in this process (dpsgd.sim.Fleet; AD-PSGD by the event simulator,
dpsgd.sim.events) and writes the same files with the same keys as a real run: `metrics.jsonl` (one
record every `log_every` steps) and `summary.json`, so `experiments.report` reads fleet sweeps as it
reads real ones. `comm_time_s` is the time the fleet spent in its communication operations (the
products with W, the means), which every peer shares; nothing waits, so `comm_overlap_s` is 0."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.func import functional_call, vmap

from dpsgd import checkpoint, data, metrics
from dpsgd.build import Peer

from .fleet import Fleet

PEER_CHUNK = 64  # peers evaluated in one vectorized call


@torch.no_grad()
def evaluate_peers(model, names: list[str], params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                   batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(n,) sums of losses, (n,) numbers correct and the count, of every peer's own model on (x, y),
    as `dpsgd.metrics.evaluate` scores one model."""
    loss_fn = metrics.loss_function(y)

    def score(ps, xb, yb):
        out = functional_call(model, dict(zip(names, ps)), (xb,))
        hit = (out.squeeze(-1) - yb).abs() < 0.1 if yb.is_floating_point() else out.argmax(-1) == yb
        return loss_fn(out, yb, reduction="sum"), hit.sum()

    n = params[0].shape[0]
    loss = torch.zeros(n, dtype=torch.float64)
    correct = torch.zeros(n, dtype=torch.float64)
    batched = vmap(score, in_dims=(0, None, None))
    for a in range(0, n, PEER_CHUNK):
        chunk = tuple(p[a : a + PEER_CHUNK] for p in params)
        for i in range(0, len(x), batch_size):
            part_loss, c = batched(chunk, x[i : i + batch_size], y[i : i + batch_size])
            loss[a : a + PEER_CHUNK] += part_loss.double().cpu()
            correct[a : a + PEER_CHUNK] += c.double().cpu()
    return loss, correct, y.numel()


@torch.no_grad()
def snapshot_metrics(model, names: list[str], params: list[torch.Tensor], x_test, y_test,
                     train_loss: float) -> dict:
    """`dpsgd.metrics.snapshot_metrics` for stacked parameters: the averaged model's test metrics,
    every peer's own, the consensus distance and the mean train loss."""
    avg = [p.mean(0) for p in params]
    sq_dist = sum(((p.double() - a.double()) ** 2).reshape(p.shape[0], -1).sum(1) for p, a in zip(params, avg))
    avg_loss, avg_correct, count = metrics.evaluate(model, dict(zip(names, avg)), x_test, y_test)
    own_loss, own_correct, own_count = evaluate_peers(model, names, params, x_test, y_test)
    peer_acc = own_correct / own_count
    return {
        "test_loss": avg_loss / count,
        "test_accuracy": avg_correct / count,
        "peer_test_accuracy_mean": float(peer_acc.mean()),
        "peer_test_accuracy_min": float(peer_acc.min()),
        "peer_test_accuracy_max": float(peer_acc.max()),
        "peer_test_loss_mean": float((own_loss / own_count).mean()),
        "consensus_distance": float(sq_dist.mean()),
        "train_loss": float(train_loss),
    }


def traffic(bytes_sent: torch.Tensor, bytes_received: torch.Tensor, comm_time_s: float) -> dict:
    return {
        "mb_sent_per_peer": float(bytes_sent.mean()) / 1e6,
        "mb_received_per_peer": float(bytes_received.mean()) / 1e6,
        "comm_time_s": comm_time_s,
        "comm_overlap_s": 0.0,
        "emulated_wait_s": None,  # the fleet does not emulate links (the AD-PSGD event simulator's time is virtual)
    }


def describe(cfg: dict, n: int, topology) -> dict:
    """The first keys of summary.json, written by `dpsgd.build.Peer.describe` itself (it reads only the
    topology of the peer, and the communicator's size and backend)."""
    return Peer.describe(SimpleNamespace(topology=topology), cfg, Roster(n))


def train_fleet(cfg: dict, out_dir: str | Path | None = None) -> dict:
    """Run the experiment `cfg` on the fleet; write metrics.jsonl and summary.json to `out_dir`."""
    if cfg["algorithm"]["name"] == "adpsgd":
        return train_events(cfg, out_dir)
    fleet = Fleet(cfg)
    n, split, model = fleet.n, fleet.split, fleet.model
    x_test, y_test = split.x_test.to(fleet.device), split.y_test.to(fleet.device)
    steps_per_epoch, total_steps = fleet.steps_per_epoch, fleet.total_steps
    batch_size = fleet.batches.batch_size
    log_every = int(cfg.get("log_every") or steps_per_epoch)
    target = cfg.get("target_accuracy")
    out_dir = Path(out_dir) if out_dir is not None else None
    log_file = (out_dir / "metrics.jsonl").open("w") if out_dir is not None else None

    running = torch.zeros(n, dtype=torch.float64)
    seen, record, reached = 0, {}, {}
    start = time.perf_counter()
    for step in range(1, total_steps + 1):
        running += fleet.train_step().double().cpu()
        seen += 1
        if step % log_every == 0 or step == total_steps:
            record = {
                "step": step,
                "epoch": step / steps_per_epoch,
                "samples": step * batch_size * n,
                "wall_time_s": time.perf_counter() - start,
                "emulated_time_s": None,
                **snapshot_metrics(model, fleet.names, fleet.params, x_test, y_test, float((running / seen).mean())),
                **traffic(fleet.bytes_sent, fleet.bytes_received, fleet.comm_time_s),
            }
            running.zero_()
            seen = 0
            if target is not None and not reached and record["test_accuracy"] >= target:
                reached = {"steps_to_target": step, "time_to_target_s": record["wall_time_s"],
                           "samples_to_target": record["samples"], "mb_sent_to_target": record["mb_sent_per_peer"]}
            if log_file is not None:
                log_file.write(json.dumps(record) + "\n")
                log_file.flush()
    wall = time.perf_counter() - start
    summary = {
        **describe(cfg, n, fleet.topology),
        "steps": total_steps,
        **{k: v for k, v in record.items() if k != "step"},
        "wall_time_s": wall,
        "emulated_s_per_step": None,
        "samples_per_s": total_steps * batch_size * n / wall,
        **({"target_accuracy": target, **(reached or {"steps_to_target": None, "time_to_target_s": None})}
           if target is not None else {}),
        "class_histograms": [data.class_histogram(split.y_train[s], split.num_classes) for s in fleet.shares],
    }
    if log_file is not None:
        log_file.close()
        checkpoint.write_json_atomic(out_dir / "summary.json", summary)
    return summary


HISTOGRAM_BINS = 16  # as dpsgd.training_async: staleness 0..15, the last bin holding 15 and more


def train_events(cfg: dict, out_dir: str | Path | None = None) -> dict:
    """AD-PSGD on the event simulator, with the files and keys of `dpsgd.training_async`; records carry
    every peer's metrics at each `log_every`-th step of peer 0 and the virtual time (`emulated_time_s`)."""
    from .events import Simulation

    sim = Simulation(cfg)
    n, split, model = sim.n, sim.split, sim.model
    log_every = int(cfg.get("log_every") or sim.steps_per_epoch)
    out_dir = Path(out_dir) if out_dir is not None else None
    log_file = (out_dir / "metrics.jsonl").open("w") if out_dir is not None else None
    start = time.perf_counter()

    def record(train_loss: float) -> dict:
        samples = sum(sim.steps) * sim.batch_size
        return {
            "step": round(sum(sim.steps) / n),
            "epoch": samples / len(split.x_train),
            "samples": samples,
            "wall_time_s": time.perf_counter() - start,
            "emulated_time_s": sim.now,
            **snapshot_metrics(model, sim.names, sim.live_params(), split.x_test, split.y_test, train_loss),
            **traffic(torch.tensor(sim.bytes_sent, dtype=torch.float64),
                      torch.tensor(sim.bytes_received, dtype=torch.float64), sum(sim.wait_s) / n),
            "scope": "all peers",
        }

    def on_step(sim, peer):
        if log_file is not None and peer == 0 and sim.steps[0] % log_every == 0:
            recent = [sum(ls[-log_every:]) / len(ls[-log_every:]) for ls in sim.losses if ls]
            progress = record(sum(recent) / len(recent))
            for key in ("comm_overlap_s", "emulated_wait_s"):  # the keys of training_async's records while peers train
                progress.pop(key)
            log_file.write(json.dumps(progress) + "\n")
            log_file.flush()

    sim.run(on_step)
    sim.now = sim.end_time
    last = [ls[-1] for ls in sim.losses if ls]
    final = record(sum(last) / len(last) if last else float("nan"))
    wall = time.perf_counter() - start
    final["wall_time_s"] = wall
    hists = [h[: HISTOGRAM_BINS - 1] + [0] * (HISTOGRAM_BINS - 1 - len(h[: HISTOGRAM_BINS - 1]))
             + [sum(h[HISTOGRAM_BINS - 1 :])] for h in sim.staleness]
    total_hist = [sum(col) for col in zip(*hists)]
    steps_total = sum(total_hist)
    elapsed = [sim.finished_at[r] for r in range(n)]
    adpsgd = {
        "budget": sim.budget,
        "averagings": sum(sim.initiated),
        "staleness_mean": sum(k * c for k, c in enumerate(total_hist)) / steps_total if steps_total else 0.0,
        "staleness_max": max((len(h) - 1 for h in sim.staleness if h), default=0),
        "staleness_histogram": total_hist,
        "wait_s_mean": sum(sim.wait_s) / n,
        "roles": list(sim.role),
        "steps_per_peer": list(sim.steps),
        "samples_per_peer": [s * sim.batch_size for s in sim.steps],
        "averagings_initiated_per_peer": list(sim.initiated),
        "averagings_served_per_peer": list(sim.served),
        "staleness_mean_per_peer": [sum(k * c for k, c in enumerate(h)) / max(1, sum(h)) for h in sim.staleness],
        "staleness_max_per_peer": [len(h) - 1 if h else 0 for h in sim.staleness],
        "staleness_histogram_per_peer": hists,
        "wait_s_per_peer": list(sim.wait_s),
        "samples_per_s_per_peer": [s * sim.batch_size / e if e > 0 else 0.0 for s, e in zip(sim.steps, elapsed)],
        "slowdown_s_per_peer": [0.0] * n,
    }
    summary = {
        **describe(cfg, n, sim.topology),
        "steps": final["step"],
        **{k: v for k, v in final.items() if k not in ("step", "scope")},
        "wall_time_s": wall,  # the virtual time is the last record's emulated_time_s
        "samples_per_s": final["samples"] / wall,
        **({"target_accuracy": cfg["target_accuracy"], "steps_to_target": None, "time_to_target_s": None}
           if cfg.get("target_accuracy") is not None else {}),
        "adpsgd": adpsgd,
        "class_histograms": [data.class_histogram(split.y_train[s], split.num_classes) for s in sim.shares],
    }
    if log_file is not None:
        totals = {k: v for k, v in adpsgd.items() if not k.endswith("_per_peer")}
        log_file.write(json.dumps({**final, "adpsgd": totals}) + "\n")
        log_file.close()
        checkpoint.write_json_atomic(out_dir / "summary.json", summary)
    return summary
