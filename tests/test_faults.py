"""Faults mid-replay lose nothing: exceptions reach the caller unchanged, the graph's saved
values are intact afterwards, a backward that raises is not compiled again, and compile
failures are reported with the plan's key (or sent to the engine with fallback='eager')."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch

import replaygrad
from replaygrad import _engine

from conftest import COMPILERS, FAST_COMPILERS, Doubling, assert_grads_equal, grads_of


class Boom(Exception):
    pass


class Failing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t):
        return t * 2

    @staticmethod
    def backward(ctx, g):
        raise Boom("backward failed")


def graph():
    x = torch.randn(4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    h = (x * w).exp()
    return x, w, h, (h.sin() * x).sum()


def expected_grads(x, w):
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    h = (x2 * w2).exp()
    (h.sin() * x2).sum().backward()
    return x2.grad, w2.grad


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("error", [Boom("hook failed"), KeyboardInterrupt()])
def test_hook_raising_mid_replay_leaves_the_graph_intact(compiler, error):
    x, w, h, loss = graph()

    def hook(g):
        raise error

    handle = h.register_hook(hook)
    with pytest.raises(type(error)):
        replaygrad.backward(loss, retain_graph=True, compiler=compiler)
    assert replaygrad.cache_info().size == 1, "no compile failed: the entry stays"
    handle.remove()
    x.grad = w.grad = None
    # Every saved value was swapped back: the engine gets the right gradients.
    loss.backward()
    ex, ew = expected_grads(x, w)
    torch.testing.assert_close(x.grad, ex)
    torch.testing.assert_close(w.grad, ew)


def test_custom_function_raising_reaches_the_caller():
    x = torch.randn(3, requires_grad=True)
    loss = (Failing.apply(x.exp()) * x).sum()
    with pytest.raises(Boom, match="backward failed"):
        replaygrad.backward(loss, retain_graph=True, compiler="aot_eager")
    with pytest.raises(Boom):
        loss.backward()


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("where", ["function", "hook"])
def test_a_backward_raising_on_every_call_compiles_once(compiler, where):
    # E.g. a test of the error in a loop: the replay's compiled regions serve every call.
    counters = torch._dynamo.utils.counters["stats"]
    graphs = []

    def hook(g):
        raise Boom("hook failed")

    for _ in range(4):
        x = torch.randn(3, requires_grad=True)
        h = x.exp() * x
        if where == "function":
            h = Failing.apply(h)
        else:
            h.register_hook(hook)
        loss = (h.sin() * x).sum()
        with pytest.raises(Boom):
            replaygrad.backward(loss, compiler=compiler)
        graphs.append(counters["unique_graphs"])
    info = replaygrad.cache_info()
    assert (info.misses, info.hits, info.size) == (1, 3, 1)
    assert graphs[1:] == graphs[:1] * 3, f"Dynamo graphs after each call: {graphs}"


def failing_backend(gm, example_inputs):
    raise RuntimeError("the backend broke")


def test_compile_failure_names_the_plan():
    x, w, _h, loss = graph()
    key = replaygrad.plan(loss).key
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        replaygrad.backward(loss, compiler=torch.compile(backend=failing_backend))
    assert any(key in note for note in info.value.__notes__)
    assert x.grad is None and w.grad is None
    assert replaygrad.cache_info().size == 0


def falls_back_to_the_engine(compiler, caplog) -> list[logging.LogRecord]:
    """Two backward calls with ``compiler`` and ``fallback="eager"`` give eager's gradients;
    returns the warnings logged."""
    caplog.set_level(logging.WARNING, logger="replaygrad")
    for _ in range(2):
        x, w, _h, loss = graph()
        replaygrad.backward(loss, compiler=compiler, fallback="eager")
        ex, ew = expected_grads(x, w)
        torch.testing.assert_close(x.grad, ex)
        torch.testing.assert_close(w.grad, ew)
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def test_compile_failure_falls_back_to_the_engine(caplog):
    warnings = falls_back_to_the_engine(torch.compile(backend=failing_backend), caplog)
    assert len(warnings) == 1 and "failed" in warnings[0].getMessage()
    assert replaygrad.cache_info().size == 1  # remembered as failed: no second compile


def test_compiler_callable_that_raises_or_returns_garbage():
    def raising(fn):
        raise Boom("no compiler today")

    x, w, _h, loss = graph()
    with pytest.raises(Boom):
        replaygrad.backward(loss, retain_graph=True, compiler=raising)
    with pytest.raises(TypeError, match="not a callable"):
        replaygrad.backward(loss, compiler=lambda fn: 42)
    assert x.grad is None and w.grad is None


@pytest.mark.parametrize("bad", ["raising", "garbage"])
def test_compiler_callable_failing_names_the_plan_or_falls_back(bad, caplog, monkeypatch):
    # The callable fails when given the replay, before anything of the call ran: as with
    # any compile failure, the error names the plan, or the engine runs the call.
    monkeypatch.setattr(_engine, "_eager_reasons_logged", set())

    def compiler(fn):
        if bad == "raising":
            raise Boom("no compiler today")
        return 42

    error = Boom if bad == "raising" else TypeError
    x, w, _h, loss = graph()
    key = replaygrad.plan(loss).key
    with pytest.raises(error) as info:
        replaygrad.backward(loss, retain_graph=True, compiler=compiler)
    assert any(key in note for note in info.value.__notes__)
    assert x.grad is None and w.grad is None
    warnings = falls_back_to_the_engine(compiler, caplog)
    assert len(warnings) == 1 and key in warnings[0].getMessage()


def test_bad_fallback_value():
    with pytest.raises(ValueError, match="fallback must be"):
        with replaygrad.enable(compiler=None, fallback="retry"):
            pass


class RaisesInBackward(torch.autograd.Function):
    is_traceable = True  # traced into the compiled replay

    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        raise IndexError("bad index in backward")


@pytest.mark.parametrize("compiler", COMPILERS)
def test_traced_function_raising_keeps_what_ran_before(compiler):
    # The backward raises while the compiler traces it: the call starts over with that
    # node run as itself, so what the engine does before it (a hook, retain_grad, another
    # leaf's accumulation) happens before the error, as in eager.
    def run(backward):
        log = []
        a = torch.ones(3, requires_grad=True)
        b = torch.ones(3, requires_grad=True)
        y = RaisesInBackward.apply(a) + (a * 3) * b
        y.retain_grad()
        y.register_hook(lambda g: log.append(g.clone()))
        with pytest.raises(IndexError, match="bad index in backward") as raised:
            # (y * 2): a gradient that is not expanded, so the hook is traced (sum()'s
            # would make it a graph break, after which the call could not start over).
            backward((y * 2).sum())
        return log, y.grad, a.grad, b.grad, str(raised.value)

    expected = run(torch.autograd.backward)
    got = run(lambda loss: replaygrad.backward(loss, compiler=compiler))
    torch.testing.assert_close(got[:4], expected[:4], rtol=0, atol=0)
    assert got[4] == expected[4]


class NumpyInBackward(torch.autograd.Function):
    is_traceable = True  # but .numpy() cannot run on the fake tensors of tracing

    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return torch.from_numpy(g.numpy() * 2)


def test_traced_function_that_cannot_be_traced_runs_as_itself():
    a = torch.ones(3, requires_grad=True)
    for _ in range(3):
        loss = (NumpyInBackward.apply(a) * a).sum()
        replaygrad.backward(loss, compiler="aot_eager")
    expected = torch.ones(3, requires_grad=True)
    for _ in range(3):
        (NumpyInBackward.apply(expected) * expected).sum().backward()
    torch.testing.assert_close(a.grad, expected.grad, rtol=0, atol=0)
    info = replaygrad.cache_info()
    assert (info.misses, info.hits) == (1, 2), "the step runs as itself from then on"


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("where", ["intermediate", "leaf"])
def test_nodes_before_an_error_release_their_saved_values(compiler, where):
    # Without retain_graph the engine releases each node's saved values once it ran; after
    # an error, those of the nodes before it are gone (a second backward through them
    # raises) and the others are intact.
    def run(backward):
        x = torch.ones(3, requires_grad=True)
        w = torch.ones(3, requires_grad=True)
        h = (x.exp() * w).sin()
        target = h if where == "intermediate" else w

        def hook(g):
            raise Boom("hook failed")

        target.register_hook(hook)
        with pytest.raises(Boom):
            backward(h.sum())
        try:
            torch.autograd.backward(h.sum())  # the engine, hook raising again or not
        except (RuntimeError, Boom) as error:
            return type(error).__name__, str(error).split(".")[0]
        return "ok", ""

    expected = run(torch.autograd.backward)
    assert run(lambda loss: replaygrad.backward(loss, compiler=compiler)) == expected


class IndexInBackward(torch.autograd.Function):
    """A backward that reads its gradient at ``INDEX``: out of range, it raises as it runs."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2 + g[INDEX].sum() * 0.5


INDEX = torch.tensor([1])


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
@pytest.mark.parametrize("where", ["hook", "function"])
def test_compiled_code_raising_as_it_runs_leaves_eagers_state(compiler, where):
    # An op of a hook or Function backward traced into the graph fails on the values (an
    # index out of range, compiled with one in range): eager has accumulated into s.grad
    # (its AccumulateGrad runs first) and released the saved values of the nodes that ran,
    # and raises IndexError (inductor's kernel raises a RuntimeError of its own). A graph's
    # effects come when it ends: the engine runs the call instead.
    def run(backward, index):
        INDEX.fill_(index)
        torch.manual_seed(0)
        a, w, s = (torch.randn(3, requires_grad=True) for _ in range(3))
        h = a.exp() * w
        if where == "hook":
            h.register_hook(lambda g: g + g[INDEX].sum() * 0.5)
        else:
            h = IndexInBackward.apply(h)
        loss = (h.sin() * s).sum() + (s * s).sum()
        raised = []
        for _ in range(2):
            try:
                backward(loss)
            except (IndexError, RuntimeError) as error:
                raised.append((type(error).__name__, str(error).split(" ")[:3]))
        return raised, s.grad, a.grad

    expected = run(torch.autograd.backward, 5)
    assert expected[0][1][0] == "RuntimeError" and expected[1] is not None
    for index in (1, 5):  # compiled, then raising
        got = run(lambda loss: replaygrad.backward(loss, compiler=compiler), index)
    assert got[0] == expected[0]
    assert_grads_equal(expected[1:], got[1:], exact=False)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("hook", ["tensor", "multi-grad"])
def test_a_hook_raising_in_a_compiled_graph_releases_the_saved_values_before_it(compiler, hook):
    # The hook's caller (which runs as Python from the graph break the raise makes) tells its
    # step: the nodes before it ran, and released their saved values. Before, those since
    # the region's start were kept: a second backward ran them again, accumulating twice.
    def run(backward):
        torch.manual_seed(0)
        a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
        h = a.sin()
        loss = (h * b).sum() + (c * 2).sum()

        def boom(_):
            raise Boom("hook failed")

        if hook == "tensor":
            h.register_hook(boom)
        else:
            torch.autograd.graph.register_multi_grad_hook((h, c), boom)
        raised = []
        for _ in range(2):
            try:
                backward(loss)
            except (Boom, RuntimeError) as error:
                raised.append((type(error).__name__, str(error).split(".")[0]))
        return raised, grads_of((a, b, c))

    expected = run(torch.autograd.backward)
    assert expected[0][1][0] == "RuntimeError"
    got = run(lambda loss: replaygrad.backward(loss, compiler=compiler))
    assert got[0] == expected[0]
    assert_grads_equal(expected[1], got[1], exact=compiler is None)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_kept_error_keeps_no_replay_frame(compiler):
    # An error a hook raised, kept (stored, or in a test report), holds its traceback:
    # eager's has the user's frames only, the replay's had its own, whose locals held the
    # call's saved values and gradients.
    def run(backward):
        torch.manual_seed(0)
        a = torch.randn(3, requires_grad=True)
        f = (a * 2).exp().sin()
        kept = weakref.ref(f)

        def boom(_):
            raise Boom("hook failed")

        f.register_hook(boom)
        loss = (f * a).sum()
        try:
            backward(loss)
        except Boom as error:
            error_kept = error
        del f, loss
        gc.collect()
        return kept() is None, error_kept

    assert run(torch.autograd.backward)[0]
    assert run(lambda loss: replaygrad.backward(loss, compiler=compiler))[0]


def test_untraceable_step_after_a_graph_break_runs_as_itself_on_later_calls():
    # The traced step fails while the code after a graph break compiles, after that graph
    # break ran: this call cannot start over and raises (with a note); later calls run the
    # step as itself and match eager.
    def run(backward):
        torch.manual_seed(0)
        x, w = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        backward(Doubling.apply(NumpyInBackward.apply(x) * w).sum())  # a graph break
        return x.grad, w.grad

    def replay(loss):
        replaygrad.backward(loss, compiler="aot_eager")

    with pytest.raises(RuntimeError) as raised:
        run(replay)
    assert any("later calls run it as itself" in note for note in raised.value.__notes__)
    expected = run(torch.autograd.backward)
    for _ in range(2):
        torch.testing.assert_close(run(replay), expected, rtol=0, atol=0)
    info = replaygrad.cache_info()
    assert (info.misses, info.hits) == (1, 2), "one entry, kept after the failed call"


def test_hook_dynamo_cannot_trace_after_an_opaque_node_under_fullgraph():
    # A hook traced into a region that runs after a node run as itself could not make the
    # call start over if it failed to compile (fullgraph=True allows no graph break, and
    # Dynamo cannot trace print): where anything runs outside the graph, hooks run between
    # the compiled regions from the first call.
    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, requires_grad=True)
        h = w.exp()
        h.register_hook(lambda g: print(end="") or log.append(g.sum().item()))
        backward((Doubling.apply(h) * w).sum())
        return log, w.grad

    def replay(loss):
        replaygrad.backward(loss, compiler="aot_eager", fullgraph=True)

    expected = run(torch.autograd.backward)
    for _ in range(2):
        torch.testing.assert_close(run(replay), expected)
    info = replaygrad.cache_info()
    assert (info.misses, info.hits) == (1, 1)


# ---- saved values modified in place during the backward ----------------------------------


def _modified_saved_value(where: str, backward) -> tuple:
    """A backward where something running outside the graph modifies in place a tensor
    that a node saved: before that node runs (the engine raises when it unpacks it) or
    after (nothing to see). Returns the error or the gradients."""
    w = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    z = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
    s = torch.randn(4, 4, dtype=torch.double)
    x = torch.randn(3, 4, dtype=torch.double)

    class Opaque(torch.autograd.Function):  # runs as itself: a graph break
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            s.add_(1)
            return g

    def step(p):
        p.data.sub_(0.1 * p.grad)

    def double_s(*_):
        s.mul_(2)

    if where == "post-accumulate-grad hook":
        # Optimizer step in backward, on a parameter also used detached (its
        # AccumulateGrad runs before the node that saved the detached one).
        w.register_post_accumulate_grad_hook(step)
        loss = (x @ w).sum() + (z * w.detach()).sum()
    elif where == "tensor hook":
        q = (z * s).exp()  # MulBackward0 saved s, runs after q's hook
        q.register_hook(double_s)
        loss = q.sum() + (x @ w).sum()
    elif where == "opaque node":
        loss = (Opaque.apply(z * s) * w).sum()
    else:  # "after the node ran": s is modified once MulBackward0 used it
        q = (z * s).exp()
        q.grad_fn.next_functions[0][0].register_hook(double_s)
        loss = q.sum() + (x @ w).sum()
    try:
        backward(loss)
    except RuntimeError as error:
        return ("error", str(error).split(";")[0])
    return grads_of([w, z])


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize(
    "where", ["post-accumulate-grad hook", "tensor hook", "opaque node", "after the node ran"]
)
def test_saved_value_modified_in_place_during_backward(compiler, where):
    # The replay's saved values were unpacked when the call was planned; the engine unpacks
    # each node's when it runs, and raises if one was modified in place in between.
    torch.manual_seed(0)
    expected = _modified_saved_value(where, lambda loss: loss.backward())
    torch.manual_seed(0)
    got = _modified_saved_value(where, lambda loss: replaygrad.backward(loss, compiler=compiler))
    if expected[0] == "error":
        assert got == expected
        assert "modified by an inplace operation" in got[1]
    else:
        assert_grads_equal(expected, got, exact=compiler is None)


def _saved_self_after_its_node_ran(backward, where: str) -> list:
    """Code outside the graph that runs after SinBackward0 reads its saved value: released
    by then without retain_graph, as the engine releases a node's saved variables when it
    has run."""
    seen = []

    def look(*_):
        try:
            _ = sin_node._saved_self
            seen.append("accessible")
        except RuntimeError as error:
            seen.append(str(error).split(".")[0])

    class Looks(torch.autograd.Function):  # runs as itself, after SinBackward0
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            look()
            return g

    a = torch.randn(3, requires_grad=True)
    y = a.exp() if where == "hook" else Looks.apply(a.exp())
    z = y.sin()
    sin_node = z.grad_fn
    if where == "hook":
        y.grad_fn.register_prehook(look)  # ExpBackward0 runs after SinBackward0
    backward(z.sum())
    return seen


@pytest.mark.parametrize(
    "compiler, where", [(None, "hook"), (None, "opaque node"), ("aot_eager", "opaque node")]
)
def test_saved_values_of_nodes_that_ran_are_released_before_code_outside_the_graph(compiler, where):
    expected = _saved_self_after_its_node_ran(lambda loss: loss.backward(), where)
    got = _saved_self_after_its_node_ran(
        lambda loss: replaygrad.backward(loss, compiler=compiler), where
    )
    assert got == expected
    assert expected and all(s.startswith("Trying to backward through the graph") for s in got)


def _released_by_a_nested_backward(where: str, backward) -> tuple:
    """Code outside the graph runs a backward without retain_graph through MmBackward0, a
    node the outer backward has not reached yet: its saved values are freed, and the engine
    raises when the outer backward reaches it."""
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    b = torch.randn(3, 4, requires_grad=True)
    h = x @ w
    other = (h * 3).sum()

    class Nested(torch.autograd.Function):  # runs as itself: a graph break
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            other.backward()
            return g

    if where == "post-accumulate-grad hook":
        b.register_post_accumulate_grad_hook(lambda p: other.backward())
        loss = (h.tanh() * b).sum()
    elif where == "opaque node":
        loss = (Nested.apply(h.tanh()) * b).sum()
    else:  # a tensor hook
        t = h.tanh()
        t.register_hook(lambda g: other.backward())
        loss = (t * b).sum()
    try:
        backward(loss)
    except RuntimeError as error:
        return ("error", str(error).split(".")[0])
    return grads_of([x, w, b])


@pytest.mark.parametrize(
    ("compiler", "where"),
    [
        (None, "tensor hook"),
        *((c, w) for c in FAST_COMPILERS for w in ("post-accumulate-grad hook", "opaque node")),
    ],
)
def test_saved_values_released_by_a_nested_backward_raise(compiler, where):
    torch.manual_seed(0)
    expected = _released_by_a_nested_backward(where, lambda loss: loss.backward())
    assert expected[0] == "error", f"eager no longer raises: {expected}"
    torch.manual_seed(0)
    got = _released_by_a_nested_backward(
        where, lambda loss: replaygrad.backward(loss, compiler=compiler)
    )
    assert got == expected


def _refusing_size_five(gm, example_inputs):
    """A backend that fails on graphs taking a 5-element tensor (any backend failing on a
    later part of a replay)."""
    if any(isinstance(t, torch.Tensor) and tuple(t.shape) == (5,) for t in example_inputs):
        raise RuntimeError("refuses 5-element inputs")
    return gm.forward


@pytest.mark.parametrize("breaking", ["print", "item"])
def test_hooks_run_once_when_a_graph_after_them_fails_to_compile(breaking, capsys):
    # A hook traced into the graph and one that breaks it run before a part whose graph the
    # backend refuses: the call does not start over (the hooks would run twice), it raises
    # the failure, as on every call here (the backend refuses that part whatever the replay
    # does); each call runs each hook once.
    def compiler(fn):
        return torch.compile(fn, backend=_refusing_size_five)

    log: list = []

    def breaks(g):
        log.append("second")
        if breaking == "print":
            print("hook prints")
        return g * float(g.sum().item() != 0) if breaking == "item" else g

    for _ in range(3):
        log.clear()
        p = torch.randn(5, requires_grad=True)
        x = torch.randn(3, requires_grad=True)
        y = x.exp() * p.cos().sum()
        e = y * 2
        e.register_hook(lambda g: log.append("first"))
        y.register_hook(breaks)
        with pytest.raises(Exception, match="refuses 5-element inputs"):
            replaygrad.backward(e.sum(), compiler=compiler)
        assert log == ["first", "second"]


def test_dynamo_failing_on_its_own_assertion_is_a_compile_failure(caplog, monkeypatch):
    # Dynamo lets an assertion of its own that fails while it compiles a frame through as
    # it is (e.g. torch 2.13's on stride() of a tensor whose symbolic stride became a
    # constant): a compile failure, which fallback="eager" sends to the engine, not the
    # backward's own error.
    def failing(*args, **kwargs):
        raise AssertionError("an assertion of Dynamo's")

    monkeypatch.setattr(torch._dynamo.output_graph.OutputGraph, "compile_subgraph", failing)
    warnings = falls_back_to_the_engine("aot_eager", caplog)
    assert len(warnings) == 1 and "AssertionError" in warnings[0].getMessage()
    x, w, _h, loss = graph()
    key = replaygrad.plan(loss).key
    with pytest.raises(AssertionError, match="Dynamo's") as info:
        replaygrad.backward(loss, compiler="aot_eager")
    assert any(key in note for note in info.value.__notes__)
    assert x.grad is None and w.grad is None
