"""Errors are the ones eager raises, for the same mistakes."""

from __future__ import annotations

import pytest
import torch

import replaygrad


def eager_error(fn):
    with pytest.raises(Exception) as info:
        fn(torch.autograd.backward)
    return info.value


def rg_error(fn):
    with pytest.raises(Exception) as info:
        fn(lambda *a, **k: replaygrad.backward(*a, compiler=None, **k))
    return info.value


def assert_same_error(fn):
    expected, got = eager_error(fn), rg_error(fn)
    assert type(got) is type(expected)
    assert str(got) == str(expected)


def test_root_that_does_not_require_grad():
    x = torch.randn(3)
    assert_same_error(lambda bw: bw(x.sum()))


def test_second_root_that_does_not_require_grad():
    w = torch.randn(3, requires_grad=True)
    assert_same_error(lambda bw: bw([(w * 2).sum(), torch.randn(())]))


def test_non_scalar_root_without_grad_tensors():
    w = torch.randn(3, requires_grad=True)
    assert_same_error(lambda bw: bw(w * 2))


def test_grad_tensor_of_wrong_shape():
    w = torch.randn(3, requires_grad=True)
    assert_same_error(lambda bw: bw(w * 2, torch.ones(4)))


def test_backward_through_a_released_graph():
    w = torch.randn(3, requires_grad=True)

    def twice(bw):
        y = (w.exp() * w).sum()
        bw(y)
        bw(y)

    assert_same_error(twice)


def test_unknown_compiler_name():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="unknown compiler 'no-such-backend'"):
        replaygrad.backward((w * 2).sum(), compiler="no-such-backend")
    assert w.grad is None
