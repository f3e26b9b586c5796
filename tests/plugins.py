"""A user's own model class, named by `model._target_` in test_build.py."""

from torch import nn


class TinyNet(nn.Module):
    def __init__(self, inputs: int = 64, classes: int = 10, width: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, width), nn.Tanh(), nn.Linear(width, classes))

    def forward(self, x):
        return self.net(x)
