"""Soak test: a long training loop under ``replaygrad.enable`` must not leak.

A small MLP (a custom ``autograd.Function`` between two layers, a fresh tensor hook on a
hidden activation every step, SGD with momentum) trains for ``--iters`` steps with every
backward routed through replaygrad. An eager twin (same initial weights, same batches, its
backward run by PyTorch's engine) trains in lockstep, so the final parameters must agree:
a cheap proof that no gradient was lost or duplicated along the way.

After ``--warmup`` steps (compilation, optimizer state), every ``--every`` steps the script
samples the process RSS, the number of live tensors (``gc.get_objects()``) and
``replaygrad.cache_info()``. It prints a table of the samples and a summary with PASS/FAIL
against: RSS growth after warm-up below ``--max-rss-growth`` percent, live tensors flat (no
sample above the first), the replay cache bounded (no new entry after warm-up), CPU time
per step not growing (``--max-slowdown``), and the twins' final parameters equal within
tolerance (and moved by training).

Usage::

    python benchmarks/soak.py                        # 10000 steps, aot_eager
    python benchmarks/soak.py --compiler none        # the replay uncompiled
    python benchmarks/soak.py --iters 2000 --every 500 --dtype float32

Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import replaygrad


class ScaledSquash(torch.autograd.Function):
    """``x * sigmoid(x)`` (SiLU) written as a Python custom Function, so the backward graph
    holds a ``ScaledSquashBackward`` node with a saved tensor."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(x)
        ctx.save_for_backward(x, s)
        return x * s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        x, s = ctx.saved_tensors
        return grad * (s * (1 + x * (1 - s)))


class Mlp(nn.Module):
    """Three linear layers; the custom Function after the first, tanh after the second, and
    a tensor hook on the second hidden activation registered anew on every forward."""

    def __init__(self, d_in: int, width: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ScaledSquash.apply(self.fc1(x))
        h = torch.tanh(self.fc2(h))
        if h.requires_grad:
            scale = 0.5
            # A fresh closure each step, as a training loop that hooks activations has.
            h.register_hook(lambda g: g * scale)
        return self.fc3(h)


@dataclass
class Sample:
    """One measurement of the replaygrad run's resources."""

    step: int
    seconds: float
    #: CPU seconds of this process (both twins), steadier than wall time on a busy machine.
    cpu_seconds: float
    rss_mib: float
    tensors: int
    cache: replaygrad.CacheInfo
    max_diff: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--iters", type=int, default=10000, help="training steps")
    p.add_argument(
        "--compiler",
        default="aot_eager",
        help="a torch.compile backend name, or none (the replay uncompiled)",
    )
    p.add_argument("--warmup", type=int, default=200, help="steps before the first sample")
    p.add_argument("--every", type=int, default=1000, help="steps between samples")
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (1: the model is tiny, and spinning worker threads "
        "blur the CPU times on a busy machine)",
    )
    p.add_argument(
        "--max-rss-growth", type=float, default=5.0, help="RSS growth limit after warm-up, %%"
    )
    p.add_argument(
        "--max-slowdown",
        type=float,
        default=3.0,
        help="limit on CPU time per step, last interval over first (other load on the "
        "machine alone moves it up to ~2x)",
    )
    p.add_argument("--rtol", type=float, help="parameter tolerance (default by dtype)")
    p.add_argument("--atol", type=float, help="parameter tolerance (default by dtype)")
    return p.parse_args(argv)


def rss_mib() -> float:
    """The resident set size of this process in MiB, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def live_tensors() -> int:
    """How many tensors the garbage collector tracks, after a full collection."""
    gc.collect()
    with warnings.catch_warnings():  # isinstance() checks on some torch objects warn
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))


def max_param_diff(a: nn.Module, b: nn.Module) -> float:
    """The largest absolute difference between corresponding parameters."""
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    """One SGD step on a squared-error loss; the backward is ``loss.backward()``."""
    opt.zero_grad(set_to_none=True)
    loss = (model(x) - y).square().mean()
    loss.backward()
    opt.step()


def main(argv: list[str] | None = None) -> int:
    """Runs the soak, prints the table and summary; returns the exit status."""
    args = parse_args(argv)
    compiler = None if args.compiler.lower() in ("none", "") else args.compiler
    dtype = getattr(torch, args.dtype)
    rtol = args.rtol if args.rtol is not None else (1e-9 if dtype == torch.float64 else 1e-4)
    atol = args.atol if args.atol is not None else (1e-11 if dtype == torch.float64 else 1e-5)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    d_in, d_out = 16, 4

    model = Mlp(d_in, args.width, d_out).to(dtype)
    twin = Mlp(d_in, args.width, d_out).to(dtype)
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    twin_opt = torch.optim.SGD(twin.parameters(), lr=args.lr, momentum=0.9)
    target = torch.nn.Linear(d_in, d_out).to(dtype).requires_grad_(False)
    data = torch.Generator().manual_seed(args.seed + 1)

    initial = [p.detach().clone() for p in model.parameters()]
    replaygrad.reset()
    samples: list[Sample] = []
    start = time.perf_counter()
    cpu_start = time.process_time()
    print(
        f"soak: {args.iters} steps, compiler={compiler!r}, dtype={args.dtype}, "
        f"warm-up {args.warmup}, sample every {args.every}, {args.threads} thread(s)",
        flush=True,
    )
    for step in range(1, args.iters + 1):
        x = torch.randn(args.batch, d_in, generator=data, dtype=dtype)
        with torch.no_grad():
            y = torch.sin(target(x))
        with replaygrad.enable(compiler):
            train_step(model, opt, x, y)
        train_step(twin, twin_opt, x, y)
        del x, y
        due = step >= args.warmup and (step - args.warmup) % args.every == 0
        if due or step == args.iters:
            sample = Sample(
                step=step,
                seconds=time.perf_counter() - start,
                cpu_seconds=time.process_time() - cpu_start,
                rss_mib=rss_mib(),
                tensors=live_tensors(),
                cache=replaygrad.cache_info(),
                max_diff=max_param_diff(model, twin),
            )
            samples.append(sample)
            print(
                f"{sample.step:>7} {sample.seconds:>8.1f}s cpu {sample.cpu_seconds:>7.1f}s "
                f"rss {sample.rss_mib:>9.1f} MiB "
                f"tensors {sample.tensors:>5} cache {sample.cache.size}/{sample.cache.maxsize} "
                f"hits {sample.cache.hits:>6} misses {sample.cache.misses:>3} "
                f"max|Δparam| {sample.max_diff:.3e}",
                flush=True,
            )
    moved = max((p - p0).abs().max().item() for p, p0 in zip(model.parameters(), initial))
    return summarize(samples, model, twin, moved, args, rtol, atol)


def summarize(
    samples: list[Sample],
    model: nn.Module,
    twin: nn.Module,
    moved: float,
    args: argparse.Namespace,
    rtol: float,
    atol: float,
) -> int:
    """Prints the summary and PASS/FAIL lines; returns 0 when every check passed.

    ``moved`` is the largest change of a parameter since initialization: the twins agreeing
    means something only if training moved them.
    """
    if not samples:
        print("FAIL: no samples (--iters below --warmup?)")
        return 1
    first, last = samples[0], samples[-1]
    growth = 100.0 * (last.rss_mib - first.rss_mib) / first.rss_mib
    peak_tensors = max(s.tensors for s in samples)
    cache_max = max(s.cache.size for s in samples)
    params_equal = all(
        torch.allclose(pa, pb, rtol=rtol, atol=atol)
        for pa, pb in zip(model.parameters(), twin.parameters())
    )
    replayed = last.cache.hits + last.cache.misses
    # CPU milliseconds per step over the first and the last interval between samples.
    pace = [
        1000.0 * (b.cpu_seconds - a.cpu_seconds) / (b.step - a.step)
        for a, b in itertools.pairwise(samples)
    ]
    checks = {
        f"RSS growth after warm-up < {args.max_rss_growth}%": growth < args.max_rss_growth,
        "live tensors flat": peak_tensors <= first.tensors,
        "cache bounded (no new entries after warm-up)": cache_max == first.cache.size
        and last.cache.misses == first.cache.misses
        and cache_max <= last.cache.maxsize,
        "backwards went through replaygrad": replayed >= args.iters,
        f"step time flat (last interval <= {args.max_slowdown}x first, CPU time)": not pace
        or pace[-1] <= args.max_slowdown * pace[0],
        f"params match eager twin (rtol={rtol:g}, atol={atol:g})": params_equal and moved > 0,
    }
    print()
    print(f"steps:              {last.step} in {last.seconds:.1f}s")
    print(
        f"RSS after warm-up:  {first.rss_mib:.1f} MiB -> {last.rss_mib:.1f} MiB "
        f"({growth:+.2f}%), peak sample {max(s.rss_mib for s in samples):.1f} MiB"
    )
    print(f"live tensors:       first {first.tensors}, last {last.tensors}, max {peak_tensors}")
    print(
        f"cache size:         max {cache_max} (maxsize {last.cache.maxsize}), "
        f"hits {last.cache.hits}, misses {last.cache.misses} "
        f"(misses at first sample {first.cache.misses})"
    )
    if pace:
        print(
            f"CPU ms per step:    first interval {pace[0]:.2f}, last {pace[-1]:.2f}, "
            f"max {max(pace):.2f}"
        )
    print(f"max |param - twin|: {last.max_diff:.3e} (max |param - initial|: {moved:.3e})")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    ok = all(checks.values())
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
