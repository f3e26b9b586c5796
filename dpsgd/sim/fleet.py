"""A fleet: n peers of a synchronous algorithm simulated in one process, vectorized.

Every model parameter is one tensor with a leading peer axis (n, *shape). Each step draws every
peer's minibatch from its own share (`FleetBatches`, the real run's order), computes all peers'
losses in one call (torch.func.vmap over functional_call of the one model; a convolutional one or one
of linear layers as one wide network, dpsgd.sim.wide, when it computes vmap's losses) and their
gradients in one backward pass, and calls the algorithm's own `step()` (dpsgd.optim, unchanged) on the
stacked tensors.
torch.optim's rules are elementwise, so one SGD/Adam/AdamW over stacked tensors is n independent ones.

The algorithm talks to its peers through `FleetCommunicator`, whose operations act on the peer axis:
a mean over it for all-reduce, one (sparse) product with the topology's W(k) for gossip. Bytes are
counted per peer as the real communicators count them (all-reduce at the ring cost, gossip M per
out-neighbour), so any synchronous algorithm, a user's `_target_` one included, runs here as written.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from scipy import sparse
from torch.func import functional_call, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from dpsgd import metrics, placement
from dpsgd.build import build_model, build_optimizer, build_topology, plan, schedule, step_options
from dpsgd.comm.base import Handle, MessagelessCommunicator, _Done, ring_allreduce_bytes
from dpsgd.config import RunConfig
from dpsgd.stepping import Stepper, TrainStep
from topologies import Topology
from topologies.matrices import canonical, entries, is_sparse

from .batches import FleetBatches
from .wide import peer_outputs, wide_input, widen

SPARSE_BELOW = 0.25  # density of W under which the product is taken with a sparse matrix
GATHER_UP_TO = 16  # on a GPU, W with at most this many nonzeros per row is applied as that many gathers


@dataclass(frozen=True)
class Mixing:
    """W(k) ready to apply: `matrix` (in the tensors' dtype), and per peer the number of
    peers it sends to (`sends`, off-diagonal nonzeros of its column) and receives from (`recvs`, of its row).
    `gather`, when set: (columns, weights), each (n, d), row i's d nonzeros (padded with weight 0), applied
    as d gathers of rows instead of the product (a GPU: no n x n product, no sparse kernel)."""

    matrix: torch.Tensor | None  # dense, or sparse (COO) when W has few nonzeros; None with `gather`
    sends: torch.Tensor
    recvs: torch.Tensor
    gather: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """sum_j W[i, j] x_j for every peer i, x with a leading peer axis."""
        flat = x.reshape(x.shape[0], -1)
        if self.gather is not None:
            cols, weights = self.gather
            out = flat.index_select(0, cols[:, 0]).mul_(weights[:, :1])
            for k in range(1, cols.shape[1]):
                out.addcmul_(flat.index_select(0, cols[:, k]), weights[:, k : k + 1])
        elif self.matrix is not None and self.matrix.is_sparse:
            out = torch.sparse.mm(self.matrix, flat)
        else:
            assert self.matrix is not None
            out = self.matrix @ flat
        return out.reshape(x.shape)


def mixing(w, dtype: torch.dtype, device, gather: bool | None = None) -> Mixing:
    """W (a dense array or a scipy.sparse matrix) ready to apply to tensors of `dtype` on `device`: sparse on a
    CPU when it has few nonzeros; as gathers (`gather`; None: on a GPU, when rows have at most GATHER_UP_TO
    nonzeros)."""
    w = canonical(w) if is_sparse(w) else np.asarray(w, dtype=np.float64)
    n = w.shape[0]
    rows, cols, values = entries(w)  # row-major: the order of a coalesced COO tensor
    off = rows != cols
    sends = torch.as_tensor(np.bincount(cols[off], minlength=n), dtype=torch.float64)
    recvs = torch.as_tensor(np.bincount(rows[off], minlength=n), dtype=torch.float64)
    per_row = np.bincount(rows, minlength=n)
    if gather is None:
        gather = device.type != "cpu" and per_row.max() <= GATHER_UP_TO
    if gather:
        d = int(per_row.max())
        slot = np.arange(len(rows)) - np.repeat(np.cumsum(per_row) - per_row, per_row)  # k-th nonzero of its row
        columns = np.repeat(np.arange(n)[:, None], d, 1)  # padding: the row itself, weight 0
        weights = np.zeros((n, d))
        columns[rows, slot], weights[rows, slot] = cols, values
        as_device = (torch.as_tensor(columns, device=device), torch.as_tensor(weights, dtype=dtype, device=device))
        return Mixing(None, sends, recvs, as_device)
    if len(rows) < SPARSE_BELOW * n * n and device.type == "cpu":  # no dense (n, n) tensor on the way
        index = torch.as_tensor(np.stack([rows, cols]))
        nonzeros = torch.as_tensor(values, dtype=dtype)
        coo = torch.sparse_coo_tensor(index, nonzeros, (n, n), device=device, is_coalesced=True, check_invariants=False)
        return Mixing(coo, sends, recvs)
    dense = w.toarray() if is_sparse(w) else w
    return Mixing(torch.as_tensor(dense, dtype=dtype, device=device), sends, recvs)


class FleetCommunicator(MessagelessCommunicator):
    """The communication of n peers whose tensors carry a leading peer axis."""

    backend = "fleet"

    def __init__(self, n: int):
        super().__init__(rank=0, size=n)
        self.peer_shape = (n,)
        self.bytes_sent = torch.zeros(n, dtype=torch.float64)
        self.bytes_received = torch.zeros(n, dtype=torch.float64)
        self._mixings: dict[tuple, Mixing] = {}

    def _done(self, op: str, result: list[torch.Tensor], started: float) -> Handle:
        if self._counting:
            self.stats.comm_time_s += time.perf_counter() - started
        return Handle(self, op, _Done(), lambda: result, [])

    def count_per_peer(self, sent, received) -> None:
        if self._counting:
            self.bytes_sent += sent
            self.bytes_received += received

    @staticmethod
    def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
        return sum(t[0].numel() * t.element_size() for t in tensors)

    def start_allreduce_mean(self, tensors: Sequence[torch.Tensor], stream: str = "") -> Handle:
        return self._allreduce(tensors, "allreduce_mean", torch.mean)

    def start_allreduce_sum(self, tensors: Sequence[torch.Tensor]) -> Handle:
        return self._allreduce(tensors, "allreduce_sum", torch.sum)

    def _allreduce(self, tensors: Sequence[torch.Tensor], op: str, reduce) -> Handle:
        started = time.perf_counter()
        out = [reduce(t, 0, keepdim=True).expand_as(t).contiguous() for t in tensors]
        ring = int(ring_allreduce_bytes(self._nbytes(tensors), self.size))  # as CommStats counts it
        self.count_per_peer(ring, ring)
        return self._done(op, out, started)

    def mixing(self, topology: Topology, step: int, like: torch.Tensor, lazy: bool = False) -> Mixing:
        """W(step) (lazy: (I + W) / 2) in `like`'s dtype and device, built once per step of a period."""
        key = (id(topology), step % topology.period if topology.period else None, lazy, like.dtype, like.device)
        if key[1] is not None and key in self._mixings:
            return self._mixings[key]
        # sparse from a Topology (no (n, n) array for a large one); a duck-typed schedule gives its dense W
        sparse_w = getattr(topology, "sparse_mixing_matrix", None)
        w = sparse_w(step) if sparse_w is not None else topology.mixing_matrix(step)
        if lazy:
            w = (w + (sparse.eye_array(w.shape[0]) if is_sparse(w) else np.eye(len(w)))) / 2
        m = mixing(w, like.dtype, like.device)
        if key[1] is not None:
            self._mixings[key] = m
        return m

    def _start_mix(
        self, tensors: Sequence[torch.Tensor], topology: Topology, step: int, lazy: bool, lent: bool
    ) -> Handle:
        started = time.perf_counter()  # the stacked product writes new tensors: lent or not, the same
        m = self.mixing(topology, step, tensors[0], lazy)
        out = [m.apply(t) for t in tensors]
        nbytes = self._nbytes(tensors)  # one message of all tensors per out-neighbour
        self.count_per_peer(m.sends * nbytes, m.recvs * nbytes)
        return self._done("neighbor_average", out, started)

    def group_mean(self, tensors: Sequence[torch.Tensor], group_size: int) -> list[torch.Tensor]:
        started, n, g = time.perf_counter(), self.size, group_size
        out = [
            t.reshape(n // g, g, *t.shape[1:]).mean(1, keepdim=True).expand(n // g, g, *t.shape[1:]).reshape(t.shape)
            for t in tensors
        ]
        self.count_per_peer(self._nbytes(tensors) * (g - 1), self._nbytes(tensors) * (g - 1))
        return self._done("neighbor_average", out, started).wait()

    def broadcast_(self, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
        with torch.no_grad():
            for t in tensors:
                t.copy_(t[root].clone().expand_as(t))

    def flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(self.size, -1) for t in tensors], 1)

    def unflatten(self, flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out, offset = [], 0
        for t in like:
            width = t[0].numel()
            out.append(flat[:, offset : offset + width].reshape(t.shape))
            offset += width
        return out


def check_model(model: torch.nn.Module) -> None:
    """The fleet stacks every peer's parameters, not its buffers: a model whose training changes its buffers
    (BatchNorm's running statistics, one set per peer) is refused."""
    if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ValueError(
            "the fleet stacks each peer's parameters but not BatchNorm's running statistics, which are per peer: "
            "run it on real peers (backend=local, mpi or torch) or use model.norm=group"
        )


class Fleet:
    """n peers of the run `config` (a dpsgd.config.RunConfig): the same data split, shares, batch order, initial
    model, topology and algorithm as the real run with the same seed. `step(k)` takes every peer's step k
    (dpsgd.stepping.TrainStep) and returns their (n,) minibatch losses."""

    def __init__(self, config: RunConfig, peers: int | None = None):
        self.config, self.n = config, int(peers if peers is not None else config.peers)
        n = self.n
        self.device = placement.single_device(config.device)
        self.plan = run = plan(config, n)
        self.batches = FleetBatches(
            run.split.x_train.to(self.device),
            run.split.y_train.to(self.device),
            run.shares,
            run.batch_size,
            config.seed,
            config.data.augment,
        )
        self.model = build_model(config.model, run.split, config.seed, config.data.name).to(self.device)
        check_model(self.model)
        self.names = [name for name, _ in self.model.named_parameters()]
        self.params = [
            p.detach().unsqueeze(0).repeat(n, *([1] * p.dim())).requires_grad_() for p in self.model.parameters()
        ]
        self.topology = build_topology(config.topology, n)
        self.comm = FleetCommunicator(n)
        self.algorithm = build_optimizer(config, self.params, self.topology, self.comm, model=self.model)
        self.loss_fn = metrics.loss_function(run.split.y_train)
        self._losses = vmap(self._loss)
        # precision, micro-batches, clipping (each peer's own norm) and the schedule, as on real peers
        self.stepper = Stepper(
            step_options(config), self.algorithm, schedule(config, run.total_steps), self.device, peer_axis=True
        )
        self._wide = self._widened()
        self.step = TrainStep(self.stepper, self.batches, self.losses, self.device, split_dim=1)

    def _loss(self, params: tuple, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(functional_call(self.model, dict(zip(self.names, params)), (x,)), y)

    def _widened(self) -> torch.nn.Module | None:
        """The model as one wide network (dpsgd.sim.wide) when it takes that form and computes vmap's losses on
        3 peers with different weights; otherwise None (vmap)."""
        try:
            wide, probe = widen(self.model, self.n), widen(self.model, 3)
        except ValueError:
            return None
        gen = torch.Generator().manual_seed(0)
        params = tuple(
            p[:1].detach().expand(3, *p.shape[1:]) + 0.01 * torch.randn((3, *p.shape[1:]), generator=gen).to(p)
            for p in self.params
        )
        take = torch.arange(3 * self.batches.batch_size, device=self.device) % len(self.batches.x)
        x = self.batches.x[take].reshape(3, self.batches.batch_size, *self.batches.x.shape[1:])
        y = self.batches.y[take].reshape(3, self.batches.batch_size, *self.batches.y.shape[1:])
        with torch.no_grad():
            try:
                got = self._wide_losses(probe, params, x, y)
            except RuntimeError:  # a custom forward the layout does not fit (e.g. a reshape of the channels)
                return None
            ok = torch.allclose(got, self._losses(params, x, y), rtol=1e-4, atol=1e-6)
        return wide if ok else None

    def _wide_losses(self, wide: torch.nn.Module, params: Sequence[torch.Tensor], x, y) -> torch.Tensor:
        channels = bool(wide.channels)
        inputs = (wide_input(x, channels),)
        out = peer_outputs(functional_call(wide, dict(zip(self.names, params)), inputs), channels)
        return self.loss_fn(out, y, reduction="none").reshape(len(out), -1).mean(1)

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every peer's gradient of its loss on its batch (x, y with a leading peer axis) in `.grad`, in fp32 and
        one micro-batch (the step's arithmetic without the optimizer's); the (n,) losses."""
        for p in self.params:
            p.grad = None
        losses = self.losses(x, y)
        losses.sum().backward()  # peer i's loss depends on its own weights only: each peer's own gradient
        return losses.detach()

    def losses(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Every peer's loss on its micro-batch (x, y with a leading peer axis): the (n,) losses."""
        if self._wide is not None:
            return self._wide_losses(self._wide, self.params, x, y)
        with sdpa_kernel(
            SDPBackend.MATH
        ):  # attention as its decomposed products: vmap has no rule for the fused kernels
            return self._losses(tuple(self.params), x, y)

    def flat(self) -> torch.Tensor:
        """The (n, D) matrix of every peer's parameters, in model.parameters() order."""
        return self.comm.flatten(self.params)
