"""n convolutional networks computed as one wide one, without vmap.

Peer i's activations are channels [i C, (i + 1) C) of one (b, n C, H, W) tensor, so every layer of a
convolutional network runs as one native call over all peers: a convolution with n times the groups (each peer's
filters see only its own channels), GroupNorm with n times the groups (each peer's affine weights on its own
channels), elementwise and per-channel layers (ReLU, pooling, residual sums) as they are, and a linear head
on the flattened features (peer-major) as one batched product. The parameters keep their names (the wide
model holds one peer's) and are called with the fleet's stacked ones, (n, *shape):
`functional_call(wide, stacked, (wide_input(x),))` returns every peer's outputs.

vmap computes the same, but moves the peer axis in and out of the batch axis around every convolution and
applies GroupNorm's affine part as separate products; this layout leaves those copies out (on CPU, ResNet-20's
forward and backward in about two thirds of the time). `widen` refuses a model with other parametrized
layers; the fleet checks the wide model's losses against vmap's on its first batch before using it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

# layers without parameters that act per sample and per channel (or elementwise): the same in the wide layout
PER_CHANNEL = (nn.ReLU, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Identity)


class WideConv2d(nn.Module):
    """n peers' Conv2d of the same shape as one grouped convolution over their stacked channels."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv  # its stride, padding, ...; its weights, one peer's, name the stacked ones
        self.weight, self.bias = conv.weight, conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.conv
        bias = None if self.bias is None else self.bias.reshape(-1)
        weight = self.weight.reshape(-1, *self.weight.shape[2:])
        return F.conv2d(x, weight, bias, c.stride, c.padding, c.dilation, c.groups * self.weight.shape[0])


class WideGroupNorm(nn.Module):
    """n peers' GroupNorm as one with n times the groups (its affine weights per peer and channel)."""

    def __init__(self, norm: nn.GroupNorm):
        super().__init__()
        if not norm.affine:
            raise ValueError("widen: GroupNorm without affine weights is not supported")
        self.groups, self.eps = norm.num_groups, norm.eps
        self.weight, self.bias = norm.weight, norm.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.weight.shape[0]
        return F.group_norm(x, self.groups * n, self.weight.reshape(-1), self.bias.reshape(-1), self.eps)


class WideFlatten(nn.Module):
    """(b, n C, ...) to (b, n, C ...): each peer's features apart, for the linear layer that follows."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], self.n, -1)


class WideLinear(nn.Module):
    """n peers' Linear on (b, n, in): one batched product, (b, n, out)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.bmm(x.transpose(0, 1), self.weight.transpose(1, 2))  # (n, b, out)
        if self.bias is not None:
            out = out + self.bias[:, None, :]
        return out.transpose(0, 1)


def widen(model: nn.Module, n: int) -> nn.Module:
    """A copy of the convolutional `model` computing n peers at once (the module's docstring); ValueError
    for a layer this layout cannot take (the fleet then uses vmap)."""
    wide = copy.deepcopy(model)
    if not any(isinstance(m, nn.Conv2d) for m in wide.modules()):
        raise ValueError("widen: no convolution (vmap's batched products are this layout already)")
    for parent in list(wide.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d) and child.padding_mode == "zeros":
                setattr(parent, name, WideConv2d(child))
            elif isinstance(child, nn.GroupNorm):
                setattr(parent, name, WideGroupNorm(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, WideLinear(child))
            elif isinstance(child, nn.Flatten) and child.start_dim == 1 and child.end_dim == -1:
                setattr(parent, name, WideFlatten(n))
            elif next(child.children(), None) is None and not isinstance(child, PER_CHANNEL):
                raise ValueError(f"widen: no wide form of {type(child).__name__}")
    return wide


def wide_input(x: torch.Tensor) -> torch.Tensor:
    """(n, b, C, H, W) stacked batches as (b, n C, H, W)."""
    n, b = x.shape[:2]
    return x.transpose(0, 1).reshape(b, n * x.shape[2], *x.shape[3:])


def peer_outputs(out: torch.Tensor) -> torch.Tensor:
    """The wide model's (b, n, ...) outputs as (n, b, ...)."""
    return out.transpose(0, 1)
