"""replaygrad: a compiled backward pass for PyTorch.

The autograd graph is planned in Rust exactly as the engine would run it, replayed as a
generated Python function with saved values as inputs, and compiled with torch.compile.
"""

import torch  # noqa: F401  (loads libtorch before the native module)

from ._api import (
    Plan,
    backward,
    cache_info,
    disable,
    enable,
    explain,
    grad,
    plan,
    reset,
    set_cache_size,
)
from ._compile import CacheInfo, Compiler

__all__ = [
    "CacheInfo",
    "Compiler",
    "Plan",
    "backward",
    "cache_info",
    "disable",
    "enable",
    "explain",
    "grad",
    "plan",
    "reset",
    "set_cache_size",
]
