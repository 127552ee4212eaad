"""Opt-in, lazily formatted logging on the standard ``logging`` module.

Loggers: ``replaygrad`` (notices, e.g. calls left to the engine) and its children
``replaygrad.plan`` (each call's plan table), ``replaygrad.source`` (generated replay source,
on a cache miss), ``replaygrad.cache`` (hits and misses) and ``replaygrad.recompiles`` (why a
call did not hit the cache: which step and which part of its key changed).

``REPLAYGRAD_LOGS`` turns them on without code, in the spirit of ``TORCH_LOGS``: a comma
separated list of ``plan``, ``source``, ``cache``, ``recompiles``, ``all``; each name enables
DEBUG on that logger, and a stderr handler on ``replaygrad`` if it has none (with
``replaygrad`` itself at INFO, so that the channels not named stay quiet).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

log = logging.getLogger("replaygrad")
plan_log = logging.getLogger("replaygrad.plan")
source_log = logging.getLogger("replaygrad.source")
cache_log = logging.getLogger("replaygrad.cache")
recompiles_log = logging.getLogger("replaygrad.recompiles")

CHANNELS = {
    "plan": plan_log,
    "source": source_log,
    "cache": cache_log,
    "recompiles": recompiles_log,
}


class Lazy:
    """Formats its message only when a handler actually emits the record."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self.fn = fn

    def __str__(self) -> str:
        return self.fn()


def configure(spec: str | None) -> list[str]:
    """Enables the channels named in ``spec`` (REPLAYGRAD_LOGS syntax); returns them."""
    if not spec:
        return []
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if "all" in names:
        names = list(CHANNELS)
    unknown = [n for n in names if n not in CHANNELS]
    if unknown:
        raise ValueError(
            f"REPLAYGRAD_LOGS: unknown channel(s) {', '.join(unknown)}; "
            f"valid: {', '.join([*CHANNELS, 'all'])}"
        )
    for name in names:
        CHANNELS[name].setLevel(logging.DEBUG)
    if names and not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        log.addHandler(handler)
        # The channels take their level from here unless named: INFO keeps their DEBUG
        # records out, and lets replaygrad's notices through.
        if log.level == logging.NOTSET or log.level > logging.INFO:
            log.setLevel(logging.INFO)
    return names


configure(os.environ.get("REPLAYGRAD_LOGS"))
