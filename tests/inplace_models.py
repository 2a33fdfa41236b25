"""Models written with in-place ops as users write them (shared by the capture unit tests and the
distributed exactness tests)."""
from __future__ import annotations

import torch
from torch import nn


class ResidualBlock(nn.Module):
    """A ResNet basic block with an in-place residual add and in-place ReLU; ``halve_inplace`` also
    halves the output in place (forward only: ReLU's backward reads the output it overwrites)."""

    def __init__(self, c: int = 4, halve_inplace: bool = False):
        super().__init__()
        self.halve_inplace = halve_inplace
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        identity = x
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity             # in-place residual add, as torchvision's ResNet writes it
        out = torch.relu_(out)
        if self.halve_inplace:
            out.div_(2.0)
        return out
