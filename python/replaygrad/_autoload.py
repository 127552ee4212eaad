"""``REPLAYGRAD=<compiler>`` turns replaygrad on for an unmodified script.

``replaygrad_autoload.pth`` (installed next to the package) imports this module at
interpreter start-up when the variable is set; it enables replaygrad on the main thread for
the life of the process. Values: a torch.compile backend name (``inductor``, ``aot_eager``,
...), ``1``/``on`` for the default (inductor), ``none`` for the uncompiled replay; ``0``,
``off`` or empty leave replaygrad off. An unknown compiler name leaves it off too, with a
message on stderr.
"""

from __future__ import annotations

import os
import sys

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

    try:
        config = Config.make(parse_compiler(value), {})
    except ValueError as error:
        # Start-up cannot be stopped from here (site reports a traceback and goes on): one
        # line saying why replaygrad stays off.
        print(
            f"replaygrad: REPLAYGRAD={value!r} ignored, replaygrad is off: {error}", file=sys.stderr
        )
        return False
    routed(config).__enter__()
    return True


enable_from_environment()
