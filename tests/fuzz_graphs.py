"""Random autograd programs for differential fuzzing of replaygrad against eager autograd.

A :class:`Program` is plain data: leaf shapes, a list of :class:`Op` specs that refer to
earlier values by index (:data:`OPS`: unary, broadcasting binary, reductions, matmul, linear, views,
in-place ops on intermediates and on their views, cat/stack, indexing, where, unbind/chunk,
casts, custom autograd Functions, checkpointing, sparse embedding gradients, tensor and
grad_fn hooks, retain_grad), the roots with the seeds of their gradients, and how the
backward is called (``backward``, ``backward(inputs=)``, ``autograd.grad``; once or twice
with ``retain_graph``; leaves with or without a ``.grad`` already). :func:`build` runs it
forward from given leaf tensors, so the same program can be built twice (once for eager,
once for replaygrad) from clones of the same leaves, and :func:`check` compares everything
the two backward calls leave observable (see :func:`compare`).

:func:`programs` is the hypothesis strategy. It builds every candidate op on ``meta`` tensors
as it draws it (with autograd on, leaves with the real strides), which gives it shapes,
``requires_grad`` and whether the op is legal at all; ops the forward rejects (an in-place op
on a leaf or on a multi-output view, say) are dropped. Backward-time errors cannot be seen
that way: in-place ops only target values no backward node has saved (see
``_GenState.tainted``), and any error left is compared between eager and replaygrad like any
other result. A few ops make the backward fail on purpose (``fn_fail``, ``bad_hook``).

Known differences are minimal tests in test_fuzz_regressions.py; what triggers them is left
out of the default generator (:data:`EXCLUDED`, :data:`COMPILED_EXCLUDED`, and comments
where a call is shaped to avoid one).

No tests here: tests/test_fuzz.py and benchmarks/fuzz.py use it.
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import replaygrad

# ---- programs as data --------------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One step of a program: ``kind`` (a key of :data:`OPS`) and its arguments (env
    indices, dims, seeds, constants)."""

    kind: str
    args: tuple

    def __repr__(self) -> str:
        return f"Op({self.kind!r}, {self.args!r})"


@dataclass(frozen=True)
class Program:
    """Leaves ``(shape, requires_grad)``, ops, roots (env indices) and one gradient seed per
    root (None: implicit gradient of a one-element root). ``seed`` makes the leaf values.

    ``mode``: "backward" (``backward(roots, grads)``), "inputs" (``backward(...,
    inputs=)``) or "grad" (``autograd.grad(roots, inputs, grads, allow_unused=True)``), with
    ``inputs`` as env indices. ``pre_grads``: per leaf, the seed of a ``.grad`` it already
    has (None: none). ``twice``: a first call with ``retain_graph=True``, then a second.
    """

    leaves: tuple[tuple[tuple[int, ...], bool], ...]
    ops: tuple[Op, ...]
    roots: tuple[int, ...]
    grad_seeds: tuple[int | None, ...]
    seed: int = 0
    mode: str = "backward"
    inputs: tuple[int, ...] = ()
    pre_grads: tuple[int | None, ...] = ()
    twice: bool = False
    #: Leaves (by index) stored with reversed dimension order (non-contiguous).
    permuted: tuple[int, ...] = ()


# ---- the builder -------------------------------------------------------------------------


@dataclass
class Built:
    """A program run forward: ``env`` holds every value in order (leaves first)."""

    leaves: list[torch.Tensor]
    env: list[torch.Tensor] = field(default_factory=list)
    #: Hook calls in the order they happened: (hook name, recorded values).
    log: list[tuple[str, tuple]] = field(default_factory=list)
    retained: list[torch.Tensor] = field(default_factory=list)
    roots: list[torch.Tensor] = field(default_factory=list)
    grad_tensors: list[torch.Tensor | None] = field(default_factory=list)
    #: Nodes hooks were registered on (an AccumulateGrad is only weakly held by its leaf).
    keep: list[Any] = field(default_factory=list)
    #: Sequence number of the op being applied (names its hooks).
    position: int = 0
    #: ``inputs=`` of the call (backward(inputs=) or autograd.grad).
    inputs: list[torch.Tensor] = field(default_factory=list)
    #: Each leaf's .grad before the backward (the object, to check it is updated in place).
    pre_grads: list[torch.Tensor | None] = field(default_factory=list)
    #: What autograd.grad returned, per call.
    results: list[tuple] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.leaves[0].device

    def generator(self, seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def randint(self, seed: int, high: int, shape: Sequence[int]) -> torch.Tensor:
        return torch.randint(0, high, tuple(shape), generator=self.generator(seed)).to(self.device)

    def mask(self, seed: int, shape: Sequence[int]) -> torch.Tensor:
        g = self.generator(seed)
        return (torch.rand(tuple(shape), generator=g) < 0.5).to(self.device)

    def randn(self, seed: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        g = self.generator(seed)
        return torch.randn(tuple(shape), generator=g, dtype=dtype).to(self.device)


def make_leaves(program: Program, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """The leaf values of ``program`` (not requiring grad yet): see :func:`fresh_leaves`."""
    g = torch.Generator().manual_seed(program.seed)
    values = []
    for k, (shape, _) in enumerate(program.leaves):
        if k in program.permuted:
            dims = tuple(reversed(range(len(shape))))
            v = torch.randn(shape[::-1], generator=g, dtype=dtype).permute(dims)
        else:
            v = torch.randn(shape, generator=g, dtype=dtype)
        values.append(v)
    return values


def fresh_leaves(program: Program, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Clones of ``values`` with the program's requires_grad flags: one set per build."""
    return [v.detach().clone().requires_grad_(rg) for v, (_, rg) in zip(values, program.leaves)]


def apply_op(b: Built, op: Op) -> list[torch.Tensor]:
    """Runs one op on ``b`` and appends its outputs to ``b.env``."""
    outs = OPS[op.kind].apply(b, *op.args)
    b.env.extend(outs)
    b.position += 1
    if op.kind in INPLACE:
        refresh_views(b.env)
    return outs


def refresh_views(env: Sequence[torch.Tensor]) -> set[int]:
    """Reads every value's grad_fn after an in-place op, which regenerates those of views
    of the modified base; returns the indices whose grad_fn raises (multi-output views of a
    modified base: they are never used again).

    The generator and the builder both do it: without it, eager autograd itself treats a
    view of a former non-grad leaf as a leaf when modified in place again
    (``v = x[0:]; v[:1].add_(s); v.add_(s)`` raises "a leaf Variable that requires grad").
    """
    dead = set()
    for i, t in enumerate(env):
        try:
            t.grad_fn  # noqa: B018
        except RuntimeError:
            dead.add(i)
    return dead


def build(program: Program, leaves: Sequence[torch.Tensor]) -> Built:
    """Runs ``program`` forward from ``leaves`` (see :func:`fresh_leaves`)."""
    b = Built(leaves=list(leaves), env=list(leaves))
    for leaf, seed in itertools.zip_longest(b.leaves, program.pre_grads):
        if seed is not None:
            leaf.grad = b.randn(seed, leaf.shape, leaf.dtype)
        b.pre_grads.append(leaf.grad)
    for op in program.ops:
        apply_op(b, op)
    for index, seed in zip(program.roots, program.grad_seeds):
        root = b.env[index]
        b.roots.append(root)
        b.grad_tensors.append(None if seed is None else b.randn(seed, root.shape, root.dtype))
    b.inputs = [b.env[i] for i in program.inputs]
    return b


# ---- hooks -------------------------------------------------------------------------------


def _snap(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return tuple(_snap(v) for v in value)


def _scaled(value: Any, scale: float) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value * scale
    return tuple(_scaled(v, scale) for v in value)


def _mutate(value: Any, scale: float) -> None:
    """Scales gradients in place (where their memory allows it)."""
    if isinstance(value, torch.Tensor):
        if torch._debug_has_internal_overlap(value) == 0:
            value.mul_(scale)
    elif value is not None:
        for v in value:
            _mutate(v, scale)


def _make_hook(b: Built, kind: str, mode: str, scale: float) -> Callable:
    """A hook that records its arguments (mode "record"/"both"), scales the gradients it
    may replace (mode "scale"/"both") or scales them in place and returns None ("inplace",
    the gradient may be shared: eager and replaygrad must share it alike)."""
    name = f"{kind}@{b.position}"
    log = b.log
    record = mode in ("record", "both")
    scale_it = mode in ("scale", "both")
    inplace = mode == "inplace"
    nested = mode == "nested"

    if kind == "post":

        def post_hook(grad_inputs, grad_outputs):
            if record:
                log.append((name, (_snap(grad_inputs), _snap(grad_outputs))))
            if inplace:
                _mutate(grad_inputs, scale)
            return _scaled(grad_inputs, scale) if scale_it else None

        return post_hook

    if kind == "post_acc":

        def post_acc_hook(tensor):
            log.append((name, (_snap(tensor.grad),)))
            if inplace:  # what these hooks are for: updating .grad (or the leaf) in place
                tensor.grad.mul_(scale)

        return post_acc_hook

    def hook(grad):
        # tensor hooks get a tensor, grad_fn pre-hooks a tuple of them
        if record:
            log.append((name, (_snap(grad),)))
        if inplace:
            _mutate(grad, scale)
        if nested:
            log.append((name, _nested_grad(grad, scale)))
        return _scaled(grad, scale) if scale_it else None

    return hook


def _bad_value(value: Any, how: str) -> Any:
    """A result a hook may not return instead of ``value`` (a tensor or a tuple)."""
    if isinstance(value, torch.Tensor):
        return [value] if how == "type" else value.unsqueeze(0)
    if how == "type":
        return list(value)
    if how == "count" or all(v is None for v in value):
        return (*value, None)
    k = next(k for k, v in enumerate(value) if v is not None)
    return (*value[:k], value[k].unsqueeze(0), *value[k + 1 :])


def _op_bad_hook(b, i, where, how):
    """A hook whose result is rejected (a wrong shape, count or type; not a wrong dtype:
    test_fuzz_regressions.py::test_hook_changing_dtype_raises_eagers_message)."""
    t = b.env[i]

    def bad_tensor_hook(grad):
        return _bad_value(grad, how)

    def bad_pre_hook(grads):
        return _bad_value(grads, how)

    def bad_post_hook(grad_inputs, grad_outputs):
        return _bad_value(grad_inputs, how)

    if where == "tensor":
        t.register_hook(bad_tensor_hook)
        return []
    fn = t.grad_fn if t.grad_fn is not None else _accumulator(t)
    b.keep.append(fn)
    if where == "pre":
        fn.register_prehook(bad_pre_hook)
    else:
        fn.register_hook(bad_post_hook)
    return []


def _nested_grad(grad: Any, scale: float) -> tuple:
    """autograd.grad of a small graph built from ``grad`` (one tensor or a tuple)."""
    if grad is None:  # a tensor hook sees None where a Function returned None
        grad = ()
    values = [grad] if isinstance(grad, torch.Tensor) else [g for g in grad if g is not None]
    total = sum((v.detach().double().sum() for v in values), torch.zeros((), dtype=torch.float64))
    z = torch.full((2,), scale, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():  # hooks run with grad mode off
        loss = (z.sin() * total).sum()
        return tuple(torch.autograd.grad(loss, z))


def _accumulator(leaf: torch.Tensor) -> Any:
    return torch.autograd.graph.get_gradient_edge(leaf).node


def _op_tensor_hook(b, i, mode, scale):
    b.env[i].register_hook(_make_hook(b, "tensor", mode, scale))
    return []


def _op_prehook(b, i, mode, scale):
    t = b.env[i]
    fn = t.grad_fn if t.grad_fn is not None else _accumulator(t)
    b.keep.append(fn)
    fn.register_prehook(_make_hook(b, "pre", mode, scale))
    return []


def _op_posthook(b, i, mode, scale):
    t = b.env[i]
    fn = t.grad_fn if t.grad_fn is not None else _accumulator(t)
    b.keep.append(fn)
    fn.register_hook(_make_hook(b, "post", mode, scale))
    return []


def _op_post_acc_hook(b, i, mode, scale):
    b.env[i].register_post_accumulate_grad_hook(_make_hook(b, "post_acc", mode, scale))
    return []


def _op_retain_grad(b, i):
    t = b.env[i]
    t.retain_grad()
    b.retained.append(t)
    return []


# ---- custom autograd Functions -----------------------------------------------------------


class MulSaved(torch.autograd.Function):
    """a * b with both inputs in save_for_backward."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad * b, grad * a


class NoneForSecond(torch.autograd.Function):
    """2a + b whose backward returns None for b (b gets no gradient this way)."""

    @staticmethod
    def forward(ctx, a, b):
        return a * 2 + b

    @staticmethod
    def backward(ctx, grad):
        return grad * 2, None


class NoMaterialize(torch.autograd.Function):
    """(sin a, 3a) with set_materialize_grads(False): an unused output's gradient is None."""

    @staticmethod
    def forward(ctx, a):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(a)
        return a.sin(), a * 3

    @staticmethod
    def backward(ctx, grad_sin, grad_three):
        (a,) = ctx.saved_tensors
        out = None
        if grad_sin is not None:
            out = grad_sin * a.cos()
        if grad_three is not None:
            out = grad_three * 3 if out is None else out + grad_three * 3
        return out


class FailingBackward(torch.autograd.Function):
    """Identity whose backward raises (how="raise") or returns a gradient of the wrong
    shape (how="shape", caught by validate_outputs)."""

    @staticmethod
    def forward(ctx, a, how):
        ctx.how = how
        return a.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.how == "raise":
            raise ValueError("FailingBackward.backward raised")
        return grad.reshape(-1)[:1].unsqueeze(0).unsqueeze(0).expand(2, 2, 1), None


class ScaleInPlace(torch.autograd.Function):
    """a *= 2 in place, with mark_dirty."""

    @staticmethod
    def forward(ctx, a):
        a.mul_(2)
        ctx.mark_dirty(a)
        return a

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class WithNonDifferentiable(torch.autograd.Function):
    """(exp a, a > 0 as a float mask) with the mask marked non-differentiable and the
    output saved."""

    @staticmethod
    def forward(ctx, a):
        out = a.exp()
        mask = (a > 0).to(a.dtype)
        ctx.mark_non_differentiable(mask)
        ctx.save_for_backward(out)
        return out, mask

    @staticmethod
    def backward(ctx, grad_out, grad_mask):
        (out,) = ctx.saved_tensors
        return grad_out * out


def _traceable(cls: type) -> type:
    return type(cls.__name__ + "Traceable", (cls,), {"is_traceable": True})


FUNCTIONS = {
    (cls.__name__, traceable): _traceable(cls) if traceable else cls
    for cls in (
        MulSaved,
        NoneForSecond,
        NoMaterialize,
        FailingBackward,
        ScaleInPlace,
        WithNonDifferentiable,
    )
    for traceable in (False, True)
}


# ---- the op table ------------------------------------------------------------------------

DrawFn = Callable[[st.SearchStrategy], Any]


@dataclass(frozen=True)
class OpDef:
    #: (built, *args) -> new values
    apply: Callable[..., list[torch.Tensor]]
    #: (draw, state) -> (args, consumed env indices) or None when not applicable
    gen: Callable[[DrawFn, _GenState], tuple[tuple, list[int]] | None]
    #: the backward saves an input / the output (in-place ops on them must then fail)
    saves_inputs: bool = False
    saves_output: bool = False


OPS: dict[str, OpDef] = {}

MAX_DIM = 8  # largest size of a dimension (leaves: 4)
MAX_NDIM = 3
SCALES = (2.0, 0.5, -1.0, 3.0)
#: "nested" hooks run a small autograd.grad of their own (a backward inside the backward);
#: "inplace" ones must stay last (see programs(inplace_hooks=)).
HOOK_MODES = ("record", "scale", "both", "nested", "inplace")


class _GenState:
    """What the generator knows while drawing: the program so far, built on meta tensors."""

    def __init__(
        self,
        leaves: Sequence[tuple[tuple[int, ...], bool]],
        inplace_hooks: bool = False,
        permuted: Sequence[int] = (),
        dtype: torch.dtype = torch.float64,
    ) -> None:
        self.inplace_hooks = inplace_hooks
        self.nested_hooks = True
        # the same strides as make_leaves': whether reshape makes a view depends on them
        program = Program(leaves=tuple(leaves), ops=(), roots=(), grad_seeds=(), permuted=permuted)
        meta = [v.to("meta") for v in make_leaves(program, dtype)]
        for t, (_, rg) in zip(meta, leaves):
            t.requires_grad_(rg)
        self.b = Built(leaves=meta, env=list(meta))
        #: ids of base tensors a backward node saved (or views of them, or aliases): an
        #: in-place op on them or their views would fail the version check at backward.
        self.tainted: set[int] = set()
        #: env indices that may not be used again: outputs of multi-output views whose
        #: base was modified in place (even reading their grad_fn raises).
        self.dead: set[int] = set()

    @property
    def env(self) -> list[torch.Tensor]:
        return self.b.env

    def base(self, i: int) -> torch.Tensor:
        t = self.env[i]
        return t._base if t._base is not None else t

    def taint(self, t: torch.Tensor) -> None:
        self.tainted.add(id(t._base if t._base is not None else t))

    def inplace_target(self, t: torch.Tensor) -> bool:
        base = t._base if t._base is not None else t
        return (
            id(base) not in self.tainted
            and not (t.is_leaf and t.requires_grad)
            and torch._debug_has_internal_overlap(t) == 0
        )


def _op(name: str, gen, saves_inputs: bool = False, saves_output: bool = False):
    def register(fn):
        OPS[name] = OpDef(fn, gen, saves_inputs, saves_output)
        return fn

    return register


def _pick(draw: DrawFn, state: _GenState, pred: Callable[[torch.Tensor], bool]) -> int | None:
    """An env index whose value satisfies ``pred``; shrinks towards the most recent one."""
    cands = [i for i, t in enumerate(state.env) if i not in state.dead and pred(t)]
    if not cands:
        return None
    return cands[-1 - draw(st.integers(0, len(cands) - 1))]


def _any(t: torch.Tensor) -> bool:
    return True


def _nd(n: int) -> Callable[[torch.Tensor], bool]:
    return lambda t: t.dim() >= n


def _broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    try:
        torch.broadcast_shapes(tuple(a), tuple(b))
    except RuntimeError:
        return False
    return True


def _broadcasts_to(a: Sequence[int], target: Sequence[int]) -> bool:
    return _broadcastable(a, target) and torch.broadcast_shapes(tuple(a), tuple(target)) == tuple(
        target
    )


# unary -------------------------------------------------------------------------------------


def _gen_unary(draw, state):
    i = _pick(draw, state, _any)
    return (i,), [i]


def _gen_dim(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    return (i, draw(st.integers(0, state.env[i].dim() - 1))), [i]


UNARY: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], bool, bool]] = {
    # name: (fn, saves input, saves output)
    "sin": (torch.sin, True, False),
    "exp": (torch.exp, False, True),
    "tanh": (torch.tanh, False, True),
    "relu": (torch.relu, False, True),
    "sigmoid": (torch.sigmoid, False, True),
    "abs": (torch.abs, True, False),
    "neg": (torch.neg, False, False),
    "square": (torch.square, True, False),
    "sqrt_abs": (lambda x: (x.abs() + 1e-3).sqrt(), True, True),
    "log_abs": (lambda x: (x.abs() + 1e-3).log(), True, False),
    "clamp": (lambda x: x.clamp(-0.5, 0.8), True, False),
    "mul_scalar": (lambda x: x * 1.5, False, False),
    "clone": (torch.clone, False, False),
    "view_as": (lambda x: x.view_as(x), False, False),
    "cast": (
        lambda x: x.to(torch.float32 if x.dtype == torch.float64 else torch.float64),
        False,
        False,
    ),
    "sum": (torch.sum, False, False),
    "mean": (torch.mean, False, False),
    "norm": (torch.norm, True, True),
}


def _register_unary(name: str, fn: Callable, saves_in: bool, saves_out: bool) -> None:
    @_op(name, _gen_unary, saves_in, saves_out)
    def _apply(b, i):
        return [fn(b.env[i])]


for _name, (_fn, _si, _so) in UNARY.items():
    _register_unary(_name, _fn, _si, _so)


@_op("detach", _gen_unary)
def _detach(b, i):
    # shares storage and version counter with its input (tainted both ways in the generator)
    return [b.env[i].detach()]


DIM_OPS: dict[str, tuple[Callable[[torch.Tensor, int], torch.Tensor], bool, bool]] = {
    "softmax": (lambda x, d: x.softmax(d), False, True),
    "log_softmax": (lambda x, d: x.log_softmax(d), False, True),
    "cumsum": (lambda x, d: x.cumsum(d), False, False),
    "flip": (lambda x, d: x.flip(d), False, False),
    "mean_dim": (lambda x, d: x.mean(d), False, False),
    "norm_dim": (lambda x, d: x.norm(dim=d), True, True),
    # Backwards that scatter into a zero-filled buffer (the indices saved, not the values).
    "max_dim": (lambda x, d: x.max(d)[0], False, False),
    "median_dim": (lambda x, d: x.median(d)[0], False, False),
    "cummax": (lambda x, d: x.cummax(d)[0], False, False),
    "sort": (lambda x, d: x.sort(d)[0], False, False),
}


def _register_dim(name: str, fn: Callable, saves_in: bool, saves_out: bool) -> None:
    @_op(name, _gen_dim, saves_in, saves_out)
    def _apply(b, i, d):
        return [fn(b.env[i], d)]


for _name, (_fn, _si, _so) in DIM_OPS.items():
    _register_dim(_name, _fn, _si, _so)


def _gen_dim_keepdim(draw, state):
    drawn = _gen_dim(draw, state)
    if drawn is None:
        return None
    (i, d), inputs = drawn
    return (i, d, draw(st.booleans())), inputs


@_op("sum_dim", _gen_dim_keepdim)
def _sum_dim(b, i, d, keepdim):
    return [b.env[i].sum(d, keepdim=keepdim)]


@_op("amax", _gen_dim_keepdim, saves_inputs=True, saves_output=True)
def _amax(b, i, d, keepdim):
    return [b.env[i].amax(d, keepdim=keepdim)]


# binary ------------------------------------------------------------------------------------


def _gen_binary(draw, state):
    i = _pick(draw, state, _any)
    si = state.env[i].shape
    j = _pick(draw, state, lambda t: _broadcastable(si, t.shape))
    return (i, j), [i, j]


BINARY: dict[str, tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], bool]] = {
    "add": (torch.add, False),
    "sub": (torch.sub, False),
    "mul": (torch.mul, True),
    "div_abs1": (lambda a, b: a / (b.abs() + 1), True),
    "maximum": (torch.maximum, True),
    "atan2": (torch.atan2, True),
}


def _register_binary(name: str, fn: Callable, saves_in: bool) -> None:
    @_op(name, _gen_binary, saves_in)
    def _apply(b, i, j):
        return [fn(b.env[i], b.env[j])]


for _name, (_fn, _si) in BINARY.items():
    _register_binary(_name, _fn, _si)


def _matmul_ok(a: Sequence[int], b: Sequence[int]) -> bool:
    if not a or not b or len(b) > 2:
        return False
    return a[-1] == (b[0] if len(b) == 1 else b[-2])


def _gen_matmul(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    si = state.env[i].shape
    dtype = state.env[i].dtype  # matmul does not promote (meta does not check)
    j = _pick(draw, state, lambda t: t.dtype == dtype and _matmul_ok(si, t.shape))
    if j is None:
        return None
    return (i, j), [i, j]


@_op("matmul", _gen_matmul, saves_inputs=True)
def _matmul(b, i, j):
    return [b.env[i] @ b.env[j]]


def _gen_linear(draw, state):
    # The weight a leaf, as a parameter is; the input another value.
    j = _pick(draw, state, lambda t: t.is_leaf and t.dim() == 2)
    if j is None:
        return None
    w = state.env[j]
    i = _pick(draw, state, lambda t: t is not w and t.dim() >= 1 and t.shape[-1] == w.shape[1])
    if i is None or state.env[i].dtype != w.dtype:
        return None
    return (i, j, draw(st.booleans())), [i, j]


@_op("linear", _gen_linear, saves_inputs=True)
def _linear(b, i, j, bias):
    """``nn.Linear``'s op, the weight another value (with a bias, its first column): a leaf
    weight used in matrix products only gets its gradient from their factors in compiled
    replays (see replaygrad._replay._products)."""
    w = b.env[j]
    return [torch.nn.functional.linear(b.env[i], w, w[:, 0] if bias else None)]


@_op("linear_row", _gen_linear, saves_inputs=True)
def _linear_row(b, i, j, bias):
    """``linear`` on the input's first row only: a product's factors smaller than the
    weight's gradient, which compiled replays take as factors (a weight whose one product's
    factors are larger is formed by its nodes); a weight in several, in blocks."""
    w = b.env[j]
    row = b.env[i].reshape(-1, w.shape[1])[:1]
    return [torch.nn.functional.linear(row, w, w[:, 0] if bias else None)]


@_op("matmul_self_t", lambda draw, state: _gen_nd_exact(draw, state, 2), saves_inputs=True)
def _matmul_self_t(b, i):
    x = b.env[i]
    return [x @ x.mT]


def _gen_nd_exact(draw, state, n):
    i = _pick(draw, state, lambda t: t.dim() == n)
    return None if i is None else ((i,), [i])


# views -------------------------------------------------------------------------------------


def _gen_transpose(draw, state):
    i = _pick(draw, state, _nd(2))
    if i is None:
        return None
    n = state.env[i].dim()
    return (i, draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))), [i]


@_op("transpose", _gen_transpose)
def _transpose(b, i, d0, d1):
    return [b.env[i].transpose(d0, d1)]


def _gen_permute(draw, state):
    i = _pick(draw, state, _nd(2))
    if i is None:
        return None
    return (i, tuple(draw(st.permutations(range(state.env[i].dim()))))), [i]


@_op("permute", _gen_permute)
def _permute(b, i, dims):
    return [b.env[i].permute(dims)]


def _shapes_of(numel: int) -> list[tuple[int, ...]]:
    out = [()] if numel == 1 else []
    for n in range(1, MAX_NDIM + 1):
        for shape in itertools.product(range(1, MAX_DIM + 1), repeat=n):
            if math.prod(shape) == numel:
                out.append(shape)
    return out


def _gen_reshape(draw, state):
    i = _pick(draw, state, _any)
    shapes = _shapes_of(state.env[i].numel())
    if not shapes:
        return None
    return (i, draw(st.sampled_from(shapes))), [i]


@_op("reshape", _gen_reshape)
def _reshape(b, i, shape):
    return [b.env[i].reshape(shape)]


def _gen_narrow(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    t = state.env[i]
    d = draw(st.integers(0, t.dim() - 1))
    start = draw(st.integers(0, t.shape[d] - 1))
    length = draw(st.integers(1, t.shape[d] - start))
    return (i, d, start, length), [i]


@_op("narrow", _gen_narrow)
def _narrow(b, i, d, start, length):
    return [b.env[i].narrow(d, start, length)]


def _gen_select(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    t = state.env[i]
    d = draw(st.integers(0, t.dim() - 1))
    return (i, d, draw(st.integers(0, t.shape[d] - 1))), [i]


@_op("select", _gen_select)
def _select(b, i, d, index):
    return [b.env[i].select(d, index)]


def _gen_slice_step(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    t = state.env[i]
    d = draw(st.integers(0, t.dim() - 1))
    return (i, d, draw(st.integers(0, t.shape[d] - 1)), draw(st.integers(1, 3))), [i]


@_op("slice_step", _gen_slice_step)
def _slice_step(b, i, d, start, step):
    return [b.env[i][(slice(None),) * d + (slice(start, None, step),)]]


def _gen_expand(draw, state):
    i = _pick(draw, state, _any)
    shape = [draw(st.integers(1, 4)) if s == 1 else s for s in state.env[i].shape]
    if len(shape) < MAX_NDIM and draw(st.booleans()):
        shape.insert(0, draw(st.integers(1, 3)))
    return (i, tuple(shape)), [i]


@_op("expand", _gen_expand)
def _expand(b, i, shape):
    return [b.env[i].expand(shape)]


def _gen_unsqueeze(draw, state):
    i = _pick(draw, state, lambda t: t.dim() < MAX_NDIM)
    if i is None:
        return None
    return (i, draw(st.integers(0, state.env[i].dim()))), [i]


@_op("unsqueeze", _gen_unsqueeze)
def _unsqueeze(b, i, d):
    return [b.env[i].unsqueeze(d)]


def _gen_squeeze(draw, state):
    i = _pick(draw, state, lambda t: 1 in t.shape)
    if i is None:
        return None
    dims = [d for d, s in enumerate(state.env[i].shape) if s == 1]
    return (i, draw(st.sampled_from(dims))), [i]


@_op("squeeze", _gen_squeeze)
def _squeeze(b, i, d):
    return [b.env[i].squeeze(d)]


# several inputs or outputs ----------------------------------------------------------------


def _gen_cat(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    si = state.env[i].shape
    d = draw(st.integers(0, len(si) - 1))

    def fits(t):
        same = (a == b for k, (a, b) in enumerate(zip(si, t.shape)) if k != d)
        return t.dim() == len(si) and all(same)

    others = [_pick(draw, state, fits) for _ in range(draw(st.integers(1, 2)))]
    return (i, tuple(others), d), [i, *others]


@_op("cat", _gen_cat)
def _cat(b, i, others, d):
    return [torch.cat([b.env[i], *(b.env[j] for j in others)], d)]


def _gen_stack(draw, state):
    i = _pick(draw, state, lambda t: t.dim() < MAX_NDIM)
    if i is None:
        return None
    si = state.env[i].shape
    others = [_pick(draw, state, lambda t: t.shape == si) for _ in range(draw(st.integers(1, 2)))]
    return (i, tuple(others), draw(st.integers(0, len(si)))), [i, *others]


@_op("stack", _gen_stack)
def _stack(b, i, others, d):
    return [torch.stack([b.env[i], *(b.env[j] for j in others)], d)]


@_op("unbind", _gen_dim)
def _unbind(b, i, d):
    return list(b.env[i].unbind(d))


def _gen_chunk(draw, state):
    drawn = _gen_dim(draw, state)
    if drawn is None:
        return None
    (i, d), inputs = drawn
    return (i, draw(st.integers(2, 3)), d), inputs


@_op("chunk", _gen_chunk)
def _chunk(b, i, chunks, d):
    return list(b.env[i].chunk(chunks, d))


def _gen_index(draw, state):
    i = _pick(draw, state, _nd(1))
    if i is None:
        return None
    return (i, draw(st.integers(1, 4)), draw(st.integers(0, 255))), [i]


@_op("index", _gen_index)
def _index(b, i, k, seed):
    x = b.env[i]
    return [x[b.randint(seed, x.shape[0], (k,))]]


def _gen_index_select(draw, state):
    drawn = _gen_dim(draw, state)
    if drawn is None:
        return None
    (i, d), inputs = drawn
    return (i, d, draw(st.integers(1, 4)), draw(st.integers(0, 255))), inputs


@_op("index_select", _gen_index_select)
def _index_select(b, i, d, k, seed):
    x = b.env[i]
    return [x.index_select(d, b.randint(seed, x.shape[d], (k,)))]


def _gen_gather(draw, state):
    drawn = _gen_dim(draw, state)
    if drawn is None:
        return None
    (i, d), inputs = drawn
    return (i, d, draw(st.integers(0, 255))), inputs


@_op("gather", _gen_gather, saves_inputs=True)
def _gather(b, i, d, seed):
    x = b.env[i]
    return [x.gather(d, b.randint(seed, x.shape[d], x.shape))]


def _gen_where(draw, state):
    drawn = _gen_binary(draw, state)
    (i, j), inputs = drawn
    return (i, j, draw(st.integers(0, 255))), inputs


@_op("where", _gen_where)
def _where(b, i, j, seed):
    x, y = b.env[i], b.env[j]
    return [torch.where(b.mask(seed, torch.broadcast_shapes(x.shape, y.shape)), x, y)]


# custom Functions --------------------------------------------------------------------------


def _gen_function2(draw, state):
    drawn = _gen_binary(draw, state)
    (i, j), inputs = drawn
    return (i, j, draw(st.booleans())), inputs


@_op("fn_mul_saved", _gen_function2, saves_inputs=True, saves_output=True)
def _fn_mul_saved(b, i, j, traceable):
    return [FUNCTIONS["MulSaved", traceable].apply(b.env[i], b.env[j])]


@_op("fn_none_for_second", _gen_function2, saves_output=True)
def _fn_none_for_second(b, i, j, traceable):
    return [FUNCTIONS["NoneForSecond", traceable].apply(b.env[i], b.env[j])]


def _gen_function1(draw, state):
    i = _pick(draw, state, _any)
    return (i, draw(st.booleans())), [i]


@_op("fn_no_materialize", _gen_function1, saves_inputs=True, saves_output=True)
def _fn_no_materialize(b, i, traceable):
    return list(FUNCTIONS["NoMaterialize", traceable].apply(b.env[i]))


@_op("fn_non_differentiable", _gen_function1, saves_output=True)
def _fn_non_differentiable(b, i, traceable):
    return list(FUNCTIONS["WithNonDifferentiable", traceable].apply(b.env[i]))


def _gen_embedding(draw, state):
    i = _pick(draw, state, lambda t: t.dim() == 2)
    if i is None:
        return None
    sparse = state.env[i].is_leaf and draw(st.booleans())  # sparse gradients: for leaves
    return (i, draw(st.integers(1, 4)), draw(st.integers(0, 255)), sparse), [i]


@_op("embedding", _gen_embedding)
def _embedding(b, i, k, seed, sparse):
    w = b.env[i]
    return [torch.nn.functional.embedding(b.randint(seed, w.shape[0], (k,)), w, sparse=sparse)]


def _gen_fn_fail(draw, state):
    i = _pick(draw, state, _any)
    return (i, draw(st.sampled_from(("raise", "shape"))), draw(st.booleans())), [i]


@_op("fn_fail", _gen_fn_fail)
def _fn_fail(b, i, how, traceable):
    return [FUNCTIONS["FailingBackward", traceable].apply(b.env[i], how)]


def _checkpointed(x: torch.Tensor) -> torch.Tensor:
    return (x.sin() * x).tanh()


def _gen_checkpoint(draw, state):
    reentrant = draw(st.booleans())
    # the reentrant form needs an input that requires grad
    i = _pick(draw, state, _requires_grad if reentrant else _any)
    return (i, reentrant), [i]


@_op("checkpoint", _gen_checkpoint, saves_inputs=True, saves_output=True)
def _checkpoint(b, i, reentrant):
    return [checkpoint(_checkpointed, b.env[i], use_reentrant=reentrant)]


@_op("saved_hooks_mul", _gen_binary, saves_inputs=True)
def _saved_hooks_mul(b, i, j):
    """a * b under saved_tensors_hooks whose pack and unpack are logged."""
    log, name = b.log, f"saved@{b.position}"

    def pack(t):
        log.append((name + ":pack", ()))
        return t

    def unpack(t):
        log.append((name + ":unpack", ()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        return [b.env[i] * b.env[j]]


# in-place ----------------------------------------------------------------------------------


def _gen_inplace_scalar(draw, state):
    i = _pick(draw, state, state.inplace_target)
    if i is None:
        return None
    return (i, draw(st.sampled_from(SCALES))), [i]


@_op("iadd_scalar", _gen_inplace_scalar)
def _iadd_scalar(b, i, c):
    return [b.env[i].add_(c)]


@_op("imul_scalar", _gen_inplace_scalar)
def _imul_scalar(b, i, c):
    return [b.env[i].mul_(c)]


def _gen_inplace_binary(draw, state):
    i = _pick(draw, state, state.inplace_target)
    if i is None:
        return None
    t = state.env[i]
    base = state.base(i)
    # a different base: partially overlapping reads and writes are an error
    j = _pick(
        draw,
        state,
        lambda u: (
            _broadcasts_to(u.shape, t.shape) and (u._base if u._base is not None else u) is not base
        ),
    )
    if j is None:
        return None
    return (i, j), [i, j]


@_op("iadd", _gen_inplace_binary)
def _iadd(b, i, j):
    return [b.env[i].add_(b.env[j])]


@_op("imul", _gen_inplace_binary, saves_inputs=True)
def _imul(b, i, j):
    return [b.env[i].mul_(b.env[j])]


def _gen_inplace_slice(draw, state, with_tensor: bool):
    i = _pick(draw, state, lambda t: t.dim() >= 1 and state.inplace_target(t))
    if i is None:
        return None
    t = state.env[i]
    d = draw(st.integers(0, t.dim() - 1))
    start = draw(st.integers(0, t.shape[d] - 1))
    length = draw(st.integers(1, t.shape[d] - start))
    if not with_tensor:
        return (i, d, start, length, draw(st.sampled_from(SCALES))), [i]
    shape = list(t.shape)
    shape[d] = length
    base = state.base(i)
    j = _pick(
        draw,
        state,
        lambda u: (
            _broadcasts_to(u.shape, shape) and (u._base if u._base is not None else u) is not base
        ),
    )
    if j is None:
        return None
    return (i, d, start, length, j), [i, j]


@_op("islice_mul", lambda draw, state: _gen_inplace_slice(draw, state, False))
def _islice_mul(b, i, d, start, length, c):
    x = b.env[i]
    x.narrow(d, start, length).mul_(c)
    return [x]


@_op("islice_add", lambda draw, state: _gen_inplace_slice(draw, state, True))
def _islice_add(b, i, d, start, length, j):
    x = b.env[i]
    x.narrow(d, start, length).add_(b.env[j])
    return [x]


@_op("islice_copy", lambda draw, state: _gen_inplace_slice(draw, state, True))
def _islice_copy(b, i, d, start, length, j):
    x = b.env[i]
    x.narrow(d, start, length).copy_(b.env[j])
    return [x]


def _gen_ifn_scale(draw, state):
    i = _pick(draw, state, state.inplace_target)
    if i is None:
        return None
    return (i, draw(st.booleans())), [i]


@_op("ifn_scale", _gen_ifn_scale)
def _ifn_scale(b, i, traceable):
    return [FUNCTIONS["ScaleInPlace", traceable].apply(b.env[i])]


def _gen_imasked_fill(draw, state):
    i = _pick(draw, state, state.inplace_target)
    if i is None:
        return None
    return (i, draw(st.integers(0, 255))), [i]


@_op("imasked_fill", _gen_imasked_fill)
def _imasked_fill(b, i, seed):
    x = b.env[i]
    return [x.masked_fill_(b.mask(seed, x.shape), 0.25)]


# hooks and retain_grad (no new values) -----------------------------------------------------


def _gen_hook(pred):
    def gen(draw, state):
        i = _pick(draw, state, pred)
        if i is None:
            return None
        modes = HOOK_MODES if state.inplace_hooks else HOOK_MODES[:-1]
        if not state.nested_hooks:
            modes = tuple(m for m in modes if m != "nested")
        return (i, draw(st.sampled_from(modes)), draw(st.sampled_from(SCALES))), []

    return gen


def _requires_grad(t):
    return t.requires_grad


def _grad_leaf(t):
    return t.is_leaf and t.requires_grad


def _non_leaf(t):
    return t.requires_grad and not t.is_leaf


_op("tensor_hook", _gen_hook(_requires_grad))(_op_tensor_hook)
_op("prehook", _gen_hook(_requires_grad))(_op_prehook)
_op("posthook", _gen_hook(_requires_grad))(_op_posthook)


def _gen_leaf_only(pred):
    def gen(draw, state):
        i = _pick(draw, state, pred)
        return None if i is None else ((i,), [])

    return gen


_op("post_acc_hook", _gen_hook(_grad_leaf))(_op_post_acc_hook)


def _op_hook_edits_hooks(b, i, j, action):
    """A tensor hook on value i that, when it runs, registers a recording hook on value j
    (action "add") or removes one registered on j now ("remove")."""
    target = b.env[j]
    name = f"edited@{b.position}"
    log = b.log

    def recording(grad):
        log.append((name, (_snap(grad),)))

    handle = target.register_hook(recording) if action == "remove" else None

    def editing_hook(grad):
        if action == "add":
            target.register_hook(recording)
        else:
            handle.remove()

    b.env[i].register_hook(editing_hook)
    return []


def _gen_hook_edits_hooks(draw, state):
    i = _pick(draw, state, _requires_grad)
    if i is None:
        return None
    # Not on another output of i's node (a hook registered on a node while the engine
    # iterates that node's hook list: see README, Known limitations).
    node = state.env[i].grad_fn
    j = _pick(draw, state, lambda t: t.requires_grad and (node is None or t.grad_fn is not node))
    if j is None:
        return None
    return (i, j, draw(st.sampled_from(("add", "remove")))), []


_op("hook_edits_hooks", _gen_hook_edits_hooks)(_op_hook_edits_hooks)


def _gen_bad_hook(draw, state):
    i = _pick(draw, state, _requires_grad)
    where = draw(st.sampled_from(("tensor", "pre", "post")))
    return (i, where, draw(st.sampled_from(("shape", "count", "type")))), []


_op("bad_hook", _gen_bad_hook)(_op_bad_hook)
_op("retain_grad", _gen_leaf_only(_non_leaf))(_op_retain_grad)


#: Every op kind; the order is the shrink order (hypothesis shrinks towards the first).
KINDS: tuple[str, ...] = tuple(OPS)

#: In-place kinds (their output is their first input, modified).
INPLACE = frozenset(k for k in KINDS if k.startswith("i") and not k.startswith("index"))

#: How often each kind is drawn (default :data:`DEFAULT_WEIGHT`): hooks, in-place ops and
#: custom Functions are what replaygrad orchestrates itself, so they come more often; ops
#: that make the backward fail are rare (the rest of the program is what is tested).
DEFAULT_WEIGHT = 4
WEIGHTS: dict[str, int] = {
    **dict.fromkeys(("tensor_hook", "prehook", "posthook", "retain_grad"), 12),
    "post_acc_hook": 8,
    "linear": 8,
    "linear_row": 8,
    **dict.fromkeys(INPLACE, 8),
    **dict.fromkeys(
        ("fn_mul_saved", "fn_none_for_second", "fn_no_materialize", "fn_non_differentiable"), 8
    ),
    "fn_fail": 1,
    "bad_hook": 1,
    "hook_edits_hooks": 4,
    "ifn_scale": 4,
}

#: Ops left out of the default generator, each with the regression test that shows why.
EXCLUDED: dict[str, str] = {}

#: Ops also left out when the replay is compiled.
COMPILED_EXCLUDED: dict[str, str] = {}

#: Ops dropped while drawing because the meta forward rejected them (for tuning).
REJECTED: Counter[str] = Counter()

MODES = ("backward", "inputs", "grad")


def _edge_node(t: torch.Tensor) -> Any:
    return torch.autograd.graph.get_gradient_edge(t).node


def _root_needed(state: _GenState, root: int, inputs: Sequence[int], mode: str) -> bool:
    """Whether exec_info marks the root's node as needed for a call with ``inputs=``."""
    top = _edge_node(state.env[root])
    targets = [_edge_node(state.env[i]) for i in inputs]  # alive: their wrappers stay the same
    if mode == "inputs" and any(top is t for t in targets):
        return True
    seen, stack = set(), [fn for fn, _ in top.next_functions]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        if any(fn is t for t in targets):
            return True
        seen.add(id(fn))
        stack.extend(f for f, _ in fn.next_functions)
    return False


def _too_big(t: torch.Tensor) -> bool:
    return t.dim() > MAX_NDIM or any(s > MAX_DIM for s in t.shape) or 0 in t.shape


@st.composite
def programs(
    draw: DrawFn,
    max_leaves: int = 3,
    max_ops: int = 24,
    kinds: Sequence[str] | None = None,
    exclude: Sequence[str] = (),
    modes: Sequence[str] = MODES,
    inplace_hooks: bool = False,
    twice: bool = True,
    dtype: torch.dtype = torch.float64,
) -> Program:
    """A random program over 1..max_leaves leaves (leaf 0 requires grad) with up to
    ``max_ops`` ops drawn from ``kinds`` (default: every kind not in :data:`EXCLUDED` or
    ``exclude``, weighted by :data:`WEIGHTS`), called in one of ``modes``; ``twice``: the
    program may run its backward twice. ``dtype``: of the leaves the program will run on
    (dtype casts make ops fail in one leaf dtype and not in the other).

    ``inplace_hooks``: hooks may also scale gradients in place (mode "inplace"). Off by
    default: torch documents that tensor and grad_fn hooks must not modify their argument,
    and replaygrad differs there
    (test_fuzz_regressions.py::test_retain_grad_value_is_taken_before_pre_hooks); for
    post-accumulate-grad hooks, scaling ``.grad`` in place is what they are for, but
    replaygrad differs where eager's ``.grad`` aliases the incoming gradient
    (test_fuzz_regressions.py::test_accumulate_grad_steals_gradient_seen_by_post_hook).
    """
    if kinds is None:
        kinds = [
            k
            for k in KINDS
            if k not in EXCLUDED and k not in exclude
            for _ in range(WEIGHTS.get(k, DEFAULT_WEIGHT))
        ]
    kinds = tuple(kinds)
    shape = st.lists(st.integers(1, 4), min_size=0, max_size=MAX_NDIM).map(tuple)
    n_leaves = draw(st.integers(1, max_leaves))
    leaves = tuple(
        (draw(shape), k == 0 or draw(st.sampled_from((True, True, False)))) for k in range(n_leaves)
    )
    permuted = tuple(
        k for k, (shape, _) in enumerate(leaves) if len(shape) >= 2 and draw(st.booleans())
    )
    state = _GenState(leaves, inplace_hooks, permuted, dtype)
    ops: list[Op] = []
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(kinds))
        spec = OPS[kind]
        drawn = spec.gen(draw, state)
        if drawn is None:
            continue
        args, inputs = drawn
        op = Op(kind, args)
        try:
            outs = spec.apply(state.b, *args)
        except RuntimeError:
            REJECTED[kind] += 1
            # an in-place op may fail after modifying its target (a custom Function's
            # mark_dirty check): its views may be unusable now
            state.dead |= refresh_views(state.env)
            continue
        if any(_too_big(t) for t in outs):
            continue
        state.env.extend(outs)
        state.b.position += 1
        ops.append(op)
        if spec.saves_inputs:
            for i in inputs:
                state.taint(state.env[i])
        if spec.saves_output or kind == "detach":
            for t in outs:
                state.taint(t)
        if kind == "detach":
            state.taint(state.env[inputs[0]])
        if kind in INPLACE:
            state.dead |= refresh_views(state.env)

    def pick_grad_value() -> int:
        i = _pick(draw, state, _requires_grad)
        assert i is not None  # leaf 0 requires grad
        return i

    roots = []
    seeds = []
    for _ in range(draw(st.integers(1, 3))):
        r = pick_grad_value()
        roots.append(r)
        implicit = state.env[r].numel() == 1 and draw(st.booleans())
        seeds.append(None if implicit else draw(st.integers(0, 255)))
    mode = draw(st.sampled_from(tuple(modes)))
    inputs = ()
    if mode != "backward":
        inputs = tuple(pick_grad_value() for _ in range(draw(st.integers(1, 3))))
        if len(roots) == 1 and not _root_needed(state, roots[0], inputs, mode):
            # With one root edge, eager queues the root node even when exec_info says it is
            # not needed (its tensor pre-hooks and retain_grad run); replaygrad plans a
            # GraphRoot and skips it. A second root edge makes eager use a GraphRoot too.
            # test_fuzz_regressions.py::test_single_root_not_needed_runs_its_tensor_hooks
            roots.append(roots[0])
            seeds.append(seeds[0])
    pre_grads = tuple(
        draw(st.sampled_from((None, None, None, 1, 2))) if rg else None for _, rg in leaves
    )
    return Program(
        leaves=leaves,
        ops=tuple(ops),
        roots=tuple(roots),
        grad_seeds=tuple(seeds),
        seed=draw(st.integers(0, 255)),
        mode=mode,
        inputs=inputs,
        pre_grads=pre_grads if any(g is not None for g in pre_grads) else (),
        twice=twice and draw(st.sampled_from((False, False, False, True))),
        permuted=permuted,
    )


# ---- the differential check --------------------------------------------------------------


def _assert_replayed(before: replaygrad.CacheInfo, calls: int) -> None:
    after = replaygrad.cache_info()
    replayed = (after.hits + after.misses) - (before.hits + before.misses)
    assert replayed == calls, (
        f"{calls - replayed} of {calls} backward calls ran in the engine, not replayed "
        "(in long runs: the recompile limit of one graph shape, see fuzz.py --reset-every)"
    )


def _assert_same(expected: Any, actual: Any, exact: bool, what: str) -> None:
    """Tensors (or nested tuples of them, or None) equal: bitwise (NaN where NaN) when
    ``exact``, else within float32 compile tolerances."""
    if expected is None or actual is None:
        assert expected is None and actual is None, f"{what}: {expected} vs {actual}"
        return
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(expected) == len(actual), what
        for k, (e, a) in enumerate(zip(expected, actual)):
            _assert_same(e, a, exact, f"{what}[{k}]")
        return
    assert expected.shape == actual.shape, f"{what}: shape {expected.shape} vs {actual.shape}"
    assert expected.dtype == actual.dtype, f"{what}: dtype {expected.dtype} vs {actual.dtype}"
    assert expected.layout == actual.layout, f"{what}: {expected.layout} vs {actual.layout}"
    if expected.layout != torch.strided:  # sparse: uncoalesced forms may differ in order
        expected, actual = expected.to_dense(), actual.to_dense()
    if exact:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=what)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5, equal_nan=True, msg=what)


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    with warnings.catch_warnings():  # .grad of a non-leaf warns
        warnings.simplefilter("ignore")
        return t.grad


@dataclass
class Outcome:
    built: Built
    error: BaseException | None
    calls: int  # backward calls that completed


def _call(program: Program, b: Built, backward: Callable, grad: Callable) -> Outcome:
    calls = 0
    try:
        for k in range(2 if program.twice else 1):
            retain = program.twice and k == 0
            if program.mode == "grad":
                out = grad(
                    b.roots, b.inputs, b.grad_tensors, retain_graph=retain, allow_unused=True
                )
                b.results.append(tuple(out))
            else:
                inputs = b.inputs if program.mode == "inputs" else None
                backward(b.roots, b.grad_tensors, retain_graph=retain, inputs=inputs)
            calls += 1
    except Exception as error:
        return Outcome(b, error, calls)
    return Outcome(b, None, calls)


def run_eager(program: Program, values: Sequence[torch.Tensor]) -> Outcome:
    b = build(program, fresh_leaves(program, values))
    return _call(program, b, torch.autograd.backward, torch.autograd.grad)


def run_replaygrad(
    program: Program,
    values: Sequence[torch.Tensor],
    compiler: Any = None,
) -> Outcome:
    b = build(program, fresh_leaves(program, values))
    before = replaygrad.cache_info()
    outcome = _call(
        program,
        b,
        functools.partial(replaygrad.backward, compiler=compiler),
        functools.partial(replaygrad.grad, compiler=compiler),
    )
    if outcome.error is None:
        _assert_replayed(before, outcome.calls)
    return outcome


def compare(expected: Outcome, actual: Outcome, exact: bool, root_grads: bool = True) -> None:
    """Everything an eager backward leaves observable, eager (``expected``) vs replaygrad:
    errors, hook calls, autograd.grad results, leaf .grad (values, strides, updated in
    place or not), .grad of retain_grad and inputs= tensors, the root gradients (hooks may
    scale them in place)."""
    e, a = expected.error, actual.error
    if e is not None or a is not None:
        assert e is not None and a is not None, f"eager raised {e!r}, replaygrad {a!r}"
        assert type(e) is type(a), f"eager raised {e!r}, replaygrad {a!r}"
        if exact:
            assert str(e) == str(a), f"eager raised {e!r}, replaygrad {a!r}"
        assert expected.calls == actual.calls, "failed in different calls"
    eb, ab = expected.built, actual.built
    names = [n for n, _ in eb.log], [n for n, _ in ab.log]
    assert names[0] == names[1], f"hook calls differ: eager {names[0]}, replaygrad {names[1]}"
    for (name, ev), (_, av) in zip(eb.log, ab.log):
        _assert_same(ev, av, exact, f"hook {name}")
    assert len(eb.results) == len(ab.results)
    for k, (er, ar) in enumerate(zip(eb.results, ab.results)):
        _assert_same(er, ar, exact, f"autograd.grad result {k}")
    for k, (eg, ag) in enumerate(zip(eb.grad_tensors if root_grads else (), ab.grad_tensors)):
        _assert_same(eg, ag, exact, f"root gradient {k}")
    if e is not None:
        # A failed call leaves .grad as it was before it under replaygrad, where eager has
        # run the AccumulateGrads ordered before the failure
        # (test_fuzz_regressions.py::test_error_mid_backward_keeps_earlier_accumulations).
        return
    for k, (el, al) in enumerate(zip(eb.leaves, ab.leaves)):
        assert el.is_leaf == al.is_leaf, f"leaf {k}"
        if not el.is_leaf:
            continue
        _assert_same(el.grad, al.grad, exact, f"leaf {k} .grad")
        in_place = el.grad is eb.pre_grads[k], al.grad is ab.pre_grads[k]
        assert in_place[0] == in_place[1], f"leaf {k}: .grad updated in place {in_place}"
        if el.grad is not None and el.grad.layout == torch.strided:
            # Only dims of size > 1: eager steals a gradient that obeys the layout contract
            # (its size-1 strides are arbitrary), replaygrad copies it
            # (test_fuzz_regressions.py::test_accumulate_grad_steals_unshared_gradient).
            strides = [
                [st for st, n in zip(g.stride(), g.shape) if n > 1] for g in (el.grad, al.grad)
            ]
            assert strides[0] == strides[1], f"leaf {k} .grad strides"
    for k, (er, ar) in enumerate(zip(eb.retained, ab.retained)):
        _assert_same(_grad_of(er), _grad_of(ar), exact, f"retained {k} .grad")
    for k, (ei, ai) in enumerate(zip(eb.inputs, ab.inputs)):
        _assert_same(_grad_of(ei), _grad_of(ai), exact, f"input {k} .grad")


def check(
    program: Program,
    *,
    compiler: Any = None,
    dtype: torch.dtype = torch.float64,
    exact: bool = True,
    repeat: bool = False,
) -> None:
    """Builds ``program`` from the same leaf values twice (three times with ``repeat``: a
    second replay that can reuse the cached one) and compares eager with replaygrad."""
    values = make_leaves(program, dtype)
    expected = run_eager(program, values)
    # With two calls, eager's first may make a view of a root gradient .grad (stolen) and
    # the second accumulate into it in place, changing the caller's gradient tensor;
    # replaygrad copies instead (test_fuzz_regressions.py::STEAL).
    root_grads = not program.twice
    for _ in range(2 if repeat else 1):
        actual = run_replaygrad(program, values, compiler)
        compare(expected, actual, exact, root_grads)


__all__ = [
    "COMPILED_EXCLUDED",
    "EXCLUDED",
    "KINDS",
    "MODES",
    "OPS",
    "WEIGHTS",
    "Built",
    "Op",
    "Outcome",
    "Program",
    "build",
    "check",
    "compare",
    "fresh_leaves",
    "make_leaves",
    "programs",
    "run_eager",
    "run_replaygrad",
]
