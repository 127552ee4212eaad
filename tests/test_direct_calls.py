"""Steady-state calls run Dynamo's compiled code of a region directly (see
``replaygrad._compile._DirectCalls``), with Dynamo's guards, and only where Dynamo would run
that code as it is; everything else goes through Dynamo. Every test checks eager's
gradients too."""

from __future__ import annotations

import pytest
import torch

import replaygrad
from replaygrad._compile import _Compiled, cache

from conftest import Doubling, Through


def grads_of(params):
    return [p.grad.clone() for p in params]


def eager_grads(make_loss, params):
    for p in params:
        p.grad = None
    make_loss().backward()
    return grads_of(params)


def replay_grads(make_loss, params, compiler, **options):
    for p in params:
        p.grad = None
    replaygrad.backward(make_loss(), compiler=compiler, **options)
    return grads_of(params)


def mlp(batch: int, dtype=torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = model.to(dtype)
    x = torch.randn(batch, 6, dtype=dtype)
    return list(model.parameters()), lambda: model(x).square().sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_steady_state_calls_skip_dynamos_frame_evaluation(compiler):
    params, loss = mlp(4)
    expected = eager_grads(loss, params)
    torch.testing.assert_close(replay_grads(loss, params, compiler), expected)
    through = Through()
    assert through.regions and all(r.direct is not None for r in through.regions)
    for _ in range(3):
        torch.testing.assert_close(replay_grads(loss, params, compiler), expected)
    assert through.calls == 0


def test_new_shapes_go_through_dynamo_then_run_directly():
    params, loss = mlp(4)
    replay_grads(loss, params, "aot_eager")
    through = Through()
    # The guards of the variant Dynamo compiled for batch 4 fail for batch 7, which it
    # compiles with a dynamic batch size, whose guards then pass for batch 5.
    for batch, compiles in ((7, 1), (5, 0)):
        p, other = mlp(batch)
        expected = eager_grads(other, p)
        before = through.calls
        torch.testing.assert_close(replay_grads(other, p, "aot_eager"), expected)
        assert through.calls == before + compiles
        torch.testing.assert_close(replay_grads(other, p, "aot_eager"), expected)
        assert through.calls == before + compiles
    # Another dtype is another replay (its saved values' dtypes are in the plan's key).
    p, other = mlp(5, torch.float64)
    expected = eager_grads(other, p)
    torch.testing.assert_close(replay_grads(other, p, "aot_eager"), expected)
    assert through.calls == 1
    through = Through()
    torch.testing.assert_close(replay_grads(other, p, "aot_eager"), expected)
    assert through.calls == 0


def test_force_eager_stance_runs_through_dynamo():
    params, loss = mlp(4)
    expected = eager_grads(loss, params)
    replay_grads(loss, params, "aot_eager")
    through = Through()
    with torch.compiler.set_stance("force_eager"):
        torch.testing.assert_close(replay_grads(loss, params, "aot_eager"), expected)
    assert through.calls == 1
    torch.testing.assert_close(replay_grads(loss, params, "aot_eager"), expected)
    assert through.calls == 1


def test_calls_under_the_profiler_run_through_dynamo():
    params, loss = mlp(4)
    replay_grads(loss, params, "aot_eager")
    replay_grads(loss, params, "aot_eager")
    through = Through()
    with torch.profiler.profile() as prof:
        replay_grads(loss, params, "aot_eager")
    assert through.calls == 1
    assert any(e.name.startswith("Torch-Compiled Region") for e in prof.events())


def _graph_break(w):
    y = w.sin()
    y.register_hook(lambda g: torch._dynamo.graph_break() or g * 3)
    return (y * w).exp().sum()


def _traced_hook(w):
    y = w.sin()
    y.register_hook(lambda g: g * 3)
    return (y * w).sum()


@pytest.mark.parametrize("forward", [_graph_break, _traced_hook], ids=["graph break", "hook"])
def test_regions_with_graph_breaks_or_python_hooks_run_through_dynamo(forward):
    # Python hooks are traced into the graph: one that Dynamo cannot trace breaks it.
    w = torch.randn(5, requires_grad=True)
    expected = eager_grads(lambda: forward(w), [w])
    torch.testing.assert_close(replay_grads(lambda: forward(w), [w], "aot_eager"), expected)
    through = Through()
    for _ in range(3):
        torch.testing.assert_close(replay_grads(lambda: forward(w), [w], "aot_eager"), expected)
    assert through.calls == 3
    assert all(r.direct is None for r in through.regions)


def test_a_step_run_as_itself_gets_a_region_of_its_own_between_direct_calls():
    # A Function that is not traceable runs as itself between two compiled regions, each
    # without a graph break (not as a break inside one region).
    def forward():
        return (Doubling.apply(w.sin()) * w).exp().sum()

    w = torch.randn(5, requires_grad=True)
    expected = eager_grads(forward, [w])
    torch._dynamo.utils.counters.clear()
    torch.testing.assert_close(replay_grads(forward, [w], "aot_eager"), expected)
    assert not torch._dynamo.utils.counters["graph_break"]
    (entry,) = cache._entries.values()
    assert [g.compiled for g in entry.replay.regions] == [True, False, True]
    through = Through()
    for _ in range(3):
        torch.testing.assert_close(replay_grads(forward, [w], "aot_eager"), expected)
    assert through.calls == 0
    assert len(through.regions) == 2 and all(r.direct for r in through.regions)


def test_regions_a_compiler_callable_compiled_run_directly_only_if_dynamos():
    params, loss = mlp(4)
    expected = eager_grads(loss, params)
    torch.testing.assert_close(
        replay_grads(loss, params, lambda fn: torch.compile(fn, backend="aot_eager")), expected
    )
    assert all(r.direct is not None for r in cache._regions.values())
    cache.clear()

    def wrapped(fn):
        compiled = torch.compile(fn, backend="aot_eager")
        return lambda *args: compiled(*args)

    torch.testing.assert_close(replay_grads(loss, params, wrapped), expected)
    regions = list(cache._regions.values())
    assert regions and all(isinstance(r, _Compiled) and r.direct is None for r in regions)


def test_after_a_dynamo_reset_regions_compile_again():
    params, loss = mlp(4)
    expected = eager_grads(loss, params)
    replay_grads(loss, params, "aot_eager")
    through = Through()
    torch._dynamo.reset()  # drops every compiled variant: nothing may run the old code
    torch.testing.assert_close(replay_grads(loss, params, "aot_eager"), expected)
    assert through.calls == 1
    torch.testing.assert_close(replay_grads(loss, params, "aot_eager"), expected)
    assert through.calls == 1


@pytest.mark.parametrize("options", [{"fullgraph": True}, {"dynamic": True}, {"dynamic": False}])
def test_compile_options_keep_direct_calls(options):
    # (Under dynamic=True the replay has no graph break: Linear's AddmmBackward0 asks whether
    # the weight's stride, a symbol then, is 1, which fixes it to 1 and no size.)
    params, loss = mlp(4)
    expected = eager_grads(loss, params)
    torch.testing.assert_close(replay_grads(loss, params, "aot_eager", **options), expected)
    through = Through()
    for _ in range(2):
        torch.testing.assert_close(replay_grads(loss, params, "aot_eager", **options), expected)
    assert through.calls == 0


def test_an_engine_call_from_code_dynamo_runs_replays_with_dynamo_off():
    # The engine called directly (not through torch.autograd) in a compiled function: the
    # call breaks Dynamo's graph and runs with Dynamo's frame evaluation on. The replay
    # turns it off, as torch.autograd's entry does, so Dynamo compiles none of its frames
    # (it compiled about 150, each Python step and hook helper, breaking at most).
    w = torch.randn(5, requires_grad=True)

    def forward():
        return (Doubling.apply(w.sin()) * w).exp().sum()

    expected = eager_grads(forward, [w])

    @torch.compile(backend="eager")
    def step(loss):
        torch.autograd.Variable._execution_engine.run_backward(
            (loss,), (torch.ones(()),), False, False, (), True, True
        )

    torch._dynamo.utils.counters.clear()
    with replaygrad.enable("aot_eager"):
        for _ in range(3):
            w.grad = None
            step(forward())
            torch.testing.assert_close([w.grad], expected)
    (reason,) = torch._dynamo.utils.counters["graph_break"]
    assert "run_backward" in reason


def test_views_between_steps_outside_the_graph_run_with_them():
    # A Linear's bias and weight AccumulateGrads, with post-accumulate-grad hooks, run in
    # place between compiled regions; the weight's TBackward0 between them (a view) runs with
    # them as Python, not as a compiled region of its own.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 6)
    seen = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, p.grad.clone()))
        )
    params = list(model.parameters())

    def forward():
        return model(x).square().sum()

    expected = eager_grads(forward, params)
    expected_seen = list(seen)
    for _ in range(3):
        seen.clear()
        torch.testing.assert_close(replay_grads(forward, params, "aot_eager"), expected)
        assert [name for name, _ in seen] == [name for name, _ in expected_seen]
        torch.testing.assert_close([g for _, g in seen], [g for _, g in expected_seen])
    (entry,) = cache._entries.values()
    assert [g.compiled for g in entry.replay.regions] == [True, False, True, False]
