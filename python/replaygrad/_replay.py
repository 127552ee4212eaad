"""The replay: a straight-line Python function, generated from a plan, that runs the backward
the way torch/csrc/autograd/engine.cpp does, one statement block per engine step.

A replay depends only on the plan's structure (its key). Everything that changes from one
backward call to the next is an argument: the root gradients, the saved values, the hook
callables. Nodes are reached through the plan being run (``current_plan``), by step number,
inside functions Dynamo does not trace, so a compiled replay carries no guard on this
iteration's graph and is reused across iterations.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _core

_tls = threading.local()


def current_plan() -> _core.Plan:
    """The plan whose replay is running on this thread."""
    plan = getattr(_tls, "plan", None)
    if plan is None:
        raise RuntimeError("replaygrad: a replay step ran outside of a replay")
    return plan


class running:
    """Makes ``plan`` the current plan of this thread for the duration of a replay."""

    def __init__(self, plan: _core.Plan) -> None:
        self.plan = plan

    def __enter__(self) -> None:
        self.prior = getattr(_tls, "plan", None)
        _tls.plan = self.plan

    def __exit__(self, *exc: object) -> None:
        _tls.plan = self.prior


# ---- steps the replay calls --------------------------------------------------------------


@torch._dynamo.allow_in_graph
def apply_traced(step: int, inputs: list, saved: list) -> tuple:
    """A traced step: the current plan's node, called with ``saved`` swapped in.

    In the graph, Dynamo does not look inside (so no guard on the node); AOTAutograd and
    the eager backend call it with the values being traced or run.
    """
    try:
        outputs = current_plan().apply(step, inputs, saved)
    except Exception as error:
        if not isinstance(error, _TRACING_LIMITS):
            error.__replaygrad_node_error__ = True  # type: ignore[attr-defined]
        raise
    first = next((o for o in outputs if o is not None), None)
    if isinstance(first, FakeTensor):
        _note_layouts(step, inputs, saved, outputs)
    return outputs


def _note_layouts(step: int, *groups: Sequence[Any]) -> None:
    """While Dynamo traces a replay: notes a step that takes or returns a sparse (or other
    non-strided) tensor, e.g. ``gather(..., sparse_grad=True)``'s backward. The plan only
    knows the layouts the graph's metadata promises; such a step is found here, and if the
    compiler then fails (inductor compiles dense tensors only), the replay is rebuilt with
    it run as itself (see :func:`non_strided_steps`)."""
    for group in groups:
        for t in group:
            if isinstance(t, torch.Tensor) and t.layout is not torch.strided:
                noted = getattr(_tls, "non_strided", None)
                if noted is not None:
                    noted.add(step)
                return


class non_strided_steps:
    """Collects the steps :func:`_note_layouts` finds while the block runs (a replay call,
    which compiles on a miss)."""

    def __enter__(self) -> set[int]:
        self.prior = getattr(_tls, "non_strided", None)
        _tls.non_strided = set()
        return _tls.non_strided

    def __exit__(self, *exc: object) -> None:
        _tls.non_strided = self.prior


# What a node raises when it is run on fake tensors it cannot handle: a limit of tracing,
# not an error of the backward itself.
_TRACING_LIMITS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.UnsupportedOperatorException,
    torch._subclasses.fake_tensor.UnsupportedFakeTensorException,
    torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode,
)


def node_error(error: BaseException) -> BaseException | None:
    """The error a traced node raised, if ``error`` (from compiling a replay) wraps one.

    Dynamo runs traced steps on fake tensors while it compiles; an error of the node's
    backward (e.g. a custom Function raising) would happen when run eagerly too, so it is
    the caller's error, not a compile failure.
    """
    seen = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if getattr(cause, "__replaygrad_node_error__", False):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _flush(deferred: list) -> None:
    """Performs the deferred effects the replay has reached (accumulations, retain_grads)
    before code that may observe them (``.grad`` in a hook or an opaque node) runs."""
    if deferred:
        current_plan().run_deferred(deferred, complete=False)


@torch._dynamo.disable
def apply_opaque(deferred: list, step: int, inputs: list) -> tuple:
    """An opaque step: a graph break that runs the current graph's node as itself."""
    _flush(deferred)
    return current_plan().apply(step, inputs)


@torch._dynamo.disable
def apply_accumulate(deferred: list, step: int, inputs: list, take: bool) -> tuple:
    """An AccumulateGrad run in place (hooks observe it), handed its gradient so that it can
    steal it as in the engine; ``take``: no post hook needs ``inputs`` afterwards."""
    _flush(deferred)
    current_plan().accumulate(step, inputs, take)
    return ()


@torch._dynamo.disable
def cpp_pre_hook(deferred: list, step: int, position: int, values: list) -> list:
    """A C++ pre-kind hook (no Python dict to trace): a graph break through the engine API."""
    _flush(deferred)
    return list(current_plan().call_hook(step, position, values))


@torch._dynamo.disable
def cpp_post_hook(deferred: list, step: int, position: int, outputs: tuple, inputs: list) -> tuple:
    _flush(deferred)
    return current_plan().call_hook(step, position, outputs, inputs)


# ---- Python hooks, as torch/csrc/autograd/python_hook.cpp calls them ----------------------


def _hook_name(fn: object) -> str:
    return getattr(fn, "__name__", "<unknown>")


def _type_string(t: torch.Tensor) -> str:
    """at::TensorBase::toString(): the legacy type name on CPU and CUDA
    ("torch.DoubleTensor", "torch.sparse.FloatTensor"), "<Device><Scalar>Type" elsewhere."""
    legacy = t.type()
    if t.device.type in ("cpu", "cuda"):
        return legacy
    scalar = legacy.rsplit(".", 1)[-1].removesuffix("Tensor")
    return f"{t.device.type.capitalize()}{scalar}Type"


def _check_single_result(original: Any, result: Any, fn: object) -> None:
    """check_single_result / check_variable_result of python_hook.cpp."""
    if result is None:
        return
    if original is None:
        raise RuntimeError("can't replace a None gradient with a non-None value")
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"expected Variable, but hook returned '{type(result).__name__}'")
    name = _hook_name(fn)
    if (
        result.dtype != original.dtype
        or result.layout != original.layout
        or result.device.type != original.device.type
    ):
        raise RuntimeError(
            f"hook '{name}' has changed the type of value (was {_type_string(original)} "
            f"got {_type_string(result)})"
        )
    if result.shape != original.shape:
        raise RuntimeError(f"hook '{name}' has changed the size of value")


def _check_result(original: tuple, result: Any, fn: object) -> None:
    if not isinstance(result, tuple):
        raise TypeError(f"expected tuple, but hook returned '{type(result).__name__}'")
    if len(result) != len(original):
        raise RuntimeError(
            f"hook '{_hook_name(fn)}' has returned an incorrect number of values "
            f"(got {len(result)}, but expected {len(original)})"
        )
    for o, r in zip(original, result):
        _check_single_result(o, r, fn)


def tensor_pre_hook(fns: Iterable[Callable], value: Any) -> Any:
    """PyFunctionTensorPreHook: each hook sees the gradient of one input and may replace it."""
    for fn in fns:
        result = fn(value)
        if result is None or result is value:
            continue
        _check_single_result(value, result, fn)
        value = result
    return value


def pre_hook(fns: Iterable[Callable], inputs: list) -> list:
    """PyFunctionPreHook (grad_fn.register_prehook): hooks see and may replace all inputs."""
    values = tuple(inputs)
    for fn in fns:
        result = fn(values)
        if result is None or result is values:
            continue
        _check_result(values, result, fn)
        values = result
    return list(values)


def post_hook(fns: Iterable[Callable], outputs: tuple, inputs: list) -> tuple:
    """PyFunctionPostHook (grad_fn.register_hook): hook(grad_inputs, grad_outputs)."""
    values = tuple(outputs)
    grad_outputs = tuple(inputs)
    for fn in fns:
        result = fn(values, grad_outputs)
        if result is None or result is values:
            continue
        _check_result(values, result, fn)
        values = result
    return values


def _live(fns: dict) -> Iterator[Callable]:
    """The callables of a Python hook's dict as the engine calls them (``PyDict_Next`` over
    the live dict): those an earlier hook removed are not called, those it added to this
    dict are."""
    for key in list(fns):
        if key in fns:
            yield fns[key]


def _outside(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` outside the graph (a graph break: Dynamo neither traces it nor guards on
    what it touches), seeing the effects of the steps before it as in the engine, and
    the hook's dict as it is now (see :func:`hook_arguments`)."""

    @torch._dynamo.disable
    @functools.wraps(hook)
    def call(deferred: list, fns: HookDict, *args: Any) -> Any:
        _flush(deferred)
        return hook(_live(fns.dict), *args)

    return call


class HookDict:
    """A hook's dict as a replay argument out of the graph: Dynamo guards on a dict's keys
    (handle ids, new whenever a hook is registered on a new tensor) even when it only passes
    the dict on to a graph break; behind an object it only checks the type."""

    __slots__ = ("dict",)

    def __init__(self, fns: dict) -> None:
        self.dict = fns


def hook_arguments(dicts: list[dict], in_graph: bool) -> list:
    """The ``hooks`` argument of a replay from the plan's hook dicts.

    Out of the graph (and uncompiled), hooks read their dict when the replay reaches them,
    as the engine does. Traced into the graph they get its callables as they are now: a
    dict would make Dynamo guard on its keys, the handle ids, which are new whenever a hook
    is registered on a new tensor (every iteration of a training loop), so every call would
    recompile.
    """
    if in_graph:
        return [list(d.values()) for d in dicts]
    return [HookDict(d) for d in dicts]


tensor_pre_hook_outside = _outside(tensor_pre_hook)
pre_hook_outside = _outside(pre_hook)
post_hook_outside = _outside(post_hook)


# ---- input buffers -----------------------------------------------------------------------


def buffer_sum(*grads: Any) -> Any:
    """InputBuffer::add over gradients in arrival order (undefined ones are skipped)."""
    total = None
    for g in grads:
        if g is None:
            continue
        if total is None:
            total = g
        elif total.is_sparse and not g.is_sparse:
            # accumulate(): a dense gradient absorbs a sparse one, not the other way round.
            total = g + total
        else:
            total = total + g
    return total


# ---- code generation ---------------------------------------------------------------------


@dataclass(frozen=True)
class Replay:
    """A replay function and the source it was generated from."""

    fn: Callable[[tuple, list, list, list], list]
    source: str


_RUNTIME = {
    "apply_traced": apply_traced,
    "apply_opaque": apply_opaque,
    "apply_accumulate": apply_accumulate,
    "cpp_pre_hook": cpp_pre_hook,
    "cpp_post_hook": cpp_post_hook,
    "tensor_pre_hook": tensor_pre_hook,
    "pre_hook": pre_hook,
    "post_hook": post_hook,
    "tensor_pre_hook_outside": tensor_pre_hook_outside,
    "pre_hook_outside": pre_hook_outside,
    "post_hook_outside": post_hook_outside,
    "buffer_sum": buffer_sum,
}


def generate_source(
    plan: _core.Plan, hooks_in_graph: bool = True, opaque: frozenset[int] = frozenset()
) -> str:
    """Straight-line source for ``replay(grads, saved, hooks, deferred) -> captured``.

    The replay appends the values of the plan's deferred effects to ``deferred`` as it
    reaches them, so that after an error the caller can still apply those that came
    before it, as the engine would have.

    ``hooks_in_graph=False`` calls Python hooks outside the graph (``*_outside``: graph
    breaks under Dynamo), after the deferred effects before them, as everything else
    that runs outside the graph does. Traced steps in ``opaque`` run as opaque ones.
    """
    where, arg = ("", "") if hooks_in_graph else ("_outside", "deferred, ")
    steps = plan.steps()
    effects = {(step, pos) for step, _kind, pos in plan.deferred()}
    dying = _dying_after(steps)

    out = ["def replay(grads, saved, hooks, deferred):"]
    out.append(f"    captured = [None] * {plan.num_captures}")
    python_hook = 0
    for s, step in enumerate(steps):
        name, _kind, mode, seq, _inputs, _outputs, a, b, slots, _targets, hooks, captures = step
        out.append(f"    # step {s}: {name} (sequence_nr {seq}, {mode})")
        out.append(f"    i = [{', '.join(_slot_expr(srcs) for srcs in slots)}]")
        if mode != "skipped":
            # evaluate_function captures a needed node's inputs as they arrived.
            out.extend(f"    captured[{k}] = i[{j}]" for j, k in captures)
        # engine.cpp call_function: tensor pre-hooks and retains_grad hooks, pre-hooks,
        # apply (with validate_outputs), post-hooks.
        post = []
        for pos, (hook_kind, index, python, value_idx) in enumerate(hooks):
            if hook_kind == "post":
                post.append((pos, python, python_hook if python else None))
                python_hook += python
            elif hook_kind == "retains_grad":
                assert (s, pos) in effects
                out.append(f"    deferred.append(i[{index}])")
            elif python and hook_kind == "tensor_pre":
                v, h = value_idx, python_hook
                out.append(f"    i[{v}] = tensor_pre_hook{where}({arg}hooks[{h}], i[{v}])")
                python_hook += 1
            elif python:
                out.append(f"    i = pre_hook{where}({arg}hooks[{python_hook}], i)")
                python_hook += 1
            else:
                out.append(f"    i = cpp_pre_hook(deferred, {s}, {pos}, i)")
        if mode == "traced" and s in opaque:
            mode = "opaque"
        if mode == "traced":
            out.append(f"    o{s} = apply_traced({s}, i, saved[{a}:{b}])")
        elif mode == "opaque":
            out.append(f"    o{s} = apply_opaque(deferred, {s}, i)")
        elif mode == "eager_accumulate":
            # The engine moves the gradient into AccumulateGrad: drop the outputs that held
            # it first, so that nothing but `i` (kept for post hooks) still does.
            producers = [p for p in dying.get(s, ()) if p != s and _has_outputs(steps[p])]
            dying[s] = [p for p in dying.get(s, ()) if p not in producers]
            if producers:
                out.append(f"    del {', '.join(f'o{p}' for p in producers)}")
            out.append(f"    o{s} = apply_accumulate(deferred, {s}, i, {not post})")
        elif mode == "deferred_accumulate":
            assert (s, -1) in effects
            out.append("    deferred.append(i[0])")
        elif mode == "skipped":
            # Not needed: popped only to run its tensor pre-hooks and take its captures.
            out.extend(f"    captured[{k}] = i[{j}]" for j, k in captures)
        else:
            raise AssertionError(f"unknown step mode {mode!r}")
        for pos, python, h in post:
            if python:
                out.append(f"    o{s} = post_hook{where}({arg}hooks[{h}], o{s}, i)")
            else:
                out.append(f"    o{s} = cpp_post_hook(deferred, {s}, {pos}, o{s}, i)")
        # Drop gradients once their last consumer ran, as the engine's buffers do.
        dead = [f"o{p}" for p in dying.get(s, ()) if _has_outputs(steps[p])]
        if dead:
            out.append(f"    del {', '.join(dead)}")
    out.append("    return captured")
    return "\n".join(out) + "\n"


def _has_outputs(step: tuple) -> bool:
    return step[2] in ("traced", "opaque", "eager_accumulate")


def _slot_expr(sources: list[tuple[int, int]]) -> str:
    terms = [f"grads[{i}]" if step < 0 else f"o{step}[{i}]" for step, i in sources]
    if not terms:
        return "None"
    if len(terms) == 1:
        return terms[0]
    return f"buffer_sum({', '.join(terms)})"


def _dying_after(steps: list) -> dict[int, list[int]]:
    """For each step, the steps whose outputs it is the last to read."""
    last: dict[int, int] = {}
    for s, step in enumerate(steps):
        last.setdefault(s, s)
        for sources in step[8]:
            for src, _ in sources:
                if src >= 0:
                    last[src] = max(last.get(src, s), s)
    dying: dict[int, list[int]] = {}
    for producer, consumer in sorted(last.items()):
        dying.setdefault(consumer, []).append(producer)
    return dying


def build(
    plan: _core.Plan, hooks_in_graph: bool = True, opaque: frozenset[int] = frozenset()
) -> Replay:
    """Generates and executes the replay source of ``plan`` (see :func:`generate_source`)."""
    source = generate_source(plan, hooks_in_graph, opaque)
    namespace: dict[str, Any] = dict(_RUNTIME)
    code = compile(source, f"<replaygrad replay {plan.key[:12]}>", "exec")
    exec(code, namespace)
    return Replay(fn=namespace["replay"], source=source)
