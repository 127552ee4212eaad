"""replaygrad: a compiled backward pass for PyTorch.

The autograd graph is planned in Rust exactly as the engine would run it, replayed as a
generated Python function with saved values as inputs, and compiled with torch.compile.
"""

import torch  # noqa: F401  (loads libtorch before the native module)

from ._api import Plan, backward, enable, grad, plan
from ._compile import Compiler

__all__ = ["Compiler", "Plan", "backward", "enable", "grad", "plan"]
