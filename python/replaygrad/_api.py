"""The public API: backward, grad, enable, plan."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import _core
from ._compile import Compiler, check_compiler
from ._engine import Config, routed

TensorOrTensors = torch.Tensor | Sequence[torch.Tensor]


def backward(
    tensors: TensorOrTensors,
    grad_tensors: TensorOrTensors | Sequence[torch.Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: TensorOrTensors | None = None,
    compiler: Compiler = "inductor",
) -> None:
    """Computes the sum of gradients of ``tensors`` w.r.t. graph leaves, like
    :func:`torch.autograd.backward`, by replaying the backward graph compiled with
    ``compiler``.

    Args:
        tensors: roots of the backward, as in torch.
        grad_tensors: gradients w.r.t. each root (None for scalars), as in torch.
        retain_graph: keep the graph's saved values for another backward; defaults to
            ``create_graph``.
        create_graph: build a graph of the gradients (runs the eager engine).
        inputs: accumulate only into these tensors (or GradientEdges), as in torch.
        compiler: a torch.compile backend name (e.g. ``"inductor"``, ``"aot_eager"``), a
            callable that compiles a function (e.g. ``torch.compile(fullgraph=True)``), or
            ``None`` to run the replay uncompiled.
    """
    check_compiler(compiler)
    with routed(Config(compiler)):
        torch.autograd.backward(
            tensors,
            grad_tensors,
            retain_graph=retain_graph,
            create_graph=create_graph,
            inputs=inputs,
        )


def grad(
    outputs: TensorOrTensors,
    inputs: TensorOrTensors,
    grad_outputs: TensorOrTensors | Sequence[torch.Tensor | None] | None = None,
    *,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    allow_unused: bool | None = None,
    materialize_grads: bool = False,
    compiler: Compiler = "inductor",
) -> tuple[torch.Tensor | None, ...]:
    """Computes and returns the gradients of ``outputs`` w.r.t. ``inputs``, like
    :func:`torch.autograd.grad` (no ``.grad`` is written), by replaying the backward graph
    compiled with ``compiler`` (see :func:`backward`)."""
    check_compiler(compiler)
    with routed(Config(compiler)):
        return torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs,
            retain_graph=retain_graph,
            create_graph=create_graph,
            allow_unused=allow_unused,
            materialize_grads=materialize_grads,
        )


@contextmanager
def enable(compiler: Compiler = "inductor") -> Iterator[None]:
    """Routes every backward on this thread (``loss.backward()``,
    ``torch.autograd.backward``, ``torch.autograd.grad``) through replaygrad while the block
    runs.

    Nested blocks use the innermost compiler; the prior state is restored on exit, also when
    the block raises.
    """
    check_compiler(compiler)
    with routed(Config(compiler)):
        yield


@dataclass(frozen=True)
class Plan:
    """What replaygrad would run for a backward from given roots.

    Attributes:
        order: node names in the order the engine runs them.
        saved: the saved-value layout, one ``(step, node name)`` per slot, in replay-input
            order.
        opaque: ``(step, node name)`` of the nodes that run as themselves (graph breaks).
        key: the structural key: equal keys share a compiled replay.
    """

    order: list[str]
    saved: list[tuple[int, str]]
    opaque: list[tuple[int, str]]
    key: str


def plan(tensors: TensorOrTensors) -> Plan:
    """Plans the backward of ``tensors`` without running it."""
    roots = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    p = _core.plan(roots)
    steps = p.steps()
    saved: list[tuple[int, str]] = []
    opaque: list[tuple[int, str]] = []
    for s, step in enumerate(steps):
        name, mode, start, end = step[0], step[2], step[6], step[7]
        saved.extend((s, name) for _ in range(start, end))
        if mode in ("opaque", "eager_accumulate"):
            opaque.append((s, name))
    return Plan(order=p.order(), saved=saved, opaque=opaque, key=p.key)
