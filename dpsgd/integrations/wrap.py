"""The chosen algorithm around a trainer's optimizer: by name (with its topology and options), by a factory, or
as an optimizer the user built; what every integration shares, so they refuse and wrap alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import dpsgd.comm
import topologies
from dpsgd.comm import Communicator
from dpsgd.optim import ALGORITHMS, DistributedOptimizer
from dpsgd.options import check_options

# the constructor arguments `Algorithm.wrap` passes itself (not an algorithm's options)
WRAP_SETS = ("base", "topology", "comm", "module", "buffers", "broadcast_initial")

# a factory: (the trainer's optimizer, this process's communicator) -> the distributed optimizer around it
Factory = Callable[[torch.optim.Optimizer, Communicator], DistributedOptimizer]


def refuse_asynchronous(name: str, where: str) -> None:
    """One line when `name` has no global step: a trainer steps every peer together, once per batch."""
    raise ValueError(
        f"{name} is asynchronous (no global step) and cannot run inside {where}, which steps every peer together; "
        "use a synchronous algorithm there (dpsgd, sgp, allreduce, diloco, ...), or run it in the library's own "
        f"loop: python -m experiments.train algorithm={name}"
    )


@dataclass
class Algorithm:
    """What wraps each of the trainer's optimizers: `name` (a key of dpsgd.optim.ALGORITHMS) on the topology
    `topology` (a name of `topologies.make`, for the world's size) with the algorithm's own `options`
    (e.g. {"period": 8} for diloco), or a `factory(base, comm)` returning the optimizer. `buffers` as the
    optimizers' `buffers=` (rank 0's BatchNorm statistics by default, as DDP's broadcast_buffers); `timeout_s`
    bounds every exchange of the optimizers (under Lightning the process group's too, unless `timeout=` is given;
    Accelerate's and the Trainer's groups keep their own timeouts)."""

    name: str = "dpsgd"
    topology: str = "ring"
    options: Mapping[str, Any] = field(default_factory=dict)
    factory: Factory | None = None
    buffers: str = "broadcast"
    timeout_s: float = dpsgd.comm.DEFAULT_TIMEOUT_S

    def wrap(
        self,
        base: torch.optim.Optimizer,
        comm: Communicator,
        module: torch.nn.Module | None = None,
        broadcast_initial: bool = True,
    ) -> DistributedOptimizer:
        """`base` inside the algorithm; an optimizer that already is a dpsgd one stays as it is.
        `broadcast_initial=False` where the trainer has restored each peer's own parameters already (a resume)."""
        if isinstance(base, DistributedOptimizer):
            if base.asynchronous:
                refuse_asynchronous(type(base).__name__, "this trainer")
            return base
        if self.factory is not None:
            return self.factory(base, comm)  # the factory decides broadcast_initial itself
        topology = topologies.make(self.topology, comm.size)
        return ALGORITHMS[self.name](
            base,
            topology=topology,
            comm=comm,
            module=module,
            buffers=self.buffers,
            broadcast_initial=broadcast_initial,
            **dict(self.options),
        )


# what an integration's `algorithm=` takes: a name (then `topology=` and `options=` beside it), an Algorithm
# (all of it said there) or a factory
Choice = str | Algorithm | Factory
Options = Mapping[str, Any] | None


def resolve(algorithm: Choice, where: str, topology: str = "ring", options: Options = None) -> Algorithm:
    """An `Algorithm` from what a user hands an integration: a name (checked here, before any peer starts: an
    unknown or asynchronous one is refused in one line), an `Algorithm`, or a factory `(base, comm) -> optimizer`.
    `where` names the trainer in the refusal."""
    if not isinstance(algorithm, str) and (topology != "ring" or options):
        raise ValueError(
            "topology= and options= go with an algorithm given by name; an Algorithm carries its own "
            "(Algorithm(name, topology=..., options=...)) and a factory builds its optimizer itself"
        )
    if isinstance(algorithm, Algorithm):
        chosen = algorithm
    elif isinstance(algorithm, str):
        chosen = Algorithm(algorithm, topology, dict(options or {}))
    elif callable(algorithm):
        return Algorithm(factory=algorithm)
    else:
        raise TypeError(
            f"algorithm= takes a name ({', '.join(ALGORITHMS)}), a dpsgd.integrations.Algorithm or a factory "
            f"(base, comm) -> optimizer; got {type(algorithm).__name__}"
        )
    if chosen.factory is None:
        if chosen.name not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {chosen.name!r}; valid algorithms: {', '.join(ALGORITHMS)}")
        if ALGORITHMS[chosen.name].asynchronous:
            refuse_asynchronous(chosen.name, where)
        if chosen.topology not in topologies.names():
            raise ValueError(f"unknown topology {chosen.topology!r}; valid: {', '.join(topologies.names())}")
        # a misspelt option refused here, by name, rather than as a TypeError once the trainer prepares
        check_options(f"algorithm {chosen.name}", ALGORITHMS[chosen.name], chosen.options, set_here=WRAP_SETS)
    return chosen


def communicator(timeout_s: float = dpsgd.comm.DEFAULT_TIMEOUT_S) -> Communicator:
    """This rank's communicator over the trainer's process group (torch.distributed, already started by the
    trainer): the optimizers' exchanges run on the trainer's own connections. A trainer run as one plain process
    starts no group: then a world of one peer (the `local` backend), so the same script runs on a laptop."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return dpsgd.comm.init("local", timeout_s=timeout_s)
    return dpsgd.comm.init("torch", timeout_s=timeout_s)
