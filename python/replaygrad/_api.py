"""The public API: backward, grad, enable/disable, plan/explain, the cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import _core
from ._compile import CacheInfo, Compiler, Config, cache
from ._engine import routed
from ._explain import table, to_dot
from ._replay import compiled_themselves, generate_source

TensorOrTensors = torch.Tensor | Sequence[torch.Tensor]


def backward(
    tensors: TensorOrTensors,
    grad_tensors: TensorOrTensors | Sequence[torch.Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    grad_variables: TensorOrTensors | Sequence[torch.Tensor | None] | None = None,
    inputs: TensorOrTensors | None = None,
    compiler: Compiler = "inductor",
    fallback: str | None = None,
    **compile_options: Any,
) -> None:
    """Computes the sum of gradients of ``tensors`` w.r.t. graph leaves, like
    :func:`torch.autograd.backward`, by replaying the backward graph compiled with
    ``compiler``.

    Args:
        tensors: roots of the backward, as in torch.
        grad_tensors: gradients w.r.t. each root (None for scalars), as in torch.
        retain_graph: keep the graph's saved values for another backward; defaults to
            ``create_graph``.
        create_graph: build a graph of the gradients (the engine runs such calls).
        grad_variables: torch's deprecated name of ``grad_tensors``.
        inputs: accumulate only into these tensors (or GradientEdges), as in torch.
        compiler: a torch.compile backend name (e.g. ``"inductor"``, ``"aot_eager"``), a
            callable that compiles a function (e.g. ``torch.compile(fullgraph=True)``), or
            ``None`` to run the replay uncompiled. Uncompiled, gradients are eager's bit
            for bit (where eager is deterministic); compiled, within float tolerance:
            ``"aot_eager"`` runs eager's ops, and other compilers fuse them and form the
            gradients of weights in matrix products from the factors.
        fallback: ``"eager"`` to have the engine run a call whose replay fails to compile
            (and later calls with the same plan), logged as a warning; by default the error
            is raised with the plan's key. A failure after parts of the call ran (a later
            region compiled when reached) cannot be run again by the engine: it is raised,
            and later calls with the plan run in the engine.
        **compile_options: passed to ``torch.compile`` with a backend name (``mode=``,
            ``dynamic=``, ``fullgraph=``, ``options=``).
    """
    with routed(Config.make(compiler, compile_options, fallback)):
        torch.autograd.backward(
            tensors,
            grad_tensors,
            retain_graph=retain_graph,
            create_graph=create_graph,
            grad_variables=grad_variables,
            inputs=inputs,
        )


def grad(
    outputs: TensorOrTensors,
    inputs: TensorOrTensors,
    grad_outputs: TensorOrTensors | Sequence[torch.Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    only_inputs: bool = True,
    allow_unused: bool | None = None,
    is_grads_batched: bool = False,
    materialize_grads: bool = False,
    compiler: Compiler = "inductor",
    fallback: str | None = None,
    **compile_options: Any,
) -> tuple[torch.Tensor | None, ...]:
    """Computes and returns the gradients of ``outputs`` w.r.t. ``inputs``, like
    :func:`torch.autograd.grad` (no ``.grad`` is written), by replaying the backward graph
    compiled with ``compiler`` (see :func:`backward`). ``only_inputs`` is torch's deprecated
    argument, passed on."""
    with routed(Config.make(compiler, compile_options, fallback)):
        return torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            only_inputs=only_inputs,
            allow_unused=allow_unused,
            is_grads_batched=is_grads_batched,
            materialize_grads=materialize_grads,
        )


def enable(
    compiler: Compiler = "inductor", *, fallback: str | None = None, **compile_options: Any
) -> routed:
    """Routes every backward on this thread (``loss.backward()``,
    ``torch.autograd.backward``, ``torch.autograd.grad``) through replaygrad while the block
    runs, compiled with ``compiler`` and ``compile_options``, with ``fallback`` on compile
    failures (see :func:`backward`).

    Blocks nest: the innermost :func:`enable` or :func:`disable` decides, and the prior state
    is restored on exit, also when the block raises. Other threads are routed as before;
    backward calls through one graph from several threads at once are not supported (the
    README's Known limitations).

    The arguments are checked here. The context manager may be entered again, and used as a
    decorator (each call of the decorated function runs in a block of its own).
    """
    return routed(Config.make(compiler, compile_options, fallback))


def disable() -> routed:
    """Runs this thread's backward calls with PyTorch's engine while the block runs, also
    inside an :func:`enable` block (a context manager, or a decorator)."""
    return routed(None)


class Plan:
    """What replaygrad runs for a backward from given roots.

    Attributes:
        order: node names in the order the engine runs them.
        saved: the saved-value layout: ``(step, node name)`` per slot, in replay-input order.
        opaque: ``(step, node name)`` of the steps that run as themselves (graph breaks) in
            a compiled replay (e.g. a custom Function whose backward Dynamo does not trace,
            see the README's "What graph-breaks and why").
        key: the structural key: plans with equal keys share a compiled replay.
    """

    def __init__(self, plan: _core.Plan) -> None:
        self._plan = plan
        steps = plan.steps()
        self.order: list[str] = plan.order()
        self.saved: list[tuple[int, str]] = [
            (s, step[0]) for s, step in enumerate(steps) for _ in range(step[6], step[7])
        ]
        self._themselves = compiled_themselves(plan, steps)
        self.opaque: list[tuple[int, str]] = [
            (s, step[0])
            for s, step in enumerate(steps)
            if step[2] in ("opaque", "eager_accumulate") or s in self._themselves
        ]
        self.key: str = plan.key

    @property
    def source(self) -> str:
        """The generated Python source of the replay as a compiler runs it (uncompiled for
        a graph with nested tensors, which replays so): the driver, then its regions (one
        unless the graph has more than ``3 * region_size`` steps, see
        :func:`set_region_size`)."""
        return generate_source(
            self._plan, region_size=cache.region_size, compiled=not self._plan.nested_inputs
        )

    def explain(self) -> str:
        """A table of the steps (node, sequence_nr, inputs, saved values, mode, hooks)
        followed by the replay source."""
        return f"{table(self._plan, self._themselves)}\n\n{self.source}"

    def to_dot(self) -> str:
        """Graphviz source of the plan; graph breaks are drawn red and dashed."""
        return to_dot(self._plan, self._themselves)

    def __repr__(self) -> str:
        return (
            f"Plan({len(self.order)} steps, {len(self.saved)} saved values, "
            f"{len(self.opaque)} graph breaks, key={self.key})"
        )


def plan(tensors: TensorOrTensors, inputs: TensorOrTensors | None = None) -> Plan:
    """Plans the backward of ``tensors`` (with respect to ``inputs`` if given, as
    ``autograd.grad`` would) without running it."""
    roots = _as_tuple(tensors, "tensors")
    if inputs is None:
        return Plan(_core.plan(roots))
    edges = _as_tuple(inputs, "inputs")
    # What torch.autograd.grad checks of its inputs.
    if not edges:
        raise RuntimeError("`inputs` argument to `grad()` cannot be empty.")
    if any(isinstance(e, torch.Tensor) and not e.requires_grad for e in edges):
        raise RuntimeError("One of the differentiated Tensors does not require grad")
    return Plan(_core.plan(roots, edges, False))


def _as_tuple(values: Any, name: str) -> tuple:
    """Tensors or GradientEdges, one or several, as the tuple ``_core.plan`` takes (edges
    as ``(node, output_nr)``)."""
    edge = torch.autograd.graph.GradientEdge
    if isinstance(values, (torch.Tensor, edge)):
        values = (values,)
    if not isinstance(values, Sequence) or isinstance(values, str):
        raise TypeError(
            f"{name} must be a Tensor, a GradientEdge or a sequence of them, "
            f"got {type(values).__name__}"
        )
    for v in values:
        if not isinstance(v, (torch.Tensor, edge)):
            raise TypeError(
                f"{name} must be Tensors or GradientEdges, got an element of type "
                f"{type(v).__name__}"
            )
    return tuple((v.node, v.output_nr) if isinstance(v, edge) else v for v in values)


def explain(tensors: TensorOrTensors) -> str:
    """``plan(tensors).explain()``: what a backward from ``tensors`` would run."""
    return plan(tensors).explain()


def cache_info() -> CacheInfo:
    """Hits, misses, current size and maximum size of the compiled-replay cache."""
    return cache.info()


def set_cache_size(maxsize: int) -> None:
    """Bounds the compiled-replay cache (least recently used entries are dropped)."""
    cache.resize(maxsize)


def set_region_size(steps: int | None) -> None:
    """Splits replays of graphs with more than ``3 * steps`` engine steps into regions of
    about ``steps`` steps, each compiled on its own (uncompiled replays: each a Python
    function); regions of the same structure (layers, unrolled steps, a long chain) share
    one compiled function, so a graph of repeated structure compiles in about the time of
    its first regions. ``None``: one region, however large the graph. Applies to replays
    built after the call. The default is 300, or ``REPLAYGRAD_REGION_SIZE`` (a number, or
    ``none``) when set."""
    cache.set_region_size(steps)


def reset() -> None:
    """Drops every compiled replay and the cache statistics."""
    cache.clear()
