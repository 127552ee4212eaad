"""PyTorch's OpInfo database through replaygrad.grad, against torch.autograd.grad.

The fast test runs benchmarks/opinfo_sweep.py on a deterministic sample of ops (minus the
known failures in opinfo_known_failures.txt) and a few samples each; the slow one runs the
whole sweep and compares it with that file.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from conftest import FAST_COMPILERS

pytest.importorskip("expecttest", reason="torch.testing._internal needs expecttest")

ROOT = Path(__file__).resolve().parents[1]
KNOWN_FAILURES = Path(__file__).with_name("opinfo_known_failures.txt")
sys.path.insert(0, str(ROOT / "benchmarks"))

import opinfo_sweep as sweep  # noqa: E402

SAMPLE_OPS = 40
SAMPLES_PER_OP = 3


@pytest.fixture(scope="module")
def sample_results():
    """One sweep over the sample for both fast compilers (eager runs once per sample)."""
    known = sweep.load_known_failures(KNOWN_FAILURES)
    ops = sweep.select_ops(n=SAMPLE_OPS, seed=0, exclude=sweep.known_ops(known, FAST_COMPILERS))
    assert len(ops) == SAMPLE_OPS
    return sweep.run_sweep(ops, FAST_COMPILERS, max_samples=SAMPLES_PER_OP, timeout=60)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_opinfo_sample_matches_eager(sample_results, compiler):
    name = sweep.compiler_name(compiler)
    results = [r for r in sample_results if r.compiler == name]
    compared = [r for r in results if r.status != "skipped"]
    assert len(compared) >= SAMPLE_OPS, "most samples should run"
    # "engine": replaygrad left the call to PyTorch's engine, so nothing was tested.
    failing = [
        f"{r.op}[{r.sample}] {r.status}: {r.detail}"
        for r in results
        if r.status in (*sweep.FAILING, "engine")
    ]
    assert not failing, "\n".join(failing)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("REPLAYGRAD_SLOW"),
    reason="the full OpInfo sweep takes 20-30 min on 2 cores: set REPLAYGRAD_SLOW=1",
)
def test_opinfo_full_sweep_matches_known_failures():
    known = sweep.load_known_failures(KNOWN_FAILURES)
    results = sweep.run_sweep(sweep.select_ops(), FAST_COMPILERS)
    cmp = sweep.compare_known(results, known)
    fixed = "\n".join(f"fixed (remove from the file): {c} {op}" for c, op in cmp.fixed)
    new = "\n".join(f"NEW: {f.line()}" for f in cmp.new)
    assert not cmp.new, f"{new}\n{fixed}"
    if cmp.fixed:
        pytest.fail(f"known failures now pass; update {KNOWN_FAILURES.name}:\n{fixed}")


def test_sweep_comparison_catches_differences():
    import torch

    a = torch.tensor([1.0, float("nan"), float("inf")], dtype=torch.float64)
    assert sweep.compare([a, None], [a.clone(), None], True, sweep.TIGHT)[0]
    assert not sweep.compare([a], [a + 1e-12], True, sweep.TIGHT)[0]
    assert sweep.compare([a], [a + 1e-12], False, sweep.COMPILED)[0]
    assert not sweep.compare([a], [a * (1 + 1e-6)], False, sweep.COMPILED)[0]
    assert not sweep.compare([a], [None], False, sweep.COMPILED)[0]
    assert not sweep.compare([a], [a.float()], False, sweep.COMPILED)[0]
    assert sweep.max_difference(a, torch.tensor([1.0, 0.0, float("inf")])) == float("inf")
