"""Distributed optimizers. Each wraps a local torch optimizer and behaves like one."""

from __future__ import annotations

import torch

from dpsgd.comm import Communicator
from topologies import Topology

from .adpsgd import ADPSGD
from .allreduce import AllReduce
from .base import AsynchronousOptimizer, DistributedOptimizer
from .choco import Choco
from .d2 import D2
from .demo import DeMo
from .desloc import DESLOC
from .dpsgd import DPSGD, QGM
from .gradient_tracking import GradientTracking
from .local_sgd import BMUF, DiLoCo, LocalSGD, SlowMo
from .noloco import NoLoCo
from .sgp import SGP
from .sparseloco import SparseLoCo
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
    "noloco": NoLoCo,
    "demo": DeMo,
    "sparseloco": SparseLoCo,
    "desloc": DESLOC,
}
BASE_OPTIMIZERS = ("sgd", "adam", "adamw")

__all__ = [
    "ADPSGD",
    "ALGORITHMS",
    "BMUF",
    "D2",
    "DESLOC",
    "DPSGD",
    "QGM",
    "SGP",
    "AllReduce",
    "AsynchronousOptimizer",
    "Choco",
    "DeMo",
    "DiLoCo",
    "DistributedOptimizer",
    "GradientTracking",
    "LocalSGD",
    "NoLoCo",
    "SlowMo",
    "SparseLoCo",
    "StreamingDiLoCo",
    "build",
    "build_base",
]


def build_base(
    params, name: str = "sgd", lr: float = 0.1, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False
) -> torch.optim.Optimizer:
    """The local optimizer a config names."""
    if not lr > 0:
        raise ValueError(f"the learning rate must be > 0, got {lr}")
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    if name in ("adam", "adamw"):
        cls = torch.optim.Adam if name == "adam" else torch.optim.AdamW
        return cls(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"unknown base optimizer {name!r}; valid: {', '.join(BASE_OPTIMIZERS)}")


def build(
    name: str, base: torch.optim.Optimizer, *, topology: Topology | None = None, comm: Communicator, **options
) -> DistributedOptimizer:
    """The distributed optimizer `name` (a key of ALGORITHMS) with its options."""
    if name not in ALGORITHMS:
        raise ValueError(f"unknown algorithm {name!r}; valid algorithms: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name](base, topology=topology, comm=comm, **options)
