"""An experiment on the fleet: `train_fleet(cfg, out_dir)` is `dpsgd.training.train` for
`backend=fleet`. It runs all peers in this process (dpsgd.sim.Fleet; an asynchronous algorithm on the
event simulator, dpsgd.sim.events) through the one training loop (`dpsgd.training.run_loop`), which
writes the same files with the same keys as a real run, so `experiments.report` reads fleet sweeps.
`comm_time_s` is the time the fleet spent in its communication operations (the products with W, the
means), which every peer shares; nothing waits, so `comm_overlap_s` is 0."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.func import vmap

from dpsgd import metrics
from dpsgd.build import describe
from dpsgd.comm import Communicator
from dpsgd.training import run_loop

from .fleet import Fleet, FleetCommunicator

PEER_CHUNK = 64  # peers evaluated in one vectorized call


@torch.no_grad()
def evaluate_peers(
    model, names: list[str], params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(n,) sums of losses, (n,) numbers correct and the count, of every peer's own model on (x, y),
    as `dpsgd.metrics.evaluate` scores one model."""
    n = params[0].shape[0]
    loss = torch.zeros(n, dtype=torch.float64)
    correct = torch.zeros(n, dtype=torch.float64)
    batched = vmap(lambda ps, xb, yb: metrics.score(model, dict(zip(names, ps)), xb, yb), in_dims=(0, None, None))
    for a in range(0, n, PEER_CHUNK):
        chunk = tuple(p[a : a + PEER_CHUNK] for p in params)
        for i in range(0, len(x), batch_size):
            part_loss, c = batched(chunk, x[i : i + batch_size], y[i : i + batch_size])
            loss[a : a + PEER_CHUNK] += part_loss.double().cpu()
            correct[a : a + PEER_CHUNK] += c.double().cpu()
    return loss, correct, y.numel()


@torch.no_grad()
def snapshot_metrics(
    model, names: list[str], params: list[torch.Tensor], x_test, y_test, train_loss: float, optimum=None
) -> dict:
    """`dpsgd.metrics.snapshot_metrics` for stacked parameters: the averaged model's test metrics,
    every peer's own, the consensus distance and the mean train loss (and where known, the perplexity
    and the distances to the optimum)."""
    avg = [p.mean(0) for p in params]
    sq_dist = torch.stack(
        [((p.double() - a.double()) ** 2).reshape(p.shape[0], -1).sum(1) for p, a in zip(params, avg)]
    ).sum(0)
    avg_loss, avg_correct, count = metrics.evaluate(model, dict(zip(names, avg)), x_test, y_test)
    own_loss, own_correct, own_count = evaluate_peers(model, names, params, x_test, y_test)
    peer_acc = own_correct / own_count
    sq_optimum = metrics.squared_optimum_distances(params, optimum, peer_axis=True)
    return {
        "test_loss": avg_loss / count,
        "test_accuracy": avg_correct / count,
        "peer_test_accuracy_mean": float(peer_acc.mean()),
        "peer_test_accuracy_min": float(peer_acc.min()),
        "peer_test_accuracy_max": float(peer_acc.max()),
        "peer_test_loss_mean": float((own_loss / own_count).mean()),
        "consensus_distance": float(sq_dist.mean()),
        "train_loss": float(train_loss),
        **metrics.language_metrics(avg_loss / count, y_test),
        **metrics.optimum_distances(avg, sq_optimum, optimum),
    }


def traffic(
    bytes_sent: torch.Tensor, bytes_received: torch.Tensor, comm_time_s: float, peak_step_bytes: float | None
) -> dict:
    return {
        "mb_sent_per_peer": float(bytes_sent.mean()) / 1e6,
        "peak_mb_sent_per_step": None if peak_step_bytes is None else peak_step_bytes / 1e6,
        "mb_received_per_peer": float(bytes_received.mean()) / 1e6,
        "comm_time_s": comm_time_s,
        "comm_overlap_s": 0.0,
        "emulated_wait_s": None,  # the fleet does not emulate links (the AD-PSGD event simulator's time is virtual)
    }


class FleetRun:
    """A synchronous algorithm on the fleet, for dpsgd.training.run_loop: records cover every peer."""

    writer = True
    comm: Communicator

    def __init__(self, cfg: dict):
        self.fleet = fleet = Fleet(cfg)
        self.comm, self.step_count, self.total_steps = fleet.comm, 0, fleet.plan.total_steps
        self.peak_step_bytes = 0.0  # the most bytes one peer sent in one step
        self._test = fleet.plan.split.x_test.to(fleet.device), fleet.plan.split.y_test.to(fleet.device)

    def describe(self, cfg: dict) -> dict:
        return describe(cfg, self.fleet.topology, self.comm)

    def begin(self, state: dict | None) -> None:
        return None

    def done(self) -> bool:
        return self.step_count >= self.total_steps

    def train_step(self) -> float | None:
        self.step_count += 1
        sent = self.fleet.bytes_sent.clone()
        loss = float(self.fleet.train_step().double().mean())
        self.peak_step_bytes = max(self.peak_step_bytes, float((self.fleet.bytes_sent - sent).max()))
        return loss

    def record(self, train_loss: float, wall_s: float) -> dict:
        fleet, step = self.fleet, self.step_count
        return {
            "step": step,
            "epoch": fleet.plan.epoch(step * fleet.batches.batch_size * fleet.n),
            "samples": step * fleet.batches.batch_size * fleet.n,
            "wall_time_s": wall_s,
            "emulated_time_s": None,
            **snapshot_metrics(
                fleet.model, fleet.names, fleet.params, *self._test, train_loss, fleet.plan.split.optimum
            ),
            **traffic(fleet.bytes_sent, fleet.bytes_received, self.comm.stats.comm_time_s, self.peak_step_bytes),
        }

    def final(self, last: dict, train_loss: float, wall_s: float) -> dict:
        return last

    def summary(self, final: dict, wall_s: float) -> dict:
        return {"class_histograms": self.fleet.plan.class_histograms()}

    def state(self, extra: dict) -> dict | None:
        return None


class EventsRun(FleetRun):
    """An asynchronous algorithm on the event simulator (virtual time), for dpsgd.training.run_loop: a record at every
    `log_every`-th step of peer 0, each covering every peer, with the virtual time as `emulated_time_s`."""

    def __init__(self, cfg: dict):
        from .events import Simulation

        self.sim = sim = Simulation(cfg)
        self.comm = FleetCommunicator(sim.n)  # what the run describes: n peers of the fleet
        self.step_count, self.total_steps = 0, sim.plan.total_steps

    def describe(self, cfg: dict) -> dict:
        return describe(cfg, self.sim.topology, self.comm)

    def done(self) -> bool:
        return self.sim.done()

    def train_step(self) -> float | None:
        peer = self.sim.advance()
        if peer is None:
            return None
        self.step_count = self.sim.steps[0]
        return self.sim.losses[peer][-1]

    def record(self, train_loss: float, wall_s: float, progress: bool = True) -> dict:
        sim = self.sim
        samples = sum(sim.steps) * sim.batch_size
        out = {
            "step": round(sum(sim.steps) / sim.n),
            "epoch": sim.plan.epoch(samples),
            "samples": samples,
            "wall_time_s": wall_s,
            "emulated_time_s": sim.now,
            **snapshot_metrics(
                sim.model,
                sim.names,
                sim.live_params(),
                sim.plan.split.x_test,
                sim.plan.split.y_test,
                train_loss,
                sim.plan.split.optimum,
            ),
            **traffic(
                torch.tensor(sim.bytes_sent, dtype=torch.float64),
                torch.tensor(sim.bytes_received, dtype=torch.float64),
                sum(opt.wait_s for opt in sim.opts) / sim.n,
                None,  # no global step
            ),
            "scope": "all peers",
        }
        if progress:  # the keys of a real asynchronous run's records while its peers train
            for key in ("comm_overlap_s", "emulated_wait_s"):
                out.pop(key)
        return out

    def final(self, last: dict, train_loss: float, wall_s: float) -> dict:
        self.sim.now = self.sim.end_time
        return self.record(train_loss, wall_s, progress=False)

    def summary(self, final: dict, wall_s: float) -> dict:
        sim, opt = self.sim, self.sim.opts[0]
        rows = [{**o.measurements(), "slowdown_s": 0.0} for o in sim.opts]  # compute times are drawn, not slept
        return {opt.summary_key: opt.summary(rows), "class_histograms": sim.plan.class_histograms()}


def train_fleet(cfg: dict, out_dir: str | Path | None = None) -> dict:
    """Run the experiment `cfg` with every peer in this process; write metrics.jsonl and summary.json to
    `out_dir`. An asynchronous algorithm runs on the event simulator (dpsgd.sim.events)."""
    from dpsgd.build import check_algorithm

    asynchronous = getattr(check_algorithm(cfg), "asynchronous", False)
    return run_loop(EventsRun(cfg) if asynchronous else FleetRun(cfg), cfg, out_dir)
