"""An experiment on the fleet: `train_fleet(config, out_dir)` is `dpsgd.training.train` for
`backend=fleet`. It runs all peers in this process (dpsgd.sim.Fleet; an asynchronous algorithm on the
event simulator, dpsgd.sim.events) through the one training loop (`dpsgd.training.run_loop`), which
writes the same files with the same keys as a real run, so `experiments.report` reads fleet sweeps.
`comm_time_s` is the time the fleet spent in its communication operations (the products with W, the
means), which every peer shares; nothing waits, so `comm_overlap_s` is 0."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from dpsgd import metrics
from dpsgd.build import algorithm_class
from dpsgd.config import RunConfig
from dpsgd.metrics import Evaluation
from dpsgd.training import Run, run_loop

from .fleet import Fleet, FleetCommunicator


class FleetRun(Run):
    """A synchronous algorithm on the fleet, for dpsgd.training.run_loop: records cover every peer."""

    writer = True
    comm: FleetCommunicator

    def __init__(self, config: RunConfig):
        self.fleet = fleet = Fleet(config)
        self.plan, self.topology, self.comm = fleet.plan, fleet.topology, fleet.comm
        self.step_count, self.total_steps = 0, fleet.plan.total_steps
        self.peak_step_bytes = 0.0  # the most bytes one peer sent in one step
        self.test = fleet.plan.split.x_test.to(fleet.device), fleet.plan.split.y_test.to(fleet.device)

    def train_step(self) -> float | None:
        self.step_count += 1
        sent = self.comm.bytes_sent.clone()
        loss = float(self.fleet.step(self.step_count).double().mean())
        self.peak_step_bytes = max(self.peak_step_bytes, float((self.comm.bytes_sent - sent).max()))
        return loss

    def record(self, train_loss: float, wall_s: float, evaluation: Evaluation | None) -> dict:
        fleet, step = self.fleet, self.step_count
        traffic = {
            "bytes_sent": self.comm.bytes_sent,
            "bytes_received": self.comm.bytes_received,
            "comm_time_s": self.comm.stats.comm_time_s,
            "peak_step_bytes": self.peak_step_bytes,
        }
        samples, optimum = step * fleet.plan.batch_size * fleet.n, fleet.plan.split.optimum
        with sdpa_kernel(SDPBackend.MATH):  # under vmap: attention as its products, not a loop over peers
            measured = metrics.measure_stacked(
                fleet.model, fleet.names, fleet.params, evaluation, train_loss, optimum, traffic, False
            )
        return metrics.record(
            step=step,
            epoch=fleet.plan.epoch(samples),
            samples=samples,
            wall_time_s=wall_s,
            lr=fleet.stepper.lr,
            scope="all peers",
            **measured,
        )


class EventsRun(FleetRun):
    """An asynchronous algorithm on the event simulator (virtual time), for dpsgd.training.run_loop: a record at every
    `log_every`-th step of peer 0, each covering every peer, with the virtual time as `emulated_time_s`."""

    def __init__(self, config: RunConfig):
        from .events import Simulation

        self.sim = sim = Simulation(config)
        self.lr = float(cast(Any, sim.opts[0]).param_groups[0]["lr"])  # constant: the simulator takes no schedule
        self.plan, self.topology = sim.plan, sim.topology
        self.comm = FleetCommunicator(sim.n)  # what the run describes: n peers of the fleet
        self.test = sim.plan.split.x_test.to(sim.device), sim.plan.split.y_test.to(sim.device)  # peers may be on a GPU
        self.step_count, self.total_steps = 0, sim.plan.total_steps

    def done(self) -> bool:
        return self.sim.done()

    def train_step(self) -> float | None:
        peer = self.sim.advance()
        if peer is None:
            return None
        self.step_count = self.sim.steps[0]
        return self.sim.losses[peer][-1]

    def record(self, train_loss: float, wall_s: float, evaluation: Evaluation | None) -> dict:
        sim, split = self.sim, self.sim.plan.split
        samples = sum(sim.steps) * sim.batch_size
        waits = torch.tensor([opt.wait_s for opt in sim.opts], dtype=torch.float64)  # in virtual time
        traffic = {
            "bytes_sent": torch.tensor(sim.bytes_sent, dtype=torch.float64),
            "bytes_received": torch.tensor(sim.bytes_received, dtype=torch.float64),
            "comm_time_s": waits,
            "emulated_wait_s": waits,
            "clock_s": sim.now,
        }
        with sdpa_kernel(SDPBackend.MATH):
            measured = metrics.measure_stacked(
                sim.model,
                sim.names,
                sim.live_params(),
                evaluation,
                train_loss,
                split.optimum,
                traffic,
                True,
            )
        return metrics.record(
            step=round(sum(sim.steps) / sim.n),
            epoch=sim.plan.epoch(samples),
            samples=samples,
            wall_time_s=wall_s,
            **{**measured, "peak_mb_sent_per_step": None},  # no global step
            lr=self.lr,
            scope="all peers",
        )

    def final(self, last: dict, train_loss: float, wall_s: float) -> dict:
        self.sim.now = self.sim.end_time
        return self.record(train_loss, wall_s, Evaluation(*self.test))

    def summary(self, final: dict, wall_s: float) -> dict:
        sim, opt = self.sim, self.sim.opts[0]
        rows = [{**o.measurements(), "slowdown_s": 0.0} for o in sim.opts]  # compute times are drawn, not slept
        return {opt.summary_key: opt.summary(rows), "class_histograms": sim.plan.class_histograms()}

    def diverged_blocks(self) -> dict:
        """Every peer is in this process: the asynchronous figures up to the divergence (goodput, staleness)."""
        return self.summary({}, 0.0)


def train_fleet(config: RunConfig, out_dir: str | Path | None = None) -> dict:
    """Run the experiment `config` with every peer in this process; write metrics.jsonl and summary.json to
    `out_dir`. An asynchronous algorithm runs on the event simulator (dpsgd.sim.events)."""
    asynchronous = getattr(algorithm_class(config.algorithm), "asynchronous", False)
    return run_loop(EventsRun(config) if asynchronous else FleetRun(config), config, out_dir)
