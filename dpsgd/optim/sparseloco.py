"""SparseLoCo (Sarfi, Thérien, Lidin & Belilovsky 2025, arXiv 2508.15706): see `SparseLoCo`."""

from __future__ import annotations

import functools

import torch

from .base import DistributedOptimizer
from .chunked import ChunkedTopK, gathered_mean, refuse_compression
from .outer import OuterOptimizer, factory, saved_outer

SPARSELOCO = functools.partial(torch.optim.SGD, lr=1.0)  # the paper's outer step: x_a <- x_a - mean_j s_j
AGGREGATES = ("mean", "templar")  # how the peers' s_j combine (see SparseLoCo)


class SparseLoCo(DistributedOptimizer):
    """SparseLoCo (Sarfi et al. 2025): DiLoCo whose outer deltas travel as chunked top-k at 2 bits, with an
    error-feedback accumulator in place of the outer momentum.

    The base optimizer steps locally; after every H = `period` steps, with x_a the anchor (the model the
    peers last agreed on, the same on every peer) and beta = `decay`:
    Delta_i = x_a - x_i;  e_i <- beta e_i + Delta_i;  s_i = Q(TopK(e_i));  e_i <- e_i - s_i;
    then the outer optimizer `outer` (by default SGD with lr alpha = 1: x_a <- x_a - alpha mean_j s_j, the
    paper's) steps the anchor with mean_j s_j (an all-gather of the s_j) as its gradient, and x_i <- x_a.
    TopK keeps the `topk` entries of largest magnitude of each block (1-D tensors in chunks of c entries,
    matrices in c1 x c2 tiles, c the largest divisor of the dimension <= `chunk`: 64 x 64 tiles and topk 64
    are 1.6% density); Q is the reference's statistical quantization to `bits` bits (codes around the mean
    within `sigmas` standard deviations, decoded as the mean of the values sharing a code;
    dpsgd.optim.chunked.quantize), null for 32-bit values. The anchor starts as the peers' common model (a
    mean when broadcast_initial is off). The inner optimizer's state is kept; the topology is ignored.

    `aggregate` says how the peers' s_j combine: "mean" (the paper's mean_j s_j over all n peers) or "templar"
    (tplr-ai/templar's, the code that trained its large models: each peer's values of a tensor clipped to the
    median over peers of their norms, min(1, med / (||s_j|| + 1e-8)), med the lower middle for an even count,
    then each entry's mean over the peers that sent it). With "templar" and outer SGD lr alpha this equals
    templar at lr sqrt(alpha): templar adds alpha Delta_i to its error feedback and steps with lr alpha again
    (the same at its default alpha = 1); templar also rounds an odd topk down to even (and to at least 2), this
    keeps `topk` as given (tests/test_reference_code.py checks both against templar's own numbers).
    """

    uses_topology = False
    label = "SparseLoCo"
    knobs = {}
    cost_form = None  # an all-gather of sparse 2-bit messages every period steps: none of the map's forms

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        period: int = 15,
        decay: float = 0.95,
        topk: int = 64,
        chunk: int = 64,
        bits: int | None = 2,
        sigmas: float = 6.0,
        outer=SPARSELOCO,
        aggregate: str = "mean",
        **common,
    ):
        super().__init__(base, **common)
        refuse_compression(self.comm, "SparseLoCo")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"SparseLoCo period must be an integer >= 1, got {period!r}")
        if not 0 <= decay <= 1:
            raise ValueError(f"SparseLoCo decay (of the error feedback) must be in [0, 1], got {decay}")
        if aggregate not in AGGREGATES:
            raise ValueError(f"SparseLoCo aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        make = factory(outer, "SparseLoCo")
        if make is None:
            raise ValueError("SparseLoCo needs an outer optimizer (its default: SGD with lr 1); got outer=None")
        self.period, self.decay, self.aggregate = period, float(decay), aggregate
        self._layout = (make, chunk, topk, bits, sigmas)
        self._lay_out()

    def _lay_out(self) -> None:
        """The blocks, the zero error feedback and the outer optimizer of every parameter (at construction, and for
        a group added before the first step)."""
        make, chunk, topk, bits, sigmas = self._layout
        lead = len(self.comm.peer_shape)
        shapes = [p.shape[lead:] for p in self.params()]
        self.code = ChunkedTopK(shapes, chunk, topk, dct=False, bits=bits, sigmas=sigmas)
        self.errors = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params()]
        self._outer = OuterOptimizer.over(make, self.param_groups, "SparseLoCo")
        self.outer_optimizer = self._outer.optimizer

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        super().param_group_added(params)  # refused after the first step
        self._lay_out()

    def update(self) -> None:
        params = self.params()
        if not self._outer.anchored:  # the peers' common model
            self._outer.set_anchors(params if self.broadcast_initial else self.comm.exact.allreduce_mean(params))
        self.base.step()
        self.step_count += 1
        if self.step_count % self.period == 0:
            for e, anchor, p in zip(self.errors, self._outer.anchors, params):
                e.mul_(self.decay).add_(anchor - p)
            message = self.code.encode(self.errors)
            for e, sent in zip(self.errors, self.code.dense(message)):
                e.sub_(sent)
            templar = self.aggregate == "templar"
            combined = gathered_mean(self.comm, self.code, message, senders=templar, clip=templar)
            self._outer.step(list[torch.Tensor | None](combined))
            for p, anchor in zip(params, self._outer.anchors):
                p.copy_(anchor)

    def algorithm_state(self):
        return {
            **super().algorithm_state(),
            "outer": self._outer.state_dict(),
            "errors": [e.clone() for e in self.errors],
        }

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        self._outer.load_state_dict(saved_outer(state, "SparseLoCo"))
        self.errors = self.own_tensors(state["errors"]) or self.errors

    def __repr__(self) -> str:
        outer = repr(self.outer_optimizer).replace("\n", " ")
        return (
            f"SparseLoCo({self.base!r}, period={self.period}, decay={self.decay}, bits={self.code.bits}, "
            f"aggregate={self.aggregate!r}, outer={outer})"
        )
