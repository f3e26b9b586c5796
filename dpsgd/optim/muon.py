"""Muon as a base optimizer: torch.optim.Muon's rule on the hidden weight matrices, AdamW on the rest.

Muon (Jordan et al. 2024) orthogonalizes each matrix's momentum with a Newton-Schulz iteration; its authors
advise it for the hidden 2-D weights only and a standard method for "the input embedding, final output layer, and
any internal gains or biases". `hidden_matrices(model)` makes that split on a model; `MuonAdamW` steps torch's own
Muon functional on those parameters and torch's AdamW on the others, so on real peers it is torch.optim.Muon plus
torch.optim.AdamW to the bit. On a fleet (`peer_dims=1`: every tensor carries a leading peer axis) Muon is not
elementwise, so its functional runs once per peer on that peer's slice: the same numbers as n real peers.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from torch.optim._muon import muon  # the functional torch.optim.Muon.step calls: the rule, written once

# torch.optim.Muon's defaults (Keller Jordan's constants)
NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)


def hidden_matrices(model: torch.nn.Module) -> list[bool]:
    """For each of `model.parameters()` (in that order): True where Muon's authors advise Muon, the weight of an
    `nn.Linear` (attention's output projection included) or attention's packed input projection, except the output
    layer, the last `nn.Linear` in `model.modules()` order (a model whose output layer is its embedding, such as
    dpsgd.models.CharGPT, says so with a class attribute `tied_head = True`). False for the rest: biases, norm
    gains, embeddings and position tables, convolution kernels (torch.optim.Muon takes 2-D matrices only) and the
    output layer, which AdamW steps."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    head = None if getattr(model, "tied_head", False) or not linears else linears[-1].weight
    chosen = {id(m.weight) for m in linears if m.weight is not head}
    chosen |= {id(m.in_proj_weight) for m in model.modules() if isinstance(m, torch.nn.MultiheadAttention)}
    chosen.discard(id(None))
    return [id(p) in chosen and p.dim() == 2 for p in model.parameters()]


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the parameters `hidden` marks (default: every 2-D matrix; from a config: `hidden_matrices(model)`),
    AdamW on the others. Two param groups, each with its own `lr` (Muon's `lr`, AdamW's `adamw_lr`) and
    `weight_decay`, so LR schedulers scale both. Muon's options are torch.optim.Muon's (`momentum`, `nesterov`,
    `ns_coefficients`, `ns_steps`, `eps`, `adjust_lr_fn`); AdamW's are prefixed `adamw_` (`adamw_lr`,
    `adamw_betas`, `adamw_eps`, `adamw_weight_decay`). `peer_dims`: leading axes that index peers (1 on a fleet)."""

    def __init__(
        self,
        params,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_coefficients: tuple[float, float, float] | list[float] = NS_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        adamw_lr: float = 0.003,
        adamw_betas: tuple[float, float] | list[float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.1,
        hidden: Sequence[bool] | None = None,
        peer_dims: int = 0,
    ):
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("MuonAdamW makes its own two param groups: pass the parameters, and `hidden` to split them")
        if hidden is None:
            hidden = [p.dim() - peer_dims == 2 for p in params]
        if len(hidden) != len(params):
            raise ValueError(f"MuonAdamW: `hidden` marks {len(hidden)} parameters but {len(params)} were given")
        flat = [p for p, h in zip(params, hidden) if h and p.dim() - peer_dims != 2]
        if flat:
            raise ValueError(
                f"MuonAdamW: Muon takes 2-D matrices, but `hidden` marks a parameter of shape {tuple(flat[0].shape)} "
                f"(peer_dims={peer_dims}); mark only matrices"
            )
        if len(tuple(ns_coefficients)) != 3 or not 0 < ns_steps < 100:
            raise ValueError(
                f"MuonAdamW: ns_coefficients must be 3 numbers and ns_steps in 1..99, got {ns_coefficients}, {ns_steps}"
            )
        for what, value in (("lr", lr), ("adamw_lr", adamw_lr)):
            if not value > 0:
                raise ValueError(f"MuonAdamW: {what} must be > 0, got {value!r}")
        self.peer_dims = int(peer_dims)
        muon_group = dict(
            params=[p for p, h in zip(params, hidden) if h],
            muon=True,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(float(c) for c in ns_coefficients),
            ns_steps=int(ns_steps),
            eps=eps,
            adjust_lr_fn=adjust_lr_fn,
        )
        adamw_group = dict(
            params=[p for p, h in zip(params, hidden) if not h],
            muon=False,
            lr=adamw_lr,
            betas=tuple(adamw_betas),
            eps=adamw_eps,
            weight_decay=adamw_weight_decay,
        )
        groups = [g for g in (muon_group, adamw_group) if g["params"]]
        super().__init__(groups, {})
        # torch's AdamW steps the AdamW group: the same group dict (schedulers' lr reaches it) and this state
        adamw = [g for g in self.param_groups if not g["muon"]]
        self._adamw = torch.optim.AdamW(adamw, lr=adamw_lr) if adamw else None
        self._link()

    def _link(self) -> None:
        if self._adamw is not None:
            self._adamw.param_groups = [g for g in self.param_groups if not g["muon"]]
            self._adamw.state = self.state  # one state: state_dict() holds both rules' buffers

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._link()  # load_state_dict replaced the group list and the state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["muon"]:
                self._muon_step(group)
        if self._adamw is not None:
            self._adamw.step()
        return loss

    def _muon_step(self, group) -> None:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            # one peer's matrix at a time: Newton-Schulz mixes a matrix's entries, so a stacked tensor is n problems
            for peer in itertools.product(*(range(s) for s in p.shape[: self.peer_dims])):
                muon(
                    [p[peer]],
                    [p.grad[peer]],
                    [buf[peer]],
                    foreach=False,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    nesterov=group["nesterov"],
                    ns_coefficients=group["ns_coefficients"],
                    ns_steps=group["ns_steps"],
                    eps=group["eps"],
                    adjust_lr_fn=group["adjust_lr_fn"],
                    has_complex=False,
                )
