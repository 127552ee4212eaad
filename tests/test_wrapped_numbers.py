"""Wrapped numbers: the Python scalars ops take as 0-dim tensors (the ``0.9`` of
``y * 0.9``), which every op makes anew and ``MulBackward0`` and the like save. A plan gives
equal ones (same dtype, same bits) one saved value, so that a compiled replay takes one input
for them (Dynamo checks the others by identity); everything else stays apart."""

from __future__ import annotations

import pytest
import torch

import replaygrad
from replaygrad import _core

from conftest import assert_grads_equal, grads_of

SCALARS = (0.9, 0.9, 0.8, 2, 2.0, -0.0, 0.0, 0.9)


def scaled(x: torch.Tensor, scalars=SCALARS) -> torch.Tensor:
    for s in scalars:
        x = x * s
    return x.sum()


def test_equal_wrapped_numbers_share_one_saved_value():
    x = torch.randn(4, requires_grad=True)
    explicit = x * torch.tensor(0.9, dtype=torch.float64)  # a tensor, not a wrapped number
    plan = _core.plan([scaled(explicit)])
    values = [v for v in plan.saved_values() if v is not None]
    by_value: dict = {}
    for v in values:
        by_value.setdefault((v.dtype, str(v.item())), set()).add(id(v))
    # The three wrapped 0.9s are one value, the explicit tensor 0.9 another; 2 and 2.0 differ
    # in dtype, -0.0 and 0.0 in bits.
    assert {k: len(ids) for k, ids in by_value.items()} == {
        (torch.float64, "0.9"): 2,
        (torch.float64, "0.8"): 1,
        (torch.int64, "2"): 1,
        (torch.float64, "2.0"): 1,
        (torch.float64, "-0.0"): 1,
        (torch.float64, "0.0"): 1,
    }
    assert sum(v.dtype == torch.float64 and v.item() == 0.9 for v in values) == 4


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_wrapped_numbers_equal_in_one_call_and_not_in_the_next(compiler):
    x = torch.randn(4, requires_grad=True)
    guards: list = []

    def record(entries):
        guards.append([g.guard_type for g in entries if g.name.startswith("saved[")])
        return [True] * len(entries)

    options = {"options": {"guard_filter_fn": record}} if compiler else {}
    for scalars in [(0.9, 0.9, 0.9), (0.9, 0.8, 0.9), (0.7, 0.7, 0.7), (0.5, 0.6, 0.7)]:
        x.grad = None
        scaled(x, scalars).backward()
        expected = grads_of([x])
        x.grad = None
        with replaygrad.enable(compiler, **options):
            scaled(x, scalars).backward()
        assert_grads_equal(expected, grads_of([x]), exact=compiler is None)
    if compiler:
        # One tensor input for three equal scalars.
        assert guards[0].count("TENSOR_MATCH") == 1
        assert guards[0].count("DUPLICATE_INPUT") == 2
        # A compile per pattern of equal scalars: (0.7, 0.7, 0.7) reuses the first.
        assert len(guards) == 3 and max(g.count("TENSOR_MATCH") for g in guards) == 3


@pytest.mark.parametrize("which", ["first", "second"])
def test_wrapped_number_modified_during_the_backward_raises_as_in_eager(which):
    """A wrapped number is reachable through ``grad_fn._saved_other``. Modified in place by
    a hook during the backward, before its node ran, the engine raises when the node unpacks
    it, whichever of two equal ones it is (the first one the replay runs or the second).
    (Not compiled: a hook traced into a compiled region that modifies a saved value is a
    known gap, see the README.)"""

    def run(backward):
        x = torch.randn(4, requires_grad=True)
        y = x * 0.9
        z = y * 0.9
        node = (z if which == "first" else y).grad_fn
        z.register_hook(lambda g: node._saved_other.add_(1) and None)
        with pytest.raises(RuntimeError) as raised:
            backward((z * 3).sum())
        return str(raised.value), x.grad

    def replayed(loss):
        with replaygrad.enable(None):
            loss.backward()

    eager, replay = run(torch.Tensor.backward), run(replayed)
    assert "modified by an inplace operation" in eager[0]
    assert replay == eager


def test_compiled_replays_take_0dim_float64_values_lifted():
    """Dynamo reads a 0-dim float64 input as a float too, and when the graph does not use it
    as one, Dynamo traces the frame twice (AOTAutograd's tensorify_python_scalars pass
    restarts it). A compiled replay takes such values as 1-element tensors sharing their
    storage and version counter (one per value), those requiring grad as they are."""
    x = torch.randn(4, requires_grad=True)
    w = torch.tensor(3.0, dtype=torch.float64, requires_grad=True)
    loss = scaled(x * w)
    plan = _core.plan([loss])
    plain, lifted = plan.saved_values(), plan.saved_values(lift=True)
    assert len(plain) == len(lifted)
    moved = [(a, b) for a, b in zip(plain, lifted) if a is not b]
    # The float64 wrapped numbers (0.9 three times, 0.8, 2.0, -0.0, 0.0); not the int 2 nor w.
    assert len(moved) == 7
    assert all(b.shape == (1,) and b.dtype == a.dtype and b.device == a.device for a, b in moved)
    assert all(b.data_ptr() == a.data_ptr() and b._version == a._version for a, b in moved)
    assert not any(b.requires_grad for _, b in moved)
    assert len({id(b) for a, b in moved if a.item() == 0.9}) == 1
    assert sum(v is not None and v.requires_grad and v.dim() == 0 for v in lifted) == 1


def test_a_region_with_wrapped_numbers_is_traced_once():
    from torch._dynamo.utils import counters

    x = torch.randn(16, requires_grad=True)

    def loss():
        y = x
        for i in range(30):
            y = y.sin() if i % 3 == 0 else y * 0.9 if i % 3 == 1 else y + 0.1
        return y.sum()

    loss().backward()
    expected = grads_of([x])
    x.grad = None
    counters.clear()
    with replaygrad.enable("aot_eager"):
        loss().backward()
    assert dict(counters["aot_autograd"]) == {"total": 1, "ok": 1}
    assert_grads_equal(expected, grads_of([x]), exact=False)


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_a_0dim_float64_value_and_a_1_element_one_have_other_keys(compiler):
    """A replay indexes a lifted value back, so whether a slot is lifted is part of the key:
    the same nodes saving a 1-element tensor (not lifted) do not take its replay."""
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    scalar = torch.tensor(0.5, dtype=torch.float64)
    vector = torch.tensor([0.5], dtype=torch.float64)
    assert _core.plan([(x * scalar).sum()]).key != _core.plan([(x * vector).sum()]).key
    for s in [scalar, vector, scalar, vector]:
        (x * s).sum().backward()
        expected = grads_of([x])
        x.grad = None
        with replaygrad.enable(compiler):
            (x * s).sum().backward()
        assert_grads_equal(expected, grads_of([x]), exact=compiler is None)
        x.grad = None


def scalar_losses(x: torch.Tensor) -> torch.Tensor:
    """Wrapped numbers meeting 0-dim gradients: a 0-dim loss scaled (and divided), the same
    0.1 also scaling a vector (one saved value for both), and an in-place scaling of a 0-dim
    window of a vector (a CopySlices whose node takes a 0-dim gradient)."""
    h = x.clone()
    h[0] *= 0.1
    return torch.tanh(x.sum() * 0.1) + torch.tanh(h.sum() * 0.3) / 3.0 + (x * 0.1).tanh().sum()


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_wrapped_numbers_meeting_0dim_gradients_as_in_eager(compiler):
    """A wrapped number keeps a 0-dim float32 gradient's product in float32 (type promotion
    leaves it out); a 0-dim float64 tensor in its place would compute it in float64 and round
    it twice. So a node taking a 0-dim gradient does not take its wrapped numbers lifted
    (indexed back in the graph they are plain tensors). Bit for bit eager's, on values where
    the two roundings differ."""
    for seed in range(8):
        torch.manual_seed(seed)
        x = torch.randn(36, requires_grad=True)
        scalar_losses(x).backward()
        expected = grads_of([x])
        x.grad = None
        with replaygrad.enable(compiler):
            scalar_losses(x).backward()
        assert_grads_equal(expected, grads_of([x]), exact=True)
