"""Gradients of small models, replaygrad against eager, over several training iterations."""

from __future__ import annotations

import pytest
import torch

import replaygrad

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


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_saved_values_report_requires_grad_as_eager(compiler):
    # linalg_solve_backward computes A's gradient only if the saved A requires grad.
    a = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    loss = torch.linalg.solve(a, b).sin().sum()
    expected = torch.autograd.grad(loss, [a, b], retain_graph=True)
    replaygrad.backward(loss, compiler=compiler)
    torch.testing.assert_close(a.grad, expected[0])
    torch.testing.assert_close(b.grad, expected[1])


def test_torch_nodes_are_traced_views_included():
    # View backwards (TBackward0, ViewBackward0, ...) report is_traceable() false, which is
    # about the TorchScript tracer: they are traced like every node compiled_args describes.
    model = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
    loss = model(torch.randn(5, 3, 16)).sum()
    plan = replaygrad.plan(loss)
    assert plan.opaque == [], plan.opaque
    assert "TBackward0" in plan.order and "ViewBackward0" in plan.order
