"""The replay: a straight-line Python function, generated from a plan, that runs the backward
the way torch/csrc/autograd/engine.cpp does, one statement block per engine step.

A replay depends only on the plan's structure (its key). Everything that changes from one
backward call to the next is an argument: the root gradients, the saved values, the sizes
torch's nodes keep (lifted out of the key), the hook callables. Nodes are reached through
the plan being run (``current_plan``), by step number, inside functions Dynamo does not
trace, so a compiled replay carries no guard on this iteration's graph and is reused
across iterations.

A replay is a driver that calls one or more regions, each a function over a range of steps
that is compiled on its own. Regions name steps relative to their first one (the driver
sets where it is, :func:`at`), so a large graph of repeated structure (layers, unrolled
steps, a long chain) is split into regions with the same source, compiled once.
"""

from __future__ import annotations

import bisect
import contextlib
import dis
import functools
import hashlib
import inspect
import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from types import CodeType, FunctionType, SimpleNamespace
from typing import Any, NoReturn

import torch
from torch._dynamo.comptime import comptime
from torch._dynamo.external_utils import FakeBackwardCFunction
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from . import _core

_tls = threading.local()


class _UserCode:
    """Whether user code (a Python hook, a Function's backward) of a replay call ran: set by
    the functions that call it in compiled regions, a store that Dynamo replays after the
    graph (or right away where the code runs as Python), so that it tells also where code
    traced into a graph ran before a graph break, then a later part of the region failed to
    compile (see :meth:`running.can_restart`). One for all threads: cleared where a call
    starts with no other replay running."""

    ran = False


_USER_CODE = _UserCode()

#: Replays running, on all threads (see :class:`_UserCode`).
_active = [0]
_active_lock = threading.Lock()


class running:
    """The replay of ``plan`` running on this thread (nested replays, e.g. a backward
    called by a hook, stack).

    Deferred effects: each region appends the values of those it reaches to a list of its
    own (Dynamo guards on the length of a list argument, so every region gets an empty
    one, see :func:`at`); the lists are gathered in ``pending``, in engine order, and
    performed before anything outside the graph runs and at the end (by the caller).
    """

    def __init__(self, plan: _core.Plan, pending: list) -> None:
        self.plan = plan
        self.pending = pending
        #: The running region's list of deferred values.
        self.local: list = []
        #: Step ``k`` of the running region is step ``base + k`` of the plan.
        self.base = 0
        #: Nothing of this call has been seen outside the compiled graphs yet (no effect
        #: applied, no hook or graph break run), so a failed compile can start it over.
        self.restartable = True
        #: The latest step seen running (outside compiled code, or a region's start): the
        #: steps before it ran, and the engine would have released their saved variables.
        self.reached = 0
        #: The steps where the replay runs something outside the graph (see
        #: :func:`outside_steps`).
        self.breaks: Sequence[int] = ()
        #: The step whose Python code (hooks, a Function's backward, post-accumulate-grad
        #: hooks) runs outside compiled code now, if one does (see
        #: :func:`current_autograd_node`).
        self.current: int | None = None
        self.outer: Any = None
        #: Code traced into a compiled graph (a hook) asked for the current autograd node.
        self.asked_node = False
        #: Traced steps whose formula made sizes that depend on data (see
        #: :data:`_DATA_DEPENDENT`), which Dynamo ran outside the graph.
        self.data_dependent: set[int] = set()
        #: The step of the Function's backward Dynamo traces (see :func:`_tracing_backward`).
        self.tracing_backward: int | None = None

    def __enter__(self) -> running:
        self.prior = getattr(_tls, "run", None)
        with _active_lock:
            if _active[0] == 0:
                _USER_CODE.ran = False
            _active[0] += 1
        self.base = 0
        self.restartable = True
        self.reached = 0
        self.current = None
        self.tracing_backward = None
        #: The node the engine was evaluating when the replay started (see
        #: :func:`current_autograd_node`).
        self.outer = _engine_current_node()
        _tls.run = self
        return self

    def __exit__(self, *exc: object) -> None:
        self.pending.extend(self.local)
        self.local = []
        _tls.run = self.prior
        with _active_lock:
            _active[0] -= 1

    def can_restart(self) -> bool:
        """Whether the call can start over: nothing of it was seen outside the compiled
        graphs (``restartable``) and no user code traced into them ran (see
        :class:`_UserCode`)."""
        return self.restartable and not _USER_CODE.ran


def _running() -> running:
    run = getattr(_tls, "run", None)
    if run is None:
        raise RuntimeError("replaygrad: a replay step ran outside of a replay")
    return run


def replaying() -> bool:
    """Whether a replay runs on this thread."""
    return getattr(_tls, "run", None) is not None


def current_plan() -> _core.Plan:
    """The plan whose replay is running on this thread."""
    return _running().plan


def _step(k: int) -> int:
    """Step ``k`` of the running region as a step of the plan, noted as reached."""
    run = _running()
    run.reached = run.base + k
    return run.reached


_engine_current_node = torch._C._current_autograd_node


@torch._dynamo.disable
def current_autograd_node() -> Any:
    """``torch._C._current_autograd_node()`` while replaygrad is installed. The engine sets
    the node it evaluates around the node's hooks and function; in a replay this is the node
    of the step whose node, hooks or accumulation run outside compiled code, else None (code
    traced into a compiled graph). A backward the engine runs inside a replay (e.g. called by
    a hook) has its own nodes, and a replay started by a node the engine evaluates (e.g. a
    custom Function's backward calling ``autograd.grad``) sets its own."""
    node = _engine_current_node()
    run = getattr(_tls, "run", None)
    if run is None or (node is not None and node is not run.outer):
        return node
    if run.current is not None:
        return run.plan.node_object(run.current)
    # Code traced into the graph: at run time (a graph break, this being Dynamo-disabled), or
    # while traced (where Dynamo's rules for torch's functions took this one for torch's,
    # having seen it in torch._C while replaygrad was installed). Later calls run the hooks
    # outside the graph.
    run.asked_node = True
    return None


#: Names through which a hook can ask for the current node (see traced_hooks_concern).
_CURRENT_NODE = frozenset({"_current_autograd_node"})

#: Names through which a hook can see the effects of earlier steps (see
#: traced_hooks_concern).
_EFFECT_NAMES = frozenset({"grad", "backward"})

#: The prefixes of a node's attributes for its saved values (``_saved_self``,
#: ``_raw_saved_self``), which the engine releases once the node ran (see
#: traced_hooks_concern).
_SAVED = ("_saved_", "_raw_saved_")

#: Names through which a hook can change hooks for later nodes of the backward it runs in.
_HOOK_EDITS = frozenset(
    {
        "register_hook",
        "register_prehook",
        "register_post_accumulate_grad_hook",
        "register_multi_grad_hook",
        "retain_grad",
        "remove",
    }
)


def may_edit_hooks(hooks: list) -> bool:
    """Whether a Python hook of ``hooks`` (lists of callables) may register or remove hooks
    (or call ``retain_grad``) while it runs: it names one of the methods that do
    (``remove``: a handle's; see :func:`_hook_names`). A compiled replay's traced steps
    call the hooks their nodes had when the call was planned, so a first call with such a
    hook runs uncompiled (see ``_replay``)."""
    return not _HOOK_EDITS.isdisjoint(_hook_names(hooks))


def traced_hooks_concern(hooks: list) -> str | None:
    """What keeps a Python hook of ``hooks`` (lists of callables) from being traced into
    the graph, if anything (see :func:`_hook_names`): ``"node"``, it may call
    ``torch._C._current_autograd_node()``, which only code outside the graph gets;
    ``"effects"``, it may read or write a tensor's ``.grad``, run a backward, or read a
    node's saved values (``_saved_self``). Traced, it would see ``.grad`` as it was when the
    graph started (accumulations and ``retain_grad``'s values are applied after it, or at a
    graph break), and a backward of its own through nodes that ran, or a look at their saved
    values, would find them still there; outside the graph it sees what the engine would
    have done by then."""
    return _concern(_hook_names(hooks))


def _concern(names: frozenset[str]) -> str | None:
    """:func:`traced_hooks_concern` of code that uses ``names`` (see :func:`_hook_names`)."""
    if not _CURRENT_NODE.isdisjoint(names):
        return "node"
    if not _EFFECT_NAMES.isdisjoint(names) or any(n.startswith(_SAVED) for n in names):
        return "effects"
    return None


def _hook_names(hooks: list) -> frozenset[str]:
    """The names (attributes and globals) that the code of the callables of ``hooks``
    (lists of callables) uses, or the code of a function defined in one or reached from it
    by a global name or a closure variable (two calls deep; not into torch's own
    functions)."""
    return frozenset().union(*(_reached(fn, 2) for fns in hooks for fn in fns))


def _reached(fn: object, depth: int) -> frozenset[str]:
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)  # a bound method's function
    if not isinstance(fn, FunctionType):
        fn = inspect.getattr_static(type(fn), "__call__", None)  # a callable object's method
        if not isinstance(fn, FunctionType):
            return frozenset()
    names = _code_reached(fn, depth)
    if depth > 0 and fn.__closure__:
        cells = [cell.cell_contents for cell in fn.__closure__ if _filled(cell)]
        names = names.union(*(_reached(c, depth - 1) for c in cells if _followed(c, fn)))
    return names


#: By code object id: the code object (kept alive, so that its id stays its own) and the
#: names reached from it by depth (see :func:`_code_reached`).
_CODE_REACHED: dict[int, tuple[CodeType, dict[int, frozenset[str]]]] = {}


#: The opcodes that set or delete an attribute (one byte each, at the even offsets of
#: ``co_code``).
_SETS_ATTRIBUTES = frozenset({dis.opmap["STORE_ATTR"], dis.opmap["DELETE_ATTR"]})
_SETS_ITEMS = frozenset({dis.opmap["STORE_SUBSCR"], dis.opmap["DELETE_SUBSCR"]})
_TORCH = os.path.dirname(torch.__file__) + os.sep

#: The names :func:`_code_reached` gives code that writes into tensors (maybe): besides
#: in-place methods (``mul_``), see :func:`traced_functions`.
_WRITES = frozenset({"<sets items>", "<out=>"})


def _code_reached(fn: FunctionType, depth: int) -> frozenset[str]:
    """The names ``fn``'s code and the code defined in it use as attributes or globals, and
    those reached from the functions its globals name, ``depth`` calls deep; kept by code
    object (a code object's functions share their module's globals). Code that sets or
    deletes an attribute adds the name ``"<sets attributes>"``, an item ``"<sets items>"``,
    code that passes a keyword argument ``out`` ``"<out=>"``."""
    code = fn.__code__
    entry = _CODE_REACHED.get(id(code))
    if entry is None:
        if len(_CODE_REACHED) >= 4096:
            _CODE_REACHED.clear()
        entry = _CODE_REACHED[id(code)] = (code, {})
    known = entry[1]
    names = known.get(depth)
    if names is None:
        found: set[str] = set()
        codes = [code]
        while codes:
            c = codes.pop()
            found.update(c.co_names)
            opcodes = c.co_code[::2]
            if not _SETS_ATTRIBUTES.isdisjoint(opcodes) and not c.co_filename.startswith(_TORCH):
                found.add("<sets attributes>")  # (torch's own, e.g. once_differentiable's: not)
            if not _SETS_ITEMS.isdisjoint(opcodes):
                found.add("<sets items>")
            if any(isinstance(k, tuple) and "out" in k for k in c.co_consts):
                found.add("<out=>")  # the names of a call's keyword arguments
            codes.extend(k for k in c.co_consts if isinstance(k, CodeType))
        names = frozenset(found)
        if depth > 0:
            callees = [fn.__globals__.get(name) for name in names]
            names = names.union(*(_reached(c, depth - 1) for c in callees if _followed(c, fn)))
        known[depth] = names
    return names


def _followed(callee: object, caller: FunctionType) -> bool:
    """Whether the look at a hook's code follows a call of ``callee`` from ``caller``: a
    function, not one of torch's own, nor the caller itself."""
    return (
        isinstance(callee, FunctionType)
        and callee is not caller
        and not (callee.__module__ or "").startswith("torch")
    )


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def at(base: int, hooks_ran: bool = False) -> list:
    """The driver, before a region: the region's step ``k`` is the plan's ``base + k``;
    returns the region's (empty) list of deferred values. ``hooks_ran``: the region before
    called Python hooks in its graph."""
    run = _running()
    if hooks_ran:
        run.restartable = False
    run.pending.extend(run.local)
    run.base = run.reached = base
    run.local = []
    return run.local


# ---- steps the replay calls --------------------------------------------------------------


@torch._dynamo.allow_in_graph
@torch._dynamo.disable
def apply_traced(step: int, inputs: list, saved: list, sizes: list | None = None) -> tuple:
    """A traced step: the current plan's node, called with ``saved`` swapped in.

    In the graph, Dynamo does not look inside (so no guard on the node); AOTAutograd and
    the eager backend call it with the values being traced or run. Where it breaks Dynamo's
    graph (see :func:`_outside_the_graph`), Dynamo calls it as Python, and does not compile
    its frame (whose ints, e.g. ``step``, would be symbolic under dynamic shapes, breaking
    the graph again at each use). ``sizes``: the step's
    lifted sizes (see ``Plan.size_ranges``), replay inputs like the saved values; traced
    with dynamic shapes they are symbolic, and the node runs with them in place of its own.
    """
    tracing = torch._guards.TracingContext.try_get() is not None
    run = _running()
    # Only a step run for real is reached (tracing runs a region's steps before any runs).
    # Traced in a resume function after a graph break, `step` can be a SymInt.
    plan_step = int(run.base + step) if tracing else _step(step)
    function = not tracing and run.plan.kind(plan_step) == "python_function"
    dynamo_run = tracing and _dynamo_fake_run()
    # Dynamo's run of the step may break its graph there (not under fullgraph=True).
    may_break = dynamo_run and _graph_breaks_allowed()
    try:
        if tracing:
            with _internal_unbacked_sizes() if dynamo_run else contextlib.nullcontext():
                outputs = _apply(run.plan, plan_step, inputs, saved, sizes, may_break)
        elif function:
            # Run for real, a Python Function's backward gets the tensors it saved, the very
            # objects (ctx.saved_tensors), as in eager, not the replay's values (detached
            # where a view or a subclass). It is code outside the graph: the call cannot
            # start over after it.
            run.restartable = False
            run.current = plan_step
            try:
                outputs = run.plan.apply(plan_step, inputs, live=True)
            finally:
                run.current = None
        else:
            outputs = run.plan.apply(plan_step, inputs, saved, live=True)
    except Exception as error:
        if not isinstance(error, _TRACING_LIMITS):
            error.__replaygrad_node_error__ = True  # type: ignore[attr-defined]
            if tracing:
                # Raised on the values being traced, before anything ran: see traced_step.
                error.__replaygrad_traced_step__ = plan_step  # type: ignore[attr-defined]
        elif tracing and isinstance(error, _DATA_DEPENDENT):
            run.data_dependent.add(plan_step)
            if isinstance(error, GuardOnDataDependentSymNode) and may_break:
                # A branch on a size only known at run time (while Dynamo captures ops
                # whose output sizes depend on data): Dynamo would fail the compile.
                _outside_the_graph("data-dependent branch in a backward formula", plan_step, error)
        raise
    if function:
        # Its backward is user code: it may modify in place a tensor a later step saved,
        # which the engine finds when that step unpacks it.
        _check_saved(plan_step, own=False)
    first = next((o for o in outputs if o is not None), None)
    if isinstance(first, FakeTensor):
        _note_layouts(step, inputs, saved, outputs)
        if all(i is None for i in inputs) and run.plan.kind(plan_step) == "generic":
            # No gradient arrived: torch's nodes then return none, some only through their
            # kernel's check (flash attention's backward), whose fake implementation makes
            # tensors anyway; traced as such, the compiled graph would use tensors that
            # are undefined at run time. (A Python Function may materialize zeros.)
            return (None,) * len(outputs)
    return outputs


def apply_uncompiled(step: int, inputs: list, saved: list, sizes: list | None = None) -> tuple:
    """:func:`apply_traced` in a replay that runs as Python (no compiler traces it): the
    node runs for real with ``saved`` swapped in (its sizes are its own)."""
    run = _running()
    plan_step = _step(step)
    plan = run.plan
    if plan.kind(plan_step) == "python_function":
        return apply_traced(step, inputs, saved, sizes)
    try:
        # Only code outside the graph can have registered hooks since the call was planned
        # (such code makes the call not restartable), and a node of torch's registers none.
        if run.restartable:
            return plan.apply(plan_step, inputs, saved)
        if not plan.has_new_hooks(plan_step):
            return plan.apply(plan_step, inputs, saved, live=True)
        # Hooks registered on the node during this backward run with it: code outside the
        # graph, which sees what the engine did before (accumulations, the current node).
        with _outside_graph(run.local, step):
            outputs = plan.apply(plan_step, inputs, saved, live=True)
    except Exception as error:
        error.__replaygrad_node_error__ = True  # type: ignore[attr-defined]
        raise
    _check_saved(plan_step, own=False)
    return outputs


def _apply(
    plan: _core.Plan, step: int, inputs: list, saved: list, sizes: list | None, may_break: bool
) -> tuple:
    """A traced step run on the values being traced; ``may_break``: see
    :func:`_apply_symbolic`."""
    if sizes is not None and any(isinstance(v, torch.SymInt) for v in sizes):
        return _apply_symbolic(plan, step, inputs, saved, sizes, may_break)
    return plan.apply(step, inputs, saved)


def _dynamo_fake_run() -> bool:
    """Whether a traced step runs for Dynamo, which runs it on fake tensors for the
    metadata of its outputs (and AOTAutograd then runs it functionalized to collect the
    graph's metadata, and traces it into ATen ops under a proxy mode)."""
    mode = torch._C._get_dispatch_mode
    key = torch._C._TorchDispatchModeKey
    return mode(key.PROXY) is None and mode(key.FUNCTIONAL) is None


def _graph_breaks_allowed() -> bool:
    """Whether the frame Dynamo is tracing may break its graph (not under
    ``fullgraph=True``)."""
    tx = getattr(torch._dynamo.symbolic_convert.tls, "current_tx", None)
    return tx is None or not (tx.one_graph or getattr(tx, "error_on_graph_break", False))


def _internal_unbacked_sizes() -> contextlib.AbstractContextManager[None]:
    """For Dynamo's run of a step: sizes only known at run time that the step's formula
    makes (``aten.nonzero`` of a mask, when Dynamo captures such ops) stay inside it (a
    gradient has the shape of its node's input), so Dynamo is not to look for them in its
    outputs. (AOTAutograd, tracing the formula's ATen ops, binds them where they are made.)"""
    mode = torch._guards.detect_fake_mode()
    shape_env = getattr(mode, "shape_env", None)
    if shape_env is None:
        return contextlib.nullcontext()
    return shape_env.ignore_fresh_unbacked_symbols()


def apply_function(
    deferred: list, step: int, inputs: list, saved: list, sizes: list | None = None
) -> tuple:
    """A traced Python Function's step (``is_traceable = True``). Its backward is user code:
    given a gradient with elements sharing memory (see :func:`_overlapping`), where eager
    raises on in-place ops (``mul_``) or writes every alias (``fill_``), it runs as itself,
    outside the graph, as hooks given one do. Decided while tracing."""
    if _overlapping(inputs):
        return apply_opaque(deferred, step, inputs, False)
    return apply_traced(step, inputs, saved, sizes)


class FunctionState:
    """What the backward of a Python Function traced by Dynamo (see :func:`traced_functions`)
    sees of its ctx besides its saved tensors: the attributes its forward set (plain values,
    which the plan's key holds), ``needs_input_grad`` and the Function's class. Taken from
    the node's ctx when the replay is built and shared by the regions of its key; it keeps
    no tensor and no graph alive."""

    def __init__(self, ctx: Any, passes_none: Sequence[bool]) -> None:
        self.__dict__.update(vars(ctx))
        self._forward_cls = ctx._forward_cls
        self.needs_input_grad = ctx.needs_input_grad
        #: Per input: the engine hands the backward None for a missing gradient there.
        self._replaygrad_passes_none = tuple(passes_none)


def function_backward(
    deferred: list,
    step: int,
    state: FunctionState,
    inputs: list,
    saved: list,
    writes: bool,
    sizes: list | None = None,
) -> tuple:
    """A Python Function's step whose backward Dynamo traces (see :func:`traced_functions`):
    its backward called as the engine's PyNode::apply calls it, on a ctx that gives
    ``saved`` as ``saved_tensors`` and ``state`` for the rest (as torch's compiled autograd
    calls it), and its result checked and cast as PyNode::apply and validate_outputs do
    (see :func:`function_outputs`; ``sizes``: the step's lifted sizes). Given a missing
    gradient where the engine would materialize zeros (not where it passes None, see
    ``FunctionState``), or one with elements sharing memory (see :func:`_overlapping`)
    where the backward may write in place (``writes``), decided while tracing, the node
    runs as itself instead, outside the graph."""
    nones = state._replaygrad_passes_none
    missing = any(g is None and not none for g, none in zip(inputs, nones))
    if missing or (writes and _overlapping(inputs)):
        return apply_opaque(deferred, step, inputs, False)
    _USER_CODE.ran = True
    comptime(_tracing_backward)
    ctx = FakeBackwardCFunction(state, tuple(saved))
    result = state._forward_cls.backward(ctx, *inputs)
    comptime(_traced_backward)
    return function_outputs(step, result, sizes)


class BackwardBrokeGraph(Exception):
    """Dynamo broke the graph in a traced Function's backward (see
    :func:`_tracing_backward`): the call starts over with that step run as itself."""


def _tracing_backward(ctx: Any) -> None:
    """While Dynamo traces a Function's backward in :func:`function_backward` (a no-op
    otherwise): notes its step, until :func:`_traced_backward`. A step still noted when
    Dynamo gets here again broke the graph in its backward (Dynamo then traces the frame
    again up to the break, and the rest of the call as frames of their own, each compiled
    at a cost, and run so every call): while the call can start over, that is raised (see
    :func:`traced_step`), and the call starts over with the step run as itself. (Later,
    :func:`broken_functions` finds it once the call is done.) Where Dynamo traces the
    backward as a frame of its own, the region's part before it has run: where that part
    called a Python hook or another traced backward, whose side effects would happen again,
    the call goes on (see :func:`_region_traced` for where Dynamo traces the region
    again)."""
    run = _running()
    broken = run.tracing_backward
    step = ctx.get_local("step")
    # (A frame of its own, after a graph break, may take the step as a symbolic int.)
    value = step.as_python_constant() if step.is_python_constant() else step.as_fake().node.hint
    run.tracing_backward = run.base + int(value)
    if broken is not None and run.can_restart():
        _broke_graph(broken)


def _traced_backward(ctx: Any) -> None:
    """See :func:`_tracing_backward`."""
    _running().tracing_backward = None


def _region_traced(ctx: Any) -> None:
    """While Dynamo traces a region with traced Functions, at its start (a no-op otherwise):
    a step still noted by :func:`_tracing_backward` broke the graph in its backward in the
    trace Dynamo then starts over (it traces the frame again, to break the graph before the
    call). Raised there, before any of the region ran (a hook traced into the graph before
    the break would run, then again when the call starts over); see
    :func:`_tracing_backward`."""
    run = _running()
    broken = run.tracing_backward
    if broken is not None and run.can_restart():
        _broke_graph(broken)


def _broke_graph(step: int) -> NoReturn:
    error = BackwardBrokeGraph(f"step {step}")
    error.__replaygrad_node_error__ = True  # type: ignore[attr-defined]
    error.__replaygrad_traced_step__ = step  # type: ignore[attr-defined]
    raise error


def _symbolic(values: Iterable[Any]) -> bool:
    """Whether a tensor of ``values`` has symbolic sizes (traced with dynamic shapes; not
    in code Dynamo traces, where a SymInt is an int)."""
    return any(
        isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)
        for v in values
    )


@torch._dynamo.allow_in_graph
@torch._dynamo.disable
def function_outputs(step: int, result: Any, sizes: list | None = None) -> tuple:
    """The gradients a Python Function's step hands on, made of ``result``, what its backward
    returned, validated against the shapes of the step's lifted ``sizes`` (see
    ``Plan.function_outputs``): raises the engine's error, while traced too (so that the
    step then runs as itself and raises where the engine would, see :func:`traced_step`).
    Without lifted sizes (a nested tensor's metadata) and given symbolic ones, Dynamo runs
    it outside the graph (where it may break the graph): the key keeps no size of a
    Function's node (see ``traced_functions``), and validate_outputs would fix the sizes to
    the node's."""
    tracing = torch._guards.TracingContext.try_get() is not None
    run = _running()
    plan_step = int(run.base + step) if tracing else _step(step)
    values = result if isinstance(result, tuple) else (result,)
    fixed = sizes is None and tracing and _symbolic(values)
    if fixed and _dynamo_fake_run() and _graph_breaks_allowed():
        _outside_the_graph("validate_outputs of a Function's gradients with symbolic sizes", step)
    try:
        return run.plan.function_outputs(plan_step, result, sizes)
    except Exception as error:
        error.__replaygrad_node_error__ = True  # type: ignore[attr-defined]
        if tracing:
            error.__replaygrad_traced_step__ = plan_step  # type: ignore[attr-defined]
        raise


def _function_backward_copy(n: int, scope: dict[str, Any]) -> FunctionType:
    """:func:`function_backward` for the ``n``-th traced Function of a region whose globals
    are ``scope``, with a code object of its own. Dynamo keeps what it compiles on the code
    object: where it breaks the graph in a backward, it compiles the rest of the call as a
    frame of this code (and its resume functions, put in ``scope``), which then tells which
    step broke (see :func:`broken_functions`), is compiled for that step alone, and is
    dropped with the region (see ``_compile._forget_compiled``). (One function for all would
    be compiled anew for each step and Function, up to Dynamo's recompile limit.)"""
    code = function_backward.__code__.replace(co_name=f"backward_{n}")
    copy = FunctionType(code, scope, f"backward_{n}", function_backward.__defaults__)
    copy.__kwdefaults__ = function_backward.__kwdefaults__
    return copy


def broken_functions(replay: Replay, cache_entries: Callable[[CodeType], list]) -> set[int]:
    """The steps of ``replay``'s Python Functions whose backward broke Dynamo's graph while
    compiled (their copy of :func:`function_backward` has compiled code of its own, see
    :func:`_function_backward_copy`; ``cache_entries`` lists a code object's): each then
    costs a frame of its own a call (and its first call a compile per frame), more than
    running it as itself between regions. Regions alike share their copies."""
    namespace = replay.fn.__globals__
    broken = set()
    for r, region in enumerate(replay.regions):
        scope = getattr(namespace.get(f"R{r}"), "scope", None)
        for n, step in enumerate(region.function_steps):
            copy = scope.get(f"backward_{n}") if scope is not None else None
            if copy is not None and cache_entries(copy.__code__):
                broken.add(step)
    return broken


def alike_functions(plan: _core.Plan, replay: Replay, steps: set[int]) -> set[int]:
    """``steps`` and the steps of ``replay``'s traced Functions of the same classes (whose
    backward breaks Dynamo's graph alike)."""
    classes = {plan.node_object(s)._forward_cls for s in steps}
    return steps | {s for s in replay.functions if plan.node_object(s)._forward_cls in classes}


def _apply_symbolic(
    plan: _core.Plan, step: int, inputs: list, saved: list, sizes: list, may_break: bool
) -> tuple:
    """A traced step of torch's run with symbolic lifted sizes; ``may_break``: Dynamo runs
    it and may break its graph there.

    Where the node's formula fails on them (a kernel whose fake implementation takes no
    symbolic sizes, e.g. upsampling's backward), Dynamo runs the step outside the graph (a
    graph break in the graph with dynamic sizes, which serves every size; the error of a
    node that fails for real is raised there). Where no graph break is allowed
    (``fullgraph=True``) or the step is traced another way (a compiler that does not go
    through Dynamo), it is traced with the sizes it keeps instead, the symbolic ones
    specialised to those (guarded), and later plans keep the sizes of nodes of its type in
    their key.

    A formula whose output sizes depend on data (e.g. indexing with a boolean mask:
    ``aten.nonzero``) fails on fake tensors whatever the sizes: that is raised as it is,
    and Dynamo runs the step outside the graph, as with static sizes (so a mask selecting
    another count each call needs no new replay).
    """
    log = logging.getLogger("torch._subclasses.fake_tensor")
    quiet, log.disabled = log.disabled, True  # it logs the kernel's failure as an error
    free = _free_sizes(inputs, saved, sizes) if may_break else {}
    try:
        outputs = plan.apply(step, inputs, saved, sizes)
    except _DATA_DEPENDENT:
        raise
    except Exception as error:
        if may_break:
            _outside_the_graph("backward formula that takes no symbolic sizes", step, error)
        plan.mark_not_liftable(step)
        for v in sizes:
            int(v)  # guard_int: the compiled graph holds for these sizes only
        return plan.apply(step, inputs, saved)
    finally:
        log.disabled = quiet
    if free:
        constants = _structural_sizes(inputs)
        if any(_fixed(symbol, shape_env, constants) for symbol, shape_env in free.items()):
            # The formula fixed a size to its value now (e.g. masked_select's backward reads
            # plain sizes()): compiled, the graph would hold for that size only, and Dynamo
            # would compile it again for every other. Dynamo restarts the frame's analysis
            # (dropping those guards) with the step outside the graph.
            _outside_the_graph("backward formula that specialises symbolic sizes", step)
    return outputs


def _structural_sizes(inputs: list) -> set[int]:
    """Sizes a traced step's gradients fix by the graph's structure: their number (the
    node's inputs, part of the key: ``unbind``'s backward stacks one gradient per output)
    and their dims that are constants while sizes are symbolic (made so by an earlier step,
    e.g. the dim of that stack)."""
    sizes = {len(inputs)}
    for value in inputs:
        if isinstance(value, torch.Tensor):
            sizes.update(d for d in value.shape if type(d) is int)
    return sizes


def _fixed(symbol: Any, shape_env: Any, structural: set[int]) -> bool:
    """Whether a formula fixed ``symbol`` to a value other than 0, 1 and the ``structural``
    sizes of its step (see :func:`_structural_sizes`). Dynamo specialises 0 and 1 itself
    in tensor sizes; a formula tests them in strides and broadcasting (``mm_mat2_backward``
    asks whether the weight's stride is 1, which with ``dynamic=True`` is a symbol too, a
    lifted int), and a graph holding for them serves a training loop, whose layouts do not
    change. A size fixed to a structural one (a GRU's sequence length, met by the stack of
    its steps' gradients) cannot take another value in graphs of the same key. Either way
    the graph guards on the value: were it to change, Dynamo would compile again."""
    value = shape_env.replace(symbol)
    return bool(value.is_number) and int(value) not in {0, 1, *structural}


def _outside_the_graph(why: str, step: int, cause: BaseException | None = None) -> NoReturn:
    """Makes Dynamo, which is running traced step ``step``, break its graph there: the step
    runs as Python between two graphs."""
    kwargs = {} if cause is None else {"from_exc": cause}
    torch._dynamo.exc.unimplemented(
        gb_type=f"replaygrad: {why}",
        context=f"step {step}",
        explanation="the step runs outside the graph",
        hints=[],
        **kwargs,
    )


def _free_sizes(inputs: list, saved: list, sizes: list) -> dict:
    """The symbols of the sizes a step is traced with that are still free (not fixed to a
    value), each with its ShapeEnv."""
    values = [*sizes]
    for t in (*inputs, *saved):
        if isinstance(t, torch.Tensor):
            values.extend(t.shape)
    free = {}
    for v in values:
        if isinstance(v, torch.SymInt):
            shape_env = v.node.shape_env
            for symbol in v.node.expr.free_symbols:
                if not shape_env.replace(symbol).is_number:
                    free[symbol] = shape_env
    return free


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
                    noted.add(_running().base + step)
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


# What a formula raises on fake tensors when sizes depend on tensor data (e.g. indexing
# with a boolean mask: aten.nonzero). Dynamo runs such a step outside the graph; a replay
# that had one is compiled again capturing those ops (see ReplayCache.capture_data_dependent).
_DATA_DEPENDENT = (
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    GuardOnDataDependentSymNode,
)

# What a node raises when it is run on fake tensors it cannot handle: a limit of tracing,
# not an error of the backward itself.
_TRACING_LIMITS = (
    torch._dynamo.exc.TorchDynamoException,
    torch._subclasses.fake_tensor.DataDependentOutputException,
    torch._subclasses.fake_tensor.DynamicOutputShapeException,
    torch._subclasses.fake_tensor.UnsupportedOperatorException,
    torch._subclasses.fake_tensor.UnsupportedFakeTensorException,
    GuardOnDataDependentSymNode,
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


def traced_step(error: BaseException) -> int | None:
    """The step whose node raised ``error`` while a compiler traced it (on fake tensors),
    if it did. Such an error may be a limit of tracing (e.g. ``.numpy()`` in a custom
    Function's backward) or the backward's own; either way nothing of the call ran yet
    where it was raised, so the call can start over with that step run as itself, which
    raises where the engine would (after the steps before it) or succeeds."""
    raised = node_error(error)
    return getattr(raised, "__replaygrad_traced_step__", None) if raised is not None else None


class _outside_graph:
    """Code outside the graph (a hook, a node run as itself) running at the region's
    ``step``; entering gives the plan's step. Before it, what the engine has done by then is
    done: the deferred effects reached are performed (accumulations, retain_grads: the code
    may read ``.grad``) and, without retain_graph, the saved variables of the nodes that ran
    are released (it may reach them, e.g. ``grad_fn._saved_self``, or a backward through
    them, which raises as in eager). The call can no longer start over. While it runs, the
    step's node is the current autograd node (see :func:`current_autograd_node`). (A class:
    a generator's context manager costs 0.7 µs more, at every such step.)"""

    __slots__ = ("deferred", "run", "step")

    def __init__(self, deferred: list, step: int) -> None:
        self.deferred = deferred
        self.step = step

    def __enter__(self) -> int:
        run = self.run = _running()
        run.restartable = False
        plan_step = _step(self.step)
        for values in (run.pending, self.deferred):
            if values:
                run.plan.run_deferred(values, complete=False)
        run.plan.release_variables(plan_step)
        run.current = plan_step
        return plan_step

    def __exit__(self, *exc: object) -> None:
        self.run.current = None


def _check_saved(step: int, own: bool) -> None:
    """After something ran outside the graph at ``step`` (a hook, a node run as itself):
    raises what the engine would if it modified in place a value saved by a traced step
    that runs before the next such thing (``own``: from this step on, else from the next).

    The replay's saved values were unpacked, and version-checked, when the call was planned;
    the engine unpacks them when each node runs. Only code outside the graph can modify them
    in between (e.g. an optimizer step in a post-accumulate-grad hook, on a parameter also
    used detached); each saved value is checked once, after the last such code before it.
    """
    run = _running()
    i = bisect.bisect_right(run.breaks, step)
    last = run.breaks[i] if i < len(run.breaks) else run.plan.num_steps
    run.plan.check_saved_versions(step if own else step + 1, last)


def saved_checked(step: int) -> None:
    """The driver, after a region whose Python Function's backward at plan step ``step``,
    traced into its graph, may have written in place (see :func:`traced_functions`):
    raises what the engine would if it modified a value saved by a later traced step (as
    :func:`_check_saved` after code outside the graph). Compiled, the later steps ran on
    it all the same; the engine raises before they run."""
    _check_saved(step, own=False)


@torch._dynamo.disable
def apply_opaque(deferred: list, step: int, inputs: list, take: bool) -> tuple:
    """An opaque step: a graph break that runs the current graph's node as itself, handed
    its gradients as in the engine; ``take``: no post hook needs ``inputs`` afterwards."""
    with _outside_graph(deferred, step) as plan_step:
        outputs = current_plan().apply(plan_step, inputs, live=True, take=take)
    _check_saved(plan_step, own=False)
    return outputs


def _checkpoint_unpack_codes() -> list[Any]:
    """The code of non-reentrant checkpointing's unpack hooks (``torch.utils.checkpoint``'s
    ``_checkpoint_hook``, without and with an error callback), whose calls
    :func:`unpack_saved` makes for a whole block at once; none if torch's checkpoint module
    is not as expected (such nodes then run as themselves, one graph break each)."""
    try:
        from torch.utils.checkpoint import _checkpoint_hook

        codes = []
        for callback in (None, lambda error: None):
            frame = SimpleNamespace(unpack_error_cb=callback)
            codes.append(_checkpoint_hook(frame).unpack_hook.__code__)
        return codes
    except Exception:  # any change of torch's private API
        return []


for _code in _checkpoint_unpack_codes():
    _core.defer_unpack_hooks(_code)


@torch._dynamo.disable
def unpack_saved(deferred: list, step: int, members: tuple[int, ...]) -> list[tuple]:
    """The hooked saved values of the region's steps ``members`` (the first is ``step``), as
    their nodes would unpack them, each with its node as the current autograd node: a graph
    break at the first step of a checkpointed block, whose first unpack recomputes the
    block's forward and whose later ones look values up. The engine makes the later calls
    when their nodes run; their results are the same. The replay drops each step's values
    once the step ran, as the engine does (in a compiled graph, when the graph ends)."""
    run = _running()
    with _outside_graph(deferred, step) as plan_step:
        values = []
        for k in members:
            run.current = run.base + k
            values.append(run.plan.unpack(run.base + k))
    _check_saved(plan_step, own=True)
    return values


@torch._dynamo.disable
def apply_accumulate(deferred: list, step: int, inputs: list, take: bool) -> tuple:
    """An AccumulateGrad run in place (hooks observe it), handed its gradient so that it can
    steal it as in the engine; ``take``: no post hook needs ``inputs`` afterwards."""
    with _outside_graph(deferred, step) as plan_step:
        current_plan().accumulate(plan_step, inputs, take)
    _check_saved(plan_step, own=False)  # post-accumulate-grad hooks ran
    return ()


@torch._dynamo.disable
def cpp_pre_hook(deferred: list, step: int, position: int, values: list) -> list:
    """A C++ pre-kind hook (no Python dict to trace): a graph break through the engine API."""
    with _outside_graph(deferred, step) as plan_step:
        values = list(current_plan().call_hook(plan_step, position, values))
    _check_saved(plan_step, own=True)
    return values


def new_tensor_pre_hooks(deferred: list, step: int, values: list) -> list:
    """Before a step's planned pre-hooks, or the captures of a step that is not needed: the
    tensor pre-hooks and retains_grad hooks its node got since the call was planned
    (registered by an earlier hook of this backward), which the engine calls there. (A node
    that runs calls them itself when it has no planned pre-hooks, see ``Plan.apply``.)
    Uncompiled replays only (see :func:`build`): in compiled ones a traced step calls the
    hooks its node had when the call was planned."""
    plan = current_plan()
    plan_step = _step(step)
    if not plan.has_new_hooks(plan_step):
        # None to call, but the tensor pre-hooks are over for this node: one a pre-hook of
        # its registers is not called when the node runs (the engine's are over too).
        return list(plan.new_tensor_pre_hooks(plan_step, values))
    with _outside_graph(deferred, step) as plan_step:
        values = list(plan.new_tensor_pre_hooks(plan_step, values))
    _check_saved(plan_step, own=True)
    return values


def _no_new_tensor_pre_hooks(deferred: list, step: int, values: list) -> list:
    """:func:`new_tensor_pre_hooks` in compiled replays."""
    return values


@torch._dynamo.disable
def late_tensor_pre_hooks(deferred: list, step: int, values: list) -> list:
    """:func:`new_tensor_pre_hooks` at a step that is not needed, in any replay: its node
    got tensor pre-hooks during an earlier backward, and may again."""
    return new_tensor_pre_hooks(deferred, step, values)


@torch._dynamo.disable
def cpp_post_hook(deferred: list, step: int, position: int, outputs: tuple, inputs: list) -> tuple:
    with _outside_graph(deferred, step) as plan_step:
        outputs = current_plan().call_hook(plan_step, position, outputs, inputs)
    _check_saved(plan_step, own=False)
    return outputs


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


def _tensor_pre_hooks(fns: Iterable[Callable], value: Any) -> Any:
    """PyFunctionTensorPreHook: each hook sees the gradient of one input and may replace it."""
    for fn in fns:
        result = fn(value)
        if result is None or result is value:
            continue
        _check_single_result(value, result, fn)
        value = result
    return value


def _pre_hooks(fns: Iterable[Callable], inputs: list) -> list:
    """PyFunctionPreHook (grad_fn.register_prehook): hooks see and may replace all inputs."""
    values = tuple(inputs)
    for fn in fns:
        result = fn(values)
        # The engine skips its check of a hook that returned its argument, which would
        # pass: checked here, as Dynamo cannot trace `is` on tuples (a graph break).
        if result is None:
            continue
        _check_result(values, result, fn)
        values = result
    return list(values)


def _post_hooks(fns: Iterable[Callable], outputs: tuple, inputs: list) -> tuple:
    """PyFunctionPostHook (grad_fn.register_hook): hook(grad_inputs, grad_outputs)."""
    values = tuple(outputs)
    grad_outputs = tuple(inputs)
    for fn in fns:
        result = fn(values, grad_outputs)
        if result is None:  # see _pre_hooks
            continue
        _check_result(values, result, fn)
        values = result
    return values


def _live(fns: dict) -> list[Callable]:
    """The callables of a Python hook's dict as the engine calls them: read when the step
    reaches the hook (``PyDict_Values`` in python_hook.cpp's ``_call_hooks``), so those an
    earlier step's hook removed are not called and those it added are, while a callable
    removed by another callable of the same dict still runs."""
    return list(fns.values())


def _outside(hook: Callable[..., Any], own: bool, live: Callable[[Any], list]) -> Callable:
    """``hook`` outside the graph (a graph break: Dynamo neither traces it nor guards on
    what it touches), seeing the effects of the steps before it as in the engine, and the
    callables ``live(fns)`` (see :func:`hook_arguments`). ``own``: it runs before the step's
    node (see :func:`_check_saved`)."""

    @torch._dynamo.disable
    @functools.wraps(hook)
    def call(deferred: list, step: int, fns: Any, *args: Any) -> Any:
        with _outside_graph(deferred, step) as plan_step:
            result = hook(live(fns), *args)
        _check_saved(plan_step, own)
        return result

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
        return [_live(d) for d in dicts]
    return [HookDict(d) for d in dicts]


def _hook_dict_values(fns: HookDict) -> list[Callable]:
    return _live(fns.dict)


tensor_pre_hook_outside = _outside(_tensor_pre_hooks, True, _hook_dict_values)
pre_hook_outside = _outside(_pre_hooks, True, _hook_dict_values)
post_hook_outside = _outside(_post_hooks, False, _hook_dict_values)
# Traced hooks that leave the graph (see _overlapping): their callables are a list already.
_tensor_pre_hook_escaped = _outside(_tensor_pre_hooks, True, list)
_pre_hook_escaped = _outside(_pre_hooks, True, list)
_post_hook_escaped = _outside(_post_hooks, False, list)


def _overlapping(values: Iterable[Any]) -> bool:
    """Whether a gradient handed to a hook has elements that share memory (stride 0 over a
    size above 1: an expanded gradient, e.g. ``sum()``'s). In eager, in-place ops on such a
    tensor raise (``mul_``) or write every alias (``zero_``); compiled, they are neither
    checked nor replayed right (functionalization writes one alias into the others). So a
    traced hook that gets one runs outside the graph, on the real tensor. Decided while
    tracing, on the fake tensors' strides. (A contiguous tensor has none to look at: torch
    2.13's Dynamo fails on ``stride()`` where a symbolic stride became a constant.)"""
    for v in values:
        if isinstance(v, torch.Tensor) and v.layout == torch.strided and not v.is_contiguous():
            for size, stride in zip(v.shape, v.stride()):
                if stride == 0 and size > 1:
                    return True
    return False


def tensor_pre_hook_in_graph(deferred: list, step: int, fns: list, value: Any) -> Any:
    """A Python tensor pre-hook traced into the graph, whatever its gradient (for compilers
    that allow no graph break, e.g. ``fullgraph=True``)."""
    _USER_CODE.ran = True
    return _tensor_pre_hooks(fns, value)


def pre_hook_in_graph(deferred: list, step: int, fns: list, inputs: list) -> list:
    _USER_CODE.ran = True
    return _pre_hooks(fns, inputs)


def post_hook_in_graph(deferred: list, step: int, fns: list, outputs: tuple, inputs: list) -> tuple:
    _USER_CODE.ran = True
    return _post_hooks(fns, outputs, inputs)


def tensor_pre_hook(deferred: list, step: int, fns: list, value: Any) -> Any:
    """A Python tensor pre-hook traced into the graph (see :func:`_overlapping`)."""
    if _overlapping((value,)):
        return _tensor_pre_hook_escaped(deferred, step, fns, value)
    _USER_CODE.ran = True
    return _tensor_pre_hooks(fns, value)


def pre_hook(deferred: list, step: int, fns: list, inputs: list) -> list:
    """A Python pre-hook traced into the graph (see :func:`_overlapping`)."""
    if _overlapping(inputs):
        return _pre_hook_escaped(deferred, step, fns, inputs)
    _USER_CODE.ran = True
    return _pre_hooks(fns, inputs)


def post_hook(deferred: list, step: int, fns: list, outputs: tuple, inputs: list) -> tuple:
    """A Python post-hook traced into the graph (see :func:`_overlapping`)."""
    if _overlapping(outputs) or _overlapping(inputs):
        return _post_hook_escaped(deferred, step, fns, outputs, inputs)
    _USER_CODE.ran = True
    return _post_hooks(fns, outputs, inputs)


def retained(grad: Any) -> Any:
    """The value a retains_grad hook keeps: the engine's hook stores a clone when it runs, so
    what a later hook does to the gradient in place does not show in ``.grad``; the replay
    applies the hook later (see :func:`_outside_graph`), so it clones here."""
    return None if grad is None else grad.clone()


def _stacked(a: tuple, b: tuple, acc: Any) -> tuple[Any, Any] | None:
    """The factors of :func:`product_factors` and :func:`product_sum` stacked, ``A.t() @
    B`` being the sum of the products ``a[k].t() @ b[k]``; None where they are no plain real
    matrices of one dtype (that of ``acc``, the sum so far, if any), or where autocast is on
    for their device: there each product is made in its own precision and cast to the
    weight's dtype before it is summed (the engine's validate_outputs), so the nodes form
    the gradient. Traced, the choice is guarded like any other branch on a tensor's type
    (and on the autocast state, which Dynamo guards on)."""
    factors = (*a, *b)
    first = factors[0] if acc is None else acc
    if first is None or _autocast(first.device.type):
        return None
    plain = all(
        t is not None
        and t.layout == torch.strided
        and t.dtype == first.dtype
        and t.dim() == 2
        and not t.dtype.is_complex
        for t in factors
    )
    if not plain:
        return None
    return (a[0], b[0]) if len(a) == 1 else (torch.cat(a), torch.cat(b))


def _autocast(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (devices without autocast, e.g. meta,
    have it off)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def product_sum(grad: Any, a: tuple, b: tuple, acc: Any = None, prior: Any = None) -> Any:
    """A weight's gradient from its products (see :func:`_products`), as one tensor: what
    arrived before the region (``prior``), plus the sum of its blocks before (``acc``, see
    :func:`product_block`), plus the sum of ``a[k].t() @ b[k]``, that one matrix product of
    the factors stacked. ``grad`` (the sum its nodes form) where the factors are no plain
    real matrices of one dtype, or ``prior`` no dense tensor of theirs."""
    if acc is False:
        return grad
    stacked = _stacked(a, b, acc)
    if stacked is None:
        return grad
    first, second = stacked
    if prior is not None:
        if prior.layout != torch.strided or prior.dtype != first.dtype:
            return grad
        acc = prior if acc is None else prior + acc
    return first.t() @ second if acc is None else torch.addmm(acc, first.t(), second)


def product_block(acc: Any, a: tuple, b: tuple) -> Any:
    """A block of a weight's products added up in the graph once its last factor arrived:
    ``acc`` (the blocks before, None for the first) plus the sum of ``a[k].t() @ b[k]`` (see
    :func:`product_sum`); False where the factors are no plain matrices, and after that (the
    weight then takes the gradient its nodes form)."""
    return product_sum(False, a, b, acc)


def product_factors(grad: Any, a: tuple, b: tuple, acc: Any = None, prior: Any = None) -> Any:
    """What a compiled replay hands back for the AccumulateGrad of a weight whose gradient
    ``grad`` is the sum of the products ``a[k].t() @ b[k]`` (see :func:`_products`), and of
    ``acc`` and ``prior`` (see :func:`product_sum`): where these are None, the pair of the
    factors stacked, ``A.t() @ B`` being that sum, so that one matrix product makes the
    gradient or adds it to an existing ``.grad`` (``Plan.run_deferred``); else the sum
    itself. ``grad`` where the factors are no plain real matrices of one dtype (the compiler
    then drops what is not used)."""
    if acc is not None or prior is not None:
        return product_sum(grad, a, b, acc, prior)
    stacked = _stacked(a, b, None)
    return grad if stacked is None else stacked


# ---- input buffers -----------------------------------------------------------------------


def buffer_sum(*grads: Any) -> Any:
    """InputBuffer::add over gradients in arrival order (undefined ones are skipped), as new
    tensors: for compiled regions (whose compiler reuses buffers itself); uncompiled ones sum
    in place where the engine would (``_core.buffer_sum``)."""
    total = None
    for g in grads:
        if g is None:
            continue
        if total is None:
            total = g
        elif total.is_sparse or total.is_sparse_csr:
            # accumulate(): onto a sparse sum, the new gradient comes first (a dense one
            # absorbs it; of two sparse ones, the new one's entries lead).
            total = g + total
        else:
            total = total + g
    return total


# ---- code generation ---------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """Steps ``start..end`` of a replay as one function, ``region(inc, saved, sizes, hooks,
    deferred) -> (exports, captured)``.

    ``inc`` holds the input buffers of its steps (and of later ones it feeds) as summed
    before the region (root gradients, gradients of earlier regions), ``exports`` the
    buffers of later steps it fed, summed so far. The source names steps, saved values,
    hooks and captures relative to the region, so that regions of repeated structure have
    the same source and the same key.
    """

    start: int
    end: int
    source: str
    #: The source and what the nodes it calls are (type, input metadata, specialisation,
    #: the metadata their outputs are validated against, saved values' metadata): regions
    #: with the same key trace to the same graph.
    key: str
    #: Input buffers ``(step, input)`` of later steps: those it takes partly summed, in the
    #: order of ``inc``, and those it hands on (see :func:`_region_source`).
    incoming: tuple[tuple[int, int], ...]
    exports: tuple[tuple[int, int], ...]
    #: The plan's capture index of each of the region's captures.
    captures: tuple[int, ...]
    saved: tuple[int, int]
    sizes: tuple[int, int]
    hooks: tuple[int, int]
    #: It traces a CopySlices step (an in-place op on a view), which inductor miscompiles
    #: with its default options (see ``replaygrad._compile``).
    in_place_on_views: bool = False
    #: The plan's steps where it unpacks hooked saved values (see :func:`unpack_saved`).
    unpacks: tuple[int, ...] = ()
    #: Compiled; False for the regions of a replay that allows no graph break which hold
    #: only steps run outside the graph (see :func:`regions`): they run as Python.
    compiled: bool = True
    #: The ctx states of its Python Functions whose backward Dynamo traces, named ``F0``,
    #: ``F1``, ... in its source, each called through ``backward_0``, ``backward_1``, ...
    #: (see :func:`_function_backward_copy`).
    functions: tuple[FunctionState, ...] = ()
    #: The plan's steps of those Functions, in that order.
    function_steps: tuple[int, ...] = ()
    #: The plan's step of its first such backward that may write in place, if any (see
    #: :func:`saved_checked`).
    writes: int | None = None


@dataclass(frozen=True)
class Replay:
    """A replay: the driver function, its regions and their source."""

    fn: Callable[[tuple, list, list], list]
    regions: tuple[Region, ...]
    #: Python hooks are traced into the compiled regions.
    hooks_in_graph: bool
    source: str
    #: The steps where something runs outside the graph (see :func:`outside_steps`).
    breaks: tuple[int, ...] = ()
    #: Traced hooks given a gradient with overlapping memory leave the graph (see
    #: :func:`_overlapping`); False for compilers that allow no graph break.
    escapes: bool = True
    #: Built for a compiler that allows no graph break (see :func:`build`).
    breakless: bool = False
    #: The saved slots (ranges) of traced steps that run as themselves, with their own
    #: saved variables: the replay does not read them (see ``Plan.forget_saved``).
    unread: tuple[tuple[int, int], ...] = ()

    @functools.cached_property
    def functions(self) -> tuple[int, ...]:
        """The steps of Python Functions whose backward Dynamo traces into the graph (see
        :func:`traced_functions`), those of its regions."""
        return tuple(s for region in self.regions for s in region.function_steps)


_RUNTIME = {
    "apply_traced": apply_traced,
    "apply_function": apply_function,
    # (What the copies of function_backward use, see _function_backward_copy, and regions
    # with traced Functions, see _region_traced.)
    "comptime": comptime,
    "_USER_CODE": _USER_CODE,
    "_region_traced": _region_traced,
    "_tracing_backward": _tracing_backward,
    "_traced_backward": _traced_backward,
    "function_outputs": function_outputs,
    "_overlapping": _overlapping,
    "FakeBackwardCFunction": FakeBackwardCFunction,
    "apply_opaque": apply_opaque,
    "apply_accumulate": apply_accumulate,
    "unpack_saved": unpack_saved,
    "cpp_pre_hook": cpp_pre_hook,
    "cpp_post_hook": cpp_post_hook,
    "new_tensor_pre_hooks": _no_new_tensor_pre_hooks,
    "late_tensor_pre_hooks": late_tensor_pre_hooks,
    "tensor_pre_hook": tensor_pre_hook,
    "pre_hook": pre_hook,
    "post_hook": post_hook,
    "tensor_pre_hook_in_graph": tensor_pre_hook_in_graph,
    "pre_hook_in_graph": pre_hook_in_graph,
    "post_hook_in_graph": post_hook_in_graph,
    "tensor_pre_hook_outside": tensor_pre_hook_outside,
    "pre_hook_outside": pre_hook_outside,
    "post_hook_outside": post_hook_outside,
    "buffer_sum": buffer_sum,
    "retained": retained,
    "product_factors": product_factors,
    "product_block": product_block,
    "product_sum": product_sum,
}


def without_dynamo_wrapper(fn: Any) -> Any:
    """``fn`` without the wrapper of ``torch._dynamo.disable`` (``fn`` itself where it has
    none), for calls made while Dynamo is off, as replays run (see
    ``_engine._on_engine_call``): the wrapper keeps Dynamo out where a compiled region calls
    ``fn`` (at a graph break); elsewhere its setting and restoring of the frame evaluation
    callback does nothing but cost ~3 µs a call."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def _without_dynamo_wrappers(runtime: dict[str, Any]) -> dict[str, Any]:
    """``runtime`` for regions that run as Python (called by the driver, not by compiled
    code): see :func:`without_dynamo_wrapper`."""
    return {name: without_dynamo_wrapper(fn) for name, fn in runtime.items()}


#: The runtime of the regions of compiled replays that run as Python (see :func:`regions`,
#: ``cut``), and that of uncompiled replays (see :func:`build`).
_AS_PYTHON = _without_dynamo_wrappers(_RUNTIME)
_UNCOMPILED = _without_dynamo_wrappers(
    {
        **_RUNTIME,
        "apply_traced": apply_uncompiled,
        "buffer_sum": _core.buffer_sum,
        "new_tensor_pre_hooks": new_tensor_pre_hooks,
    }
)


def generate_source(
    plan: _core.Plan,
    hooks_in_graph: bool = True,
    opaque: frozenset[int] = frozenset(),
    region_size: int | None = None,
    compiled: bool = True,
) -> str:
    """The replay source of ``plan``: the driver, then its regions (see :func:`regions`);
    ``compiled``: as a compiler runs it (see :func:`replay_inputs`)."""
    steps = plan.steps()
    saved, scalars = replay_inputs(plan) if compiled else ((), frozenset())
    opaque, functions = _themselves(plan, steps, saved, compiled and hooks_in_graph, opaque)
    found = regions(
        plan,
        steps,
        hooks_in_graph,
        opaque,
        region_size,
        saved,
        cut=compiled,
        scalars=scalars,
        functions=functions,
    )
    return _replay_source(found, _driver_source(steps, found, plan.num_captures, hooks_in_graph))


def _themselves(
    plan: _core.Plan, steps: list, saved: Sequence[Any], dynamo: bool, opaque: frozenset[int]
) -> tuple[frozenset[int], dict[int, tuple[FunctionState, bool]]]:
    """``opaque`` with the traced steps that run as themselves whatever the compiler (see
    :func:`steps_run_as_themselves`) and the Python Functions' that do (see
    :func:`traced_functions`, ``dynamo``), and the Functions whose backward Dynamo traces."""
    themselves, functions = traced_functions(plan, steps, saved, dynamo)
    return opaque | steps_run_as_themselves(plan, steps) | themselves, functions


def compiled_themselves(plan: _core.Plan, steps: list) -> frozenset[int]:
    """The traced steps of ``plan`` that a compiled replay (with Python code traced into
    its graph, the default) runs as themselves (see :func:`_themselves`)."""
    saved = () if plan.nested_inputs else replay_inputs(plan)[0]
    return _themselves(plan, steps, saved, not plan.nested_inputs, frozenset())[0]


def _replay_source(found: Sequence[Region], driver: str) -> str:
    return "\n".join(
        [driver] + [f"# region {r} (key {g.key[:16]})\n{g.source}" for r, g in enumerate(found)]
    )


def steps_run_as_themselves(plan: _core.Plan, steps: list) -> frozenset[int]:
    """Traced steps that run as themselves whatever the compiler, found by their node's
    saved state:

    - nodes that make sparse gradients (``embedding(..., sparse=True)``,
      ``gather(..., sparse_grad=True)``). Traced, the fake tensors do not always say so
      (embedding's backward traces to a dense tensor), and a compiler given sparse values
      where it traced dense ones computes wrong gradients without an error;
    - nodes whose backward raises in eager on a check that compiled code leaves out: the
      in-place ``leaky_relu_``, ``elu_``, ``celu_`` and ``rrelu_`` with a negative slope
      (inductor's decompositions have no such check), and ``linalg.eig`` and complex
      ``linalg.eigh``, whose formula checks that the loss does not depend on the
      eigenvectors' phases only on real tensors;
    - ``Tensor.put``: without ``accumulate`` its backward's ``put_`` alerts under
      ``torch.use_deterministic_algorithms`` (raises, or warns with ``warn_only``, as set on
      each call; inductor's code does not); with it, its backward's ``take`` of a 0-dim index
      fails to compile under inductor (torch 2.13: a data-dependent ``item()``), and the
      index may be behind an unpack hook (checkpointing's) when the replay is built;
    - ``avg_pool1d/2d/3d`` where inductor's lowering of their backward (torch 2.13) differs
      from eager: with ``ceil_mode`` and ``count_include_pad`` it divides a last window that
      overhangs the padded input by the whole kernel, not by the part eager counts (wrong
      gradients, pytorch/pytorch#198119), and it asserts one kernel size, stride and padding
      per dimension where eager also takes a single one for all;
    - 2-d nearest upsampling (``interpolate(mode="nearest")`` of a 4-d input), whose
      backward inductor lowers (torch 2.13) from the sizes alone: given a scale whose
      reciprocal is not input size / output size (``scale_factor=1.7,
      recompute_scale_factor=False``) it computes wrong gradients, and once the spatial sizes
      are dynamic it fails to compile (``'FloorDiv' object cannot be interpreted as an
      integer``), whatever the scale.
    """
    return frozenset(
        s
        for s, step in enumerate(steps)
        if step[2] == "traced" and _runs_as_itself(step[0], functools.partial(plan.node_object, s))
    )


def traced_functions(
    plan: _core.Plan, steps: list, saved: Sequence[Any], dynamo: bool
) -> tuple[frozenset[int], dict[int, tuple[FunctionState, bool]]]:
    """The traced steps of Python Functions that do not declare themselves traceable
    (``is_traceable``): those whose backward Dynamo traces into the graph, each with the
    state of its ctx (see :func:`function_backward`) and whether it may write in place (its
    code names an in-place method, sets an item or passes ``out=``), and those that run as
    themselves: all of them unless ``dynamo`` (a compiled replay with Python code traced
    into its graph, see :func:`build`). A Function declared traceable is traced by the
    compiler, running as itself on the values being traced (see :func:`apply_traced`).

    Dynamo traces a backward as torch's compiled autograd does: it guards on what it reads,
    breaks the graph where it cannot trace (e.g. a ``.item()`` it branches on), and
    replays the backward's Python side effects after the graph. A backward runs as itself,
    outside the graph, where that would not do what the engine does: where its code (as
    looked at for traced hooks, see :func:`traced_hooks_concern`) may read ``.grad``, run a
    backward, ask for the current autograd node, set an attribute (the ctx it gets is not
    the node's), or use the ctx's autograd API beyond ``saved_tensors`` and
    ``needs_input_grad`` (hooks, ``next_functions``, ``metadata``, ...); where it is
    wrapped in ``torch._dynamo.disable`` (how a user keeps a backward out of compiled
    graphs), is not a plain function, comes with ``vjp``, ``boxed_grads_call`` or
    ``clear_saved_tensors_on_access``; where an
    input gradient has no source and the engine would materialize zeros there (not where
    it passes None: ``set_materialize_grads(False)``); or where its saved tensors
    are not plain (None, or one tensor saved twice: the replay's slots of a node follow its
    distinct tensors); or where it may write in place and can reach a tensor other than its
    saved tensors and gradients (see :func:`_outer_tensors`)."""
    themselves: set[int] = set()
    traced: dict[int, tuple[FunctionState, bool]] = {}
    for s, step in enumerate(steps):
        if step[1] != "python_function" or step[2] != "traced" or plan.is_traceable(s):
            continue
        ctx = plan.node_object(s) if dynamo else None
        state = (
            _traced_function_state(ctx, step, saved, plan.passes_none(s))
            if ctx is not None
            else None
        )
        if state is None:
            themselves.add(s)
        else:
            traced[s] = state
    return frozenset(themselves), traced


#: The ctx's autograd API that a backward traced into the graph does not get (see
#: :func:`traced_functions`): what ``BackwardCFunction`` has but ``saved_tensors``,
#: ``needs_input_grad`` and ``_forward_cls``; with ``setattr``/``delattr`` and the marker
#: of code that sets attributes (see :func:`_code_reached`).
_CTX_API = frozenset(
    name
    for name in dir(torch.autograd.function.BackwardCFunction)
    if not name.startswith("__")
    # (`apply` and `requires_grad`, names of other objects too, e.g. a Function's `apply`
    # and once_differentiable's look at its gradients, are left to Dynamo.)
    and name not in ("saved_tensors", "needs_input_grad", "_forward_cls", "apply", "requires_grad")
) | {"setattr", "delattr", "<sets attributes>"}


def _traced_function_state(
    ctx: Any, step: tuple, saved: Sequence[Any], passes_none: Sequence[bool]
) -> tuple[FunctionState, bool] | None:
    """The state of a Python Function's ctx for :func:`function_backward` and whether its
    backward may write in place, or None where it runs as itself (see
    :func:`traced_functions`). ``passes_none``: per input, whether the engine hands the
    backward None for a missing gradient there (``Plan.passes_none``)."""
    cls = ctx._forward_cls
    backward = inspect.getattr_static(cls, "backward", None)
    function = torch.autograd.Function
    if (
        not isinstance(backward, staticmethod)
        or not isinstance(backward.__func__, FunctionType)
        or hasattr(backward.__func__, "_torchdynamo_orig_callable")
        or cls.backward is function.backward
        or cls.vjp is not function.vjp
        or getattr(cls, "boxed_grads_call", False)
        # (Looked at below, its saved tensors would be cleared before its backward runs.)
        or getattr(cls, "clear_saved_tensors_on_access", False)
        or any(not sources and not none for sources, none in zip(step[8], passes_none))
    ):
        return None
    names = _hook_names([[backward.__func__]])
    if _concern(names) is not None or not _CTX_API.isdisjoint(names):
        return None
    a, b = step[6], step[7]
    try:
        values = ctx.saved_tensors
        if len(values) != b - a or any(not saved or saved[x] is None for x in range(a, b)):
            return None
        seen = {(v.data_ptr(), v.storage_offset(), v.shape, v.stride(), v.dtype) for v in values}
    except Exception:  # freed, modified in place (raised where the node runs), not strided
        return None
    if len(seen) != len(values):
        return None
    writes = not _WRITES.isdisjoint(names) or any(
        n.endswith("_") and not n.endswith("__") for n in names
    )
    if writes and _outer_tensors(backward.__func__, 2):
        return None
    return FunctionState(ctx, passes_none), writes


def _outer_tensors(fn: Any, depth: int) -> bool:
    """Whether ``fn`` (a function), or one it reaches by a closure variable or a global
    name (``depth`` calls deep, see :func:`_reached`), can reach a tensor (or a module,
    which holds some) by one: a backward that writes into such a tensor in place (e.g. a
    buffer it updates) runs as itself, where the engine sees the write when it happens
    (compiled, it is copied back when the graph ends, counted in the tensor's version
    differently)."""
    if not isinstance(fn, FunctionType):
        return False
    values = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    scope = fn.__globals__
    values += [scope[name] for name in _code_reached(fn, 0) if name in scope]
    if any(isinstance(v, (torch.Tensor, torch.nn.Module)) for v in values):
        return True
    return depth > 0 and any(_outer_tensors(v, depth - 1) for v in values if _followed(v, fn))


#: The saved flags of torch's generated nodes that make their gradients sparse.
_SPARSE_FLAGS = ("_saved_sparse", "_saved_sparse_grad")

#: Average pooling nodes (avg_pool1d's is AvgPool2DBackward0) and their spatial dimensions.
_AVG_POOL_DIMS = {"AvgPool2DBackward0": 2, "AvgPool3DBackward0": 3}

#: Nodes that run as themselves whatever their saved state.
_ALWAYS_THEMSELVES = frozenset({"PutBackward0", "UpsampleNearest2DBackward0", "LinalgEigBackward0"})

#: The generated nodes that have one of those flags.
_SPARSE_NODES = frozenset(
    name
    for name, cls in vars(torch._C._functions).items()
    if isinstance(cls, type) and any(hasattr(cls, flag) for flag in _SPARSE_FLAGS)
)


def _runs_as_itself(name: str, node_object: Callable[[], Any]) -> bool:
    """See :func:`steps_run_as_themselves`: whether a step whose node is a ``name`` runs as
    itself. ``node_object()`` makes the node's Python object, only for the types whose saved
    state tells: a node given one keeps it, and torch 2.13 frees such nodes recursively (a
    node's object frees the next node's), so that a long chain of them overflows the stack
    when the graph is freed, where the engine frees nodes without objects iteratively."""
    if name in _ALWAYS_THEMSELVES:
        return True
    if name in _SPARSE_NODES:
        node = node_object()
        return any(getattr(node, flag, False) is True for flag in _SPARSE_FLAGS)
    if name in ("LeakyReluBackward1", "EluBackward1", "CeluBackward1"):
        # The backward of the in-place op, from its result: slopes below 0 raise.
        node = node_object()
        slope = node._saved_negative_slope if name == "LeakyReluBackward1" else node._saved_alpha
        return slope < 0
    if name == "RreluWithNoiseBackward1":
        node = node_object()
        return (node._saved_lower + node._saved_upper) / 2 < 0
    if name in _AVG_POOL_DIMS:
        node = node_object()
        dims = _AVG_POOL_DIMS[name]
        overhang_divided_by_kernel = (
            node._saved_ceil_mode
            and node._saved_count_include_pad
            and node._saved_divisor_override is None
        )
        sizes = (node._saved_kernel_size, node._saved_stride, node._saved_padding)
        return overhang_divided_by_kernel or any(0 < len(s) < dims for s in sizes)
    if name == "LinalgEighBackward0":
        # Real eigenvectors have no phase to check. (Read from the gradient's metadata: the
        # saved value may be behind an unpack hook, e.g. checkpointing's.)
        return node_object()._input_metadata[1].dtype.is_complex
    return False


def regions(
    plan: _core.Plan,
    steps: list,
    hooks_in_graph: bool = True,
    opaque: frozenset[int] = frozenset(),
    region_size: int | None = None,
    saved: Sequence[Any] = (),
    escapes: bool = True,
    cut: bool = False,
    products: bool = False,
    scalars: frozenset[int] = frozenset(),
    functions: dict[int, tuple[FunctionState, bool]] | None = None,
) -> tuple[Region, ...]:
    """Splits ``plan`` into regions of about ``region_size`` steps (see :func:`_cuts`; one
    region if None) and generates their source.

    A region runs its steps as the engine does (see :func:`_region_source`). Cuts fall
    before a step like the most common one (same node type and key parts) once a region
    has ``region_size`` steps, so that in a graph of repeated structure the regions repeat
    too; with a ``region_size``, a region also starts at each checkpointed block (see
    :func:`unpack_saved`). ``saved`` (the plan's saved values, when known) adds their
    metadata to the keys, and the regions do not read the slots that hold None; ``scalars``:
    the slots whose values ``saved`` holds lifted (see :func:`replay_inputs`). ``opaque``
    and ``escapes``: see :func:`_region_source`.

    ``cut`` (compiled replays): the steps where something runs outside the graph
    (:func:`outside_steps`) get regions of their own, run as Python between the compiled
    ones, so that no compiled region breaks its graph there (a compiler that allows no graph
    break needs that). A region costs less a call than a graph break (whose resume function
    Dynamo enters as a frame of its own), and regions alike compile once: a Python Function
    run as itself in each of 20 layers took 2.30 ms a backward with a graph break at each
    and 14.7 s to compile, 1.61 ms and 4.2 s cut into regions (2026-12-07).

    ``products`` (compiled replays but torch's debugging backends', see
    ``Config.products``): the weights whose gradient is a matrix product, or a sum of them,
    are accumulated from the factors (see :func:`_products`; needs ``saved``).
    ``functions``: see :func:`traced_functions`.
    """
    functions = functions or {}
    digests = plan.step_digests()
    size_ranges = plan.size_ranges()
    hooked = {step: (count, group) for step, count, group in plan.hooked_steps()}
    # Per step: what the node is, whatever step it is (type, input metadata, specialisation).
    what = [(step[0], step[1], digests[24 * s + 8 : 24 * s + 24]) for s, step in enumerate(steps)]
    effects = {(step, pos) for step, _kind, pos in plan.deferred()}
    absent = frozenset(slot for slot, value in enumerate(saved) if value is None)
    factored = _products(plan, steps, opaque, hooked, absent, saved) if products and saved else {}
    span = _block_span(factored, saved) if region_size is not None else None
    if span is not None and span < region_size:
        # A compiler schedules a region's kernels as it sees fit: inductor made an unrolled
        # GRU cell's blocks of products at the region's end, holding all their factors until
        # then (4.6 MB at most where eager holds 3.1; 3.9 in regions of a block's steps, its
        # steady state 1-2% slower, 2026-12-08). Regions that span a block bound what is held.
        cuts = _cuts(what, span, small=True)
    else:
        cuts = _cuts(what, region_size)
    if region_size is not None and hooked:
        # Checkpointed blocks break the graph where they are unpacked anyway: a region per
        # block loses no fusion, and blocks alike are compiled once.
        starts = (first for first, _ in _unpack_groups(steps, hooked, 0, len(steps), opaque))
        cuts = sorted({*cuts, *starts})
    outside = set(outside_steps(steps, hooks_in_graph, opaque)) if cut else set()
    if outside:
        outside |= _views_beside(outside, steps)
        edges = (s for s in range(1, len(steps)) if (s in outside) != (s - 1 in outside))
        cuts = sorted({*cuts, *edges})
    out = []
    python_hooks = 0
    for start, end in pairwise(cuts):
        unpacks = _unpack_groups(steps, hooked, start, end, opaque)
        source, incoming, exports, captures, used, states = _region_source(
            steps,
            size_ranges,
            start,
            end,
            effects,
            hooks_in_graph,
            opaque,
            python_hooks,
            escapes,
            {m: (first, members, hooked[m][0]) for first, members in unpacks for m in members},
            absent,
            _region_products(factored, steps, saved, start, end),
            scalars,
            functions,
        )
        a, b = (steps[start][6], steps[end - 1][7]) if end > start else (0, 0)
        identity = [
            (what[s], [(what[t][2][:8] if t >= 0 else None, nr) for t, nr in steps[s][9]])
            for s in range(start, end)
        ]
        identity.append([_meta(v) for v in saved[a:b]])
        if hooks_in_graph and used:
            # Traced hooks are this region's own: Dynamo guards on the callables, which
            # differ from place to place.
            identity.append((plan.key, start))
        key = hashlib.blake2b(f"{source}\n{identity!r}".encode(), digest_size=16).hexdigest()
        out.append(
            Region(
                start,
                end,
                source,
                key,
                incoming,
                exports,
                captures,
                (a, b),
                (size_ranges[start][0], size_ranges[end - 1][1]) if end > start else (0, 0),
                (python_hooks, python_hooks + used),
                any(_traced_copy_slices(steps[s], s, opaque) for s in range(start, end)),
                tuple(first for first, _ in unpacks),
                not outside.issuperset(range(start, end)),
                functions=states,
                function_steps=tuple(
                    s for s in range(start, end) if s in functions and s not in opaque
                ),
                writes=next(
                    (s for s in range(start, end) if functions.get(s, (0, False))[1]), None
                ),
            )
        )
        python_hooks += used
    return tuple(out)


#: torch's nodes whose backward makes a view or reshape of its gradient: nothing to compile.
_VIEW_FORMULAS = frozenset(
    {
        "AliasBackward0",
        "PermuteBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "TBackward0",
        "TransposeBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)


def _views_beside(outside: set[int], steps: list) -> set[int]:
    """The runs of traced view formulas (without hooks or captures) next to a step of
    ``outside``, which run with it as Python: cut out between steps outside the graph (e.g.
    a Linear's weight's TBackward0 between its bias's and weight's AccumulateGrads with
    post-accumulate-grad hooks), such a run would be a compiled region whose call costs
    ~25 µs (guards, AOTAutograd's wrappers and its regeneration of view outputs) for a
    transpose that takes ~1 µs."""
    found: set[int] = set()
    run: list[int] = []
    for s, step in enumerate([*steps, None]):
        if step is not None and s not in outside and _plain_view(step):
            run.append(s)
            continue
        if run and (run[0] - 1 in outside or s in outside):
            found.update(run)
        run = []
    return found


def _plain_view(step: tuple) -> bool:
    return step[2] == "traced" and step[0] in _VIEW_FORMULAS and not step[10] and not step[11]


#: The matrix-product nodes whose gradient of ``mat2`` is ``mat1.t() @ grad``: the output
#: that gradient goes out on, and whether ``mat1`` is the first of the node's two saved
#: variables when both are defined (the slots: undefined ones first, then in the order
#: compiled_args collects them, by name).
_MATMULS = {"AddmmBackward0": (2, True), "MmBackward0": (1, False)}


def _products(
    plan: _core.Plan,
    steps: list,
    opaque: frozenset[int],
    hooked: dict,
    absent: frozenset[int],
    saved: Sequence[Any],
) -> dict[int, tuple[tuple[int, ...], tuple[tuple[int, int, bool, int], ...]]]:
    """The AccumulateGrad steps whose gradient is a matrix product or a sum of them:
    ``{step: (weight's shape, products)}``, a product being ``(matmul step, saved slot of
    mat1, transposed, the step its gradient arrives from)``, in step order. Such a weight is
    ``mat2`` of ``mm`` or ``addmm`` (with ``alpha`` 1), or its transpose (``nn.Linear``'s
    ``addmm(b, x, W.t())``), and its gradient ``mat1.t() @ grad`` (``grad.t() @ mat1``
    transposed); used in several products (an unrolled RNN's), the sum of theirs is one
    product of the factors stacked. The replay hands back the factors (see
    :func:`product_factors`): one matrix product makes the gradient, or adds it to an
    existing ``.grad`` with ``addmm_``, a pass over the weight where eager makes two per
    product (the product, then the add; inductor's graph likewise). The steps on the way run
    nothing else: traced, without hooks or captures.

    The factors held for a weight take no more memory than its gradient (which eager holds
    from its first product on), at the sizes of this plan: each region takes its products
    in blocks of that size (:func:`_region_products`), and where a weight takes several,
    regions span a block's steps (see :func:`regions`). The blocks but the last are added up
    in the graph, each as one matrix product once its last factor arrived (see
    :func:`product_block`); the last is added to them and sent on to a later region (see
    :func:`product_sum`), or the one the replay hands back (or adds to the others,
    :func:`product_factors`)."""
    out = {}

    def factors(p: int, index: int) -> tuple[int, int, bool, int] | None:
        source = p
        transposed = p >= 0 and steps[p][0] == "TBackward0"
        if transposed:
            if not _plain_traced(steps[p], p, opaque) or len(steps[p][8][0]) != 1:
                return None
            p, index = steps[p][8][0][0]
        if p < 0 or _MATMULS.get(steps[p][0], (None,))[0] != index:
            return None
        if not _plain_traced(steps[p], p, opaque) or p in hooked:
            return None
        a, b = steps[p][6], steps[p][7]
        mat1 = a if _MATMULS[steps[p][0]][1] and a not in absent else a + 1
        if b - a != 2 or mat1 in absent:
            return None
        if steps[p][0] == "AddmmBackward0" and plan.node_object(p)._saved_alpha != 1:
            return None
        return p, mat1, transposed, source

    for s, step in enumerate(steps):
        if step[2] != "deferred_accumulate" or step[10] or step[11] or not step[8][0]:
            continue
        found = [factors(p, index) for p, index in step[8][0]]
        if all(found):
            out[s] = (tuple(plan.node_object(s).variable.shape), tuple(sorted(found)))
    return out


def _block_span(factored: dict, saved: Sequence[Any]) -> int | None:
    """The fewest steps between the ends of a weight's first two blocks of products (see
    :func:`_product_blocks`, made over the whole plan): an unrolled cell's steps per block.
    None where no weight takes two blocks."""
    spans = []
    for shape, uses in factored.values():
        blocks = _product_blocks(uses, shape, saved)
        if len(blocks) > 1:
            spans.append(blocks[1][-1][0] - blocks[0][-1][0])
    return min(spans, default=None)


def _region_products(
    factored: dict, steps: list, saved: Sequence[Any], start: int, end: int
) -> dict[int, tuple[tuple[tuple[int, int, bool, int], ...], ...]]:
    """The products (see :func:`_products`) region ``start..end`` makes, in blocks (see
    :func:`_product_blocks`), by the weight's AccumulateGrad step (in the region or a
    later one): of the weights whose every gradient arriving in the region comes from a
    product made in it."""
    out = {}
    for s, (shape, uses) in factored.items():
        if s < start:
            continue
        local = [use for use in uses if start <= use[0] < end]
        arriving = sum(start <= p < end for p, _ in steps[s][8][0])
        if not local or len(local) != arriving or not all(start <= u[3] < end for u in local):
            continue
        blocks = _product_blocks(local, shape, saved)
        if blocks:
            out[s] = blocks
    return out


def _product_blocks(
    uses: Sequence[tuple[int, int, bool, int]], shape: Sequence[int], saved: Sequence[Any]
) -> tuple[tuple[tuple[int, int, bool, int], ...], ...]:
    """A weight's products (see :func:`_products`) in blocks whose factors take no more
    memory than the gradient (``shape``): a product's take ``rows * (shape[0] + shape[1])``
    elements, its ``mat1`` (in ``saved``) having the rows. () where that gains nothing: a
    weight with one product whose factors are larger than its gradient (a square
    ``nn.Linear`` on more rows than half its width), or with blocks of one product each."""
    budget = shape[0] * shape[1]
    blocks: list[list[tuple[int, int, bool, int]]] = []
    held = 0
    for use in uses:
        size = saved[use[1]].shape[0] * (shape[0] + shape[1])
        if not blocks or held + size > budget:
            blocks.append([])
            held = 0
        blocks[-1].append(use)
        held += size
    if held > budget if len(blocks) == 1 else all(len(block) == 1 for block in blocks):
        return ()
    return tuple(tuple(block) for block in blocks)


def _plain_traced(step: tuple, s: int, opaque: frozenset[int]) -> bool:
    """Whether plan step ``s`` is a traced node of torch's without hooks or captures."""
    return step[1:3] == ("generic", "traced") and s not in opaque and not step[10] and not step[11]


def _traced_copy_slices(step: tuple, s: int, opaque: frozenset[int]) -> bool:
    """Whether plan step ``s`` is a CopySlices (an in-place op on a view) that is traced."""
    return step[0] == "torch::autograd::CopySlices" and step[2] == "traced" and s not in opaque


def _unpack_groups(
    steps: list, hooked: dict[int, tuple[int, int]], start: int, end: int, opaque: frozenset[int]
) -> list[tuple[int, tuple[int, ...]]]:
    """The hooked saved values of the region ``start..end`` (see ``Plan.hooked_steps``) by
    unpack hook, each as (first step, its traced steps): the region unpacks them all at the
    first (see :func:`unpack_saved`)."""
    groups: dict[int, list[int]] = {}
    for s in range(start, end):
        if s in hooked and steps[s][2] == "traced" and s not in opaque:
            groups.setdefault(hooked[s][1], []).append(s)
    return [(members[0], tuple(members)) for members in groups.values()]


def replay_inputs(plan: _core.Plan) -> tuple[list, frozenset[int]]:
    """The saved values a compiled replay of ``plan`` takes, and the slots among them that
    hold a 0-dim float64 value lifted to a 1-element tensor (see
    ``_core.Plan.saved_values``), which the replay indexes back in its graph: Dynamo reads
    such a 0-dim input as a float too, and when the graph does not use that float as one
    (a wrapped number's value in ``MulBackward0``), AOTAutograd's ``tensorify_python_scalars``
    pass has Dynamo trace the region again."""
    plain, lifted = plan.saved_values(), plan.saved_values(lift=True)
    return lifted, frozenset(k for k, (a, b) in enumerate(zip(plain, lifted)) if a is not b)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.layout, tuple(value.shape), value.stride())
    return type(value)


def outside_steps(steps: list, hooks_in_graph: bool, opaque: frozenset[int]) -> tuple[int, ...]:
    """The steps where the replay runs something outside the graph (a node run as itself, an
    AccumulateGrad run in place, a C++ hook, a Python hook when hooks are not traced, the
    late tensor pre-hooks of a step not needed), in order: the points after which saved
    values may have been modified."""
    out = []
    for s, step in enumerate(steps):
        mode, hooks = step[2], step[10]
        if (
            mode in ("opaque", "eager_accumulate")
            or (mode in ("traced", "skipped") and s in opaque)
            or any(
                not python or not hooks_in_graph
                for kind, _, python, _ in hooks
                if kind != "retains_grad"
            )
        ):
            out.append(s)
    return tuple(out)


def _cuts(what: list, size: int | None, small: bool = False) -> list[int]:
    """Region boundaries for graphs of more than three regions' worth of steps (smaller
    ones compile as fast whole, and run faster; with ``small``, of more than one): a cut
    before a step like the most common one (an "anchor") once the region has ``size``
    steps, or anyway at twice that; at ``size`` where no step repeats often enough to align
    regions."""
    n = len(what)
    if size is None or n <= (1 if small else 3) * size:
        return [0, n]
    anchor, count = Counter(what).most_common(1)[0]
    limit = 2 * size if count * size >= n else size
    cuts = [0]
    for s in range(1, n):
        length = s - cuts[-1]
        if length >= size and (what[s] == anchor or length >= limit):
            cuts.append(s)
    cuts.append(n)
    return cuts


def _region_source(
    steps: list,
    size_ranges: Sequence[tuple[int, int]],
    start: int,
    end: int,
    effects: set[tuple[int, int]],
    hooks_in_graph: bool,
    opaque: frozenset[int],
    hook_base: int,
    escapes: bool = True,
    unpacked: dict[int, tuple[int, tuple[int, ...], int]] | None = None,
    absent: frozenset[int] = frozenset(),
    products: dict[int, tuple[tuple[tuple[int, int, bool, int], ...], ...]] | None = None,
    scalars: frozenset[int] = frozenset(),
    functions: dict[int, tuple[FunctionState, bool]] | None = None,
) -> tuple[str, tuple, tuple, tuple, int, tuple[FunctionState, ...]]:
    """Straight-line source for ``region(inc, saved, sizes, hooks, deferred)``, one block per step
    as engine.cpp runs it, and its interface: the incoming and exported input buffers (as
    ``(step, input)``), the captures, the number of Python hooks.

    An input buffer that takes two gradients or more is summed as they arrive, in arrival
    order, as InputBuffer::add does, so that a hook changing a gradient in place after it
    arrived does not change the sum. That of a later step is taken summed as far as before
    the region and exported with the region's gradients added, so that the gradients of a
    shared parameter are not all kept until its AccumulateGrad runs.

    The region appends the values of the plan's deferred effects to ``deferred`` as it
    reaches them, so that after an error the caller can still apply those that came before
    it, as the engine would have.

    ``hooks_in_graph=False`` calls Python hooks outside the graph (``*_outside``: graph
    breaks under Dynamo), after the deferred effects before them, as everything else that
    runs outside the graph does. Traced steps in ``opaque`` run as opaque ones; skipped
    ones call their node's late tensor pre-hooks (see :func:`late_tensor_pre_hooks`).
    ``escapes=False`` keeps traced hooks in the graph whatever their gradients (see
    :func:`_overlapping`). ``unpacked``: traced steps whose last saved values are unpacked
    when the replay runs, as (first step of their group, the group's steps, count); the
    group's values are unpacked at its first step (one graph break for a checkpointed
    block), each step's dropped after it ran. ``absent``: the saved slots that hold None
    (undefined SavedVariables; the keys tell them apart): the region passes None there
    without reading ``saved``, so that a compiler does not guard on them. ``products``: the
    AccumulateGrad steps that take their gradient as a product's factors (see
    :func:`_products`; their matmul steps are in the region). ``scalars``: the saved slots
    whose values come lifted (see :func:`replay_inputs`), which the region indexes back.
    ``functions``: the Python Functions' steps whose backward Dynamo traces (see
    :func:`function_backward`), with their ctx states (returned for the region's steps in
    the order its source names them) and whether they may write in place.
    """
    unpacked = unpacked or {}
    functions = functions or {}
    states: list[FunctionState] = []
    products = products or {}
    factors = {use[0] for blocks in products.values() for block in blocks for use in block}
    # The matmul steps that complete a block added up in the graph: its weight's step, the
    # block, and whether a block came before it.
    flushes = {
        block[-1][0]: (w, block, n > 0)
        for w, blocks in products.items()
        for n, block in enumerate(blocks[:-1])
    }
    # Their sums by weight, named in order (not by step), so that regions alike share a key.
    sums = {w: f"w{n}" for n, w in enumerate(sorted(products))}
    groups: dict[int, str] = {}
    where = ("" if escapes else "_in_graph") if hooks_in_graph else "_outside"
    incoming: dict[tuple[int, int], int] = {}
    captures: list[int] = []

    def before(step: int, slot: int) -> list[str]:
        """Input buffer ``slot`` of ``step`` as summed before the region, if anything
        arrived there: an element of ``inc``."""
        if not any(p < start for p, _ in steps[step][8][slot]):
            return []
        return [f"inc[{incoming.setdefault((step, slot), len(incoming))}]"]

    # Buffers summed as their gradients arrive (see above): those of later steps that this
    # region feeds, and those of its own steps that take two gradients or more (what
    # arrived before the region counts as one); the others hold their one gradient.
    feeds: dict[int, list[tuple[tuple[int, int], int]]] = {}
    for target in dict.fromkeys(
        (t, slot) for p in range(start, end) for t, slot in steps[p][9] if t >= start
    ):
        sources = steps[target[0]][8][target[1]]
        local = [(p, i) for p, i in sources if start <= p < end]
        if target[0] >= end or len(local) + any(p < start for p, _ in sources) > 1:
            for p, i in local:
                feeds.setdefault(p, []).append((target, i))
    # Every step's outputs die after their last reader here: the step itself for those
    # summed into a buffer on arrival, so that a sum can go into the first gradient in place
    # (see _core.buffer_sum), as the engine's does.
    last = {p: p for p in range(start, end)}
    for p in range(start, end):
        fed = {(target, i) for target, i in feeds.get(p, ())}
        for i, (t, slot) in enumerate(steps[p][9]):
            if start <= t < end and ((t, slot), i) not in fed:
                last[p] = max(last[p], t)
    partial: dict[tuple[int, int], str] = {}

    def buffer(step: int, slot: int) -> str:
        """Input buffer ``slot`` of ``step`` in the region: as summed on arrival, or the one
        gradient that arrived, before the region or from one of its steps."""
        if (step, slot) in partial:
            return partial[(step, slot)]
        local = [f"o{p - start}[{i}]" for p, i in steps[step][8][slot] if p >= start]
        return _sum(before(step, slot) + local)

    dying: dict[int, list[int]] = {}
    for p in range(start, end):
        if _has_outputs(steps[p]):
            dying.setdefault(last[p], []).append(p)

    saved_base = steps[start][6] if end > start else 0
    sizes_base = size_ranges[start][0] if end > start else 0

    def saved_slots(a: int, b: int) -> str:
        """The list of the saved slots ``a..b``."""
        if not any(slot in absent or slot in scalars for slot in range(a, b)):
            return f"saved[{a - saved_base}:{b - saved_base}]"
        values = (
            "None" if x in absent else f"saved[{x - saved_base}]{'[0]' if x in scalars else ''}"
            for x in range(a, b)
        )
        return f"[{', '.join(values)}]"

    def stacks(block: tuple[tuple[int, int, bool, int], ...]) -> tuple[str, str, str]:
        """The factors of a block of products (see _products), ``a`` and ``b`` (the product
        is ``a[k].t() @ b[k]``), and the names of its gradients."""
        pairs, grads = [], []
        for p, slot, transposed, _ in block:
            grad, mat1 = f"f{p - start}", f"saved[{slot - saved_base}]"
            pairs.append((grad, mat1) if transposed else (mat1, grad))
            grads.append(grad)
        a, b = (f"({', '.join(side)},)" for side in zip(*pairs))
        return a, b, ", ".join(grads)

    def last_block(w: int) -> tuple[str, str]:
        """The arguments that take weight ``w``'s last block of products (see
        :func:`product_sum`): its factors, the sum of its blocks before and what arrived
        before the region; and what to drop after."""
        blocks = products[w]
        a, b, grads = stacks(blocks[-1])
        prior = (before(w, 0) or ["None"])[0]
        if len(blocks) == 1:
            return f"{a}, {b}, None, {prior}", f"del {grads}"
        return f"{a}, {b}, {sums[w]}, {prior}", f"del {grads}, {sums[w]}"

    body = []
    exports: list[tuple[int, int]] = []
    hook = hook_base
    for s in range(start, end):
        name, _kind, mode, _seq, _inputs, _outputs, a, b, slots, _targets, hooks, caps = steps[s]
        k = s - start
        arg = f"deferred, {k}, "
        if mode == "traced" and s in opaque:
            mode = "opaque"
        body.append(f"# step {k}: {name} ({mode})")
        body.append(f"i = [{', '.join(buffer(s, slot) for slot in range(len(slots)))}]")
        consumed = [partial.pop((s, slot)) for slot in range(len(slots)) if (s, slot) in partial]
        if consumed:
            body.append(f"del {', '.join(consumed)}")
        capture_lines = []
        for j, c in caps:
            capture_lines.append(f"captured[{len(captures)}] = i[{j}]")
            captures.append(c)
        if mode != "skipped":
            # evaluate_function captures a needed node's inputs as they arrived.
            body.extend(capture_lines)
        # engine.cpp call_function: tensor pre-hooks and retains_grad hooks, pre-hooks,
        # apply (with validate_outputs), post-hooks.
        post = []
        # Outside the graph, the tensor pre-hooks the node got since the call was planned
        # run where the engine runs them, before its pre-hooks (see new_tensor_pre_hooks).
        first_pre = where == "_outside"
        for pos, (hook_kind, index, python, value_idx) in enumerate(hooks):
            h = hook - hook_base
            if hook_kind == "pre" and first_pre:
                body.append(f"i = new_tensor_pre_hooks(deferred, {k}, i)")
                first_pre = False
            if hook_kind == "post":
                post.append((pos, python, h if python else None))
                hook += python
            elif hook_kind == "retains_grad":
                assert (s, pos) in effects
                body.append(f"deferred.append(retained(i[{index}]))")
            elif python and hook_kind == "tensor_pre":
                v = value_idx
                body.append(f"i[{v}] = tensor_pre_hook{where}({arg}hooks[{h}], i[{v}])")
                hook += 1
            elif python:
                body.append(f"i = pre_hook{where}({arg}hooks[{h}], i)")
                hook += 1
            else:
                body.append(f"i = cpp_pre_hook(deferred, {k}, {pos}, i)")
        if mode == "traced":
            c, d = size_ranges[s]
            lifted = f", sizes[{c - sizes_base}:{d - sizes_base}]" if d > c else ""
            saved_k = saved_slots(a, b)
            done = None
            if s in unpacked:
                first, members, count = unpacked[s]
                if s == first:
                    groups[first] = f"u{len(groups)}"
                    relative = "".join(f"{m - start}, " for m in members)
                    body.append(f"{groups[first]} = unpack_saved(deferred, {k}, ({relative}))")
                u = f"{groups[first]}[{members.index(s)}]"
                saved_k = f"[*{saved_slots(a, b - count)}, *{u}]"
                # Dropped once the step ran, as the engine drops what a node unpacked.
                done = f"del {groups[first]}" if s == members[-1] else f"{u} = None"
            if s in factors:
                # Its gradient is a factor of a weight's gradient (see _products).
                body.append(f"f{k} = i[0]")
            if s in flushes:
                w, block, more = flushes[s]
                a, b, grads = stacks(block)
                acc = sums[w] if more else "None"
                body.append(f"{sums[w]} = product_block({acc}, {a}, {b})")
                body.append(f"del {grads}")
            if s in functions:
                n, writes = len(states), functions[s][1]
                states.append(functions[s][0])
                args = f"F{n}, i, {saved_k}, {writes}{lifted}"
                body.append(f"o{k} = backward_{n}(deferred, {k}, {args})")
            elif escapes and steps[s][1] == "python_function":
                body.append(f"o{k} = apply_function(deferred, {k}, i, {saved_k}{lifted})")
            else:
                body.append(f"o{k} = apply_traced({k}, i, {saved_k}{lifted})")
            if done is not None:
                body.append(done)
        elif mode in ("opaque", "eager_accumulate"):
            # The engine moves a node's gradients into its call (AccumulateGrad steals one
            # no one else holds; a Function's backward may free it): drop the outputs that
            # held them first, so that nothing but `i` (kept for post hooks) still does.
            producers = [p for p in dying.get(s, ()) if p != s]
            dying[s] = [p for p in dying.get(s, ()) if p not in producers]
            if producers:
                body.append(f"del {', '.join(f'o{p - start}' for p in producers)}")
            # A producer whose other outputs go to later steps still holds the gradients
            # it sent here (one output goes to one input; a gradient summed on arrival was
            # dropped then): drop those.
            for slot in range(len(slots)):
                for p, i in steps[s][8][slot]:
                    if start <= p < s and last[p] > s:
                        q = f"o{p - start}"
                        body.append(f"{q} = (*{q}[:{i}], None, *{q}[{i + 1}:])")
            # Nor `inc` (the driver hands a region its incoming gradients in a list of their
            # own, see _driver_source).
            taken = [incoming[(s, slot)] for slot in range(len(slots)) if (s, slot) in incoming]
            body.extend(f"inc[{j}] = None" for j in taken)
            run = "apply_opaque" if mode == "opaque" else "apply_accumulate"
            body.append(f"o{k} = {run}(deferred, {k}, i, {not post})")
        elif mode == "deferred_accumulate" and s in products:
            assert (s, -1) in effects
            args, dropped = last_block(s)
            body.append(f"deferred.append(product_factors(i[0], {args}))")
            body.append(dropped)
        elif mode == "deferred_accumulate":
            assert (s, -1) in effects
            body.append("deferred.append(i[0])")
        elif mode == "skipped":
            # Not needed: popped only to run its tensor pre-hooks and take its captures.
            if s in opaque:
                # Its node got tensor pre-hooks during an earlier backward (see
                # _engine._hooks_changed_during): called outside the graph.
                body.append(f"i = late_tensor_pre_hooks(deferred, {k}, i)")
            elif where == "_outside":
                body.append(f"i = new_tensor_pre_hooks(deferred, {k}, i)")
            body.extend(capture_lines)
        else:
            raise AssertionError(f"unknown step mode {mode!r}")
        for pos, python, h in post:
            if python:
                body.append(f"o{k} = post_hook{where}({arg}hooks[{h}], o{k}, i)")
            else:
                body.append(f"o{k} = cpp_post_hook(deferred, {k}, {pos}, o{k}, i)")
        for target, terms in _grouped(feeds.get(s, ()), f"o{k}"):
            if target in partial:
                terms.insert(0, partial[target])
            else:
                if target[0] >= end:
                    partial[target] = f"e{len(exports)}"
                    exports.append(target)
                else:
                    partial[target] = f"b{target[0] - start}_{target[1]}"
                terms[:0] = before(*target)
            body.append(f"{partial[target]} = {_sum(terms)}")
        # Drop gradients once their last reader ran, as the engine's buffers do.
        dead = [f"o{p - start}" for p in dying.get(s, ())]
        if dead:
            body.append(f"del {', '.join(dead)}")
    for w in products:
        if w >= end:
            # Sent on to a later region's accumulation: the products, not the sum their
            # nodes formed (which the compiler then drops).
            args, dropped = last_block(w)
            sent = partial[(w, 0)]
            body.append(f"{sent} = product_sum({sent}, {args})")
            body.append(dropped)
    returned = "".join(f"{partial[target]}, " for target in exports)
    lines = [
        "def region(inc, saved, sizes, hooks, deferred):",
        # (See _region_traced.)
        *(["    comptime(_region_traced)"] if states else []),
        f"    captured = [None] * {len(captures)}",
        *(f"    {line}" for line in body),
        f"    return ({returned}), captured",
    ]
    source = "\n".join(lines) + "\n"
    return (
        source,
        tuple(incoming),
        tuple(exports),
        tuple(captures),
        hook - hook_base,
        tuple(states),
    )


def _sum(terms: list[str]) -> str:
    if not terms:
        return "None"
    return terms[0] if len(terms) == 1 else f"buffer_sum({', '.join(terms)})"


def _grouped(feeds: Iterable[tuple[Any, int]], outputs: str) -> list:
    """``[(target, ["o3[i]", ...])]`` from ``[(target, i)]``, in first-seen order."""
    groups: dict[Any, list[str]] = {}
    for target, i in feeds:
        groups.setdefault(target, []).append(f"{outputs}[{i}]")
    return list(groups.items())


def _has_outputs(step: tuple) -> bool:
    return step[2] in ("traced", "opaque", "eager_accumulate")


def _driver_source(
    steps: list, regions: Sequence[Region], num_captures: int, hooks_in_graph: bool
) -> str:
    """``replay(grads, saved, sizes, hooks) -> captured``: calls the regions (``R0``,
    ``R1``, ...) in order, handing input buffers from region to region (a buffer that no
    region fed yet holds the root gradients), each after :func:`at`. A buffer is taken out
    of the driver's dict ``x`` when it is handed on, so that the region's ``inc`` is all that
    holds it (a node run as itself may free it, see :func:`_region_source`)."""
    names: dict[tuple[int, int], int] = {}
    count = 0
    out = [
        "def replay(grads, saved, sizes, hooks):",
        f"    captured = [None] * {num_captures}",
    ]
    if any(g.exports for g in regions):
        out.append("    x = {}")
    whole = len(regions) == 1
    for r, g in enumerate(regions):
        inc = []
        for target in g.incoming:
            if target in names:
                inc.append(f"x.pop({names.pop(target)})")
            else:
                roots = [f"grads[{i}]" for p, i in steps[target[0]][8][target[1]] if p < 0]
                inc.append(_sum(roots))
        for target in g.exports:
            names[target] = count
            count += 1
        exported = "".join(f"x[{names[target]}], " for target in g.exports)
        captured = "".join(f"captured[{c}], " for c in g.captures)
        (a, b), (c, d), (h0, h1) = g.saved, g.sizes, g.hooks
        args = (
            "saved, sizes, hooks" if whole else f"saved[{a}:{b}], sizes[{c}:{d}], hooks[{h0}:{h1}]"
        )
        hooks_ran = r > 0 and hooks_in_graph and regions[r - 1].hooks[1] > regions[r - 1].hooks[0]
        out.append(f"    d = at({g.start}{', True' if hooks_ran else ''})")
        out.append(f"    ({exported}), ({captured}) = R{r}([{', '.join(inc)}], {args}, d)")
        if g.writes is not None:
            out.append(f"    saved_checked({g.writes})")
    out.append("    return captured")
    return "\n".join(out) + "\n"


def build(
    plan: _core.Plan,
    compile_region: Callable[[Region, Callable[[], FunctionType]], Callable[..., Any]],
    hooks_in_graph: bool = True,
    opaque: frozenset[int] = frozenset(),
    region_size: int | None = None,
    saved: Sequence[Any] = (),
    escapes: bool = True,
    uncompiled: bool = False,
    breakless: bool = False,
    products: bool = False,
    scalars: frozenset[int] = frozenset(),
) -> Replay:
    """Generates the replay of ``plan``, each region's function compiled by
    ``compile_region(region, make)``, ``make()`` making the function. ``uncompiled``: the
    regions run as Python (no compiler traces them): their steps run as
    :func:`apply_uncompiled`, they call the hooks nodes got during the backward
    (:func:`new_tensor_pre_hooks`), and they sum gradients in
    place where the engine would (``_core.buffer_sum``; :func:`buffer_sum`, which compilers
    trace, always makes new sums). Compiled replays are ``cut`` (see :func:`regions`).
    ``breakless`` (a compiler that allows no graph break, ``fullgraph=True``): the steps with
    hooked saved values run as themselves (the unpack of a checkpointed block's values is a
    graph break, see :func:`unpack_saved`), and Python hooks are not traced where anything
    runs outside the graph. ``products``: see :func:`regions`."""
    steps = plan.steps()
    dynamo = not uncompiled and hooks_in_graph and escapes
    opaque, traced = _themselves(plan, steps, saved, dynamo, opaque)
    if breakless:
        opaque |= {step for step, _, _ in plan.hooked_steps()}
        if hooks_in_graph and outside_steps(steps, True, opaque):
            # A region after code that ran outside the graph cannot start over if a traced
            # hook in it fails to compile (which, with no graph break allowed, any hook Dynamo
            # cannot trace does): the hooks run between regions too.
            hooks_in_graph = False
    traced = {s: state for s, state in traced.items() if s not in opaque}
    found = regions(
        plan,
        steps,
        hooks_in_graph,
        opaque,
        region_size,
        saved,
        escapes,
        not uncompiled,
        products,
        scalars,
        traced,
    )
    namespace: dict[str, Any] = {"at": at, "buffer_sum": buffer_sum, "saved_checked": saved_checked}

    def make(g: Region) -> FunctionType:
        """The function of region ``g``, taken out of the scope it was defined in (its
        globals), so that no cycle holds it: a replay and its regions are freed as soon as
        the cache drops them (see _compile._Compiled)."""
        runtime = _UNCOMPILED if uncompiled else _RUNTIME if g.compiled else _AS_PYTHON
        scope: dict[str, Any] = dict(runtime)
        for n, state in enumerate(g.functions):
            scope[f"F{n}"] = state
            scope[f"backward_{n}"] = _function_backward_copy(n, scope)
        exec(compile(g.source, f"<replaygrad region {g.key[:12]}>", "exec"), scope)
        return scope.pop("region")

    # Regions of one key (one source) run one function; compiled ones make theirs only
    # where no compiled region of theirs is cached (a long chain's hundreds of regions
    # have three keys).
    functions: dict[str, FunctionType] = {}
    for r, g in enumerate(found):
        if g.compiled:
            namespace[f"R{r}"] = compile_region(g, lambda g=g: make(g))
        else:
            if g.key not in functions:
                functions[g.key] = make(g)
            namespace[f"R{r}"] = functions[g.key]
    driver = _driver_source(steps, found, plan.num_captures, hooks_in_graph)
    exec(compile(driver, f"<replaygrad replay {plan.key[:12]}>", "exec"), namespace)
    unpacks = [step for region in found for step in region.unpacks]
    return Replay(
        namespace.pop("replay"),
        found,
        hooks_in_graph,
        _replay_source(found, driver),
        tuple(sorted({*outside_steps(steps, hooks_in_graph, opaque), *unpacks})),
        escapes,
        breakless,
        tuple(
            (steps[s][6], steps[s][7])
            for s in sorted(opaque)
            if steps[s][2] == "traced" and steps[s][7] > steps[s][6]
        ),
    )
