"""D-PSGD (Lian et al., NeurIPS 2017) and its quasi-global momentum variant QGM: see the classes."""

from __future__ import annotations

import torch

from dpsgd.comm import Handle
from topologies import Topology

from .base import DistributedOptimizer, snapshot

ORDERS = ("cta", "atc")


class DPSGD(DistributedOptimizer):
    """D-PSGD (Lian et al. 2017): a base step and one gossip average with the topology's W(k) per step.

    Peer i at step k, d_i = base(x_i, g_i) - x_i its local increment, g_i taken at x_i^k:

    - `order="cta"` (combine then adapt, the paper's): x_i <- sum_j W[i,j] x_j^k + d_i. Since x^k is
      known before the backward pass, `overlap=True` sends it from `start_communication()` (called by the
      training loop before the forward pass) and `step()` only waits for it.
    - `order="atc"` (adapt then combine): x_i <- sum_j W[i,j] (x_j^k + d_j).

    W(k) must be doubly stochastic (refused otherwise), so the average model moves only by the average
    increment. `qgm=True` adds quasi-global momentum (see `QGM`). Options: `order`, `overlap`, `qgm`,
    `qgm_beta`, `qgm_mu`, and the keywords every optimizer takes (`topology`, `comm`, `broadcast_initial`,
    `module`, `buffers`).
    Bytes per step: the model to each neighbour of W(k). With a compressing communicator (`compression=`,
    dpsgd.comm.codecs) each peer sends q_i = Q(x_i) and mixes x_i + sum_j W[i,j] (q_j - q_i), which keeps
    the average model.
    """

    topology: Topology  # required: gossip needs its mixing matrices
    elastic = True  # an added peer starts from the survivors' average, its momentum zero
    label = "D-PSGD"
    knobs = {}
    cost_form = "gossip"

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        topology: Topology,
        order: str = "cta",
        qgm: bool = False,
        qgm_beta: float = 0.9,
        qgm_mu: float | None = None,
        overlap: bool = False,
        **common,
    ):
        super().__init__(base, topology=topology, **common)
        self.require_topology("doubly", why=" (the average model must move only by the average increment)")
        if order not in ORDERS:
            raise ValueError(f"DPSGD order must be one of {ORDERS}, got {order!r}")
        if overlap and order != "cta":
            raise ValueError("DPSGD overlap=true needs order='cta': only x^k is known before the backward pass")
        self.order = order
        self.overlap = bool(overlap)
        self._in_flight: tuple[list[torch.Tensor], Handle] | None = None  # (x^k, handle) when started early
        self.qgm = bool(qgm)
        self.qgm_buffer: list[torch.Tensor] | None = None  # m_hat, the quasi-global momentum buffer
        if self.qgm:
            if not isinstance(base, torch.optim.SGD) or any(g.get("momentum", 0) for g in base.param_groups):
                raise ValueError(
                    "DPSGD(qgm=True) supplies its own momentum (qgm_beta): wrap "
                    "torch.optim.SGD(..., momentum=0), not a base with momentum or state of its own"
                )
            mu = qgm_beta if qgm_mu is None else qgm_mu
            for label, value in (("qgm_beta", qgm_beta), ("qgm_mu", mu)):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                    raise ValueError(f"DPSGD {label} must be in [0, 1), got {value!r}")
            self.qgm_beta, self.qgm_mu = float(qgm_beta), float(mu)

    @torch.no_grad()
    def start_communication(self) -> None:
        """Send x^k now (cta order): call it before the backward pass to overlap the two."""
        if self.order != "cta":
            raise RuntimeError("only order='cta' can start its exchange before the backward pass")
        if self._in_flight is None:
            x_k = snapshot(self.params())
            self._in_flight = (x_k, self.comm.start_mix(x_k, self.topology, self.step_count))

    def update(self) -> None:
        params = self.params()
        if self.qgm:
            x_before = snapshot(params)
            self._qgm_gradient(params)
        if self.order == "cta":
            self.start_communication()
            assert self._in_flight is not None
            x_k, handle = self._in_flight
            self.base.step()  # p = x^k + d
            mixed = handle.wait()
            self._in_flight = None
            for p, x, m in zip(params, x_k, mixed):
                p.sub_(x).add_(m)  # x^{k+1} = sum_j W_ij x_j^k + d
        else:
            self.base.step()
            for p, m in zip(params, self.comm.mix(params, self.topology, self.step_count)):
                p.copy_(m)
        if self.qgm:
            self._qgm_update(params, x_before)
        self.step_count += 1

    def _qgm_gradient(self, params) -> None:
        """p.grad <- g + beta m_hat: the heavy-ball direction with the quasi-global buffer."""
        if self.qgm_buffer is None:
            self.qgm_buffer = [torch.zeros_like(p) for p in params]
        for p, m in zip(params, self.qgm_buffer):
            if p.grad is not None:
                p.grad.add_(m, alpha=self.qgm_beta)

    def _qgm_update(self, params, x_before) -> None:
        """m_hat <- mu m_hat + (1 - mu) (x^k - x^{k+1}) / lr, with each parameter's group lr."""
        lr_of = {id(p): group["lr"] for group in self.param_groups for p in group["params"]}
        assert self.qgm_buffer is not None  # made by _qgm_gradient
        for p, x, m in zip(params, x_before, self.qgm_buffer):
            m.mul_(self.qgm_mu)
            if lr_of[id(p)] > 0:  # with lr 0 (frozen group) the movement is gossip alone: no direction to learn
                m.add_(x.sub_(p), alpha=(1 - self.qgm_mu) / lr_of[id(p)])

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        if self._in_flight is not None:
            raise RuntimeError("add_param_group() between start_communication() and step(): finish the step first")
        if self.qgm_buffer is not None:  # a new parameter's momentum starts at zero
            self.qgm_buffer += [torch.zeros_like(p) for p in params]

    def algorithm_state(self):
        if self._in_flight is not None:
            raise RuntimeError("state_dict() between start_communication() and step(): finish the step first")
        state = {**super().algorithm_state(), "order": self.order}
        if self.qgm:
            state["qgm_buffer"] = None if self.qgm_buffer is None else [t.clone() for t in self.qgm_buffer]
        return state

    def load_algorithm_state(self, state):
        super().load_algorithm_state(state)
        if self.qgm:
            self.qgm_buffer = self.own_tensors(state.get("qgm_buffer"))


class QGM(DPSGD):
    """D-PSGD with quasi-global momentum (Lin et al. 2021), registered as `qgm`: `DPSGD(qgm=True)`.

    With beta = `beta`, mu = `mu` (beta by default), m_hat_i = 0 at start and lr the current learning rate:
    m_i = g_i + beta m_hat_i is handed to the base SGD as its gradient, the order's gossip update follows
    (`atc` by default, as in the paper), then m_hat_i <- mu m_hat_i + (1 - mu) (x_i^k - x_i^{k+1}) / lr:
    the momentum follows the model's own displacement, gossip included, not the local gradient, so it
    approximates the global direction on heterogeneous data (the paper's Algorithm 1, QG-DSGDm). The base
    must be `torch.optim.SGD` with momentum 0 (QGM is its momentum); its weight decay is added to m_i, as in
    the authors' code. `order="cta"` applies the same buffer rule to the cta update. Other keywords are
    `DPSGD`'s (`topology`, `comm`, `broadcast_initial`, `overlap`).
    """

    elastic = False  # its momentum buffer is each peer's own estimate of the global direction: no rule for a new peer
    label = "QG-DSGDm"
    knobs = {}
    cost_form = "gossip"

    def __init__(
        self, base: torch.optim.Optimizer, *, order: str = "atc", beta: float = 0.9, mu: float | None = None, **options
    ):
        super().__init__(base, order=order, qgm=True, qgm_beta=beta, qgm_mu=mu, **options)
