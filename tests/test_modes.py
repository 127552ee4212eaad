"""Torch function and dispatch modes around a backward: they see the calls eager autograd
makes them see, no more and no fewer, and the gradients are eager's."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import BaseTorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import replaygrad

from conftest import FAST_COMPILERS


class DispatchLog(TorchDispatchMode):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.log.append(str(func))
        return func(*args, **(kwargs or {}))


class FunctionLog(BaseTorchFunctionMode):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.log.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs)


class SumCos(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sum()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return torch.ones_like(x) * grad * x.cos()


def logged_backward(context, mode_type, mode_around_forward: bool):
    """The calls a mode logs during (and, ``mode_around_forward``, before) a backward of a
    small graph of torch's nodes and a Python Function, and the gradients."""
    w = torch.linspace(-1, 1, 16).reshape(4, 4).requires_grad_()
    b = torch.linspace(0, 1, 4).requires_grad_()
    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    log: list[str] = []
    mode = mode_type(log)
    outer, inner = (
        (mode, contextlib.nullcontext())
        if mode_around_forward
        else (contextlib.nullcontext(), mode)
    )
    with outer:
        loss = SumCos.apply(torch.tanh(x @ w + b).sin() * 2)
        log.append("backward:")
        with context, inner:
            loss.backward()
    return log, (w.grad, b.grad)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("mode_type", [DispatchLog, FunctionLog])
@pytest.mark.parametrize("mode_around_forward", [True, False])
def test_modes_see_what_they_see_in_eager(compiler, mode_type, mode_around_forward):
    expected, grads = logged_backward(contextlib.nullcontext(), mode_type, mode_around_forward)
    assert "backward:" in expected
    for _ in range(2):  # the call that compiles, then a cache hit
        log, actual = logged_backward(replaygrad.enable(compiler), mode_type, mode_around_forward)
        assert log == expected
        for a, e in zip(actual, grads):
            torch.testing.assert_close(a, e)


def test_first_enable_inside_a_function_mode_shows_it_no_import():
    """The first enable() of a process lists the compiler backends, which imports their
    modules; their module-level torch calls must not reach the caller's mode (a fresh
    process: the modules are imported once)."""
    script = f"""
import contextlib, sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import replaygrad
from test_modes import FunctionLog, logged_backward
expected, _ = logged_backward(contextlib.nullcontext(), FunctionLog, True)
log, _ = logged_backward(replaygrad.enable("aot_eager"), FunctionLog, True)
assert log == expected, (log, expected)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
