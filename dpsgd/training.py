"""The one training loop every run takes, and the one writer of a run's records.

`run_loop(run, config, out_dir)` drives a `Run`: real peers taking global steps (`SynchronousRun`), real
peers at their own pace (`AsynchronousRun`, for an optimizer that declares `asynchronous`), the fleet
and the event simulator (dpsgd.sim.run). It averages the training loss, writes `metrics.jsonl` every
`log_every` steps, tracks the target accuracy, checkpoints every `checkpoint.every` steps where the run
can, shows its progress (dpsgd.progress), and writes `summary.json` with the same keys for every kind of run
(records: dpsgd.metrics.Record), each file whole (dpsgd.runfiles).
`train(comm, config, out_dir)` is one real peer's side of an experiment (`config`: its dpsgd.config.RunConfig);
with `resume: true` it continues from the newest complete checkpoint in `out_dir` (and fails where there is none;
`resume: auto` starts over then) and ends with the numbers of an uninterrupted run; `summary.json`'s
`resumed_from` names the step it continued from (null for a new run); with `elastic: true` it continues from the
newest complete checkpoint of any peer count (dpsgd.elastic).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Protocol, cast

import torch

import topologies
from dpsgd import calibration, checkpoint, divergence, elastic, loggers, metrics, progress, runfiles
from dpsgd.build import Peer, Plan, build_peer
from dpsgd.comm import Communicator
from dpsgd.config import RunConfig
from dpsgd.metrics import Evaluation
from dpsgd.optim import AsynchronousOptimizer
from dpsgd.seeds import reshuffle_seed
from topologies import Topology


class Run(Protocol):
    """What the loop asks of a kind of run. `step_count` counts the steps that `log_every` and
    checkpoints refer to (global steps; an asynchronous peer's own; the simulator's peer 0's). The methods
    with a body are the defaults of a run that subclasses Run: global steps, no state of its own."""

    comm: Communicator
    plan: Plan
    topology: Topology
    step_count: int
    total_steps: int
    writer: bool  # this process writes the run's files
    test: tuple[torch.Tensor, torch.Tensor]  # the test (or validation) split, where its peers evaluate

    def train_step(self) -> float | None: ...  # the step's training loss (None: no step of ours)

    def record(self, train_loss: float, wall_s: float, evaluation: Evaluation | None) -> dict | None:
        """A progress record, with the test figures `evaluation` scores (None: none)."""
        ...

    def describe(self, config: RunConfig) -> dict:
        return describe(config, self.topology, self.comm)

    def begin(self, state: dict | None) -> None:  # restore a checkpoint's state, start the clocks
        return None

    def done(self) -> bool:
        return self.step_count >= self.total_steps

    def final(self, last: dict, train_loss: float, wall_s: float) -> dict:  # the run's last record
        return last

    def summary(self, final: dict, wall_s: float) -> dict:  # keys beyond the final record's
        return {"class_histograms": self.plan.class_histograms()}

    def state(self, extra: dict) -> dict | None:  # a checkpoint's state (None: this run keeps none)
        return None

    def diverged_blocks(self) -> dict:  # summary blocks a diverged run can still say without its peers
        return {}


def describe(config: RunConfig, topology: Topology, comm: Communicator) -> dict:
    """What the run was: the first keys of every summary.json."""
    return {
        "algorithm": config.algorithm.name,
        "topology": config.topology.name,
        "peers": comm.size,
        "backend": comm.backend,
        "dataset": config.data.name,
        "partition": config.data.partition,
        "model": config.model.name,
        "seed": config.seed,
        "evaluated_on": "validation" if config.data.validation_fraction else "test",
        "spectral_gap": float(topologies.analysis.spectral_gap(topology)),
    }


class RunLog:
    """metrics.jsonl, the target accuracy and summary.json of one run (written by one process), and the same
    records to the sinks `logger=` names (dpsgd.loggers: TensorBoard, MLflow)."""

    def __init__(self, config: RunConfig, out_dir: Path | None, resumed_step: int = 0, reached: dict | None = None):
        self.target = config.target_accuracy
        self.reached = reached or {}  # the first record at or above the target accuracy
        self.out_dir = out_dir
        self._file: runfiles.JsonLines | None = None
        self._sinks: list[loggers.Sink] = []
        if out_dir is not None:
            kept = []  # a resumed run keeps what was logged up to its checkpoint
            if resumed_step and (out_dir / "metrics.jsonl").exists():
                kept = [
                    r
                    for r in (out_dir / "metrics.jsonl").read_text().splitlines()
                    if r.strip() and json.loads(r)["step"] <= resumed_step
                ]
            self._file = runfiles.JsonLines(out_dir / "metrics.jsonl", kept)
            try:  # an earlier attempt's summary would say this run had ended
                (out_dir / "summary.json").unlink(missing_ok=True)
            except OSError as exc:
                raise runfiles.RunFileError(out_dir / "summary.json", exc, "remove") from exc
            self._sinks = loggers.open_sinks(config.logger, config.as_dict(), out_dir, resumed_step)

    def write(self, record: dict, track: bool = True) -> None:
        if track and self.target is not None and not self.reached and (record.get("test_accuracy") or 0) >= self.target:
            self.reached = {
                "steps_to_target": record["step"],
                "time_to_target_s": record["wall_time_s"],
                "emulated_time_to_target_s": record.get("emulated_time_s"),
                "samples_to_target": record["samples"],
                "mb_sent_to_target": record["mb_sent_per_peer"],
            }
        if self._file is not None:
            self._file.write(divergence.json_safe(record))
        for sink in self._sinks:
            sink.write(record)

    def summary(self, describe: dict, final: dict, extra: dict, wall_s: float) -> dict:
        emulated = final.get("emulated_time_s")
        target = {}
        if self.target is not None:
            target = {
                "target_accuracy": self.target,
                **(self.reached or {"steps_to_target": None, "time_to_target_s": None}),
            }
        summary = {
            **describe,
            "steps": final["step"],
            **{k: v for k, v in final.items() if k not in ("step", "scope")},
            "wall_time_s": wall_s,
            "emulated_s_per_step": emulated / final["step"] if emulated and final["step"] else None,
            "samples_per_s": final["samples"] / wall_s,
            **target,
            **extra,
        }
        if self._file is not None and self.out_dir is not None:
            self._file.close()
            runfiles.write_json_atomic(self.out_dir / "summary.json", divergence.json_safe(summary))
        for sink in self._sinks:
            sink.close(summary)
        return summary


def run_loop(
    run: Run, config: RunConfig, out_dir: str | Path | None, resume: dict | None = None, event: dict | None = None
) -> dict:
    """Train `run` to its end; returns the summary (every process; the writer also writes the files).
    `event`: a record written first, after those kept from before the checkpoint (an elastic world's)."""
    out_dir = Path(out_dir) if out_dir is not None else None
    state = resume or {}
    log = RunLog(config, out_dir if run.writer else None, state.get("step", 0), state.get("reached"))
    if event is not None:
        log.write(event, track=False)
    log_every, eval_every = config.log_every, config.eval_every or config.log_every
    ckpt_every = config.checkpoint.every if out_dir is not None else 0
    x_test, y_test = run.test  # records in between score a sample (eval.samples, eval.peers), the last all of it
    sampled = Evaluation.sampled(x_test, y_test, run.comm.size, config.eval.samples, config.eval.peers, config.seed)
    whole = Evaluation(x_test, y_test)
    running, seen = state.get("running", 0.0), state.get("seen", 0)
    guard = divergence.Guard(run, config.on_divergence)
    run.begin(resume)
    start = time.perf_counter() - state.get("elapsed", 0.0)
    last: dict = {}
    logged = None
    shown = progress.show(run.total_steps, run.step_count, _planned(run, config)) if run.writer else progress.Off()
    if run.writer and (unsynced := _never_combines(config, run.total_steps)):
        print(f"note: {unsynced}", file=sys.stderr, flush=True)
    status = ""
    try:
        with divergence.ending(out_dir, lambda: run.describe(config), lambda: last, run.diverged_blocks):
            while not run.done():
                loss = run.train_step()
                if loss is None:
                    continue
                guard.check(run.step_count, loss)
                running, seen = running + loss, seen + 1
                step = run.step_count
                evaluated = step % eval_every == 0 or step == run.total_steps
                if step != logged and (evaluated or step % log_every == 0):
                    logged = step
                    evaluation = (whole if step == run.total_steps else sampled) if evaluated else None
                    record = run.record(running / seen, time.perf_counter() - start, evaluation)
                    if record is not None:
                        last = record
                        log.write(record, track=record.get("scope") != "rank 0")
                        guard.check_record(record, run.plan.split.num_classes)
                        running, seen = 0.0, 0
                        if record["test_accuracy"] is not None:
                            status = f"acc {record['test_accuracy']:.3f}  loss {record['train_loss']:.3f}"
                shown.update(step, status)
                if ckpt_every and step % ckpt_every == 0 and step < run.total_steps and guard.checkpoint_ok():
                    kept = run.state(
                        {
                            "running": running,
                            "seen": seen,
                            "elapsed": time.perf_counter() - start,
                            "reached": log.reached,
                        }
                    )
                    if kept is not None and out_dir is not None:
                        checkpoint.save(run.comm, out_dir, step, kept)
    finally:
        shown.close()
    wall = time.perf_counter() - start
    # no step since the last record (an asynchronous peer may stop right after one): that record's loss
    final = run.final(last, running / seen if seen else last.get("train_loss", float("nan")), wall)
    extra = run.summary(final, wall)
    if final is not last:  # taken after training: with the totals of the summary's blocks (e.g. AD-PSGD's)
        totals = {
            key: {k: v for k, v in block.items() if not k.endswith("_per_peer")}
            for key, block in extra.items()
            if isinstance(block, dict)
        }
        log.write({**final, **totals}, track=False)
    resumed_from = state.get("step") if resume else None  # the checkpoint's step (dpsgd.checkpoint), or a new run
    return log.summary(
        run.describe(config),
        final,
        {**extra, **guard.summary(), "resumed_from": resumed_from},
        max(wall, final["wall_time_s"]),
    )


def _planned(run: Run, config: RunConfig) -> str:
    """What the planned steps are, for the progress display's first line."""
    plan = run.plan
    per_epoch = f"{plan.steps_per_epoch:,} steps of {plan.batch_size} samples"
    return f"{run.comm.size} peers, {config.epochs:,} epochs of {per_epoch}"


def _never_combines(config: RunConfig, total_steps: int) -> str | None:
    """A periodic algorithm whose period is longer than the run: its peers train alone, and a comparison would
    credit their independent models to the algorithm. None where the run combines at least once."""
    period = config.algorithm.options.get("period")
    if isinstance(period, int) and not isinstance(period, bool) and period > total_steps:
        return (
            f"algorithm.period={period} is more than the run's {total_steps} steps: its peers never combine their "
            "models; give more epochs or a smaller algorithm.period"
        )
    return None


# --- real peers ---------------------------------------------------------------------------------
class SynchronousRun(Run):
    """One real peer taking global steps; every record is taken with collectives over all peers."""

    def __init__(self, peer: Peer, comm: Communicator, writer: bool):
        self.peer, self.comm, self.writer, self.plan, self.topology = peer, comm, writer, peer.plan, peer.topology
        self.test = peer.x_test, peer.y_test
        self.step_count, self.total_steps = 0, peer.plan.total_steps
        self.samples = 0  # by all peers: a step takes batch_size from each peer of the world of that time

    def describe(self, config: RunConfig) -> dict:
        words = calibration.compute_words(config)  # what the emulated clock takes as each step's compute
        return {**describe(config, self.topology, self.comm), **({"emulated_compute": words} if words else {})}

    def begin(self, state: dict | None) -> None:
        peer = self.peer
        if state:
            peer.model.load_state_dict(state["model"])
            peer.optimizer.load_state_dict(state["optimizer"])
            self.step_count = state["step"]
            if "batches" in state:
                peer.batches.load_state_dict(state["batches"])
            else:  # an elastic world of another size: a new share
                peer.batches.reshuffle(reshuffle_seed(peer.seed, self.comm.rank, self.step_count))
            self.samples = state.get("samples", self.step_count * peer.batches.batch_size * self.comm.size)
            if "elastic_from" in state:  # the steps left to the run's budget of samples, at this world's size
                left = max(0, peer.plan.total_samples - self.samples)
                self.total_steps = self.step_count + math.ceil(left / (peer.batches.batch_size * self.comm.size))
            for key, value in state["comm_stats"].items():
                setattr(self.comm.stats, key, value)
            peer.stepper.load_state_dict(state.get("stepper") or {})
        self.comm.barrier()  # start the clock together
        peer.network.clock.reset((state or {}).get("emulated_time_s", 0.0))

    def train_step(self) -> float:
        self.step_count += 1
        self.samples += self.peer.batches.batch_size * self.comm.size
        self.comm.context = f"step {self.step_count}"
        sent = self.comm.stats.bytes_sent
        loss = float(self.peer.step(self.step_count))
        stats = self.comm.stats
        stats.peak_step_bytes = max(stats.peak_step_bytes, stats.bytes_sent - sent)
        return loss

    def record(self, train_loss: float, wall_s: float, evaluation: Evaluation | None) -> dict | None:
        self.comm.context = f"metrics at step {self.step_count}"
        peer = self.peer
        with peer.network.clock.paused():  # evaluating is not training: off the emulated clock (sleep mode)
            measured = metrics.measure_peers(self.comm, peer.model, evaluation, train_loss, peer.plan.split.optimum)
        if measured["emulated_time_s"] is not None:  # every peer waited there for the latest one
            peer.network.clock.catch_up(measured["emulated_time_s"])
        return metrics.record(
            step=self.step_count,
            epoch=peer.plan.epoch(self.samples),
            samples=self.samples,
            wall_time_s=wall_s,
            lr=peer.stepper.lr,
            scope="all peers",
            **measured,
        )

    def state(self, extra: dict) -> dict | None:
        peer = self.peer
        return {
            "step": self.step_count,
            "samples": self.samples,
            "model": peer.model.state_dict(),
            "optimizer": peer.optimizer.state_dict(),
            "batches": peer.batches.state_dict(),
            "stepper": peer.stepper.state_dict(),
            "comm_stats": self.comm.stats.as_dict(),
            "emulated_time_s": peer.network.clock.elapsed(),
            **extra,
        }


class AsynchronousRun(SynchronousRun):
    """One real peer of an asynchronous optimizer: it steps at its own pace until its share of the budget
    (the synchronous run's samples, steps or `algorithm.seconds`) is spent. No collective runs while peers
    train, so rank 0 records its own view; the final record is taken with collectives once all finished."""

    def __init__(self, peer: Peer, comm: Communicator, writer: bool):
        super().__init__(peer, comm, writer)
        self.opt = cast(AsynchronousOptimizer, peer.optimizer)
        self.rows: list[dict] = []  # every peer's measurements, once finished
        self.opt.set_budget(
            steps=peer.plan.total_steps,
            samples=peer.plan.total_steps * peer.batches.batch_size * comm.size,
            samples_per_step=peer.batches.batch_size,
        )

    def begin(self, state: dict | None) -> None:
        super().begin(state)  # x_i, the counters and the generators come with the optimizer's state
        self.opt.start()

    def done(self) -> bool:
        try:
            return self.opt.should_stop()
        except BaseException:
            self.opt.abort()
            raise

    def train_step(self) -> float:
        self.comm.context = f"step {self.opt.step_count + 1}"
        try:
            loss = float(self.peer.step(self.opt.step_count + 1))
        except BaseException:
            self.opt.abort()
            raise
        self.step_count = self.opt.step_count
        self.samples = self.step_count * self.peer.batches.batch_size * self.comm.size  # estimated, as in records
        return loss

    def record(self, train_loss: float, wall_s: float, evaluation: Evaluation | None) -> dict | None:
        if not self.writer:
            return None
        peer, optimum = self.peer, self.peer.plan.split.optimum
        tested: dict = {"test_loss": None, "test_accuracy": None}
        if evaluation is not None:
            x, y = evaluation.x, evaluation.y
            loss, correct, count = metrics.evaluate(peer.model, dict(peer.model.named_parameters()), x, y)
            tested = {
                "test_loss": loss / count,
                "test_accuracy": correct / count,
                **metrics.language_metrics(loss / count, y),
            }
        own = [p.detach() for p in peer.model.parameters()]
        return metrics.record(  # rank 0's own model: the average needs collectives
            step=self.step_count,
            epoch=peer.plan.epoch(self.samples),
            samples=self.samples,  # estimated: peers run at their own pace
            wall_time_s=wall_s,
            emulated_time_s=peer.network.clock.elapsed() if peer.network.active else None,
            train_loss=train_loss,
            **tested,
            **metrics.optimum_distances(own, metrics.squared_optimum_distances(own, optimum), optimum),
            lr=peer.stepper.lr,
            scope="rank 0",
        )

    def final(self, last: dict, train_loss: float, wall_s: float) -> dict:
        finishing = time.perf_counter()
        try:
            self.opt.finish()
        except BaseException:
            self.opt.abort()
            raise
        wall_own = wall_s + time.perf_counter() - finishing
        self.comm.context = "final metrics"
        comm, peer = self.comm, self.peer
        mine = {**self.opt.measurements(), "slowdown_s": peer.network.slowdown.slept_s, "wall_s": wall_own}
        self.rows = metrics.gather_objects(comm, mine)
        steps, samples = [r["steps"] for r in self.rows], [r["samples"] for r in self.rows]
        whole = Evaluation(peer.x_test, peer.y_test)
        measured = metrics.measure_peers(comm, peer.model, whole, train_loss, peer.plan.split.optimum)
        return metrics.record(
            step=round(sum(steps) / comm.size),
            epoch=peer.plan.epoch(sum(samples)),
            samples=int(sum(samples)),
            wall_time_s=max(r["wall_s"] for r in self.rows),  # until its last peer stopped
            **{**measured, "peak_mb_sent_per_step": None},  # no global step to count it in
            lr=peer.stepper.lr,
            scope="all peers",
        )

    def summary(self, final: dict, wall_s: float) -> dict:
        block = self.opt.summary([{k: v for k, v in r.items() if k != "wall_s"} for r in self.rows])
        return {self.opt.summary_key: block, **super().summary(final, wall_s)}

    def state(self, extra: dict) -> dict | None:
        """With a steps budget every peer reaches each checkpoint step (experiments.validate refuses the
        others): wait for this peer's averaging in flight, then for every peer's (barrier), so that no
        exchange is half done and the saved x_i conserve the sum of the models."""
        if self.opt.budget != "steps":
            return None
        self.opt.settle()
        self.comm.context = f"checkpoint at step {self.step_count}"
        self.comm.barrier()
        return super().state(extra)


def train(comm: Communicator, config: RunConfig, out_dir: str | Path | None = None) -> dict:
    """One real peer's side of the experiment `config`; rank 0 writes the run's files to `out_dir`."""
    if config.elastic:
        elastic.check_world(config.topology, comm.size)
    config = calibration.resolved(config)  # the app's driver resolved it already; a library user's run here
    peer = build_peer(comm, config)
    writer = out_dir is not None and comm.rank == 0
    asynchronous = getattr(peer.optimizer, "asynchronous", False)
    run = (AsynchronousRun if asynchronous else SynchronousRun)(peer, comm, writer)
    state, event = None, None
    if config.elastic and out_dir is not None:
        state = elastic.resume_state(Path(out_dir), comm.rank, comm.size)
        if state is not None and writer:
            event = elastic.membership_record(Path(out_dir), state["step"], comm.size, state["elastic_from"])
    elif config.resume and out_dir is not None:
        state = checkpoint.load_latest(Path(out_dir), comm.rank, comm.size)
        if state is None and config.resume is True:  # resume=auto starts over; the app said which (experiments.train)
            raise RuntimeError(
                f"resume=true, but {out_dir} holds no complete checkpoint of {comm.size} peers; pass resume=auto to "
                "start over when there is none"
            )
    return run_loop(run, config, out_dir, state, event)
