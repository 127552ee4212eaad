"""The three acceptance scenarios of the proof of concept, through the public API on a stock
torch wheel."""

from __future__ import annotations

import pytest
import torch
import torch.utils.cpp_extension

import replaygrad

CPP_SOURCE = """
struct CustomOpAutogradFunction : public torch::autograd::Function<CustomOpAutogradFunction> {
  static constexpr bool is_traceable = false;

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    return x;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad_output) {
    // not traceable: writes through a raw data pointer
    *grad_output[0].data_ptr<float>() = 3.14;
    return grad_output;
  }
};

torch::Tensor custom_op_backed_by_autograd_fn(torch::Tensor x) {
  return CustomOpAutogradFunction::apply(x);
}

TORCH_LIBRARY(replaygrad_test_non_traceable, m) {
  m.def("custom_op_backed_by_autograd_fn", custom_op_backed_by_autograd_fn);
}
"""


@pytest.fixture(scope="module")
def non_traceable_op():
    torch.utils.cpp_extension.load_inline(
        name="replaygrad_test_non_traceable",
        cpp_sources=CPP_SOURCE,
        functions="custom_op_backed_by_autograd_fn",
        verbose=False,
    )
    return torch.ops.replaygrad_test_non_traceable.custom_op_backed_by_autograd_fn


def test_addcmul_sum_aot_eager_fullgraph():
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    value = 2.0
    loss = torch.addcmul(a, b, c, value=value).sum()
    replaygrad.backward(loss, compiler=torch.compile(backend="aot_eager", fullgraph=True))
    assert torch.allclose(a.grad, torch.ones_like(a))
    assert torch.allclose(b.grad, c * value)
    assert torch.allclose(c.grad, b * value)


def test_prehook_with_side_effect_runs_once_fullgraph():
    a, b, c = (torch.randn(3, requires_grad=True) for _ in range(3))
    out = torch.addcmul(a, b, c, value=2.0)
    stuff = []

    def hook(grads):
        stuff.append(grads[0])
        return grads

    out.grad_fn.register_prehook(hook)
    replaygrad.backward(out.sum(), compiler=torch.compile(backend="eager", fullgraph=True))
    assert len(stuff) == 1
    assert torch.allclose(stuff[0], torch.ones_like(stuff[0]))


def test_non_traceable_cpp_function_graph_breaks(non_traceable_op):
    x = torch.ones(10, 10, requires_grad=True)
    loss = non_traceable_op(x).sum()
    plan = replaygrad.plan(loss)
    assert [name for _, name in plan.opaque] == [
        "torch::autograd::CppNode<CustomOpAutogradFunction>"
    ]
    replaygrad.backward(loss, compiler=torch.compile(backend="eager"))
    assert torch.allclose(x.grad, torch.ones_like(x) * 3.14)


@pytest.mark.parametrize("compiler", [None, "aot_eager", "inductor"])
def test_non_traceable_cpp_function_runs_the_current_node_every_iteration(
    non_traceable_op, compiler
):
    for _ in range(3):
        x = torch.ones(4, 4, requires_grad=True)
        y = torch.randn(4, 4, requires_grad=True)
        loss = (non_traceable_op(x * y) * 2).sum()
        replaygrad.backward(loss, compiler=compiler)
        # d(loss)/d(x*y) = 2 everywhere, then the C++ node overwrites element 0 with 3.14.
        expected = torch.full((4, 4), 2.0)
        expected.view(-1)[0] = 3.14
        torch.testing.assert_close(x.grad, expected * y.detach())
