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

// A C++ Function whose backward runs a backward itself (a checkpoint written in C++), and
// a C++ tensor hook that does: the engine refuses calls made with the GIL held.
struct Recompute : public torch::autograd::Function<Recompute> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    ctx->save_for_backward({x});
    torch::NoGradGuard no_grad;
    return x.tanh();
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grad_output) {
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    torch::AutoGradMode grad_mode(true);
    return torch::autograd::grad({x.tanh()}, {x}, {grad_output[0]});
  }
};

torch::Tensor recomputed_tanh(torch::Tensor x) {
  return Recompute::apply(x);
}

void add_grad_of_hook(torch::Tensor t, torch::Tensor out, torch::Tensor in) {
  t.register_hook([out, in](torch::Tensor g) {
    return g + torch::autograd::grad({out}, {in}, {}, true)[0].sum();
  });
}

TORCH_LIBRARY(replaygrad_test_non_traceable, m) {
  m.def("custom_op_backed_by_autograd_fn", custom_op_backed_by_autograd_fn);
}
"""


@pytest.fixture(scope="module")
def extension():
    return torch.utils.cpp_extension.load_inline(
        name="replaygrad_test_non_traceable",
        cpp_sources=CPP_SOURCE,
        functions=["custom_op_backed_by_autograd_fn", "recomputed_tanh", "add_grad_of_hook"],
        verbose=False,
    )


@pytest.fixture(scope="module")
def non_traceable_op(extension):
    return torch.ops.replaygrad_test_non_traceable.custom_op_backed_by_autograd_fn


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_cpp_backward_calling_the_engine(extension, compiler):
    def run(backward):
        x = torch.linspace(-1, 1, 5, requires_grad=True)
        backward(extension.recomputed_tanh(x * 2).sum())
        y = torch.ones(3, requires_grad=True)
        h = x * 2
        extension.add_grad_of_hook(h, (y * 3).sum(), y)
        backward((h * h).sum())
        return x.grad

    expected = run(torch.autograd.backward)
    got = run(lambda loss: replaygrad.backward(loss, compiler=compiler))
    assert torch.equal(got, expected)


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
