"""Long differential fuzzing runs of replaygrad against eager autograd: the property of
tests/test_fuzz.py (random programs from tests/fuzz_graphs.py, same leaves, everything the
backward leaves observable compared) with many more examples.

Usage::

    python benchmarks/fuzz.py --examples 20000                    # uncompiled, float64, exact
    python benchmarks/fuzz.py --examples 500 --compiler aot_eager  # float32, tolerances
    python benchmarks/fuzz.py --examples 100 --compiler inductor --max-ops 12
    python benchmarks/fuzz.py --examples 500 --compiler aot     # aot_eager as a callable
    python benchmarks/fuzz.py --examples 5000 --seed 7 --keep-going
    python benchmarks/fuzz.py --include-excluded --inplace-hooks --keep-going

By default hypothesis stops at the first failure, shrinks it and prints the minimal program
(derandomized unless ``--seed`` is given). ``--keep-going`` instead runs every example,
groups failures by their first message line and prints the smallest program of each group.
Exit status 1 when anything failed.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, seed, settings

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS))

import fuzz_graphs  # noqa: E402

import replaygrad  # noqa: E402


def aot_callable(fn: Any) -> Any:
    """``--compiler aot``: aot_eager given as a compiler callable."""
    return torch.compile(fn, backend="aot_eager")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--examples", type=int, default=5000, help="number of programs")
    p.add_argument(
        "--compiler",
        default="none",
        help="none (exact comparison in float64), a torch.compile backend (float32, compared "
        "with tolerances), or aot: aot_eager as a compiler callable, whose replays, like "
        "inductor's, take weights' gradients from matrix products as their factors "
        "(replays compiled with the backend name aot_eager run eager's ops)",
    )
    p.add_argument(
        "--dtype", choices=("float64", "float32"), help="leaf dtype (default by compiler)"
    )
    p.add_argument("--max-ops", type=int, default=24)
    p.add_argument("--max-leaves", type=int, default=3)
    p.add_argument("--seed", type=int, help="random (not derandomized) run with this seed")
    p.add_argument("--keep-going", action="store_true", help="collect all failures, no shrinking")
    p.add_argument(
        "--include-excluded",
        action="store_true",
        help="also draw the kinds in fuzz_graphs.EXCLUDED (and COMPILED_EXCLUDED with a "
        "compiler): known differences",
    )
    p.add_argument(
        "--inplace-hooks",
        action="store_true",
        help="hooks may also modify gradients in place (known differences)",
    )
    p.add_argument(
        "--kinds", help="comma-separated op kinds to draw from (default: all but EXCLUDED)"
    )
    p.add_argument("--exclude", help="comma-separated op kinds not to draw")
    p.add_argument("--no-repeat", action="store_true", help="replay each program once, not twice")
    p.add_argument("--cache-size", type=int, default=256, help="replaygrad's replay cache size")
    p.add_argument(
        "--reset-every",
        type=int,
        default=500,
        help="clear replaygrad's cache every N programs (0: never). Programs of one graph "
        "shape with other node state (a scalar) share a limit of compiled variants "
        "(torch._dynamo.config.recompile_limit), past which the engine runs them, which the "
        "check reports as a call not replayed; thousands of programs reach it",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    compiler: Any = None if args.compiler.lower() in ("none", "") else args.compiler
    if compiler == "aot":
        compiler = aot_callable
    dtype = getattr(torch, args.dtype or ("float64" if compiler is None else "float32"))
    exact = compiler is None and dtype == torch.float64
    if args.kinds:
        kinds = args.kinds.split(",")
        unknown = set(kinds) - set(fuzz_graphs.KINDS)
        if unknown:
            raise SystemExit(f"unknown kinds: {sorted(unknown)}; known: {fuzz_graphs.KINDS}")
        kinds = [
            k for k in kinds for _ in range(fuzz_graphs.WEIGHTS.get(k, fuzz_graphs.DEFAULT_WEIGHT))
        ]
    elif args.include_excluded:
        kinds = [
            k
            for k in fuzz_graphs.KINDS
            for _ in range(fuzz_graphs.WEIGHTS.get(k, fuzz_graphs.DEFAULT_WEIGHT))
        ]
    else:
        kinds = None
    exclude = set(args.exclude.split(",")) if args.exclude else set()
    if compiler is not None and not args.include_excluded:
        exclude |= set(fuzz_graphs.COMPILED_EXCLUDED)
    if kinds is not None:
        kinds = [k for k in kinds if k not in exclude]
    strategy = fuzz_graphs.programs(
        max_leaves=args.max_leaves,
        max_ops=args.max_ops,
        kinds=kinds,
        exclude=tuple(exclude),
        inplace_hooks=args.inplace_hooks,
        dtype=dtype,
    )
    replaygrad.set_cache_size(args.cache_size)
    torch.set_num_threads(1)

    stats: collections.Counter[str] = collections.Counter()
    failures: collections.Counter[str] = collections.Counter()
    smallest: dict[str, fuzz_graphs.Program] = {}
    tracebacks: dict[str, str] = {}  # the end of the first traceback of each group

    def run(program: fuzz_graphs.Program) -> None:
        if args.reset_every and stats["examples"] % args.reset_every == 0:
            replaygrad.reset()
        stats["examples"] += 1
        stats["ops"] += len(program.ops)
        try:
            fuzz_graphs.check(
                program, compiler=compiler, dtype=dtype, exact=exact, repeat=not args.no_repeat
            )
        except Exception as error:
            if not args.keep_going:
                raise
            where = traceback.extract_tb(error.__traceback__)[-1]
            message = str(error).splitlines()[0][:200] if str(error) else ""
            key = f"{type(error).__name__}: {message} ({where.filename}:{where.lineno})"
            failures[key] += 1
            if key not in smallest or len(program.ops) < len(smallest[key].ops):
                smallest[key] = program
            tracebacks.setdefault(key, "".join(traceback.format_exception(error)[-12:]))

    test = given(strategy)(run)
    test = settings(
        max_examples=args.examples,
        deadline=None,
        derandomize=args.seed is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=True,
    )(test)
    if args.seed is not None:
        test = seed(args.seed)(test)

    print(
        f"fuzzing {args.examples} programs: compiler={compiler!r} dtype={dtype} exact={exact} "
        f"max_ops={args.max_ops}",
        flush=True,
    )
    start = time.perf_counter()
    status = 0
    try:
        test()
    except Exception as error:  # hypothesis' shrunk failure(s); the programs are printed
        status = 1
        print(f"FAILED: {type(error).__name__}: {error}", file=sys.stderr)
    elapsed = time.perf_counter() - start
    n = max(stats["examples"], 1)
    print(
        f"{stats['examples']} runs (with shrinking) in {elapsed:.1f} s, "
        f"{1000 * elapsed / n:.1f} ms each, {stats['ops'] / n:.1f} ops on average; "
        f"replay cache {replaygrad.cache_info()}"
    )
    if fuzz_graphs.REJECTED:
        print(f"ops the meta forward rejected while drawing: {dict(fuzz_graphs.REJECTED)}")
    for key, count in failures.most_common():
        status = 1
        print(f"\n{count} x {key}\n  smallest: {smallest[key]}\n  first seen:\n{tracebacks[key]}")
    if status == 0:
        print("no differences")
    return status


if __name__ == "__main__":
    sys.exit(main())
