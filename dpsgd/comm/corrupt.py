"""Corrupt peers: what a misbehaving peer sends in place of its own values (`faults.corrupt_peer`, a rank or a
list, with `faults.corrupt_mode`). dpsgd.comm.robust's wrapper sends `Corruption.alter(x)` from those peers in every
mix and mean; the peer itself keeps training on its true x. Modes, for the flat vector x a peer would send:
- `nan`: every entry nan (a crashed or buggy peer);
- `scale`: x times `faults.corrupt_scale` (default 10);
- `sign`: -x (sign flipped);
- `noise`: x plus a Gaussian vector of norm `faults.corrupt_scale` (default ||x||), drawn from (seed, sender, call);
- `alie`: "a little is enough" (Baruch et al. 2019): mean - z std, coordinate-wise, of the honest vectors the
  peer saw in its previous exchange of the same kind (its own included; none yet: its own x), so that the
  value hides inside the honest spread; z is `faults.corrupt_scale`, default Baruch et al.'s
  z = Phi^-1((n - s) / n) with s = floor(n / 2 + 1) - b for n peers of which b are corrupt (0 if that is not positive).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

MODES = ("nan", "scale", "sign", "noise", "alie")


def mode_name(mode):
    """The mode a config gives: `faults.corrupt_mode=nan` on the command line reaches the config as the float NaN
    (Hydra's grammar reads nan as a number), which names the mode `nan`."""
    return "nan" if isinstance(mode, float) and math.isnan(mode) else mode


DEFAULT_SCALE = 10.0


def alie_z(n: int, corrupt: int) -> float:
    """Baruch et al.'s largest z that stays inside the spread of the honest values: with s = floor(n/2 + 1) - b
    peers needed for a majority, Phi^-1((n - s) / n); 0 when no positive z exists."""
    s = math.floor(n / 2 + 1) - corrupt
    p = (n - s) / n
    return max(0.0, statistics.NormalDist().inv_cdf(p)) if 0 < p < 1 else 0.0


@dataclass(frozen=True)
class Corruption:
    """Which peers send corrupted values and how (see the module)."""

    peers: frozenset[int]
    mode: str
    scale: float | None = None
    seed: int = 0
    n: int = 1

    def __post_init__(self):
        object.__setattr__(self, "mode", mode_name(self.mode))
        if self.mode not in MODES:
            raise ValueError(f"faults.corrupt_mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def alter(self, x: torch.Tensor, sender: int, call: int, seen: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """What corrupt peer `sender` sends instead of its flat `x` at its `call`-th exchange; `seen`: the honest
        vectors it received in its previous exchange of this kind (alie)."""
        if self.mode == "nan":
            return torch.full_like(x, math.nan)
        if self.mode == "scale":
            return x * (DEFAULT_SCALE if self.scale is None else self.scale)
        if self.mode == "sign":
            return -x
        if self.mode == "noise":
            g = torch.Generator().manual_seed(_seed(self.seed, sender, call))
            e = torch.randn(x.shape, generator=g, dtype=torch.float64).to(x.device, x.dtype)
            norm = float(torch.linalg.vector_norm(x)) if self.scale is None else self.scale
            return x + e * (norm / max(float(torch.linalg.vector_norm(e)), 1e-30))
        values = torch.stack([x, *seen])  # alie
        z = alie_z(self.n, len(self.peers)) if self.scale is None else self.scale
        std = values.std(0, unbiased=False) if len(values) > 1 else torch.zeros_like(x)
        return values.mean(0) - z * std


def _seed(seed: int, sender: int, call: int) -> int:
    state = np.random.SeedSequence([int(seed), 0xBAD, int(sender), int(call)]).generate_state(1, dtype=np.uint64)[0]
    return int(state) & ((1 << 63) - 1)


def from_faults(peers: list[int], mode: str, scale: float | None, n: int, seed: int = 0) -> Corruption | None:
    """The Corruption of a config's `faults:` (already checked by dpsgd.faults.FaultPlan): `peers` send `mode`d
    values; None when no peer is corrupt."""
    if not peers:
        return None
    return Corruption(frozenset(int(p) for p in peers), mode, scale, seed, n)
