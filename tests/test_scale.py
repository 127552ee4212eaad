"""Large graphs and concurrent threads."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch

import replaygrad

from conftest import assert_replayed


def test_hundred_thousand_node_graph_plans_and_replays():
    x = torch.randn(4, requires_grad=True)
    h = x
    for _ in range(50_000):
        h = h * 1.0001 + 0.001  # MulBackward0 + AddBackward0 per round
    loss = h.sum()
    plan = replaygrad.plan(loss)
    assert len(plan.order) == 100_002
    (expected,) = torch.autograd.grad(loss, x, retain_graph=True)
    before = replaygrad.cache_info()
    replaygrad.backward(loss, compiler=None)
    assert_replayed(before)
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("compiler", ["None", "lambda fn: fn"])
def test_a_long_chain_is_freed_after_its_replay(compiler):
    """torch 2.13 frees the nodes that have a Python object (which a node keeps once given
    one) recursively, one after the other, where it frees the others iteratively: replays
    that made objects for every node of a long chain (to read their saved state) crashed
    when the graph was freed, which eager frees. Run with a 1 MB stack, so that a chain of
    20,002 nodes is long enough. A compiler callable takes the weight's gradient from the
    matrix product's factors (see ``_products``)."""
    script = (
        "import torch, replaygrad\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(4, 4, requires_grad=True)\n"
        "h = torch.randn(3, 4).mm(w)\n"
        "for _ in range(10_000):\n"
        "    h = h * 1.0001 + 0.001\n"
        "loss = h.sum()\n"
        "(expected,) = torch.autograd.grad(loss, w, retain_graph=True)\n"
        f"replaygrad.backward(loss, compiler={compiler})\n"
        "torch.testing.assert_close(w.grad, expected)\n"
        "del loss, h\n"
        "print('freed')\n"
    )
    result = subprocess.run(
        ["bash", "-c", 'ulimit -s 1024 && exec "$0" -c "$1"', sys.executable, script],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (result.returncode, result.stdout) == (0, "freed\n"), result.stderr[-2000:]


def test_two_threads_with_independent_models():
    results = {}
    errors = []

    def train(name, compiler):
        try:
            torch.manual_seed(hash(name) % 1000)
            model = torch.nn.Sequential(
                torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)
            )
            twin = torch.nn.Sequential(
                torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2)
            )
            twin.load_state_dict(model.state_dict())
            for i in range(10):
                x = torch.randn(3, 5)
                model.zero_grad()
                model(x).square().sum().backward()
                twin.zero_grad()
                with replaygrad.enable(compiler):
                    twin(x).square().sum().backward()
                for p, q in zip(model.parameters(), twin.parameters()):
                    torch.testing.assert_close(q.grad, p.grad, msg=f"{name} step {i}")
            results[name] = True
        except Exception as e:  # reported by the main thread
            errors.append((name, e))

    threads = [
        threading.Thread(target=train, args=("a", None)),
        threading.Thread(target=train, args=("b", "aot_eager")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {"a": True, "b": True}
