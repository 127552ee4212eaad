"""Where backward calls enter replaygrad.

``torch.autograd.backward`` (and so ``Tensor.backward``) validates its arguments in Python
and then calls ``torch.autograd._engine_run_backward``, which hands them to the C++ engine.
While replaygrad is active on a thread, that call is routed here instead: the arguments have
been checked exactly as eager checks them, and this module does what
``THPEngine_run_backward`` and ``Engine::execute`` do, with a replay in place of the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd

from . import _core
from ._compile import Compiler, cache
from ._replay import running

log = logging.getLogger("replaygrad")

_eager_run_backward = torch.autograd.graph._engine_run_backward
_tls = threading.local()
_install_lock = threading.Lock()
_install_count = 0


@dataclass(frozen=True)
class Config:
    """How backward calls on this thread are run."""

    compiler: Compiler


def current_config() -> Config | None:
    return getattr(_tls, "config", None)


class routed:
    """Routes this thread's backward calls through replaygrad with ``config`` while active.

    Nests: the innermost config wins, and the prior one is restored on exit, also when the
    block raises. The hook into torch is installed while any thread has one active.
    """

    def __init__(self, config: Config | None) -> None:
        self.config = config

    def __enter__(self) -> None:
        global _install_count
        with _install_lock:
            if _install_count == 0:
                torch.autograd._engine_run_backward = _run_backward
            _install_count += 1
        self.prior = current_config()
        _tls.config = self.config

    def __exit__(self, *exc: object) -> None:
        global _install_count
        _tls.config = self.prior
        with _install_lock:
            _install_count -= 1
            if _install_count == 0:
                torch.autograd._engine_run_backward = _eager_run_backward


_eager_reasons_logged: set[str] = set()


def _eager(reason: str, args: tuple, kwargs: dict) -> Any:
    if reason not in _eager_reasons_logged:
        _eager_reasons_logged.add(reason)
        log.info("replaygrad: running the eager engine for a backward call: %s", reason)
    return _eager_run_backward(*args, **kwargs)


def _run_backward(
    t_outputs: Sequence[Any],
    grad_tensors: Sequence[torch.Tensor | None],
    keep_graph: bool,
    create_graph: bool,
    inputs: Sequence[Any] | None = None,
    allow_unreachable: bool = False,
    accumulate_grad: bool = True,
    **kwargs: Any,
) -> tuple[torch.Tensor | None, ...] | None:
    args = (
        t_outputs,
        grad_tensors,
        keep_graph,
        create_graph,
        inputs,
        allow_unreachable,
        accumulate_grad,
    )
    config = current_config()
    if config is None or getattr(_tls, "replaying", False):
        # Not active on this thread, or a backward started inside a replay (a reentrant
        # checkpoint, a hook): the engine runs it, as it would run it nested.
        return _eager_run_backward(*args, **kwargs)
    if create_graph:
        return _eager("create_graph=True (higher-order gradients)", args, kwargs)
    if torch._C._are_functorch_transforms_active():
        return _eager("a functorch transform (vmap/grad) is active", args, kwargs)
    return _replay_backward(
        config, t_outputs, grad_tensors, keep_graph, inputs, allow_unreachable, accumulate_grad
    )


def _is_gradient_edge(obj: Any) -> bool:
    return isinstance(obj, torch.autograd.graph.GradientEdge)


def _check_roots(roots: Sequence[Any], grad_tensors: Sequence[Any]) -> None:
    """THPEngine_run_backward's checks of the roots, in its order."""
    if len(roots) != len(grad_tensors):
        raise RuntimeError(f"got {len(roots)} tensors and {len(grad_tensors)} gradients")
    for i, (root, grad) in enumerate(zip(roots, grad_tensors)):
        if _is_gradient_edge(root):
            if grad is None:
                raise RuntimeError(
                    f"element {i} of gradients tuple is None, but the corresponding "
                    "GradientEdge requires a gradient"
                )
            continue
        if not isinstance(root, torch.Tensor):
            raise TypeError(
                f"element {i} of tensors must be a Tensor or GradientEdge, "
                f"got {type(root).__name__}"
            )
        if not root.requires_grad:
            raise RuntimeError(
                f"element {i} of tensors does not require grad and does not have a grad_fn"
            )
        if grad is None:
            raise RuntimeError(
                f"element {i} of gradients tuple is None, but the corresponding Tensor "
                "requires grad"
            )
        if not isinstance(grad, torch.Tensor):
            raise RuntimeError(f"element {i} of gradients tuple is not a Tensor or None")


def _check_inputs(inputs: Sequence[Any], accumulate_grad: bool) -> None:
    """THPEngine_run_backward's handling of `inputs`: backward(inputs=) retains the grad of
    non-leaf inputs (that is how their .grad gets filled)."""
    for obj in inputs:
        if _is_gradient_edge(obj):
            continue
        if not isinstance(obj, torch.Tensor):
            raise RuntimeError(
                f"all inputs have to be Tensors or GradientEdges, but got {type(obj).__name__}"
            )
        if accumulate_grad:
            obj.retain_grad()
        if not obj.requires_grad:
            raise RuntimeError("One of the differentiated Tensors does not require grad")


def _replay_backward(
    config: Config,
    roots: Sequence[Any],
    grad_tensors: Sequence[torch.Tensor | None],
    keep_graph: bool,
    inputs: Sequence[Any] | None,
    allow_unreachable: bool,
    accumulate_grad: bool,
) -> tuple[torch.Tensor | None, ...] | None:
    _check_roots(roots, grad_tensors)
    if inputs:
        _check_inputs(inputs, accumulate_grad)
    elif not accumulate_grad:
        raise ValueError("grad requires non-empty inputs.")
    plan = _core.plan(roots, inputs if inputs else None, accumulate_grad)
    grads = plan.validate_root_grads(grad_tensors)
    entry = cache.get(plan, config.compiler)
    saved = plan.saved_values()
    hooks = plan.hook_functions()
    _tls.replaying = True
    try:
        with running(plan), torch.no_grad():
            returned, captured = entry.compiled(grads, saved, hooks)
        del saved
        # run_deferred empties the list: a gradient held by nothing else can then be stolen
        # by AccumulateGrad rather than copied, as in the engine.
        deferred = returned if type(returned) is list else list(returned)
        del returned
        plan.run_deferred(deferred)
    finally:
        _tls.replaying = False
    entry.calls += 1
    if not keep_graph:
        plan.release_variables()
    if accumulate_grad or not inputs:
        return ()
    if not allow_unreachable and any(c is None for c in captured):
        raise RuntimeError(
            "One of the differentiated Tensors appears to not have been used in the graph. "
            "Set allow_unused=True if this is the desired behavior."
        )
    return tuple(captured)
