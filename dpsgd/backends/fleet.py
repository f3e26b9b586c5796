"""The `fleet` backend: every peer simulated in the driver's process (dpsgd.sim), on every core by default.
Its communicator (dpsgd.sim.fleet) serves all peers at once, so it has no transport to give one peer."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dpsgd.config import RunConfig

from .driver import Backend


class FleetBackend(Backend):
    name = "fleet"
    checkpoints = False  # a fleet run is minutes

    # threads: torch's; compute_*: the event simulator's virtual compute time per step (dpsgd.sim.events)
    config_options = {
        "threads": None,
        "compute_mean_s": 0.01,
        "compute_distribution": "constant",
        "compute_sigma": 0.5,
        "compute_shape": 2.5,
    }

    def options(self, backend: Mapping, device: str) -> dict:
        return {"threads": threads(backend)}

    def connect(self, timeout_s: float, **options):
        raise ValueError(
            "backend=fleet simulates every peer in one process and gives no communicator to one "
            "of them; run it with experiments.train backend=fleet, or choose local, mpi or torch"
        )

    def start(self, config: RunConfig, run_dir: Path, argv: list[str], peers: int | None = None) -> dict:
        """The fleet simulates config.peers; `peers` (an elastic relaunch's count) never comes: validate refuses."""
        import torch

        from dpsgd.sim import train_fleet

        torch.set_num_threads(threads(config.backend.options))
        return train_fleet(config, run_dir)


def threads(backend: Mapping) -> int:
    """torch's intra-op threads for the fleet: `backend.threads`, or every core when it is null. Small models on a
    shared machine run faster on 1: idle threads spin-wait for cores that other jobs hold."""
    wanted = backend.get("threads")
    if wanted is None:
        return os.cpu_count() or 1
    if isinstance(wanted, bool) or not isinstance(wanted, int) or wanted < 1:
        raise ValueError(f"backend.threads must be a whole number >= 1, or null for every core; got {wanted!r}")
    return wanted
