"""Models, built identically on every peer from one seed.

- `linear`: multinomial logistic (or linear) regression, a convex problem.
- `mlp`: fully connected with ReLU, `hidden` widths.
- `cnn`: two 3x3 conv blocks (conv, GroupNorm, ReLU, max-pool), an adaptive average pool to `pool` x `pool` and a
  head of `hidden` widths (none: one linear layer); any image size.
- `resnet20`: He et al. 2016's CIFAR ResNet-20 (0.27 M parameters), with GroupNorm by default, as in
  the decentralized literature (Hsieh et al. 2020): batch statistics are local to a peer and do not
  average meaningfully; `norm="batch"` gives the original BatchNorm (running statistics per peer).
- `transformer`: a small causal transformer language model over token ids (pre-norm encoder
  layers with a causal mask, learned positions, no dropout so that peers stay deterministic).
- `char_gpt`: a character-level GPT in the shape of nanoGPT's `shakespeare_char` (Karpathy; conf/model/char_gpt:
  6 layers, 6 heads, 384 wide, no biases, the output layer tied to the embedding), and conf/model/char_gpt_small,
  the CPU variant of nanoGPT's README (4 layers, 4 heads, 128 wide); its context is the data's `seq_len`.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from math import prod
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("linear", "mlp", "cnn", "resnet20", "transformer", "char_gpt")
LANGUAGE_MODELS = ("transformer", "char_gpt")  # over token ids (text data)
# the options each model reads (build's keywords); any other is refused by name (dpsgd.build.build_model)
OPTIONS = {
    "linear": (),
    "mlp": ("hidden",),
    "cnn": ("width", "groups", "pool", "hidden"),
    "resnet20": ("norm", "groups"),
    "transformer": ("dim", "layers", "heads"),
    "char_gpt": ("dim", "layers", "heads"),
}
NORMS = ("group", "batch")  # resnet20's normalization layers
_init_lock = threading.Lock()  # local-backend peers are threads sharing torch's global RNG


@contextmanager
def seeded(seed: int):
    """torch's global CPU generator seeded with `seed` while a model is made, restored afterwards; one model at a
    time (local-backend peers are threads sharing the generator)."""
    with _init_lock, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def build(
    name: str,
    input_shape: tuple[int, ...],
    num_outputs: int,
    seed: int,
    hidden: list[int] | None = None,
    width: int = 16,
    groups: int = 2,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    norm: str = "group",
    pool: int = 2,
) -> nn.Module:
    """Every peer calls this with the same seed and gets the same initial parameters.
    `num_outputs` is the class count (1 for regression; the vocabulary size for a language model)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}")
    if norm not in NORMS:
        raise ValueError(f"model.norm must be one of {', '.join(NORMS)}, got {norm!r}")
    if name in LANGUAGE_MODELS and len(input_shape) != 1:
        raise ValueError(
            f"model {name} needs token sequences (data=tiny_text, data=text_corpus or data=shakespeare), "
            f"got inputs of shape {input_shape}"
        )
    if name in ("cnn", "resnet20") and len(input_shape) != 3:
        raise ValueError(
            f"model {name} needs images (channels, height, width), got inputs of shape {input_shape}; "
            f"use model=mlp or model=linear"
        )
    with seeded(seed):
        if name in ("linear", "mlp"):
            return _mlp(prod(input_shape), list(hidden or [64]) if name == "mlp" else [], num_outputs)
        if name == "cnn":
            return _cnn(input_shape, num_outputs, width, groups, pool, list(hidden or []))
        if name == "transformer":
            return TinyTransformer(num_outputs, input_shape[0], dim, layers, heads)
        if name == "char_gpt":
            return CharGPT(num_outputs, input_shape[0], dim, layers, heads)
        return ResNet20(input_shape[0], num_outputs, groups, norm)


def _mlp(inputs: int, hidden: list[int], outputs: int) -> nn.Module:
    widths = [inputs, *hidden]
    layers: list[nn.Module] = [nn.Flatten()]
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], outputs))
    return nn.Sequential(*layers)


def _cnn(input_shape, outputs: int, width: int, groups: int, pool: int, hidden: list[int]) -> nn.Module:
    channels = input_shape[0]
    layers: list[nn.Module] = []
    for c_in, c_out in ((channels, width), (width, 2 * width)):
        layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(groups, c_out), nn.ReLU(), nn.MaxPool2d(2)]
    widths = [2 * width * pool * pool, *hidden]
    head: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        head += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(pool), nn.Flatten(), *head, nn.Linear(widths[-1], outputs))


def _norm(kind: str, groups: int, channels: int) -> nn.Module:
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(groups, channels)


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, groups: int, norm: str = "group"):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = _norm(norm, groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = _norm(norm, groups, c_out)
        self.shortcut = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), _norm(norm, groups, c_out))
        )

    def forward(self, x):
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(self.norm2(self.conv2(out)) + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 (He et al. 2016, the CIFAR variant: 3 stages of 3 basic blocks, 16/32/64 channels), with
    GroupNorm (`norm="group"`, the default: no batch statistics differ between peers) or the original
    BatchNorm (`norm="batch"`: running statistics kept per peer, in buffers); 0.27 M parameters."""

    def __init__(self, channels: int = 3, num_classes: int = 10, groups: int = 2, norm: str = "group"):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, 16, 3, 1, 1, bias=False), _norm(norm, groups, 16), nn.ReLU())
        blocks, c_in = [], 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_Block(c_in, c_out, stride if i == 0 else 1, groups, norm))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


class TinyTransformer(nn.Module):
    """A small causal transformer language model (learned positions, `layers` pre-norm blocks of `heads`
    heads): logits of the next token at every position, for next-character prediction (data=tiny_text)."""

    def __init__(self, vocab: int, seq_len: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(seq_len, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        for layer in cast(list[nn.TransformerEncoderLayer], self.encoder.layers):  # pre-norm, no dropout
            h = h + _causal_attention(layer.self_attn, layer.norm1(h))
            h = h + layer.linear2(layer.activation(layer.linear1(layer.norm2(h))))
        return self.head(self.norm(h))


def _causal_attention(attn: nn.MultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """nn.MultiheadAttention's self-attention with a causal mask, its products on (batch x positions, width):
    the same numbers, and under vmap (the fleet) one batched product each instead of one per position."""
    b, t, d = x.shape
    heads = attn.num_heads
    qkv = F.linear(x.reshape(b * t, d), attn.in_proj_weight, attn.in_proj_bias)
    q, k, v = qkv.reshape(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)  # each (b, heads, t, d / heads)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * t, d)
    return F.linear(out, attn.out_proj.weight, attn.out_proj.bias).reshape(b, t, d)


class CharGPT(nn.Module):
    """A character-level GPT (Radford et al. 2019's layout, as nanoGPT writes it for `shakespeare_char`): token and
    learned position embeddings, `layers` pre-norm blocks of causal self-attention (`heads` heads) and a 4x GELU
    MLP, a final LayerNorm, and the logits through the embedding's own weights (tied). No biases (nanoGPT's
    `bias=False`) and no dropout (peers stay deterministic; nanoGPT's full config uses 0.2). Initial weights as
    GPT-2's: normal(0, 0.02), the projections into the residual stream scaled by 1 / sqrt(2 * layers)."""

    tied_head = True  # its output layer is the embedding: optimizer=muon steps it with AdamW (optim.muon)

    def __init__(self, vocab: int, block: int, dim: int = 384, layers: int = 6, heads: int = 6):
        super().__init__()
        if dim % heads:
            raise ValueError(f"model char_gpt: dim {dim} must be a multiple of heads {heads}")
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(_GPTBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith("out.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens):
        h = self.embed(tokens) + self.position.weight[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h, self.heads)
        return F.linear(self.norm(h), self.embed.weight)


class _GPTBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, bias=False), nn.LayerNorm(dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.mlp_out = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, h, heads: int):
        b, t, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).reshape(b, t, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        h = h + self.attn_out(attended)
        return h + self.mlp_out(F.gelu(self.up(self.norm2(h))))
