"""A user's own classes, named by `_target_`: a model (test_build.py), an algorithm (test_contract.py) and an
asynchronous algorithm (test_async_plugin.py)."""

from torch import nn

from dpsgd.optim import ADPSGD, DistributedOptimizer


class TinyNet(nn.Module):
    def __init__(self, inputs: int = 64, classes: int = 10, width: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)


class AlternatingGossip(DistributedOptimizer):
    """A user's own algorithm, written outside the package with the communicator's operations only:
    the base step, then gossip with W(k), and every `period`-th step an exact average (with a
    momentum-like pull of `pull` toward the model of the last exact average)."""

    def __init__(self, base, *, period: int = 5, pull: float = 0.1, **common):
        super().__init__(base, **common)  # topology=, comm=, broadcast_initial=, module=, buffers=
        self.require_topology("doubly")
        self.period, self.pull = period, pull
        self.anchor = None

    def update(self):
        params = self.params()
        self.base.step()
        if (self.step_count + 1) % self.period == 0:
            mixed = self.comm.allreduce_mean(params)
            self.anchor = [m.clone() for m in mixed]
        else:
            mixed = self.comm.mix(params, self.topology, self.step_count)
        for i, (p, m) in enumerate(zip(params, mixed)):
            p.copy_(m if self.anchor is None else m + self.pull * (self.anchor[i] - m))
        self.step_count += 1


def line_of_peers(n: int, self_weight: float = 0.5):
    """A user's own topology, named by `topology._target_`: peers on a line (a ring without its closing link)."""
    import networkx

    import topologies

    return topologies.from_networkx(networkx.path_graph(n), self_weight=self_weight, name="line")


class PartialGossip(ADPSGD):
    """A user's own asynchronous algorithm: AD-PSGD's protocol (roles, partner draws, locks, budgets) with
    a partial averaging: each side moves `weight` of the way to the other's model, x_i <- x_i + w (x_j - x_i)
    (w = 1/2 is AD-PSGD's), so the sum of the models is still conserved. Its figures go to summary.json's
    block `partial_gossip`."""

    summary_key = "partial_gossip"

    def __init__(self, base, *, weight: float = 0.25, **options):
        if not 0 < weight <= 0.5:
            raise ValueError(f"PartialGossip's weight must be in (0, 0.5], got {weight}")
        super().__init__(base, **options)
        self.weight = weight

    def mix(self, own, other):
        own.lerp_(other, self.weight)
