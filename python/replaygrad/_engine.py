"""Where backward calls enter replaygrad.

replaygrad takes over inside the engine, or in front of it where nothing can tell.
``torch.autograd.backward`` and ``torch.autograd.grad`` reach ``Engine::execute`` as usual:
torch validates the arguments, the engine checks the root gradients, builds its GraphTask
(dependencies, exec_info) and makes it current. Then, instead of running the graph, it hands
the call to the function in its compiled-autograd slot, which replaygrad's shim fills
(``_core.engine_hook_install``). On a thread where replaygrad is enabled, that hook calls
:func:`_on_engine_call` with the call; everywhere else (other threads, backward calls made
inside a replay) the engine runs as it always does. So errors, ``queue_callback``,
``_current_graph_task_id`` and the other GraphTask-dependent APIs behave as in eager.

A plain ``backward()`` whose replay runs no code of the user's (no hook but retains_grad's,
no custom Function, no saved_tensors_hooks), which therefore cannot observe the GraphTask,
is replayed before it reaches the engine (:func:`_engine_run_backward`): the engine's
dependency count and GraphTask cost about as much as planning the call.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
import threading
from collections import Counter
from collections.abc import Iterator
from traceback import walk_tb
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from . import _core
from . import _replay as _replay_module
from ._compile import Config, Entry, _cache_entries, cache, compile_failed, recompile_limit
from ._explain import table
from ._logging import Lazy, log, plan_log
from ._replay import (
    BackwardBrokeGraph,
    alike_functions,
    broken_functions,
    current_autograd_node,
    hook_arguments,
    may_edit_hooks,
    node_error,
    non_strided_steps,
    replaying,
    running,
    traced_hooks_concern,
    traced_step,
)

_tls = threading.local()
_install_lock = threading.Lock()
_install_count = 0


def current_config() -> Config | None:
    return getattr(_tls, "config", None)


def _torch_compiled_autograd_enabled() -> bool:
    ca = getattr(torch._dynamo, "compiled_autograd", None)
    return bool(getattr(ca, "compiled_autograd_enabled", False))


# torch clears the engine's compiled-autograd slot (sets it to None) whenever its own
# compiled autograd steps aside: `compiled_autograd._disable()` runs around every AOTAutograd
# compile and functorch transform, and `reset()`. Backward calls inside a `_disable()` region
# (AOTAutograd traces joint graphs with autograd.grad) must reach the engine, so replaygrad
# stays out of the slot until the outermost region ends, then takes it back; a slot cleared
# outside such a region is taken back at once. While torch's compiled autograd is on, it
# keeps the slot.
_ca_module = torch._C._dynamo.compiled_autograd
_torch_set_autograd_compiler = _ca_module.set_autograd_compiler
_torch_ca_disable = torch._dynamo.compiled_autograd._disable
_disable_depth = 0


def _reclaim_slot() -> None:
    if _install_count > 0 and _disable_depth == 0:
        _core.engine_hook_install(_on_engine_call)


def _set_autograd_compiler(compiler: Any, dynamic: bool) -> Any:
    prior = _torch_set_autograd_compiler(compiler, dynamic)
    if compiler is None:
        _reclaim_slot()
    return prior


@contextlib.contextmanager
def _ca_disable() -> Iterator[None]:
    global _disable_depth
    with _install_lock:
        _disable_depth += 1
    try:
        with _torch_ca_disable():
            yield
    finally:
        with _install_lock:
            _disable_depth -= 1
            _reclaim_slot()


_torch_current_autograd_node = torch._C._current_autograd_node


_torch_engine_run_backward = torch.autograd._engine_run_backward


def _patch_torch(install: bool) -> None:
    if install:
        _ca_module.set_autograd_compiler = _set_autograd_compiler
        torch._dynamo.compiled_autograd._disable = _ca_disable
        torch._C._current_autograd_node = current_autograd_node
        torch.autograd._engine_run_backward = _engine_run_backward_outside_dynamo
    else:
        _ca_module.set_autograd_compiler = _torch_set_autograd_compiler
        torch._dynamo.compiled_autograd._disable = _torch_ca_disable
        torch._C._current_autograd_node = _torch_current_autograd_node
        torch.autograd._engine_run_backward = _torch_engine_run_backward


#: What :func:`_engine_run_backward` leaves for the hook: the plan of the call the engine is
#: given next, or this marker for "the engine runs it".
_ENGINE_RUNS = object()


def _engine_run_backward(outputs: Any, *args: Any, **kwargs: Any) -> tuple:
    """``torch.autograd``'s call into the engine (after it made and checked the root
    gradients), while replaygrad is installed. A plain ``backward()`` on an enabled thread
    whose replay runs torch's formulas only is replayed here, without the engine: its
    GraphTask and dependency count, which nothing in such a call can observe, cost about as
    much as planning it (see :func:`_replay_without_engine`). Any other call goes to the
    engine, and through its hook. So is ``torch.autograd.grad`` and ``backward(inputs=)``
    with tensors as inputs (see :func:`_grad_without_engine`). What it raises keeps no
    frame of the replay's (see :func:`_clear_frames`)."""
    try:
        return _run_backward(outputs, args, kwargs)
    except BaseException as error:
        _clear_frames(error.__traceback__)
        raise


def _run_backward(outputs: Any, args: tuple, kwargs: dict) -> tuple:
    if len(args) == 4 and not args[2] and kwargs.get("accumulate_grad") is True:
        # backward(tensors, grads, retain_graph, create_graph=False, inputs)
        if not args[3]:
            if _replay_without_engine(outputs, args[0], args[1]) is not None:
                return ()
        elif _grad_without_engine(outputs, args[0], args[1], args[3], True, True) is not None:
            return ()
    elif len(args) == 5 and not args[2] and kwargs.get("accumulate_grad") is False:
        # grad(outputs, grad_outputs, retain_graph, create_graph=False, inputs, allow_unused)
        result = _grad_without_engine(outputs, args[0], args[1], args[3], bool(args[4]), False)
        if result is not None:
            return result
    try:
        return _torch_engine_run_backward(outputs, *args, **kwargs)
    finally:
        _tls.planned = None


def _raising_step(error: BaseException, base: int) -> int:
    """The step of the replay (whose raising region starts at step ``base``) whose user code
    raised ``error``, as its frame of the function that called that code tells (a hook's or
    a Python Function backward's caller, whose arguments are the region's deferred list and
    step: Dynamo runs it as Python from the graph break the raise makes); 0 if none does.
    The steps before it ran, in the engine: where they ran in a compiled graph, nothing
    else tells (see ``running.reached``)."""
    for frame, _ in walk_tb(error.__traceback__):
        code = frame.f_code
        if code.co_filename == _REPLAY_FILE and code.co_varnames[:2] == ("deferred", "step"):
            step = frame.f_locals.get("step")
            return base + step if type(step) is int else 0
    return 0


_REPLAY_FILE = _replay_module.__file__

#: The directories whose frames :func:`_clear_frames` clears: replaygrad's and torch's.
_OWN_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _clear_frames(tb: Any) -> None:
    """Clears the locals of the finished frames of a replay in a traceback: replaygrad's (its
    generated code's too) and torch's between them (Dynamo's wrappers of compiled regions).
    They hold the call's gradients and saved values, which an error the user keeps (stored,
    or in a test report) would keep alive with them, where eager's traceback holds the
    user's frames only (the C++ engine's are none). The user's frames (a hook's, below) keep
    theirs."""
    frames = [frame for frame, _ in walk_tb(tb)]
    own = [n for n, frame in enumerate(frames) if _own_code(frame.f_code)]
    if not own:
        return
    for frame in frames[own[0] : own[-1] + 1]:
        name = frame.f_code.co_filename
        if _own_code(frame.f_code) or name.startswith(_TORCH_DIR):
            with contextlib.suppress(RuntimeError):  # still running (the caller's)
                frame.clear()


def _own_code(code: Any) -> bool:
    return code.co_filename.startswith((_OWN_DIR, "<replaygrad "))


#: What is installed: a function compiled with ``torch.compile`` that calls
#: ``autograd.grad`` or ``backward()`` breaks its graph there, and Dynamo runs the call with
#: its frame evaluation on, compiling every Python frame the call enters that is not
#: torch's: here, the whole replay (hundreds of frames, graph breaks and warnings about
#: replaygrad's builtins). The call runs outside Dynamo, as the engine's C++ does; the
#: replay's regions, compiled with their own ``torch.compile``, still run compiled.
_engine_run_backward_outside_dynamo = torch.compiler.disable(_engine_run_backward)


#: The input types :func:`_grad_without_engine` takes: a Parameter is a plain tensor to the
#: engine.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _grad_without_engine(
    tensors: tuple,
    grads: tuple,
    retain_graph: bool,
    inputs: tuple,
    allow_unused: bool,
    accumulate_grad: bool,
) -> tuple | None:
    """Replays ``autograd.grad`` (or, ``accumulate_grad``, ``backward(inputs=)``) without
    the engine as :func:`_replay_without_engine` does, where its inputs are plain tensors
    that require grad (otherwise the engine raises); returns what ``run_backward`` would
    (the gradients of the inputs, or ()), or None to have the engine take the call."""
    if not all(type(t) in _PLAIN and t.requires_grad and not t.is_nested for t in inputs):
        return None
    if accumulate_grad:
        for t in inputs:  # as run_backward does first, also if the engine takes the call
            t.retain_grad()
    result = _replay_without_engine(tensors, grads, retain_graph, inputs, accumulate_grad)
    if result is None or accumulate_grad:
        return result
    unused = next((i for i, g in enumerate(result) if g is None), None)
    if not allow_unused and unused is not None:
        raise RuntimeError(
            f"The differentiated Tensor at index {unused} appears to not have been used in "
            "the graph. Set allow_unused=True if this is the desired behavior."
        )
    return result


def _replay_without_engine(
    tensors: tuple,
    grads: tuple,
    retain_graph: bool,
    inputs: tuple | None = None,
    accumulate_grad: bool = True,
) -> tuple | None:
    """Replays ``backward(tensors, grads)`` (with ``inputs``: see
    :func:`_grad_without_engine`) without the engine, if nothing can tell the difference,
    returning what the replay returns; None to have the engine take the call (then handing
    a plan made here to the hook, so that the call is planned once).

    Nothing can when no code of the user's runs during the call (no hook but
    retains_grad's, no custom Function, no saved_tensors_hooks, no step that runs as
    itself: ``Plan.runs_only_formulas``), the call is no backward within a backward (inside
    a replay or a node the engine runs) and the engine would take the root gradients as
    they are (each of the root's dtype, device, shape and layout; ``_make_grads`` checked
    the shapes, validate_outputs would cast or reduce the others). The engine also takes
    calls made while it logs every node (``TORCH_LOGS``), profiles or detects anomalies,
    and those of torch's transforms and modes."""
    config = current_config()
    if (
        config is None
        or _disable_depth
        or getattr(_tls, "without_engine", False)
        or replaying()
        or torch._C._current_graph_task_id() != -1
        or _torch_compiled_autograd_enabled()
        or torch._C._autograd._profiler_enabled()
        or torch.autograd.graph.log.getEffectiveLevel() <= logging.DEBUG
        or _engine_only_reason() is not None
    ):
        return None
    if len(tensors) != len(grads):
        return None  # the engine raises
    for t, g in zip(tensors, grads):
        if not (
            type(t) is torch.Tensor
            and type(g) is torch.Tensor
            and t.grad_fn is not None
            and not (t.is_nested or g.is_nested)  # (whose shapes are no sizes)
            and g.dtype == t.dtype
            and g.device == t.device
            and g.layout == t.layout == torch.strided
            and g.shape == t.shape
        ):
            return None
    try:
        plan = _core.plan_backward(
            tensors, grads, retain_graph, inputs, accumulate_grad, config.compiler is not None
        )
    except RuntimeError:
        return None  # the engine plans it again, and raises where eager does
    if not plan.runs_only_formulas:
        _tls.planned = plan
        return None
    # As in the hook's callback, backward calls made during the replay (e.g. by a compiler)
    # run in the engine; and as in run_backward, the C++ warnings of the nodes the shim runs
    # reach Python's warnings when the call ends.
    _tls.without_engine = True
    enabled = _core.engine_set_enabled(False)
    try:
        with _core.CppWarnings():
            result = _replay(config, plan)
    finally:
        _core.engine_set_enabled(enabled)
        _tls.without_engine = False
    if result is None:
        _tls.planned = _ENGINE_RUNS
    return result


class routed(contextlib.ContextDecorator):
    """Routes this thread's backward calls through replaygrad with ``config`` while active
    (``None``: to the engine).

    Nests: the innermost block wins, and the prior state is restored on exit, also when the
    block raises. The engine hook is installed while any thread has a block active. One
    object may be entered again, also within its own block and from several threads (each
    exit restores what its thread's entry found); as a decorator, each call enters a block
    of its own.
    """

    def __init__(self, config: Config | None) -> None:
        self.config = config
        # Per thread, per entry not yet exited: whether it installed, the prior config and
        # engine state.
        self._local = threading.local()

    def _recreate_cm(self) -> routed:
        return routed(self.config)

    def _entries(self) -> list[tuple[bool, Config | None, bool]]:
        entries = getattr(self._local, "entries", None)
        if entries is None:
            entries = self._local.entries = []
        return entries

    def __enter__(self) -> None:
        global _install_count
        installs = self.config is not None
        if installs:
            if _torch_compiled_autograd_enabled():
                raise RuntimeError(
                    "replaygrad cannot run while torch._dynamo.compiled_autograd is enabled: "
                    "both take over the autograd engine's compiled-autograd slot"
                )
            with _install_lock:
                if _install_count == 0:
                    _core.engine_hook_install(_on_engine_call)
                    _patch_torch(True)
                _install_count += 1
        prior = current_config()
        _tls.config = self.config
        self._entries().append((installs, prior, _core.engine_set_enabled(installs)))

    def __exit__(self, *exc: object) -> None:
        global _install_count
        installs, prior, prior_enabled = self._entries().pop()
        _tls.config = prior
        _core.engine_set_enabled(prior_enabled)
        if installs:
            with _install_lock:
                _install_count -= 1
                if _install_count == 0:
                    _patch_torch(False)
                    _core.engine_hook_uninstall()


_eager_reasons_logged: set[str] = set()


def _leave_to_engine(reason: str, level: int = logging.INFO) -> None:
    """Logs, once per reason, why the engine runs a call itself."""
    if reason not in _eager_reasons_logged:
        _eager_reasons_logged.add(reason)
        log.log(level, "replaygrad: the engine runs this backward call itself: %s", reason)


def _on_engine_call(call: Any) -> tuple[torch.Tensor | None, ...] | None:
    """The engine hook's callback: replays the call and returns the captured gradients (empty
    for backward()), or None to let the engine run it. A replay runs with Dynamo off, as it
    does when called through ``torch.autograd`` (see
    :data:`_engine_run_backward_outside_dynamo`), also where the engine is called some other
    way from code Dynamo runs (``Variable._execution_engine.run_backward`` in a compiled
    function): Dynamo would compile each Python frame of the replay."""
    if _eval_frame_callback() is not None:
        return _on_engine_call_outside_dynamo(call)
    config = current_config()
    if config is None:
        return None
    planned = getattr(_tls, "planned", None)
    if planned is not None:
        _tls.planned = None
        if planned is _ENGINE_RUNS:
            return None
        if planned.adopt(call):
            return _replay(config, planned)
    reason = _engine_only_reason()
    if reason is not None:
        _leave_to_engine(reason)
        return None
    try:
        plan = _core.plan_engine_call(call, config.compiler is not None)
    except RuntimeError as error:
        # A saved value that cannot be unpacked (released graph, modified in place, an
        # unpack hook raising): the engine raises it where eager does, after running the
        # nodes (and their hooks and accumulations) that come before.
        log.debug("replaygrad: planning failed, the engine runs the call: %s", error)
        _leave_to_engine("planning the call raised; the engine raises it where eager does")
        return None
    if plan is None:
        _leave_to_engine("create_graph=True (higher-order gradients)")
        return None
    return _replay(config, plan)


_on_engine_call_outside_dynamo = torch.compiler.disable(_on_engine_call)
_eval_frame_callback = torch._C._dynamo.eval_frame.get_eval_frame_callback


def _engine_only_reason() -> str | None:
    """Why this call must run in the engine itself, if it must."""
    if torch._C._are_functorch_transforms_active():
        return "a functorch transform (vmap/grad) is active"
    if torch.is_anomaly_enabled():
        # The engine's per-node NaN checks and "Error detected in" context.
        return "anomaly detection is enabled"
    if torch._C._len_torch_dispatch_stack() > 0:
        # The user's mode must see the backward's ops, and only those.
        return "a TorchDispatchMode is active"
    if torch.autograd.forward_ad._current_level >= 0:
        # Saved values may be dual tensors: the engine's formulas then compute the tangents
        # of the gradients too, and a replay takes the saved values without them.
        return "a forward-mode AD level is active (torch.autograd.forward_ad.dual_level)"
    return None


#: The types of values a compiled replay takes (saved values and root gradients may be
#: undefined).
_PLAIN_VALUES = (*_PLAIN, type(None))


_batched = torch._C._functorch.is_legacy_batchedtensor


def _unfakeable(grads: tuple, saved: list) -> bool:
    """Whether root gradients or saved values of the call are values Dynamo cannot fake:
    tensor subclasses, or root gradients batched by ``is_grads_batched=True`` (legacy vmap:
    plain tensors to Python)."""
    return not (
        all(type(g) in _PLAIN_VALUES for g in grads) and _core.only_types(saved, _PLAIN_VALUES)
    ) or any(g is not None and _batched(g) for g in grads)


def _recompiled_for_hooks(entry: Entry, plan: _core.Plan) -> bool:
    """After a call of ``entry``'s replay, with Python hooks traced into its graph, in which
    Dynamo compiled graphs: whether it recompiled on a cache hit for what the hooks touch
    (state Dynamo guards on, e.g. a list's length) rather than for new input shapes or
    strides (e.g. a changed batch size, after which Dynamo makes sizes dynamic)."""
    shapes = tuple(map(_layout_of, (*plan.root_grads(), *plan.saved_values())))
    before, entry.shapes = entry.shapes, shapes
    return entry.calls > 1 and before == shapes


def _layout_of(value: Any) -> tuple | None:
    if not isinstance(value, torch.Tensor):
        return None
    return (value.shape, value.stride() if value.layout == torch.strided else None)


def _graphs_compiled() -> int:
    """Graphs Dynamo compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


#: The module whose frames are on the stack while Dynamo compiles a frame.
_CONVERT_FRAME = torch._dynamo.convert_frame.__file__


def _compile_failure(error: BaseException) -> bool:
    """Errors that mean Dynamo or the backend failed on a replay, not the backward itself
    (none that wraps a traced node's own error, see :func:`node_error`): Dynamo's, and those
    raised while it compiled a frame, which it lets through as they are (e.g. an assertion
    of its own)."""
    if node_error(error) is not None:
        return False
    return isinstance(error, torch._dynamo.exc.TorchDynamoException) or any(
        frame.f_code.co_filename == _CONVERT_FRAME for frame, _ in walk_tb(error.__traceback__)
    )


def _summary(error: BaseException) -> str:
    """``Type: first line of the message``, for a log line."""
    message = str(error)
    return f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"


def _note_compile_failure(error: BaseException, plan: _core.Plan, config: Config) -> None:
    """Names the plan whose replay failed to compile on the error the caller raises."""
    error.add_note(
        f"replaygrad: while compiling the replay of plan {plan.key} with "
        f"{config.compiler!r}; enable(..., fallback='eager') runs such calls in the engine"
    )


_DDP = torch.nn.parallel.DistributedDataParallel

#: Why a replay's hooks move out of the graph when one reads the current autograd node.
_ASKS_NODE = (
    "a Python hook calls torch._C._current_autograd_node(), which is only set for code "
    "outside the graph"
)

#: Why a replay's hooks move out of the graph when one may read or write a `.grad` or run
#: a backward.
_OBSERVES_STEPS = (
    "a Python hook may read or write a tensor's .grad, or run a backward, which see the "
    "effects of the steps before it (accumulations, retain_grad, freed saved values) only "
    "outside the graph"
)


def _call(entry: Entry, plan: _core.Plan, config: Config, args: tuple, run: running) -> list:
    """Calls the entry's replay with ``args`` (see :func:`_call_until_done`), outside any DDP
    forward: for a backward inside one (e.g. ``autograd.grad`` of an input), Dynamo would
    take the replay for that forward and split it at DDP's gradient buckets
    (DDPOptimizer)."""
    ddp = _DDP._active_ddp_module
    _DDP._active_ddp_module = None
    try:
        return _call_until_done(entry, plan, config, args, run)
    finally:
        _DDP._active_ddp_module = ddp


def _call_until_done(
    entry: Entry, plan: _core.Plan, config: Config, args: tuple, run: running
) -> list:
    """Calls the entry's replay with ``args``. While the call can still start over, steps
    that keep the compiler from compiling it are made to run as themselves and the call is
    made again: steps that met sparse (or other non-strided) tensors only present at run
    time (e.g. the gradient of ``gather(..., sparse_grad=True)``), and a step whose node
    raised while being traced (see :func:`traced_step`); likewise for hooks and graph
    breaks the compiler fails on (see :func:`_remedy`). Once it cannot start over, the error
    is raised, and a compile failure's remedy is for later calls (the error marked
    ``__replaygrad_remedied__``)."""
    while True:
        run.breaks = entry.replay.breaks
        try:
            with run, torch.no_grad(), non_strided_steps() as non_strided:
                return entry.replay.fn(*args)
        except Exception as error:
            failed_to_compile = _compile_failure(error)
            if entry.capture and failed_to_compile and run.can_restart():
                run.pending.clear()
                cache.stop_capturing(entry, plan, config)
                continue
            traced_code = bool(args[3] or entry.replay.functions)
            remedy = _remedy(entry, plan, error, failed_to_compile, non_strided, traced_code)
            if remedy is None:
                raise
            if not run.can_restart():
                # (_replay stops capturing; with fallback="eager", later calls run in the
                # engine.)
                if failed_to_compile and not entry.capture and config.fallback is None:
                    _apply_remedy(remedy, entry, plan, config)
                    error.__replaygrad_remedied__ = True  # type: ignore[attr-defined]
                raise
        run.pending.clear()
        in_graph = entry.replay.hooks_in_graph
        _apply_remedy(remedy, entry, plan, config)
        if entry.replay.hooks_in_graph != in_graph:
            # A rebuild moved the hooks (regions cut at the graph breaks move them out of
            # the graph too): the call starts over with them in the form its replay takes.
            args = (*args[:3], hook_arguments(plan.hook_dicts(), entry.replay.hooks_in_graph))


def _remedy(
    entry: Entry,
    plan: _core.Plan,
    error: Exception,
    failed_to_compile: bool,
    non_strided: set[int],
    hooks: bool,
) -> str | set[int] | None:
    """What to change in ``entry``'s replay after ``error`` for the call to succeed: steps
    to run as themselves, or where its hooks run (``hooks``: it has Python hooks or Python
    Functions' backwards traced by Dynamo, which go where its hooks go); None if nothing
    would help."""
    step = traced_step(error)
    if step is not None and step not in entry.opaque:
        if isinstance(node_error(error), BackwardBrokeGraph):
            # The Function's other nodes would break the graph too, one restart each.
            return alike_functions(plan, entry.replay, {step})
        return {step}
    if not failed_to_compile:
        return None
    steps = non_strided - entry.opaque
    in_graph = entry.replay.hooks_in_graph and hooks
    if steps:
        return steps
    if in_graph and entry.replay.escapes:
        # Traced Python hooks the compiler fails on: first kept in the graph (a compiler
        # allowing no graph break failed where one would leave it),
        return "in graph"
    if entry.replay.breaks and not entry.replay.breakless:
        # then what runs outside the graph between compiled regions (such a compiler failed
        # on a graph break),
        return "between regions"
    if in_graph:
        # then the hooks outside the graph, where one raises as in eager, or works.
        return "outside"
    return None


def _apply_remedy(remedy: str | set[int], entry: Entry, plan: _core.Plan, config: Config) -> None:
    """Rebuilds ``entry``'s replay with ``remedy`` (see :func:`_remedy`)."""
    if remedy == "in graph":
        cache.keep_hooks_in_graph(entry, plan, config)
    elif remedy == "between regions":
        cache.run_outside_between_regions(entry, plan, config)
    elif remedy == "outside":
        cache.move_hooks_outside(entry, plan, config, "compiling its traced hooks failed")
    else:
        assert isinstance(remedy, set)
        cache.run_as_themselves(entry, plan, config, remedy)


def _hooks_changed_during(
    entry: Entry,
    plan: _core.Plan,
    config: Config,
    in_graph: bool,
    dicts: list[dict],
    hooks: list,
    handles: bool,
    outside: bool,
    shrunk: bool,
) -> list[str]:
    """After a call during which hooks may have changed: ``handles``, some got a
    ``RemovableHandle`` (every hook's handle is one, numbered in order); ``outside``, code
    ran outside the graph, which may have called ``retain_grad`` (no handle); ``shrunk``, a
    traced hook's dict has fewer callables than the call took. A traced step of ``entry``'s
    compiled replay calls the hooks its node had when the call was planned, and a Python
    hook traced into the graph (``in_graph``) the callables its dict (of ``dicts``) had then
    (``hooks``), so a hook registered during the backward is not called if its node had not
    run yet, and a callable removed from its dict (by a hook that ran before it, traced or
    not) is called all the same; nor does a step the call does not need call the tensor
    pre-hooks its node got (the engine does, before taking ``autograd.grad``'s captures
    there). Such steps are made to run as themselves, where a node calls the hooks it got
    since the call was planned (a step not needed, its tensor pre-hooks only), and such
    hooks outside the graph, where they read their dict when reached, as the engine does.
    Returns the changes found, described (none: the replay follows what changed)."""
    # Nodes the call does not need count too: the engine calls their tensor pre-hooks
    # (before taking autograd.grad's captures there).
    steps = set(plan.steps_with_new_hooks()) - entry.opaque if handles or outside else set()
    added = False
    removed = shrunk and entry.replay.hooks_in_graph
    if handles and in_graph and entry.replay.hooks_in_graph and hooks:
        # Callables added have handles; with one added, one removed need not shorten a dict.
        # Counted, as one callable can be registered more than once.
        for fns, before in zip(hook_arguments(dicts, True), hooks):
            now, then = Counter(map(id, fns)), Counter(map(id, before))
            added = added or bool(now - then)
            removed = removed or bool(then - now)
    changes = []
    if steps:
        order = plan.order()
        nodes = ", ".join(f"{order[s]} (step {s})" for s in sorted(steps))
        changes.append(f"hooks registered on nodes of its graph ({nodes})")
        cache.run_as_themselves(
            entry, plan, config, steps, "hooks were registered on their nodes during a backward"
        )
    if added:
        changes.append("callables added to hooks traced into the compiled graph")
    if removed:
        changes.append("callables removed from hooks traced into the compiled graph")
    if added or removed:
        cache.move_hooks_outside(
            entry,
            plan,
            config,
            "callables were added to or removed from its hooks during a backward",
        )
    return changes


def _replay(config: Config, plan: _core.Plan) -> tuple[torch.Tensor | None, ...] | None:
    plan_log.debug("plan:\n%s", Lazy(lambda: table(plan)))
    grads = plan.root_grads()
    # A compiled replay takes 0-dim float64 values lifted (see _replay.replay_inputs).
    lifted = config.compiler is not None
    saved = plan.saved_values(lift=lifted)
    if config.compiler is not None and (plan.nested_inputs or _unfakeable(grads, saved)):
        # Dynamo cannot fake such tensors (e.g. LoggingTensor): every step would be a graph
        # break and a frame of its own to compile, so the replay runs uncompiled. Nor can it
        # resume after a graph break with a nested tensor, a gradient the replay passes
        # between steps, so a graph with one runs uncompiled as well.
        config = Config(None, fallback=config.fallback)
    try:
        entry = cache.get(plan, config)
    except Exception as error:
        if not compile_failed(error):
            raise
        # The compiler failed when given the replay (nothing of the call ran).
        if config.fallback == "eager":
            _leave_to_engine(
                f"compiling the replay of plan {plan.key} failed ({_summary(error)})",
                logging.WARNING,
            )
            return None
        _note_compile_failure(error, plan, config)
        raise
    if entry is None:
        _leave_to_engine(
            f"{recompile_limit()} replays of one graph shape with other node state (e.g. a "
            "scalar argument that changes every call) were compiled already "
            "(torch._dynamo.config.recompile_limit): new variants run in the engine",
            logging.WARNING,
        )
        return None
    if entry.failed:
        _leave_to_engine(f"compiling the replay of plan {plan.key} failed before")
        return None
    dicts = plan.hook_dicts()
    vetting = None
    if not entry.vetted and config.compiler is not None:
        # The replay's first call runs uncompiled, as the engine would, with a hook that may
        # change hooks (a traced step calls the hooks its node had when the call was
        # planned), or while torch's profiler records: its profile is then eager's (the
        # engine's events, with the forward ops' sequence numbers), not that of a compile.
        before = hook_arguments(dicts, True)
        if torch._C._autograd._profiler_enabled() or (dicts and may_edit_hooks(before)):
            in_graph = entry.replay.hooks_in_graph
            vetting = (entry, config, in_graph, before if in_graph else [])
            entry = cache.uncompiled(plan, config)
            config = Config(None, fallback=config.fallback)
    if lifted and config.compiler is None:
        saved = plan.saved_values()  # the uncompiled replay takes them as they are
    for a, b in entry.replay.unread:
        # Saved by a node that runs as itself, with its own: neither the plan nor the replay
        # keeps them, so that they are freed when the node releases them, as in the engine.
        plan.forget_saved(a, b)
        saved[a:b] = [None] * (b - a)
    hooks = hook_arguments(dicts, entry.replay.hooks_in_graph)
    if entry.replay.hooks_in_graph and hooks:
        concern = traced_hooks_concern(hooks)
        if concern is not None:
            reason = _ASKS_NODE if concern == "node" else _OBSERVES_STEPS
            cache.move_hooks_outside(entry, plan, config, reason)
            hooks = hook_arguments(dicts, in_graph=False)
    in_graph = entry.replay.hooks_in_graph
    graphs = _graphs_compiled()
    deferred: list[torch.Tensor | None] = []
    run = running(plan, deferred)
    handles = RemovableHandle.next_id
    try:
        captured = _call(entry, plan, config, (grads, saved, plan.sizes(), hooks), run)
    except BaseException as error:  # KeyboardInterrupt too
        raised = node_error(error)
        if not _compile_failure(error):
            step = traced_step(error)
            if step is not None:
                # Raised while a later part of the call was traced, after parts of it ran
                # (so the call could not start over): later calls run that step as itself.
                cache.run_as_themselves(entry, plan, config, {step})
                raised.add_note(
                    f"replaygrad: step {step} of this backward raised while it was being "
                    "compiled, after earlier steps ran; later calls run it as itself"
                )
            elif config.compiler is not None and isinstance(error, Exception) and run.can_restart():
                # Raised by compiled code as it ran (an op of a traced hook or Function
                # backward failing on the values, e.g. an index out of range), before
                # anything of the call was seen: a compiled graph's effects come when it
                # ends, so those of the steps before the failing one (accumulations,
                # released saved values) are not known. The engine runs the call from the
                # start, as nothing of it ran, and raises eager's error with eager's effects
                # before it (or runs it, where the compiled code was at fault).
                _leave_to_engine(
                    f"a compiled replay of plan {plan.key} raised as it ran "
                    f"({_summary(error)}): the engine runs such a call from the start, "
                    "raising where eager does",
                    logging.WARNING,
                )
                return None
            # The entry stays (this is no compile failure): what was compiled serves the next
            # call, so a backward that raises on every call, e.g. in a test of its error,
            # compiles once.
            # The engine has run the accumulations and retain_grads before the failing step,
            # and released the saved variables of the nodes before it.
            del saved
            plan.run_deferred(deferred, complete=False)
            plan.release_variables(max(run.reached, _raising_step(error, run.base)))
            if raised is not None and raised is not error:
                raise raised.with_traceback(raised.__traceback__) from None
            raise
        if entry.capture:
            cache.stop_capturing(entry, plan, config)
        if not run.can_restart():
            # Hooks, graph breaks or accumulations of this call ran before the compile of a
            # later region failed: the engine would run them again. As after an error, the
            # effects reached are performed.
            del saved
            plan.run_deferred(deferred, complete=False)
            if getattr(error, "__replaygrad_remedied__", False):
                # Later calls run what failed another way (see _call_until_done).
                error.add_note(
                    f"replaygrad: compiling a region of the replay of plan {plan.key} failed "
                    "after parts of this backward ran, so it could not start over; later "
                    "calls run the replay rebuilt for what failed"
                )
                raise
            if config.fallback == "eager":
                entry.failed = True
                error.add_note(
                    f"replaygrad: compiling a region of the replay of plan {plan.key} failed "
                    "after parts of this backward ran, so the engine cannot run it instead; "
                    "later calls with this plan run in the engine"
                )
                raise
        elif config.fallback == "eager":
            log.warning(
                "replaygrad: compiling the replay of plan %s failed (%s); this and later "
                "calls with this plan run in the engine",
                plan.key,
                _summary(error),
            )
            entry.failed = True
            return None
        cache.discard(config, plan.key)
        _note_compile_failure(error, plan, config)
        raise
    del saved
    # run_deferred empties the list: a gradient held by nothing else can then be stolen by
    # AccumulateGrad rather than copied, as in the engine.
    plan.run_deferred(deferred)
    entry.calls += 1
    # Hooks registered during the call have handles; `retain_grad` (a retains_grad hook) has
    # none, and only code that ran outside the graph can call it (Dynamo breaks the graph
    # there).
    new_handles = RemovableHandle.next_id != handles
    if vetting is not None:
        # The first call ran uncompiled, as the engine would; the compiled replay is rebuilt
        # for what its hooks changed (every later call then calls them as in eager, as after
        # a compiled call that warns).
        entry, config, in_graph, hooks = vetting
    # A callable only removed from a traced hook's dict (no handle) shortens it.
    shrunk = (
        config.compiler is not None
        and in_graph
        and any(map(operator.lt, map(len, dicts), map(len, hooks)))
    )
    # Code ran outside the graph: every hook, in an uncompiled first call.
    outside = vetting is not None or not run.restartable
    if config.compiler is not None and (new_handles or outside or shrunk):
        changes = _hooks_changed_during(
            entry, plan, config, in_graph, dicts, hooks, new_handles, outside, shrunk
        )
        if changes and vetting is None:
            log.warning(
                "replaygrad: hooks changed during a compiled backward (%s). The compiled "
                "replay called the hooks the graph had when the call was planned: not new ones "
                "whose node had not run yet, and removed ones all the same (eager does not "
                "call one removed before its hook was reached; one that removes itself it "
                "does); later calls with this graph call them as in eager (compiler=None does "
                "in this call too, and so does a first call with a hook whose code names a "
                "hook's registration or removal)",
                "; ".join(changes),
            )
    entry.vetted = True
    if entry.replay.functions and _cache_entries is not None and _graphs_compiled() > graphs:
        broken = broken_functions(entry.replay, _cache_entries)
        if broken:
            cache.run_as_themselves(
                entry,
                plan,
                config,
                alike_functions(plan, entry.replay, broken),
                "Dynamo broke the graph in their backward",
            )
    if entry.replay.hooks_in_graph:
        traced_code = hooks or entry.replay.functions
        if traced_code and _graphs_compiled() > graphs and _recompiled_for_hooks(entry, plan):
            cache.move_hooks_outside(
                entry,
                plan,
                config,
                "it recompiled on a cache hit: its Python hooks or Python Functions' "
                "backwards touch state Dynamo guards on",
            )
        elif run.asked_node:
            cache.move_hooks_outside(entry, plan, config, _ASKS_NODE)
    if config.compiler is not None and not run.data_dependent <= entry.capture:
        cache.capture_data_dependent(entry, plan, config, run.data_dependent)
    plan.release_variables()
    return () if plan.accumulate_grad else tuple(captured)
