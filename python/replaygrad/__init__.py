"""replaygrad: a compiled backward pass for PyTorch.

The autograd graph is planned in Rust exactly as the engine would run it, replayed as a
generated Python function with saved values as inputs, and compiled with torch.compile.
"""

import torch  # loads libtorch before the native module links against it

_TORCH_SERIES = "2.13"  # the release tch 0.26 (and so the native module) is built for


def _check_torch() -> None:
    installed = torch.__version__.split("+")[0]
    if ".".join(installed.split(".")[:2]) != _TORCH_SERIES:
        raise ImportError(
            f"replaygrad is built against torch {_TORCH_SERIES}.x but torch {installed} is "
            f"installed; install torch=={_TORCH_SERIES}.* (or rebuild replaygrad against "
            "this torch, if tch supports it)"
        )


_check_torch()

from . import _core  # noqa: E402

if _core.TORCH_VERSION != torch.__version__.split("+")[0]:
    import warnings

    warnings.warn(
        f"replaygrad was built against torch {_core.TORCH_VERSION}, running with torch "
        f"{torch.__version__}: patch releases are expected to be compatible",
        RuntimeWarning,
        stacklevel=2,
    )

from ._api import (  # noqa: E402
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
    set_region_size,
)
from ._compile import CacheInfo, Compiler  # noqa: E402

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
    "set_region_size",
]
