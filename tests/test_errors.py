"""Errors are the ones eager raises, for the same mistakes."""

from __future__ import annotations

import warnings

import pytest
import torch

import replaygrad


def eager_error(fn):
    with pytest.raises(Exception) as info:
        fn(torch.autograd.backward)
    return info.value


def rg_error(fn):
    with pytest.raises(Exception) as info:
        fn(lambda *a, **k: replaygrad.backward(*a, compiler=None, **k))
    return info.value


def assert_same_error(fn):
    expected, got = eager_error(fn), rg_error(fn)
    assert type(got) is type(expected)
    assert str(got) == str(expected)


def test_root_that_does_not_require_grad():
    x = torch.randn(3)
    assert_same_error(lambda bw: bw(x.sum()))


def test_second_root_that_does_not_require_grad():
    w = torch.randn(3, requires_grad=True)
    assert_same_error(lambda bw: bw([(w * 2).sum(), torch.randn(())]))


def test_non_scalar_root_without_grad_tensors():
    w = torch.randn(3, requires_grad=True)
    assert_same_error(lambda bw: bw(w * 2))


def test_grad_tensor_of_wrong_shape():
    w = torch.randn(3, requires_grad=True)
    assert_same_error(lambda bw: bw(w * 2, torch.ones(4)))


def test_backward_through_a_released_graph():
    w = torch.randn(3, requires_grad=True)

    def twice(bw):
        y = (w.exp() * w).sum()
        bw(y)
        bw(y)

    assert_same_error(twice)


def test_unknown_compiler_name():
    w = torch.randn(3, requires_grad=True)
    with pytest.raises(ValueError, match="unknown compiler 'no-such-backend'"):
        replaygrad.backward((w * 2).sum(), compiler="no-such-backend")
    assert w.grad is None


# ---- checks of backward formulas that compiled code leaves out -----------------------------

F = torch.nn.functional

#: In-place activations whose backward runs from their result: eager raises for a negative
#: slope; inductor's decompositions of their backward have no such check.
_IN_PLACE_ACTIVATIONS = {
    "leaky_relu_": lambda t, s: F.leaky_relu_(t, s),
    "elu_": lambda t, s: F.elu_(t, alpha=s),
    "celu_": lambda t, s: F.celu_(t, alpha=s),
    "rrelu_": lambda t, s: F.rrelu_(t, 2 * s - 0.5, 0.5),  # slope (lower + upper) / 2 = s
}


def _activation_backward(op: str, slope: float, backward) -> torch.Tensor:
    a = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
    out = _IN_PLACE_ACTIVATIONS[op](a * 1.5, slope)
    backward((out * out).sum())
    return a.grad


def _compiled_backward(compiler):
    return lambda *a, **k: replaygrad.backward(*a, compiler=compiler, **k)


@pytest.mark.parametrize("compiler", [None, "aot_eager", "inductor"])
@pytest.mark.parametrize("op", sorted(_IN_PLACE_ACTIVATIONS))
def test_in_place_activation_with_a_negative_slope(op, compiler):
    with pytest.raises(RuntimeError) as expected:
        _activation_backward(op, -2.0, torch.autograd.backward)
    with pytest.raises(RuntimeError) as got:
        _activation_backward(op, -2.0, _compiled_backward(compiler))
    assert str(got.value) == str(expected.value)
    # With a slope of 0 or more the same graph's backward works.
    expected_grad = _activation_backward(op, 0.25, torch.autograd.backward)
    torch.testing.assert_close(
        _activation_backward(op, 0.25, _compiled_backward(compiler)), expected_grad
    )


@pytest.mark.parametrize("compiler", [None, "aot_eager", "inductor"])
@pytest.mark.parametrize("shape", [(3, 3), (), (1,)])
def test_accumulating_put_with_a_0_dim_index(shape, compiler):
    # Its backward's take of a 0-dim index fails to compile under inductor (torch 2.13: a
    # data-dependent item()); found by an OpInfo sweep under inductor.
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        src = torch.randn((), dtype=torch.float64, requires_grad=True)
        y = x.put(torch.zeros((), dtype=torch.long), src, accumulate=True)
        backward((y * y).sum())
        return x.grad, src.grad

    torch.testing.assert_close(run(_compiled_backward(compiler)), run(torch.autograd.backward))


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
@pytest.mark.parametrize("decomposition", ["eig", "eigh"])
def test_eig_backward_of_a_loss_that_depends_on_the_eigenvectors_phases(decomposition, compiler):
    def run(loss_of, backward):
        torch.manual_seed(0)
        a = torch.randn(3, 3, dtype=torch.complex128)
        if decomposition == "eigh":
            a = a + a.mH
        a.requires_grad_()
        values, vectors = getattr(torch.linalg, decomposition)(a)
        backward(loss_of(values, vectors))
        return a.grad

    # Not invariant to a phase per eigenvector: eager's formula raises.
    def phase_dependent(values, vectors):
        return vectors.real.sum()

    with pytest.raises(RuntimeError) as expected:
        run(phase_dependent, torch.autograd.backward)
    with pytest.raises(RuntimeError) as got:
        run(phase_dependent, _compiled_backward(compiler))
    assert str(got.value) == str(expected.value)

    def invariant(values, vectors):
        return values.abs().sum() + vectors.abs().sum()

    torch.testing.assert_close(
        run(invariant, _compiled_backward(compiler)), run(invariant, torch.autograd.backward)
    )


def _put_backward(backward, deterministic: bool | None) -> tuple:
    """A backward through ``Tensor.put`` (without accumulate), whose formula's ``put_`` has no
    deterministic CPU kernel, with determinism on (True), on with warn_only (None) or off
    (False); returns the error message, put_'s warnings and the gradient."""
    x = torch.randn(5, requires_grad=True)
    source = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = (x.put(torch.tensor([1, 1]), source) * torch.arange(5.0)).sum()
    prior = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(deterministic is not False, warn_only=deterministic is None)
    error = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                backward(loss)
            except RuntimeError as e:
                error = str(e)
    finally:
        torch.use_deterministic_algorithms(prior[0], warn_only=prior[1])
    alerts = [str(w.message) for w in caught if "put_" in str(w.message)]
    return error, alerts, x.grad


@pytest.mark.parametrize("compiler", [None, "aot_eager", "inductor"])
def test_put_backward_under_deterministic_algorithms(compiler):
    # Each call follows the setting it runs under, with one compiled replay for all of them.
    for deterministic in (True, None, False, True):
        expected = _put_backward(torch.autograd.backward, deterministic)
        got = _put_backward(_compiled_backward(compiler), deterministic)
        assert got[:2] == expected[:2]
        assert (got[2] is None) == (expected[2] is None)
        if expected[2] is not None:
            assert torch.equal(got[2], expected[2])


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_a_cpp_warning_turned_into_an_error_is_raised_after_the_backward(compiler):
    # As run_backward does, the warning of put_'s formula is issued when the call ends: under
    # an "error" filter it is raised then, after every gradient was accumulated.
    def run(backward):
        x = torch.randn(5, requires_grad=True)
        source = torch.tensor([1.0, 2.0], requires_grad=True)
        loss = (x.put(torch.tensor([1, 1]), source) * torch.arange(5.0)).sum()
        prior = torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                with pytest.raises(UserWarning) as raised:
                    backward(loss)
        finally:
            torch.use_deterministic_algorithms(False, warn_only=prior)
        return str(raised.value), x.grad, source.grad

    expected = run(torch.autograd.backward)
    with replaygrad.enable(compiler):
        got = run(torch.autograd.backward)
    assert got[0] == expected[0]
    assert torch.equal(got[1], expected[1]) and torch.equal(got[2], expected[2])


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_checkpointed_eigh_is_not_unpacked_before_it_runs(compiler):
    # Whether an eigh step runs as itself is decided without reading its saved values,
    # which a checkpointed block's unpack hook recomputes when the block is reached.
    def run(backward):
        torch.manual_seed(0)
        a = torch.randn(3, 3, dtype=torch.complex128)
        a = (a + a.mH).requires_grad_()

        def block(m):
            return torch.linalg.eigh(m * 2)[1].abs().sum()

        backward(torch.utils.checkpoint.checkpoint(block, a, use_reentrant=False))
        return a.grad

    torch.testing.assert_close(run(_compiled_backward(compiler)), run(torch.autograd.backward))
