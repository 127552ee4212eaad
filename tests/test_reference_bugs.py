"""Each bug of the proof of concept (see ARCHITECTURE.md) as a test against eager."""

from __future__ import annotations

import pytest
import torch

import replaygrad

from conftest import FAST_COMPILERS, assert_grads_equal, grads_of


def run_both(make_loss, leaves, compiler):
    """Eager backward, then replaygrad's on a fresh graph over the same leaves."""
    make_loss().backward()
    expected = grads_of(leaves)
    for t in leaves:
        t.grad = None
    replaygrad.backward(make_loss(), compiler=compiler)
    assert_grads_equal(expected, grads_of(leaves), exact=compiler is None)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_gradients_arriving_out_of_input_order_are_summed(compiler):
    # unbind's backward has one input per output; its consumers run in the opposite order
    # of input_nr, and output 1 is used twice (two gradients to sum in one slot).
    x = torch.randn(3, 4, requires_grad=True)

    def loss():
        a, b, c = (x * 1.5).unbind(0)
        return (c.exp() * 2 + b.sin() + b.cos() * a + a).sum()

    run_both(loss, [x], compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_gradients_for_one_input_from_many_nodes(compiler):
    w = torch.randn(5, requires_grad=True)

    def loss():
        h = w * 2
        return sum((h * k).sin() for k in range(1, 6)).sum() + (h**2).sum()

    run_both(loss, [w], compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_list_valued_saved_values_stack(compiler):
    xs = [torch.randn(3, requires_grad=True) for _ in range(4)]

    def loss():
        s = torch.stack([x.exp() for x in xs])
        return (s * s.flip(0)).sum()

    run_both(loss, xs, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_list_valued_saved_values_tensor_index(compiler):
    x = torch.randn(6, 4, requires_grad=True)
    rows = torch.tensor([0, 3, 3, 5])
    cols = torch.tensor([1, 1, 2, 0])

    def loss():
        return (x[rows, cols] * torch.arange(4.0)).sum() + x[rows].pow(2).sum()

    plan = replaygrad.plan(loss())
    index_steps = {s for s, name in plan.saved if name == "IndexBackward0"}
    assert index_steps, "IndexBackward0 saves its index tensors"
    run_both(loss, [x], compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_several_pre_hooks_on_a_node_run_in_order(compiler):
    x = torch.randn(4, requires_grad=True)
    calls = []

    def make_loss(record):
        h = x * 3
        out = h.exp()
        out.grad_fn.register_prehook(lambda g: record.append(("first", g[0].sum().item())) or None)
        out.grad_fn.register_prehook(lambda g: (g[0] * 2,))
        out.grad_fn.register_prehook(lambda g: record.append(("third", g[0].sum().item())) or None)
        return out.sum()

    eager_calls = []
    make_loss(eager_calls).backward()
    expected = grads_of([x])
    x.grad = None
    if compiler is None:
        replaygrad.backward(make_loss(calls), compiler=None)
        assert calls == eager_calls
    else:
        # .item() in a traced hook is a graph break; the values must still match.
        replaygrad.backward(make_loss(calls), compiler=compiler)
        assert [c[0] for c in calls] == ["first", "third"]
        assert calls[1][1] == pytest.approx(eager_calls[1][1])
    assert_grads_equal(expected, grads_of([x]), exact=compiler is None)
