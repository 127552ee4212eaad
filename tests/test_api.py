"""The public API around the replay: switches, options, explain, logging, the cache."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading

import pytest
import torch

import replaygrad
from replaygrad import _core, _engine

from conftest import Doubling, counting_backend


def loss_of(w):
    return (w.exp() * w).sum()


def test_nested_enable_and_disable_restore_state():
    w = torch.randn(3, requires_grad=True)
    compilers = []

    def compiler(fn):
        compilers.append(fn)
        return fn

    with replaygrad.enable(compiler=None):
        with replaygrad.disable():
            loss_of(w).backward()  # the engine
            assert replaygrad.cache_info().misses == 0
            with replaygrad.enable(compiler=compiler):
                loss_of(w).backward()
            assert len(compilers) == 1
        loss_of(w).backward()  # back to compiler=None
        assert replaygrad.cache_info().misses == 2
    loss_of(w).backward()  # outside: the engine again
    assert replaygrad.cache_info().misses == 2
    assert _core.engine_set_enabled(False) is False


def test_enable_restores_state_when_the_block_raises():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(KeyError):
        with replaygrad.enable(compiler=None):
            with replaygrad.disable():
                raise KeyError("x")
    loss_of(w).backward()
    assert replaygrad.cache_info().misses == 0


def test_enable_is_reusable_reentrant_and_a_decorator():
    w = torch.randn(3, requires_grad=True)
    loss_of(w).backward()
    expected, w.grad = w.grad, None
    routing = replaygrad.enable(compiler=None)

    def grad_and_misses():
        loss_of(w).backward()
        got, w.grad = w.grad, None
        assert torch.equal(got, expected)
        return replaygrad.cache_info().misses

    with routing:
        assert grad_and_misses() == 1
        with routing:  # the same object, within its own block
            with replaygrad.disable():
                assert grad_and_misses() == 1  # the engine
            assert grad_and_misses() == 1  # a cache hit
        assert grad_and_misses() == 1  # the inner exit restored the outer block's state
    assert grad_and_misses() == 1  # outside: the engine
    with routing:  # entered again after its block ended
        assert grad_and_misses() == 1
    assert _core.engine_set_enabled(False) is False

    @replaygrad.enable(compiler=None)
    def replayed(depth):
        if depth:
            replayed(depth - 1)  # each call in a block of its own
        return grad_and_misses()

    assert replayed(2) == 1
    assert replaygrad.disable()(grad_and_misses)() == 1
    assert grad_and_misses() == 1
    assert _core.engine_set_enabled(False) is False


def test_one_enable_object_shared_by_threads():
    routing = replaygrad.enable(compiler=None)
    outer = replaygrad.enable("aot_eager")
    both_in, a_out = threading.Barrier(2), threading.Event()
    seen = {}

    def a():
        with outer:
            with routing:
                both_in.wait()
            seen["a out"] = _engine.current_config()  # its own prior, not b's
        a_out.set()

    def b():
        with routing:
            both_in.wait()
            a_out.wait()  # b's block ends after a's
            seen["b in"] = _engine.current_config()
        seen["b out"] = _engine.current_config()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"a out": outer.config, "b in": routing.config, "b out": None}
    assert _engine.current_config() is None


def test_enable_checks_its_arguments_when_called():
    with pytest.raises(ValueError, match="fallback must be"):
        replaygrad.enable(compiler=None, fallback="engine")
    with pytest.raises(ValueError, match="fallback must be"):
        replaygrad.enable(compiler=None, fallback=["eager"])
    with pytest.raises(ValueError, match="unknown compiler 'nope'"):
        replaygrad.enable("nope")
    # Valid arguments seen before are not checked again, and do not let bad ones through.
    replaygrad.enable("aot_eager", fallback="eager")
    with pytest.raises(ValueError, match="unknown compiler 'nope'"):
        replaygrad.enable("nope", fallback="eager")
    with pytest.raises(TypeError, match="unknown compile option"):
        replaygrad.enable("aot_eager", fallback="eager", fullgrpah=True)


@pytest.fixture
def compile_calls(monkeypatch) -> list[dict]:
    """The keyword arguments of every ``torch.compile`` call (which still compiles)."""
    calls: list[dict] = []
    real_compile = torch.compile

    def spy(fn, **kwargs):
        calls.append(kwargs)
        return real_compile(fn, **kwargs)

    monkeypatch.setattr(torch, "compile", spy)
    return calls


def test_compile_options_reach_torch_compile(compile_calls):
    w = torch.randn(3, requires_grad=True)
    with replaygrad.enable("aot_eager", dynamic=False, fullgraph=True):
        loss_of(w).backward()
    # (aot_eager as a backend making its graph modules eagerly, see _without_module_calls)
    (call,) = compile_calls
    assert call.pop("backend").__name__ == "aot_eager_without_module_calls"
    assert call == {"dynamic": False, "fullgraph": True}
    torch.testing.assert_close(w.grad, w.exp() * w + w.exp())


def test_inductor_options_dict_is_a_cache_key(compile_calls):
    """``options=`` of torch.compile is a dict: configs with equal dicts share entries."""
    seen = compile_calls
    w = torch.randn(3, requires_grad=True)
    for _ in range(2):
        with replaygrad.enable("inductor", options={"size_asserts": False}):
            loss_of(w).backward()
    ours = {"size_asserts": False, "fallback_random": True}
    assert seen == [{"backend": "inductor", "options": ours}]
    assert replaygrad.cache_info()[:2] == (1, 1)
    with replaygrad.enable("inductor", options={"size_asserts": True}):
        loss_of(w).backward()
    assert len(seen) == 2 and replaygrad.cache_info().misses == 2
    torch.testing.assert_close(w.grad, 3 * (w.exp() * w + w.exp()))


def test_inductor_options_replaygrad_sets(compile_calls):
    """Dynamo's guards check every input's sizes and strides before a compiled replay runs:
    inductor's asserts of the same are left out; random ops draw from torch's generator. A
    region with an in-place op on a view (CopySlices) compiles without reordering for
    locality and without fusion (inductor miscompiles such graphs otherwise; see
    test_node_kinds). Unless the options say otherwise; a mode is passed as its options,
    with these."""
    w = torch.randn(3, requires_grad=True)
    replaygrad.backward(loss_of(w), compiler="inductor")
    replaygrad.backward(loss_of(w), compiler="inductor", options={"size_asserts": True})
    replaygrad.backward(loss_of(w), compiler="inductor", mode="default")
    replaygrad.backward(loss_of(w), compiler="inductor", mode="max-autotune-no-cudagraphs")
    y = w * 1
    y[1:].mul_(2)
    replaygrad.backward(y.sum(), compiler="inductor")
    replaygrad.backward(loss_of(w), compiler="inductor", options={"max_fusion_size": 8})
    autotune = torch._inductor.list_mode_options("max-autotune-no-cudagraphs")
    ours = {"size_asserts": False, "fallback_random": True}
    views = {**ours, "reorder_for_locality": False, "max_fusion_size": 1}
    assert compile_calls == [
        {"backend": "inductor", "options": ours},
        {"backend": "inductor", "options": {**ours, "size_asserts": True}},
        {"backend": "inductor", "options": ours},
        {"backend": "inductor", "options": {**ours, **autotune}},
        {"backend": "inductor", "options": views},
        {"backend": "inductor", "options": {**ours, "max_fusion_size": 8}},
    ]
    expected = 5 * (w.exp() * w + w.exp()) + torch.tensor([1.0, 2.0, 2.0])
    torch.testing.assert_close(w.grad, expected)
    with pytest.raises(RuntimeError, match="Unrecognized mode=fast"):
        replaygrad.backward(loss_of(w), compiler="inductor", mode="fast")


def test_bad_compile_options():
    with pytest.raises(TypeError, match="need a backend name"):
        with replaygrad.enable(compiler=None, mode="max-autotune"):
            pass
    with pytest.raises(TypeError, match="may not set backend"):
        with replaygrad.enable("eager", backend="inductor"):
            pass
    with pytest.raises(TypeError, match=r"unknown compile option.*retain_grpah"):
        replaygrad.backward(torch.ones(1, requires_grad=True).sum(), retain_grpah=True)
    with pytest.raises(ValueError, match="unknown compiler 'nope'"):
        with replaygrad.enable("nope"):
            pass
    with pytest.raises(TypeError, match="compiler must be"):
        with replaygrad.enable(3):
            pass


def test_plan_explain_and_dot():
    w = torch.randn(3, requires_grad=True)
    h = w.exp()
    h.register_hook(lambda g: g)
    loss = Doubling.apply(h).sum()
    plan = replaygrad.plan(loss)
    assert plan.order == [
        "SumBackward0",
        "DoublingBackward",
        "ExpBackward0",
        "torch::autograd::AccumulateGrad",
    ]
    assert plan.opaque == [(1, "DoublingBackward")]
    assert plan.saved == [(2, "ExpBackward0")]
    text = plan.explain()
    assert "DoublingBackward" in text and "opaque" in text and "tensor_pre" in text
    assert "def replay(grads, saved, sizes, hooks):" in text
    assert "1 graph breaks" in text
    dot = plan.to_dot()
    assert dot.startswith("digraph replaygrad {")
    assert 's1 [label="1: DoublingBackward\\nopaque", color=red, style=dashed' in dot
    assert replaygrad.explain(loss) == text


def test_explain_shows_checkpointed_blocks():
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())
    h = torch.randn(3, 4, requires_grad=True)
    for _ in range(2):
        h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
    plan = replaygrad.plan(h.sum())
    assert plan.opaque == []  # traced, their values unpacked once per block
    text = plan.explain()
    assert "2 (2 unpacked, block 1)" in text  # the second block's AddmmBackward0
    assert "0 graph breaks and 2 checkpointed blocks" in text
    assert text.count("unpack_saved(") == 2


def test_logging_channels(caplog):
    w = torch.randn(3, requires_grad=True)
    caplog.set_level(logging.DEBUG, logger="replaygrad")
    replaygrad.backward(loss_of(w), compiler=None)
    replaygrad.backward(loss_of(w), compiler=None)
    replaygrad.backward(torch.addcmul(w, w, w, value=3.0).sum(), compiler=None)
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    names = [n for n, _ in messages]
    assert "replaygrad.plan" in names and "replaygrad.source" in names
    assert any(n == "replaygrad.cache" and m.startswith("hit") for n, m in messages)
    recompiles = [m for n, m in messages if n == "replaygrad.recompiles"]
    assert any("step 0 (SumBackward0)" in m or "steps" in m for m in recompiles)


def test_recompile_reason_names_the_changed_part(caplog):
    w = torch.randn(3, requires_grad=True)
    caplog.set_level(logging.DEBUG, logger="replaygrad.recompiles")
    replaygrad.backward(torch.addcmul(w, w, w, value=2.0).sum(), compiler=None)
    replaygrad.backward(torch.addcmul(w, w, w, value=3.0).sum(), compiler=None)
    (message,) = [r.getMessage() for r in caplog.records if r.name == "replaygrad.recompiles"]
    assert "step 1 (AddcmulBackward0): specialization" in message


def test_logs_variable_enables_only_the_channels_it_names():
    script = (
        "import torch, replaygrad\n"
        "w = torch.randn(3, requires_grad=True)\n"
        "for value in (2.0, 3.0):\n"
        "    replaygrad.backward(torch.addcmul(w, w, w, value=value).sum(), compiler=None)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "REPLAYGRAD_LOGS": "recompiles"},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    channels = {line.split("]")[0] + "]" for line in result.stderr.splitlines() if line[:1] == "["}
    assert channels == {"[replaygrad.recompiles]"}, result.stderr


def test_configure_rejects_unknown_channels():
    from replaygrad._logging import configure

    with pytest.raises(ValueError, match="unknown channel"):
        configure("plan,bogus")


def test_cache_info_reset_and_size():
    w = torch.randn(3, requires_grad=True)
    replaygrad.set_cache_size(2)
    try:
        for k in (1.0, 2.0, 3.0):
            replaygrad.backward(torch.addcmul(w, w, w, value=k).sum(), compiler=None)
        info = replaygrad.cache_info()
        assert (info.misses, info.size, info.maxsize) == (3, 2, 2)
        replaygrad.reset()
        assert replaygrad.cache_info() == (0, 0, 0, 2)
        with pytest.raises(ValueError, match="cache size"):
            replaygrad.set_cache_size(0)
        for bad in (True, "5", 2.0):
            with pytest.raises(TypeError, match="cache size"):
                replaygrad.set_cache_size(bad)
    finally:
        replaygrad.set_cache_size(256)


def test_grad_is_grads_batched():
    w = torch.randn(3, requires_grad=True)
    expected = torch.autograd.grad(w * w, w, torch.eye(3), is_grads_batched=True)
    got = replaygrad.grad(w * w, w, torch.eye(3), is_grads_batched=True, compiler=None)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_batched_root_gradients_replay_uncompiled():
    # is_grads_batched=True runs the call under legacy vmap: its root gradients are batched
    # tensors, plain torch.Tensor to Python, which Dynamo cannot fake (it warned and fell
    # back frame by frame). The replay runs uncompiled, with eager's values.
    backend, graphs = counting_backend()
    compiler = torch.compile(backend=backend)
    w = torch.randn(3, requires_grad=True)
    expected = torch.autograd.grad(w.sin() * w.exp(), w, torch.eye(3), is_grads_batched=True)
    before = replaygrad.cache_info()
    got = replaygrad.grad(
        w.sin() * w.exp(), w, torch.eye(3), is_grads_batched=True, compiler=compiler
    )
    after = replaygrad.cache_info()
    assert after.hits + after.misses > before.hits + before.misses
    assert graphs == []
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_plan_checks_its_arguments_as_torch_does():
    w = torch.randn(3, requires_grad=True)
    loss = loss_of(w)
    for tensors in ("loss", 3, ["loss"]):
        with pytest.raises(TypeError, match="tensors must be"):
            replaygrad.plan(tensors)
    with pytest.raises(TypeError, match="tensors must be"):
        replaygrad.explain("loss")
    for inputs, error in (([], RuntimeError), ([torch.randn(3)], RuntimeError)):
        with pytest.raises(error) as ours:
            replaygrad.plan(loss, inputs)
        with pytest.raises(error) as torchs:
            torch.autograd.grad(loss, inputs, retain_graph=True)
        assert str(ours.value) == str(torchs.value)


def test_deprecated_arguments_are_passed_on():
    # torch warns about them and goes on.
    w = torch.randn(3, requires_grad=True)
    with pytest.warns(FutureWarning, match="grad_variables"):
        replaygrad.backward(loss_of(w), grad_variables=torch.tensor(2.0), compiler=None)
    expected = w.grad.clone()
    w.grad = None
    loss_of(w).backward(torch.tensor(2.0))
    assert torch.equal(w.grad, expected)
    with pytest.warns(FutureWarning, match="only_inputs"):
        (got,) = replaygrad.grad(loss_of(w), w, only_inputs=False, compiler=None)
    assert torch.equal(got, torch.autograd.grad(loss_of(w), w)[0])


def test_plan_takes_gradient_edges():
    x = torch.randn(2, requires_grad=True)
    z = x * 3
    loss = z.sin().sum()
    edge = torch.autograd.graph.get_gradient_edge(z)
    assert replaygrad.plan(loss, [edge]).order == replaygrad.plan(loss, [z]).order
    assert replaygrad.plan(edge).order == ["MulBackward0", "torch::autograd::AccumulateGrad"]
