"""Two pure-Python planners of a backward graph, the baselines of ``bench.py``'s planning table.

Both do, in Python, the work replaygrad's Rust core does per backward call: find the order in
which the engine would run the nodes, collect the saved values to pass to a replay, and (the
careful planner) compute a structural key to look a compiled replay up by.

- :func:`plan_careful` is the best one can reasonably do in Python: one iterative walk over
  ``next_functions`` that counts dependencies (``Engine::compute_dependencies``), then the
  engine's ready queue as a heap on ``sequence_nr`` (``ReadyQueue::CompareNodeTaskTime``: the
  higher ``sequence_nr`` runs first, so ``AccumulateGrad``, whose ``sequence_nr`` is
  UINT64_MAX, runs as soon as it is ready). Ties (in practice between ``AccumulateGrad``
  nodes) go first-in first-out here, where libstdc++'s ``std::priority_queue`` breaks them by
  its heap layout. Which attributes hold saved values is found by one ``dir()`` per node
  type, cached.
- :func:`plan_poc` plans the way the proof of concept in ``/work/shared/reference/`` did: the
  engine itself computes the order (a tensor hook on the root reads
  ``torch._C._current_graph_task_execution_order()`` and aborts the backward), and every node
  is inspected with its own ``dir()`` calls, once to collect its saved values (unpacked) and
  once more to count them; no key.
"""

from __future__ import annotations

import heapq
from typing import Any, NamedTuple

import torch

#: Per node type: names of the tensor-valued saved attributes (read as ``_raw_saved_*``, the
#: SavedVariable itself) and of the other saved attributes (``_saved_*``, part of the key).
_layouts: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}


class PyPlan(NamedTuple):
    """What a planner found: the nodes in engine order, each node's next edges as
    ``(step, input_nr)`` (step -1: no gradient flows there), the saved values, and a structural
    key."""

    order: list[Any]
    edges: list[tuple[tuple[int, int], ...]]
    saved: list[Any]
    key: int


def _layout(node_type: type, node: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    layout = _layouts.get(node_type)
    if layout is None:
        names = dir(node)
        tensors = tuple(a for a in names if a.startswith("_raw_saved_"))
        raw = {a[len("_raw") :] for a in tensors}
        others = tuple(a for a in names if a.startswith("_saved_") and a not in raw)
        layout = _layouts[node_type] = (tensors, others)
    return layout


def plan_careful(root: torch.Tensor) -> PyPlan:
    """Plans ``root.backward()`` in Python: engine order, saved values and a structural key."""
    start = root.grad_fn
    # Engine::compute_dependencies: one walk, counting the edges into each node.
    edges: dict[Any, tuple[tuple[Any, int], ...]] = {}
    dependencies: dict[Any, int] = {start: 0}
    stack = [start]
    while stack:
        node = stack.pop()
        next_functions = edges[node] = node.next_functions
        for fn, _ in next_functions:
            if fn is None:
                continue
            if fn in dependencies:
                dependencies[fn] += 1
            else:
                dependencies[fn] = 1
                stack.append(fn)
    # The ready queue: a max-heap on sequence_nr (negated for heapq), FIFO among ties.
    order: list[Any] = []
    pushed = 0
    ready = [(-start._sequence_nr(), pushed, start)]
    while ready:
        node = heapq.heappop(ready)[2]
        order.append(node)
        for fn, _ in edges[node]:
            if fn is None:
                continue
            dependencies[fn] -= 1
            if dependencies[fn] == 0:
                pushed += 1
                heapq.heappush(ready, (-fn._sequence_nr(), pushed, fn))
    step = {node: i for i, node in enumerate(order)}
    targets = [tuple((step.get(fn, -1), nr) for fn, nr in edges[node]) for node in order]
    saved: list[Any] = []
    key_parts: list[tuple[Any, ...]] = []
    for node, node_targets in zip(order, targets):
        node_type = type(node)
        tensors, others = _layout(node_type, node)
        saved.extend(getattr(node, a) for a in tensors)
        if node_type.__name__ == "AccumulateGrad":
            saved.append(node.variable)
        constants = tuple(_hashable(getattr(node, a)) for a in others)
        key_parts.append((node_type.__name__, len(tensors), constants, node_targets))
    return PyPlan(order, targets, saved, hash(tuple(key_parts)))


def _hashable(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


class _Abort(Exception):
    """Raised by the root's hook once the engine has computed the execution order."""


def plan_poc(root: torch.Tensor) -> PyPlan:
    """Plans ``root.backward()`` the proof of concept's way (order from the engine, ``dir()``
    per node); its key is always 0."""
    order: list[Any] = []

    def hook(_: torch.Tensor) -> None:
        order.extend(torch._C._current_graph_task_execution_order())
        raise _Abort

    handle = root.register_hook(hook)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            root.backward()
    except _Abort:
        pass
    finally:
        handle.remove()
    saved: list[Any] = []
    for node in order:
        before = len(saved)
        saved.extend(getattr(node, a[len("_raw") :]) for a in dir(node) if a.startswith("_raw"))
        is_accumulate_grad = type(node).__name__ == "AccumulateGrad"
        if is_accumulate_grad:
            saved.append(node.variable)
        # The proof of concept counted each node's saved values again, with a second dir(),
        # to slice the replay's inputs.
        if sum(a.startswith("_raw") for a in dir(node)) + is_accumulate_grad != len(saved) - before:
            raise AssertionError(f"saved values of {node.name()} changed while planning")
    position = {node: i for i, node in enumerate(order)}
    edges = [tuple((position.get(fn, -1), nr) for fn, nr in node.next_functions) for node in order]
    return PyPlan(order, edges, saved, 0)
