"""Small models for the bundled datasets, built identically on every peer from one seed."""

from __future__ import annotations

import threading
from math import prod

import torch
from torch import nn

MODELS = ("mlp", "linear")
_init_lock = threading.Lock()  # local-backend peers are threads sharing torch's global RNG


def build(name: str, input_shape: tuple[int, ...], num_classes: int, seed: int,
          hidden: list[int] | None = None) -> nn.Module:
    """Every peer calls this with the same seed and gets the same initial parameters."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid models: {', '.join(MODELS)}")
    with _init_lock:
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            width = [prod(input_shape)] + (list(hidden or [64]) if name == "mlp" else [])
            layers: list[nn.Module] = [nn.Flatten()]
            for a, b in zip(width, width[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            layers.append(nn.Linear(width[-1], num_classes))
            return nn.Sequential(*layers)
        finally:
            torch.random.set_rng_state(state)
