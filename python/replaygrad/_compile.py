"""Compilers and the cache of compiled replays."""

from __future__ import annotations

import dis
import functools
import hashlib
import inspect
import os
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module

from . import _core
from ._explain import key_difference
from ._logging import Lazy, cache_log, recompiles_log, source_log
from ._replay import Region, Replay, build, replay_inputs, without_dynamo_wrapper

#: What ``compiler=`` accepts: a torch.compile backend name, a callable that takes a
#: function and returns a compiled one, or None (run the replay as plain Python).
Compiler = str | Callable[[Callable[..., Any]], Callable[..., Any]] | None


@dataclass(frozen=True)
class Config:
    """How backward calls are run: the compiler and, for a backend name, the options given
    to ``torch.compile`` (``mode``, ``dynamic``, ``fullgraph``, ``options``, ...)."""

    compiler: Compiler
    #: The options in a hashable form (the cache key); see :attr:`kwargs` for the values.
    options: tuple[tuple[str, Any], ...] = ()
    #: "eager": when compiling a replay fails, the engine runs the call (and later ones with
    #: the same plan) instead of raising.
    fallback: str | None = None
    #: The options as given, for ``torch.compile``.
    kwargs: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def fullgraph(self) -> bool:
        return bool(self.kwargs.get("fullgraph", False))

    @property
    def products(self) -> bool:
        """Whether replays hand back weights' gradients as a matrix product's factors (see
        :func:`replaygrad._replay._products`): compiled ones, but not with torch's debugging
        backends, which run eager's ops so that their results are eager's bit for bit."""
        return self.compiler is not None and self.compiler not in _DEBUG_BACKENDS

    @staticmethod
    def make(compiler: Compiler, options: dict[str, Any], fallback: str | None = None) -> Config:
        plain = (
            not options
            and (compiler is None or type(compiler) is str)
            and fallback in (None, "eager")
        )
        if plain and (compiler, fallback) in _plain_configs:
            return _plain_configs[compiler, fallback]
        check_compiler(compiler)
        if fallback not in (None, "eager"):
            raise ValueError(f"fallback must be None or 'eager', got {fallback!r}")
        if options and not isinstance(compiler, str):
            raise TypeError(
                "compile options are passed to torch.compile, so they need a backend name as "
                f"compiler, got {compiler!r}"
            )
        bad = set(options) & {"backend", "model"}
        if bad:
            raise TypeError(f"compile options may not set {', '.join(sorted(bad))}")
        unknown = set(options) - _TORCH_COMPILE_OPTIONS
        if unknown:
            raise TypeError(
                f"unknown compile option(s) {', '.join(sorted(unknown))}: torch.compile takes "
                f"{', '.join(sorted(_TORCH_COMPILE_OPTIONS))}"
            )
        config = Config(compiler, _frozen(options), fallback, dict(options))
        if plain:
            _plain_configs[compiler, fallback] = config
        return config


#: The configs of a backend name (or None) without options, by compiler and fallback: made
#: once, as `enable()` and `backward()` make one a call.
_plain_configs: dict[tuple[str | None, str | None], Config] = {}


def _frozen(value: Any) -> Any:
    """``value`` as a hashable key: dicts, lists and sets by their contents (``options=``
    of ``torch.compile`` is a dict), other unhashable values by identity (the config keeps
    them alive, so the identity is not reused while the key exists)."""
    if isinstance(value, dict):
        return tuple(sorted(((k, _frozen(v)) for k, v in value.items()), key=repr))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return frozenset(_frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


#: torch.compile's backends that run eager's ops (Dynamo's graph, or AOTAutograd's).
_DEBUG_BACKENDS = frozenset({"eager", "aot_eager"})

#: The keyword options of ``torch.compile`` (beyond ``model`` and ``backend``).
_TORCH_COMPILE_OPTIONS = frozenset(inspect.signature(torch.compile).parameters) - {
    "model",
    "backend",
}


#: Backend names found registered (backends are not unregistered): ``enable()`` may run once
#: per training step, and listing the backends costs more than the rest of it.
_known_backends: set[str] = set()


def check_compiler(compiler: Compiler) -> None:
    """Raises ValueError/TypeError where the user passed an unusable compiler."""
    if compiler is None or callable(compiler):
        return
    if not isinstance(compiler, str):
        raise TypeError(
            "compiler must be a torch.compile backend name, a callable or None, "
            f"got {type(compiler).__name__}"
        )
    if compiler in _known_backends:
        return
    # The first listing imports the backends' modules, whose module-level code calls torch
    # functions: not through the torch function modes of a caller (enable() may be entered
    # inside one), which eager autograd would never show them.
    with torch._C.DisableTorchFunction():
        backends = torch._dynamo.list_backends(exclude_tags=())
    if compiler not in backends:
        raise ValueError(
            f"unknown compiler {compiler!r}; torch.compile backends are: {', '.join(backends)}"
        )
    _known_backends.add(compiler)


def _compile(
    fn: Callable[..., Any], config: Config, views: bool = False, capture: bool = False
) -> Callable[..., Any]:
    """``fn`` compiled with ``config``; ``views``: it traces in-place ops on views (see
    :data:`_INDUCTOR_VIEW_OPTIONS`); ``capture``: see :func:`_capturing`. What the compiler
    raises here (a compiler callable failing, ``torch.compile`` rejecting its options) is
    marked as a compile failure (see :func:`compile_failed`)."""
    compiler = config.compiler
    if compiler is None:
        return fn
    if compiler == "inductor" or not isinstance(compiler, str):
        _mend_inductor_scheduler()
    try:
        if isinstance(compiler, str):
            # torch.compile pops entries (guard_filter_fn) from the options it is given:
            # each region gets its own copy.
            kwargs = {**config.kwargs}
            if isinstance(kwargs.get("options"), dict):
                kwargs["options"] = {**kwargs["options"]}
            if compiler == "inductor":
                kwargs = _inductor_kwargs(kwargs, views)
                backend: Any = compiler
            else:
                backend = _without_module_calls(compiler)
            compiled = torch.compile(fn, backend=backend, **kwargs)
        else:
            compiled = compiler(fn)
            if not callable(compiled):
                raise TypeError(
                    f"the compiler {compiler!r} returned {type(compiled).__name__}, not a callable"
                )
        return _capturing(compiled) if capture else compiled
    except Exception as error:
        error.__replaygrad_compile_failed__ = True  # type: ignore[attr-defined]
        raise


@functools.cache
def _without_module_calls(name: str) -> Callable[..., Any]:
    """The backend named ``name``, its graph modules made eagerly (not lazily): torch's
    debugging backends (``aot_eager``'s nop compiler) keep the ``forward`` of a lazy graph
    module, which calls the module (``nn.Module.__call__``) on every run, so that global
    module hooks (``register_module_forward_pre_hook``, ModuleTracker's and so
    FlopCounterMode's) were called in the backward, on the graph, where eager calls no
    module (a hook rewriting its module's inputs then failed the backward)."""
    backend = torch._dynamo.lookup_backend(name)

    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, **kwargs: Any) -> Any:
        if isinstance(gm, _LazyGraphModule):
            gm.real_recompile()
        with _use_lazy_graph_module(False):
            return backend(gm, example_inputs, **kwargs)

    compile_graph.__name__ = f"{name}_without_module_calls"
    return compile_graph


_mend_lock = threading.Lock()
_mended = False


def _mend_inductor_scheduler() -> None:
    """Mends a bug of torch 2.13's inductor that loses gradients. A scatter writes into a
    zero-filled buffer, and the scheduler renames a later node's read of that buffer to the
    scatter's output, so that the node runs after the scatter. When the CPU backend fuses
    such a node with one of compatible loop ranges (e.g. ``(72,)`` and ``(2, 6, 6)``), it
    recomputes the node's loop body and reads (``SchedulerNode.recompute_size_and_body``)
    and applies the renames again only to a node that also has ordering-only dependencies.
    Otherwise the read depends on the zero fill alone, and the fused kernel can read the
    buffer before the scatter writes it: a sum of several selecting or pooling ops'
    gradients lost a term (also under plain ``torch.compile`` and torch's compiled
    autograd). The method is wrapped to apply the renames to every recomputed node, for the
    whole process: installed at replaygrad's first compile that may use inductor, and only
    where the method has that form (a torch that renames anyway is left as it is)."""
    global _mended
    with _mend_lock:
        if _mended:
            return
        _mended = True
        from torch._inductor.dependencies import StarDep, WeakDep
        from torch._inductor.scheduler import SchedulerNode

        original = SchedulerNode.recompute_size_and_body
        try:
            renames_only_with_fake_deps = "if fake_deps:" in inspect.getsource(original)
        except (OSError, TypeError):
            renames_only_with_fake_deps = False
        if not renames_only_with_fake_deps:
            return

        @functools.wraps(original)
        def recompute_size_and_body(self: Any, *args: Any, **kwargs: Any) -> None:
            renamed = any(isinstance(d, (WeakDep, StarDep)) for d in self.read_writes.reads)
            original(self, *args, **kwargs)
            if not renamed and self.mutation_renames:
                self.set_read_writes(self.read_writes.rename(self.mutation_renames))

        SchedulerNode.recompute_size_and_body = recompute_size_and_body


def _capturing(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, called with Dynamo capturing ops whose output sizes depend on data
    (``capture_dynamic_output_shape_ops``, read when Dynamo compiles, which happens inside
    a call): for replays with a step such as the backward of ``out[mask] += x``, whose
    formula indexes with the mask. Without it Dynamo runs the step outside the graph, a
    graph break on every call. The setting is process-wide: another thread compiling
    during such a call sees it too."""
    config = torch._dynamo.config

    def call(*args: Any) -> Any:
        prior = config.capture_dynamic_output_shape_ops
        config.capture_dynamic_output_shape_ops = True
        try:
            return compiled(*args)
        finally:
            config.capture_dynamic_output_shape_ops = prior

    return call


#: Inductor options a replay is compiled with unless the user's options (or mode) set them.
_INDUCTOR_DEFAULTS = {
    # Inductor asserts every input's sizes and strides on each call, which Dynamo's guards
    # have just checked: a replay has hundreds of inputs (its saved values).
    "size_asserts": False,
    # Random ops (in hooks, custom Functions' backwards) draw from torch's generator as in
    # eager, not from inductor's own: the same values, and the same state after the call.
    "fallback_random": True,
}

#: And for regions that trace a CopySlices step (an in-place op on a view). Its traced form
#: writes a window of a copy of its gradient (``as_strided_scatter``, which inductor turns
#: into an in-place write), and inductor (torch 2.13) miscompiles some such graphs: with its
#: reordering for locality, the double backward of two in-place ops on views lost gradients
#: (as under torch's compiled autograd); with fusion, the CPU backend's outer-loop fusion
#: looked up a read of the written buffer in a node that does not read it and failed
#: (``KeyError``, PyTorch's test_lobpcg: a double backward through ``lobpcg``), and before
#: :func:`_mend_inductor_scheduler` read a ``scatter_add`` buffer before the scatter (the
#: double backward of ``scatter_add_`` on a slice). These regions give up both.
_INDUCTOR_VIEW_OPTIONS = {"reorder_for_locality": False, "max_fusion_size": 1}


def _inductor_kwargs(kwargs: dict[str, Any], views: bool = False) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments for inductor, with :data:`_INDUCTOR_DEFAULTS`
    (and :data:`_INDUCTOR_VIEW_OPTIONS` for ``views``). A ``mode`` is passed as the options
    it stands for (torch.compile takes one or the other); an unknown one, or both, are
    passed on for torch.compile to reject."""
    mode = kwargs.get("mode")
    if mode is not None and "options" in kwargs:
        return kwargs
    options: dict[str, Any] = {}
    if mode is not None:
        try:
            options = torch._inductor.list_mode_options(mode, kwargs.get("dynamic"))
        except RuntimeError:
            return kwargs
    ours = {**_INDUCTOR_DEFAULTS, **(_INDUCTOR_VIEW_OPTIONS if views else {})}
    rest = {k: v for k, v in kwargs.items() if k != "mode"}
    return {**rest, "options": {**ours, **options, **(kwargs.get("options") or {})}}


def compile_failed(error: BaseException) -> bool:
    """Whether ``error`` was raised by the compiler while it compiled a replay's region."""
    return getattr(error, "__replaygrad_compile_failed__", False)


@dataclass
class Entry:
    """A cached replay: the generated function, its compiled form, and what its key was
    made of (to explain later misses)."""

    replay: Replay
    step_digests: bytes
    order: list[str]
    calls: int = 0
    #: Compiling failed and the config's fallback sends this plan to the engine.
    failed: bool = False
    #: Traced steps that run as themselves instead (they handle non-strided tensors).
    opaque: frozenset[int] = frozenset()
    #: Steps whose regions are compiled capturing ops whose output sizes depend on data
    #: (see :func:`_capturing`).
    capture: frozenset[int] = frozenset()
    #: A call has run with it (or uncompiled for it: a first call with hooks that may edit
    #: hooks, or while torch's profiler records; see ``_replay``).
    vetted: bool = False
    #: The input shapes and strides of the last call that compiled graphs for it (see
    #: ``_recompiled_for_hooks``).
    shapes: tuple | None = None


class _Compiled:
    """A compiled region, shared by every cached replay that has a region with its key
    (held by their drivers; dropped with the last of them). ``source`` is the region's
    generated function, which ``fn`` is compiled from: when the region is dropped, what
    Dynamo compiled for it is dropped too (see :func:`_forget_compiled`). Where ``fn`` is
    ``torch.compile`` of ``source``, a call that Dynamo has compiled code for runs that code
    directly (see :class:`_DirectCalls`)."""

    __slots__ = ("__weakref__", "direct", "fn", "scope")

    def __init__(self, fn: Callable[..., Any], source: types.FunctionType) -> None:
        self.fn = fn
        #: The globals of the region's function (see ``_replay.broken_functions``).
        self.scope = source.__globals__
        self.direct = (
            _DirectCalls(source)
            if _cache_entries is not None
            and getattr(fn, "_torchdynamo_orig_callable", None) is source
            else None
        )
        weakref.finalize(self, _forget_compiled, source.__code__, source.__globals__).atexit = False

    def __call__(self, *args: Any) -> Any:
        if self.direct is not None:
            run = self.direct.find(args)
            if run:
                return run(*args)
            if run is False:
                self.direct = None
        return self.fn(*args)


#: Dynamo's compiled variants of a code object (each with its guards), in the order Dynamo
#: tries them; a debugging function of torch's C module (which
#: ``torch._dynamo.eval_frame._debug_get_cache_entry_list`` wraps), hence looked up.
_cache_entries: Callable[[types.CodeType], list[Any]] | None = getattr(
    torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None
)
_eval_frame = torch._dynamo.eval_frame
_profiler = torch.autograd.profiler


class _DirectCalls:
    """Runs Dynamo's compiled code of a region without Dynamo's frame evaluation.

    A call of a ``torch.compile``d function enters Dynamo: its wrapper sets the frame
    evaluation callback, which looks up the code object's compiled variants, checks their
    guards and runs the first whose guards pass. In a backward, after the forward has been
    through the CPU's caches, a region's call took 45-60 µs before its compiled graph
    started, against ~20 µs when called in a loop (2026-12-07). Here the variants' guards
    are checked with Dynamo's own guard managers, in Dynamo's order, and the variant that
    passes runs as a plain function of its transformed code: 10-25 µs less a call (chain of
    100 ops: 252 -> 228-234 µs a backward; MLP: 2.01 -> 1.96-1.97 ms).

    Only where the transformed code does nothing but call the compiled graph (no graph
    break, whose code calls functions whose frames Dynamo would evaluate), for regions
    without Python hooks in their graph (whose effects Dynamo replays after the graph), and
    only where Dynamo would run compiled code as it is (see :func:`_direct_calls_allowed`).
    Anything else, including calls that compile, goes through Dynamo."""

    __slots__ = ("code", "functions", "names", "scope")

    def __init__(self, source: types.FunctionType) -> None:
        self.code = source.__code__
        self.names = self.code.co_varnames[: self.code.co_argcount]
        self.scope = source.__globals__
        #: Each variant's transformed code (by id; the code is kept) and its function, None
        #: where it does more than call its compiled graph.
        self.functions: dict[int, tuple[types.CodeType, types.FunctionType | None]] = {}

    def find(self, args: tuple) -> types.FunctionType | bool | None:
        """The function of the variant Dynamo would run for ``args``; None where this call
        goes through Dynamo, False where every call of the region should (a variant that
        cannot be called directly passed, or the region has Python hooks in its graph)."""
        if _cache_entries is None or not _direct_calls_allowed():
            return None
        frame_locals = dict(zip(self.names, args))
        if frame_locals.get("hooks"):  # the region's argument of Python hooks in its graph
            return False
        try:
            for entry in _cache_entries(self.code):
                if entry.guard_manager.check(frame_locals):
                    code = entry.code
                    known = self.functions.get(id(code))
                    if known is None:
                        known = (code, _direct_function(code, self.scope))
                        self.functions[id(code)] = known
                    return known[1] or False
        except Exception:  # a guard that raises: left to Dynamo's own frame evaluation
            return None
        return None


def _direct_calls_allowed() -> bool:
    """Whether Dynamo would run a region's compiled code as it is: in the default stance
    (not ``force_eager`` and the like), and with torch's profiler off (under it Dynamo
    records each compiled region's call, which profiles show)."""
    return _eval_frame._stance.stance == "default" and not _profiler._is_profiler_enabled


#: The globals Dynamo's transformed code of a region without graph breaks loads: the
#: compiled graph, the module of the helpers that mark its argument handling for the
#: profiler (``record_pregraph_bytecode_enter``), and the mark that a traced Function's
#: backward ran (``_replay._UserCode``, a store Dynamo replays after the graph).
_DIRECT_GLOBALS = ("__compiled_fn_", "__import_torch_dot__dynamo_dot_utils", "_USER_CODE")


class _Unrecorded:
    """Dynamo's utils module as direct calls' code sees it (``__import_torch_dot__dynamo_dot_
    utils``): its profiler marks do nothing, as they do with the profiler off, the only case
    where calls are direct (see :func:`_direct_calls_allowed`), without the cost of their
    ``torch._disable_dynamo`` wrappers (~3 µs a region call, the two of them)."""

    @staticmethod
    def record_pregraph_bytecode_enter() -> None:
        return None

    @staticmethod
    def record_pregraph_bytecode_exit(cm: None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch._dynamo.utils, name)


_UNRECORDED = _Unrecorded()


def _direct_function(code: types.CodeType, scope: dict[str, Any]) -> types.FunctionType | None:
    """Dynamo's transformed ``code`` as a function of the globals of ``scope`` (the region's,
    where Dynamo put its compiled graph) that it loads, if they all are
    :data:`_DIRECT_GLOBALS` (the utils module as :class:`_Unrecorded`): code with a graph
    break calls the region's helpers or a function that resumes it."""
    if code.co_freevars or code.co_cellvars:
        return None
    names = {"__builtins__": scope.get("__builtins__", __builtins__)}
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_NAME", "IMPORT_NAME", "LOAD_DEREF", "LOAD_CLOSURE"):
            return None
        if instruction.opname == "LOAD_GLOBAL":
            name = str(instruction.argval)
            if not name.startswith(_DIRECT_GLOBALS) or name not in scope:
                return None
            if name == _DIRECT_GLOBALS[1]:
                names[name] = _UNRECORDED
            elif name == _DIRECT_GLOBALS[2]:
                names[name] = scope[name]
            else:
                # The compiled graph without its torch._dynamo.disable wrapper.
                names[name] = without_dynamo_wrapper(scope[name])
    return types.FunctionType(code, names)


def _forget_compiled(code: types.CodeType, scope: dict[str, Any]) -> None:
    """Drops what Dynamo compiled for a dropped region's ``code``, and for the functions it
    made to resume that code after graph breaks (``__resume_at_*``, put in the region's
    ``scope``) and the region's copies of ``function_backward`` (``backward_*``, see
    ``_replay._function_backward_copy``). Dynamo keeps its compiled code, guards and traced
    graphs on the code object, and torch 2.13 keeps every code object it guarded on for the
    process's lifetime (a ``functools.cache`` in ``torch._dynamo.guards``), so without this
    each region compiled and evicted would keep ~1 MB."""
    codes = [code]
    codes += [
        value.__code__
        for name, value in list(scope.items())
        if name.startswith(("__resume_at_", "backward_")) and hasattr(value, "__code__")
    ]
    for c in codes:
        torch._dynamo.reset_code(c)


class CacheInfo(NamedTuple):
    hits: int
    misses: int
    size: int
    maxsize: int


@dataclass
class ReplayCache:
    """Compiled replays by (config, plan key), least recently used evicted first.

    Entries hold no tensors and no graph nodes: a replay takes all of them as arguments.
    Lookups are thread-safe; two threads missing on the same key may both compile it.
    """

    maxsize: int = 256
    #: Steps per compiled region (see :func:`replaygrad._replay.regions`); None: one region.
    region_size: int | None = field(default_factory=lambda: _region_size_from_env())
    hits: int = 0
    misses: int = 0
    _entries: OrderedDict[tuple[Config, str], Entry] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _regions: weakref.WeakValueDictionary[tuple[Config, str, bool], _Compiled] = field(
        default_factory=weakref.WeakValueDictionary
    )
    #: Keys of the replays compiled per (config, plan shape) (see :func:`plan_shape`), for
    #: the shapes seen last (four times as many as entries).
    _variants: OrderedDict[tuple[Config, bytes], set[str]] = field(default_factory=OrderedDict)
    #: Plans whose replay failed to compile capturing data-dependent sizes (see
    #: :meth:`capture_data_dependent`): theirs keep running such steps outside the graph.
    _capture_failed: set[tuple[Config, str]] = field(default_factory=set)

    def get(self, plan: _core.Plan, config: Config) -> Entry | None:
        """The cached replay of ``plan``, compiled if it is new; None when the plan's shape
        has had :func:`recompile_limit` replays compiled already (see :func:`plan_shape`):
        the engine then runs the call."""
        key = (config, plan.key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                cache_log.debug("hit %s (%d steps)", plan.key, plan.num_steps)
                return entry
            latest = next((e for (c, _), e in reversed(self._entries.items()) if c == config), None)
            variants = None
            if config.compiler is not None:
                shape = (config, plan_shape(plan))
                variants = self._variants.setdefault(shape, set())
                self._variants.move_to_end(shape)
                if len(self._variants) > 4 * self.maxsize:
                    self._variants.popitem(last=False)
                if plan.key not in variants and len(variants) >= recompile_limit():
                    return None
        if latest is not None and recompiles_log.isEnabledFor(10):
            recompiles_log.debug(
                "new replay for key %s: %s",
                plan.key,
                Lazy(lambda: key_difference(plan, latest.step_digests, latest.order)),
            )
        # Uncompiled, hooks run as plain calls that see the effects before them.
        # Under fullgraph=True no hook can leave the graph.
        replay = self._build(
            plan, config, config.compiler is not None, frozenset(), not config.fullgraph
        )
        entry = Entry(
            replay=replay,
            step_digests=plan.step_digests(),
            order=plan.order(),
        )
        with self._lock:
            self.misses += 1
            self._entries[key] = entry
            if variants is not None:
                variants.add(plan.key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)
        cache_log.debug("miss %s (%d steps): compiled a new replay", plan.key, plan.num_steps)
        return entry

    def uncompiled(self, plan: _core.Plan, config: Config) -> Entry:
        """An uncompiled replay of ``plan`` for one call, not cached (``config``: the
        replaygrad config it stands in for)."""
        replay = self._build(plan, Config(None, fallback=config.fallback), False, frozenset(), True)
        return Entry(replay=replay, step_digests=b"", order=[])

    def move_hooks_outside(
        self, entry: Entry, plan: _core.Plan, config: Config, reason: str
    ) -> None:
        """Rebuilds ``entry`` with its Python hooks called through graph breaks, and its
        Python Functions' backwards run as themselves.

        Dynamo guards on the Python state a traced hook or backward reads (e.g. the length
        of a list it appends to), so such code makes every call recompile until Dynamo's
        recompile limit, after which it stops compiling. Run outside the graph, it runs as
        plain Python between compiled regions, with nothing to guard on. Code the compiler
        fails on runs there too.
        """
        recompiles_log.info(
            "replay %s: %s; running its Python hooks and Functions' backwards outside the "
            "compiled graph from now on",
            plan.key,
            reason,
        )
        self._rebuild(entry, plan, config, hooks_in_graph=False)

    def run_as_themselves(
        self,
        entry: Entry,
        plan: _core.Plan,
        config: Config,
        steps: set[int],
        why: str = "compiling it failed on steps with non-strided (e.g. sparse) tensors or "
        "that raised while traced",
    ) -> None:
        """Rebuilds ``entry`` with ``steps`` (traced ones: by default those the compiler failed
        on, which met sparse or other non-strided tensors, or raised on the values being
        traced) run as themselves, between compiled regions."""
        recompiles_log.info(
            "replay %s: %s; running steps %s as themselves", plan.key, why, sorted(steps)
        )
        entry.opaque |= steps
        self._rebuild(entry, plan, config)

    def capture_data_dependent(
        self, entry: Entry, plan: _core.Plan, config: Config, steps: set[int]
    ) -> None:
        """Rebuilds ``entry`` with the regions of ``steps`` compiled capturing ops whose
        output sizes depend on data: those steps' formulas use one (e.g. the backward of
        indexing with a boolean mask), which Dynamo otherwise runs outside the graph, on
        every call."""
        if (config, plan.key) in self._capture_failed:
            return
        recompiles_log.info(
            "replay %s: the output sizes of an op in steps %s depend on data (e.g. indexing "
            "with a boolean mask); compiling their regions again with "
            "torch._dynamo.config.capture_dynamic_output_shape_ops",
            plan.key,
            sorted(steps),
        )
        entry.capture |= steps
        self._rebuild(entry, plan, config)

    def stop_capturing(self, entry: Entry, plan: _core.Plan, config: Config) -> None:
        """Rebuilds ``entry`` as before :meth:`capture_data_dependent`, for good: compiling
        it that way failed."""
        recompiles_log.info(
            "compiling replay %s capturing data-dependent sizes failed; its steps with such "
            "sizes run outside the graph again",
            plan.key,
        )
        with self._lock:
            self._capture_failed.add((config, plan.key))
        entry.capture = frozenset()
        self._rebuild(entry, plan, config)

    def keep_hooks_in_graph(self, entry: Entry, plan: _core.Plan, config: Config) -> None:
        """Rebuilds ``entry`` with its traced hooks kept in the graph whatever their
        gradients: compiling failed where a hook would leave it (a compiler that allows no
        graph break, e.g. ``torch.compile(..., fullgraph=True)`` passed as a callable)."""
        recompiles_log.info(
            "compiling replay %s failed with hooks leaving the graph; keeping them in it",
            plan.key,
        )
        self._rebuild(entry, plan, config, hooks_in_graph=True, escapes=False)

    def run_outside_between_regions(self, entry: Entry, plan: _core.Plan, config: Config) -> None:
        """Rebuilds ``entry`` with what runs outside the graph between compiled regions (see
        :func:`replaygrad._replay.regions`, ``breakless``): compiling it failed where the
        graph would break (a compiler callable that allows no graph break)."""
        recompiles_log.info(
            "compiling replay %s failed with graph breaks; running what is outside the graph "
            "between compiled regions",
            plan.key,
        )
        self._rebuild(entry, plan, config, breakless=True)

    def _rebuild(
        self,
        entry: Entry,
        plan: _core.Plan,
        config: Config,
        hooks_in_graph: bool | None = None,
        escapes: bool | None = None,
        breakless: bool | None = None,
    ) -> None:
        """Builds ``entry``'s replay again for its steps run as themselves and its regions
        that capture data-dependent sizes, with its hooks where they were and its regions
        cut as they were unless ``hooks_in_graph`` / ``escapes`` / ``breakless`` say
        otherwise."""
        replay = entry.replay
        entry.replay = self._build(
            plan,
            config,
            replay.hooks_in_graph if hooks_in_graph is None else hooks_in_graph,
            entry.opaque,
            replay.escapes if escapes is None else escapes,
            entry.capture,
            replay.breakless if breakless is None else breakless,
        )

    def _build(
        self,
        plan: _core.Plan,
        config: Config,
        hooks_in_graph: bool,
        opaque: frozenset[int],
        escapes: bool,
        capture: frozenset[int] = frozenset(),
        breakless: bool = False,
    ) -> Replay:
        """The replay of ``plan``, its regions compiled with ``config`` (or taken from other
        cached replays that have them); the regions of steps in ``capture``: see
        :func:`_capturing`; ``breakless``: see :func:`replaygrad._replay.regions` (always
        under ``fullgraph=True``)."""

        def compile_region(
            region: Region, make: Callable[[], types.FunctionType]
        ) -> Callable[..., Any]:
            captures = any(region.start <= s < region.end for s in capture)
            key = (config, region.key, captures)
            with self._lock:
                compiled = self._regions.get(key)
            if compiled is None:
                fn = make()
                compiled = _Compiled(_compile(fn, config, region.in_place_on_views, captures), fn)
                with self._lock:
                    self._regions[key] = compiled
            return compiled

        size = self.region_size
        saved, scalars = replay_inputs(plan) if config.compiler is not None else ((), frozenset())
        replay = build(
            plan,
            compile_region,
            hooks_in_graph,
            opaque,
            size,
            saved,
            escapes,
            uncompiled=config.compiler is None,
            breakless=config.compiler is not None and (breakless or config.fullgraph),
            products=config.products,
            scalars=scalars,
        )
        source_log.debug("replay %s:\n%s", plan.key, replay.source)
        return replay

    def set_region_size(self, steps: int | None) -> None:
        if steps is not None:
            _check_positive_int(steps, "region size", " or None")
        self.region_size = steps

    def discard(self, config: Config, key: str) -> None:
        with self._lock:
            self._entries.pop((config, key), None)

    def info(self) -> CacheInfo:
        return CacheInfo(self.hits, self.misses, len(self._entries), self.maxsize)

    def resize(self, maxsize: int) -> None:
        _check_positive_int(maxsize, "cache size")
        with self._lock:
            self.maxsize = maxsize
            while len(self._entries) > maxsize:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._regions.clear()
            self._variants.clear()
            self._capture_failed.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


def _check_positive_int(value: Any, what: str, alternative: str = "") -> None:
    """TypeError for a value that is no int, ValueError for one below 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{what} must be a positive int{alternative}, got {value!r}")
    if value < 1:
        raise ValueError(f"{what} must be a positive int{alternative}, got {value!r}")


def plan_shape(plan: _core.Plan) -> bytes:
    """What a plan's key is made of but the steps' specialisations (the non-tensor state
    their nodes report, e.g. a ``clamp`` bound, and the sizes kept in the key): plans of one
    shape differ only in values a compiled replay is specialised on, such as a scalar a
    training loop anneals. A digest of them."""
    digests = plan.step_digests()
    shape = hashlib.blake2b(digest_size=16)
    for i in range(0, len(digests), 24):
        shape.update(digests[i : i + 16])
    return shape.digest()


def recompile_limit() -> int:
    """How many replays of one plan shape are compiled: Dynamo's recompile limit (8 by
    default), after which it also leaves a function to run uncompiled."""
    return int(torch._dynamo.config.recompile_limit)


def _region_size_from_env() -> int | None:
    value = os.environ.get("REPLAYGRAD_REGION_SIZE", "").strip().lower()
    if not value:
        return 300
    if value == "none":
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"REPLAYGRAD_REGION_SIZE must be a positive int or 'none', got {value!r}")
    return int(value)


cache = ReplayCache()
