"""SPARTA (EXO Gym's sparse parameter averaging): see `SPARTA`."""

from __future__ import annotations

import torch

import topologies

from .base import DistributedOptimizer


class SPARTA(DistributedOptimizer):
    """SPARTA (sparse parameter averaging, EXO Gym's SPARTAStrategy): every step each peer takes its base step,
    then averages a random fraction p = `fraction` of its entries with one partner.

    Step k: x_i <- base(x_i, g_i); the entries S(k) = {e : u_e(k) < p}, u(k) uniform draws over the parameters
    flattened in order from a generator seeded by (`seed`, k), the same on every peer (EXO Gym broadcasts rank 0's
    mask; a shared seed gives the same mask without the message); the partner j = m_k(i) of a random perfect
    matching (topologies' `random_matching`, seeded by `seed`: one peer sits out when n is odd); then
    x_i[S(k)] <- (x_i[S(k)] + x_j[S(k)]) / 2. Only the |S(k)| ~ p D selected values travel, to one peer.
    `partners="all"` averages them over every peer instead (x_i[S] <- mean_j x_j[S], an all-reduce of the selected
    values: the form of EXO Gym's code, which all-reduces the masked entries). The topology is accepted and
    ignored; the base's state (momentum, Adam moments) stays each peer's own."""

    uses_topology = False  # its own random matching (or all peers)
    label = "SPARTA"
    knobs = {"fraction": (0.001, 0.005, 0.02, 0.05)}
    cost_form = None  # p D values a step to one partner: none of the cost model's forms

    def __init__(
        self, base: torch.optim.Optimizer, *, fraction: float = 0.005, partners: str = "one", seed: int = 0, **common
    ):
        super().__init__(base, **common)
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise ValueError(
                f"SPARTA fraction (the share of entries averaged a step) must be in (0, 1], got {fraction!r}"
            )
        if partners not in ("one", "all"):
            raise ValueError(f"SPARTA partners must be 'one' (a random partner a step) or 'all', got {partners!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"SPARTA seed must be an integer >= 0, got {seed!r}")
        self.fraction, self.partners, self.seed = float(fraction), partners, seed
        self.matching = topologies.make("random_matching", self.comm.size, seed=seed)

    def mask(self, step: int, entries: int) -> torch.Tensor:
        """S(step): the selected entries of the flattened parameters, the same on every peer and backend."""
        draws = torch.rand(entries, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + step))
        return (draws < self.fraction).nonzero().squeeze(1)

    def update(self) -> None:
        self.base.step()
        params = self.params()
        flat = self.comm.flatten(params)
        chosen = self.mask(self.step_count, flat.shape[-1]).to(flat.device)
        values = flat.index_select(-1, chosen)
        if self.partners == "one":
            (mixed,) = self.comm.mix([values], self.matching, self.step_count)
        else:
            (mixed,) = self.comm.allreduce_mean([values])
        flat.index_copy_(flat.dim() - 1, chosen, mixed)
        for p, value in zip(params, self.comm.unflatten(flat, params)):
            p.copy_(value)
        self.step_count += 1

    def __repr__(self) -> str:
        return f"SPARTA({self.base!r}, fraction={self.fraction}, partners={self.partners!r}, seed={self.seed})"
