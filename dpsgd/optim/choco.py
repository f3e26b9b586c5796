"""Choco-SGD (Koloskova, Stich, Jaggi, ICML 2019, "Decentralized Stochastic Optimization and Gossip
Algorithms with Compressed Communication"): see `Choco`."""

from __future__ import annotations

import torch

from dpsgd.comm import codecs
from topologies import Topology

from .base import DistributedOptimizer

ORDERS = ("compress_first", "gossip_first")  # when the consensus step reads the public copies (see Choco)
COPIES_STARTS = ("zero", "model")  # what the public copies start as (see Choco)


class Choco(DistributedOptimizer):
    """CHOCO-SGD (Koloskova et al. 2019): gossip on compressed differences to public copies.

    Peer i keeps x_i, its public copy x_hat_i (what its neighbours know of x_i) and
    s_i = sum_j W[i,j] x_hat_j; with Q the compressor, gamma the consensus step and W static doubly
    stochastic, each step:

        x_i^{+} = x_i + d_i                              (the base step)
        q_i     = Q(x_i^{+} - x_hat_i)                   (sent to every neighbour as its encoded bytes)
        x_hat_i += q_i;   s_i += sum_j W[i,j] q_j
        x_i     = x_i^{+} + gamma (s_i - x_hat_i)

    x_hat and s start at 0; s is the memory-efficient variant of the paper's appendix (i never stores its
    neighbours' copies). `order` "gossip_first" is the later form of the rule (Koloskova, Lin, Stich & Jaggi, ICLR
    2020, Algorithm 1, and epfml/ChocoSGD's code): x_i = x_i^{+} + gamma (s_i - x_hat_i) with the copies as they
    stand, then q_i = Q(x_i - x_hat_i), x_hat_i += q_i, s_i += sum_j W[i,j] q_j. `copies_start` "model" starts
    x_hat_i at the peer's initial model and s_i at sum_j W[i,j] x_j^0 (one exact exchange; none when every peer
    starts from rank 0's model), as epfml/ChocoSGD's convex code does. q_i travels as the exact bytes of `Q.encode`
    (`Compressed.gossip`), so the bytes counted are a real network's, and each peer decodes its own message too, so
    x_hat_i is bit for bit the copy its neighbours hold. The model is compressed as one flat vector (top-k is
    global). Since W is column stochastic, sum_i (s_i - x_hat_i) = 0: the consensus step never moves the average
    model. With both set to the code's form, the trajectory equals epfml/ChocoSGD's convex code for top-k, random-k
    and QSGD, and with `order` "gossip_first" its deep-learning code's sign compressor on a one-tensor model (that
    code scales each tensor's signs apart; tests/test_reference_code.py).

    Options: the compressor Q, a name of `codecs.CODECS` with `ratio`, `levels`, `rescale`, `seed` (random
    codecs draw from (seed, sender rank, step)) or a Codec, or else the codec of a compressing communicator
    (`compression=` with `algorithm.compressor=null`: one vocabulary); the consensus step `gamma` in (0, 1].
    The paper's guarantees need a contractive Q (top-k, random-k, scaled sign, rescaled QSGD) and a gamma
    small enough for its delta; too large a gamma diverges.
    """

    topology: Topology  # required: gossip needs its mixing matrices
    label = "Choco-SGD"
    knobs = {"gamma": (0.1, 0.25, 0.5, 1.0)}
    cost_form = None  # its messages are encoded differences, not the models the map's gossip form sends

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        topology: Topology,
        compressor: str | codecs.Codec | None = None,
        gamma: float = 0.5,
        ratio: float | None = None,
        levels: int | None = None,
        rescale: bool = True,
        seed: int = 0,
        order: str = "compress_first",
        copies_start: str = "zero",
        **common,
    ):
        super().__init__(base, topology=topology, **common)
        self.require_topology()
        if order not in ORDERS:
            raise ValueError(f"Choco order must be one of {ORDERS}, got {order!r}")
        if copies_start not in COPIES_STARTS:
            raise ValueError(f"Choco copies_start must be one of {COPIES_STARTS}, got {copies_start!r}")
        self.order, self.copies_start = order, copies_start
        comm = self.comm
        codec: codecs.Codec | codecs.PowerSGD | str | None = compressor
        if isinstance(comm, codecs.Compressed):  # compression= names the codec
            if compressor is not None:
                raise ValueError(
                    f"Choco encodes its gossip with compressor={compressor}, and the communicator is compressed "
                    f"too ({comm.codec!r}): name the codec once (compression=none, or algorithm.compressor=null)"
                )
            codec = comm.codec
        elif isinstance(compressor, str):
            given = {"ratio": ratio, "levels": levels, "seed": seed, "rescale": rescale}
            codec = codecs.make(
                compressor, **{k: v for k, v in given.items() if k in codecs.OPTIONS.get(compressor, ())}
            )
        if not isinstance(codec, codecs.Codec):
            raise ValueError(
                f"Choco needs a compressor, a codec of one message "
                f"({', '.join(c for c in codecs.CODECS if c != 'powersgd')}): compressor=NAME "
                f"(algorithm.compressor in a config) or a compressing communicator (compression=NAME); got "
                f"{compressor!r}; without compression use DPSGD (algorithm=dpsgd)"
            )
        if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not 0 < gamma <= 1:
            raise ValueError(f"Choco gamma (the consensus step size) must be in (0, 1], got {gamma!r}")
        if topology.period != 1:
            raise ValueError(
                f"Choco keeps s_i = sum_j W[i,j] x_hat_j incrementally, which needs a static W; "
                f"topology {topology.name!r} changes over time (period {topology.period}) - use a "
                f"static topology"
            )
        self.require_topology("doubly", why=" (the consensus step must keep the average model)")
        self.compressor, self.gamma = codec, float(gamma)
        self.x_hat: torch.Tensor | None = None  # public copy of this peer's model (flat)
        self.s: torch.Tensor | None = None  # sum_j W[i,j] x_hat_j (flat)

    def update(self) -> None:
        params = self.params()
        if self.x_hat is None or self.s is None:
            self._start_copies(params)
        assert self.x_hat is not None and self.s is not None
        self.base.step()  # p = x^{t+1/2}
        x = self.comm.flatten(params)
        if not isinstance(self.comm, codecs.Compressed):
            self.comm = codecs.Compressed(self.comm, self.compressor)  # its gossip sends the codec's bytes
        if self.order == "gossip_first":
            x.add_(self.s - self.x_hat, alpha=self.gamma)
        q, mixed = self.comm.gossip(x - self.x_hat, self.topology, self.step_count)
        self.x_hat.add_(q)
        self.s.add_(mixed)
        if self.order == "compress_first":
            x.add_(self.s - self.x_hat, alpha=self.gamma)
        for p, value in zip(params, self.comm.unflatten(x, params)):
            p.copy_(value)
        self.step_count += 1

    def _start_copies(self, params: list[torch.Tensor]) -> None:
        x = self.comm.flatten(params)
        if self.copies_start == "zero":
            self.x_hat, self.s = torch.zeros_like(x), torch.zeros_like(x)
            return
        self.x_hat = x.clone()
        if self.broadcast_initial:  # every peer holds rank 0's model: sum_j W[i,j] x_j^0 = x_i^0
            self.s = x.clone()
        else:
            (mixed,) = self.comm.exact.mix([x], self.topology, self.step_count)
            self.s = mixed.clone()

    def algorithm_state(self):
        return {
            **super().algorithm_state(),
            "x_hat": None if self.x_hat is None else self.x_hat.clone(),
            "s": None if self.s is None else self.s.clone(),
        }

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        p = self.params()[0]
        self.x_hat = None if state.get("x_hat") is None else state["x_hat"].detach().clone().to(p.device, p.dtype)
        self.s = None if state.get("s") is None else state["s"].detach().clone().to(p.device, p.dtype)
