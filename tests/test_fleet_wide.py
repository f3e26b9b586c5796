"""The fleet's faster paths against the plain ones: the wide layout (dpsgd.sim.wide) for convolutional models
(the same gradients as vmap over peers with different weights; a CNN fleet equal to the local backend's
threads), the transformer's attention under vmap, gossip as gathers of rows (a GPU's form), and the wide MLP's
PeerLinear backward."""

from __future__ import annotations

import copy

import pytest
import runs
import torch
from test_fleet import local_parameters

import topologies
from dpsgd.config import parse
from dpsgd.sim import Fleet
from dpsgd.sim.fleet import mixing
from dpsgd.sim.wide import widen

torch.set_num_threads(1)


def image_config(model: dict, peers: int = 4) -> dict:
    cfg = runs.experiment(runs.load("algorithm", "dpsgd"), "ring", peers, "fleet")
    data = {**runs.load("data", "synthetic_cifar"), "image_shape": [3, 8, 8], "num_samples": 160}
    return {**cfg, "model": model, "data": data, "batch_size": 4}


MODELS = {
    "cnn": {"name": "cnn", "width": 4, "groups": 2},
    "resnet20": {"name": "resnet20", "groups": 2},
}


@pytest.mark.parametrize("model", [*MODELS, "mlp"])
def test_wide_gradients_equal_vmaps(model):
    fleet = Fleet(
        parse(image_config(MODELS[model]) if model in MODELS else runs.experiment(runs.load("algorithm", "dpsgd")))
    )
    assert fleet._wide is not None  # the fleet chose the wide layout
    generator = torch.Generator().manual_seed(0)  # seeded: the same weights on every run of the test
    with torch.no_grad():  # peers with different weights: a layout that mixed peers would show
        for p in fleet.params:
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    x, y = fleet.batches.next()
    fleet.gradients(x, y)
    wide = [p.grad.clone() for p in fleet.params]
    fleet._wide = None
    fleet.gradients(x, y)
    for name, a, b in zip(fleet.names, wide, (p.grad for p in fleet.params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_wide_fleet_equals_local_backend():
    cfg = image_config(MODELS["cnn"])
    fleet = Fleet(parse(copy.deepcopy(cfg)))
    assert fleet._wide is not None
    for step in range(1, 10 + 1):
        fleet.step(step)
    torch.testing.assert_close(fleet.flat(), local_parameters(cfg, 10), rtol=1e-5, atol=1e-5)


def test_widen_refuses_what_it_cannot_lay_out():
    with pytest.raises(ValueError, match="no wide form of LayerNorm"):  # a network of linear layers takes no norm
        widen(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2)), 2)
    with pytest.raises(ValueError, match="no wide form of BatchNorm2d"):
        widen(torch.nn.Sequential(torch.nn.Conv2d(3, 2, 3), torch.nn.BatchNorm2d(2)), 2)


def test_transformer_fleet_equals_local_backend():
    """The transformer under vmap (attention as its decomposed products) against the local backend's threads."""
    cfg = runs.experiment(runs.load("algorithm", "dpsgd"), "ring", 4, "fleet")
    cfg = {**cfg, "model": {"name": "transformer", "dim": 16, "layers": 1, "heads": 2}, "batch_size": 4,
           "data": {**runs.load("data", "tiny_text"), "num_samples": 200, "seq_len": 12}}  # fmt: skip
    fleet = Fleet(parse(copy.deepcopy(cfg)))
    for step in range(1, 5 + 1):
        fleet.step(step)
    torch.testing.assert_close(fleet.flat(), local_parameters(cfg, 5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["ring", "exponential", "one_peer_exponential", "directed_exponential", "complete"])
def test_gossip_as_gathers_equals_the_product(name):
    """The GPU's form of W(k) x (d gathers of rows), run here on the CPU, against the dense product."""
    w = topologies.make(name, 12).mixing_matrix(3)
    x = torch.randn(12, 5, 3)
    m = mixing(w, torch.float32, torch.device("cpu"), gather=True)
    assert m.gather is not None and m.gather[0].shape[1] == (w != 0).sum(1).max()
    expected = (torch.as_tensor(w, dtype=torch.float32) @ x.reshape(12, -1)).reshape(x.shape)
    torch.testing.assert_close(m.apply(x), expected)
    torch.testing.assert_close(mixing(w, torch.float32, torch.device("cpu")).apply(x), expected)


@pytest.mark.parametrize("bias", [True, False])
def test_peer_linear_gives_autograds_gradients_in_the_weights_layout(bias):
    """PeerLinear's own backward against autograd's through the same batched product, on 3 peers."""
    from dpsgd.sim.wide import PeerLinear

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(3, 6, generator=gen, dtype=torch.float64, requires_grad=True) if bias else None
    upstream = torch.randn(3, 5, 6, generator=gen, dtype=torch.float64)
    inputs = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(PeerLinear.apply(x, w, b), inputs, upstream)
    plain = torch.bmm(x, w.transpose(1, 2)) + (b[:, None, :] if b is not None else 0)
    want = torch.autograd.grad(plain, inputs, upstream)
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g, r)
    assert got[1].is_contiguous()  # no transposed copy left for autograd to make
    assert torch.autograd.gradcheck(lambda *t: PeerLinear.apply(*t, *([None] if b is None else [])), inputs)
