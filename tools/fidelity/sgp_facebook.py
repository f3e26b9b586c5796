"""facebookresearch/stochastic_gradient_push's SGP (gossip/distributed.py GossipDataParallel with its default
graph, NPeerDynamicDirectedExponentialGraph, UniformMixing and PushSum) on 4 gloo processes: every peer's model.

Two cases: "x", the default graph (regular: every peer receives as many messages as it sends, so the push-sum
weights stay 1 and the wrapper mixes lazily), and "nonregular_x", a graph given to the wrapper (`graph=`) whose
in-degrees differ, so that the weights move and the de-biasing x / w is exercised: a GraphManager subclass whose
phone book (an input, not the rule) is 0: [1, 3], 1: [0, 2], 2: [0, 3], 3: [2, 1], one peer per iteration, rotated
every step as the reference rotates a dynamic graph (in-degrees 2, 1, 1, 0 at phone-book index 0; it says
is_regular_graph False, so the wrapper mixes on transfer, not lazily).

Usage: python tools/fidelity/sgp_facebook.py SGP_CHECKOUT tests/fixtures/sgp_facebook.npz
(SGP_CHECKOUT: a clone of https://github.com/facebookresearch/stochastic_gradient_push.)

Stubbed, none of it the rule: the process group (gloo on 127.0.0.1, one process per peer); the CUDA parts the
wrapper calls with no GPU here, as no-ops: torch.cuda.current_stream / torch.cuda.Stream (an object whose
synchronize and wait_stream do nothing), torch.cuda.stream (a null context), Tensor.pin_memory and Tensor.cuda
(the tensor itself: graph_manager.Edge warms each edge's group up with an all-reduce of a one-element tensor);
and GossipDataParallel.scatter (the scatter of the inputs onto GPUs: the inputs as given). The loop is
gossip_sgd.py's: forward (whose pre-hook adds the gossip received and de-biases), backward (whose hook turns the
model back into push-sum numerators), optimizer.step(), model.transfer_params() (starts the next gossip).
Inputs: float32 parameters W (8, 12) and b (12,), flat x0 = default_rng(0).normal(size=108) (W, then b); at step t
peer i's loss is 0.5 ||x - c[t, i]||^2, c = default_rng(1).normal(size=(12, 4, 108)) * (1 + i) cast to float32;
plain SGD lr 0.05, 12 steps. Per step: each peer's de-biased model as its next forward sees it (after the gossip
of that step's transfer is added), read after the last step by one more forward."""

from __future__ import annotations

import contextlib
import os
import sys

import common
import numpy as np

SHAPES, STEPS, N, LR = ((8, 12), (12,)), 12, 4, 0.05
NUMEL = sum(int(np.prod(s)) for s in SHAPES)


def inputs():
    x0 = np.random.default_rng(0).normal(size=NUMEL).astype(np.float32)
    c = np.random.default_rng(1).normal(size=(STEPS, N, NUMEL))
    return x0, (c * (1 + np.arange(N))[None, :, None]).astype(np.float32)


class NoStream:
    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


NONREGULAR = {0: [1, 3], 1: [0, 2], 2: [0, 3], 3: [2, 1]}  # each rank's out-peers, one per iteration in turn


def peer(rank, n, port, checkout, tmp, case):
    import torch

    common.init(rank, n, port)
    torch.cuda.current_stream = lambda *args, **kwargs: NoStream()
    torch.cuda.Stream = lambda *args, **kwargs: NoStream()
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # graph_manager.Edge's warm-up all-reduce of a [1]
    sys.path.insert(0, checkout)
    from gossip import GossipDataParallel
    from gossip.graph_manager import GraphManager

    class NonRegular(GraphManager):
        def _make_graph(self):
            for r in range(self.world_size):
                self._add_peers(r, NONREGULAR[r])

        def is_regular_graph(self):
            return False

        def is_bipartite_graph(self):
            return False

        def is_passive(self, rank=None):
            return False

        def is_dynamic_graph(self, graph_type=None):
            return True

    GossipDataParallel.scatter = lambda self, inputs, kwargs, device_ids: ((inputs,), (kwargs,))
    x0, c = inputs()

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            at = 0
            for name, shape in zip(("w", "b"), SHAPES):
                size = int(np.prod(shape))
                value = torch.from_numpy(x0[at : at + size].reshape(shape).copy())
                self.register_parameter(name, torch.nn.Parameter(value))
                at += size

        def forward(self, x):
            return torch.cat([self.w.reshape(-1), self.b]) + 0 * x

    graph = NonRegular(rank, n) if case == "nonregular_x" else None
    model = GossipDataParallel(Flat(), device_ids=[0], rank=rank, world_size=n, graph=graph)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    seen = []
    for t in range(STEPS + 1):
        out = model(torch.zeros(1))  # the pre-hook adds the gossip received, then de-biases
        seen.append(out.detach().numpy().copy())
        if t == STEPS:
            break
        opt.zero_grad()
        (0.5 * (out - torch.from_numpy(c[t, rank])).pow(2).sum()).backward()
        opt.step()
        model.transfer_params()
    np.save(f"{tmp}.{case}.rank{rank}.npy", np.array(seen[1:]))
    os._exit(0)  # the gossip thread is a daemon waiting on its flag


if __name__ == "__main__":
    checkout, out = sys.argv[1], sys.argv[2]
    arrays = {}
    for case in ("x", "nonregular_x"):
        common.spawn(peer, N, checkout, out, case)
        arrays[case] = np.stack([np.load(f"{out}.{case}.rank{r}.npy") for r in range(N)], axis=1)
        for r in range(N):
            os.remove(f"{out}.{case}.rank{r}.npy")
    meta = {
        "repo": "https://github.com/facebookresearch/stochastic_gradient_push",
        "file": "gossip/distributed.py (GossipDataParallel), gossip/gossiper.py (PushSum), gossip/graph_manager.py",
        "commit": common.commit(checkout),
        "inputs": __doc__.split("Inputs: ")[1].strip(),
        "lr": LR,
        "peers": N,
        "nonregular_graph": {str(r): peers for r, peers in NONREGULAR.items()},
        "stubbed": __doc__.split("Stubbed, ")[1].split("\nInputs")[0].strip(),
    }
    common.write(out, meta, arrays)
