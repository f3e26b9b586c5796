"""The `fleet` backend: every peer simulated in the driver's process (dpsgd.sim), on every core."""

from __future__ import annotations

import os
from pathlib import Path

from . import Backend, register


class FleetBackend(Backend):
    name = "fleet"
    checkpoints = False  # a fleet run is minutes

    def connect(self, timeout_s: float, **options):
        raise ValueError(
            "backend=fleet simulates every peer in one process and gives no communicator to one "
            "of them; run it with experiments.train backend=fleet, or choose local, mpi or torch"
        )

    def start(self, cfg: dict, run_dir: Path, argv: list[str], peers: int | None = None) -> dict:
        """The fleet simulates cfg["peers"]; `peers` (an elastic relaunch's count) never comes: validate refuses."""
        import torch

        from dpsgd.sim import train_fleet

        torch.set_num_threads(os.cpu_count() or 1)
        return train_fleet(cfg, run_dir)


register(FleetBackend())
