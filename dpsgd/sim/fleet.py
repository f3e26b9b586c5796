"""A fleet: n peers of a synchronous algorithm simulated in one process, vectorized.

Every model parameter is one tensor with a leading peer axis (n, *shape). Each step draws every
peer's minibatch from its own share (`FleetBatches`, the real run's order), computes all peers'
losses in one call (torch.func.vmap over functional_call of the one model) and their gradients in one
backward pass, takes the base
optimizer's step on the stacked tensors (torch.optim's rules are elementwise, so one SGD/Adam/AdamW
over stacked tensors is n independent ones, with a step count shared by peers that step together),
and communicates as one matrix product with the topology's W(k) (`dpsgd.sim.gossip`).

The update equations are `dpsgd.optim`'s (see each class there; the rules below follow them line
by line on stacked tensors), and the options are parsed and validated by the real optimizer class
itself, built on the stacked base optimizer with a stand-in communicator of n peers: the same
config gives the same algorithm and the same errors. Bytes are counted as the communicators of
`dpsgd.comm.base` count them (all-reduce at the ring cost 2 (n - 1) / n M, gossip M per
out-neighbour), per peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.func import functional_call, vmap

from dpsgd import metrics
from dpsgd.build import BASE_KEYS, build_model, build_topology, load_data, partition
from dpsgd.optim import build as build_algorithm
from dpsgd.optim import build_base
from dpsgd.optim.checks import check_stochastic
from dpsgd.optim.local_sgd import outer_update

from .batches import FleetBatches
from .gossip import Gossip

ALGORITHMS = ("allreduce", "dpsgd", "qgm", "local_sgd", "slowmo", "diloco", "bmuf", "sgp", "choco", "d2",
              "gradient_tracking")


@dataclass
class Roster:
    """The stand-in communicator the real optimizer classes are built with to parse their options."""

    size: int
    rank: int = 0
    backend: str = "fleet"


class Fleet:
    """n peers of the experiment config `cfg` (the dict a Hydra run resolves): the same data split,
    shares, batch order, initial model, topology and algorithm as the real run with the same seed."""

    def __init__(self, cfg: dict, peers: int | None = None):
        algo = cfg["algorithm"]
        if algo.get("_target_") or algo.get("name") not in ALGORITHMS:
            raise ValueError(f"backend=fleet runs the algorithms {', '.join(ALGORITHMS)} (and adpsgd by the event "
                             f"simulator), not {algo.get('_target_') or algo.get('name')!r}; use backend=local")
        self.cfg, self.n = cfg, int(peers if peers is not None else cfg["peers"])
        seed, n = int(cfg["seed"]), self.n
        self.device = torch.device(cfg.get("device", "cpu"))
        self.split = load_data(cfg)
        self.shares = partition(cfg, self.split, n)
        self.batches = FleetBatches(self.split.x_train.to(self.device), self.split.y_train.to(self.device),
                                    self.shares, int(cfg["batch_size"]), seed)
        self.model = build_model(cfg, self.split).to(self.device)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.params = [p.detach().unsqueeze(0).repeat(n, *([1] * p.dim())).requires_grad_()
                       for p in self.model.parameters()]
        self.topology = build_topology(cfg, n)
        self.base = build_base(self.params, name=algo.get("optimizer", "sgd"), lr=float(algo["lr"]),
                               momentum=float(algo.get("momentum", 0.0)),
                               weight_decay=float(algo.get("weight_decay", 0.0)),
                               nesterov=bool(algo.get("nesterov", False)))
        options = {k: v for k, v in algo.items() if k not in BASE_KEYS}
        self.algorithm = build_algorithm(algo["name"], self.base, Roster(n), self.topology, **options)
        self.loss_fn = metrics.loss_function(self.split.y_train)
        self.steps_per_epoch = max(1, len(self.split.x_train) // (n * self.batches.batch_size))
        self.total_steps = int(cfg["epochs"]) * self.steps_per_epoch
        self.step_count = 0
        self.bytes_sent = torch.zeros(n, dtype=torch.float64)
        self.bytes_received = torch.zeros(n, dtype=torch.float64)
        self.comm_time_s = 0.0  # time the fleet spent in its communication operations (all peers at once)
        self.rule = _RULES[algo["name"]](self)
        self._losses = vmap(self._loss)

    # --- one step of every peer -------------------------------------------------------------
    def _loss(self, params: tuple, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(functional_call(self.model, dict(zip(self.names, params)), (x,)), y)

    def train_step(self) -> torch.Tensor:
        """Every peer's forward, backward and step; returns the (n,) minibatch losses."""
        x, y = self.batches.next()
        losses = self._losses(tuple(self.params), x, y)  # (n,): peer i's loss depends on its own slice only,
        grads = torch.autograd.grad(losses.sum(), self.params)  # so the gradient of the sum is each peer's own
        for p, g in zip(self.params, grads):
            p.grad = g
        with torch.no_grad():
            self.rule.step(self.step_count)
        self.step_count += 1
        return losses.detach()

    # --- views ------------------------------------------------------------------------------
    def flat(self) -> torch.Tensor:
        """The (n, D) matrix of every peer's parameters, in model.parameters() order."""
        return torch.cat([p.detach().reshape(self.n, -1) for p in self.params], 1)

    def parameters_of(self, rank: int) -> list[torch.Tensor]:
        return [p.detach()[rank] for p in self.params]

    @property
    def message_bytes(self) -> int:
        return sum(p[0].numel() * p.element_size() for p in self.params)

    # --- communication, counted as the real communicators count it --------------------------
    def mean(self, tensors: list[torch.Tensor], count: bool = True) -> list[torch.Tensor]:
        """Every peer's all-reduce mean (broadcast back to the peer axis), at the ring cost."""
        t0 = time.perf_counter()
        out = [t.mean(0, keepdim=True).expand_as(t) for t in tensors]
        if count:
            nbytes = sum(t[0].numel() * t.element_size() for t in tensors)
            ring = int(2 * (self.n - 1) / self.n * nbytes)  # as CommStats counts it
            self.bytes_sent += ring
            self.bytes_received += ring
            self.comm_time_s += time.perf_counter() - t0
        return out

    def gossip(self, mixing, tensors: list[torch.Tensor], extra_bytes: int = 0) -> list[torch.Tensor]:
        """sum_j W[i, j] x_j for each tensor; one message of all of them per out-neighbour."""
        t0 = time.perf_counter()
        out = [mixing.apply(t) for t in tensors]
        nbytes = sum(t[0].numel() * t.element_size() for t in tensors) + extra_bytes
        self.count(mixing, nbytes)
        self.comm_time_s += time.perf_counter() - t0
        return out

    def count(self, mixing, nbytes: int) -> None:
        self.bytes_sent += mixing.sends * nbytes
        self.bytes_received += mixing.recvs * nbytes


# --- the update rules, on stacked tensors (see dpsgd.optim for the equations) ---------------------
class _Rule:
    def __init__(self, fleet: Fleet):
        self.fleet, self.opt, self.base = fleet, fleet.algorithm, fleet.base
        self.params = fleet.params
        self.gossip = Gossip(fleet.topology, self.params[0].dtype, fleet.device)

    def step(self, k: int) -> None:
        raise NotImplementedError


class _AllReduce(_Rule):
    def step(self, k):
        for p, avg in zip(self.params, self.fleet.mean([p.grad for p in self.params])):
            p.grad = avg.clone()
        self.base.step()


class _DPSGD(_Rule):
    def __init__(self, fleet):
        super().__init__(fleet)
        self.buffer = None  # QGM's m_hat

    def step(self, k):
        opt, params = self.opt, self.params
        mixing = self.gossip.at(k)
        if opt.qgm:
            x_before = [p.clone() for p in params]
            if self.buffer is None:
                self.buffer = [torch.zeros_like(p) for p in params]
            for p, m in zip(params, self.buffer):
                p.grad.add_(m, alpha=opt.qgm_beta)
        if opt.order == "cta":
            x_k = [p.clone() for p in params]
            mixed = self.fleet.gossip(mixing, x_k)
            self.base.step()
            for p, x, m in zip(params, x_k, mixed):
                p.sub_(x).add_(m)
        else:
            self.base.step()
            for p, m in zip(params, self.fleet.gossip(mixing, params)):
                p.copy_(m)
        if opt.qgm:
            lr_of = {id(p): group["lr"] for group in self.base.param_groups for p in group["params"]}
            for p, x, m in zip(params, x_before, self.buffer):
                m.mul_(opt.qgm_mu)
                if lr_of[id(p)] > 0:
                    m.add_(x.sub_(p), alpha=(1 - opt.qgm_mu) / lr_of[id(p)])


class _LocalSGD(_Rule):
    def __init__(self, fleet):
        super().__init__(fleet)
        self.anchor = self.outer_buffer = None

    def step(self, k):
        opt, t = self.opt, k + 1
        if t <= opt.warmup_steps:
            for p, avg in zip(self.params, self.fleet.mean([p.grad for p in self.params])):
                p.grad = avg.clone()
            self.base.step()
            return
        if opt.outer != "average" and self.anchor is None:
            self.anchor = [a.clone() for a in self.fleet.mean(self.params)]
        self.base.step()
        s = t - opt.warmup_steps
        if opt.global_period is not None and s % opt.global_period == 0:
            self.average(group=False)
        elif s % opt.period == 0:
            self.average(group=opt.global_period is not None)

    def average(self, group: bool) -> None:
        opt, fleet, params = self.opt, self.fleet, self.params
        state = opt._state_tensors() if opt.inner_state == "average" else []
        tensors = params + state
        if not group:
            averaged = fleet.mean(tensors)
        elif opt.group_size > 1:
            g = opt.group_size
            t0 = time.perf_counter()
            averaged = [t.reshape(fleet.n // g, g, *t.shape[1:]).mean(1, keepdim=True)
                        .expand(fleet.n // g, g, *t.shape[1:]).reshape(t.shape) for t in tensors]
            nbytes = sum(t[0].numel() * t.element_size() for t in tensors) * (g - 1)
            fleet.bytes_sent += nbytes
            fleet.bytes_received += nbytes
            fleet.comm_time_s += time.perf_counter() - t0
        else:
            averaged = tensors
        averaged = [a.clone() for a in averaged]
        for s, a in zip(state, averaged[len(params):]):
            s.copy_(a)
        x_avg = averaged[: len(params)]
        if group or opt.outer == "average":
            for p, a in zip(params, x_avg):
                p.copy_(a)
        else:
            if self.outer_buffer is None:
                self.outer_buffer = [torch.zeros_like(a) for a in self.anchor]
            i = 0
            for pg in self.base.param_groups:
                gamma = float(pg["lr"])
                if opt.outer == "momentum" and not gamma > 0:
                    raise ValueError(f"LocalSGD outer='momentum' divides by the base lr, which is {gamma}")
                for p in pg["params"]:
                    outer_update(opt.outer, self.anchor[i], self.outer_buffer[i], x_avg[i], opt.outer_lr,
                                 opt.outer_momentum, gamma)
                    p.copy_(self.anchor[i])
                    i += 1
        if opt.inner_state == "reset":
            self.base.state.clear()


class _SGP(_Rule):
    def __init__(self, fleet):
        super().__init__(fleet)
        self.x = self.w = None

    def step(self, k):
        params = self.params
        if self.x is None:
            self.x = [p.clone() for p in params]
            self.w = torch.ones(self.fleet.n, 1, dtype=params[0].dtype, device=params[0].device)
        if self.opt.topology.period is None:
            check_stochastic(self.opt.topology, "SGP", "column", k)
        z = [p.clone() for p in params]
        self.base.step()
        for x, p, zk in zip(self.x, params, z):
            x.add_(p).sub_(zk)
        mixing = self.gossip.at(k)
        mixed = self.fleet.gossip(mixing, self.x, extra_bytes=params[0].element_size())
        self.w = mixing.apply(self.w)
        for x, m, p in zip(self.x, mixed, params):
            x.copy_(m)
            torch.div(x, self.w.reshape(-1, *([1] * (x.dim() - 1))), out=p)


class _Choco(_Rule):
    def __init__(self, fleet):
        super().__init__(fleet)
        self.x_hat = self.s = None

    def step(self, k):
        fleet, opt = self.fleet, self.opt
        self.base.step()
        x = fleet.flat().clone()
        if self.x_hat is None:
            self.x_hat, self.s = torch.zeros_like(x), torch.zeros_like(x)
        t0 = time.perf_counter()
        diff = x - self.x_hat
        # each peer's message is compressed with its own key (rank, step), as on a real peer
        q = torch.stack([opt.compressor.compress(diff[i], (i, k)) for i in range(fleet.n)])
        mixing = self.gossip.at(0)
        self.x_hat.add_(q)
        self.s.add_(mixing.apply(q))
        fleet.count(mixing, opt.compressor.nbytes(x.shape[1], x.dtype))
        fleet.comm_time_s += time.perf_counter() - t0
        x.add_(self.s - self.x_hat, alpha=opt.gamma)
        offset = 0
        for p in self.params:
            width = p[0].numel()
            p.copy_(x[:, offset : offset + width].reshape(p.shape))
            offset += width


class _D2(_Rule):
    def __init__(self, fleet):
        super().__init__(fleet)
        self.gossip = Gossip(fleet.topology, self.params[0].dtype, fleet.device, transform=self.lazy)
        self.previous = None

    def lazy(self, w, step):
        if not self.opt._check(step):  # the real D2's check: symmetric, lambda_min, lazy_mixing
            return w
        return (w + np.eye(len(w))) / 2

    def step(self, k):
        params = self.params
        x_k = [p.clone() for p in params]
        if self.previous is None:
            self.previous = [x.clone() for x in x_k]
        self.base.step()
        after = [p.clone() for p in params]
        for p, x, m in zip(params, x_k, self.previous):
            p.add_(x).sub_(m)
        self.previous = after
        for p, m in zip(params, self.fleet.gossip(self.gossip.at(k), params)):
            p.copy_(m)


class _GradientTracking(_Rule):
    def __init__(self, fleet):
        super().__init__(fleet)
        self.correction = None

    def step(self, k):
        params = self.params
        if self.opt.topology.period is None:
            check_stochastic(self.opt.topology, "GradientTracking", "doubly", k)
        grads = [p.grad.clone() for p in params]
        if self.correction is None:
            self.correction = [torch.zeros_like(p) for p in params]
        for p, g, c in zip(params, grads, self.correction):
            p.grad.copy_(g + c)
        trackers = [p.grad.clone() for p in params]
        self.base.step()
        n = len(params)
        mixed = self.fleet.gossip(self.gossip.at(k), [*params, *trackers])
        for p, m in zip(params, mixed[:n]):
            p.copy_(m)
        for c, wy, g in zip(self.correction, mixed[n:], grads):
            torch.sub(wy, g, out=c)


_RULES = {"allreduce": _AllReduce, "dpsgd": _DPSGD, "qgm": _DPSGD, "local_sgd": _LocalSGD, "slowmo": _LocalSGD,
          "diloco": _LocalSGD, "bmuf": _LocalSGD, "sgp": _SGP, "choco": _Choco, "d2": _D2,
          "gradient_tracking": _GradientTracking}
