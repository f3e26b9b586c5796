"""Every peer's minibatches at once, as one (n, batch, ...) tensor, so that a fleet computes all peers'
gradients in one vectorized call."""

from __future__ import annotations

import torch

from dpsgd.data import augmented
from dpsgd.seeds import augment_seed, batch_seed


class FleetBatches:
    """Synchronous batches of n peers: `next()` returns (x, y) with a leading peer axis, the same samples
    in the same order as each peer's own `dpsgd.data.Batches`: peer r shuffles its share with
    torch.Generator(batch_seed(seed, r)) at the start of each of its passes, as `dpsgd.build.build_peer` does, and
    crops and flips them as it does (`augment`)."""

    def __init__(
        self, x: torch.Tensor, y: torch.Tensor, shares: list, batch_size: int, seed: int, augment: str = "none"
    ):
        sizes = [len(s) for s in shares]
        if batch_size < 1 or batch_size > min(sizes):
            raise ValueError(
                f"batch_size must be in [1, {min(sizes)}] (the samples of the smallest peer's share), got {batch_size}"
            )
        n, width = len(shares), max(sizes)
        self.x, self.y, self.batch_size = x, y, batch_size
        self.sizes = torch.tensor(sizes)
        self.shares = torch.zeros(n, width, dtype=torch.long)
        for r, s in enumerate(shares):
            self.shares[r, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        self.batches_per_pass = self.sizes // batch_size
        self._seeds = [batch_seed(seed, r) for r in range(n)]
        self._gens = [torch.Generator().manual_seed(s) for s in self._seeds]
        augmented(x[:1], augment, 0)  # an unknown kind, or one the data does not take, refused here
        self.augment = augment  # each peer's crops and flips, as its own Batches draws them
        self._order = torch.zeros(n, width, dtype=torch.long)
        self._equal, self._width = min(sizes) == width, width  # equal shares (iid): all peers reshuffle together
        self._cols = torch.arange(batch_size)
        self.position = 0  # batches drawn so far (by every peer)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.position % self.batches_per_pass
        starting = torch.nonzero(i == 0).reshape(-1).tolist()  # peers starting a pass reshuffle
        if len(starting) == len(self._gens) and self._equal:
            self._order[:] = torch.stack([torch.randperm(self._width, generator=g) for g in self._gens])
        else:
            for r in starting:
                self._order[r, : self.sizes[r]] = torch.randperm(int(self.sizes[r]), generator=self._gens[r])
        local = self._order.gather(1, i[:, None] * self.batch_size + self._cols)
        idx = self.shares.gather(1, local)
        x = self.x[idx]
        if self.augment != "none":
            x = torch.stack(
                [augmented(x[r], self.augment, augment_seed(s, self.position)) for r, s in enumerate(self._seeds)]
            )
        self.position += 1
        return x, self.y[idx]
