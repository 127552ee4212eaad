"""Sparse and mkldnn gradients, replayed against eager with every compiler.

Compilers trace dense tensors: inductor cannot compile sparse ones, and a node run on fake
tensors returns a strided gradient where an mkldnn one is due. A node whose gradients the
graph's metadata declares non-strided runs as itself, and so does one whose saved flags make
its gradients sparse (``sparse_grad=True``, ``Embedding(sparse=True)``); any other found
with sparse values while Dynamo traces it runs as itself when the compiler fails on it.
"""

from __future__ import annotations

import functools

import pytest
import torch

import replaygrad

from conftest import (
    COMPILERS,
    assert_replayed,
    assert_same,
    compare,
    eager_backward,
    replay_backward,
    summary,
)


def _grads(*tensors: torch.Tensor) -> tuple:
    return tuple(summary(t.grad) for t in tensors)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_sparse_gather_gradient(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(4, 3, requires_grad=True)
        index = torch.tensor([[0, 2, 1], [3, 3, 0]])
        out = torch.gather(x, 0, index, sparse_grad=True)
        backward(out, torch.rand_like(out))
        return (), _grads(x)

    compare(run, compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_sparse_and_dense_gradients_meet_in_a_buffer(compiler):
    # The leaf receives a sparse gradient (gather) and a dense one (clone); the root
    # gradients given are not modified in place.
    def run(backward):
        torch.manual_seed(0)
        leaf = torch.rand(2, 2, requires_grad=True)
        out2 = leaf.gather(0, torch.tensor([[0, 0]]), sparse_grad=True)
        out1 = leaf.clone() * 2
        g1, g2 = torch.rand_like(out1), torch.rand_like(out2)
        originals = (g1.clone(), g2.clone())
        backward((out1, out2), (g1, g2))
        return (torch.equal(g1, originals[0]), torch.equal(g2, originals[1])), _grads(leaf)

    compare(run, compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_sparse_embedding_training_steps(compiler):
    # A sparse gradient on every call: after the first call the cache entry knows which
    # step runs as itself, and later calls hit it.
    torch.manual_seed(0)
    eager = torch.nn.Embedding(10, 4, sparse=True)
    rg = torch.nn.Embedding(10, 4, sparse=True)
    rg.load_state_dict(eager.state_dict())
    for step in range(3):
        ids = torch.tensor([[1, 2, 2], [7, 1, 0]]) + step
        for model, backward in ((eager, eager_backward), (rg, replay_backward(compiler))):
            model.zero_grad()
            backward((model(ids).sin() * 3).sum())
        assert_same(summary(eager.weight.grad), summary(rg.weight.grad), compiler is None, "grad")
    assert replaygrad.cache_info().size == 1


@pytest.mark.parametrize("compiler", COMPILERS)
def test_sparse_embedding_used_twice(compiler):
    # Traced, embedding's backward gives a dense fake tensor; its sparse gradients summed
    # in a compiled graph came out wrong (every term the first one), without an error.
    def run(backward):
        w = torch.ones(8, 2, requires_grad=True)
        a = torch.nn.functional.embedding(torch.tensor([1, 2]), w, sparse=True)
        b = torch.nn.functional.embedding(torch.tensor([7]), w, sparse=True)
        # Summed in w's input buffer, in eager's operand order (the indices show it).
        backward(a.sum() * 2 + b.square().sum() * 3)
        return (), (w.grad.to_dense(), w.grad._indices())

    compare(run, compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_sparse_leaf(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(3, 3).relu().to_sparse().requires_grad_(True)
        w = torch.randn(3, 2, requires_grad=True)
        backward((x.to_dense() @ w).tanh().sum())
        return (), _grads(x, w)

    compare(run, compiler)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no mkldnn in this build")
@pytest.mark.parametrize("compiler", COMPILERS)
def test_mkldnn_leaf_gradient(compiler):
    # autograd.grad of a dense function of an mkldnn leaf (what gradcheck does).
    def run(grad):
        torch.manual_seed(0)
        a = torch.rand(10, requires_grad=True)
        b = torch.rand(10).to_mkldnn().requires_grad_(True)
        out = (a + b.to_dense()).square()
        grads = grad(out, (a, b), torch.ones_like(out))
        return (grads[1].layout, *tuple(summary(g.to_dense()) for g in grads))

    expected = run(torch.autograd.grad)
    before = replaygrad.cache_info()
    got = run(functools.partial(replaygrad.grad, compiler=compiler))
    assert_replayed(before)
    assert_same(expected, got, exact=compiler is None, where="grads")


def test_tensor_subclass_values_run_uncompiled():
    # Dynamo cannot fake a LoggingTensor: compiled, every step was a graph break and a frame
    # of its own to compile (minutes for PyTorch's autograd.functional tests). Such calls run
    # the replay uncompiled, exactly as eager.
    from torch.testing._internal.logging_tensor import LoggingTensor

    def f(x):
        return (x.exp() * x).sin().sum()

    x = LoggingTensor(torch.randn(3)).requires_grad_()
    (expected,) = torch.autograd.grad(f(x), x)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    for _ in range(2):
        (got,) = replaygrad.grad(f(x), x, compiler="aot_eager")
        assert type(got) is LoggingTensor
        torch.testing.assert_close(got.elem, expected.elem, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["frames"]["total"] == frames, "Dynamo saw no frame"
    assert replaygrad.cache_info()[:2] == (1, 1)
    # The same structure with plain tensors compiles (an entry of its own), and a subclass
    # call after it still runs uncompiled.
    plain = x.elem.detach().requires_grad_()
    replaygrad.grad(f(plain), plain, compiler="aot_eager")
    assert torch._dynamo.utils.counters["frames"]["total"] > frames
    frames = torch._dynamo.utils.counters["frames"]["total"]
    (got,) = replaygrad.grad(f(x), x, compiler="aot_eager")
    torch.testing.assert_close(got.elem, expected.elem, rtol=0, atol=0)
    assert torch._dynamo.utils.counters["frames"]["total"] == frames


def _nested_graph(layout: torch.layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = torch.randn(2, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    nt = torch.nested.as_nested_tensor([a, b], layout=layout)
    if layout == torch.jagged:
        # Nodes of a tensor subclass run as themselves: a jagged gradient passes between them.
        loss = (nt.sin() * 2).values().sum()
    else:
        loss = torch.nested.to_padded_tensor(nt * 3, 0.0).sum()
    return a, b, loss


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
@pytest.mark.parametrize("compiler", COMPILERS)
def test_nested_tensor_graphs_replay_uncompiled(compiler, layout):
    # Compiled, a strided nested saved value failed before the compile (it has no sizes) and
    # a jagged gradient failed Dynamo's guards where it resumed after a graph break, also
    # with fallback="eager": a graph whose nodes take nested tensors replays uncompiled.
    def run(backward):
        torch.manual_seed(0)
        a, b, loss = _nested_graph(layout)
        backward(loss)
        return [], _grads(a, b)

    frames = torch._dynamo.utils.counters["frames"]["total"]
    compare(run, compiler)
    assert torch._dynamo.utils.counters["frames"]["total"] == frames, "Dynamo saw no frame"
    assert "def replay" in replaygrad.plan(_nested_graph(layout)[2]).source
