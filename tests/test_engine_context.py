"""A replay runs inside the engine's own GraphTask: APIs that depend on it behave as in eager."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch
from torch._dynamo.utils import counters

import replaygrad

from conftest import FAST_COMPILERS, Doubling, assert_replayed


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_queue_callback_runs_after_the_backward(compiler):
    events = []
    x = torch.randn(3, requires_grad=True)

    def hook(g):
        events.append("hook")
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: events.append(("callback", x.grad is not None))
        )

    y = x * 2
    y.register_hook(hook)
    replaygrad.backward(y.sum(), compiler=None if compiler is None else "eager")
    assert events == ["hook", ("callback", True)]


def test_graph_task_id_is_set_inside_hooks():
    ids = []
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.register_hook(lambda g: ids.append(torch._C._current_graph_task_id()))
    replaygrad.backward(y.sum(), compiler=None)
    assert ids and ids[0] != -1
    assert torch._C._current_graph_task_id() == -1


@pytest.mark.parametrize("mode", ["all", "any"])
def test_multi_grad_hook(mode):
    def run(backward):
        calls = []
        a = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        torch.autograd.graph.register_multi_grad_hook(
            (a, b),
            lambda g: calls.append(g if mode == "any" else [t is None for t in g]),
            mode=mode,
        )
        backward((a * 2).sum())
        backward((a * b).sum())
        return calls

    expected = run(lambda loss: loss.backward())
    got = run(lambda loss: replaygrad.backward(loss, compiler=None))
    assert len(got) == len(expected)
    if mode == "all":
        assert got == expected


def test_will_engine_execute_node():
    seen = []
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    h = x * w
    other = w.exp()

    def hook(g):
        seen.append(
            (
                torch._C._will_engine_execute_node(h.grad_fn),
                torch._C._will_engine_execute_node(other.grad_fn),
            )
        )

    out = h.sin()
    out.register_hook(hook)
    replaygrad.backward(out.sum(), compiler=None)
    assert seen == [(True, False)]


def test_cpp_warnings_become_python_warnings():
    # A C++ warning raised while a node runs reaches Python's warnings, as in eager.
    class Warn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            warnings.warn("from backward", UserWarning, stacklevel=1)
            return g

    def run(backward):
        x = torch.randn(3, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            backward(Warn.apply(x).sum())
        return [str(w.message) for w in caught]

    assert run(lambda loss: replaygrad.backward(loss, compiler=None)) == run(
        lambda loss: loss.backward()
    )


def test_exceptions_from_hooks_reach_the_caller_unchanged():
    class MyError(Exception):
        pass

    x = torch.randn(3, requires_grad=True)
    y = x * 2

    def hook(g):
        raise MyError("from a hook")

    y.register_hook(hook)
    with pytest.raises(MyError, match="from a hook"):
        replaygrad.backward(y.sum(), compiler=None)


def test_backward_inside_a_hook_runs_in_the_engine():
    inner = []
    w = torch.randn(3, requires_grad=True)

    def hook(g):
        z = torch.randn(3, requires_grad=True)
        with torch.enable_grad():  # hooks run with grad mode off, as in eager
            (z * z).sum().backward()
        inner.append(z.grad.clone())

    y = w * 3
    y.register_hook(hook)
    replaygrad.backward(y.sum(), compiler=None)
    assert len(inner) == 1
    torch.testing.assert_close(w.grad, torch.full((3,), 3.0))


def test_enable_restores_the_engine_on_exit():
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(ZeroDivisionError):
        with replaygrad.enable(compiler=None):
            raise ZeroDivisionError
    # After the block the engine runs again without replaygrad.
    ran = []
    y = x * 2
    y.register_hook(lambda g: ran.append(torch._C._current_graph_task_id()))
    y.sum().backward()
    assert ran and x.grad is not None


def test_other_threads_use_the_engine():
    errors = []

    def worker():
        try:
            for _ in range(20):
                a = torch.randn(8, requires_grad=True)
                (a.sin() * a).sum().backward()
                torch.testing.assert_close(a.grad, a.cos() * a + a.sin())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with replaygrad.enable(compiler=None):
        t = threading.Thread(target=worker)
        t.start()
        for _ in range(20):
            b = torch.randn(8, requires_grad=True)
            (b.exp() * b).sum().backward()
            torch.testing.assert_close(b.grad, b.exp() * b + b.exp())
        t.join()
    assert not errors


@pytest.mark.parametrize("compiler", [None, "eager"])
def test_threads_replaying_one_graph_at_once_get_eager_gradients(compiler):
    # Replays swap values into the graph's nodes (fake tensors while Dynamo traces them);
    # threads replaying the same nodes at once must not see each other's. (Dynamo's "eager"
    # backend: AOTAutograd turns on anomaly detection, process-wide, while it compiles, and
    # enabled threads' calls then go to the engine, which does not take replaygrad's lock.)
    torch.manual_seed(0)
    x = torch.randn(16, 16, requires_grad=True)
    w = (torch.randn(16, 16) / 4).requires_grad_()
    y = x
    for _ in range(20):
        y = torch.tanh(y @ w) * 1.01 + y[:, :1].sin()
    loss = y.square().sum()
    expected = torch.autograd.grad(loss, [x, w], retain_graph=True)
    start = threading.Barrier(4)
    errors = []

    def worker():
        try:
            with replaygrad.enable(compiler):
                start.wait()
                for _ in range(5):
                    got = torch.autograd.grad(loss, [x, w], retain_graph=True)
                    for e, g in zip(expected, got):
                        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        except Exception as e:  # reported below
            errors.append(e)

    replays = 0
    for _ in range(3):  # each round from an empty cache: threads trace while others plan
        replaygrad.reset()
        before = replaygrad.cache_info()
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:3]
        after = replaygrad.cache_info()
        replays += after.hits + after.misses - before.hits - before.misses
    assert replays == 60
    # The graph still holds its own saved values: the engine gives the same gradients.
    for e, g in zip(expected, torch.autograd.grad(loss, [x, w])):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_replay_survives_torch_compile_clearing_the_engine_slot():
    # AOTAutograd compiles (of a replay or of a torch.compile'd forward) clear the engine's
    # compiled-autograd slot; replaygrad takes it back.
    lin = torch.nn.Linear(4, 4)
    fwd = torch.compile(lambda x: lin(x).relu(), backend="aot_eager")
    with replaygrad.enable("aot_eager"):
        for _ in range(3):
            before = replaygrad.cache_info()
            fwd(torch.randn(2, 4)).sum().backward()
            assert_replayed(before)
        torch._dynamo.compiled_autograd.reset()
        before = replaygrad.cache_info()
        (lin(torch.randn(2, 4)) ** 2).sum().backward()
        assert_replayed(before)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_backward_inside_a_forward_ad_level_runs_in_the_engine(compiler):
    # Forward over reverse: the engine's formulas run on dual saved values, so gradients
    # (and what hooks see) carry tangents; a replay takes the saved values without them.
    import torch.autograd.forward_ad as fwAD

    def run(backward):
        torch.manual_seed(0)
        seen = []
        x = torch.randn(4, requires_grad=True)
        with fwAD.dual_level():
            d = fwAD.make_dual(x, torch.ones(4))
            y = d.exp()
            y.register_hook(lambda g: seen.append(fwAD.unpack_dual(g).tangent))
            loss = (y * d).sum()
            (g,) = backward(loss, x)
            return fwAD.unpack_dual(g).tangent, seen

    expected = run(torch.autograd.grad)
    assert expected[0] is not None and len(expected[1]) == 1
    before = replaygrad.cache_info()
    with replaygrad.enable(compiler):
        got = run(torch.autograd.grad)
    assert replaygrad.cache_info()[:2] == before[:2], "the engine ran the call"
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(got[1], expected[1], rtol=0, atol=0)


@pytest.fixture
def process_group():
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("this torch has no gloo process group")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_backward_inside_a_ddp_forward(process_group, compiler):
    # DDP marks its module active during its forward, and Dynamo compiles what runs then
    # split at DDP's gradient buckets: the replay of a backward made there (an input
    # saliency) is not DDP's module, and small buckets failed its compile.
    from torch import nn

    class Saliency(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 4), nn.Linear(8, 4)

        def forward(self, x):
            x = x.detach().requires_grad_()
            (saliency,) = torch.autograd.grad(self.b(self.a(x).tanh()).square().sum(), x)
            return self.b(self.a(x).tanh()) + self.c(saliency.abs())

    def train(routed: bool) -> list:
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(Saliency(), bucket_cap_mb=0.0005)
        grads = []
        with replaygrad.enable(compiler) if routed else replaygrad.disable():
            for step in range(2):
                ddp.zero_grad()
                torch.manual_seed(100 + step)
                ddp(torch.randn(5, 8)).square().mean().backward()
                grads += [p.grad.clone() for p in ddp.parameters()]
        return grads

    expected = train(routed=False)
    before = replaygrad.cache_info()
    got = train(routed=True)
    assert_replayed(before, calls=4)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def _profiled_backward(backward) -> list[tuple[str, int]]:
    """The profiler's events of a small backward, in start order and indented by nesting, with
    the sequence numbers profilers give them, counted from the forward's first (torch's
    test_profiler_experimental_tree and test_profiler_seq_nr check the engine's events this
    way)."""
    t1, t2 = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    with torch.profiler.profile() as prof:
        z = torch.add(t1, t2)
        loss = ((torch.ones(2) - z) ** 2).sum()
        backward(loss)
    events = []

    def walk(event, depth):
        events.append(("  " * depth + event.name, event.extra_fields.sequence_number))
        for child in event.children:
            walk(child, depth + 1)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, 0)
    first = events[0][1]
    assert events[0][0] == "aten::add" and first >= 0
    return [(name, -1 if seq < 0 else seq - first) for name, seq in events]


def test_an_uncompiled_replay_records_the_engines_profiler_events():
    expected = _profiled_backward(lambda loss: loss.backward())
    names = [name for name, _ in expected]
    assert "autograd::engine::evaluate_function: PowBackward0" in names
    assert "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad" in names
    before = replaygrad.cache_info()
    got = _profiled_backward(lambda loss: replaygrad.backward(loss, compiler=None))
    assert_replayed(before)
    assert got == expected


def test_a_step_run_as_itself_in_a_compiled_replay_is_profiled_as_in_eager():
    def events(backward):
        x = torch.randn(3, requires_grad=True)
        with torch.autograd.profiler.profile() as prof:
            y = Doubling.apply(x.exp())
            backward(y.sum())
        (forward,) = [e for e in prof.function_events if e.name == "Doubling"]
        assert forward.sequence_nr >= 0
        # The engine's event takes the forward's sequence number and thread.
        return [
            (e.sequence_nr == forward.sequence_nr, e.fwd_thread == forward.thread)
            for e in prof.function_events
            if e.name == "autograd::engine::evaluate_function: DoublingBackward"
        ]

    expected = events(lambda loss: loss.backward())
    assert expected == [(True, True)]
    # The replay's first call, profiled, would run uncompiled: a call outside the profiler
    # compiles it first.
    x = torch.randn(3, requires_grad=True)
    replaygrad.backward(Doubling.apply(x.exp()).sum(), compiler="aot_eager")
    before = replaygrad.cache_info()
    got = events(lambda loss: replaygrad.backward(loss, compiler="aot_eager"))
    assert_replayed(before)
    assert replaygrad.cache_info().hits == before.hits + 1
    assert got == expected


def test_a_replays_first_call_while_profiling_runs_uncompiled():
    # Its profile is eager's (the engine's events with the forward's sequence numbers;
    # torch's test_profiler_seq_nr), not a compile's; the next call compiles the replay.
    expected = _profiled_backward(lambda loss: loss.backward())
    counters.clear()
    before = replaygrad.cache_info()
    got = _profiled_backward(lambda loss: replaygrad.backward(loss, compiler="aot_eager"))
    assert_replayed(before)
    assert got == expected
    assert counters["stats"]["unique_graphs"] == 0
    compiled = _profiled_backward(lambda loss: replaygrad.backward(loss, compiler="aot_eager"))
    assert counters["stats"]["unique_graphs"] == 1
    assert any(name.strip().startswith("Torch-Compiled Region") for name, _ in compiled)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("create_graph", [False, True])
def test_a_single_roots_node_is_not_in_the_graph(create_graph):
    # The engine starts a single root's node with no GraphRoot before it, so that node is
    # not one of the graph's: _will_engine_execute_node says so, and a multi-grad hook over
    # the loss and another tensor is called once per tensor. (create_graph=True: the engine
    # runs the call itself, while replaygrad's engine hook is installed.)
    def run(backward):
        x = torch.randn(4, requires_grad=True)
        a = x.exp()
        loss = (a * 2).sum()
        will, calls = [], []
        a.register_hook(lambda g: will.append(torch._C._will_engine_execute_node(loss.grad_fn)))
        torch.autograd.graph.register_multi_grad_hook(
            (loss, a), lambda grads: calls.append([g is None for g in grads])
        )
        backward(loss)
        return will, calls

    expected = run(lambda loss: loss.backward(create_graph=create_graph))
    assert expected == ([False], [[False, True], [True, False]])
    before = replaygrad.cache_info()
    got = run(lambda loss: replaygrad.backward(loss, create_graph=create_graph, compiler=None))
    assert_replayed(before, calls=0 if create_graph else 1)
    assert got == expected


class _Spy:
    """Counts the calls made to a function (kept as ``real``)."""

    def __init__(self, real):
        self.real = real
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.fixture
def engine_calls(monkeypatch):
    """Counts the backward calls torch.autograd hands to the engine, and the plans made by
    the engine hook (``plan_engine_call``) and in front of the engine (``plan_backward``)."""
    from replaygrad import _core, _engine

    spies = {
        "engine": _Spy(_engine._torch_engine_run_backward),
        "plan_engine_call": _Spy(_core.plan_engine_call),
        "plan_backward": _Spy(_core.plan_backward),
    }
    monkeypatch.setattr(_engine, "_torch_engine_run_backward", spies["engine"])
    monkeypatch.setattr(_core, "plan_engine_call", spies["plan_engine_call"])
    monkeypatch.setattr(_core, "plan_backward", spies["plan_backward"])
    return lambda: {name: spy.calls for name, spy in spies.items()}


def _formulas_only(backward):
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    h = (x * w).sin()
    h.retain_grad()  # a C++ hook of torch's: nothing of the user's runs
    backward((h * 0.5 + x.exp()).sum())
    return x.grad, w.grad, h.grad


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_a_backward_of_torchs_formulas_runs_without_the_engine(engine_calls, compiler):
    expected = _formulas_only(lambda loss: loss.backward())
    before = replaygrad.cache_info()
    with replaygrad.enable(compiler):
        got = _formulas_only(lambda loss: loss.backward())
    assert_replayed(before)
    assert engine_calls() == {"engine": 0, "plan_engine_call": 0, "plan_backward": 1}
    for e, g in zip(expected, got):
        if compiler is None:
            assert torch.equal(e, g)
        else:
            torch.testing.assert_close(g, e)


def _grads_of_formulas(how: str):
    """``autograd.grad`` w.r.t. a leaf, a Parameter and a non-leaf, or ``backward(inputs=)``
    of the same, of a graph of torch's formulas; its results and the ``.grad``s."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(3))
    b = torch.randn(3, requires_grad=True)  # not an input: its AccumulateGrad is not needed
    h = (x * w).sin() + b
    loss = (h * 0.5 + x.exp()).sum()
    inputs = [x, w, h]
    if how == "grad":
        return torch.autograd.grad(loss, inputs), [t.grad for t in (x, w, b)]
    loss.backward(inputs=inputs)  # retains h's grad
    return (), [t.grad for t in (x, w, b, h)]


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("how", ["grad", "backward(inputs=)"])
def test_a_grad_of_torchs_formulas_runs_without_the_engine(engine_calls, compiler, how):
    expected = _grads_of_formulas(how)
    before = replaygrad.cache_info()
    with replaygrad.enable(compiler):
        got = _grads_of_formulas(how)
    assert_replayed(before)
    assert engine_calls() == {"engine": 0, "plan_engine_call": 0, "plan_backward": 1}
    assert [g is None for g in got[1]] == [e is None for e in expected[1]]
    for e, g in zip([*expected[0], *expected[1]], [*got[0], *got[1]]):
        if e is None:
            continue
        if compiler is None:
            assert torch.equal(e, g)
        else:
            torch.testing.assert_close(g, e)


def test_a_grad_of_an_unused_input_raises_as_in_eager(engine_calls):
    x = torch.randn(3, requires_grad=True)
    unused = torch.randn(3, requires_grad=True)
    results = []
    for context in (contextlib.nullcontext(), replaygrad.enable("aot_eager")):
        with context:
            loss = x.sin().sum()
            with pytest.raises(RuntimeError, match="Tensor at index 1 appears to not have been"):
                torch.autograd.grad(loss, [x, unused], retain_graph=True)
            results.append(torch.autograd.grad(loss, [x, unused], allow_unused=True))
            with pytest.raises(RuntimeError, match="does not require grad"):
                torch.autograd.grad(x.sin().sum(), [x, torch.randn(3)])
    assert results[1][1] is None
    torch.testing.assert_close(results[1][0], results[0][0])
    # (Outside enable(), torch calls its engine directly.) Under it, the call with an
    # input that does not require grad went to the engine, which raised.
    assert engine_calls()["engine"] == 1


def _with_user_code(kind: str, backward):
    torch.manual_seed(0)
    x = torch.randn(3, requires_grad=True)
    seen = []
    if kind == "saved_tensors_hooks":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: seen.append(1) or t):
            h = x.sin()
    elif kind == "custom Function":
        h = Doubling.apply(x.sin())
    else:
        h = x.sin()
        h.register_hook(lambda g: seen.append(torch._C._current_graph_task_id() != -1))
    backward(h.exp().sum())
    return x.grad, seen


@pytest.mark.parametrize("kind", ["tensor hook", "custom Function", "saved_tensors_hooks"])
def test_a_backward_running_user_code_runs_in_the_engine_planned_once(engine_calls, kind):
    expected = _with_user_code(kind, lambda loss: loss.backward())
    before = replaygrad.cache_info()
    with replaygrad.enable("aot_eager"):
        got = _with_user_code(kind, lambda loss: loss.backward())
    assert_replayed(before)
    # Planned in front of the engine, then handed to its hook: not planned again.
    assert engine_calls() == {"engine": 1, "plan_engine_call": 0, "plan_backward": 1}
    torch.testing.assert_close(got[0], expected[0])
    assert got[1] == expected[1]


@pytest.mark.parametrize("how", ["grad", "backward(inputs=)"])
def test_a_grad_running_user_code_runs_in_the_engine_planned_once(engine_calls, how):
    def run(unused):
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        seen = []
        h = x.sin()
        h.register_hook(lambda g: seen.append(torch._C._current_graph_task_id() != -1))
        loss = (h * w).exp().sum()
        inputs = [x, unused] if unused is not None else [x]
        if how == "grad":
            return torch.autograd.grad(loss, inputs, allow_unused=True), seen
        loss.backward(inputs=inputs)
        return (x.grad, w.grad), seen

    unused = torch.randn(2, requires_grad=True)  # a leaf the graph does not reach
    expected = run(unused)
    before = replaygrad.cache_info()
    with replaygrad.enable("aot_eager"):
        got = run(unused)
    assert_replayed(before)
    assert engine_calls() == {"engine": 1, "plan_engine_call": 0, "plan_backward": 1}
    assert got[1] == expected[1] == [True]
    for e, g in zip(expected[0], got[0]):
        assert (e is None) == (g is None)
        if e is not None:
            torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    "grad",
    [
        torch.tensor(2.0, dtype=torch.float64),  # validate_outputs casts these two
        torch.tensor(2.0, dtype=torch.float16),
        torch.tensor(2.0, dtype=torch.complex64),  # and raises on this one
    ],
    ids=["float64", "float16", "complex64"],
)
def test_root_gradients_the_engine_would_change_go_to_the_engine(engine_calls, grad):
    def run(backward):
        x = torch.randn(3, requires_grad=True, generator=torch.Generator().manual_seed(0))
        loss = x.exp().sum()
        try:
            backward(loss)
        except RuntimeError as error:
            return str(error)
        return x.grad

    expected = run(lambda loss: loss.backward(grad))
    with replaygrad.enable(None):
        got = run(lambda loss: loss.backward(grad))
    assert engine_calls()["plan_backward"] == 0
    if isinstance(expected, str):
        assert got == expected
    else:
        assert torch.equal(got, expected)


def test_backward_calls_made_while_compiling_run_in_the_engine(engine_calls):
    inner = []

    def compiler(fn):
        z = torch.ones(3, requires_grad=True)
        with torch.enable_grad():
            (z * z).sum().backward()
        inner.append(z.grad)
        return fn

    x = torch.randn(3, requires_grad=True)
    before = replaygrad.cache_info()
    replaygrad.backward(x.exp().sum(), compiler=compiler)
    assert_replayed(before)  # the inner backward was not replayed
    assert [g.tolist() for g in inner] == [[2.0, 2.0, 2.0]]
    torch.testing.assert_close(x.grad, x.exp())


def test_a_second_backward_through_a_graph_without_the_engine(engine_calls):
    def run(backward):
        x = torch.randn(3, requires_grad=True, generator=torch.Generator().manual_seed(0))
        loss = (x.sin() * 2).sum()
        backward(loss, retain_graph=True)
        backward(loss)
        with pytest.raises(RuntimeError) as error:
            backward(loss)
        return x.grad, str(error.value)

    expected = run(lambda loss, **kw: loss.backward(**kw))
    with replaygrad.enable(None):
        got = run(lambda loss, **kw: loss.backward(**kw))
    assert torch.equal(got[0], expected[0])
    assert got[1] == expected[1]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_tensor_root_goes_to_the_engine(engine_calls):
    # A nested root's shape is no sizes: it is not compared, the engine takes the call.
    def run(backward):
        a = torch.arange(6.0).reshape(2, 3).requires_grad_()
        b = torch.arange(8.0).reshape(2, 4).requires_grad_()
        nt = torch.nested.as_nested_tensor([a, b])
        out = nt.sin() * 2
        grad = torch.nested.nested_tensor([torch.ones(2, 3), torch.full((2, 4), 2.0)])
        backward(out, grad)
        return a.grad, b.grad

    expected = run(lambda out, grad: out.backward(grad))
    with replaygrad.enable(None):
        got = run(lambda out, grad: out.backward(grad))
    assert engine_calls()["plan_backward"] == 0
    for e, g in zip(expected, got):
        assert torch.equal(e, g)
