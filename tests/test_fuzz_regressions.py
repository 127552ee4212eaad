"""Differences between replaygrad and eager autograd found by the differential fuzzer
(tests/test_fuzz.py, benchmarks/fuzz.py), each reduced to a minimal program.

Each test runs the same program through eager autograd and through replaygrad (uncompiled,
where the difference already shows) and asserts they agree; they are marked
``xfail(strict=True, raises=AssertionError)`` until replaygrad is fixed. What each test
assumes about eager itself is checked with :func:`eager_fact`, which raises
:class:`EagerChanged` (not an AssertionError) so that a torch change fails the test instead
of passing for the wrong reason.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import replaygrad


class EagerChanged(Exception):
    """Eager autograd no longer behaves as the test assumes."""


def eager_fact(condition: bool, what: str) -> None:
    if not condition:
        raise EagerChanged(what)


def eager_backward(*args, **kwargs) -> None:
    torch.autograd.backward(*args, **kwargs)


def replay_backward(*args, **kwargs) -> None:
    replaygrad.backward(*args, compiler=None, **kwargs)


def eager_grad(*args, **kwargs):
    return torch.autograd.grad(*args, **kwargs)


def replay_grad(*args, **kwargs):
    return replaygrad.grad(*args, compiler=None, **kwargs)


# ---- AccumulateGrad never steals the incoming gradient ------------------------------------

# AccumulateGrad steals a gradient nobody else holds (use_count <= 1, or 2 with post hooks)
# and makes it .grad. replaygrad hands the gradient over (rg_node_accumulate moves it out
# of its handle; an AccumulateGrad with hooks around it is called after the outputs that
# held the gradient are dropped), so it steals as the engine does.


def _leaf_grad_is_hook_result(backward: Callable) -> bool:
    x = torch.randn(4, requires_grad=True)
    made = []

    def hook(grad):
        out = grad * 3
        made.append(out.data_ptr())  # no reference to `out` is kept
        return out

    x.register_hook(hook)
    backward((x * 2).sum())
    return x.grad.data_ptr() == made[0]


def test_accumulate_grad_steals_unshared_gradient():
    eager_fact(_leaf_grad_is_hook_result(eager_backward), "eager steals the hook's result")
    assert _leaf_grad_is_hook_result(replay_backward), "replaygrad copied it"


def _root_grad_becomes_leaf_grad(backward: Callable) -> bool:
    x = torch.randn(1, 4, requires_grad=True)
    grad = torch.randn(4, 1)
    backward([x.transpose(0, 1)], [grad])  # TransposeBackward: a fresh view of `grad`
    return x.grad.data_ptr() == grad.data_ptr()


def test_accumulate_grad_steals_view_of_root_gradient():
    eager_fact(_root_grad_becomes_leaf_grad(eager_backward), "eager: .grad aliases the root grad")
    assert _root_grad_becomes_leaf_grad(replay_backward)


def _post_hook_sees_scaled_grad(backward: Callable) -> torch.Tensor:
    x = torch.ones(3, requires_grad=True)
    seen = []
    accumulate = torch.autograd.graph.get_gradient_edge(x).node
    accumulate.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_outputs[0] + 0))

    def scale_grad(tensor):
        tensor.grad.mul_(2)

    x.register_post_accumulate_grad_hook(scale_grad)
    backward((x * 3).sum())
    return seen[0]


def test_accumulate_grad_steals_gradient_seen_by_post_hook():
    # A post-accumulate-grad hook scales .grad in place (what these hooks are for); in eager
    # .grad *is* the incoming gradient, so the AccumulateGrad post hook sees it scaled.
    expected = _post_hook_sees_scaled_grad(eager_backward)
    eager_fact(torch.equal(expected, torch.full((3,), 6.0)), "eager: the post hook sees 2 * 3")
    assert torch.equal(_post_hook_sees_scaled_grad(replay_backward), expected)


# ---- a single root that exec_info does not need -------------------------------------------

# With one root edge and no compiled-autograd hook, Engine::execute skips the GraphRoot and
# queues the root node itself whatever exec_info says; evaluate_function then runs its
# tensor pre-hooks and retain_grad hooks (and captures) before skipping it as not needed.
# replaygrad's hook makes the engine build a GraphRoot, so plans model the engine without
# one (fixed: Plan::build_for schedules with graph_root=false).


def _hooks_of_unneeded_root(backward: Callable) -> tuple[list[str], torch.Tensor | None]:
    x = torch.randn(3, requires_grad=True)
    h = x.sin()
    calls = []
    h.register_hook(lambda g: calls.append("h") or None)
    h.retain_grad()
    later = h.exp()  # downstream of h: no path from h's gradient to it
    backward(h, torch.ones(3), inputs=[later])
    return calls, h.grad


def test_single_root_not_needed_runs_its_tensor_hooks():
    calls, grad = _hooks_of_unneeded_root(eager_backward)
    eager_fact(calls == ["h"] and grad is not None, "eager runs the root's tensor hooks")
    rg_calls, rg_grad = _hooks_of_unneeded_root(replay_backward)
    assert rg_calls == calls
    assert rg_grad is not None and torch.equal(rg_grad, grad)


def _hooks_of_unneeded_root_grad(grad_fn: Callable) -> list[str]:
    x = torch.randn(3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)
    h = x.sin()
    calls = []
    h.register_hook(lambda g: calls.append("h") or None)
    grad_fn(h, [w], torch.ones(3), allow_unused=True)
    return calls


def test_single_root_not_needed_runs_its_tensor_hooks_in_autograd_grad():
    eager_fact(_hooks_of_unneeded_root_grad(eager_grad) == ["h"], "eager runs the hook")
    assert _hooks_of_unneeded_root_grad(replay_grad) == ["h"]


# ---- retain_grad is applied after the replay, from a reference ----------------------------


def _retained_after_inplace_prehook(backward: Callable) -> torch.Tensor:
    x = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    h = x.sin()

    def scale_in_place(grads):
        grads[0].mul_(2)

    h.grad_fn.register_prehook(scale_in_place)
    h.retain_grad()
    backward(h, torch.tensor(1.0, dtype=torch.float64))
    return h.grad


def test_retain_grad_value_is_taken_before_pre_hooks():
    expected = _retained_after_inplace_prehook(eager_backward)
    eager_fact(expected.item() == 1.0, "eager's .grad is the gradient before the pre-hook")
    assert torch.equal(_retained_after_inplace_prehook(replay_backward), expected)


# ---- an error mid-backward ----------------------------------------------------------------


class FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 1

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward failed")


def _grads_after_failure(backward: Callable) -> torch.Tensor | None:
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(3, requires_grad=True)
    failing = FailingBackward.apply(w).sum()  # created first: runs after x's branch
    ok = (x * 2).sum()
    with pytest.raises(ValueError, match="backward failed"):
        backward([ok, failing])
    return x.grad


def test_error_mid_backward_keeps_earlier_accumulations():
    expected = _grads_after_failure(eager_backward)
    eager_fact(expected is not None, "eager accumulated x before the failing node ran")
    got = _grads_after_failure(replay_backward)
    assert got is not None and torch.equal(got, expected)


def _dtype_hook_error(backward: Callable) -> str:
    x = torch.randn(3, dtype=torch.float64, requires_grad=True)
    h = x * 2

    def to_float(grad):
        return grad.float()

    h.register_hook(to_float)
    with pytest.raises(RuntimeError) as error:
        backward(h.sin().sum())
    return str(error.value)


def test_hook_changing_dtype_raises_eagers_message():
    expected = _dtype_hook_error(eager_backward)
    eager_fact("torch.DoubleTensor" in expected, f"eager's message: {expected}")
    assert _dtype_hook_error(replay_backward) == expected


# ---- saved values are unpacked when the replay is planned ---------------------------------

# Eager unpacks a node's SavedVariables when the node runs, which calls saved_tensors_hooks'
# unpack (for non-reentrant torch.utils.checkpoint: recomputes the segment). replaygrad once
# unpacked every saved value when it planned; nodes with hooked saved values now run as
# themselves (opaque), so unpack hooks run in engine order.


def _unpack_order(backward: Callable) -> list[str]:
    log = []
    x = torch.randn(3, requires_grad=True)

    def pack(t):
        log.append("pack")
        return t

    def unpack(t):
        log.append("unpack")
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        h = x.sin()  # SinBackward0 saves x
    h2 = h * 2
    h2.register_hook(lambda g: log.append("hook") or None)
    backward(h2.exp().sum())
    return log


def test_saved_tensor_unpack_hooks_run_when_the_node_runs():
    expected = _unpack_order(eager_backward)
    eager_fact(expected == ["pack", "hook", "unpack"], f"eager's order: {expected}")
    assert _unpack_order(replay_backward) == expected


def _checkpoint_order(backward: Callable) -> list[str]:
    from torch.utils.checkpoint import checkpoint

    log = []

    def segment(x, k):
        log.append(f"forward {k}")
        return (x.sin() * x).exp()

    h = torch.randn(4, requires_grad=True)
    for k in range(3):
        h = checkpoint(segment, h, k, use_reentrant=False)
        h.register_hook(lambda g, k=k: log.append(f"backward {k}") or None)
    backward(h.sum())
    return log


def test_non_reentrant_checkpoint_recomputes_each_segment_when_needed():
    expected = _checkpoint_order(eager_backward)
    forwards = ["forward 0", "forward 1", "forward 2"]
    recompute = ["backward 2", "forward 2", "backward 1", "forward 1", "backward 0", "forward 0"]
    eager_fact(expected == forwards + recompute, f"eager's order: {expected}")
    assert _checkpoint_order(replay_backward) == expected


# ---- hooks registered during the backward --------------------------------------------------

# The engine reads a node's hooks when it runs the node (call_tensor_pre_hooks,
# call_pre_hooks, call_post_hooks iterate the live lists and dicts), so a hook can register
# or remove hooks (or call retain_grad) for nodes that run later in the same backward.
# replaygrad reads each Python hook's dict of callables when the replay reaches it
# (Plan.hook_dicts), and a node run for real (here: uncompiled) calls the hooks it got
# since it was planned (rg_node_apply's `live`).


def _edited_hooks(backward: Callable, action: str) -> tuple[list[str], torch.Tensor | None]:
    log = []
    x = torch.randn(3, requires_grad=True)
    later = x.sin()  # its node runs after `first`'s
    first = later * 2
    handle = later.register_hook(lambda g: log.append("registered before") or None)

    def editing_hook(grad):
        log.append("editing")
        if action == "add":
            later.register_hook(lambda g: log.append("registered during") or None)
        elif action == "remove":
            handle.remove()
        else:
            later.retain_grad()

    first.register_hook(editing_hook)
    backward(first.sum())
    return log, later.grad if action == "retain_grad" else None


def test_hook_registered_during_backward_runs():
    # `later` has a tensor hook already: the new callable joins its live dict.
    expected, _ = _edited_hooks(eager_backward, "add")
    eager_fact(expected[-1] == "registered during", f"eager's calls: {expected}")
    assert _edited_hooks(replay_backward, "add")[0] == expected


def test_hook_removed_during_backward_does_not_run():
    expected, _ = _edited_hooks(eager_backward, "remove")
    eager_fact(expected == ["editing"], f"eager's calls: {expected}")
    assert _edited_hooks(replay_backward, "remove")[0] == expected


def test_retain_grad_called_during_backward_is_applied():
    _, expected = _edited_hooks(eager_backward, "retain_grad")
    eager_fact(expected is not None, "eager retains the gradient")
    _, got = _edited_hooks(replay_backward, "retain_grad")
    assert got is not None and torch.equal(got, expected)


def test_callable_registered_again_during_a_compiled_backward():
    # Found by benchmarks/fuzz.py (seed 2003, aot_eager). A hook registers the same callable
    # on h at every backward: the first call gives h a hook dict, the second adds the
    # callable to it again, which eager then calls twice. A compiled replay found the change
    # by comparing the dict's callables, not counting them, so the replay of the second
    # call, cached, kept the hook in the graph with the callable once.
    def run(backward):
        log = []
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        out = h.exp()

        def recording(g):
            log.append(len(log))

        out.register_hook(lambda g: h.register_hook(recording) and None)
        backward(out.sum(), retain_graph=True)
        backward(out.sum())
        return log

    expected = run(eager_backward)
    eager_fact(expected == [0, 1, 2], f"eager's calls: {expected}")
    for _ in range(2):  # the second run's calls hit the replays the first one cached
        assert run(lambda *a, **k: replaygrad.backward(*a, compiler="aot_eager", **k)) == expected


# ---- compiled replays ----------------------------------------------------------------------


class TraceableFailingBackward(torch.autograd.Function):
    is_traceable = True

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("backward failed")


def _error_of_traceable_function(backward: Callable) -> BaseException:
    x = torch.randn(3, requires_grad=True)
    with pytest.raises(Exception) as error:
        backward(TraceableFailingBackward.apply(x * 2).sum())
    return error.value


def test_traceable_function_error_reaches_caller_when_compiled():
    expected = _error_of_traceable_function(eager_backward)
    eager_fact(type(expected) is ValueError, f"eager raised {expected!r}")
    got = _error_of_traceable_function(
        lambda *args: replaygrad.backward(*args, compiler="aot_eager")
    )
    assert type(got) is ValueError, f"replaygrad raised {type(got).__name__}"


@pytest.mark.parametrize("change", ["dtype", "device", "layout", "size"])
def test_hook_changing_the_gradient_raises_eagers_message(change):
    def convert(grad):
        if change == "dtype":
            return grad.float()
        if change == "device":
            return grad.to("meta")
        if change == "layout":
            return grad.to_sparse()
        return grad[:2]

    def message(backward: Callable) -> str:
        x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        h = x * 2
        h.register_hook(convert)
        h.grad_fn.register_prehook(lambda grads: None)
        with pytest.raises(RuntimeError) as error:
            backward(h.sin().sum())
        return str(error.value)

    assert message(replay_backward) == message(eager_backward)
