"""A C++ autograd Function that cannot be traced becomes a graph break, not an error.

torch's compiled autograd fails on C++ nodes it cannot trace; replaygrad runs such a node
as itself, eagerly, between compiled regions. Run: python examples/custom_cpp_op.py
(the first run compiles a small C++ extension, about a minute).
"""

from __future__ import annotations

import torch
import torch.utils.cpp_extension

import replaygrad

SOURCE = """
struct ClipGrad : public torch::autograd::Function<ClipGrad> {
  static constexpr bool is_traceable = false;

  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x) {
    return x.clone();
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    // Reads and writes gradient memory through raw pointers: not traceable.
    auto g = grads[0].contiguous().clone();
    float* p = g.data_ptr<float>();
    for (int64_t i = 0; i < g.numel(); ++i) {
      p[i] = p[i] > 1.0f ? 1.0f : (p[i] < -1.0f ? -1.0f : p[i]);
    }
    return {g};
  }
};

torch::Tensor clip_grad(torch::Tensor x) { return ClipGrad::apply(x); }

TORCH_LIBRARY(replaygrad_example, m) { m.def("clip_grad", clip_grad); }
"""


def main() -> None:
    torch.utils.cpp_extension.load_inline(
        name="replaygrad_example", cpp_sources=SOURCE, functions="clip_grad", verbose=False
    )
    clip_grad = torch.ops.replaygrad_example.clip_grad

    torch.manual_seed(0)
    w = torch.randn(8, requires_grad=True)

    def loss_fn() -> torch.Tensor:
        return (clip_grad(w * 3).exp() * 4).sum()

    loss_fn().backward()
    expected = w.grad.clone()
    w.grad = None

    loss = loss_fn()
    print(replaygrad.plan(loss))
    print("graph breaks:", [name for _, name in replaygrad.plan(loss).opaque])
    replaygrad.backward(loss, compiler="aot_eager")
    print("gradients equal eager:", torch.allclose(w.grad, expected))


if __name__ == "__main__":
    main()
