"""The hierarchical variant of asynchronous Local-SGD (in the spirit of HALoS, Kim et al. 2025, arXiv 2506.04531): the
peers split into G contiguous groups; each group's first rank holds a local server (`GroupServer`) that applies its
workers' outer gradients with its own outer optimizer and every K local merges pushes the group's accumulated
delta to the global merger (rank 0), adopting the global model it answers with. The rule only, no communication:
AsyncLocalSGD (`groups: G`) carries the messages. Equations: AsyncLocalSGD's docstring and docs/guide/algorithms.md.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LocalMerger(Protocol):
    """What a group's server (and AsyncLocalSGD through it) reads of its local merger: async_local_sgd.Merger, which
    imports this module."""

    x: torch.Tensor
    merges: int
    done: set[int]
    useful_steps: int
    useful_samples: int

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def group_of(rank: int, n: int, groups: int) -> tuple[int, int, range]:
    """Peer `rank`'s group index, its leader (the group's first rank) and its members: G contiguous groups of n / G."""
    size = n // groups
    g = rank // size
    return g, g * size, range(g * size, (g + 1) * size)


class GroupServer:
    """A group's local server: `merger` (a Merger over the group's workers: the group model y, its local outer
    optimizer) and the group's side of the exchange with the global merger. `anchor` is y as last agreed with the
    global merger, so y - anchor is the local progress not yet pushed:

        every K local merges (and once more when the group's workers are done), with no push in flight:
            D_g = anchor - y;  y_sent = y;  anchor <- y            (push D_g to the global merger)
        the global model x (after its update with D_g) comes back:
            y <- x + (y - y_sent);  anchor <- x                     (keep the local merges made in flight)
    """

    def __init__(self, merger: LocalMerger, every: int, members: range):
        self.merger, self.every, self.members = merger, int(every), members
        self.anchor = merger.x.clone()
        self.sent: torch.Tensor | None = None  # y at the push in flight (None: none in flight)
        self.merges_at_push = 0  # the local merger's merges at the last push
        self.global_version = 0  # the global model's version this group last adopted
        self.pushes = 0

    @property
    def finished(self) -> bool:
        """Every worker of the group is done (each said DONE, the leader's own worker at its last push)."""
        return set(self.members) <= self.merger.done

    def due(self) -> bool:
        """A push to the global merger is due: none in flight, and K local merges since the last (or the group is
        finished with merges not yet pushed)."""
        if self.sent is not None:
            return False
        since = self.merger.merges - self.merges_at_push
        return since >= self.every or (self.finished and since > 0)

    def take_push(self) -> torch.Tensor:
        """The group delta D_g = anchor - y, the push now in flight."""
        y = self.merger.x
        delta = self.anchor - y
        self.sent = y.clone()
        self.anchor.copy_(y)
        self.merges_at_push = self.merger.merges
        self.pushes += 1
        return delta

    def adopt(self, x: torch.Tensor, version: int) -> None:
        """The global model x answers the push in flight: y <- x + (y - y_sent), anchor <- x."""
        assert self.sent is not None, "a global model came with no push in flight"
        y = self.merger.x
        y.sub_(self.sent).add_(x)
        self.anchor.copy_(x)
        self.sent = None
        self.global_version = int(version)

    def state_dict(self) -> dict:
        return {
            "merger": self.merger.state_dict(),
            "anchor": self.anchor.clone(),
            "sent": None if self.sent is None else self.sent.clone(),
            "counters": [self.merges_at_push, self.global_version, self.pushes],
        }

    def load_state_dict(self, state: dict) -> None:
        self.merger.load_state_dict(state["merger"])
        self.anchor.copy_(state["anchor"])
        self.sent = None if state["sent"] is None else state["sent"].clone()
        self.merges_at_push, self.global_version, self.pushes = (int(c) for c in state["counters"])
