"""Compilers and the cache of compiled replays."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import _core
from ._replay import Replay, build

#: What ``compiler=`` accepts: a torch.compile backend name, a callable that takes a
#: function and returns a compiled one, or None (run the replay as plain Python).
Compiler = str | Callable[[Callable[..., Any]], Callable[..., Any]] | None


def check_compiler(compiler: Compiler) -> None:
    """Raises ValueError/TypeError where the user passed an unusable compiler."""
    if compiler is None or callable(compiler):
        return
    if not isinstance(compiler, str):
        raise TypeError(
            "compiler must be a torch.compile backend name, a callable or None, "
            f"got {type(compiler).__name__}"
        )
    backends = torch._dynamo.list_backends(exclude_tags=())
    if compiler not in backends:
        raise ValueError(
            f"unknown compiler {compiler!r}; torch.compile backends are: {', '.join(backends)}"
        )


def _compile(fn: Callable[..., Any], compiler: Compiler) -> Callable[..., Any]:
    if compiler is None:
        return fn
    if isinstance(compiler, str):
        return torch.compile(fn, backend=compiler)
    compiled = compiler(fn)
    if not callable(compiled):
        raise TypeError(
            f"the compiler {compiler!r} returned {type(compiled).__name__}, not a callable"
        )
    return compiled


@dataclass
class Entry:
    """A cached replay: the generated function and its compiled form."""

    replay: Replay
    compiled: Callable[..., Any]
    calls: int = 0


class ReplayCache:
    """Compiled replays by (compiler, plan key), least recently used evicted first.

    Entries hold no tensors and no nodes: a replay takes all of them as arguments.
    """

    def __init__(self, maxsize: int = 256) -> None:
        self.maxsize = maxsize
        self._entries: OrderedDict[tuple[Any, str], Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, plan: _core.Plan, compiler: Compiler) -> Entry:
        key = (compiler, plan.key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return entry
        replay = build(plan)
        entry = Entry(replay=replay, compiled=_compile(replay.fn, compiler))
        with self._lock:
            self.misses += 1
            self._entries[key] = entry
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


cache = ReplayCache()
