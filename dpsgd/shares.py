"""Each peer's share of a map-style dataset, for a user's own loop: `ShareSampler`, a torch `Sampler` in the
manner of `DistributedSampler`, with the app's partitions (dpsgd.data.partition: iid or Dirichlet)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from dpsgd import data, seeds

PARTITIONS = ("iid", "dirichlet")

__all__ = ["ShareSampler"]


class ShareSampler(Sampler[int]):
    """The indices of peer `rank`'s share of `dataset` (of `peers` peers), for
    `DataLoader(dataset, batch_size=..., sampler=ShareSampler(dataset, comm=comm))`.

    The shares are the app's (`dpsgd.data.partition` with `seed`): "iid" (equal random shares) or "dirichlet"
    (each class spread over the peers by Dirichlet(`alpha`) proportions: label skew, smaller `alpha` more
    skewed; the labels come from `labels`, else `dataset.targets`, else each item's second element).
    Every peer computes every share from the seed alone, so the shares are disjoint without a message.

    An epoch is `len(dataset) // peers` samples on every peer, whatever its share's size (so synchronous
    algorithms take the same number of steps everywhere): passes over the own share, each in a new order,
    drawn from (seed, rank, epoch). As with `DistributedSampler`, call `set_epoch(epoch)` before each epoch;
    `set_epoch(epoch, start=k)` resumes an epoch after its first k samples (a restored checkpoint).
    Give `comm` (a `dpsgd.comm.Communicator`) or `peers` and `rank`.
    """

    def __init__(
        self,
        dataset,
        comm=None,
        *,
        peers: int | None = None,
        rank: int | None = None,
        partition: str = "iid",
        alpha: float = 0.5,
        seed: int = 0,
        labels: Sequence[int] | None = None,
    ):
        if comm is not None:
            peers, rank = comm.size, comm.rank
        if peers is None or rank is None:
            raise TypeError("ShareSampler needs comm=dpsgd.comm.init(...), or peers= and rank=")
        if not 0 <= rank < peers:
            raise ValueError(f"ShareSampler rank must be in [0, {peers}), got {rank}")
        if partition not in PARTITIONS:
            raise ValueError(f"ShareSampler partition must be one of {', '.join(PARTITIONS)}, got {partition!r}")
        n = len(dataset)
        if partition == "iid":
            classes = np.zeros(n, dtype=np.int64)  # iid needs only the count
        else:
            classes = np.asarray(_labels(dataset, labels))
        self.peers, self.rank, self.seed = peers, rank, seed
        self.indices = data.partition(classes, peers, seed, partition, alpha=alpha)[rank]
        self.num_samples = n // peers
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch the next iteration draws (and the samples of it already consumed, to resume mid-epoch)."""
        if not 0 <= start <= self.num_samples:
            raise ValueError(f"ShareSampler start must be in [0, {self.num_samples}], got {start}")
        self.epoch, self.start = int(epoch), int(start)

    def __iter__(self) -> Iterator[int]:
        # the peer's own stream (the app's batch seed), one per epoch
        generator = torch.Generator().manual_seed(seeds.batch_seed(self.seed, self.rank) * 1_000_003 + self.epoch)
        passes = -(-self.num_samples // len(self.indices))
        order = torch.cat([torch.randperm(len(self.indices), generator=generator) for _ in range(passes)])
        chosen = self.indices[order[: self.num_samples].numpy()]
        return iter(chosen[self.start :].tolist())

    def __len__(self) -> int:
        return self.num_samples - self.start


def _labels(dataset, labels) -> np.ndarray:
    """The class of every item: given, the dataset's `targets` (torchvision's), or each item's second element."""
    if labels is not None:
        found = labels
    elif getattr(dataset, "targets", None) is not None:
        found = dataset.targets
    else:
        found = torch.stack([torch.as_tensor(dataset[i][1]) for i in range(len(dataset))])
    found = torch.as_tensor(found)
    if found.is_floating_point() or found.dim() != 1 or len(found) != len(dataset):
        raise ValueError(
            "ShareSampler(partition='dirichlet') splits by class: it needs one integer label per item "
            f"(labels=, or dataset.targets); got shape {tuple(found.shape)} of {found.dtype}"
        )
    return found.numpy()
