"""Backward-pass benchmark: eager autograd, torch's compiled autograd (CA) and replaygrad.

Usage::

    python benchmarks/bench.py                  # everything, 300 s compile cap per cell
    python benchmarks/bench.py --quick          # a few minutes: validates the script
    python benchmarks/bench.py --workloads mlp gru --cap 120

Workloads (float32, CPU, one thread, parameters' ``.grad`` set to None before each backward):
``mlp`` 4 x (Linear(512, 512) + ReLU) on a (64, 512) batch, loss ``sum()``; ``transformer``
``nn.TransformerEncoderLayer(256, 4, dropout=0, batch_first=True)`` in training mode on
(batch 8, seq 128, 256), loss ``square().mean()``; ``gru`` ``nn.GRUCell(256, 256)`` unrolled
32 steps over a batch of 16, loss ``sum()``; ``chainN`` N ops cycling sin, ``* 0.9``,
``+ 0.1`` on a 16-element leaf, loss ``sum()`` (N + 2 nodes); ``checkpoint`` 8 residual blocks
(LayerNorm(128), Linear(128, 256), GELU, Linear(256, 128)), each under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, on a (32, 128) batch, loss
``square().mean()``; ``function`` one Linear(64, 64) applied 20 times, each followed by
tanh and a Python custom Function squaring its input (not ``is_traceable``), on a (8, 64)
batch, loss ``sum()`` (these two are not in the default set).
Systems: ``eager`` (``loss.backward()``), ``ca_<backend>`` (inside
``torch._dynamo.compiled_autograd._enable(torch.compile(backend=..., fullgraph=True))``) and
``rg_<backend>`` (inside ``replaygrad.enable(backend)``; ``rg_none``: uncompiled replay).

Every (workload, system) cell runs in a fresh process, so no compile cache or Dynamo state
leaks between systems, and is killed after ``--cap`` seconds (its figures then read ``> cap``).
In a compiled cell, the compiler's set-up in the process is timed first ("set-up": an unrelated
function compiled with the cell's backend, which pays the imports and inductor's vector-ISA
check that any first ``torch.compile`` of a process pays). Then the first backward is timed
(compiles included) and its gradients are compared with an eager backward of the same
forward (``error`` when the largest difference exceeds 1e-3 of the largest eager gradient);
then up to ``--iters`` backward calls, each on a fresh forward graph, are timed alone
("median ms", "min ms": wall time; "CPU ms": the median CPU time of the calling thread,
which other load on the machine distorts less). Ratios compare medians.
"peak MB" is the most resident memory a steady-state backward call added: the kernel's RSS
high-water mark is reset (``/proc/self/clear_refs``) right before the call and read after
it. It sees pages newly touched, not memory malloc reuses, so it is an approximation.
"alloc MB" is the most memory a steady-state call had allocated at once, over what was
allocated before it, as torch's profiler reports its CPU allocator's allocations during one
more call (``profile_memory=True``); freeing what existed before the call (saved tensors
released as a backward goes) does not count, so it is the peak of the call's own tensors.
"compiles" counts compiled-autograd captures or replaygrad cache misses, plus, where it
differs, the graphs Dynamo handed to the backend. In the inductor cells each call is also
split in two: the time inside inductor's compiled graphs (``CompiledFxGraph.__call__``,
wrapped by a timer) and the rest, the system's own per-call cost ("outside graph", in the
per-call overhead table).

torch keeps what it compiles on disk (``TORCHINDUCTOR_CACHE_DIR``: inductor's FX graph and
kernel caches, AOTAutograd's cache, Dynamo's automatic-dynamic profiles), so a process that
compiles a graph compiled before (e.g. by the previous run of this benchmark) mostly reads it
back. By default (``--disk-cache fresh``) every cell but eager's gets an empty copy of a
cache directory prepared once per run by compiling an unrelated function with inductor:
the first call then compiles its graphs for real, while inductor's one-time set-up on a
machine (its vector-ISA probes, ~20 s here) is not counted. ``--disk-cache reuse`` keeps
torch's usual directory (what a user re-running a script gets).

glibc's malloc gives memory back to the system when the top of its heap holds more free
memory than its trim threshold (128 KiB at first, then twice the largest block it has
unmapped). A process whose heap happens to end in the blocks of one backward call (e.g. the
weights' gradients, set to None before the next call) gives them back and faults them in
again every call: seen here in processes of every system, up to ~1100 page faults and
1.6x the time of a call, depending on where earlier allocations happened to land. By default
(``--malloc fixed``) the cells run with fixed thresholds that keep such memory
(``GLIBC_TUNABLES``: trim threshold 1 GiB, mmap threshold 32 MiB), so that this does not
decide a cell; ``--malloc default`` keeps glibc's.

Results go to ``--out-md`` (markdown, also printed), the same path with ``.json`` (raw
numbers) and ``--plot`` (time vs chain length).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
from _planner_py import plan_careful, plan_poc
from torch import nn
from torch.utils.checkpoint import checkpoint

import replaygrad
from replaygrad import _core

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("eager", "ca_aot_eager", "ca_inductor", "rg_none", "rg_aot_eager", "rg_inductor")
WORKLOADS = (
    "mlp",
    "transformer",
    "gru",
    "chain100",
    "chain1000",
    "chain3000",
    "chain10000",
    "chain30000",
)
#: Workloads run only when named (``--workloads``).
EXTRA_WORKLOADS = ("checkpoint", "function")
QUICK_WORKLOADS = ("mlp", "transformer", "gru", "chain100", "chain1000")
PLAN_SIZES = (10**3, 10**4, 10**5)
QUICK_PLAN_SIZES = (10**3, 10**4)
MARK = "BENCH "  # prefixes a child's result lines on stdout
MAX_REL_ERROR = 1e-3


@dataclass
class Workload:
    """A model's parameters and a function that runs a fresh forward pass to a scalar loss."""

    params: list[torch.Tensor]
    forward: Callable[[], torch.Tensor]


def make_workload(name: str) -> Workload:
    """Builds the named workload, seeded, so every process gets the same values."""
    torch.manual_seed(0)
    if name == "mlp":
        model: nn.Module = nn.Sequential(
            *[m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())]
        )
        x = torch.randn(64, 512)
        return Workload(list(model.parameters()), lambda: model(x).sum())
    if name == "transformer":
        model = nn.TransformerEncoderLayer(256, 4, dropout=0.0, batch_first=True)
        x = torch.randn(8, 128, 256)
        # Not sum(): the sum of a LayerNorm output barely depends on anything before it, so
        # every gradient but the norm's would be rounding noise.
        return Workload(list(model.parameters()), lambda: model(x).square().mean())
    if name == "gru":
        cell = nn.GRUCell(256, 256)
        xs = torch.randn(32, 16, 256)

        def unrolled() -> torch.Tensor:
            h = torch.zeros(16, 256)
            for x in xs:
                h = cell(x, h)
            return h.sum()

        return Workload(list(cell.parameters()), unrolled)
    if name == "checkpoint":
        blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(128), nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
            for _ in range(8)
        )
        x = torch.randn(32, 128)

        def checkpointed() -> torch.Tensor:
            h = x
            for block in blocks:
                h = h + checkpoint(block, h, use_reentrant=False)
            return h.square().mean()

        return Workload(list(blocks.parameters()), checkpointed)
    if name == "function":
        layer = nn.Linear(64, 64)
        x = torch.randn(8, 64)

        def layers() -> torch.Tensor:
            h = x
            for _ in range(20):
                h = Square.apply(layer(h).tanh())
            return h.sum()

        return Workload(list(layer.parameters()), layers)
    if name.startswith("chain"):
        return chain(int(name[len("chain") :]))
    raise ValueError(f"unknown workload {name!r}")


class Square(torch.autograd.Function):
    """``x * x`` as a Python Function that does not declare itself traceable: replaygrad
    runs its backward as itself, outside the compiled graph; torch's compiled autograd has
    Dynamo trace it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def chain(n: int) -> Workload:
    """``n`` ops cycling sin, ``* 0.9``, ``+ 0.1`` on a 16-element leaf: n + 2 graph nodes."""
    leaf = torch.randn(16, requires_grad=True)

    def forward() -> torch.Tensor:
        y = leaf
        for i in range(n):
            y = torch.sin(y) if i % 3 == 0 else y * 0.9 if i % 3 == 1 else y + 0.1
        return y.sum()

    return Workload([leaf], forward)


def system_context(system: str) -> Callable[[], AbstractContextManager[Any]]:
    """A factory of the context a backward call of ``system`` runs in (one compiler object
    per process, so compiled graphs are reused)."""
    if system == "eager":
        return nullcontext
    kind, backend = system.split("_", 1)
    if kind == "ca":
        compiler = torch.compile(backend=backend, fullgraph=True)
        return lambda: torch._dynamo.compiled_autograd._enable(compiler)
    return lambda: replaygrad.enable(None if backend == "none" else backend)


def compiles(system: str) -> dict[str, int]:
    """Captures (CA) or cache misses (replaygrad) so far, and Dynamo graphs compiled."""
    counters = torch._dynamo.utils.counters
    captures = 0
    if system.startswith("ca_"):
        captures = counters["compiled_autograd"]["captures"]
    elif system.startswith("rg_"):
        captures = replaygrad.cache_info().misses
    return {"captures": captures, "graphs": counters["stats"]["unique_graphs"]}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak() -> int | None:
    """Resets the RSS high-water mark; returns the current RSS in kB, None if not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_kb("VmRSS")


def peak_mb(rss_kb: int | None) -> float | None:
    """MB the high-water mark rose above ``rss_kb`` since :func:`reset_peak`."""
    return None if rss_kb is None else (_status_kb("VmHWM") - rss_kb) / 1024


class GraphTimer:
    """Seconds spent inside inductor's compiled graphs (``CompiledFxGraph.__call__``: the
    generated kernels and their buffers), so that a call's time outside them, the system's
    own per-call cost (capture or planning, Dynamo's guards, AOTAutograd's wrappers, the
    driver, accumulations), can be told apart. Installed in inductor cells only."""

    seconds = 0.0

    @classmethod
    def install(cls) -> None:
        from torch._inductor.output_code import CompiledFxGraph

        call = CompiledFxGraph.__call__

        def timed(self: Any, inputs: Any) -> Any:
            start = time.perf_counter()
            try:
                return call(self, inputs)
            finally:
                cls.seconds += time.perf_counter() - start

        CompiledFxGraph.__call__ = timed


class DeferredTimer:
    """Seconds a replaygrad call spends in ``Plan.run_deferred``: the accumulations after its
    compiled graph, where it forms weights' gradients from matrix products (gradient math
    torch's compiled autograd does inside its graph). Timed by a profile function, in calls
    of their own (the function slows every other Python call)."""

    seconds = 0.0
    _start = 0.0

    @classmethod
    def _profile(cls, frame: Any, event: str, arg: Any) -> None:
        if event[:2] != "c_" or getattr(arg, "__name__", None) != "run_deferred":
            return
        if event == "c_call":
            cls._start = time.perf_counter()
        else:
            cls.seconds += time.perf_counter() - cls._start

    @classmethod
    def median_ms(
        cls, wl: Workload, context: Callable[[], AbstractContextManager[Any]], calls: int
    ) -> float:
        """The median milliseconds per call over ``calls`` backward calls."""
        seconds = []
        for _ in range(calls):
            cls.seconds = 0.0
            sys.setprofile(cls._profile)
            try:
                backward_once(wl, context)
            finally:
                sys.setprofile(None)
            seconds.append(cls.seconds)
        return statistics.median(seconds) * 1e3


def backward_once(
    wl: Workload, context: Callable[[], AbstractContextManager[Any]]
) -> tuple[float, float, float | None]:
    """Runs a fresh forward of ``wl`` and its backward in ``context``; returns the wall and the
    CPU seconds of this thread that the backward call took (only it is timed) and the MB it
    added to the peak RSS."""
    for p in wl.params:
        p.grad = None
    loss = wl.forward()
    rss = reset_peak()
    with context():
        start, start_cpu = time.perf_counter(), time.thread_time()
        loss.backward()
        wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    return wall, cpu, peak_mb(rss)


def alloc_peak_mb(wl: Workload, context: Callable[[], AbstractContextManager[Any]]) -> float:
    """The MB the tensors allocated during one backward call of ``wl`` took at their most,
    as torch's profiler reports the CPU allocator's allocations and frees (``[memory]``
    events, whose running total counts from the profile's start)."""
    from torch.profiler import ProfilerActivity, profile

    for p in wl.params:
        p.grad = None
    loss = wl.forward()
    with context(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    if not memory:
        return 0.0
    start = memory[0]["args"]["Total Allocated"] - memory[0]["args"]["Bytes"]
    return (max(e["args"]["Total Allocated"] for e in memory) - start) / 2**20


def unrelated(x: torch.Tensor) -> torch.Tensor:
    """The function compiled to prepare a disk cache and a compiler's set-up in a cell."""
    return x.sin() + 1


def compiler_setup(backend: str) -> float:
    """Seconds a process's first ``torch.compile`` with ``backend`` spends before compiling
    anything of its own, paid once per process whatever it compiles: imports and, for
    inductor, its vector-ISA check (probe programs it runs in every process), its disk
    caches' set-up (e.g. the hash of torch's sources in their keys) and the registration of
    its pattern-matcher passes (when it first lowers a graph). Measured by compiling
    :func:`unrelated`, which the prepared disk cache holds; for inductor then once more with
    its FX graph cache bypassed, so that it lowers the graph (its kernel still comes from the
    disk cache). Dynamo's counters are cleared after it."""
    start = time.perf_counter()
    torch.compile(unrelated, backend=backend)(torch.randn(8))
    if backend == "inductor":
        import torch._inductor.config as inductor_config

        torch._dynamo.reset()
        with inductor_config.patch(fx_graph_cache=False):
            torch.compile(unrelated, backend=backend)(torch.randn(8))
    seconds = time.perf_counter() - start
    torch._dynamo.utils.counters.clear()
    return seconds


def emit(record: dict[str, Any]) -> None:
    print(MARK + json.dumps(record), flush=True)


def run_cell(workload: str, system: str, iters: int, budget: float) -> None:
    """The child process of one cell: emits its "first" and then its "steady" record."""
    wl = make_workload(workload)
    context = system_context(system)
    timed = system.endswith("_inductor")
    if timed:
        GraphTimer.install()
    setup = None if system in ("eager", "rg_none") else compiler_setup(system.split("_", 1)[1])
    try:
        first, _, first_peak = backward_once(wl, context)
    except Exception as error:
        emit({"phase": "first", "error": f"{type(error).__name__}: {error}".splitlines()[0]})
        return
    grads = [p.grad for p in wl.params]
    backward_once(wl, nullcontext)  # the eager reference
    # Relative to the largest gradient, not per parameter: some gradients are zero up to
    # rounding (e.g. attention's key bias), and their rounding differs between systems.
    scale = max(float(p.grad.abs().max()) for p in wl.params)
    rel_error = max(float((g - p.grad).abs().max()) for g, p in zip(grads, wl.params)) / scale
    record = {"phase": "first", "first_s": first, "setup_s": setup, "first_peak_mb": first_peak}
    record |= {"rel_error": rel_error, **compiles(system)}
    if not rel_error <= MAX_REL_ERROR:
        record["error"] = f"gradients differ from eager: relative error {rel_error:.2e}"
    emit(record)
    times: list[float] = []
    cpu_times: list[float] = []
    peaks: list[float] = []
    outside: list[float] = []
    while len(times) < iters and (len(times) < 3 or sum(times) < budget):
        GraphTimer.seconds = 0.0
        wall, cpu, peak = backward_once(wl, context)
        times.append(wall)
        outside.append(wall - GraphTimer.seconds)
        cpu_times.append(cpu)
        if peak is not None:
            peaks.append(peak)
    record = {"phase": "steady", "times_ms": [t * 1e3 for t in times], **compiles(system)}
    record["cpu_ms"] = statistics.median(cpu_times) * 1e3
    if timed:
        record["outside_ms"] = statistics.median(outside) * 1e3
        if system.startswith("rg_"):
            record["deferred_ms"] = DeferredTimer.median_ms(wl, context, min(len(times), 10))
    record["peak_mb"] = max(peaks) if peaks else None
    record["alloc_mb"] = alloc_peak_mb(wl, context)
    if system == "eager":
        record["nodes"] = len(_core.plan((wl.forward(),)).order())
        record["plan_us"] = time_planner(lambda loss: _core.plan((loss,)), wl, len(times))
    emit(record)


def time_planner(planner: Callable[[torch.Tensor], object], wl: Workload, reps: int) -> float:
    """Median µs of ``planner`` on ``reps`` fresh forward graphs of ``wl``."""
    times = []
    for _ in range(reps):
        loss = wl.forward()
        start = time.perf_counter()
        planner(loss)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


#: The planners of the planning table: replaygrad's Rust planner (what each backward call
#: runs), the public ``replaygrad.plan`` (which also converts the plan to Python lists), and the
#: two Python planners of ``_planner_py``.
PLANNERS: dict[str, Callable[[torch.Tensor], object]] = {
    "rust": lambda loss: _core.plan((loss,)),
    "public": replaygrad.plan,
    "careful": plan_careful,
    "poc": plan_poc,
}


def run_planning(sizes: list[int], reps: int) -> NoReturn:
    """The child process of the planning table: emits one record per graph size, then
    exits."""
    for size in sizes:
        loss = chain(size - 2).forward()
        record: dict[str, Any] = {"phase": "plan", "nodes": size}
        for name, planner in PLANNERS.items():
            planner(loss)  # warm: per-type caches, first-touch allocations
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                planner(loss)
                times.append((time.perf_counter() - start) * 1e6 / size)
            record[name] = {"median": statistics.median(times), "min": min(times)}
        rust_order = _core.plan((loss,)).order()
        record["same_order"] = [n.name() for n in plan_careful(loss).order] == rust_order
        emit(record)
    # torch 2.13 segfaults freeing a 10^5-node chain once Python objects were made for its
    # nodes (the Python planners make them), so the process ends before `loss` is freed.
    os._exit(0)


#: glibc's malloc as ``--malloc fixed`` runs the cells (see the module's docstring).
FIXED_MALLOC = "glibc.malloc.trim_threshold=1073741824:glibc.malloc.mmap_threshold=33554432"


def run_child(
    argv: list[str], cap: float, cache_dir: Path | None = None, malloc: str = "default"
) -> tuple[list[dict[str, Any]], str | None]:
    """Runs ``bench.py argv`` in a fresh process for at most ``cap`` s, with torch's disk
    caches in ``cache_dir`` (None: torch's default) and glibc's malloc as ``malloc`` says
    ("fixed": see :data:`FIXED_MALLOC`); returns its records and, if it timed out or crashed,
    why."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    env = dict(os.environ)
    if malloc == "fixed":
        env["GLIBC_TUNABLES"] = ":".join(filter(None, [env.get("GLIBC_TUNABLES"), FIXED_MALLOC]))
    if cache_dir is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    # A session of its own, so that a timeout also ends the compile workers it started.
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        out, err = proc.communicate(timeout=cap)
        failure = None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        failure = "timeout"
    except BaseException:  # interrupted (SIGTERM too, see main): leave no child behind
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    records = [json.loads(s[len(MARK) :]) for s in out.splitlines() if s.startswith(MARK)]
    if failure and failure != "timeout":
        failure += ": " + (err.strip().splitlines() or ["no output"])[-1]
    return records, failure


def prepare_cache(scratch: Path, cap: float) -> Path:
    """A torch disk-cache directory in ``scratch`` where inductor has done its one-time
    set-up on this machine (see the module's docstring), by compiling an unrelated function."""
    template = scratch / "template"
    _, failure = run_child(["--prepare-cache"], cap, template)
    if failure:
        raise RuntimeError(f"preparing a disk cache for the cells failed: {failure}")
    return template


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the planning table and then every cell, each in its own process; writes the
    outputs after each, so a run cut short leaves what it measured. Returns the raw results."""
    with tempfile.TemporaryDirectory(prefix="replaygrad-bench-") as scratch:
        template = prepare_cache(Path(scratch), args.cap) if args.disk_cache == "fresh" else None
        return _run_all(args, template)


def _run_all(args: argparse.Namespace, template: Path | None) -> dict[str, Any]:
    iters, budget = (5, 5.0) if args.quick else (50, 30.0)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "replaygrad": replaygrad_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch on 1 thread",
        "load_average": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cap_s": args.cap,
        "disk_cache": args.disk_cache,
        "malloc": args.malloc,
        "iters": iters,
        "steady_budget_s": budget,
        "cells": [],
    }
    sizes = QUICK_PLAN_SIZES if args.quick else PLAN_SIZES
    argv = ["--planning", *map(str, sizes), "--iters", "3" if args.quick else "10"]
    results["planning"], results["planning_failure"] = run_child(argv, args.cap, malloc=args.malloc)
    for workload in args.workloads:
        for system in SYSTEMS:
            argv = ["--child", workload, system, "--iters", str(iters), "--budget", str(budget)]
            cache_dir = None
            if template is not None and system != "eager":
                cache_dir = template.with_name(f"{workload}-{system}")
                shutil.copytree(template, cache_dir)
            try:
                records, failure = run_child(argv, args.cap, cache_dir, malloc=args.malloc)
            finally:
                if cache_dir is not None:
                    shutil.rmtree(cache_dir, ignore_errors=True)
            cell: dict[str, Any] = {"workload": workload, "system": system, "failure": failure}
            for record in records:
                cell |= record
            cell.pop("phase", None)
            if "times_ms" in cell:
                cell["median_ms"] = statistics.median(cell["times_ms"])
                cell["min_ms"] = min(cell["times_ms"])
                cell["mean_ms"] = statistics.mean(cell["times_ms"])
            results["cells"].append(cell)
            write_outputs(results, args)
            print(
                f"{workload:>12} {system:<13} first {cell.get('first_s', '-')!s:.6} s, "
                f"median {cell.get('median_ms', '-')!s:.6} ms, "
                f"{cell.get('error') or failure or 'ok'}",
                file=sys.stderr,
                flush=True,
            )
    return results


def replaygrad_version() -> str:
    """The checkout's commit, marked "+changes" where the replaygrad sources differ from it
    (an editable install runs the working tree)."""
    root = Path(__file__).resolve().parent.parent

    def git(*argv: str) -> str:
        run = subprocess.run(["git", *argv], cwd=root, capture_output=True, text=True)
        return run.stdout.strip() if run.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = git("status", "--porcelain", "--", "python", "rust", "cpp_shim")
    return commit + (" +changes" if changed else "")


def write_outputs(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Writes the markdown report, the raw JSON and the plot."""
    args.out_md.parent.mkdir(parents=True, exist_ok=True)
    args.out_md.write_text(report(results))
    args.out_md.with_suffix(".json").write_text(json.dumps(results, indent=1))
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    plot(results, args.plot)


def _median(cells: dict[str, dict[str, Any]], system: str) -> float | None:
    """A system's steady-state median, None where it is missing, timed out or wrong."""
    cell = cells.get(system, {})
    return None if "error" in cell else cell.get("median_ms")


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def _figure(cell: dict[str, Any], key: str, cap: float, digits: int = 2) -> str:
    if "error" in cell:
        return "error"
    value = cell.get(key)
    if value is not None:
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    if cell["failure"] == "timeout":
        return f"> {cap:g} s"
    return "error" if cell["failure"] else "-"


def _first_ratio(cell: dict[str, Any], ca: dict[str, Any]) -> str:
    """The ratio of first calls, then in parentheses of first calls with their set-up."""
    if "error" in cell or "error" in ca:
        return "-"
    first, ca_first = cell.get("first_s"), ca.get("first_s")
    if first is None or ca_first is None:
        return "-"
    setup, ca_setup = cell.get("setup_s") or 0.0, ca.get("setup_s") or 0.0
    return f"{_ratio(first, ca_first)} ({_ratio(first + setup, ca_first + ca_setup)})"


def workload_table(cells: dict[str, dict[str, Any]], cap: float) -> list[str]:
    """The markdown rows of one workload's table."""
    lines = [
        "| system | set-up (s) | first call (s) | compiles | median ms | min ms | mean ms "
        "| CPU ms | peak MB | alloc MB | first-call peak MB | vs eager | vs torch CA "
        "| first call vs torch CA |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    eager = _median(cells, "eager")
    for system, cell in cells.items():
        median = _median(cells, system)
        compiles_text = "-"
        if "captures" in cell:
            compiles_text = str(cell["captures"])
            if cell["graphs"] != cell["captures"]:
                compiles_text += f" ({cell['graphs']} graphs)"
        vs_ca = first_vs_ca = "-"
        if system.startswith("rg_") and system != "rg_none":
            ca = "ca_" + system[len("rg_") :]
            vs_ca = _ratio(median, _median(cells, ca))
            first_vs_ca = _first_ratio(cell, cells.get(ca, {}))
        row = [
            system,
            _figure(cell, "setup_s", cap),
            _figure(cell, "first_s", cap),
            "error" if "error" in cell else compiles_text,
            _figure(cell, "median_ms", cap, 3),
            _figure(cell, "min_ms", cap, 3),
            _figure(cell, "mean_ms", cap, 3),
            _figure(cell, "cpu_ms", cap, 3),
            _figure(cell, "peak_mb", cap, 1),
            _figure(cell, "alloc_mb", cap, 2),
            _figure(cell, "first_peak_mb", cap, 1),
            _ratio(median, eager) if system != "eager" else "1.00x",
            vs_ca,
            first_vs_ca,
        ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def overhead_table(by_workload: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """Per-call overhead: replaygrad's planning, and each system's aot_eager time minus
    eager's (aot_eager runs the same kernels as eager, so the difference is the system's own
    cost per call, or its saving, when negative)."""
    lines = [
        "| workload | nodes | replaygrad plan (µs/call) | plan µs/node "
        "| rg aot_eager - eager (ms) | CA aot_eager - eager (ms) "
        "| rg inductor outside graph (ms) | CA inductor outside graph (ms) | CA / rg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def minus_eager(cells: dict[str, dict[str, Any]], system: str) -> str:
        a, b = _median(cells, system), _median(cells, "eager")
        return "-" if a is None or b is None else f"{a - b:+.3f}"

    for workload, cells in by_workload.items():
        eager = cells.get("eager", {})
        plan_us, nodes = eager.get("plan_us"), eager.get("nodes")
        row = [
            workload,
            str(nodes or "-"),
            f"{plan_us:.1f}" if plan_us else "-",
            f"{plan_us / nodes:.3f}" if plan_us and nodes else "-",
            minus_eager(cells, "rg_aot_eager"),
            minus_eager(cells, "ca_aot_eager"),
        ]
        outside = [cells.get(s, {}).get("outside_ms") for s in ("rg_inductor", "ca_inductor")]
        deferred = cells.get("rg_inductor", {}).get("deferred_ms")
        if outside[0] is not None and deferred is not None:
            outside[0] -= deferred
        row += [f"{o:.3f}" if o is not None else "-" for o in outside]
        row.append(_ratio(outside[1], outside[0]))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def planning_table(planning: list[dict[str, Any]]) -> list[str]:
    """The markdown rows of the planning table: median µs/node, min in parentheses; ratios of
    the minimums, the figure least distorted by other load on the machine."""
    lines = [
        "| nodes | replaygrad `_core.plan` | `replaygrad.plan` | careful Python | POC-style "
        "| careful / replaygrad | POC / replaygrad | same order |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in planning:
        cols = [f"{r[k]['median']:.3f} ({r[k]['min']:.3f})" for k in PLANNERS]
        ratios = [f"{r[k]['min'] / r['rust']['min']:.1f}x" for k in ("careful", "poc")]
        lines.append(
            f"| {r['nodes']} | " + " | ".join([*cols, *ratios]) + f" | {r['same_order']} |"
        )
    return lines


TABLE_NOTE = (
    "set-up: what the process's first torch.compile with the cell's backend took before "
    "compiling anything of its own (imports; inductor's vector-ISA check, which runs probe "
    "programs in every process, its disk caches' set-up and the registration of its "
    "pattern-matcher passes when it first lowers a graph), measured by compiling an unrelated "
    "function before the first call (inductor: read back from the disk cache, then lowered); "
    "any torch.compile in a process pays it once. first call: the first backward, "
    "compiling included, set-up excluded. compiles: compiled-autograd captures "
    "or replaygrad cache misses, and in parentheses the graphs Dynamo compiled where that "
    "differs. median/min/mean ms: wall time (the mean includes the cycle collector's pauses); "
    "CPU ms: median CPU time of the calling thread. peak "
    "MB: most resident memory a steady-state call added (first-call peak: the first call); "
    "alloc MB: most memory its tensors took at once (torch's profiler, one more call). "
    "vs eager, vs torch CA (same backend): ratios of medians; first call vs torch CA: of "
    "first calls, in parentheses of first calls with their set-up. > cap: killed at the cap; "
    "error: see Errors."
)
OVERHEAD_NOTE = (
    'What a call costs besides the gradient math. "replaygrad plan": the median time of '
    "`_core.plan`, the planning every replaygrad backward call does (engine order, saved "
    'values, key), on fresh graphs. "X aot_eager - eager": the difference of steady-state '
    "medians; aot_eager runs the same ATen kernels as eager, so this is roughly the system's "
    "own per-call cost on a cache hit (capture or planning, guards, replay), negative where it "
    'runs the graph faster than the engine. "X inductor outside graph": the median time of a '
    "steady-state inductor call minus the time inside inductor's compiled graphs "
    "(`CompiledFxGraph.__call__`, timed in the same calls): everything but the compiled graph "
    "itself (capture or planning, Dynamo's guards, AOTAutograd's wrappers, the replay's "
    "driver, the engine's part), for replaygrad less its accumulations after the graph "
    "(`Plan.run_deferred`, timed in 10 calls of their own): there it forms the weights' "
    "gradients from matrix products and runs AccumulateGrad, which torch's compiled autograd "
    "does inside its graph. CA / rg: how many times replaygrad's is smaller."
)
#: How the report describes the cells' disk caches (runs before 2026-12-05 reused them).
DISK_CACHE_NOTE = {
    "fresh": "each compiled cell started with an empty copy of a disk cache where inductor "
    "had done its one-time set-up, so first calls compile their graphs for real.",
    "reuse": "compiled cells used torch's default disk cache, so first calls may have read "
    "back graphs compiled by earlier runs.",
}
MALLOC_NOTE = {
    "fixed": "glibc's malloc kept freed memory (trim threshold 1 GiB, mmap threshold 32 MiB), "
    "so that no cell paid page faults for the memory a call's end gave back to the system.",
    "default": "glibc's malloc ran with its default thresholds.",
}
PLANNING_NOTE = (
    "A chain graph planned repeatedly (after one warm-up call; cache hits). replaygrad "
    "`_core.plan`: the Rust planner each backward call runs; `replaygrad.plan`: the public "
    "API, which also converts the plan to Python lists; careful Python: "
    "`_planner_py.plan_careful` (dependency counts, heap on sequence_nr, saved layout by one "
    "`dir()` per node type, hash key); POC-style: `_planner_py.plan_poc` (order from the "
    'engine, `dir()` per node, no key). Ratios are of the minimums; "same order": '
    "careful Python's order equals replaygrad's."
)


def report(results: dict[str, Any]) -> str:
    """All of the results as markdown."""
    cap = results["cap_s"]
    by_workload: dict[str, dict[str, dict[str, Any]]] = {}
    for cell in results["cells"]:
        by_workload.setdefault(cell["workload"], {})[cell["system"]] = cell
    out = [
        "# replaygrad backward benchmark",
        "",
        f"replaygrad {results.get('replaygrad', 'unknown')}, torch {results['torch']}, "
        f"{results['machine']}, {results['date']} (load average "
        f"{results['load_average']:.1f} at the start); up to "
        f"{results['iters']} steady-state calls (or {results['steady_budget_s']:g} s) per cell, "
        f"compile cap {cap:g} s per cell. Times are of the backward call alone; "
        f"{DISK_CACHE_NOTE[results.get('disk_cache', 'reuse')]} "
        f"{MALLOC_NOTE[results.get('malloc', 'default')]} "
        "`python benchmarks/bench.py --help` says more.",
        "",
        TABLE_NOTE,
    ]
    for workload, cells in by_workload.items():
        out += ["", f"## {workload}", "", *workload_table(cells, cap)]
    out += ["", "## Per-call overhead", "", OVERHEAD_NOTE, "", *overhead_table(by_workload)]
    if results["planning"]:
        out += ["", "## Planning (µs per node, median (min))", "", PLANNING_NOTE, ""]
        out += planning_table(results["planning"])
    errors = [
        c for c in results["cells"] if c.get("error") or c["failure"] not in (None, "timeout")
    ]
    if results["planning_failure"]:
        errors.append(
            {"workload": "planning", "system": "-", "failure": results["planning_failure"]}
        )
    if errors:
        out += ["", "## Errors", ""]
        out += [
            f"- {c['workload']} / {c['system']}: {c.get('error') or c['failure']}" for c in errors
        ]
    return "\n".join(out) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    """Backward time against chain length, log-log, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {
        "eager": ("black", "-"),
        "ca_inductor": ("tab:blue", "-"),
        "ca_aot_eager": ("tab:blue", "--"),
        "rg_inductor": ("tab:red", "-"),
        "rg_aot_eager": ("tab:red", "--"),
        "rg_none": ("tab:red", ":"),
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    for system, (color, style) in styles.items():
        points = sorted(
            (int(c["workload"][len("chain") :]), c["median_ms"])
            for c in results["cells"]
            if c["system"] == system
            and c["workload"].startswith("chain")
            and "error" not in c
            and "median_ms" in c
        )
        if points:
            ax.loglog(*zip(*points), style, color=color, marker="o", label=system)
    ax.set(xlabel="chain length N (ops)", ylabel="backward median (ms)", title="sin/mul/add chain")
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few iterations, short chains, 60 s cap")
    p.add_argument("--cap", type=float, help="seconds per cell before it is killed (300)")
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS + EXTRA_WORKLOADS,
        help=f"default: all but {', '.join(EXTRA_WORKLOADS)}",
    )
    p.add_argument("--out-md", type=Path, default=RESULTS / "bench.md")
    p.add_argument("--plot", type=Path, default=RESULTS / "bench.png")
    p.add_argument(
        "--disk-cache",
        choices=("fresh", "reuse"),
        default="fresh",
        help="torch's disk caches per cell: an empty copy after inductor's one-time set-up "
        "(default), or torch's usual directory",
    )
    p.add_argument(
        "--malloc",
        choices=("fixed", "default"),
        default="fixed",
        help="glibc's malloc in the cells: thresholds that keep freed memory (default), or "
        "glibc's own",
    )
    p.add_argument("--report", type=Path, metavar="JSON", help="re-render a run's JSON")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "SYSTEM"), help=argparse.SUPPRESS)
    p.add_argument("--planning", nargs="+", type=int, metavar="NODES", help=argparse.SUPPRESS)
    p.add_argument("--prepare-cache", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=50, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=30.0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cap is None:
        args.cap = 60.0 if args.quick else 300.0
    if args.workloads is None:
        args.workloads = QUICK_WORKLOADS if args.quick else WORKLOADS
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.child:
        run_cell(*args.child, args.iters, args.budget)
        return
    if args.planning:
        run_planning(args.planning, args.iters)
        return
    if args.prepare_cache:
        torch.compile(unrelated)(torch.randn(8))
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_child can clean up
    results = json.loads(args.report.read_text()) if args.report else run_all(args)
    if args.report:
        write_outputs(results, args)
    print(report(results))
    print(f"wrote {args.out_md}, {args.out_md.with_suffix('.json')}, {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
