"""Hooks of every kind, against eager: which hooks run, in which order, what each one sees,
and the gradients they leave behind.

Each test builds its graph in ``run(backward)`` from a fixed seed, registers hooks that log
what they see, and runs once with the engine and once with replaygrad.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

import replaygrad

from conftest import (
    COMPILERS,
    FAST_COMPILERS,
    Doubling,
    assert_grads_equal,
    assert_replayed,
    assert_same,
    eager_backward,
    grads_of,
    replay_backward,
    summary,
)


def assert_logs_equal(expected: list, got: list, exact: bool) -> None:
    """Same hooks, same order, same arguments."""
    assert [e[0] for e in expected] == [g[0] for g in got]
    for n, (e, g) in enumerate(zip(expected, got)):
        assert_same(e[1:], g[1:], exact, f"log entry {n} ({e[0]})")


def compare(run, compiler, **options) -> None:
    """``run(backward) -> (log, grads)`` with the engine and with replaygrad (compile
    ``options`` given)."""
    expected_log, expected_grads = run(eager_backward)
    got_log, got_grads = run(replay_backward(compiler, **options))
    exact = compiler is None
    assert_logs_equal(expected_log, got_log, exact)
    assert_same(tuple(expected_grads), tuple(got_grads), exact, "grads")


# ---- tensor hooks --------------------------------------------------------------------------


@pytest.mark.parametrize("compiler", COMPILERS)
def test_tensor_hooks_on_leaves_and_non_leaves(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        x.register_hook(lambda g: log.append(("x0", summary(g))))
        x.register_hook(lambda g: g * 2)
        x.register_hook(lambda g: log.append(("x2", summary(g))))
        w.register_hook(lambda g: g.neg())
        h = x * w
        h.register_hook(lambda g: log.append(("h0", summary(g))))
        h.register_hook(lambda g: g + 1)
        h.register_hook(lambda g: None)
        h.register_hook(lambda g: log.append(("h3", summary(g))) or g * g)
        backward(h.tanh().sum())
        return log, grads_of([x, w])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_on_a_tensor_used_twice(compiler):
    # One call per tensor, with the gradients of both uses summed first.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(4, requires_grad=True)
        x.register_hook(lambda g: log.append(("x", summary(g))))
        h = x.sin()
        h.register_hook(lambda g: log.append(("h", summary(g))) or g * 0.5)
        loss = (h * x).sum() + (h.exp() * 3).sum() + x.pow(2).sum()
        backward(loss)
        return log, grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_on_the_roots(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)  # a leaf as a root
        loss = x.exp().sum()
        loss.register_hook(lambda g: log.append(("loss", summary(g))) or g * 2)
        loss.grad_fn.register_prehook(lambda go: log.append(("loss pre", summary(go))))
        w.register_hook(lambda g: log.append(("w", summary(g))) or g - 1)
        backward([loss, w], [None, torch.full((3,), 0.5)])
        return log, grads_of([x, w])

    compare(run, compiler)


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, ga, gb):
        return ga * 2 + gb * 3


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_on_outputs_of_multi_output_nodes(compiler):
    # A tensor hook belongs to one input slot of its grad_fn (its output_nr).
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, 4, requires_grad=True)
        a, b, c = (x * 1.5).unbind(0)
        b.register_hook(lambda g: log.append(("b", summary(g))) or g * 3)
        c.retain_grad()
        c.register_hook(lambda g: log.append(("c", summary(g))))
        p, q = TwoOutputs.apply(a)
        q.register_hook(lambda g: log.append(("q", summary(g))) or g * 5)
        p.grad_fn.register_hook(lambda gi, go: log.append(("Function post", summary((gi, go)))))
        backward((a * b + c.exp() + b + p * q).sum())
        return log, grads_of([x, c])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_before_and_after_an_in_place_op(compiler):
    # A hook registered before the in-place op sees the gradient of the value before it.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, 4, requires_grad=True)
        y = x.clone()
        y.register_hook(lambda g: log.append(("before", summary(g))) or g * 2)
        y[1:].mul_(2)  # CopySlices
        y.register_hook(lambda g: log.append(("after", summary(g))) or g + 1)
        y.retain_grad()
        backward((y * y).sum())
        return log, grads_of([x, y])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_retain_grad_with_hooks_before_and_after(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(5, requires_grad=True)
        x.retain_grad()  # a leaf: no-op
        h = x.exp()
        h.register_hook(lambda g: g * 3)  # registered before retain_grad
        h.retain_grad()
        h.register_hook(lambda g: log.append(("h", summary(g))) or g + 1)  # and after
        k = h.sin()
        k.retain_grad()
        k.retain_grad()  # twice: one .grad
        k.register_hook(lambda g: log.append(("k", summary(g))))
        y = (k * h).sum()
        y.retain_grad()  # the root
        backward(y, retain_graph=True)
        log.append(("first", summary([h.grad, k.grad, y.grad])))
        # A second backward through the same graph accumulates into the retained grads.
        backward(y * 2)
        return log, grads_of([x, h, k, y])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_reads_a_retained_grad_mid_backward(compiler):
    # A hook that reads a .grad runs outside the graph, after the effects of the steps
    # before it (here h's retain_grad), as in eager.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        h.retain_grad()
        x.register_hook(lambda g: log.append(("x", summary(h.grad))))
        backward(h.exp().sum())
        return log, grads_of([x, h])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_reads_and_scales_another_parameters_grad(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        w1 = torch.randn(3, 3, requires_grad=True)
        w2 = torch.randn(3, 3, requires_grad=True)
        w2.grad = torch.zeros(3, 3)
        x = torch.randn(2, 3)

        def hook(g):
            log.append(("w2.grad", summary(w2.grad)))
            w2.grad.mul_(0.5)

        w1.register_hook(hook)
        backward(((x @ w1).tanh() @ w2).square().sum())
        return log, grads_of([w1, w2])

    for _ in range(2):
        compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_running_a_backward_through_nodes_that_ran(compiler):
    # The hook's own backward goes through h's node, which ran before it, and frees its
    # saved values: eager then raises at the node that needs them. The hook runs outside
    # the graph (it names `backward`), after the replay released what the engine had.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x.exp()
        a = h.sin()

        def hook(g):
            with torch.enable_grad():
                h.sum().backward()
            log.append("nested")

        a.register_hook(hook)
        try:
            backward((a * 2).sum())
        except RuntimeError as error:
            log.append(("raised", str(error).splitlines()[0]))
        return log, grads_of([x])

    for _ in range(2):
        compare(run, compiler)


# ---- grad_fn hooks ------------------------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_node_pre_and_post_hooks(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        a = torch.randn(3, 2, requires_grad=True)
        b = torch.randn(2, 4, requires_grad=True)
        m = a @ b
        out = m.relu() * 2
        m.grad_fn.register_prehook(lambda go: log.append(("mm pre", summary(go))))
        m.grad_fn.register_prehook(lambda go: (go[0] * 10,))
        m.grad_fn.register_hook(lambda gi, go: log.append(("mm post", summary(gi), summary(go))))
        # A post hook that replaces one of the node's grad_inputs, keeps the other.
        m.grad_fn.register_hook(lambda gi, go: (gi[0] + 1, None))
        m.grad_fn.register_hook(lambda gi, go: log.append(("mm post 2", summary(gi))))
        relu = out.grad_fn.next_functions[0][0]
        relu.register_hook(lambda gi, go: log.append(("relu post", summary(gi), summary(go))))
        relu.register_prehook(lambda go: None)
        backward(out.sum())
        return log, grads_of([a, b])

    compare(run, compiler)


@pytest.mark.parametrize("options", [{}, {"fullgraph": True}])
def test_node_hooks_returning_tuples_are_traced_without_a_graph_break(options):
    """Node pre- and post-hooks that return a new tuple, or the one they were given: traced
    into the graph without a break (Dynamo cannot trace ``is`` between tuples)."""

    def run(backward):
        torch.manual_seed(0)
        a = torch.randn(3, 2, requires_grad=True)
        b = torch.randn(2, 4, requires_grad=True)
        m = a @ b
        m.grad_fn.register_prehook(lambda go: (go[0] * 10,))
        m.grad_fn.register_prehook(lambda go: go)
        m.grad_fn.register_hook(lambda gi, go: (gi[0] + 1, gi[1] * 2))
        m.grad_fn.register_hook(lambda gi, go: gi)
        backward((m.relu() * 2).sum())
        return [], grads_of([a, b])

    torch._dynamo.utils.counters.clear()
    compare(run, "aot_eager", **options)
    assert not torch._dynamo.utils.counters["graph_break"]


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_post_hook_sees_none_for_inputs_not_needing_grad(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        a = torch.randn(4, requires_grad=True)
        c = torch.randn(4)  # no grad: MulBackward0's second grad_input is undefined
        y = a * c
        y.grad_fn.register_hook(lambda gi, go: log.append(("mul", summary(gi), summary(go))))
        backward(y.sum())
        return log, grads_of([a])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_hook_order_across_nodes(compiler):
    # Every kind of hook on a graph with branches logs into one list: the engine's order.
    def run(backward):
        torch.manual_seed(0)
        log = []

        def tag(name):
            return lambda *args: log.append((name,))

        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        x.register_hook(tag("x tensor"))
        w.register_hook(tag("w tensor"))
        w.register_post_accumulate_grad_hook(tag("w post acc"))
        p = x * w
        q = x.exp()
        r = w.sin()
        for name, t in (("p", p), ("q", q), ("r", r)):
            t.register_hook(tag(f"{name} tensor"))
            t.grad_fn.register_prehook(tag(f"{name} pre"))
            t.grad_fn.register_hook(tag(f"{name} post"))
        s = p + q * r
        s.grad_fn.register_prehook(tag("s pre"))
        out = (s * p).sum() + r.sum()
        out.grad_fn.register_hook(tag("out post"))
        backward(out)
        return log, grads_of([x, w])

    compare(run, compiler)


# ---- AccumulateGrad hooks -----------------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_post_accumulate_grad_hook_sees_the_new_grad(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, requires_grad=True)
        v = torch.randn(3, requires_grad=True)
        w.register_post_accumulate_grad_hook(lambda p: log.append(("w", summary(p.grad))))
        v.register_post_accumulate_grad_hook(lambda p: log.append(("v", summary(p.grad))))
        v.register_hook(lambda g: g * 4)  # the tensor hook runs before the accumulation
        backward((w * v).sum() + w.exp().sum())
        backward((w * v * v).sum())  # the second one sees the accumulated grads
        return log, grads_of([w, v])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_hooked_accumulation_steals_a_gradient_its_producer_sent_elsewhere_too(compiler):
    # The convolution's node sends the weight's gradient to its AccumulateGrad (run in
    # place: it has a post-accumulate-grad hook) and the bias's to a later one. The engine
    # moves each gradient into its input buffer, so the accumulation steals the weight's
    # (keeping its strides, which in the depthwise weight's size-1 dim are not the
    # weight's); the replay kept the node's outputs for the bias, and it made a copy.
    def run(enabled: bool) -> tuple:
        torch.manual_seed(0)
        w = torch.randn(16, 1, 7, 7, requires_grad=True)
        b = torch.randn(16, requires_grad=True)
        seen = []
        w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.stride()))
        x = torch.randn(2, 16, 2, 2).contiguous(memory_format=torch.channels_last)
        loss = torch.nn.functional.conv2d(x, w, b, padding=3, groups=16).square().sum()
        if enabled:
            with replaygrad.enable(compiler):
                loss.backward()
        else:
            loss.backward()
        return seen, w.grad.stride(), w.grad, b.grad

    expected, got = run(False), run(True)
    assert expected[:2] == got[:2]
    assert_same(expected[2:], got[2:], compiler is None, "grads")


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_optimizer_in_backward(compiler):
    # The post-accumulate-grad hook steps the parameter and frees its grad, as in
    # torch's "optimizer step in backward" recipe.
    def run(backward):
        torch.manual_seed(0)
        log = []
        model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))

        def step(p):
            log.append(("step", summary(p.grad)))
            with torch.no_grad():
                p.add_(p.grad, alpha=-0.1)
            p.grad = None

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
        for _ in range(2):
            backward(model(torch.randn(6, 4)).square().mean())
        params = [p.detach().clone() for p in model.parameters()]
        return log, grads_of(model.parameters()) + params

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_post_accumulate_grad_hook_reads_other_parameters_grads(compiler):
    # E.g. a hook on the last parameter to be ready computing a norm over all of them.
    def run(backward):
        torch.manual_seed(0)
        log = []
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        model[0].weight.register_post_accumulate_grad_hook(
            lambda p: log.append(("grads", summary([q.grad for q in model.parameters()])))
        )
        backward(model(torch.randn(5, 3)).sum())
        return log, grads_of(model.parameters())

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_accumulate_grad_node_hooks(compiler):
    # grad_fn-style hooks on the AccumulateGrad node itself: the pre-hook may replace the
    # gradient; the post-hook runs after .grad is written.
    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, requires_grad=True)
        out = w * 2
        acc = out.grad_fn.next_functions[0][0]
        acc.register_prehook(lambda go: (go[0] * 5,))
        acc.register_hook(
            lambda gi, go: log.append(("acc post", summary(gi), summary(go), summary(w.grad)))
        )
        backward(out.sum())
        return log, grads_of([w])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_keeps_the_gradient_it_was_given(compiler):
    # AccumulateGrad may steal a gradient nobody else holds; one a hook kept is copied, so
    # the next accumulation (in place) does not change what the hook kept.
    def run(backward):
        torch.manual_seed(0)
        kept = []
        w = torch.randn(3, requires_grad=True)
        w.register_hook(lambda g: kept.append(g))
        backward((w * 2).sum())
        backward((w * 3).sum())
        return [("kept", summary(kept))], grads_of([w])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("holder", ["tensor hook keeps it", "pre-hook keeps it", "hook returns it"])
def test_gradient_held_by_python_with_an_accumulate_grad_post_hook(compiler, holder):
    # With a post hook on AccumulateGrad, the engine expects one C++ reference more before
    # it steals a gradient; a gradient also held from Python (a kept hook argument, a tensor
    # a hook returned) must still be copied, not shared with .grad. Without such a holder
    # it is stolen, as in the engine.
    def run(backward):
        torch.manual_seed(0)
        kept = []
        stolen = []
        w = torch.randn(3, requires_grad=True)
        own = torch.ones(3)
        out = w * 2
        acc = out.grad_fn.next_functions[0][0]
        if holder == "tensor hook keeps it":
            w.register_hook(lambda g: kept.append(g))
        elif holder == "pre-hook keeps it":
            acc.register_prehook(lambda gi: kept.append(gi[0]))
        else:
            w.register_hook(lambda g: own)
        acc.register_hook(lambda gi, go: stolen.append(go[0].data_ptr()))
        backward(out.sum())
        first_stolen = stolen[0] == w.grad.data_ptr()
        own.add_(1)
        backward((w * 3).sum())  # accumulates into w.grad in place
        return [("kept", summary(kept)), ("stolen", first_stolen)], grads_of([w])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_gradient_stolen_with_an_accumulate_grad_post_hook(compiler):
    def run(backward):
        stolen = []
        w = torch.ones(3, requires_grad=True)
        out = w * 2
        out.grad_fn.next_functions[0][0].register_hook(
            lambda gi, go: stolen.append(go[0].data_ptr())
        )
        w.register_hook(lambda g: g * 1)
        backward(out.sum())
        return [("stolen", stolen[0] == w.grad.data_ptr())], grads_of([w])

    compare(run, compiler)
    assert run(eager_backward)[0] == [("stolen", True)]


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_mutates_the_gradient_in_place(compiler):
    # AddBackward0 hands the same tensor to both of its inputs: a hook on one branch that
    # changes it in place (and returns None) changes the other branch's gradient too.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        a = x * 2
        b = x * 3

        def double_in_place(g):
            log.append(("b", summary(g)))
            g.mul_(2)

        b.register_hook(double_in_place)
        a.register_hook(lambda g: log.append(("a", summary(g))))
        backward((a + b).exp().sum())
        return log, grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("op", ["zero_", "fill_", "masked_fill_", "mul_", "clamp_"])
@pytest.mark.parametrize("kind", ["tensor", "pre", "post"])
def test_hook_mutates_an_expanded_gradient_in_place(compiler, op, kind):
    # sum()'s gradient is expanded (stride 0): in eager, mul_ and clamp_ on it raise
    # (internal overlap) and zero_/fill_/masked_fill_ write every alias. Traced, neither
    # happens (the compiled graph computed -3 for zero_); such hooks run outside the graph.
    ops = {
        "zero_": lambda g: g.zero_(),
        "fill_": lambda g: g.fill_(2.0),
        "masked_fill_": lambda g: g.masked_fill_(torch.tensor([True, False, True, False]), 0),
        "mul_": lambda g: g.mul_(3),
        "clamp_": lambda g: g.clamp_(max=0.5),
    }

    def mutate(g):
        ops[op](g)  # returns None: the engine goes on with g as mutated

    def run(backward):
        a = torch.ones(4, requires_grad=True)
        b = a * 2
        y = b.sum()
        if kind == "tensor":
            b.register_hook(mutate)
        elif kind == "pre":  # MulBackward0 gets SumBackward0's expanded gradient
            b.grad_fn.register_prehook(lambda grads: mutate(grads[0]))
        else:
            y.grad_fn.register_hook(lambda grad_inputs, _: mutate(grad_inputs[0]))
        try:
            backward(y)
        except RuntimeError as error:
            return [("error", str(error).splitlines()[0])], []
        return [], grads_of([a])

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Use of masked_fill_ on expanded tensors")
        compare(run, compiler)


@pytest.mark.parametrize("how", ["option", "callable"])
def test_hook_on_an_expanded_gradient_under_fullgraph(how):
    # No graph break is allowed: the hook stays in the graph (given as a callable, the
    # compiler is only known to refuse one once compiling fails; the call starts over).
    def run(backward):
        log = []
        a = torch.linspace(-1, 1, 4, requires_grad=True)
        b = a.exp()
        b.register_hook(lambda g: log.append(("b", summary(g))))
        backward(b.sum())
        return log, grads_of([a])

    def fullgraph_backward(loss):
        if how == "option":
            replaygrad.backward(loss, compiler="aot_eager", fullgraph=True)
        else:
            compiler = torch.compile(backend="aot_eager", fullgraph=True)
            replaygrad.backward(loss, compiler=compiler)

    expected_log, expected_grads = run(eager_backward)
    got_log, got_grads = run(fullgraph_backward)
    assert_logs_equal(expected_log, got_log, exact=False)
    assert_same(tuple(expected_grads), tuple(got_grads), False, "grads")


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_hook_drawing_random_numbers(compiler):
    # Gradient dropout in a tensor hook: the same mask as in eager, and torch's generator
    # left where eager leaves it (inductor drew from its own generator before 2026-12-07).
    def run(backward):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        after = []
        for _ in range(2):
            h = model[0](torch.randn(4, 5))
            h.register_hook(lambda g: g * (torch.rand_like(g) > 0.5))
            backward(model[2](model[1](h)).sum())
            after.append(torch.rand(3))
        return after, grads_of(model.parameters())

    compare(run, compiler)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_traced_hook_and_a_graph_break_under_a_fullgraph_callable(backend):
    # The first call starts over twice: the hook kept in the graph, then the regions cut at
    # the graph break, which moves the hooks out of the graph. The call went on with the
    # hooks as taken for the graph and failed (AttributeError: 'list' object has no
    # attribute 'dict').
    compiler = torch.compile(backend=backend, fullgraph=True)

    def run(backward):
        log = []
        w = torch.linspace(-1, 1, 4, requires_grad=True)
        for _ in range(2):
            h = Doubling.apply((w * 1.5).tanh())
            h.register_hook(lambda g: log.append(("h", summary(g))))
            backward(h.sin().sum())
        return log, grads_of([w])

    expected_log, expected_grads = run(eager_backward)
    got_log, got_grads = run(lambda loss: replaygrad.backward(loss, compiler=compiler))
    assert_logs_equal(expected_log, got_log, exact=False)
    assert_same(tuple(expected_grads), tuple(got_grads), False, "grads")


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_traced_hook_failing_on_the_traced_values_raises_as_in_eager(compiler):
    # The hook's error comes up while the compiler traces it (on fake tensors): the call
    # starts over with hooks outside the graph, where it raises as in eager, after the
    # effects before it.
    def run(backward):
        log = []
        x = torch.randn(4, requires_grad=True)
        h = x.exp()
        h.register_hook(lambda g: log.append(("h", summary(g))))
        out = h * 2
        out.register_hook(lambda g: g.view(-1, 3))
        try:
            backward(out.sum())
        except RuntimeError as error:
            log.append(("error", str(error).splitlines()[0]))
        return log, grads_of([x])

    compare(run, compiler)


def _add_tensor_hook(x, h, out, log):
    out.register_hook(lambda g: h.register_hook(lambda g: log.append(("late",)) or g * 10) and None)


def _remove_tensor_hook(x, h, out, log):
    handle = h.register_hook(lambda g: log.append(("removed",)) or g * 10)
    out.register_hook(lambda g: handle.remove())


def _add_node_pre_hook(x, h, out, log):
    out.register_hook(lambda g: h.grad_fn.register_prehook(lambda go: (go[0] * 7,)) and None)


def _add_post_accumulate_grad_hook(x, h, out, log):
    out.register_hook(
        lambda g: (
            x.register_post_accumulate_grad_hook(
                lambda p: log.append(("late acc", summary(p.grad)))
            )
            and None
        )
    )


def _add_node_post_hook(x, h, out, log):
    out.register_hook(
        lambda g: (
            h.grad_fn.register_hook(lambda gi, go: log.append(("post", summary(gi[0])))) and None
        )
    )


def _retain_grad(x, h, out, log):
    out.register_hook(lambda g: h.retain_grad())


def _add_leaf_hook(x, h, out, log):
    out.register_hook(
        lambda g: x.register_hook(lambda g: log.append(("leaf", summary(g))) or g * 10) and None
    )


def _add_accumulate_grad_post_hook(x, h, out, log):
    node = torch.autograd.graph.get_gradient_edge(x).node
    out.register_hook(
        lambda g: (
            node.register_hook(lambda gi, go: log.append(("acc post", summary(go[0])))) and None
        )
    )


def _changed_during_backward(change: Callable, middle: Callable = lambda x: x * 2) -> Callable:
    """``run(backward)`` for :func:`compare` of x -> h = middle(x) -> out = h.exp(), with
    ``change(x, h, out, log)`` made before the backward (hooks that edit hooks)."""

    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = middle(x)
        out = h.exp()
        change(x, h, out, log)
        backward(out.sum())
        return log, [*grads_of([x]), h.grad if h.retains_grad else None]

    return run


@pytest.mark.parametrize(
    "change",
    [
        _add_tensor_hook,
        _remove_tensor_hook,
        _add_node_pre_hook,
        _add_node_post_hook,
        _retain_grad,
        _add_leaf_hook,
        _add_accumulate_grad_post_hook,
        _add_post_accumulate_grad_hook,
    ],
)
@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_added_or_removed_during_backward(change, compiler):
    # Compiled, the first call runs uncompiled (the hook's code names a registration or a
    # removal), and later calls run what the hooks changed as in eager.
    for _ in range(3):
        compare(_changed_during_backward(change), compiler)


def _hidden_hook_edits(monkeypatch) -> None:
    """Hooks edit hooks where replaygrad's look at their code does not see it (e.g. through
    an object's method): then a compiled first call traces them."""
    monkeypatch.setattr(replaygrad._replay, "_HOOK_EDITS", frozenset())


@pytest.mark.parametrize(
    "edit",
    [
        lambda h, log, handle: h.register_hook(lambda g: log.append("added")),
        lambda h, log, handle: h.grad_fn.register_prehook(lambda g: log.append("pre")),
        lambda h, log, handle: h.retain_grad(),
        lambda h, log, handle: handle.remove(),
    ],
    ids=["tensor_hook", "prehook", "retain_grad", "remove"],
)
def test_hook_edits_hooks_through_a_helper(edit):
    # The hook reaches the edit through a module-level function, whose code is looked at
    # too: the first compiled call matches eager.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = (x * 2).sin()
        out = h.exp()
        handle = h.register_hook(lambda g: log.append("scaled") or g * 3)
        out.register_hook(lambda g: _edit_through(edit, h, log, handle))
        backward(out.sum())
        return log, [*grads_of([x]), h.grad if h.retains_grad else None]

    for _ in range(2):
        compare(run, "aot_eager")


def _edit_through(edit: Callable, *args: Any) -> None:
    edit(*args)


def test_tensor_hook_added_during_backward_runs_before_the_nodes_pre_hooks():
    # The engine calls a node's tensor pre-hooks, new ones included, before its pre-hooks:
    # here the pre-hook scales the gradient in place, and the new tensor hook sees it unscaled.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        out = h.exp()

        def scale(grad_outputs):
            log.append(("pre", summary(grad_outputs[0])))
            grad_outputs[0].mul_(0.5)

        h.grad_fn.register_prehook(scale)
        h.grad_fn.register_hook(lambda gi, go: log.append(("post", summary(gi[0]))))
        out.register_hook(
            lambda g: h.register_hook(lambda g: log.append(("late", summary(g)))) and None
        )
        backward(out.sum())
        return log, grads_of([x])

    compare(run, None)


def test_hook_added_during_backward_sees_what_the_engine_did_before():
    # Added on h by a hook of a node before it, the hook runs after w's accumulation (its
    # nodes come between) and while h's node is the current one, as in eager.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        h = x * 2
        w_term = (w * 3).sum()
        out = h.exp()

        def late(g):
            current = torch._C._current_autograd_node()
            log.append(("late", summary(w.grad), current is h.grad_fn))

        out.register_hook(lambda g: h.register_hook(late) and None)
        backward(w_term + out.sum())
        return log, grads_of([x, w])

    compare(run, None)


def test_tensor_hook_added_during_backward_on_an_input_of_grad():
    # autograd.grad with respect to h: h's node is not run, but the engine calls its tensor
    # pre-hooks, the one added during the backward too, before it captures the gradient.
    def run(grad):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        out = h.exp()
        out.register_hook(
            lambda g: h.register_hook(lambda g: log.append(("late", summary(g))) or g * 10) and None
        )
        return log, grad(out.sum(), [h])

    expected = run(torch.autograd.grad)
    got = run(lambda *args: replaygrad.grad(*args, compiler=None))
    assert_same(tuple(expected[0]), tuple(got[0]), True, "log")
    assert_same(tuple(expected[1]), tuple(got[1]), True, "grads")


def test_tensor_hook_added_during_a_compiled_backward_on_an_input_of_grad(caplog, monkeypatch):
    # As above, compiled: the step of h's node is not needed and traced with the hooks it
    # had when the call was planned. The first call misses the new one and says so; later
    # calls call the node's tensor pre-hooks outside the graph there, as in eager.
    _hidden_hook_edits(monkeypatch)

    def run(grad):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        h = x * 2
        out = (h * w).sin()
        out.register_hook(
            lambda g: h.register_hook(lambda g: log.append(("late", summary(g))) or g * 10) and None
        )
        return log, grad(out.sum(), [h])

    def compiled(*args):
        return replaygrad.grad(*args, compiler="aot_eager")

    expected = run(torch.autograd.grad)
    with caplog.at_level(logging.WARNING, logger="replaygrad"):
        run(compiled)
    assert "hooks registered on nodes of its graph" in caplog.text
    assert "MulBackward0 (step 3)" in caplog.text
    caplog.clear()
    for _ in range(2):
        got = run(compiled)
        assert_same(tuple(expected[0]), tuple(got[0]), True, "log")
        assert_same(tuple(expected[1]), tuple(got[1]), False, "grads")
    assert "during a compiled backward" not in caplog.text


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_added_during_backward_to_a_leaf_whose_hooks_were_removed(compiler):
    # The leaf's hook dict is left empty by a removed hook (the replay skips such a hook);
    # one added to it during the backward is called before the accumulation, as in eager.
    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, requires_grad=True)
        w.register_hook(lambda g: None).remove()
        h = (w * 2).tanh()
        h.register_hook(
            lambda g: w.register_hook(lambda g: log.append(("w", summary(g))) or g * 10) and None
        )
        backward(h.sum())
        return log, grads_of([w])

    compare(run, compiler)


def _warns_once_then_matches(run, caplog, *messages: str):
    """Runs ``run`` compiled with aot_eager: the first call logs a warning naming each of
    ``messages`` (hooks changed during it); two more calls match eager without one. Returns
    what the first call returned."""
    with caplog.at_level(logging.WARNING, logger="replaygrad"):
        first = run(replay_backward("aot_eager"))
    for message in messages:
        assert message in caplog.text
    caplog.clear()
    for _ in range(2):
        compare(run, "aot_eager")
    assert "during a compiled backward" not in caplog.text
    return first


def test_callable_added_during_a_compiled_backward_to_a_traced_hook(caplog, monkeypatch):
    # The leaf's hook is traced into the compiled graph with the callables its dict had
    # when the call was planned: one added during the backward is missed on that call,
    # which says so, and later calls run the hooks outside the graph, where they read it.
    _hidden_hook_edits(monkeypatch)

    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, requires_grad=True)
        w.register_hook(lambda g: log.append(("first", summary(g))))
        h = (w * 2).tanh()
        h.register_hook(
            lambda g: (
                w.register_hook(lambda g: log.append(("added", summary(g))) or g * 10) and None
            )
        )
        backward(h.sum())
        return log, grads_of([w])

    _warns_once_then_matches(run, caplog, "callables added to hooks traced into the compiled graph")


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize(
    "change",
    [_add_tensor_hook, _add_node_pre_hook, _add_node_post_hook, _add_leaf_hook, _retain_grad],
)
def test_hooks_added_during_backward_to_a_node_that_runs_as_itself(compiler, change):
    # A node run for real calls the hooks it got since the call was planned, also in a
    # compiled replay: a node that runs as itself, and a leaf's AccumulateGrad.
    compare(_changed_during_backward(change, Doubling.apply), compiler)


@pytest.mark.parametrize(
    "change", [_add_tensor_hook, _add_node_pre_hook, _add_node_post_hook, _retain_grad]
)
def test_hook_added_during_a_compiled_backward_to_a_traced_node(change, caplog, monkeypatch):
    # A traced step calls the hooks its node had when the call was planned: the first call
    # misses the new one and says so, and later calls run that node as itself, which calls
    # it as in eager.
    _hidden_hook_edits(monkeypatch)
    run = _changed_during_backward(change)
    _warns_once_then_matches(
        run, caplog, "hooks registered on nodes of its graph", "MulBackward0 (step 2)"
    )


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_removed_or_added_to_an_existing_dict_by_an_earlier_hook(compiler):
    # h's tensor hook dict exists before the backward; out's hook (run first) removes one
    # callable from it and adds another: the engine reads the dict when it reaches h.
    # Compiled, the first call runs uncompiled, and later ones read the dict live.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        out = h.exp()
        removed = h.register_hook(lambda g: log.append(("removed",)) or g * 10)
        h.register_hook(lambda g: log.append(("kept", summary(g))))

        def edit(g):
            removed.remove()
            h.register_hook(lambda g: log.append(("added", summary(g))) or g * 3)

        out.register_hook(edit)
        backward(out.sum())
        return log, grads_of([x])

    for _ in range(2):
        compare(run, compiler)


def test_hook_removed_during_a_compiled_backward_by_an_earlier_hook(caplog, monkeypatch):
    # A hook traced into the graph calls its dict's callables as they were when the call was
    # planned, so the first call still calls one an earlier hook removed, and says so; later
    # calls read the dict when they reach the hook, as the engine does.
    _hidden_hook_edits(monkeypatch)

    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        out = h.exp()
        removed = h.register_hook(lambda g: log.append(("removed",)) or g * 10)
        h.register_hook(lambda g: log.append(("kept", summary(g))))
        out.register_hook(lambda g: removed.remove())
        backward(out.sum())
        return log, grads_of([x])

    first = _warns_once_then_matches(
        run, caplog, "callables removed from hooks traced into the compiled graph"
    )
    assert first[0][0] == ("removed",), "the first call calls the removed callable"


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_that_removes_itself_is_called_once_in_every_call(compiler):
    # A one-shot hook: the compiled replay calls it (as eager does), notices the removal
    # after the first call and runs the hooks outside the graph from then on.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = (x * 2).exp()

        def once(g):
            log.append(("once", summary(g)))
            handle.remove()
            return g * 5

        handle = h.register_hook(once)
        backward(h.sum())
        return log, grads_of([x])

    for _ in range(3):
        compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_removed_by_another_callable_of_the_same_dict_still_runs(compiler):
    # The engine takes the dict's values when it starts calling them (test_autograd's
    # test_grad_fn_prehooks_remove_hooks): removing a later callable of the same dict does
    # not stop it this time.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        out = h.exp()

        def first(g):
            log.append(("first",))
            second.remove()
            h.register_hook(lambda g: log.append(("added",)))

        h.register_hook(first)
        second = h.register_hook(lambda g: log.append(("second", summary(g))) or g * 3)
        out.grad_fn.register_prehook(lambda go: log.append(("pre",)))
        backward(out.sum())
        return log, grads_of([x])

    compare(run, compiler)


# ---- removed hooks -----------------------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_removed_before_backward(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, requires_grad=True)
        h = w * 3
        out = h.sin()
        removed = [
            h.register_hook(lambda g: g * 100),
            w.register_hook(lambda g: g * 100),
            out.grad_fn.register_prehook(lambda go: (go[0] * 100,)),
            out.grad_fn.register_hook(lambda gi, go: (gi[0] * 100,)),
            w.register_post_accumulate_grad_hook(lambda p: log.append(("removed",))),
        ]
        h.register_hook(lambda g: log.append(("h kept", summary(g))))
        out.grad_fn.register_prehook(lambda go: log.append(("pre kept", summary(go))))
        for handle in removed:
            handle.remove()
        removed[0].remove()  # twice: no-op
        backward(out.sum())
        return log, grads_of([w])

    compare(run, compiler)


# ---- nn.Module backward hooks --------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_module_full_backward_hooks(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        first, act, last = model

        def pre(module, grad_output):
            log.append(("pre", type(module).__name__, summary(grad_output)))

        def scale_grad_output(module, grad_output):
            return (grad_output[0] * 2,)

        def post(module, grad_input, grad_output):
            log.append(("post", type(module).__name__, summary(grad_input), summary(grad_output)))

        def scale_grad_input(module, grad_input, grad_output):
            return (grad_input[0] * 0.5,)

        last.register_full_backward_pre_hook(pre)
        last.register_full_backward_pre_hook(scale_grad_output)
        last.register_full_backward_hook(post)
        act.register_full_backward_hook(scale_grad_input)
        act.register_full_backward_hook(post)
        first.register_full_backward_hook(post)  # its input needs no grad: grad_input (None,)
        model.register_full_backward_hook(post)
        backward(model(torch.randn(5, 4)).square().sum())
        return log, grads_of(model.parameters())

    compare(run, compiler)


@pytest.mark.parametrize("compiler", [*COMPILERS, "aot_eager_decomp_partition"])
def test_global_module_hooks_see_no_module_in_the_backward(compiler):
    # Eager's backward calls no module. torch's debugging backends call their graph as a
    # module (a lazy graph module's forward): global forward hooks were called on it, and
    # one rewriting its module's inputs failed the backward.
    def run(backward):
        torch.manual_seed(0)
        log = []
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        loss = model(torch.randn(5, 4)).square().sum()
        handles = [
            nn.modules.module.register_module_forward_pre_hook(
                lambda module, args: (
                    log.append(("pre", type(module).__name__)) or tuple(a * 1 for a in args)
                )
            ),
            nn.modules.module.register_module_forward_hook(
                lambda module, args, output: log.append(("forward", type(module).__name__))
            ),
        ]
        try:
            backward(loss)
        finally:
            for handle in handles:
                handle.remove()
        return log, grads_of(model.parameters())

    compare(run, compiler)


# ---- saved tensor hooks ------------------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_saved_tensors_hooks(compiler):
    # pack keeps a transformed copy; unpack undoes the transform. What each unpack returns
    # flows into the backward: the gradients show it was used.
    def run(backward):
        torch.manual_seed(0)
        log = []

        def pack(t):
            log.append(("pack", tuple(t.shape)))
            return (t * 2).to(torch.float64)

        def unpack(packed):
            log.append(("unpack", tuple(packed.shape)))
            return (packed / 2).to(torch.float32) + 0.25  # visible in the gradients

        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 2, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            h = (x @ w).sin()
            loss = (h * x.sum(1, keepdim=True)).sum()
        backward(loss)
        return log, grads_of([x, w])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_saved_tensors_hooks_packing_to_a_key(compiler):
    # The offloading pattern: pack hands out a key, not a tensor; unpack looks it up.
    def run(backward):
        torch.manual_seed(0)
        store = {}
        log = []

        def pack(t):
            store[len(store)] = t.clone()
            return len(store) - 1

        def unpack(key):
            log.append(("unpack", key))
            return store[key]

        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x.exp() * x).sin()
        backward(y.sum())
        return log, grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_post_hook_registered_on_the_running_node_by_its_unpack_hook(compiler):
    # The engine reads a node's post hooks after it ran: one registered while it ran (here
    # by the unpack hook of one of its saved values, on the current autograd node) is
    # called, without inputs, and its result replaces the node's outputs.
    def run(backward):
        torch.manual_seed(0)
        log = []

        def unpack(t):
            node = torch._C._current_autograd_node()

            def hook(outputs, inputs):
                log.append(("post", node.name(), len(inputs)))
                return tuple(o / 2 if o is not None else None for o in outputs)

            node.register_hook(hook)
            return t

        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            y = x.sin() * x
        backward(y.exp().sum())
        return log, grads_of([x])

    compare(run, compiler)


# ---- multi-grad hooks --------------------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("mode", ["all", "any"])
def test_multi_grad_hook_sees_the_gradients(compiler, mode):
    def run(backward):
        torch.manual_seed(0)
        log = []
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        unused = torch.randn(3, requires_grad=True)
        h = a * b  # a non-leaf in the set
        torch.autograd.graph.register_multi_grad_hook(
            (a, h, unused, b), lambda g: log.append(("multi", summary(g))), mode=mode
        )
        backward((h.exp() + a).sum())
        backward((b * 3).sum())
        return log, grads_of([a, b])

    compare(run, compiler)


# ---- autograd.grad and inputs= -----------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_under_autograd_grad(compiler):
    def run(grad):
        torch.manual_seed(0)
        log = []
        x = torch.randn(4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        x.register_hook(lambda g: log.append(("x", summary(g))) or g * 2)
        w.register_hook(lambda g: log.append(("w: not needed",)))
        h = x * w
        h.register_hook(lambda g: log.append(("h", summary(g))))
        h.grad_fn.register_prehook(lambda go: log.append(("h pre", summary(go))))
        h.grad_fn.register_hook(lambda gi, go: log.append(("h post", summary(gi), summary(go))))
        e = w.exp()
        e.grad_fn.register_prehook(lambda go: log.append(("exp pre: not needed",)))
        result = grad((h.sin() * e).sum(), [x, h])
        return log, list(result) + grads_of([x, w])

    def replay_grad(*args, **kwargs):
        before = replaygrad.cache_info()
        result = replaygrad.grad(*args, compiler=compiler, **kwargs)
        assert_replayed(before)
        return result

    expected_log, expected = run(torch.autograd.grad)
    got_log, got = run(replay_grad)
    assert_logs_equal(expected_log, got_log, exact=compiler is None)
    assert_grads_equal(expected, got, exact=compiler is None)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hooks_with_backward_inputs(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        x.register_hook(lambda g: log.append(("x: not an input",)))
        w.register_hook(lambda g: log.append(("w", summary(g))) or g + 1)
        w.register_post_accumulate_grad_hook(lambda p: log.append(("w acc", summary(p.grad))))
        h = x.exp() * w
        h.register_hook(lambda g: log.append(("h", summary(g))))
        h.grad_fn.register_hook(lambda gi, go: log.append(("h post", summary(gi))))
        backward(h.cos().sum(), inputs=[w])
        return log, grads_of([x, w])

    compare(run, compiler)


# ---- a hook with a side effect in a training loop -----------------------------------------


def test_hook_side_effect_each_iteration_one_compile():
    def train(enabled):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        seen = []
        results = []
        for _ in range(5):
            x = torch.randn(3, 4)
            h = model[0](x)
            h.register_hook(lambda g: seen.append(g.clone()))
            loss = model[2](model[1](h)).square().mean()
            model.zero_grad()
            with enabled():
                loss.backward()
            results.append(grads_of(model.parameters()))
        return seen, results

    expected_seen, expected = train(replaygrad.disable)
    before = replaygrad.cache_info()
    seen, got = train(lambda: replaygrad.enable("aot_eager"))
    after = replaygrad.cache_info()
    assert len(seen) == len(expected_seen) == 5
    for e, g in zip(expected_seen, seen):
        torch.testing.assert_close(g, e)
    for e, g in zip(expected, got):
        assert_grads_equal(e, g, exact=False)
    assert after.misses - before.misses == 1, after
    assert after.hits - before.hits == 4, after


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("where", ["pre_hook", "post_hook"])
def test_hook_changing_a_retained_gradient_in_place_after_retain_grad(compiler, where):
    # retain_grad stores a clone when the engine reaches it: a later hook's in-place change
    # of that gradient does not show in .grad (the replay applies retain_grad later).
    def scale_in_place(grad):
        grad.mul_(10)

    def run(backward):
        x = torch.linspace(-1, 1, 3, requires_grad=True)
        t = (x * 2).sin()
        t.retain_grad()
        if where == "pre_hook":
            t.grad_fn.register_prehook(lambda grads: scale_in_place(grads[0]))
        else:
            t.grad_fn.register_hook(lambda grad_inputs, grads: scale_in_place(grads[0]))
        backward((t * 3).sum())
        return t.grad, x.grad

    expected = run(eager_backward)
    got = run(replay_backward(compiler))
    assert_same(expected, got, compiler is None, "t.grad, x.grad")


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_hook_changing_in_place_a_gradient_already_summed_into_another_buffer(compiler):
    # q = a + y hands one gradient tensor to a and to y; it is the second gradient to reach
    # a, so the engine adds it into a's buffer when it arrives, before y's hook changes it
    # in place. The replay sums buffers as gradients arrive too.
    def scale_in_place(grad):
        grad.mul_(10)

    def run(backward):
        x = torch.linspace(-1, 1, 3, requires_grad=True)
        z = torch.linspace(0.5, 2, 3, requires_grad=True)
        a = x * 2
        y = z * 3
        q = a + y
        p = a.cos()  # reaches a's buffer first
        y.register_hook(scale_in_place)
        backward((p * q).sum())
        return x.grad, z.grad

    expected = run(eager_backward)
    got = run(replay_backward(compiler))
    assert_same(expected, got, compiler is None, "x.grad, z.grad")


class _Named(torch.autograd.Function):
    """Its backward records the node the engine says is running."""

    log: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        _Named.log.append(("function", _node_name()))
        return g * 3


def _node_name() -> str | None:
    node = torch._C._current_autograd_node()
    return None if node is None else node.name()


@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_current_autograd_node_in_hooks_and_functions(compiler, hidden, monkeypatch):
    # torch._C._current_autograd_node() is the node the engine evaluates, around its hooks
    # and its function (autograd's TORCH_LOGS=autograd messages and DebugMode read it). In
    # a compiled replay, a hook traced into the graph would get None; x's hook here calls
    # it through a helper, which replaygrad sees, so its hooks run outside the graph (y's
    # hooks get an expanded gradient, and run outside the graph anyway). With `hidden`, as
    # for a hook that reaches it in a way replaygrad does not see, the first call gets None,
    # and the replay's hooks run outside the graph from the next call on.
    def run(backward):
        torch.manual_seed(0)
        log = _Named.log = []
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(3, requires_grad=True)
        y = _Named.apply(w.sin()) * x
        y.register_hook(lambda g: log.append(("tensor", _node_name())))
        y.grad_fn.register_prehook(lambda g: log.append(("pre", _node_name())))
        y.grad_fn.register_hook(lambda gi, go: log.append(("post", _node_name())))
        w.register_post_accumulate_grad_hook(lambda p: log.append(("accumulated", _node_name())))

        def nested(g):
            # A backward the engine runs inside the hook: its own nodes, then ours again.
            a = torch.randn(2, requires_grad=True)
            with torch.enable_grad():
                b = a.exp()
                b.grad_fn.register_prehook(lambda gs: log.append(("nested", _node_name())))
                torch.autograd.grad(b.sum(), a)
            log.append(("after nested", _node_name()))

        x.register_hook(nested)
        backward(y.sum())
        log.append(("after", _node_name()))
        return log, grads_of([w, x])

    expected_log, expected_grads = run(eager_backward)
    assert expected_log[4] == ("after nested", "torch::autograd::AccumulateGrad")
    first_log = list(expected_log)
    if hidden:
        for names in ("_CURRENT_NODE", "_HOOK_EDITS", "_EFFECT_NAMES"):
            monkeypatch.setattr(replaygrad._replay, names, frozenset())
        if compiler is not None:
            first_log[4] = ("after nested", None)
    for log in (first_log, expected_log):
        got_log, got_grads = run(replay_backward(compiler))
        assert got_log == log
        assert_same(tuple(expected_grads), tuple(got_grads), compiler is None, "grads")
    with replaygrad.enable(compiler):
        assert torch._C._current_autograd_node() is None


@pytest.mark.parametrize("compiler", COMPILERS)
def test_autograd_debug_logging_names_the_nodes(compiler):
    # With torch.autograd.graph's logger at DEBUG (TORCH_LOGS="+autograd"), backward()
    # registers a pre-hook on every node that logs torch._C._current_autograd_node(). Such
    # a hook calls it by name: compiled replays run it outside the graph from the first call.
    logger = logging.getLogger("torch.autograd.graph")

    def run(backward):
        records: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append(re.sub(r" at 0x\w+", "", record.getMessage()))
        logger.addHandler(handler)
        level = logger.level
        logger.setLevel(logging.DEBUG)
        try:
            x = torch.randn(3, requires_grad=True)
            backward((x.sin() * 2).sum())
        finally:
            logger.setLevel(level)
            logger.removeHandler(handler)
        return records

    expected = run(eager_backward)
    assert expected[0].startswith("Executing: <SumBackward0") and len(expected) == 4
    assert run(replay_backward(compiler)) == expected


class _Printing(torch.autograd.Function):
    """Its backward prints: Dynamo breaks the graph there."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        print("backward")
        return 2 * x * g


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3)
        self.calls = 0

    def forward(self, x):
        return self.second(_Printing.apply(self.first(x)))


def test_module_hooks_after_a_replay_made_their_sizes_dynamic():
    # A 1-d graph cut into small regions with hooks, then 2-d calls of a module with full
    # backward hooks (which print and count) around a graph-breaking Function: Dynamo's
    # frames of replaygrad's hook callers see the sizes dynamic, one of them a constant by
    # then; torch 2.13's Dynamo fails on stride() of a tensor with such a stride (an
    # assertion), which replaygrad's check for expanded gradients read (it skips contiguous
    # ones now).
    prior = replaygrad._compile.cache.region_size
    replaygrad.set_region_size(4)
    try:
        h = torch.randn(4, requires_grad=True)
        for i in range(55):
            if i == 25:
                h = _Printing.apply(h)
            h = (h * 1.01 + 0.01).sin() if i % 2 else h.cos() * 0.9 + h
            if i % 8 == 0:
                h.register_hook(lambda g: None)
        with replaygrad.enable("aot_eager"):
            h.sum().backward()
    finally:
        replaygrad.set_region_size(prior)
    model = _Counted()

    def hook(module, grad_input, grad_output):
        model.calls += 1
        print("hook", model.calls)

    for module in (model.first, model.second, model):
        module.register_full_backward_hook(hook)
    for n in range(1, 4):
        x = torch.randn(2, 3, requires_grad=True)
        model(x).sum().backward()
        expected = x.grad
        x.grad = None
        with replaygrad.enable("aot_eager"):
            model(x).sum().backward()
        torch.testing.assert_close(x.grad, expected)
        assert model.calls == 6 * n
