"""NoLoCo, no-all-reduce low-communication training (Kolehmainen et al. 2025, arXiv 2506.10911): see `NoLoCo`."""

from __future__ import annotations

import functools

import numpy as np
import torch

from topologies import Topology

from .base import DistributedOptimizer
from .outer import OuterOptimizer, factory, saved_outer

# the reference's outer optimizer (gensyn-ai/noloco, its C4 configs): lr alpha 0.7, momentum beta 0.5
NOLOCO = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.5)


def groups(n: int, size: int, step: int) -> list[list[int]]:
    """The groups of `size` peers that average after `step`: the reference's permutation
    numpy.random.default_rng(step + 1).permutation(n), dealt round-robin into n / size groups."""
    order = np.random.default_rng(step + 1).permutation(n)
    count = n // size
    return [[int(r) for r in order[g::count]] for g in range(count)]


def group_matrix(n: int, size: int, step: int) -> np.ndarray:
    """W(step): 1 / size between the members of each group (a doubly stochastic block matrix)."""
    w = np.zeros((n, n))
    for members in groups(n, size, step):
        w[np.ix_(members, members)] = 1.0 / size
    return w


class NoLoCo(DistributedOptimizer):
    """NoLoCo (Kolehmainen et al. 2025): DiLoCo without an all-reduce; every H steps each peer averages with
    the other members of a small group drawn by a step-seeded permutation.

    Each peer keeps its own anchor phi_i and outer momentum. The base optimizer steps locally; after every
    H = `period` steps, in groups of `group_size` peers (`groups`: the reference's permutation of the step),
    with Delta_i = x_i - phi_i and means over the peer's group:
    delta_i <- beta delta_i + alpha mean(Delta) + gamma (mean(phi) - phi_i);  phi_i <- phi_i + delta_i;
    x_i <- phi_i. `outer` is that outer step as a torch optimizer over the anchor (by default SGD with
    lr alpha = 0.7, momentum beta = 0.5: it steps with the gradient -mean(Delta) + (gamma / alpha)
    (phi_i - mean(phi)), which is the update above); `gamma` (the pull toward the group's anchors) is alpha
    when null, as in the reference code. One exchange of [Delta_i, phi_i] with each group partner, no
    collective. Needs the peer count divisible by group_size; one peer alone keeps to itself. The inner
    optimizer's state is kept; the run's topology is ignored (the groups are the algorithm's own).
    """

    uses_topology = False
    label = "NoLoCo"
    knobs = {}
    cost_form = "pairwise"  # local steps; every `period` one exchange of [x - phi, phi] within its groups

    @staticmethod
    def pairing(n: int, group_size: int = 2) -> Topology:
        """The groups as a time-varying topology: W(step) averages each group of `group_size` peers that the
        step's permutation deals (`groups`), what the peers mix with after that step."""
        return Topology(
            "noloco_groups", functools.partial(group_matrix, n, group_size), options={"group_size": group_size}
        )

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        period: int = 50,
        group_size: int = 2,
        outer=NOLOCO,
        gamma: float | None = None,
        **common,
    ):
        super().__init__(base, **common)
        comm = self.comm
        for name, value in (("period", period), ("group_size", group_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"NoLoCo {name} must be an integer >= 1, got {value!r}")
        size = group_size if comm.size > 1 else 1
        if comm.size % size:
            raise ValueError(
                f"NoLoCo group_size {group_size} must divide the {comm.size} peers (groups of equal size average)"
            )
        make = factory(outer, "NoLoCo")
        if make is None:
            raise ValueError("NoLoCo needs an outer optimizer (its default: SGD lr 0.7, momentum 0.5); got outer=None")
        if gamma is not None and gamma < 0:
            raise ValueError(f"NoLoCo gamma (the pull toward the group's anchors) must be >= 0, got {gamma}")
        self.period, self.group_size, self.gamma = period, size, gamma
        n = comm.size
        self.groups = NoLoCo.pairing(n, size)
        self._make = make
        self._outer = OuterOptimizer.over(make, self.param_groups, "NoLoCo")
        self.outer_optimizer = self._outer.optimizer

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        super().param_group_added(params)  # refused after the first step
        self._outer = OuterOptimizer.over(self._make, self.param_groups, "NoLoCo")  # over every group, the new too
        self.outer_optimizer = self._outer.optimizer

    def update(self) -> None:
        params = self.params()
        if not self._outer.anchored:  # each peer's own anchor: its model at the start
            self._outer.set_anchors(params)
        self.base.step()
        self.step_count += 1
        if self.step_count % self.period == 0:
            self._outer_step(params)

    def _outer_step(self, params: list[torch.Tensor]) -> None:
        anchors = self._outer.anchors
        k = len(params)
        mixed = self.comm.mix([p - a for p, a in zip(params, anchors)] + list(anchors), self.groups, self.step_count)
        ratios = [
            (float(group["lr"]) if self.gamma is None else self.gamma) / float(group["lr"])
            for group in self._outer.optimizer.param_groups  # type: ignore[union-attr]
            for _ in group["params"]
        ]
        grads: list[torch.Tensor | None] = [
            -d + r * (a - m) for d, m, a, r in zip(mixed[:k], mixed[k:], anchors, ratios)
        ]
        self._outer.step(grads)
        for p, a in zip(params, anchors):
            p.copy_(a)

    def algorithm_state(self):
        return {**super().algorithm_state(), "outer": self._outer.state_dict()}

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        self._outer.load_state_dict(saved_outer(state, "NoLoCo"))

    def __repr__(self) -> str:
        outer = repr(self.outer_optimizer).replace("\n", " ")
        options = f"period={self.period}, group_size={self.group_size}, gamma={self.gamma}"
        return f"NoLoCo({self.base!r}, {options}, outer={outer})"
