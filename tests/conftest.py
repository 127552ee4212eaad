"""Shared fixtures and helpers: every test compares replaygrad with eager autograd in the same
process, on the same inputs."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence

import pytest
import torch

import replaygrad
from replaygrad._compile import cache

COMPILERS = [None, "aot_eager", "inductor"]
FAST_COMPILERS = [None, "aot_eager"]


@pytest.fixture(autouse=True)
def _isolated():
    """Each test starts with an empty replay cache and a fixed seed."""
    cache.clear()
    torch.manual_seed(0)
    yield
    cache.clear()


class Doubling(torch.autograd.Function):
    """``x * 2`` as a Python Function whose backward is kept out of compiled graphs
    (``torch._dynamo.disable``): a step that runs as itself in compiled replays."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    @torch._dynamo.disable
    def backward(ctx, grad):
        return grad * 2


class Through:
    """Counts the calls of the regions compiled so far that go through Dynamo (their
    ``torch.compile``d function)."""

    def __init__(self) -> None:
        self.calls = 0
        self.regions = list(cache._regions.values())
        for region in self.regions:
            region.fn = self._counting(region.fn)

    def _counting(self, fn):
        def call(*args):
            self.calls += 1
            return fn(*args)

        return call


def all_nodes(roots: Sequence[torch.Tensor]) -> list:
    """Every grad_fn reachable from the roots (Python walk over next_functions)."""
    seen: dict[int, object] = {}
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return list(seen.values())


def engine_order(roots: Sequence[torch.Tensor], grads=None) -> list[str]:
    """The order the engine really runs nodes in, recorded by a pre-hook on every node.

    Runs an eager backward with retain_graph=True and removes the hooks afterwards.
    """
    order: list[str] = []
    handles = []
    for fn in all_nodes(roots):
        handles.append(fn.register_prehook(lambda g, fn=fn: order.append(fn.name())))
    try:
        torch.autograd.backward(list(roots), grads, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    return order


def reported_order(root: torch.Tensor) -> list[str]:
    """What torch._C._current_graph_task_execution_order() reports during an eager backward."""
    out: list[str] = []

    def hook(grads):
        out.extend(fn.name() for fn in torch._C._current_graph_task_execution_order())

    handle = root.grad_fn.register_prehook(hook)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            root.backward(torch.ones_like(root), retain_graph=True)
    finally:
        handle.remove()
    return out


def grads_of(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in tensors]


def assert_grads_equal(expected, actual, exact: bool, scaled: bool = False) -> None:
    """Gradients equal bit for bit (``exact``) or within float tolerance; ``scaled``: the
    absolute tolerance grows with each gradient's magnitude (for compiled float32 sums whose
    small entries are differences of large terms)."""
    assert len(expected) == len(actual)
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e is None or a is None:
            assert e is None and a is None, f"grad {i}: {e} vs {a}"
            continue
        assert e.shape == a.shape and e.dtype == a.dtype, f"grad {i}"
        if exact:
            assert torch.equal(e, a), f"grad {i} differs: max {(e - a).abs().max()}"
        else:
            scale = max(1.0, e.abs().max().item()) if scaled else 1.0
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5 * scale, msg=f"grad {i}")


def compare_training(
    make_model: Callable[[], torch.nn.Module],
    make_input: Callable[[], torch.Tensor],
    compiler,
    iterations: int = 3,
) -> None:
    """Trains an eager copy and a replaygrad copy of a model side by side and compares the
    parameter gradients after every backward."""
    eager_model = make_model()
    rg_model = copy.deepcopy(eager_model)
    eager_opt = torch.optim.SGD(eager_model.parameters(), lr=0.1)
    rg_opt = torch.optim.SGD(rg_model.parameters(), lr=0.1)
    for _ in range(iterations):
        x = make_input()
        eager_opt.zero_grad()
        eager_model(x).square().mean().backward()
        rg_opt.zero_grad()
        before = replaygrad.cache_info()
        replaygrad.backward(rg_model(x).square().mean(), compiler=compiler)
        assert_replayed(before)
        assert_grads_equal(
            grads_of(eager_model.parameters()),
            grads_of(rg_model.parameters()),
            exact=compiler is None,
        )
        eager_opt.step()
        rg_opt.step()


def assert_replayed(before, calls: int = 1) -> None:
    """Checks that `calls` backward calls went through a replay since `before`
    (a cache_info() snapshot), not silently through the engine."""
    after = replaygrad.cache_info()
    assert (after.hits + after.misses) - (before.hits + before.misses) == calls


def uncompiled_and_failing_aot_eager(reason: str) -> list:
    """``compiler`` values: None, and "aot_eager" as a strict expected failure."""
    return [None, pytest.param("aot_eager", marks=pytest.mark.xfail(strict=True, reason=reason))]


def counting_backend():
    """A torch.compile backend that counts the graphs it is asked to compile."""
    calls = []

    def backend(gm, example_inputs):
        calls.append(gm)
        return gm.forward

    return backend, calls


__all__ = [
    "COMPILERS",
    "FAST_COMPILERS",
    "Doubling",
    "all_nodes",
    "assert_grads_equal",
    "assert_replayed",
    "compare_training",
    "counting_backend",
    "engine_order",
    "grads_of",
    "reported_order",
]


@pytest.fixture
def deepcopy():
    return copy.deepcopy


def summary(value):
    """A logged value (a hook argument, what a backward saw): tensors cloned, sequences
    recursed, the rest as is."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return tuple(summary(v) for v in value)
    return value


def assert_same(expected, got, exact: bool, where: str) -> None:
    """Nested tuples of tensors and plain values equal: tensors bit for bit when ``exact``,
    else within float tolerance; same shape, dtype and layout always."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {expected} vs {got}"
        assert (expected.shape, expected.dtype, expected.layout) == (
            got.shape,
            got.dtype,
            got.layout,
        ), where
        if expected.is_sparse:
            expected, got = expected.to_dense(), got.to_dense()
        if exact:
            assert torch.equal(expected, got), f"{where}: {expected} vs {got}"
        elif expected.dtype in (torch.float32, torch.float64):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5, msg=where)
        else:
            torch.testing.assert_close(got, expected, msg=where)
    elif isinstance(expected, tuple):
        assert isinstance(got, tuple) and len(got) == len(expected), f"{where}: {got}"
        for k, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, exact, f"{where}[{k}]")
    else:
        assert expected == got, f"{where}: {expected!r} vs {got!r}"


def eager_backward(*args, **kwargs) -> None:
    torch.autograd.backward(*args, **kwargs)


def compare(run, compiler, **options) -> None:
    """``run(backward) -> (log, grads)`` with the engine and with replaygrad (compile
    ``options`` given): the same log and gradients (bit for bit uncompiled)."""
    expected = run(eager_backward)
    got = run(replay_backward(compiler, **options))
    exact = compiler is None
    assert_same(tuple(expected[0]), tuple(got[0]), exact, "log")
    assert_same(tuple(expected[1]), tuple(got[1]), exact, "grads")


def replay_backward(compiler, **options):
    """``backward`` through replaygrad with ``compiler`` (and compile ``options``), asserting
    it really replayed."""

    def backward(*args, **kwargs):
        before = replaygrad.cache_info()
        replaygrad.backward(*args, compiler=compiler, **options, **kwargs)
        assert_replayed(before)

    return backward
