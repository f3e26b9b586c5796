"""DeMo, decoupled momentum optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870): see `DeMo`."""

from __future__ import annotations

import contextlib

import torch

from .base import DistributedOptimizer
from .chunked import ChunkedTopK, gathered_mean, refuse_compression

AGGREGATES = ("senders", "mean")  # how the peers' coefficients combine (see DeMo)


@contextlib.contextmanager
def without_weight_decay(base: torch.optim.Optimizer):
    """The base's groups with weight_decay 0 for one step (DeMo applies it itself, decoupled), restored after."""
    held = [group.get("weight_decay") for group in base.param_groups]
    try:
        for group in base.param_groups:
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        yield
    finally:
        for group, wd in zip(base.param_groups, held):
            if wd is not None:
                group["weight_decay"] = wd


class DeMo(DistributedOptimizer):
    """DeMo (Peng et al. 2024): each peer keeps its own momentum, sends only its fast components, steps on the
    sign of their mean.

    At every step, with gamma the base lr and lambda the base's weight_decay of the parameter's group,
    beta = `decay`:
    m_i <- beta m_i + gamma g_i;  c_i = TopK(DCT(m_i));  m_i <- m_i - IDCT(c_i);  C = the peers' c_j (an
    all-gather) combined per coefficient; x_i <- (1 - gamma lambda) x_i (decoupled weight decay, the
    reference's); then the base optimizer steps with sign(IDCT(C)) as the gradient and its weight_decay held
    at 0 for that step (x_i <- x_i - gamma sign(IDCT(C)) with plain SGD, the reference's).

    `aggregate` says how C combines the peers' coefficients: "senders" (each coefficient's mean over the peers
    that sent it, 0 where none did: bloc97/DeMo's scatter mean, the default) or "mean" (their sum over all n
    peers divided by n, the paper's mean_j q_j written linearly; a coefficient sent by few peers is scaled
    down, so sign(IDCT(C)) differs). DCT and top-k are per block: 1-D tensors in chunks of c entries,
    matrices in c1 x c2 tiles, c the largest divisor of the dimension <= `chunk`, the `topk` largest DCT
    coefficients of each block kept (dpsgd.optim.chunked; a tensor of more than 2 dimensions as the matrix
    (shape[0], rest), which the reference does not take).
    The peers' models stay equal (they all apply the same sign). A message is each kept coefficient's position
    in its block (log2 of the block size, in bits) and its value (32 bits); the topology is ignored.
    Defaults are the reference's (bloc97/DeMo demo.py: decay 0.999, topk 32, chunk 64, the senders' mean);
    its sign steps equal the reference's on tests/fixtures/demo_bloc97.npz (tests/test_reference_code.py).
    """

    uses_topology = False
    label = "DeMo"
    knobs = {}
    cost_form = None  # an all-gather of sparse DCT coefficients every step: none of the map's forms

    def __init__(
        self,
        base: torch.optim.Optimizer,
        *,
        decay: float = 0.999,
        topk: int = 32,
        chunk: int = 64,
        aggregate: str = "senders",
        **common,
    ):
        super().__init__(base, **common)
        refuse_compression(self.comm, "DeMo")
        if not 0 <= decay < 1:
            raise ValueError(f"DeMo decay (of the local momentum) must be in [0, 1), got {decay}")
        if aggregate not in AGGREGATES:
            raise ValueError(f"DeMo aggregate must be one of {AGGREGATES}, got {aggregate!r}")
        self.decay, self.aggregate = float(decay), aggregate
        self._chunk, self._topk = chunk, topk
        self._lay_out()

    def _lay_out(self) -> None:
        """The DCT blocks and the zero momenta of every parameter (at construction, and for a group added before the
        first step)."""
        lead = len(self.comm.peer_shape)
        shapes = [p.shape[lead:] for p in self.params()]
        self.code = ChunkedTopK(shapes, self._chunk, self._topk, dct=True, bits=None, sigmas=0)
        self.momenta = [torch.zeros_like(p, memory_format=torch.contiguous_format) for p in self.params()]

    def param_group_added(self, params: list[torch.Tensor]) -> None:
        super().param_group_added(params)  # refused after the first step
        self._lay_out()

    def update(self) -> None:
        params = self.params()
        lrs = [float(group["lr"]) for group in self.param_groups for _ in group["params"]]
        decays = [float(group.get("weight_decay", 0.0)) for group in self.param_groups for _ in group["params"]]
        for p, m, lr in zip(params, self.momenta, lrs):
            m.mul_(self.decay)
            if p.grad is not None:
                m.add_(p.grad, alpha=lr)
        message = self.code.encode(self.momenta)
        for m, sent in zip(self.momenta, self.code.dense(message)):
            m.sub_(sent)
        combined = gathered_mean(self.comm, self.code, message, senders=self.aggregate == "senders")
        for p, q, lr, wd in zip(params, combined, lrs, decays):
            p.grad = torch.sign(q)
            if wd:
                p.mul_(1.0 - lr * wd)
        with without_weight_decay(self.base):
            self.base.step()
        self.step_count += 1

    def algorithm_state(self):
        return {**super().algorithm_state(), "momenta": [m.clone() for m in self.momenta]}

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        self.momenta = self.own_tensors(state["momenta"]) or self.momenta

    def __repr__(self) -> str:
        k, chunk = self.code.ks[0] if self.code.ks else 0, self.code.blocks[0].sizes if self.code.blocks else []
        return f"DeMo({self.base!r}, decay={self.decay}, topk={k}, chunk={chunk}, aggregate={self.aggregate!r})"
