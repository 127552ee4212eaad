"""Python Functions that do not declare themselves traceable: in compiled replays Dynamo
traces their backward into the graph where that does what the engine does (see
``replaygrad._replay.traced_functions``), and they run as themselves elsewhere. Every test
compares with eager autograd on the same inputs."""

from __future__ import annotations

from typing import ClassVar

import numpy
import pytest
import torch
from torch.autograd.function import once_differentiable

import replaygrad
from replaygrad._compile import cache

from conftest import Doubling, Through

COMPILED = ["aot_eager", "inductor"]


class Scaled(torch.autograd.Function):
    """``x * x * k`` with a float on ctx and an input that is not a tensor."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * x * k

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad * ctx.k if ctx.needs_input_grad[0] else None, None


def layers(x, w, function=Scaled, depth=3):
    for _ in range(depth):
        x = function.apply(torch.tanh(x @ w), 0.5)
    return x


def grads(make_loss, params, compiler=False, **options):
    for p in params:
        p.grad = None
    if compiler is False:
        make_loss().backward()
    else:
        replaygrad.backward(make_loss(), compiler=compiler, **options)
    return [p.grad.clone() for p in params]


def entry():
    (found,) = cache._entries.values()
    return found


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_functions_backward_is_traced_into_one_graph(compiler):
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)

    def loss():
        return layers(x, w).sum()

    expected = grads(loss, [w])
    torch._dynamo.utils.counters.clear()
    torch.testing.assert_close(grads(loss, [w], compiler), expected)
    through = Through()
    for _ in range(3):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert not torch._dynamo.utils.counters["graph_break"]
    replay = entry().replay
    assert len(replay.functions) == 3 and replay.breaks == ()
    assert [g.compiled for g in replay.regions] == [True]
    assert "backward_0(" in replay.source
    assert replaygrad.cache_info().misses == 1
    # Nothing but the graph in the region's compiled code: called directly.
    assert through.calls == 0


def test_uncompiled_replays_run_functions_as_themselves():
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)

    def loss():
        return layers(x, w).sum()

    expected = grads(loss, [w])
    assert torch.equal(grads(loss, [w], None)[0], expected[0])
    assert entry().replay.functions == ()


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_kept_out_of_compiled_graphs_runs_as_itself(compiler):
    # torch._dynamo.disable on a backward: a region of its own, run as Python.
    w = torch.randn(5, requires_grad=True)

    def loss():
        return (Doubling.apply(w.sin()) * w).exp().sum()

    expected = grads(loss, [w])
    torch.testing.assert_close(grads(loss, [w], compiler), expected)
    replay = entry().replay
    assert replay.functions == ()
    assert [g.compiled for g in replay.regions] == [True, False, True]


CALLS: list = []


class Counting(torch.autograd.Function):
    """Appends to a list in its backward: a Python side effect, which Dynamo replays."""

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        CALLS.append(grad.shape)
        return grad * 3


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_with_a_side_effect_runs_once_a_call_and_stops_recompiling(compiler):
    w = torch.randn(3, 4, requires_grad=True)

    def loss():
        return Counting.apply(w.cos()).sum()

    CALLS.clear()
    expected = grads(loss, [w])
    assert torch.Size([3, 4]) == CALLS[0] and len(CALLS) == 1
    for n in range(2, 5):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
        assert CALLS == [torch.Size([3, 4])] * n
    # Dynamo replays the append after the graph, guarding on the list's length: the second
    # call recompiled on a hit, so the backward runs outside the graph from then on (the
    # third compiles the regions around it), with nothing to guard on.
    assert entry().replay.functions == ()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in range(5, 9):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
        assert len(CALLS) == n
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


class Stepping(torch.autograd.Function):
    """Reads a global counter its backward increments: Dynamo guards on the value."""

    step = 0

    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, grad):
        Stepping.step += 1
        return grad * Stepping.step


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_that_recompiles_every_call_runs_as_itself_from_then_on(compiler):
    w = torch.randn(3, 4, requires_grad=True)

    def loss():
        return Stepping.apply(w.cos()).sum()

    for n in range(6):
        Stepping.step = n
        expected = grads(loss, [w])
        Stepping.step = n
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
        assert Stepping.step == n + 1
    # The second call recompiled (a guard on the counter failed): the backward runs
    # outside the graph from then on, with nothing to guard on.
    assert entry().replay.functions == ()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for n in range(6, 9):
        Stepping.step = n
        expected = grads(loss, [w])
        Stepping.step = n
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


class Branching(torch.autograd.Function):
    """A backward that branches on its gradient's values."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        if grad.sum() > 0:
            return grad * x
        return grad - x


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_branching_on_data_follows_the_data(compiler):
    w = torch.randn(5, requires_grad=True)
    for sign in (1.0, -1.0, 1.0):

        def loss(sign=sign):
            return (Branching.apply(w.sin()) * sign).sum()

        expected = grads(loss, [w])
        torch.testing.assert_close(grads(loss, [w], compiler), expected)


class OnceDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        ctx.save_for_backward(x, y)
        return x * y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        return grad * y, grad * x


class Mixed(torch.autograd.Function):
    """Tensor and non-tensor inputs, a gradient in another dtype (cast by the engine) and
    one to be summed to its input's shape (validate_outputs)."""

    @staticmethod
    def forward(ctx, a, n, b):
        ctx.save_for_backward(a, b)
        return a * b * n

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return (grad * b).double(), None, grad * a


@pytest.mark.parametrize("compiler", COMPILED)
def test_traced_backwards_get_the_engines_checks_and_casts(compiler):
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)

    def loss():
        x = OnceDifferentiable.apply(a.tanh(), b.sin())
        return Mixed.apply(x, 2, b).exp().sum()

    expected = grads(loss, [a, b])
    for _ in range(2):
        torch.testing.assert_close(grads(loss, [a, b], compiler), expected)
    assert len(entry().replay.functions) == 2


class TwoOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, g1, g2):
        return g1 * 2 + g2 * 3


@pytest.mark.parametrize("compiler", COMPILED)
def test_an_unused_output_gets_zeros_as_in_eager(compiler):
    w = torch.randn(4, requires_grad=True)

    def loss():
        first, _ = TwoOutputs.apply(w.cos())
        return first.sum()

    expected = grads(loss, [w])
    torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert entry().replay.functions == ()  # the engine materializes the zeros


class KeepingNumpy(torch.autograd.Function):
    """Keeps a numpy scalar on ctx, a float subclass that Dynamo traces as a 0-dim array."""

    seen: ClassVar[list] = []

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x * 1

    @staticmethod
    def backward(ctx, g):
        KeepingNumpy.seen.append(type(ctx.scale).__name__)
        return g * ctx.scale, None


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_ctx_keeping_numpy_scalars_runs_as_itself(compiler):
    # Plain values are of the builtin types themselves: the backward sees numpy's scalars,
    # as in eager, where traced it saw an ndarray for a float64 (a float subclass).
    w = torch.randn(4, requires_grad=True)
    scalars = [numpy.float64(1.5), numpy.float32(2.5), numpy.int64(3)]
    for scalar in scalars:
        expected = grads(lambda: KeepingNumpy.apply(w, scalar).sum(), [w])  # noqa: B023
        got = grads(lambda: KeepingNumpy.apply(w, scalar).sum(), [w], compiler)  # noqa: B023
        torch.testing.assert_close(got, expected)
    names = [type(scalar).__name__ for scalar in scalars]
    assert KeepingNumpy.seen == [name for name in names for _ in range(2)]
    KeepingNumpy.seen.clear()


class Unmaterialized(torch.autograd.Function):
    """Outputs: a product, a non-differentiable mask and another product; the backward gets
    None for missing gradients (``set_materialize_grads(False)``), or only for the mask
    (``_materialize_non_diff_grads`` off)."""

    @staticmethod
    def forward(ctx, x, materialize):
        ctx.set_materialize_grads(materialize)
        ctx._materialize_non_diff_grads = False
        mask = x > 0
        ctx.mark_non_differentiable(mask)
        return x * 2, mask, x * 3

    @staticmethod
    def backward(ctx, g1, g_mask, g2):
        assert g_mask is None
        grad = g1 * 2 if g1 is not None else None
        if g2 is not None:
            grad = g2 * 3 if grad is None else grad + g2 * 3
        return grad, None


@pytest.mark.parametrize("compiler", COMPILED)
@pytest.mark.parametrize("materialize", [False, True])
def test_a_backward_given_none_for_missing_gradients_is_traced(compiler, materialize):
    # Where the engine hands the backward None for a gradient no node sends (the Function
    # says so), the traced backward gets None too; where it materializes zeros, the node
    # runs as itself (see the test above).
    w = torch.randn(4, requires_grad=True)

    def loss():
        first, _, _ = Unmaterialized.apply(w.cos(), materialize)
        return first.sum()

    expected = grads(loss, [w])
    for _ in range(2):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert len(entry().replay.functions) == (0 if materialize else 1)


class WritesGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.mul_(2)


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_writing_into_an_expanded_gradient_raises_as_in_eager(compiler):
    w = torch.randn(4, requires_grad=True)

    def loss():
        return WritesGrad.apply(w.cos()).sum()  # sum's gradient is expanded

    with pytest.raises(RuntimeError) as eager:
        loss().backward()
    with pytest.raises(RuntimeError) as replayed:
        replaygrad.backward(loss(), compiler=compiler)
    assert str(replayed.value) == str(eager.value)

    def dense():
        return (WritesGrad.apply(w.cos()) * w).sum()

    expected = grads(dense, [w])
    cache.clear()
    torch.testing.assert_close(grads(dense, [w], compiler), expected)


class Remembering(torch.autograd.Function):
    """Counts its backward calls on ctx: only the node's own ctx keeps that."""

    @staticmethod
    def forward(ctx, x):
        ctx.calls = 0
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        ctx.calls += 1
        return grad * ctx.calls


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_setting_ctx_attributes_runs_as_itself(compiler):
    w = torch.randn(4, requires_grad=True)
    results = []
    for replay in (False, True):
        w.grad = None
        y = Remembering.apply(w.sin()).sum()
        for _ in range(3):
            if replay:
                replaygrad.backward(y, compiler=compiler, retain_graph=True)
            else:
                y.backward(retain_graph=True)
        results.append(w.grad.clone())
    torch.testing.assert_close(results[1], results[0])


def bad(returned):
    class Bad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, n):
            return x * n

        @staticmethod
        def backward(ctx, grad):
            return returned(grad)

    return Bad


@pytest.mark.parametrize("compiler", COMPILED)
@pytest.mark.parametrize(
    "returned",
    [
        lambda g: g,  # one gradient for two inputs
        lambda g: (g, g),  # a gradient for the int
        lambda g: (g, None, None, g),  # an extra one that is not None
        lambda g: (3, None),  # not a tensor
        lambda g: (g[:2], None),  # the wrong shape
        lambda g: [g, None],  # a list is one value
    ],
)
def test_bad_gradients_raise_the_engines_error(compiler, returned):
    function = bad(returned)
    w = torch.randn(4, requires_grad=True)

    def loss():
        return function.apply(w.cos(), 2).sum()

    with pytest.raises(Exception) as eager:
        loss().backward()
    for _ in range(2):
        with pytest.raises(Exception) as replayed:
            replaygrad.backward(loss(), compiler=compiler)
        assert type(replayed.value) is type(eager.value)
        assert str(replayed.value) == str(eager.value)


class Raising(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("no backward today")


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_that_raises_raises_as_in_eager(compiler):
    w = torch.randn(4, requires_grad=True)

    def loss():
        return (Raising.apply(w.cos()) * w).sum()

    w.grad = None
    with pytest.raises(ValueError, match="no backward today"):
        loss().backward()
    assert w.grad is None  # the Function's node runs before w's AccumulateGrad
    for _ in range(2):
        with pytest.raises(ValueError, match="no backward today"):
            replaygrad.backward(loss(), compiler=compiler)
        assert w.grad is None


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_function_with_another_ctx_state_compiles_its_own_replay(compiler):
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)
    for k in (0.5, 0.5, 2.0, 2.0):

        def loss(k=k):
            return Scaled.apply(torch.tanh(x @ w), k).sum()

        expected = grads(loss, [w])
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert replaygrad.cache_info().misses == 2


class Casting(torch.autograd.Function):
    """Computes in float64 and casts the gradient back: its ctx keeps torch's immutable
    values (a dtype, a device, a layout, a memory format and a torch.Size)."""

    @staticmethod
    def forward(ctx, x):
        ctx.dtype, ctx.device, ctx.layout, ctx.shape = x.dtype, x.device, x.layout, x.shape
        ctx.format = torch.contiguous_format
        ctx.save_for_backward(x)
        return (x.double() * 2).sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        assert ctx.layout == torch.strided and ctx.format == torch.contiguous_format
        g = grad * 2 * (x.double() * 2).cos()
        return g.to(dtype=ctx.dtype, device=ctx.device).reshape(ctx.shape)


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_ctx_keeping_dtypes_and_devices_is_traced_and_keyed_by_them(compiler):
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)
    for dtype in (torch.float32, torch.float32, torch.float16):

        def loss(dtype=dtype):
            return Casting.apply(torch.tanh(x @ w).to(dtype)).sum()

        expected = grads(loss, [w])
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert replaygrad.cache_info().misses == 2
    assert [len(e.replay.functions) for e in cache._entries.values()] == [1, 1]


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_traced_backward_keeps_no_tensor_alive(compiler):
    import gc
    import weakref

    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)
    activation = torch.tanh(x @ w)
    alive = weakref.ref(activation)
    replaygrad.backward(Scaled.apply(activation, 0.5).sum(), compiler=compiler)
    assert len(entry().replay.functions) == 1
    del activation
    gc.collect()
    assert alive() is None


class ScalesSaved(torch.autograd.Function):
    """Writes into its saved input in place (to save memory), which a later node saved too."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.mul_(2)


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_backward_writing_into_a_value_a_later_node_saved_raises_as_in_eager(compiler):
    w = torch.randn(4, requires_grad=True)

    def loss():
        x = w.sin()
        later = x.cos()  # CosBackward0 saved x; it runs after the Function's node
        return (ScalesSaved.apply(x) + later).sum()

    with pytest.raises(RuntimeError) as eager:
        loss().backward()
    for _ in range(2):
        with pytest.raises(RuntimeError) as replayed:
            replaygrad.backward(loss(), compiler=compiler)
        # (The version: the compiled graph's write is copied back when it ends.)
        assert (
            str(replayed.value).split(" is at version")[0]
            == str(eager.value).split(" is at version")[0]
        )
    assert len(entry().replay.functions) == 1


class KeptOut(torch.autograd.Function):
    """Saves its input; its backward runs as itself (kept out of compiled graphs)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    @torch._dynamo.disable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * 2 + 0 * x


@pytest.mark.parametrize("compiler", [None, *COMPILED])
def test_a_function_run_as_itself_frees_its_saved_tensors_when_it_ran(compiler):
    # The engine releases a node's saved variables once it ran: a tensor only the
    # Function saved is freed then, before the nodes after it run. (A compiled replay holds
    # the saved values of its traced steps until the call ends: the README's Known
    # limitations.)
    import weakref

    def observed(backward):
        w = torch.randn(4, requires_grad=True)
        big = w * 3
        alive = weakref.ref(big)
        y = KeptOut.apply(big)
        seen = []
        # (It names `grad`: compiled replays call it outside the graph, where it sees what
        # eager shows it, see traced_hooks_concern.)
        big.grad_fn.register_prehook(lambda grads: seen.append((alive() is not None, w.grad)))
        del big
        backward((y * w).sum())
        return seen

    assert observed(lambda loss: loss.backward()) == [(False, None)]
    for _ in range(2):
        replayed = observed(lambda loss: replaygrad.backward(loss, compiler=compiler))
        assert replayed == [(False, None)]


@pytest.mark.parametrize("compiler", COMPILED)
def test_regions_alike_but_for_a_functions_ctx_state_do_not_share_it(compiler):
    # Layers of one structure split into regions of a layer each: a Function's ctx state
    # (its scale) is part of the region's key, so a layer with another scale gets a region
    # of its own.
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)

    def loss():
        h = x
        for k in (0.5, 0.5, 0.5, 2.0, 0.5, 2.0):
            h = Scaled.apply(torch.tanh(h @ w), k)
        return h.sum()

    expected = grads(loss, [w])
    prior = cache.region_size
    replaygrad.set_region_size(3)
    try:
        for _ in range(2):
            torch.testing.assert_close(grads(loss, [w], compiler), expected)
        replay = entry().replay
        assert len(replay.regions) > 3 and len(replay.functions) == 6
        assert len({g.key for g in replay.regions}) < len(replay.regions)
    finally:
        replaygrad.set_region_size(prior)


class ClearsOnAccess(torch.autograd.Function):
    clear_saved_tensors_on_access = True

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_function_clearing_its_saved_tensors_on_access_runs_as_itself(compiler):
    # Looking at its saved tensors when the replay is built would clear them.
    w = torch.randn(4, requires_grad=True)

    def loss():
        return (ClearsOnAccess.apply(w.sin()) * w).sum()

    expected = grads(loss, [w])
    for _ in range(2):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert entry().replay.functions == ()


class ItemScale(torch.autograd.Function):
    """A backward that breaks Dynamo's graph (it makes a Python float of a tensor)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        return x * k

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * float(x.abs().max().item()), None


@pytest.mark.parametrize("compiler", COMPILED)
def test_functions_whose_backward_breaks_the_graph_run_as_themselves(compiler):
    # Found while Dynamo traces the first of them: the call starts over with every node of
    # that Function run as itself, before anything was compiled for the break (each broken
    # backward would be frames of their own, compiled and called every time).
    w = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6)

    def loss():
        return layers(x, w, ItemScale, depth=4).sum()

    expected = grads(loss, [w])
    torch._dynamo.utils.counters.clear()
    torch.testing.assert_close(grads(loss, [w], compiler), expected)
    replay = entry().replay
    assert replay.functions == () and len(replay.breaks) == 4
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 1
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for _ in range(2):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("compiler", COMPILED)
@pytest.mark.parametrize("breaking", ["item", "raise"])
@pytest.mark.parametrize("counting", [False, True])
def test_user_code_before_a_graph_breaking_backward_runs_once(compiler, breaking, counting):
    # Before a Function whose backward breaks the graph, in its region: a hook on its
    # gradient (and a side effect of another Function's backward). Where Dynamo runs the
    # region's part before the break, then traces the broken backward as a frame of its own
    # (a backward that raises), the call does not start over (the hook would run twice);
    # where Dynamo traces the region again first (`.item()`), the call starts over before
    # any of it ran.
    w = torch.randn(4, requires_grad=True)
    calls: list = []

    def loss():
        a = w.cos()
        y = ItemScale.apply(a, 2.0) if breaking == "item" else Raising.apply(a)
        y.register_hook(lambda g: calls.append(len(calls)))
        return ((Counting.apply(y) if counting else y) * w).sum()

    def run(compiler=False):
        CALLS.clear()
        calls.clear()
        w.grad = None
        try:
            if compiler is False:
                loss().backward()
            else:
                replaygrad.backward(loss(), compiler=compiler)
        except ValueError as error:
            return str(error), len(calls), len(CALLS)
        return w.grad.clone(), len(calls), len(CALLS)

    expected = run()
    assert expected[1:] == (1, int(counting))
    for _ in range(2):
        result = run(compiler)
        assert result[1:] == expected[1:]
        if breaking == "raise":
            assert result[0] == expected[0]
        else:
            torch.testing.assert_close(result[0], expected[0])


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_side_effect_in_an_earlier_region_happens_once_when_a_backward_breaks_later(compiler):
    # A traced backward's side effect (Counting) in one region, a graph-breaking backward
    # in a later one: the call does not start over once the earlier region ran.
    w = torch.randn(4, requires_grad=True)

    def loss():
        y = ItemScale.apply(w.cos(), 2.0)
        for _ in range(12):
            y = y.sin() * 1.01
        return (Counting.apply(y) * w).sum()

    prior = cache.region_size
    replaygrad.set_region_size(2)
    try:
        CALLS.clear()
        expected = grads(loss, [w])
        for n in (2, 3):
            torch.testing.assert_close(grads(loss, [w], compiler), expected)
            assert len(CALLS) == n
        assert len(entry().replay.regions) > 2
    finally:
        replaygrad.set_region_size(prior)


class Unsaving(torch.autograd.Function):
    """Saves nothing: ctx state only."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k, ctx.mode = k, "scale"
        return x * k

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.k if ctx.mode == "scale" else grad), None


@pytest.mark.parametrize("compiler", COMPILED)
def test_a_function_in_a_graph_without_saved_values_is_traced(compiler):
    w = torch.randn(3, 4, requires_grad=True)

    def loss():
        return Unsaving.apply(w, 3.0).sum()

    expected = grads(loss, [w])
    for _ in range(2):
        torch.testing.assert_close(grads(loss, [w], compiler), expected)
    assert entry().replay.functions == (1,)
