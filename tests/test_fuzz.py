"""Property-based differential fuzzing: random autograd programs (fuzz_graphs.py) run
backward through eager autograd and through replaygrad from the same leaf values, and
everything the backward leaves observable must agree: errors, hook calls and their
arguments in order, autograd.grad results, leaf .grad (values, strides, updated in place or
not), .grad of retain_grad and inputs= tensors, the root gradients. Every program is also
replayed a second time from a fresh graph, which reuses the cached replay.

The uncompiled replay (float64) must match bit for bit; the aot_eager one (float32) within
float32 tolerances. Differences found so far are minimal regression tests in
test_fuzz_regressions.py; the generator leaves out what triggers them (see
fuzz_graphs.EXCLUDED, COMPILED_EXCLUDED and the comments there). Longer runs, other
compilers: benchmarks/fuzz.py.
"""

from __future__ import annotations

import fuzz_graphs
import pytest
import torch
from hypothesis import HealthCheck, given, settings

SUPPRESSED = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.filter_too_much,
    HealthCheck.large_base_example,
    # conftest's autouse fixture clears the replay cache once per test, not per example:
    # later examples may reuse replays compiled for earlier ones, as a training loop would.
    HealthCheck.function_scoped_fixture,
]

# Eager itself warns when a permuted leaf gets a gradient in another layout.
pytestmark = pytest.mark.filterwarnings("ignore:grad and param do not obey the gradient layout")


@settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=SUPPRESSED,
)
@given(program=fuzz_graphs.programs(max_ops=40))
def test_uncompiled_replay_matches_eager_exactly(program):
    fuzz_graphs.check(
        program,
        compiler=None,
        dtype=torch.float64,
        exact=True,
        repeat=True,
    )


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=SUPPRESSED,
)
@given(program=fuzz_graphs.programs(exclude=fuzz_graphs.COMPILED_EXCLUDED))
def test_aot_eager_replay_matches_eager(program):
    fuzz_graphs.check(
        program,
        compiler="aot_eager",
        dtype=torch.float32,
        exact=False,
        repeat=True,
    )
