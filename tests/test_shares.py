"""ShareSampler: the app's shares of any map-style dataset, one epoch length on every peer, orders that
`set_epoch` reproduces and resumes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from dpsgd import data
from dpsgd.shares import ShareSampler

PEERS = 4


def dataset(n: int = 203, classes: int = 5) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(classes, (n,), generator=g))


@pytest.mark.parametrize("partition", ["iid", "dirichlet"])
def test_the_shares_are_the_apps_and_every_epoch_has_one_length(partition):
    ds = dataset()
    labels = ds.tensors[1].numpy()
    expected = data.partition(labels if partition == "dirichlet" else np.zeros(len(ds)), PEERS, 7, partition, alpha=0.3)
    samplers = [ShareSampler(ds, peers=PEERS, rank=r, partition=partition, alpha=0.3, seed=7) for r in range(PEERS)]
    for sampler, share in zip(samplers, expected):
        np.testing.assert_array_equal(sampler.indices, share)
        drawn = list(sampler)
        assert len(drawn) == len(sampler) == len(ds) // PEERS  # the same on every peer
        assert set(drawn) <= set(share.tolist())
    covered = np.concatenate([s.indices for s in samplers])
    assert len(set(covered.tolist())) == len(covered)  # disjoint
    if partition == "iid":
        assert all(len(set(s)) == len(ds) // PEERS for s in samplers)  # a pass over the own share
    else:
        assert len({len(s.indices) for s in samplers}) > 1  # label skew: the shares differ in size


def test_set_epoch_reshuffles_reproducibly_and_resumes_mid_epoch():
    ds = dataset()
    sampler = ShareSampler(ds, peers=PEERS, rank=2, seed=3)
    first = list(sampler)
    sampler.set_epoch(1)
    second = list(sampler)
    assert first != second and sorted(first) == sorted(second)
    sampler.set_epoch(1, start=10)
    assert list(sampler) == second[10:] and len(sampler) == len(second) - 10
    again = ShareSampler(ds, peers=PEERS, rank=2, seed=3)
    again.set_epoch(1)
    assert list(again) == second


def test_labels_come_from_targets_or_items_and_errors_say_what_to_give():
    ds = dataset()
    ds.targets = ds.tensors[1].tolist()  # torchvision's attribute
    by_targets = ShareSampler(ds, peers=PEERS, rank=0, partition="dirichlet", seed=0).indices
    by_items = ShareSampler(dataset(), peers=PEERS, rank=0, partition="dirichlet", seed=0).indices
    np.testing.assert_array_equal(by_targets, by_items)
    with pytest.raises(ValueError, match="one integer label per item"):
        ShareSampler(TensorDataset(torch.randn(40, 2), torch.randn(40)), peers=2, rank=0, partition="dirichlet")
    with pytest.raises(TypeError, match="needs comm="):
        ShareSampler(ds)
    with pytest.raises(ValueError, match="partition must be one of iid, dirichlet"):
        ShareSampler(ds, peers=2, rank=0, partition="shards")
