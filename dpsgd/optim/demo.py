"""DeMo, decoupled momentum optimization (Peng, Quesnelle & Kingma 2024, arXiv 2411.19870): see `DeMo`."""

from __future__ import annotations

import torch

from .base import DistributedOptimizer
from .chunked import ChunkedTopK, gathered_mean, refuse_compression


class DeMo(DistributedOptimizer):
    """DeMo (Peng et al. 2024): each peer keeps its own momentum, sends only its fast components, steps on the
    sign of their mean.

    At every step, with gamma the base lr of the parameter's group, beta = `decay`:
    m_i <- beta m_i + gamma g_i;  q_i = IDCT(TopK(DCT(m_i)));  m_i <- m_i - q_i;  Q = mean_j q_j (an
    all-gather of the peers' q_j); then the base optimizer steps with sign(Q) as the gradient
    (x_i <- x_i - gamma sign(Q) with SGD, the paper's; weight decay is the base's). DCT and top-k are per
    block: 1-D tensors in chunks of c entries, matrices in c1 x c2 tiles, c the largest divisor of the
    dimension <= `chunk`, the `topk` largest DCT coefficients of each block kept (dpsgd.optim.chunked).
    The peers' models stay equal (they all apply sign(Q)). A message is each kept coefficient's position in
    its block (log2 of the block size, in bits) and its value (32 bits); the topology is ignored.
    Defaults are the reference's (bloc97/DeMo: decay 0.999, topk 32, chunk 64).
    """

    uses_topology = False
    label = "DeMo"
    knobs = {}
    cost_form = None  # an all-gather of sparse DCT coefficients every step: none of the map's forms

    def __init__(self, base: torch.optim.Optimizer, *, decay: float = 0.999, topk: int = 32, chunk: int = 64, **common):
        super().__init__(base, **common)
        refuse_compression(self.comm, "DeMo")
        if not 0 <= decay < 1:
            raise ValueError(f"DeMo decay (of the local momentum) must be in [0, 1), got {decay}")
        self.decay, self._chunk, self._topk = float(decay), chunk, topk
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
        for p, m, lr in zip(params, self.momenta, lrs):
            m.mul_(self.decay)
            if p.grad is not None:
                m.add_(p.grad, alpha=lr)
        message = self.code.encode(self.momenta)
        for m, sent in zip(self.momenta, self.code.dense(message)):
            m.sub_(sent)
        for p, q in zip(params, gathered_mean(self.comm, self.code, message)):
            p.grad = torch.sign(q)
        self.base.step()
        self.step_count += 1

    def algorithm_state(self):
        return {**super().algorithm_state(), "momenta": [m.clone() for m in self.momenta]}

    def load_algorithm_state(self, state) -> None:
        super().load_algorithm_state(state)
        self.momenta = self.own_tensors(state["momenta"]) or self.momenta

    def __repr__(self) -> str:
        k, chunk = self.code.ks[0] if self.code.ks else 0, self.code.blocks[0].sizes if self.code.blocks else []
        return f"DeMo({self.base!r}, decay={self.decay}, topk={k}, chunk={chunk})"
