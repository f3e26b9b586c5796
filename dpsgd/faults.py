"""Fault injection, driven by the config's `faults:` block (commands: docs/guide/reliability.md): a peer that
dies (`kill_peer`, with `kill_mode` exit: SIGKILL, no message, or hang), one that is slow (`delay_peer`,
`delay_s` before each step), and messages lost on the `local` backend (`drop_messages`, seeded), each from
`faults.at_step` on; and peers that send corrupted values in every mix and mean from the first exchange
(`corrupt_peer`, `corrupt_mode`, `corrupt_scale`: dpsgd.comm.corrupt, on every backend, the fleet included).
The training loops call `FaultInjector.before_step(step)` at the start of each step; nothing happens when no
fault is set.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from dpsgd.comm import transport
from dpsgd.comm.corrupt import MODES as CORRUPT_MODES
from dpsgd.comm.corrupt import mode_name
from dpsgd.comm.transport import Transport
from dpsgd.config import FaultsConfig
from dpsgd.seeds import message_loss_seed

KILL_MODES = ("exit", "hang")


class InjectedFault(RuntimeError):
    """A peer of the `local` backend ended by `faults.kill_peer` (a thread cannot be killed, so it
    raises this, and its world stops the other peers as it would for any failed peer)."""


@dataclass(frozen=True)
class FaultPlan:
    """What to inject, checked against the world it is injected into."""

    kill_peer: int | None = None
    kill_mode: str = "exit"
    at_step: int = 1
    delay_peer: int | None = None
    delay_s: float = 0.0
    drop_messages: float = 0.0
    corrupt_peer: int | list[int] | None = None  # rank(s) that send corrupted values (dpsgd.comm.corrupt)
    corrupt_mode: str = "scale"
    corrupt_scale: float | None = None

    @property
    def corrupt_peers(self) -> list[int]:
        peers = self.corrupt_peer
        return [] if peers is None else [peers] if not isinstance(peers, list | tuple) else list(peers)

    @classmethod
    def from_config(cls, section: FaultsConfig | Mapping | None, peers: int, backend: Transport) -> FaultPlan:
        """The plan of a config's `faults:` section (or a mapping of its keys) for peers of `backend` (its record:
        dpsgd.backends.get or dpsgd.comm.transport.get); ValueError (one line: what, and how to fix) if invalid."""
        section = dataclasses.asdict(section) if isinstance(section, FaultsConfig) else dict(section or {})
        unknown = sorted(set(section) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"unknown faults option(s) {unknown}; valid: {', '.join(cls.__dataclass_fields__)}")
        if "corrupt_mode" in section:
            section["corrupt_mode"] = mode_name(section["corrupt_mode"])
        plan = cls(**{k: v for k, v in section.items() if v is not None or k.endswith("_peer")})
        for key in ("kill_peer", "delay_peer"):
            rank = getattr(plan, key)
            if rank is not None and (not _is_number(rank, whole=True) or not 0 <= rank < peers):
                raise ValueError(f"faults.{key} must be a peer rank in [0, {peers}) or null, got {rank!r}")
        for rank in plan.corrupt_peers:
            if not _is_number(rank, whole=True) or not 0 <= rank < peers:
                raise ValueError(
                    f"faults.corrupt_peer must be a peer rank in [0, {peers}), a list of them, or null, got "
                    f"{plan.corrupt_peer!r}"
                )
        if len(set(plan.corrupt_peers)) >= max(peers, 1):
            raise ValueError(f"faults.corrupt_peer names every one of the {peers} peers; leave at least one honest")
        if plan.corrupt_mode not in CORRUPT_MODES:
            raise ValueError(
                f"faults.corrupt_mode must be one of {', '.join(CORRUPT_MODES)}, got {plan.corrupt_mode!r}"
            )
        if plan.corrupt_scale is not None and not _is_number(plan.corrupt_scale):
            raise ValueError(
                f"faults.corrupt_scale must be a number or null (the mode's default), got {plan.corrupt_scale!r}"
            )
        if plan.kill_mode not in KILL_MODES:
            raise ValueError(f"faults.kill_mode must be one of {', '.join(KILL_MODES)}, got {plan.kill_mode!r}")
        if not _is_number(plan.at_step, whole=True) or plan.at_step < 1:
            raise ValueError(f"faults.at_step must be an integer >= 1, got {plan.at_step!r}")
        if not _is_number(plan.delay_s) or plan.delay_s < 0:
            raise ValueError(f"faults.delay_s must be a number of seconds >= 0, got {plan.delay_s!r}")
        if not _is_number(plan.drop_messages) or not 0 <= plan.drop_messages <= 1:
            raise ValueError(f"faults.drop_messages must be a fraction in [0, 1], got {plan.drop_messages!r}")
        if plan.kill_peer is not None or plan.delay_peer is not None or plan.drop_messages:
            if not backend.real_peers:
                raise ValueError(
                    f"faults need real peers and backend={backend.name} simulates them; "
                    f"use backend={transport.having('real_peers')}"
                )
            if plan.drop_messages and not backend.threads:
                raise ValueError(
                    f"faults.drop_messages works on backend={transport.having('threads')} only (got "
                    f"backend={backend.name}); on processes, kill or hang a peer instead (faults.kill_peer)"
                )
        return plan


class FaultInjector:
    """One peer's side of a FaultPlan."""

    def __init__(self, plan: FaultPlan, comm, seed: int = 0):
        self.plan, self.comm, self.step = plan, comm, 0
        self._rng = random.Random(message_loss_seed(seed, comm.rank))
        if plan.drop_messages:
            comm.drop_message = self._drop

    @classmethod
    def from_config(cls, faults: FaultsConfig, comm, seed: int) -> FaultInjector:
        plan = FaultPlan.from_config(faults, comm.size, transport.get(comm.backend))
        return cls(plan, comm, seed)

    def before_step(self, step: int) -> None:
        self.step = step
        plan, rank = self.plan, self.comm.rank
        if step < plan.at_step:
            return
        if plan.delay_peer == rank and plan.delay_s:
            time.sleep(plan.delay_s)
        if plan.kill_peer == rank and step == plan.at_step:
            self._kill(step)

    def _drop(self, peer: int) -> bool:
        return self.step >= self.plan.at_step and self._rng.random() < self.plan.drop_messages

    def _kill(self, step: int) -> None:
        rank, thread = self.comm.rank, transport.get(self.comm.backend).threads  # a thread cannot be killed
        what = "exited" if self.plan.kill_mode == "exit" else "hung"
        message = (
            f"peer {rank} {what} at step {step} (injected by faults.kill_peer={rank}, "
            f"faults.at_step={self.plan.at_step}, faults.kill_mode={self.plan.kill_mode})"
        )
        if self.plan.kill_mode == "exit" and thread:
            raise InjectedFault(message)
        if not thread:
            print(f"fault: {message}", file=sys.stderr, flush=True)  # the last line of this peer's log
        if self.plan.kill_mode == "exit":
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would: no handler, no message
        while True:  # hang: answer nothing until the launcher (or, for a thread, the failed world) stops us
            if thread:
                self.comm.world.check(rank, f"hang injected at step {step}")
            time.sleep(0.05)


def _is_number(value, whole: bool = False) -> bool:
    return isinstance(value, int if whole else (int, float)) and not isinstance(value, bool)
