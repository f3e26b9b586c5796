"""What ends an AD-PSGD run, which has no global step: `steps` per peer, wall-clock `seconds`, or a total
of `samples` across peers.

How it works: docs/guide/internals.md#adpsgd-budget.
"""

from __future__ import annotations

import threading

import torch

from dpsgd.comm import PeerTimeoutError
from dpsgd.comm.pending import Request

from .averaging import receive_any

BUDGETS = ("steps", "samples", "seconds")
TAG_PROGRESS, TAG_ANSWER = 13, 14


def check_budget(kind: str, who: str = "ADPSGD") -> str:
    """`kind` if it is one of BUDGETS (steps, samples, seconds); a ValueError naming them otherwise."""
    if kind not in BUDGETS:
        raise ValueError(f"{who} budget must be one of {BUDGETS}, got {kind!r}")
    return kind


class Budget:
    """The budget named `opt.budget` and the amounts `set` gives (only that one ends the run). The main
    thread waits with `opt._wait` (bounded, naming what it awaited); the coordinator thread ends early
    once `opt._abort` is set."""

    def __init__(self, opt, seconds: float | None):  # opt: the ADPSGD (whose module imports this one)
        self.opt, self.kind, self.comm = opt, check_budget(opt.budget, type(opt).__name__), opt.comm
        self.amounts: dict[str, float | None] = {"steps": None, "samples": None, "seconds": None}
        self.set(seconds=seconds)
        # a simulator's world (dpsgd.sim.events) shares every peer's samples here, read at once
        self.tally: dict[int, int] | None = getattr(self.comm, "tally", None)
        # collective and in the same order on every peer: every peer makes the same duplicates
        shared = self.comm.size > 1 and self.kind == "samples" and self.tally is None
        self.control = self.comm.duplicate() if shared else None
        self.coordinating = self.control is not None and self.comm.rank == 0
        self.stop = threading.Event()  # the shared samples budget is spent (rank 0: by its coordinator)
        # (request, buffer, send) of the coordinator's answer to our last report
        self._answer: tuple[Request, torch.Tensor, Request] | None = None

    def set(self, **amounts: float | None) -> None:
        for kind, amount in amounts.items():
            if amount is not None:
                self.amounts[kind] = float(amount) if kind == "seconds" else int(amount)

    def require(self) -> None:
        if self.amounts[self.kind] is None:
            name = type(self.opt).__name__
            raise ValueError(f"{name}(budget={self.kind!r}) needs set_budget({self.kind}=...) before training")

    def spent(self, steps: int, samples: int, seconds: float) -> bool:
        """True once this peer's share is spent (never blocks)."""
        self.require()
        if self.control is not None:
            return self.stop.is_set()
        amount = self.amounts[self.kind]
        assert amount is not None  # require() said so
        if self.tally is not None and self.kind == "samples":
            return sum(self.tally.values()) >= amount
        return {"steps": steps, "samples": samples, "seconds": seconds}[self.kind] >= amount

    # --- the shared samples budget: the main thread's side -------------------------------------------
    def report(self, samples: int, final: bool) -> None:
        """After each step (`final`: at the end). Rank 0 counts in-process; the others send [rank,
        samples, final] and read the answer to their previous report first."""
        if self.tally is not None:
            self.tally[self.comm.rank] = samples
        control = self.control
        if control is None:
            return
        if self.comm.rank == 0:  # the coordinator reads opt.samples
            if final:
                self.stop.set()
            return
        self._read_answer()
        msg = torch.tensor([float(self.comm.rank), float(samples), 1.0 if final else 0.0], dtype=torch.float64)
        send = control.start_send(msg, 0, TAG_PROGRESS)
        answer = torch.zeros(1, dtype=torch.float64)
        self._answer = (control.start_recv(answer, 0, TAG_ANSWER), answer, send)
        if final:
            self._read_answer()

    def _read_answer(self) -> None:
        if self._answer is None:
            return
        request, answer, send = self._answer
        self.opt._wait(
            lambda: send.test() and request.test(),
            "coordinator (rank 0) did not answer",
            "; it died or hangs (raise comm.timeout_s if it is slow)",
        )
        self._answer = None
        if answer.item() > 0:
            self.stop.set()

    # --- rank 0's coordinator thread ----------------------------------------------------------------
    def coordinate(self) -> None:
        """Add up every peer's samples, answer each report with go on / stop, and end once every other
        peer sent its final report."""
        control, n, timeout_s, budget = self.control, self.comm.size, self.comm.timeout_s, self.amounts["samples"]
        assert control is not None and budget is not None  # the coordinator runs for a samples budget only
        reported = {p: 0.0 for p in range(1, n)}
        final: set[int] = set()
        msg = torch.zeros(3, dtype=torch.float64)
        while len(final) < n - 1:
            senders = f"peer(s) {sorted(set(reported) - final)}"
            listener = f"rank 0: {self.opt.label}'s coordinator"
            try:
                heard = receive_any(control, msg, TAG_PROGRESS, timeout_s, self.opt._abort.is_set, listener, senders)
            except PeerTimeoutError:
                if not getattr(self.opt, "carries_on", False):
                    raise
                self.stop.set()  # the algorithm goes on without silent peers (a quorum merge): the budget ends here
                return
            if not heard:
                return
            sender = int(msg[0].item())
            reported[sender] = max(reported[sender], msg[1].item())
            if msg[2].item() > 0:
                final.add(sender)
            if sum(reported.values()) + self.opt.samples >= budget:
                self.stop.set()
            answer = torch.tensor([1.0 if self.stop.is_set() else 0.0], dtype=torch.float64)
            send = control.start_send(answer, sender, TAG_ANSWER)
            control.wait_request(f"{self.opt.label} coordinator answer", send, [sender])
