"""Divergence: a run whose loss or parameters stop being finite or explode, or that does not learn, is caught on the
step (or record) it happens.

`Guard(run, mode)` watches one kind of run of dpsgd.training (a real peer, the fleet, the event simulator): after
every step it checks the step's loss and the norm of the parameters this process holds (one fused reduction;
on the fleet, one norm per peer), and it asks the communicator whether a message received this step held
non-finite values (dpsgd.comm.robust checks what it receives and names the sender). The thresholds:
- diverged: a loss or parameters not finite; a parameter norm above MAX_NORM; a training loss more than BLOWUP
  times the run's first step's after the first WARMUP_STEPS steps (a learning rate far too large: the loss explodes
  without ever leaving the floats);
- not learning: after NOT_LEARNING_EPOCHS epochs, a record whose averaged model's test accuracy is at most CHANCE
  times chance (1 / classes; classification only).
`on_divergence` says what follows: `stop` (default) raises `Diverged` (`NotLearning`), one line naming the first
peer (or the averaged model) and the step; `mark` keeps training and the run's summary says `status: diverged`
(`not_learning`) with that peer and step. Every summary says `status` (`ok`, `diverged` or `not_learning`). A
diverged peer never saves a checkpoint: its own state is checked every step, and under `mark` the peers agree
before each checkpoint (one collective of one number) and save none once any diverged.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from pathlib import Path

import torch

from dpsgd import runfiles

MODES = ("stop", "mark")
MAX_NORM = 1e15  # a parameter vector this long has exploded (float32 squares overflow near 1.8e19 anyway)
BLOWUP = 10.0  # a training loss this many times the first step's has exploded ...
WARMUP_STEPS = 2  # ... once this many steps are taken (the first steps of a stable run may rise a little)
NOT_LEARNING_EPOCHS = 5.0  # epochs after which an averaged model at chance is not learning
CHANCE = 1.5  # ... at most this many times chance accuracy (1 / classes): 0.15 for 10 classes
WAIT_S = 5.0  # how long a peer that did not claim a divergence waits for the summary of the one that did
CLAIM = "diverged.json"  # in RUN_DIR/logs: the first peer to stop a run names it there, so every line agrees


class Diverged(RuntimeError):
    """A peer's loss or parameters stopped being finite; the message is the one line for the user."""

    def __init__(self, peer: int, step: int, what: str):
        self.peer, self.step, self.what = peer, step, what
        super().__init__(
            f"peer {peer} diverged at step {step}: {what} (on_divergence=mark keeps training and marks the run)"
        )

    status = "diverged"

    def as_dict(self) -> dict:
        return {"peer": self.peer, "step": self.step, "what": self.what}


class NotLearning(Diverged):
    """The averaged model is still at chance after NOT_LEARNING_EPOCHS epochs; `peer` is None (every peer's model)."""

    status = "not_learning"

    def __init__(self, step: int, what: str):
        self.peer, self.step, self.what = None, step, what  # type: ignore[assignment]
        RuntimeError.__init__(
            self, f"not learning at step {step}: {what} (on_divergence=mark keeps training and marks the run)"
        )


def not_learning(record: dict, classes: int) -> str | None:
    """What says a run whose record is `record` is not learning (None: it is, or it is too early to say)."""
    accuracy, epoch = record.get("test_accuracy"), record.get("epoch")
    if classes < 2 or accuracy is None or epoch is None or epoch < NOT_LEARNING_EPOCHS:
        return None
    if accuracy <= CHANCE / classes:
        return (
            f"the averaged model's test accuracy {accuracy:.3f} is at chance ({1 / classes:.3g} for {classes} "
            f"classes) after {epoch:.3g} epochs (dpsgd.divergence: at most {CHANCE:g}x chance after "
            f"{NOT_LEARNING_EPOCHS:g} epochs)"
        )
    return None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"on_divergence must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def problem(loss: float | None, norm: float | None) -> str | None:
    """What is wrong with a peer whose step had `loss` and whose parameters have `norm` (None: fine)."""
    if norm is not None and not math.isfinite(norm):
        return "its parameters are not finite" if math.isnan(norm) else "its parameters overflowed (norm inf)"
    if norm is not None and norm > MAX_NORM:
        return f"its parameter norm {norm:.3g} exceeds {MAX_NORM:g} (exploding)"
    if loss is not None and not math.isfinite(loss):
        return f"its training loss is {loss}"
    return None


def norms(params: list[torch.Tensor], peers: int | None = None) -> torch.Tensor:
    """The norm of all of `params` (with `peers`: of each peer's slice of the leading peer axis), float32 as stored."""
    with torch.no_grad():
        if peers is None:
            return torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.detach() for p in params])))
        rows = [torch.linalg.vector_norm(p.detach().reshape(peers, -1), dim=1) for p in params]
        return torch.linalg.vector_norm(torch.stack(rows, 1), dim=1)


def json_safe(value):
    """`value` with every non-finite float as None: what strict JSON readers accept (records after a divergence)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value


class Guard:
    """The divergence check of one run (see the module)."""

    def __init__(self, run, mode: str = "stop"):
        self.mode = check_mode(mode)
        self.run = run
        self.first: Diverged | None = None  # this process's first divergence (mark)
        self._params, self._peers, self._rank, self._comm = self._watched(run)
        self._sim = getattr(run, "sim", None)  # the event simulator: every peer's live x, once per step of peer 0
        self._checked = -1
        self._start: float | None = None  # the first step's training loss

    @staticmethod
    def _watched(run):
        """(parameters, peer count of a peer axis or None, this peer's rank, the algorithm's communicator)."""
        peer, fleet = getattr(run, "peer", None), getattr(run, "fleet", None)
        if peer is not None:
            return list(peer.model.parameters()), None, run.comm.rank, getattr(peer.optimizer, "comm", None)
        if fleet is not None:
            return list(fleet.params), fleet.n, 0, getattr(fleet.algorithm, "comm", None)
        return [], None, 0, None  # the event simulator: its peers' losses, and their live x (below)

    def check(self, step: int, loss: float) -> None:
        """After step `step` (whose mean training loss over this process's peers was `loss`)."""
        if self.first is not None:
            return  # marked already: the rest of the run is not checked again
        found = self._find(step, loss) or self._exploded(step, loss)
        if found is not None:
            self._found(found)

    def check_record(self, record: dict, classes: int) -> None:
        """After a record of every peer's models (not an asynchronous run's rank-0 view): is the run learning?"""
        what = None if self.first is not None or record.get("scope") == "rank 0" else not_learning(record, classes)
        if what is not None:
            self._found(NotLearning(record["step"], what))

    def _found(self, found: Diverged) -> None:
        if self.mode == "stop":
            raise found
        self.first = found

    def _exploded(self, step: int, loss: float) -> Diverged | None:
        """A training loss more than BLOWUP times the first step's, after WARMUP_STEPS steps."""
        if self._start is None:
            self._start = loss if math.isfinite(loss) else None
            return None
        if step <= WARMUP_STEPS or not self._start > 0 or not loss > BLOWUP * self._start:
            return None
        what = f"its training loss {loss:.4g} is more than {BLOWUP:g}x its first step's {self._start:.4g} (exploding)"
        return Diverged(self._rank, step, what if self._peers is None else what.replace("its", "the mean", 1))

    def _find(self, step: int, loss: float) -> Diverged | None:
        sender = getattr(self._comm, "nonfinite_from", None)
        if sender is not None:  # (sender, receiver): a neighbour's message, named as that neighbour's
            return Diverged(sender[0], step, f"it sent non-finite values (received by peer {sender[1]})")
        if self._sim is not None and step != self._checked:
            self._checked = step
            rows = torch.linalg.vector_norm(self._sim.live, dim=1)  # (n, D): as many entries as n events step
            bad = [(peer, what) for peer, value in enumerate(rows.tolist()) if (what := problem(None, value))]
            if bad:
                return Diverged(bad[0][0], step, bad[0][1])
        if not self._params:
            what = problem(loss, None)
            return None if what is None else Diverged(self._rank, step, what)
        norm = norms(self._params, self._peers)
        if self._peers is None:
            what = problem(loss, float(norm))
            return None if what is None else Diverged(self._rank, step, what)
        for peer, value in enumerate(norm.tolist()):  # the first peer of the fleet whose parameters went wrong
            what = problem(None, value)
            if what is not None:
                return Diverged(peer, step, what)
        what = problem(loss, None)
        return None if what is None else Diverged(0, step, what.replace("its training loss", "the mean training loss"))

    def _collective(self) -> bool:
        comm = self.run.comm
        return self._peers is None and self._params != [] and comm.size > 1

    def checkpoint_ok(self) -> bool:
        """Whether every peer may save now (a collective under `mark` with real peers: all call it at the step)."""
        if self.mode == "stop" or not self._collective():
            return self.first is None
        return not self.run.comm.any_peer(self.first is not None, self._params[0].device)

    def summary(self) -> dict:
        """The summary's `status` and, when diverged, which peer first and at which step (a collective with real
        peers under `mark`: every peer calls it once, after training)."""
        first = {**self.first.as_dict(), "status": self.first.status} if self.first is not None else None
        if self.mode == "mark" and self._collective():
            from dpsgd.metrics import gather_objects

            with self.run.comm.uncounted():
                found = [f for f in gather_objects(self.run.comm, first) if f is not None]
            first = min(found, key=lambda f: (f["step"], -1 if f["peer"] is None else f["peer"])) if found else None
        if first is None:
            return {"status": "ok"}
        status = first.pop("status")
        return {"status": status, "diverged": first}


def claim(out_dir: Path | None, exc: Diverged, summary: dict) -> Diverged:
    """The divergence that names the run: the first one any peer of it claimed (in RUN_DIR/logs), so that every
    peer's line and the summary agree. The claiming peer writes `summary` as the run's summary.json; the others
    wait (a few seconds at most) until it is there, since their exit may end the claiming peer's process."""
    if out_dir is None:
        return exc
    logs = Path(out_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(logs / CLAIM, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        deadline = time.monotonic() + WAIT_S
        while not (Path(out_dir) / "summary.json").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            first = json.loads((logs / CLAIM).read_text())
            if first["peer"] is None:
                return NotLearning(first["step"], first["what"])
            return Diverged(first["peer"], first["step"], first["what"])
        except (OSError, ValueError, KeyError):  # the claiming peer died while writing it
            return exc
    with os.fdopen(fd, "w") as fh:
        json.dump(exc.as_dict(), fh)
    runfiles.write_json_atomic(Path(out_dir) / "summary.json", json_safe(summary))
    return exc


def summary(exc: Diverged, describe: dict, last: dict, blocks: dict | None = None) -> dict:
    """summary.json of a run that `stop` ended: what it was, its last record, the blocks its run could still say
    (e.g. the event simulator's asynchronous figures), `status: diverged`."""
    return {
        **describe,
        **{k: v for k, v in last.items() if k not in ("step", "scope")},
        **(blocks or {}),
        "steps": exc.step,
        "status": exc.status,
        "diverged": exc.as_dict(),
    }


@contextlib.contextmanager
def ending(out_dir: str | Path | None, describe, last, blocks=dict):
    """Around a run's loop: a `Diverged` leaving it is claimed (`claim`, with the summary from `describe()`, the
    last record `last()` and `blocks()`, what the run can say without its peers), and the claimed one is raised."""
    try:
        yield
    except Diverged as exc:
        try:
            said = blocks()
        except Exception as why:  # a diverged run's figures may not compute: the summary names the divergence anyway
            said = {"blocks_error": f"{type(why).__name__}: {why}"}
        run_summary = summary(exc, describe(), last(), said)
        raise claim(Path(out_dir) if out_dir is not None else None, exc, run_summary) from None
