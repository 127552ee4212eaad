"""Differential sweep of replaygrad against eager autograd over PyTorch's OpInfo database.

For every op in ``torch.testing._internal.common_methods_invocations.op_db`` that supports
backward on CPU in float64 (else float32), each sample input is run forward from scratch once
per engine (same inputs, same RNG seed) and differentiated with random cotangents w.r.t. every
input tensor that requires grad: with ``torch.autograd.grad`` (eager) and with
``replaygrad.grad`` for each compiler. A sample is

- ``equal``: gradients match (None in the same places; with ``compiler=None`` bit-exactly
  where eager is deterministic, else within a tight tolerance; compiled within rtol/atol
  suited to the dtype),
- ``differ``: they do not,
- ``error``: replaygrad raised (or ran past the time limit) where eager did not,
- ``engine``: replaygrad handed the call to PyTorch's engine (no replay ran, nothing tested),
- ``skipped``: eager raised, or the sample has nothing to differentiate.

Usage::

    python benchmarks/opinfo_sweep.py                      # all ops, compilers None, aot_eager
    python benchmarks/opinfo_sweep.py --ops 40 --compilers none
    python benchmarks/opinfo_sweep.py --op 'linalg.*' --json results.json
    python benchmarks/opinfo_sweep.py --known-failures tests/opinfo_known_failures.txt
    python benchmarks/opinfo_sweep.py --write-known-failures tests/opinfo_known_failures.txt

Importable: ``select_ops``, ``run_sweep``, ``load_known_failures`` and ``compare_known`` are
what tests/test_opinfo_sample.py uses. Needs ``expecttest`` (torch.testing._internal imports
it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import json
import random
import signal
import sys
import time
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from torch.utils._pytree import tree_flatten

import replaygrad
from replaygrad._compile import cache

DEFAULT_COMPILERS: tuple[str | None, ...] = (None, "aot_eager")
#: Statuses that count as a failure (an op is "known failing" if any sample has one).
FAILING = ("differ", "error")

# Tolerances: (rtol, atol) per dtype. "tight" is for compiler=None where eager itself is not
# bit-reproducible; "compiled" for torch.compile'd replays.
TIGHT = {torch.float64: (1e-10, 1e-12), torch.float32: (1e-6, 1e-7)}
COMPILED = {torch.float64: (1e-7, 1e-7), torch.float32: (1e-5, 1e-5)}


def compiler_name(compiler: str | None) -> str:
    return "none" if compiler is None else str(compiler)


def parse_compiler(name: str) -> str | None:
    return None if name.strip().lower() in ("none", "") else name.strip()


# ---- environment -------------------------------------------------------------------------


@contextlib.contextmanager
def configured() -> Iterator[None]:
    """Settings that make thousands of tiny compiles feasible and results reproducible;
    restored on exit (the sweep also runs inside pytest)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    patch: dict[str, Any] = {
        # Each replay is a new code object, but replays with equal plan keys share one and
        # recompile for new shapes/dtypes: do not give up on them after 8 variants.
        "recompile_limit": 64,
        "accumulated_recompile_limit": 100_000,
        "suppress_errors": False,
    }
    if hasattr(torch._dynamo.config, "automatic_dynamic_local_pgo"):
        # No profile-guided dynamic shapes carried over from earlier processes.
        patch["automatic_dynamic_local_pgo"] = False
    try:
        with torch._dynamo.config.patch(patch), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        torch.set_num_threads(threads)


def reset_compilers() -> None:
    """Drops compiled replays and Dynamo's caches (bounds memory across ops)."""
    cache.clear()
    torch._dynamo.reset()


def load_op_db() -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    return list(op_db)


# ---- op selection ------------------------------------------------------------------------


def op_key(op: Any) -> str:
    """The op's name, with its variant (``name.variant``) where it has one."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def pick_dtype(op: Any) -> torch.dtype | None:
    """float64 if the op supports backward in it on CPU, else float32, else None."""
    if not op.supports_autograd:
        return None
    try:
        dtypes = op.supported_backward_dtypes("cpu")
    except Exception:
        return None
    for dtype in (torch.float64, torch.float32):
        if dtype in dtypes:
            return dtype
    return None


def select_ops(
    patterns: Sequence[str] | None = None,
    n: int | None = None,
    *,
    seed: int = 0,
    first: bool = False,
    exclude: Iterable[str] = (),
    op_db: Sequence[Any] | None = None,
) -> list[tuple[Any, torch.dtype]]:
    """The eligible ops as ``(op, dtype)``, in op_db order.

    ``patterns`` filters by op key or name (fnmatch globs); ``exclude`` drops op keys; ``n``
    keeps the first ``n`` (``first``) or a deterministic random sample of ``n`` (``seed``).
    """
    ops = load_op_db() if op_db is None else op_db
    excluded = set(exclude)
    eligible = []
    for op in ops:
        key = op_key(op)
        if key in excluded:
            continue
        if patterns and not any(
            fnmatch.fnmatchcase(key, p) or fnmatch.fnmatchcase(op.name, p) for p in patterns
        ):
            continue
        dtype = pick_dtype(op)
        if dtype is not None:
            eligible.append((op, dtype))
    if n is not None and n < len(eligible):
        if first:
            eligible = eligible[:n]
        else:
            keep = set(random.Random(seed).sample(range(len(eligible)), n))
            eligible = [e for i, e in enumerate(eligible) if i in keep]
    return eligible


# ---- one sample --------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    op: str
    dtype: str
    sample: int
    compiler: str
    status: str  # equal | differ | error | engine | skipped
    detail: str = ""
    max_diff: float | None = None
    exact: bool | None = None
    seconds: float = 0.0


class SampleTimeout(BaseException):
    """Raised by the alarm when a sample runs past its time limit (a BaseException, so that
    code under test does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """SIGALRM-based limit (main thread only; a long C++ call is interrupted when it returns
    to Python)."""
    if not seconds or seconds <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise SampleTimeout(f"timeout after {seconds:g} s")

    try:
        previous = signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:  # not the main thread
        yield
        return
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    line = text[0].strip() if text else ""
    return f"{type(exc).__name__}: {line}"[:300]


def sample_function(op: Any, sample: Any) -> Callable[[], Any]:
    """The sample's forward, as test_ops_gradients runs it (gradcheck_wrapper, then
    output_process_fn_grad)."""
    variant = op.get_op()

    def forward() -> Any:
        out = op.gradcheck_wrapper(variant, sample.input, *sample.args, **sample.kwargs)
        if sample.output_process_fn_grad is not None:
            out = sample.output_process_fn_grad(out)
        return out

    return forward


def grad_inputs(sample: Any) -> list[torch.Tensor]:
    """Every tensor of the sample that requires grad, once each, in argument order."""
    leaves, _ = tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
    seen: set[int] = set()
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def differentiable_outputs(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [
        t
        for t in leaves
        if isinstance(t, torch.Tensor)
        and t.requires_grad
        and (t.dtype.is_floating_point or t.dtype.is_complex)
    ]


def random_cotangents(roots: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(r.shape, dtype=r.dtype, generator=gen).to(device=r.device) for r in roots]


def run_engine(
    forward: Callable[[], Any],
    inputs: Sequence[torch.Tensor],
    cotangents: Sequence[torch.Tensor] | None,
    engine: str | None,
    seed: int,
) -> tuple[tuple[torch.Tensor | None, ...], list[torch.Tensor]]:
    """A fresh forward (RNG seeded, so random ops repeat) and its backward.

    ``engine`` is "eager" or a replaygrad compiler. Returns the gradients and the cotangents
    used (random ones of the roots' shapes when ``cotangents`` is None).
    """
    torch.manual_seed(seed)
    roots = differentiable_outputs(forward())
    if not roots:
        raise LookupError("no differentiable output")
    if cotangents is None:
        cotangents = random_cotangents(roots, seed)
    elif [(r.shape, r.dtype) for r in roots] != [(c.shape, c.dtype) for c in cotangents]:
        raise RuntimeError("the forward's outputs changed between runs")
    if engine == "eager":
        grads = torch.autograd.grad(roots, inputs, cotangents, allow_unused=True)
    else:
        calls = cache.hits + cache.misses
        grads = replaygrad.grad(roots, inputs, cotangents, allow_unused=True, compiler=engine)
        if cache.hits + cache.misses == calls:
            raise EngineRan
    return tuple(grads), list(cotangents)


class EngineRan(Exception):
    """replaygrad looked up no replay: the engine ran the call."""


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


def max_difference(expected: torch.Tensor, actual: torch.Tensor) -> float:
    """Largest |expected - actual|; NaN in both places counts as equal, in one as inf."""
    e, a = _dense(expected).detach(), _dense(actual).detach()
    if e.numel() == 0:
        return 0.0
    if not (e.dtype.is_floating_point or e.dtype.is_complex):
        return float((e != a).any())
    e_nan, a_nan = torch.isnan(e), torch.isnan(a)
    if not torch.equal(e_nan, a_nan):
        return float("inf")
    diff = (e - a).abs().masked_fill(e_nan, 0)
    same_inf = torch.isinf(e) & (e == a)
    diff = diff.masked_fill(same_inf, 0)
    return float(torch.nan_to_num(diff, nan=float("inf")).max())


def compare(
    expected: Sequence[torch.Tensor | None],
    actual: Sequence[torch.Tensor | None],
    exact: bool,
    tolerances: dict[torch.dtype, tuple[float, float]],
) -> tuple[bool, str, float | None]:
    """(equal, detail, max difference) of two gradient tuples."""
    if len(expected) != len(actual):
        return False, f"{len(actual)} gradients, eager has {len(expected)}", None
    worst = 0.0
    mismatch = ""
    for i, (e, a) in enumerate(zip(expected, actual)):
        if e is None or a is None:
            if e is not a:
                return False, f"grad {i}: {_describe(a)}, eager {_describe(e)}", None
            continue
        if e.shape != a.shape or e.dtype != a.dtype or e.layout != a.layout:
            return False, f"grad {i}: {_describe(a)}, eager {_describe(e)}", None
        diff = max_difference(e, a)
        worst = max(worst, diff)
        if exact:
            ok = diff == 0.0
        else:
            rtol, atol = tolerances.get(e.dtype, tolerances[torch.float32])
            de, da = _dense(e).detach(), _dense(a).detach()
            ok = de.numel() == 0 or torch.allclose(da, de, rtol=rtol, atol=atol, equal_nan=True)
        if not ok and not mismatch:
            mismatch = f"grad {i} differs by {diff:.3g}"
    if mismatch:
        return False, mismatch, worst
    return True, "", worst


def _describe(t: torch.Tensor | None) -> str:
    if t is None:
        return "None"
    layout = "" if t.layout == torch.strided else f" {t.layout}"
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}{layout}"


def _real_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype.to_real() if dtype.is_complex else dtype


def run_sample(
    op: Any,
    dtype: torch.dtype,
    index: int,
    sample: Any,
    compilers: Sequence[str | None],
    *,
    seed: int,
    timeout: float | None,
) -> list[Result]:
    """One sample: eager twice (to know whether it is bit-reproducible), then each
    compiler, each from a fresh forward."""
    key, dname = op_key(op), str(dtype).removeprefix("torch.")

    def result(compiler: str | None, status: str, detail: str = "", **kw: Any) -> Result:
        return Result(key, dname, index, compiler_name(compiler), status, detail, **kw)

    forward = sample_function(op, sample)
    inputs = grad_inputs(sample)
    if not inputs:
        return [result(c, "skipped", "no input requires grad") for c in compilers]
    try:
        with time_limit(timeout):
            expected, cotangents = run_engine(forward, inputs, None, "eager", seed)
            again, _ = run_engine(forward, inputs, cotangents, "eager", seed)
    except (Exception, SampleTimeout) as exc:
        return [result(c, "skipped", f"eager: {first_line(exc)}") for c in compilers]
    deterministic, _, _ = compare(expected, again, True, TIGHT)

    out = []
    for compiler in compilers:
        start = time.perf_counter()
        try:
            with time_limit(timeout):
                got, _ = run_engine(forward, inputs, cotangents, compiler, seed)
        except EngineRan:
            out.append(result(compiler, "engine", "replaygrad left the call to the engine"))
            continue
        except (Exception, SampleTimeout) as exc:
            if isinstance(exc, SampleTimeout):
                reset_compilers()  # a compile may have been interrupted halfway
            out.append(
                result(compiler, "error", first_line(exc), seconds=time.perf_counter() - start)
            )
            continue
        exact = compiler is None and deterministic
        tolerances = TIGHT if compiler is None else COMPILED
        equal, detail, diff = compare(expected, got, exact, tolerances)
        out.append(
            result(
                compiler,
                "equal" if equal else "differ",
                detail,
                max_diff=diff,
                exact=exact,
                seconds=time.perf_counter() - start,
            )
        )
    return out


# ---- the sweep ---------------------------------------------------------------------------


def op_seed(key: str) -> int:
    return zlib.crc32(key.encode())


def run_op(
    op: Any,
    dtype: torch.dtype,
    compilers: Sequence[str | None],
    *,
    max_samples: int | None = None,
    timeout: float | None = 120.0,
) -> list[Result]:
    key = op_key(op)
    seed = op_seed(key)
    torch.manual_seed(seed)
    dname = str(dtype).removeprefix("torch.")
    try:
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=True))
    except Exception as exc:
        return [
            Result(key, dname, -1, compiler_name(c), "skipped", f"samples: {first_line(exc)}")
            for c in compilers
        ]
    if max_samples is not None:
        samples = samples[:max_samples]
    results: list[Result] = []
    for index, sample in enumerate(samples):
        results.extend(
            run_sample(op, dtype, index, sample, compilers, seed=seed + index, timeout=timeout)
        )
    return results


def run_sweep(
    ops: Sequence[tuple[Any, torch.dtype]],
    compilers: Sequence[str | None] = DEFAULT_COMPILERS,
    *,
    max_samples: int | None = None,
    timeout: float | None = 120.0,
    progress: Callable[[str], None] | None = None,
) -> list[Result]:
    """Runs every op's samples; compiled replays and Dynamo's caches are dropped after each
    op, so an op's results do not depend on which ops ran before it."""
    results: list[Result] = []
    start = time.perf_counter()
    for n, (op, dtype) in enumerate(ops, 1):
        t0 = time.perf_counter()
        try:
            with configured():
                op_results = run_op(op, dtype, compilers, max_samples=max_samples, timeout=timeout)
        finally:
            reset_compilers()
        results.extend(op_results)
        if progress is not None:
            counts = defaultdict(int)
            for r in op_results:
                counts[r.status] += 1
            summary = " ".join(f"{k}={v}" for k, v in sorted(counts.items()))
            progress(
                f"[{n}/{len(ops)} {time.perf_counter() - start:7.0f}s] {op_key(op)} "
                f"({time.perf_counter() - t0:.1f}s) {summary}"
            )
    return results


# ---- reporting ---------------------------------------------------------------------------


@dataclasses.dataclass
class Failure:
    compiler: str
    op: str
    status: str  # the worst status among its samples: error, else differ
    failing: int
    total: int
    reason: str

    def line(self) -> str:
        counts = f"{self.status} {self.failing}/{self.total}"
        return f"{self.compiler}\t{self.op}\t{counts}: {self.reason}"


def failures_of(results: Iterable[Result]) -> dict[tuple[str, str], Failure]:
    """Per (compiler, op): the ops with any differ/error sample, and the first reason."""
    by_op: dict[tuple[str, str], list[Result]] = defaultdict(list)
    for r in results:
        by_op[(r.compiler, r.op)].append(r)
    out = {}
    for (compiler, op), rs in by_op.items():
        bad = [r for r in rs if r.status in FAILING]
        if not bad:
            continue
        errors = [r for r in bad if r.status == "error"]
        first = (errors or bad)[0]
        reason = first.detail
        if not errors:
            worst = max((r.max_diff for r in bad if r.max_diff is not None), default=None)
            if worst is not None:
                reason = f"differs by {worst:.3g} (first: {first.detail})"
        counted = [r for r in rs if r.status != "skipped"]
        out[(compiler, op)] = Failure(
            compiler, op, first.status, len(bad), len(counted), reason.replace("\t", " ")
        )
    return out


def summary_rows(
    results: Sequence[Result], compilers: Sequence[str | None]
) -> list[dict[str, Any]]:
    rows = []
    for compiler in map(compiler_name, compilers):
        rs = [r for r in results if r.compiler == compiler]
        counts = defaultdict(int)
        ops: dict[str, bool] = {}
        for r in rs:
            counts[r.status] += 1
            if r.status != "skipped":
                ops[r.op] = ops.get(r.op, True) and r.status == "equal"
        run = counts["equal"] + counts["differ"] + counts["error"] + counts["engine"]
        rows.append(
            {
                "compiler": compiler,
                "ops": len(ops),
                "ops_equal": sum(ops.values()),
                "samples": run,
                "equal": counts["equal"],
                "differ": counts["differ"],
                "error": counts["error"],
                "engine": counts["engine"],
                "skipped": counts["skipped"],
                "pct_equal": 100.0 * counts["equal"] / run if run else 100.0,
                "pct_ops_equal": 100.0 * sum(ops.values()) / len(ops) if ops else 100.0,
            }
        )
    return rows


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    header = (
        f"{'compiler':<10} {'ops':>5} {'ops eq':>7} {'ops %':>7} {'samples':>8} {'equal':>7} "
        f"{'differ':>7} {'errors':>7} {'engine':>7} {'skipped':>8} {'equal %':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['compiler']:<10} {r['ops']:>5} {r['ops_equal']:>7} {r['pct_ops_equal']:>6.2f}% "
            f"{r['samples']:>8} {r['equal']:>7} {r['differ']:>7} {r['error']:>7} "
            f"{r['engine']:>7} {r['skipped']:>8} {r['pct_equal']:>7.2f}%"
        )
    return "\n".join(lines)


# ---- known failures ----------------------------------------------------------------------

KNOWN_HEADER = """\
# replaygrad OpInfo sweep (benchmarks/opinfo_sweep.py): ops that do not reach "equal" on all
# their samples, per compiler. One per line, tab-separated:
#   <compiler>  <op>  <status> <failing>/<samples>: <first error line, or the max difference>
# compiler is "none" (uncompiled replay) or a torch.compile backend; op is name[.variant].
# Regenerate: python benchmarks/opinfo_sweep.py --write-known-failures <this file>
"""


def load_known_failures(path: str | Path) -> dict[tuple[str, str], str]:
    """``{(compiler, op): reason}`` from a known-failures file (``#`` starts a comment)."""
    known = {}
    for lineno, raw in enumerate(Path(path).read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split("\t", 2) if "\t" in line else line.split(None, 2)
        if len(parts) < 2:
            raise ValueError(f"{path}:{lineno}: expected '<compiler> <op> <reason>'")
        known[(parts[0], parts[1])] = parts[2] if len(parts) > 2 else ""
    return known


def write_known_failures(path: str | Path, failures: dict[tuple[str, str], Failure]) -> None:
    lines = [f.line() for _, f in sorted(failures.items())]
    Path(path).write_text(KNOWN_HEADER + "\n".join(lines) + ("\n" if lines else ""))


def known_ops(known: dict[tuple[str, str], str], compilers: Iterable[str | None]) -> set[str]:
    names = {compiler_name(c) for c in compilers}
    return {op for (c, op) in known if c in names}


@dataclasses.dataclass
class KnownComparison:
    new: list[Failure]  # failing, not in the file
    known: list[Failure]  # failing, in the file
    fixed: list[tuple[str, str]]  # in the file, ran, and all samples equal


def compare_known(results: Sequence[Result], known: dict[tuple[str, str], str]) -> KnownComparison:
    failures = failures_of(results)
    ran = {(r.compiler, r.op) for r in results if r.status != "skipped"}
    new = [f for k, f in sorted(failures.items()) if k not in known]
    old = [f for k, f in sorted(failures.items()) if k in known]
    fixed = sorted(k for k in known if k in ran and k not in failures)
    return KnownComparison(new, old, fixed)


# ---- command line ------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, metavar="N", help="only N ops (deterministic)")
    parser.add_argument("--first", action="store_true", help="with --ops: the first N ops")
    parser.add_argument("--seed", type=int, default=0, help="seed of the --ops sample")
    parser.add_argument(
        "--op", action="append", metavar="NAME", help="op key or name (fnmatch glob); repeatable"
    )
    parser.add_argument(
        "--compilers",
        default="none,aot_eager",
        help="comma-separated replaygrad compilers ('none' = uncompiled); default: %(default)s",
    )
    parser.add_argument("--max-samples", type=int, metavar="K", help="first K samples per op")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per sample (0: none)")
    parser.add_argument("--json", metavar="PATH", help="write per-sample results here")
    parser.add_argument("--known-failures", metavar="PATH", help="report new vs known failures")
    parser.add_argument(
        "--exclude-known", action="store_true", help="with --known-failures: skip those ops"
    )
    parser.add_argument("--write-known-failures", metavar="PATH", help="write the failing ops")
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-op progress")
    args = parser.parse_args(argv)

    compilers = [parse_compiler(c) for c in args.compilers.split(",")]
    known = load_known_failures(args.known_failures) if args.known_failures else None
    exclude = known_ops(known, compilers) if known and args.exclude_known else set()
    ops = select_ops(args.op, args.ops, seed=args.seed, first=args.first, exclude=exclude)
    if not ops:
        print("no op matches", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    results = run_sweep(
        ops,
        compilers,
        max_samples=args.max_samples,
        timeout=args.timeout or None,
        progress=None if args.quiet else progress,
    )
    elapsed = time.perf_counter() - start

    rows = summary_rows(results, compilers)
    print(f"replaygrad OpInfo sweep: {len(ops)} ops, torch {torch.__version__}, {elapsed:.0f} s")
    print(format_table(rows))
    failures = failures_of(results)
    print(f"\nfailing ops ({len(failures)}):")
    for _, f in sorted(failures.items()):
        print(f"  {f.compiler:<10} {f.op:<45} {f.status} {f.failing}/{f.total}: {f.reason}")

    status = 0
    if known is not None:
        cmp = compare_known(results, known)
        print(f"\nknown failures: {len(cmp.known)} still failing, {len(cmp.fixed)} fixed")
        for c, op in cmp.fixed:
            print(f"  fixed: {c:<10} {op}")
        print(f"new failures: {len(cmp.new)}")
        for f in cmp.new:
            print(f"  NEW: {f.compiler:<10} {f.op:<45} {f.status}: {f.reason}")
        status = 1 if cmp.new else 0
    if args.write_known_failures:
        write_known_failures(args.write_known_failures, failures)
        print(f"\nwrote {len(failures)} known failures to {args.write_known_failures}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "torch": torch.__version__,
                    "compilers": [compiler_name(c) for c in compilers],
                    "seconds": elapsed,
                    "summary": rows,
                    "failures": [dataclasses.asdict(f) for _, f in sorted(failures.items())],
                    "results": [dataclasses.asdict(r) for r in results],
                },
                indent=1,
            )
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
