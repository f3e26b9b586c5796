"""Fast simulation of many peers in one process: `Fleet` runs synchronous algorithms vectorized
(stacked parameters, one matrix product per gossip), `events` replays AD-PSGD in virtual time."""

from .events import Simulation
from .fleet import Fleet, FleetCommunicator, check_model
from .run import train_fleet

__all__ = ["Fleet", "FleetCommunicator", "Simulation", "check_model", "train_fleet"]
