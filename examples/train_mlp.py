"""A training loop whose backward passes run through replaygrad.

Run: python examples/train_mlp.py [--compiler inductor|aot_eager|none] [--steps N]
The loop itself is ordinary PyTorch: `replaygrad.enable()` routes every `loss.backward()`
through a replay that is compiled once and reused for every step.
"""

from __future__ import annotations

import argparse
import copy

import torch

import replaygrad


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 1),
    )


def train(model: torch.nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiler", default="inductor")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    compiler = None if args.compiler == "none" else args.compiler

    torch.manual_seed(0)
    w_true = torch.randn(20, 1)
    data = []
    for _ in range(args.steps):
        x = torch.randn(32, 20)
        data.append((x, x @ w_true + 0.1 * torch.randn(32, 1)))

    model = make_model()
    twin = copy.deepcopy(model)
    eager_losses = train(model, data)
    with replaygrad.enable(compiler):
        replay_losses = train(twin, data)

    info = replaygrad.cache_info()
    drift = max(abs(a - b) for a, b in zip(eager_losses, replay_losses))
    print(f"loss: first {replay_losses[0]:.4f}, last {replay_losses[-1]:.4f}")
    print(f"largest difference from eager training: {drift:.2e}")
    print(f"compiled replays: {info.misses}, reused: {info.hits}")


if __name__ == "__main__":
    main()
