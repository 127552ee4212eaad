"""Nothing outlives its graph: the cache and the replay keep no tensors, nodes or models alive,
and a training loop's memory stays flat."""

from __future__ import annotations

import gc
import sys
import threading
import warnings
import weakref

import pytest
import torch

import replaygrad

from conftest import COMPILERS


def live_tensor_count() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on some torch module objects warns
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


@pytest.mark.parametrize("compiler", COMPILERS)
def test_model_graph_and_saved_values_are_freed(compiler):
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    x = torch.randn(3, 6, requires_grad=True)
    hidden = model[0](x)
    loss = model[2](model[1](hidden)).sum()
    # x and the weights are saved by the graph's AddmmBackward nodes.
    refs = [weakref.ref(t) for t in (*model.parameters(), x, hidden)]
    replaygrad.backward(loss, compiler=compiler)
    del model, x, hidden, loss
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs)
    assert replaygrad.cache_info().size == 1  # the replay itself stays cached


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_training_loop_memory_is_flat(compiler):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()

    with replaygrad.enable(compiler):
        for _ in range(5):  # warm up: compile, optimizer state
            step()
        before = live_tensor_count()
        for _ in range(50):
            step()
        after = live_tensor_count()
    assert after <= before, f"live tensors grew from {before} to {after}"
    info = replaygrad.cache_info()
    assert info.size == 1 and info.hits == 54


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_a_failed_call_on_another_thread_frees_its_saved_values(compiler):
    # A replay that raised leaves its plan in a reference cycle (traceback, Dynamo's
    # state): collected on another thread, an unsendable plan was leaked, with the saved
    # tensors it holds, and PyO3 reported an error.
    refs = []
    unraisable = []

    def work():
        w = torch.randn(4, 4, requires_grad=True)
        big = torch.randn(64, 64, requires_grad=True)  # saved by the graph
        refs.append(weakref.ref(big))
        h = (big[:4, :4] * w).sin()
        h.register_hook(lambda g: 1 / 0)
        with pytest.raises(ZeroDivisionError), replaygrad.enable(compiler):
            h.sum().backward()

    hook = sys.unraisablehook
    sys.unraisablehook = unraisable.append
    gc.disable()
    try:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
        gc.collect()
    finally:
        gc.enable()
        sys.unraisablehook = hook
    assert refs[0]() is None, "the saved tensor was freed"
    assert not unraisable


def test_the_saved_values_a_replay_makes_are_not_tracked_by_the_cycle_collector():
    # A replay makes a Python tensor per saved value per call that has none yet. Tracked,
    # the collections during calls moved them to the oldest generation, and a full collection
    # of the heap (hundreds of ms with torch imported) followed every few hundred calls of a
    # long chain.
    from torch.testing._internal.logging_tensor import LoggingTensor

    from replaygrad import _core

    x = torch.randn(4, requires_grad=True)
    y = x
    for _ in range(3):
        y = (y * 1.5).exp()  # saves the wrapped 1.5 and exp's result: no Python objects yet
    plan = _core.plan([y.sum()])
    values = [v for v in plan.saved_values() if v is not None]
    assert len(values) >= 4  # exp's results, mul's wrapped scalar (one value for all three)
    assert not any(gc.is_tracked(v) for v in values)
    refs = [weakref.ref(v) for v in values]
    del plan, values, y
    assert [r() for r in refs] == [None] * len(refs), "untracked, they are still freed"

    # A saved tensor of the user's is a saved value as it is, its own Python object; a view
    # or a Parameter is detached (the compiler would see the base, or the type).
    y = x.sin()
    (value,) = _core.plan([y.sum()]).saved_values()
    assert value is x
    view = x[1:]
    (value,) = _core.plan([view.sin().sum()]).saved_values()
    assert value is not view and not value._is_view() and value.data_ptr() == view.data_ptr()
    weight = torch.nn.Parameter(torch.randn(4))
    (value,) = _core.plan([weight.sin().sum()]).saved_values()
    assert type(value) is torch.Tensor and value.requires_grad

    # A subclass detaches itself: its Python object is its own, and stays tracked.
    s = LoggingTensor(torch.randn(3)).requires_grad_()
    values = [v for v in _core.plan([(s * s).sum()]).saved_values() if v is not None]
    assert values and all(type(v) is LoggingTensor and gc.is_tracked(v) for v in values)


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("post_hook", [False, True])
@pytest.mark.parametrize("region_size", [None, 1], ids=["whole", "regions"])
def test_a_function_run_as_itself_is_handed_its_gradients(compiler, post_hook, region_size):
    # The engine moves a node's gradients into its call: a Function with boxed_grads_call
    # that clears the list it gets frees a gradient no one else holds (PyTorch's
    # test_custom_function_boxed_grads_no_extra_refs). A post hook gets them afterwards.
    # Compiled, the Function runs between regions; with regions of one step the uncompiled
    # replay is split too: the gradient comes from an earlier region either way.
    prior = replaygrad._compile.cache.region_size
    replaygrad.set_region_size(region_size)
    try:
        _handed_its_gradients(compiler, post_hook)
    finally:
        replaygrad.set_region_size(prior)


def _handed_its_gradients(compiler, post_hook):
    alive = []

    class Boxed(torch.autograd.Function):
        boxed_grads_call = True

        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grads):
            grad = grads[0]
            result = grad * 2
            ref = weakref.ref(grad)
            grads.clear()
            del grad
            alive.append(ref() is not None)
            return result

    x0 = torch.randn(4)

    def run():
        x = x0.clone().requires_grad_()
        y = Boxed.apply(x.sin())
        seen = []
        if post_hook:
            y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_outputs))
        (y * 3).sum().backward()
        return x.grad, seen

    expected, expected_seen = run()
    with replaygrad.enable(compiler):
        for _ in range(2):
            got, seen = run()
            exact = {"rtol": 0, "atol": 0} if compiler is None else {}
            torch.testing.assert_close(got, expected, **exact)
            assert [[g.tolist() for g in s] for s in seen] == [
                [g.tolist() for g in s] for s in expected_seen
            ]
    # With a post hook the engine keeps the gradients for it, as the replay does.
    assert alive == [post_hook] * 3


def _region_functions() -> list:
    """The replay regions' generated functions alive now."""
    gc.collect()
    return [
        o
        for o in gc.get_objects()
        if type(o).__name__ == "function"
        and o.__code__.co_filename.startswith("<replaygrad region")
    ]


def test_an_evicted_replay_leaves_nothing_compiled_behind():
    # Dynamo keeps what it compiled for a function on its code object, and torch 2.13 keeps
    # every code object it guarded on (a functools.cache): the regions of a replay the cache
    # evicts must be freed, and their compiled code dropped with them, also that of the
    # functions Dynamo made to resume a region after a graph break (here, in a hook). (torch
    # keeps the code it ran for such a region alive, and with it the resume function and
    # the region's first graph; only where a region has a graph break.)
    cache_entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    w = torch.randn(4, requires_grad=True)

    def breaking_hook(grad):
        torch._dynamo.graph_break()
        return grad * 2

    def backward(n: int) -> None:
        y = w.cos()
        y.register_hook(breaking_hook)
        for _ in range(n):
            y = y.sin()
        replaygrad.backward(y.sum(), compiler="aot_eager")

    maxsize = replaygrad.cache_info().maxsize
    replaygrad.reset()
    replaygrad.set_cache_size(1)
    try:
        earlier = _region_functions()  # of other tests, kept alive by their objects

        def new_regions() -> list:
            return [f for f in _region_functions() if all(f is not e for e in earlier)]

        backward(3)
        regions = new_regions()
        codes = [f.__code__ for f in regions]
        assert any(c.co_name.startswith("torch_dynamo_resume") for c in codes)
        assert all(cache_entries(c) for c in codes)
        [region] = [weakref.ref(f) for f in regions if f.__code__.co_name == "region"]
        del regions
        backward(4)  # evicts the first replay
        gc.collect()
        assert region() is None
        assert [cache_entries(c) for c in codes] == [[]] * len(codes)
        assert sum(f.__code__.co_name == "region" for f in new_regions()) == 1
    finally:
        replaygrad.set_cache_size(maxsize)
        replaygrad.reset()
