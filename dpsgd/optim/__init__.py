"""Distributed optimizers. Each wraps a local torch optimizer and behaves like one."""

from __future__ import annotations

import torch

from dpsgd.comm import Communicator
from topologies import Topology

from .adpsgd import ADPSGD
from .allreduce import AllReduce
from .async_local_sgd import AsyncLocalSGD
from .base import AsynchronousOptimizer, DistributedOptimizer
from .choco import Choco
from .d2 import D2
from .demo import DeMo
from .desloc import DESLOC
from .dpsgd import DPSGD, QGM
from .gradient_tracking import GradientTracking
from .local_sgd import BMUF, DiLoCo, LocalSGD, SlowMo
from .muon import MuonAdamW, hidden_matrices
from .noloco import NoLoCo
from .sgp import SGP
from .sparseloco import SparseLoCo
from .sparta import SPARTA
from .streaming_diloco import StreamingDiLoCo

ALGORITHMS = {
    "allreduce": AllReduce,
    "dpsgd": DPSGD,
    "local_sgd": LocalSGD,
    "slowmo": SlowMo,
    "diloco": DiLoCo,
    "streaming_diloco": StreamingDiLoCo,
    "bmuf": BMUF,
    "sgp": SGP,
    "choco": Choco,
    "d2": D2,
    "gradient_tracking": GradientTracking,
    "qgm": QGM,
    "adpsgd": ADPSGD,
    "async_local_sgd": AsyncLocalSGD,
    "noloco": NoLoCo,
    "demo": DeMo,
    "sparseloco": SparseLoCo,
    "desloc": DESLOC,
    "sparta": SPARTA,
}
# the base optimizers of `optimizer=NAME` (conf/optimizer/): each takes its torch class's own keyword options
BASE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
    "muon": MuonAdamW,  # Muon on hidden matrices, AdamW on the rest (dpsgd.optim.muon)
}

__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "BMUF",
    "D2",
    "DESLOC",
    "DPSGD",
    "QGM",
    "SGP",
    "SPARTA",
    "AllReduce",
    "AsyncLocalSGD",
    "AsynchronousOptimizer",
    "Choco",
    "DeMo",
    "DiLoCo",
    "DistributedOptimizer",
    "GradientTracking",
    "LocalSGD",
    "MuonAdamW",
    "NoLoCo",
    "SlowMo",
    "SparseLoCo",
    "StreamingDiLoCo",
    "build",
    "build_base",
    "hidden_matrices",
]


def build_base(params, name: str = "sgd", **options) -> torch.optim.Optimizer:
    """The base optimizer `name` (a key of BASE_OPTIMIZERS) over `params`, with its torch class's own options
    (`lr`, `momentum`, `betas`, `weight_decay`, ...)."""
    if name not in BASE_OPTIMIZERS:
        raise ValueError(f"unknown base optimizer {name!r}; valid: {', '.join(BASE_OPTIMIZERS)}")
    lr = options.get("lr", 0.1)
    if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
        raise ValueError(f"the learning rate must be a number > 0, got {lr!r}")
    return BASE_OPTIMIZERS[name](params, **{"lr": lr, **options})


def build(
    name: str, base: torch.optim.Optimizer, *, topology: Topology | None = None, comm: Communicator, **options
) -> DistributedOptimizer:
    """The distributed optimizer `name` (a key of ALGORITHMS) with its options."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name](base, topology=topology, comm=comm, **options)
