"""replaygrad demo: gradients of a small MLP, eager autograd against replaygrad."""

import copy

import torch

import replaygrad


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 10),
    )
    twin = copy.deepcopy(model)
    x, target = torch.randn(16, 32), torch.randint(0, 10, (16,))

    torch.nn.functional.cross_entropy(model(x), target).backward()
    loss = torch.nn.functional.cross_entropy(twin(x), target)
    print("plan:", " -> ".join(replaygrad.plan(loss).order[:6]), "...")
    replaygrad.backward(loss, compiler="inductor")

    print(f"{'parameter':<12} {'eager grad[0]':>14} {'replaygrad grad[0]':>19} {'max |diff|':>11}")
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        diff = (p.grad - q.grad).abs().max().item()
        worst = max(worst, diff)
        e, r = p.grad.flatten()[0].item(), q.grad.flatten()[0].item()
        print(f"{name:<12} {e:>14.6f} {r:>19.6f} {diff:>11.2e}")
    print(f"max difference over all gradients: {worst:.2e}")


if __name__ == "__main__":
    main()
