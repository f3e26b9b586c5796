"""ResNet-20's normalization: GroupNorm by default, BatchNorm with model.norm=batch (running statistics per peer,
left untouched by evaluation), and the fleet's refusal of BatchNorm (it stacks parameters, not buffers)."""

from __future__ import annotations

import pytest
import torch

from dpsgd import metrics, models
from dpsgd.config import parse
from experiments.validate import ConfigError, validate


def test_resnet20_norms():
    group = models.build("resnet20", (1, 8, 8), 10, seed=0)
    batch = models.build("resnet20", (1, 8, 8), 10, seed=0, norm="batch")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in group.modules()) and not list(group.buffers())
    assert sum(isinstance(m, torch.nn.BatchNorm2d) for m in batch.modules()) == 21  # stem, 18 in blocks, 2 shortcuts
    with pytest.raises(ValueError, match="model.norm must be one of group, batch"):
        models.build("resnet20", (1, 8, 8), 10, seed=0, norm="layer")


def test_evaluation_leaves_running_statistics_alone():
    model = models.build("resnet20", (1, 8, 8), 10, seed=0, norm="batch")
    x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    model(x)  # a training forward pass updates them
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = metrics.evaluate(model, dict(model.named_parameters()), x, y)
    assert metrics.evaluate(model, dict(model.named_parameters()), x, y) == first and model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_batchnorm_runs_on_real_peers_not_on_the_fleet(hydra_config):
    validate(hydra_config("model=resnet20", "model.norm=batch", "epochs=1"))
    with pytest.raises(ConfigError, match="BatchNorm's running statistics"):
        validate(hydra_config("backend=fleet", "model=resnet20", "model.norm=batch"))


def test_buffers_option_reaches_the_app(hydra_config):
    """`buffers=` of the config governs a real peer's BatchNorm statistics (dpsgd.optim's `buffers=`): the same on
    every peer with broadcast (rank 0's), mixed with D-PSGD's gossip with average (nearer each other), each its
    own with local."""

    from dpsgd.build import build_peer
    from dpsgd.comm import run_local

    def stats(mode: str) -> torch.Tensor:
        cfg = hydra_config("model=resnet20", "model.norm=batch", "data.partition=shards", f"buffers={mode}")

        def peer(comm):
            p = build_peer(comm, parse(cfg))
            for step in range(1, 4):
                p.step(step)
            return torch.cat([b.reshape(-1).float() for b in p.model.buffers()])

        return torch.stack(run_local(4, peer, timeout_s=120))

    def spread(got: torch.Tensor) -> float:
        return float((got - got.mean(0)).abs().max())

    local = stats("local")
    assert spread(stats("broadcast")) == 0 and spread(local) > 1e-3  # skewed shares: each peer's own
    assert 0 < spread(stats("average")) < spread(local) / 2
