"""Bad input (issue 5): every mistake raises what eager autograd raises for it (same exception
type, same message; replaygrad may add to the message but not change it), leaves every
`.grad` as eager leaves it, and inputs eager accepts (odd as they are) give eager's gradients.

Each case builds its graph from a fixed seed and is run twice on fresh tensors: once with
``torch.autograd.backward``/``grad`` and once through replaygrad (``replaygrad.backward`` with
``compiler=None`` and ``"aot_eager"``, and ``torch.autograd.backward`` inside
``replaygrad.enable(None)``). test_errors.py holds the first few cases of this kind.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import replaygrad

from conftest import assert_grads_equal

# ---- harness -------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    text = str(error)
    return text.splitlines()[0] if text else ""


def assert_same_error(eager_call: Callable[[], object], replay_call: Callable[[], object]):
    """Runs both calls; eager must raise, and replaygrad must raise the same exception type
    with eager's first message line in its message. Returns both exceptions."""
    with pytest.raises(BaseException) as eager_info:
        eager_call()
    expected = eager_info.value
    try:
        replay_call()
    except BaseException as error:
        got = error
    else:
        raise AssertionError(f"eager raised {type(expected).__name__}: {expected}; replaygrad ran")
    assert type(got) is type(expected), (
        f"eager raised {type(expected).__name__}: {first_line(expected)!r}; "
        f"replaygrad raised {type(got).__name__}: {first_line(got)!r}"
    )
    assert first_line(expected) in str(got), (
        f"eager's message {first_line(expected)!r} is not in replaygrad's {str(got)!r}"
    )
    return expected, got


class Leaves(list):
    """The tensors whose `.grad` a case compares. New leaves start with a `.grad` of 0.5 so
    that an unwanted accumulation shows."""

    def new(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        t = torch.randn(*shape, dtype=dtype, requires_grad=True)
        t.grad = torch.full_like(t, 0.5)
        self.append(t)
        return t


def current_grads(tensors) -> list:
    with warnings.catch_warnings():  # .grad of a non-leaf that does not retain it warns
        warnings.simplefilter("ignore")
        return [None if t.grad is None else t.grad.clone() for t in tensors]


@dataclass
class Outcome:
    error: BaseException | None
    result: object
    grads: list
    replays: int  # backward calls replaygrad ran (cache hits + misses)
    leaves: Leaves = field(repr=False)


def run_case(case, call) -> Outcome:
    torch.manual_seed(0)
    leaves = Leaves()
    before = replaygrad.cache_info()
    error, result = None, None
    try:
        result = case(call, leaves)
    except Exception as e:
        error = e
    after = replaygrad.cache_info()
    replays = (after.hits + after.misses) - (before.hits + before.misses)
    return Outcome(error, result, current_grads(leaves), replays, leaves)


def assert_same_results(expected, got, exact: bool) -> None:
    if expected is None:
        assert got is None
        return
    assert isinstance(got, tuple) and len(got) == len(expected)
    assert_grads_equal(list(expected), list(got), exact=exact)


def check(case, eager_call, replay_call, exact: bool) -> Outcome:
    """Runs `case` with eager and with replaygrad and compares what each did."""
    eager = run_case(case, eager_call)
    replay = run_case(case, replay_call)
    if eager.error is not None:
        assert_same_error(lambda: _raise(eager.error), lambda: _raise(replay.error))
    else:
        assert replay.error is None, f"eager ran, replaygrad raised {replay.error!r}"
        assert replay.replays >= 1, "replaygrad did not replay the call"
        assert_same_results(eager.result, replay.result, exact)
    # Untouched .grad stays untouched; accumulated ones match eager's.
    assert_grads_equal(eager.grads, replay.grads, exact=exact)
    return replay


def _raise(error: BaseException | None) -> None:
    if error is not None:
        raise error


# ---- routes --------------------------------------------------------------------------------


def rg_backward(compiler):
    def call(*args, **kwargs):
        return replaygrad.backward(*args, compiler=compiler, **kwargs)

    return call


def enabled(fn, compiler=None):
    def call(*args, **kwargs):
        with replaygrad.enable(compiler):
            return fn(*args, **kwargs)

    return call


def rg_grad(compiler):
    def call(*args, **kwargs):
        return replaygrad.grad(*args, compiler=compiler, **kwargs)

    return call


def method_backward(tensors, grad_tensors=None, **kwargs):
    """loss.backward(gradient, ...) with autograd.backward's signature."""
    return tensors.backward(grad_tensors, **kwargs)


BACKWARD_ROUTES = {
    "backward-None": rg_backward(None),
    "backward-aot_eager": rg_backward("aot_eager"),
    "enable-autograd.backward": enabled(torch.autograd.backward),
}
GRAD_ROUTES = {
    "grad-None": rg_grad(None),
    "grad-aot_eager": rg_grad("aot_eager"),
    "enable-autograd.grad": enabled(torch.autograd.grad),
}


# ---- backward cases ------------------------------------------------------------------------
# case(backward, leaves): builds a graph from the fixed seed and calls `backward` on it.


def graph(leaves: Leaves):
    w = leaves.new(3)
    h = w.exp()
    return w, h, (h * w).sum()


def root_int(bw, L):
    graph(L)
    bw(3)


def root_none(bw, L):
    graph(L)
    bw(None)


def root_string(bw, L):
    graph(L)
    bw("loss")


def roots_tensor_and_int(bw, L):
    bw([graph(L)[2], 3])


def roots_tensor_and_none(bw, L):
    bw([graph(L)[2], None])


def roots_nested_list(bw, L):
    bw([[graph(L)[2]]])


def roots_empty_list(bw, L):
    graph(L)
    bw([])


def roots_empty_tuple(bw, L):
    graph(L)
    bw(())


def root_without_grad(bw, L):
    graph(L)
    bw(torch.randn(3).exp().sum())


def root_detached(bw, L):
    bw(graph(L)[2].detach())


def roots_second_is_plain_number_tensor(bw, L):
    bw([graph(L)[2], torch.tensor(1.0)], [None, None])


def root_non_scalar(bw, L):
    bw(graph(L)[1])


def root_non_scalar_with_none_grad(bw, L):
    _w, h, loss = graph(L)
    bw([loss, h], [None, None])


def grads_too_few(bw, L):
    _w, h, loss = graph(L)
    bw([loss, (h * 3).sum()], [torch.tensor(1.0)])


def grads_too_many(bw, L):  # eager ignores the extra one
    bw([graph(L)[2]], [torch.tensor(2.0), torch.tensor(5.0)])


def grad_wrong_shape_for_scalar(bw, L):
    bw(graph(L)[2], torch.ones(3))


def grad_extra_dim(bw, L):
    bw(graph(L)[1], torch.ones(1, 3))


def grad_float64_for_float32(bw, L):  # eager casts it
    bw(graph(L)[1], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def grad_int64_for_float32(bw, L):  # eager casts it
    bw(graph(L)[1], torch.tensor([1, 2, 3]))


def grad_bool_for_float32(bw, L):
    bw(graph(L)[1], torch.tensor([True, False, True]))


def grad_float32_for_float16(bw, L):
    w = L.new(3, dtype=torch.float16)
    bw(w * 2, torch.tensor([1.0, 2.0, 3.0]))


def grad_complex_for_float32(bw, L):
    bw(graph(L)[1], torch.ones(3, dtype=torch.complex64))


def grad_on_meta_device(bw, L):
    bw(graph(L)[1], torch.ones(3, device="meta"))


def grad_python_float(bw, L):
    bw(graph(L)[2], 2.0)


def grad_string_in_list(bw, L):
    bw([graph(L)[1]], ["ones"])


def grad_that_requires_grad(bw, L):
    bw(graph(L)[1], torch.ones(3, requires_grad=True))


def grad_from_inference_mode(bw, L):
    with torch.inference_mode():
        g = torch.full((3,), 2.0)
    bw(graph(L)[1], g)


def inputs_empty(bw, L):
    bw(graph(L)[2], inputs=[])


def inputs_non_leaf(bw, L):  # allowed: the non-leaf gets a .grad, nothing else does
    _w, h, loss = graph(L)
    L.append(h)
    bw(loss, inputs=[h])


def inputs_non_leaf_and_leaf(bw, L):
    w, h, loss = graph(L)
    L.append(h)
    bw(loss, inputs=[h, w])


def inputs_without_grad(bw, L):
    bw(graph(L)[2], inputs=[torch.randn(3)])


def inputs_int(bw, L):
    bw(graph(L)[2], inputs=[3])


def inputs_duplicate(bw, L):
    w, _h, loss = graph(L)
    bw(loss, inputs=[w, w])


def inputs_unrelated_leaf(bw, L):
    _w, _h, loss = graph(L)
    other = L.new(2)
    bw(loss, inputs=[other])


def inputs_inference_tensor(bw, L):
    with torch.inference_mode():
        t = torch.randn(3)
    bw(graph(L)[2], inputs=[t])


def released_graph(bw, L):
    _w, _h, loss = graph(L)
    bw(loss)
    bw(loss)


def released_graph_partly(bw, L):
    # The first call ran (and freed) only the branch to w; the second needs it again.
    w = L.new(3)
    v = L.new(3)
    loss = (w.exp() * w).sum() + (v.sin() * v).sum()
    bw(loss, inputs=[w])
    bw(loss, inputs=[v])


def root_from_inference_mode(bw, L):
    graph(L)
    with torch.inference_mode():
        t = torch.randn(3).sum()
    bw(t)


def graph_built_in_inference_mode(bw, L):
    w = L.new(3)
    with torch.inference_mode():
        loss = (w.exp() * w).sum()
    bw(loss)


def backward_inside_inference_mode(bw, L):
    loss = graph(L)[2]
    with torch.inference_mode():
        bw(loss)


def backward_inside_no_grad(bw, L):
    loss = graph(L)[2]
    with torch.no_grad():
        bw(loss)


def leaf_as_root(bw, L):
    w = L.new(())
    bw(w)


BACKWARD_CASES = [
    root_int,
    root_none,
    root_string,
    roots_tensor_and_int,
    roots_tensor_and_none,
    roots_nested_list,
    roots_empty_list,
    roots_empty_tuple,
    root_without_grad,
    root_detached,
    roots_second_is_plain_number_tensor,
    root_non_scalar,
    root_non_scalar_with_none_grad,
    grads_too_few,
    grads_too_many,
    grad_wrong_shape_for_scalar,
    grad_extra_dim,
    grad_float64_for_float32,
    grad_int64_for_float32,
    grad_bool_for_float32,
    grad_float32_for_float16,
    grad_complex_for_float32,
    grad_on_meta_device,
    grad_python_float,
    grad_string_in_list,
    grad_that_requires_grad,
    grad_from_inference_mode,
    inputs_empty,
    inputs_non_leaf,
    inputs_non_leaf_and_leaf,
    inputs_without_grad,
    inputs_int,
    inputs_duplicate,
    inputs_unrelated_leaf,
    inputs_inference_tensor,
    released_graph,
    released_graph_partly,
    root_from_inference_mode,
    graph_built_in_inference_mode,
    backward_inside_inference_mode,
    backward_inside_no_grad,
    leaf_as_root,
]
# Cases eager accepts but runs no backward for (nothing to replay).
NOTHING_TO_RUN = {roots_empty_list, roots_empty_tuple}


@pytest.mark.parametrize("route", BACKWARD_ROUTES)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: c.__name__)
def test_backward_input_like_eager(case, route):
    call = BACKWARD_ROUTES[route]
    if case in NOTHING_TO_RUN:
        eager = run_case(case, torch.autograd.backward)
        replay = run_case(case, call)
        assert eager.error is None and replay.error is None
        assert_grads_equal(eager.grads, replay.grads, exact=True)
        return
    check(case, torch.autograd.backward, call, exact=route != "backward-aot_eager")


# loss.backward(...) inside replaygrad.enable, for the cases with one tensor root.
METHOD_CASES = [
    root_without_grad,
    root_non_scalar,
    grad_wrong_shape_for_scalar,
    grad_float64_for_float32,
    grad_complex_for_float32,
    grad_on_meta_device,
    inputs_empty,
    inputs_non_leaf,
    inputs_without_grad,
    released_graph,
    graph_built_in_inference_mode,
]


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
@pytest.mark.parametrize("case", METHOD_CASES, ids=lambda c: c.__name__)
def test_tensor_backward_input_like_eager(case, compiler):
    check(case, method_backward, enabled(method_backward, compiler), exact=compiler is None)


# ---- a saved tensor modified in place --------------------------------------------------------


def modified_saved_tensor(bw, L):
    w = L.new(3)
    h = (w * 1).exp()  # ExpBackward0 saves its result
    loss = (h * 2).sum()
    h.add_(1)
    bw(loss)


@pytest.mark.parametrize("route", BACKWARD_ROUTES)
def test_modified_saved_tensor_message(route):
    check(modified_saved_tensor, torch.autograd.backward, BACKWARD_ROUTES[route], exact=True)


@pytest.mark.parametrize("route", BACKWARD_ROUTES)
def test_modified_saved_tensor_error_type_and_grads(route):
    eager = run_case(modified_saved_tensor, torch.autograd.backward)
    replay = run_case(modified_saved_tensor, BACKWARD_ROUTES[route])
    assert type(eager.error) is RuntimeError and type(replay.error) is RuntimeError
    for outcome in (eager, replay):
        assert "modified by an inplace operation" in str(outcome.error)
        assert "which is output 0 of Exp, is at version 1; expected version 0" in str(outcome.error)
    assert_grads_equal(eager.grads, replay.grads, exact=True)


def modified_saved_tensor_after_other_work(bw, L):
    # Eager runs the nodes before ExpBackward0 (the root's hook, v's branch and its
    # AccumulateGrad) and only then finds the modified saved tensor.
    w = L.new(3)
    v = L.new(3)
    h = (w * 1).exp()
    loss = h.sum() + v.sum()
    calls = []
    loss.register_hook(lambda g: calls.append("root hook"))
    h.add_(1)
    try:
        bw(loss)
    finally:
        L.calls = calls


def released_graph_after_other_work(bw, L):
    # The second call: eager runs the root's hook, v's branch (which saves nothing) and its
    # AccumulateGrad, and only then reaches MulBackward0, whose saved values are freed.
    w = L.new(3)
    v = L.new(3)
    loss = (w.exp() * w).sum() + v.sum()
    bw(loss)
    calls = []
    loss.register_hook(lambda g: calls.append("root hook"))
    try:
        bw(loss)
    finally:
        L.calls = calls


@pytest.mark.parametrize("route", ["backward-None", "backward-aot_eager"])
@pytest.mark.parametrize(
    "case",
    [modified_saved_tensor_after_other_work, released_graph_after_other_work],
    ids=lambda c: c.__name__,
)
def test_side_effects_before_a_saved_value_error(case, route):
    eager = run_case(case, torch.autograd.backward)
    replay = run_case(case, BACKWARD_ROUTES[route])
    assert eager.error is not None and type(replay.error) is type(eager.error)
    assert replay.leaves.calls == eager.leaves.calls == ["root hook"]
    assert_grads_equal(eager.grads, replay.grads, exact=True)


# ---- autograd.grad cases ---------------------------------------------------------------------


def g_outputs_int(grad, L):
    w = graph(L)[0]
    return grad(3, [w])


def g_outputs_empty(grad, L):
    w = graph(L)[0]
    return grad([], [w])


def g_outputs_without_grad(grad, L):
    w = graph(L)[0]
    return grad(torch.randn(3).sum(), [w])


def g_grad_outputs_too_few(grad, L):
    w, h, loss = graph(L)
    return grad([loss, (h * 3).sum()], [w], [torch.tensor(1.0)])


def g_grad_outputs_too_many(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w], [torch.tensor(2.0), torch.tensor(5.0)])


def g_grad_outputs_wrong_shape(grad, L):
    w, h, _loss = graph(L)
    return grad(h, [w], torch.ones(4))


def g_grad_outputs_missing_for_non_scalar(grad, L):
    w, h, _loss = graph(L)
    return grad(h, [w])


def g_grad_outputs_float64(grad, L):
    w, h, _loss = graph(L)
    return grad(h, [w], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))


def g_grad_outputs_complex(grad, L):
    w, h, _loss = graph(L)
    return grad(h, [w], torch.ones(3, dtype=torch.complex64))


def g_grad_outputs_meta(grad, L):
    w, h, _loss = graph(L)
    return grad(h, [w], torch.ones(3, device="meta"))


def g_grad_outputs_string(grad, L):
    w, h, _loss = graph(L)
    return grad(h, [w], ["ones"])


def g_grad_outputs_python_float(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w], 2.0)


def g_inputs_empty(grad, L):
    return grad(graph(L)[2], [])


def g_inputs_none(grad, L):
    return grad(graph(L)[2], None)


def g_inputs_int(grad, L):
    return grad(graph(L)[2], [3])


def g_inputs_without_grad(grad, L):
    return grad(graph(L)[2], [torch.randn(3)])


def g_inputs_duplicate(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w, w])


def g_inputs_non_leaf(grad, L):
    w, h, loss = graph(L)
    return grad(loss, [h, w])


def g_unused_default(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w, L.new(2)])


def g_unused_not_allowed(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w, L.new(2)], allow_unused=False)


def g_unused_allowed(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w, L.new(2)], allow_unused=True)


def g_materialize_grads(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [L.new(2), w], materialize_grads=True)


def g_materialize_grads_with_allow_unused_false(grad, L):
    w, _h, loss = graph(L)
    return grad(loss, [w, L.new(2)], materialize_grads=True, allow_unused=False)


def g_released_graph(grad, L):
    w, _h, loss = graph(L)
    grad(loss, [w])
    return grad(loss, [w])


def g_inputs_inference_tensor(grad, L):
    with torch.inference_mode():
        t = torch.randn(3)
    return grad(graph(L)[2], [t])


GRAD_CASES = [
    g_outputs_int,
    g_outputs_empty,
    g_outputs_without_grad,
    g_grad_outputs_too_few,
    g_grad_outputs_too_many,
    g_grad_outputs_wrong_shape,
    g_grad_outputs_missing_for_non_scalar,
    g_grad_outputs_float64,
    g_grad_outputs_complex,
    g_grad_outputs_meta,
    g_grad_outputs_string,
    g_grad_outputs_python_float,
    g_inputs_empty,
    g_inputs_none,
    g_inputs_int,
    g_inputs_without_grad,
    g_inputs_duplicate,
    g_inputs_non_leaf,
    g_unused_default,
    g_unused_not_allowed,
    g_unused_allowed,
    g_materialize_grads,
    g_materialize_grads_with_allow_unused_false,
    g_released_graph,
    g_inputs_inference_tensor,
]


@pytest.mark.parametrize("route", GRAD_ROUTES)
@pytest.mark.parametrize("case", GRAD_CASES, ids=lambda c: c.__name__)
def test_grad_input_like_eager(case, route):
    # autograd.grad writes no .grad: every leaf keeps its 0.5, also when the call works.
    replay = check(case, torch.autograd.grad, GRAD_ROUTES[route], exact=route != "grad-aot_eager")
    for t in replay.leaves:
        if t.is_leaf:
            assert torch.equal(t.grad, torch.full_like(t, 0.5))


# ---- the compiler argument (replaygrad's own) --------------------------------------------


class Boom(Exception):
    pass


def hooked_graph():
    w = torch.randn(3, requires_grad=True)
    w.grad = torch.full_like(w, 0.5)
    ran = []
    h = w.exp()
    h.register_hook(lambda g: ran.append("hook"))
    return w, ran, (h * w).sum()


def assert_nothing_ran_and_graph_intact(w, ran, loss, cached: int = 0):
    """The call had no effect: no hook ran, `.grad` is untouched, ``cached`` cache entries
    were kept, and the graph was not released (the engine can still run it, without
    retain_graph)."""
    assert ran == []
    assert torch.equal(w.grad, torch.full_like(w, 0.5))
    assert replaygrad.cache_info().size == cached
    w.grad = None
    loss.backward()
    assert ran == ["hook"]
    torch.testing.assert_close(w.grad, w.detach().exp() * (w.detach() + 1))


@pytest.mark.parametrize("name", ["no-such-backend", "", "Inductor", "aot-eager"])
def test_unknown_compiler_name_lists_the_backends(name):
    w, ran, loss = hooked_graph()
    with pytest.raises(ValueError, match=f"unknown compiler {name!r}") as info:
        replaygrad.backward(loss, compiler=name)
    message = str(info.value)
    for backend in ("aot_eager", "eager", "inductor"):
        assert backend in message.split("backends are:")[1].replace(",", " ").split()
    assert_nothing_ran_and_graph_intact(w, ran, loss)


def test_unknown_compiler_name_through_enable_and_grad():
    w, ran, loss = hooked_graph()
    with pytest.raises(ValueError, match=r"unknown compiler 'no-such-backend'; torch\.compile"):
        with replaygrad.enable("no-such-backend"):
            loss.backward()
    with pytest.raises(ValueError, match="unknown compiler 'no-such-backend'"):
        replaygrad.grad(loss, [w], compiler="no-such-backend")
    assert_nothing_ran_and_graph_intact(w, ran, loss)


@pytest.mark.parametrize("compiler", [3, b"inductor", ["aot_eager"]])
def test_compiler_of_the_wrong_type(compiler):
    w, ran, loss = hooked_graph()
    with pytest.raises(TypeError, match=r"compiler must be a torch\.compile backend name"):
        replaygrad.backward(loss, compiler=compiler)
    assert_nothing_ran_and_graph_intact(w, ran, loss)


@pytest.mark.parametrize("error", [Boom("no compiler today"), RuntimeError("out of memory")])
def test_compiler_callable_that_raises_changes_nothing(error):
    def compiler(fn):
        raise error

    w, ran, loss = hooked_graph()
    with pytest.raises(type(error)) as info:
        replaygrad.backward(loss, compiler=compiler)  # no retain_graph
    assert info.value is error
    assert_nothing_ran_and_graph_intact(w, ran, loss)


@pytest.mark.parametrize("returned", [42, None, "compiled"])
def test_compiler_callable_returning_a_non_callable_changes_nothing(returned):
    w, ran, loss = hooked_graph()
    with pytest.raises(TypeError, match=f"returned {type(returned).__name__}, not a callable"):
        replaygrad.backward(loss, compiler=lambda fn: returned)
    assert_nothing_ran_and_graph_intact(w, ran, loss)


def test_compiled_replay_that_raises_runs_in_the_engine(caplog):
    # Compiled code raising as it runs, before anything of the call was seen: the engine
    # runs the call from the start (raising where eager does; here it runs it).
    def compiler(fn):
        def compiled(*args):
            raise Boom("the compiled replay failed")

        return compiled

    w, ran, loss = hooked_graph()
    with caplog.at_level(logging.WARNING, logger="replaygrad"):
        replaygrad.backward(loss, compiler=compiler)
    assert "raised as it ran (Boom: the compiled replay failed)" in caplog.text
    assert ran == ["hook"]
    torch.testing.assert_close(w.grad, 0.5 + w.detach().exp() * (w.detach() + 1))
    # The compile worked and its replay raised: the entry stays.
    assert replaygrad.cache_info().size == 1
    # A working compiler gets its own entry.
    w2, ran2, loss2 = hooked_graph()
    replaygrad.backward(loss2, compiler=lambda fn: fn)
    assert ran2 == ["hook"]
    torch.testing.assert_close(w2.grad, 0.5 + w2.detach().exp() * (w2.detach() + 1))
