"""experiments.cost_model, the map's time per run, against the emulator's clock of real (threaded) peers: the same
steps of each algorithm under the same network cell, hosts and straggler included."""

from __future__ import annotations

import pytest
from emulated import emulated_steps

import topologies
from dpsgd.comm import run_local
from dpsgd.optim import DPSGD, AllReduce, DiLoCo, LocalSGD
from experiments.cost_model import Algorithm, Network, clock_after

NUMEL = 10_000
NBYTES = 4 * NUMEL
COMPUTE = 0.01


def _emulated(comm, make, network: dict, steps: int) -> float:
    return emulated_steps(comm, make, NUMEL, network, steps, lr=0.01)[0]


CASES = [
    (Algorithm("allreduce", (), "allreduce"), lambda b, c: AllReduce(b, comm=c)),
    (Algorithm("local_sgd", (), "periodic", period=3), lambda b, c: LocalSGD(b, comm=c, period=3)),
    (Algorithm("diloco", (), "periodic", period=4), lambda b, c: DiLoCo(b, comm=c, period=4)),
    (
        Algorithm("dpsgd ring", (), "gossip", topology="ring"),
        lambda b, c: DPSGD(b, comm=c, topology=topologies.make("ring", c.size)),
    ),
    (
        Algorithm("dpsgd one-peer", (), "gossip", topology="one_peer_exponential"),
        lambda b, c: DPSGD(b, comm=c, topology=topologies.make("one_peer_exponential", c.size)),
    ),
]
CELLS = [
    Network(1e-3, 1e7),  # a per-peer link
    Network(1e-3, 1e7, peers_per_host=2, slowdown=3.0),  # 2 per host, peer 1 three times slower
    Network(5e-3, 1e8, peers_per_host=4, slowdown=2.0),
    Network(1e-3, 1e7, peers_per_host=2, allreduce="halving_doubling"),  # MPICH's all-reduce
]


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"ppr{c.peers_per_host}_slow{c.slowdown}_{c.allreduce}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0].label)
def test_clock_after_equals_the_emulators_clock(case, cell):
    algorithm, make = case
    n, steps = 8, 9
    emulated = run_local(n, _emulated, make, cell.config(COMPUTE, n), steps)
    predicted = clock_after(algorithm, steps, n, NBYTES, COMPUTE, cell)
    assert max(emulated) == pytest.approx(predicted, rel=1e-9)


def test_a_straggler_paces_the_synchronous_algorithms_not_adpsgd():
    """Free links: the latest clock of a ring and of all-reduce is the straggler's own; AD-PSGD's global step
    runs at the peers' summed rates."""
    ring = Algorithm("dpsgd ring", (), "gossip", topology="ring")
    cell = Network(0.0, None, slowdown=4.0)
    assert clock_after(ring, 40, 64, NBYTES, COMPUTE, cell) == pytest.approx(40 * 4 * COMPUTE)
    allreduce = Algorithm("allreduce", (), "allreduce")
    assert clock_after(allreduce, 40, 64, NBYTES, COMPUTE, cell) == pytest.approx(40 * 4 * COMPUTE)
    adpsgd = Algorithm("adpsgd", (), "async")
    assert clock_after(adpsgd, 40, 64, NBYTES, COMPUTE, cell) == pytest.approx(40 * 64 / (63 + 1 / 4) * COMPUTE)
