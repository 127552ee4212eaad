"""A training loop compiles once: replays are cached by the plan's structural key."""

from __future__ import annotations

import torch

import replaygrad
from replaygrad._compile import cache

from conftest import counting_backend


def test_five_iterations_compile_once():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiles = []

    def compiler(fn):
        compiles.append(fn)
        return torch.compile(fn, backend="aot_eager")

    for _ in range(5):
        opt.zero_grad()
        replaygrad.backward(model(torch.randn(4, 8)).sum(), compiler=compiler)
        opt.step()
    assert len(compiles) == 1
    assert cache.hits == 4 and cache.misses == 1


def test_dynamo_traces_the_replay_once():
    backend, graphs = counting_backend()
    compiled = torch.compile(backend=backend)
    w = torch.randn(3, 3, requires_grad=True)
    for _ in range(5):
        x = torch.randn(2, 3)
        replaygrad.backward((x @ w).relu().sum(), compiler=compiled)
    assert len(graphs) == 1


def test_structure_changes_make_new_entries():
    w = torch.randn(3, requires_grad=True)
    replaygrad.backward(torch.addcmul(w, w, w, value=2.0).sum(), compiler=None)
    replaygrad.backward(torch.addcmul(w, w, w, value=2.0).sum(), compiler=None)
    replaygrad.backward(torch.addcmul(w, w, w, value=3.0).sum(), compiler=None)  # a scalar
    replaygrad.backward((w.exp() * 2).sum(), compiler=None)  # another graph
    assert len(cache) == 3


def test_python_scalars_of_tensor_ops_are_inputs_not_key():
    # w * 2 saves its scalar as a (wrapped number) tensor: it is a replay input, so graphs
    # that differ only in it share one replay and still get their own gradients.
    w = torch.randn(3, requires_grad=True)
    for k in (2.0, 3.0):
        w.grad = None
        replaygrad.backward((w * w * k).sum(), compiler="aot_eager")
        torch.testing.assert_close(w.grad, 2 * k * w.detach())
    assert len(cache) == 1


def test_hook_with_a_python_side_effect_stops_recompiling():
    # Dynamo guards on len(seen) when it traces the hook: each call would recompile until
    # the recompile limit. replaygrad moves the hooks out of the graph at the first
    # recompile of a cached replay, after which nothing recompiles.
    from torch._dynamo.utils import counters

    seen = []
    w = torch.randn(8, requires_grad=True)
    graphs = []
    for i in range(12):
        h = (w * 2).sin()
        expected = torch.autograd.grad(h.sum(), w, retain_graph=True)[0]
        h.register_hook(lambda g: seen.append(g.sum().item()))
        w.grad = None
        replaygrad.backward(h.sum(), compiler="aot_eager")
        torch.testing.assert_close(w.grad, expected)
        graphs.append(counters["stats"]["unique_graphs"])
        assert len(seen) == i + 1
    assert graphs[2:] == [graphs[2]] * 10, graphs
    assert cache.misses == 1
