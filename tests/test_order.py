"""The plan's order against the engine: what torch._C._current_graph_task_execution_order()
reports, and what the engine really runs (recorded by pre-hooks on every node)."""

from __future__ import annotations

import torch

import replaygrad
from replaygrad import _core

from conftest import engine_order, reported_order


def mlp_loss():
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Linear(16, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 2),
    )
    return model(torch.randn(5, 8)).pow(2).mean()


def diamond_loss():
    x = torch.randn(4, requires_grad=True)
    h = x.exp()  # a non-leaf used twice
    return (h.sin() * h.cos() + h).sum()


def multi_input_loss():
    x = torch.randn(6, requires_grad=True)
    a, b, c = (x * 2).chunk(3)  # SplitBackward0 has three inputs
    return (c.exp() + a.sin() * 3 + b).sum()


def chain_loss(n_nodes: int):
    x = torch.randn(4, requires_grad=True)
    h = x
    for _ in range(n_nodes // 2):
        h = h.sin() * 0.5
    return h.sum()


CASES = {
    "mlp": mlp_loss,
    "diamond": diamond_loss,
    "multi_input": multi_input_loss,
    "chain_1000": lambda: chain_loss(1000),
}


def test_order_matches_reported_order():
    for name, make in CASES.items():
        loss = make()
        assert replaygrad.plan(loss).order == reported_order(loss), name


def test_order_matches_the_engine():
    for name, make in CASES.items():
        loss = make()
        assert replaygrad.plan(loss).order == engine_order([loss]), name


def test_chain_has_every_node():
    loss = chain_loss(1000)
    plan = replaygrad.plan(loss)
    assert len(plan.order) == 1000 + 2  # sum, 500 x (sin, mul), AccumulateGrad


def test_plan_nodes_are_the_graph_nodes():
    loss = mlp_loss()
    p = _core.plan([loss])
    assert _core.same_node(p.nodes()[0], loss.grad_fn)
    reported: list = []

    def hook(grads):
        reported.extend(torch._C._current_graph_task_execution_order())

    loss.grad_fn.register_prehook(hook)
    with torch.autograd.set_multithreading_enabled(False):
        loss.backward(retain_graph=True)
    assert len(reported) == p.num_steps
    assert all(_core.same_node(a, b) for a, b in zip(p.nodes(), reported))


def test_leaf_used_twice_waits_for_both_uses():
    # The engine runs a leaf's AccumulateGrad once both gradients arrived. (The reported
    # order, a simulation without dependency counts, places it after the first one.)
    x = torch.randn(3, requires_grad=True)
    loss = (x.sin() * 2 + x.exp()).sum()
    order = replaygrad.plan(loss).order
    assert order == engine_order([loss])
    assert order[-1] == "torch::autograd::AccumulateGrad"


def test_ties_among_accumulate_grads_follow_the_engine():
    # Seven leaves become ready at once; all AccumulateGrads have the same sequence_nr.
    leaves = [torch.randn(2, requires_grad=True) for _ in range(7)]
    loss = torch.stack(leaves).sum()
    p = _core.plan([loss])
    recorded: list = []
    for i, leaf in enumerate(leaves):
        leaf.register_hook(lambda g, i=i: recorded.append(i))
    loss.backward(retain_graph=True)
    acc_nodes = p.nodes()[2:]
    stack_fn = loss.grad_fn.next_functions[0][0]
    leaf_of = [
        next(i for i, (fn, _) in enumerate(stack_fn.next_functions) if _core.same_node(fn, n))
        for n in acc_nodes
    ]
    assert leaf_of == recorded
    assert recorded != sorted(recorded), "ties are not first-in first-out in the engine"


def test_several_roots():
    x = torch.randn(3, requires_grad=True)
    a = (x * 2).sum()
    b = (x.exp() * a).sum()  # depends on a
    c = x.sin().sum()
    roots = [a, b, c]
    p = _core.plan(roots)
    assert p.order() == engine_order(roots)
