"""n networks computed as one wide one, without vmap.

Peer i's activations are channels [i C, (i + 1) C) of one (b, n C, H, W) tensor, so every layer of a
convolutional network runs as one native call over all peers: a convolution with n times the groups (each peer's
filters see only its own channels), GroupNorm with n times the groups (each peer's affine weights on its own
channels), elementwise and per-channel layers (ReLU, pooling, residual sums) as they are, and a linear head
on the flattened features (peer-major) as one batched product. The parameters keep their names (the wide
model holds one peer's) and are called with the fleet's stacked ones, (n, *shape):
`functional_call(wide, stacked, (wide_input(x, True),))` returns every peer's outputs. A network of linear
layers (and elementwise ones) runs peer-major instead, (n, b, features), each Linear one batched product with
its bias added in the same call (PeerLinear: its backward pass writes the weight's gradient in the weight's layout).

vmap computes the same, but moves the peer axis in and out of the batch axis around every convolution and
applies GroupNorm's affine part as separate products; this layout leaves those copies out (on CPU, ResNet-20's
forward and backward in about two thirds of the time; the MLP of 64 peers in about half). `widen`
refuses a model with other parametrized layers; the fleet checks the wide model's losses against vmap's
on its first batch before using it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

# layers without parameters that act elementwise, or per sample and channel: the same in the wide layouts
ELEMENTWISE = (nn.ReLU, nn.Identity, nn.Tanh, nn.GELU, nn.Sigmoid, nn.SiLU, nn.LeakyReLU)
PER_CHANNEL = (*ELEMENTWISE, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)


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


class PeerLinear(torch.autograd.Function):
    """x W^T + b for each peer, x (n, b, in), W (n, out, in), b (n, out) or None: the products torch computes
    for it, except that the backward pass forms the weight's gradient as g^T x, straight in W's (n, out, in)
    layout. Autograd's own backward forms x^T g, (n, in, out), whose transpose it then copied into W's layout at
    every step: 29% of the MLP's forward+backward at 4,096 peers, in the profile."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        wt = weight.transpose(1, 2)
        return torch.bmm(x, wt) if bias is None else torch.baddbmm(bias[:, None, :], x, wt)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        (grad,) = grads
        x, weight = ctx.saved_tensors
        wants = ctx.needs_input_grad
        grad_x = torch.bmm(grad, weight) if wants[0] else None
        grad_weight = torch.bmm(grad.transpose(1, 2), x) if wants[1] else None
        grad_bias = grad.sum(1) if ctx.has_bias and wants[2] else None
        return grad_x, grad_weight, grad_bias


class WideLinear(nn.Module):
    """n peers' Linear as one batched product: on (b, n, in) after a convolutional network's flattening, or on
    (n, b, in), peer-major, in a network of linear layers."""

    def __init__(self, linear: nn.Linear, peer_major: bool):
        super().__init__()
        self.weight, self.bias, self.peer_major = linear.weight, linear.bias, peer_major

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x if self.peer_major else x.transpose(0, 1)
        if torch.is_autocast_enabled(x.device.type):  # autocast casts inside autograd's own products only
            wt = self.weight.transpose(1, 2)
            out = torch.bmm(x, wt) if self.bias is None else torch.baddbmm(self.bias[:, None, :], x, wt)
        else:
            out = PeerLinear.apply(x, self.weight, self.bias)
        return out if self.peer_major else out.transpose(0, 1)


class PeerFlatten(nn.Module):
    """Flatten of (n, b, ...) peer-major batches: (n, b, features)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2)


def widen(model: nn.Module, n: int) -> nn.Module:
    """A copy of `model` computing n peers at once (the module's docstring): a convolutional one in the channel
    layout, one of linear layers peer-major (its `channels` attribute says which); ValueError for a layer
    neither layout takes (the fleet then uses vmap)."""
    wide = copy.deepcopy(model)
    channels = any(isinstance(m, nn.Conv2d) for m in wide.modules())
    allowed = PER_CHANNEL if channels else ELEMENTWISE
    for parent in list(wide.modules()):
        for name, child in list(parent.named_children()):
            if channels and isinstance(child, nn.Conv2d) and child.padding_mode == "zeros":
                setattr(parent, name, WideConv2d(child))
            elif channels and isinstance(child, nn.GroupNorm):
                setattr(parent, name, WideGroupNorm(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, WideLinear(child, peer_major=not channels))
            elif isinstance(child, nn.Flatten) and child.start_dim == 1 and child.end_dim == -1:
                setattr(parent, name, WideFlatten(n) if channels else PeerFlatten())
            elif next(child.children(), None) is None and not isinstance(child, allowed):
                raise ValueError(f"widen: no wide form of {type(child).__name__}")
    wide.channels = channels  # type: ignore[assignment]  # which layout: wide_input and peer_outputs ask
    return wide


def wide_input(x: torch.Tensor, channels: bool) -> torch.Tensor:
    """(n, b, C, H, W) stacked batches as (b, n C, H, W) for the channel layout; as they are, peer-major."""
    if not channels:
        return x
    n, b = x.shape[:2]
    return x.transpose(0, 1).reshape(b, n * x.shape[2], *x.shape[3:])


def peer_outputs(out: torch.Tensor, channels: bool) -> torch.Tensor:
    """The wide model's outputs as (n, b, ...)."""
    return out.transpose(0, 1) if channels else out
