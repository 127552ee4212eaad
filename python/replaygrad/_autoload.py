"""``REPLAYGRAD=<compiler>`` turns replaygrad on for an unmodified script.

``replaygrad_autoload.pth`` (installed next to the package) imports this module at
interpreter start-up when the variable is set; it enables replaygrad on the main thread for
the life of the process. Values: a torch.compile backend name (``inductor``, ``aot_eager``,
...), ``1``/``on`` for the default (inductor), ``none`` for the uncompiled replay; ``0``,
``off`` or empty leave replaygrad off.
"""

from __future__ import annotations

import os

_OFF = {"", "0", "off", "false", "no"}
_DEFAULT = {"1", "on", "true", "yes"}


def parse_compiler(value: str) -> str | None:
    """The compiler named by a REPLAYGRAD / --compiler value (``none`` → uncompiled)."""
    v = value.strip()
    if v.lower() in _DEFAULT:
        return "inductor"
    if v.lower() == "none":
        return None
    return v


def enable_from_environment() -> bool:
    """Enables replaygrad for this thread, for good, if REPLAYGRAD asks for it."""
    value = os.environ.get("REPLAYGRAD", "")
    if value.strip().lower() in _OFF:
        return False
    from ._compile import Config
    from ._engine import routed

    routed(Config.make(parse_compiler(value), {})).__enter__()
    return True


enable_from_environment()
