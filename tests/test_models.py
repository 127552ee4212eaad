"""Gradients of small models, replaygrad against eager, over several training iterations."""

from __future__ import annotations

import pytest
import torch

from conftest import COMPILERS, compare_training


def mlp():
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 4),
    )


def convnet():
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 2 * 2, 3),
    )


@pytest.mark.parametrize("compiler", COMPILERS)
def test_mlp(compiler):
    compare_training(mlp, lambda: torch.randn(8, 16), compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_convnet(compiler):
    compare_training(convnet, lambda: torch.randn(4, 3, 8, 8), compiler)
