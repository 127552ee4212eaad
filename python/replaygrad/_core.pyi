"""Type stubs for replaygrad's native module (rust/python.rs)."""

from collections.abc import Iterable, Sequence
from typing import Any

import torch

TORCH_VERSION: str

_Slot = list[tuple[int, int]]
_StepInfo = tuple[
    str,  # node name
    str,  # node kind: generic | accumulate_grad | python_function | cpp_function
    str,  # mode: traced | opaque | deferred_accumulate | eager_accumulate
    int,  # sequence_nr
    int,  # num_inputs
    int,  # num_outputs
    int,  # first saved slot
    int,  # end of saved slots
    list[_Slot],  # per input: (step, index) sources; step -1 is root gradient `index`
    list[tuple[int, int]],  # per output: (target step or -1, input_nr)
    list[tuple[str, int, bool, int]],  # hooks: (kind, index, python, value_idx or -1)
]

class Plan:
    """The plan of one backward call: engine order, saved-value layout, structural key."""

    @property
    def key(self) -> str: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def num_saved(self) -> int: ...
    @property
    def num_roots(self) -> int: ...
    def order(self) -> list[str]: ...
    def nodes(self) -> list[Any]: ...
    def steps(self) -> list[_StepInfo]: ...
    def saved_values(self) -> list[torch.Tensor | None]: ...
    def hook_functions(self) -> list[list[Any]]: ...
    def deferred(self) -> list[tuple[int, str, int]]: ...
    def validate_root_grads(
        self, grads: Iterable[torch.Tensor | None]
    ) -> tuple[torch.Tensor | None, ...]: ...
    def apply(
        self,
        step: int,
        inputs: Sequence[torch.Tensor | None],
        saved: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor | None, ...]: ...
    def call_hook(
        self,
        step: int,
        position: int,
        values: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor | None, ...]: ...
    def run_deferred(self, values: list[torch.Tensor | None]) -> None: ...
    def release_variables(self) -> None: ...

def plan(roots: Iterable[torch.Tensor]) -> Plan: ...
def same_node(a: object, b: object) -> bool: ...
