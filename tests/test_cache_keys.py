"""Cache keys (issue 7): the key distinguishes every difference a compiled replay specialises
on, and nothing else.

Each test builds graphs that differ in one aspect, compares ``replaygrad.plan(...).key`` and
runs them through a compiled replay (``aot_eager``), checking the gradients against eager and
what the cache did. test_cache.py holds the first cases (a training loop compiles once, Python
scalars of tensor ops are replay inputs).
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import replaygrad
from replaygrad import _compile, _engine

from conftest import Doubling

COMPILER = "aot_eager"


def key(tensors, inputs=None) -> str:
    return replaygrad.plan(tensors, inputs).key


def eager_grads(make_loss, leaves, inputs=None, **kwargs) -> list[torch.Tensor | None]:
    """Gradients eager autograd accumulates into fresh copies of `leaves` (`inputs`: indices
    into `leaves`)."""
    copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
    if inputs is not None:
        kwargs["inputs"] = [copies[i] for i in inputs]
    torch.autograd.backward(make_loss(*copies), **kwargs)
    return [c.grad for c in copies]


def replay_grads(make_loss, leaves, inputs=None, **kwargs) -> list[torch.Tensor | None]:
    for t in leaves:
        t.grad = None
    if inputs is not None:
        kwargs["inputs"] = [leaves[i] for i in inputs]
    replaygrad.backward(make_loss(*leaves), compiler=COMPILER, **kwargs)
    return [t.grad for t in leaves]


def assert_like_eager(make_loss, leaves, **kwargs) -> None:
    expected = eager_grads(make_loss, leaves, **kwargs)
    got = replay_grads(make_loss, leaves, **kwargs)
    for e, g in zip(expected, got):
        if e is None:
            assert g is None
        else:
            torch.testing.assert_close(g, e)


def lookups() -> tuple[int, int]:
    info = replaygrad.cache_info()
    return info.misses, info.hits


# ---- Python scalars an op keeps in its node --------------------------------------------------

# A scalar compiled_args reports is a specialisation (part of the key: addcmul's value, the
# issue's example); a scalar saved as a wrapped-number tensor is a replay input (same key:
# test_cache.py). The others are pinned to neither, but the cache must follow the key, and every
# call must get its own gradient under the cached replay. (Today all of them but mul, div and
# rsub are keys.)
SCALAR_OPS = {
    "addcmul_value": (lambda w, k: torch.addcmul(w, w, w.exp(), value=k), "key"),
    "mul_scalar": (lambda w, k: w.exp() * k, "input"),
    "pow_exponent": (lambda w, k: w.pow(k), None),
    "add_alpha": (lambda w, k: torch.add(w.exp(), w.sin(), alpha=k), None),
    "clamp_min": (lambda w, k: w.exp().clamp(min=k), None),
    "leaky_relu_slope": (lambda w, k: F.leaky_relu(w, negative_slope=k), None),
    "softplus_beta": (lambda w, k: F.softplus(w, beta=k), None),
    "lerp_weight": (lambda w, k: torch.lerp(w, w.exp(), k), None),
    "div_scalar": (lambda w, k: w.exp() / k, None),
    "rsub_scalar": (lambda w, k: k - w.exp() * w, None),
}


@pytest.mark.parametrize("name", SCALAR_OPS)
def test_scalar_of_an_op(name):
    op, role = SCALAR_OPS[name]
    w = torch.linspace(0.1, 2.0, 6, requires_grad=True)
    k1, k2 = key(op(w, 1.0).sum()), key(op(w, 2.0).sum())
    if role is not None:
        assert (k1 != k2) == (role == "key")
    assert key(op(w, 1.0).sum()) == k1, "the same scalar gives the same key"
    for k in (1.0, 2.0, 1.0, 2.0):
        assert_like_eager(lambda w, k=k: op(w, k).sum(), [w])
    entries = 2 if k1 != k2 else 1
    assert lookups() == (entries, 4 - entries)


def test_a_scalar_changed_every_call_compiles_up_to_dynamos_recompile_limit(monkeypatch, caplog):
    # clamp's bounds are node state, part of the key: a loop that changes them on every call
    # (e.g. an annealed clip range) would compile a new replay on every call. Past Dynamo's
    # recompile limit for one graph shape, new variants run in the engine, with a warning;
    # the variants compiled before still replay.
    monkeypatch.setattr(_engine, "_eager_reasons_logged", set())
    w = torch.linspace(-1, 1, 6, requires_grad=True)
    with torch._dynamo.config.patch(recompile_limit=3), caplog.at_level(logging.WARNING):
        for i in range(6):
            bound = 0.2 + 0.1 * i
            assert_like_eager(lambda w, b=bound: (w * 2).clamp(-b, b).sum(), [w])
        assert lookups() == (3, 0)
        assert_like_eager(lambda w: (w * 2).clamp(-0.2, 0.2).sum(), [w])
        assert lookups() == (3, 1)
        # Another shape has a limit of its own.
        assert_like_eager(lambda w: (w * 2).clamp(-0.9, 0.9).exp().sum(), [w])
        assert lookups() == (4, 1)
    warnings = [r for r in caplog.records if "recompile_limit" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


# ---- custom Functions --------------------------------------------------------------------


def scale_function(name: str, factor: float, traceable: bool) -> type[torch.autograd.Function]:
    """A custom Function class named `name`; classes made by this have the same structure."""

    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * factor

    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * factor + 0 * x

    namespace = {
        "is_traceable": traceable,
        "forward": staticmethod(forward),
        "backward": staticmethod(backward),
    }
    return type(name, (torch.autograd.Function,), namespace)


@pytest.mark.parametrize("traceable", [True, False])
def test_custom_functions_of_different_classes_have_different_keys(traceable):
    # Same name, same structure, different backward: a compiled replay bakes in the class's
    # backward (traced by the compiler, or by Dynamo where the class does not say it is
    # traceable), so the class is part of the key.
    first = scale_function("Scale", 2.0, traceable=traceable)
    second = scale_function("Scale", 3.0, traceable=traceable)
    w = torch.randn(4, requires_grad=True)
    assert first.apply(w).grad_fn.name() == second.apply(w).grad_fn.name()
    assert replaygrad.plan(first.apply(w).sum()).opaque == []
    assert key(first.apply(w.exp()).sum()) != key(second.apply(w.exp()).sum())
    for fn in (first, second, first, second):
        assert_like_eager(lambda w, fn=fn: fn.apply(w.exp()).sum(), [w])
    assert lookups() == (2, 2)


def test_custom_functions_of_different_names_have_different_keys():
    w = torch.randn(4, requires_grad=True)
    for traceable in (True, False):
        a = scale_function("Double", 2.0, traceable)
        b = scale_function("Twice", 2.0, traceable)
        assert key(a.apply(w.exp()).sum()) != key(b.apply(w.exp()).sum())


class CtxScale(torch.autograd.Function):
    """A traceable Function whose backward reads non-tensor state from ctx."""

    is_traceable = True

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x * scale

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def test_custom_function_ctx_state_is_key_or_input():
    w = torch.randn(4, requires_grad=True)
    for scale in (2.0, 3.0):
        assert_like_eager(lambda w, s=scale: CtxScale.apply(w.exp(), s).sum(), [w])


# ---- hooks -------------------------------------------------------------------------------


def hooked_loss(kind: str | None, hook_fn=None, remove: bool = False):
    """(w, loss) with `hook_fn` registered on the graph as `kind` (None: no hook)."""
    w = hooked_loss.w
    h = w.exp()
    handle = None
    if kind == "tensor":
        handle = h.register_hook(hook_fn or (lambda g: g * 3))
    elif kind == "pre":
        handle = h.grad_fn.register_prehook(hook_fn or (lambda gs: (gs[0] * 3,)))
    elif kind == "post":
        handle = h.grad_fn.register_hook(hook_fn or (lambda gi, go: (gi[0] * 3,)))
    elif kind == "post_accumulate":
        handle = w.register_post_accumulate_grad_hook(hook_fn or (lambda p: None))
    loss = (h * w).sum()
    if remove and handle is not None:
        handle.remove()
    return loss, handle


HOOK_KINDS = ["tensor", "pre", "post", "post_accumulate"]


@pytest.fixture
def hook_leaf():
    hooked_loss.w = torch.randn(4, requires_grad=True)
    yield hooked_loss.w
    del hooked_loss.w


@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_hook_added_changes_the_key_and_runs(kind, hook_leaf):
    w = hook_leaf
    plain = key(hooked_loss(None)[0])
    loss, handle = hooked_loss(kind)
    assert key(loss) != plain
    handle.remove()

    def expected(scale: float):
        # d/dw sum(exp(w) * w) = exp(w) + exp(w) * w, the second term through ExpBackward0
        return w.detach().exp() * (1 + scale * w.detach())

    for _ in range(2):  # miss, then hit
        w.grad = None
        replaygrad.backward(hooked_loss(None)[0], compiler=COMPILER)
        torch.testing.assert_close(w.grad, expected(1.0))
        ran: list[torch.Tensor] = []
        w.grad = None
        loss, handle = hooked_loss(kind)
        if kind == "post_accumulate":
            handle.remove()
            handle = w.register_post_accumulate_grad_hook(
                lambda p, ran=ran: ran.append(p.grad.clone())
            )
        replaygrad.backward(loss, compiler=COMPILER)
        handle.remove()
        if kind == "post_accumulate":
            assert len(ran) == 1 and torch.equal(ran[0], w.grad)
            torch.testing.assert_close(w.grad, expected(1.0))
        else:
            torch.testing.assert_close(w.grad, expected(3.0))


@pytest.mark.parametrize("kind", ["tensor", "pre", "post"])
def test_a_different_hook_at_the_same_place_shares_the_key(kind, hook_leaf):
    # Hooks are replay inputs: another function in the same place is the same replay, and each
    # call runs its own hook.
    w = hook_leaf
    scales = (2.0, 5.0, 2.0)
    hooks = {
        "tensor": [lambda g, s=s: g * s for s in scales],
        "pre": [lambda gs, s=s: (gs[0] * s,) for s in scales],
        "post": [lambda gi, go, s=s: (gi[0] * s,) for s in scales],
    }[kind]
    keys = {key(hooked_loss(kind, fn)[0]) for fn in hooks}
    assert len(keys) == 1
    for scale, fn in zip(scales, hooks):
        w.grad = None
        loss, _ = hooked_loss(kind, fn)
        replaygrad.backward(loss, compiler=COMPILER)
        torch.testing.assert_close(w.grad, w.detach().exp() * (1 + scale * w.detach()))
    assert lookups() == (1, 2)


@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_removed_hook_does_not_run(kind, hook_leaf):
    w = hook_leaf
    ran = []

    def hook(*args):
        ran.append(kind)

    loss, _ = hooked_loss(kind, hook, remove=True)
    w.grad = None
    replaygrad.backward(loss, compiler=COMPILER)
    assert ran == []
    torch.testing.assert_close(w.grad, w.detach().exp() * (w.detach() + 1))


@pytest.mark.parametrize("kind", HOOK_KINDS)
def test_removed_hook_gives_the_key_of_no_hook(kind, hook_leaf):
    plain = key(hooked_loss(None)[0])
    loss, _ = hooked_loss(kind, remove=True)
    assert key(loss) == plain


def test_retain_grad_changes_the_key_and_is_applied():
    w = torch.randn(4, requires_grad=True)

    def make(retain: bool):
        h = w.exp()
        if retain:
            h.retain_grad()
        return h, (h * w).sum()

    assert key(make(True)[1]) != key(make(False)[1])
    for retain in (True, False, True, False):
        h, loss = make(retain)
        w.grad = None
        replaygrad.backward(loss, compiler=COMPILER)
        torch.testing.assert_close(w.grad, w.detach().exp() * (w.detach() + 1))
        if retain:
            torch.testing.assert_close(h.grad, w.detach())
        else:
            assert not h.retains_grad
    assert lookups() == (2, 2)


# ---- the graph's shape, ops and types -------------------------------------------------------


def test_sum_and_mean_have_different_keys():
    w = torch.randn(5, requires_grad=True)
    assert key(w.exp().sum()) != key(w.exp().mean())
    for reduce in (torch.sum, torch.mean, torch.sum):
        assert_like_eager(lambda w, r=reduce: r(w.exp() * w), [w])
    assert lookups() == (2, 1)


def test_dtype_change_has_a_different_key():
    w32 = torch.randn(5, requires_grad=True)
    w64 = w32.detach().double().requires_grad_()
    assert key((w32.exp() * w32).sum()) != key((w64.exp() * w64).sum())
    for w in (w32, w64, w32):
        assert_like_eager(lambda w: (w.exp() * w).sum(), [w])
        assert w.grad.dtype == w.dtype
    assert lookups() == (2, 1)


def test_shape_change_has_a_different_key():
    a, b = torch.randn(5, requires_grad=True), torch.randn(2, 3, requires_grad=True)
    assert key(a.exp().sum()) != key(b.exp().sum())
    for w in (a, b, a):
        assert_like_eager(lambda w: (w.exp() * w).sum(), [w])
    assert lookups() == (2, 1)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


BATCH_SIZES = (8, 16, 32, 64)


def _mlp_over_batches(batches, **options) -> None:
    """Backward of one MLP over batches of the given sizes, each equal to eager's."""
    model = mlp()
    params = list(model.parameters())
    for batch in batches:
        x = torch.randn(batch, 8)
        expected = torch.autograd.grad(model(x).square().mean(), params)
        for p in params:
            p.grad = None
        replaygrad.backward(model(x).square().mean(), compiler=COMPILER, **options)
        for p, e in zip(params, expected):
            assert torch.equal(p.grad, e)


def test_batch_size_changes_compile_at_most_twice():
    """Sizes the nodes keep (AddmmBackward0's, MeanBackward0's) and the shapes gradients are
    validated against are replay inputs, not part of the key: one replay, which the compiler
    traces again once with dynamic sizes, serves every batch size."""
    counters.clear()
    _mlp_over_batches((*BATCH_SIZES, 8, 5))
    assert lookups() == (1, len(BATCH_SIZES) + 1)
    assert unique_graphs() <= 2, f"{unique_graphs()} Dynamo graphs for batch sizes {BATCH_SIZES}"


def test_batch_size_changes_with_a_traced_hook_compile_at_most_twice(caplog):
    """A Python hook traced into the graph stays there when the batch size changes: the
    recompile is for the new shapes (after which sizes are dynamic), not for state the hook
    touches. (It was taken for the hook's: the hooks moved out of the graph, and the rebuilt
    replay compiled twice more.)"""
    counters.clear()
    model = mlp()
    params = list(model.parameters())
    with caplog.at_level(logging.INFO, logger="replaygrad"):
        for batch in (*BATCH_SIZES, 8, 5):
            x = torch.randn(batch, 8)
            expected = torch.autograd.grad(model(x).square().mean(), params)
            h = model[0](x)
            h.register_hook(lambda g: g * 2)
            loss = model[2](model[1](h)).square().mean()
            for p in params:
                p.grad = None
            replaygrad.backward(loss, compiler=COMPILER)
            for p, e in zip(params[:2], expected[:2]):
                torch.testing.assert_close(p.grad, e * 2)
    assert lookups() == (1, len(BATCH_SIZES) + 1)
    assert unique_graphs() <= 2, f"{unique_graphs()} Dynamo graphs for batch sizes {BATCH_SIZES}"
    assert "outside the compiled graph" not in caplog.text


def test_stride_change_with_a_traced_hook_keeps_it_in_the_graph(caplog):
    """Likewise for a saved input whose strides change (a transposed batch): Dynamo
    recompiles for them, not for the hook."""
    model = mlp()
    with caplog.at_level(logging.INFO, logger="replaygrad"):
        for transposed in (False, False, True, True, False):
            x = torch.randn(8, 4).t() if transposed else torch.randn(4, 8)
            h = model[0](x)
            h.register_hook(lambda g: g * 2)
            replaygrad.backward(model[2](model[1](h)).sum(), compiler=COMPILER)
    assert "outside the compiled graph" not in caplog.text


def _shape_program(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Nodes that keep sizes (view, expand, sum over dims, mean, softmax, layer_norm, cat,
    index), broadcasting that validate_outputs reduces, in-place ops on views (CopySlices
    wrapping a generated node, and an indexed assignment's copy_) and a custom Function."""
    batch, seq, _ = x.shape
    h = torch.nn.functional.layer_norm(x @ w + b, (w.shape[1],))
    h = h.softmax(-1) * b.view(1, 1, -1)  # broadcast: reduced to b's shape
    h = torch.cat([h, h[:, :1].expand(batch, 1, -1)], dim=1).reshape(batch, -1)
    h = Doubling.apply(h)
    h = h.clone()
    h[:, 0] *= 3
    h[:, 1:3].mul_(h[:, 3:5].sigmoid())
    return h.sum(1).mean() + h[:, :seq].tanh().mean(0).sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_changing_shapes_match_eager_with_one_replay_per_structure(compiler):
    w = torch.randn(6, 5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    replays = 0
    for batch, seq in ((2, 3), (4, 3), (3, 7), (5, 1), (2, 3), (6, 4)):
        x = torch.randn(batch, seq, 6, requires_grad=True)
        expected = torch.autograd.grad(_shape_program(x, w, b), (x, w, b))
        x.grad = w.grad = b.grad = None
        misses = replaygrad.cache_info().misses
        replaygrad.backward(_shape_program(x, w, b), compiler=compiler)
        replays += replaygrad.cache_info().misses - misses
        for got, e in zip((x.grad, w.grad, b.grad), expected):
            torch.testing.assert_close(got, e)
    # One replay, and one for seq = 1 (a different graph: its slice is a no-op).
    assert replays == 2


def _in_place_on_views(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """In-place ops on views of several kinds (each a CopySlices, whose base and view
    geometry are sizes, strides and offsets) and copies into a buffer (CopyBackwards)."""
    h = (x * w).clone()
    h[:, :2] *= 3
    h[:, 1] = x[:, 0].sin() * w[1]
    h.t()[2:4].mul_(x.t()[:2].exp())
    h[1:][:, 2:].sigmoid_()
    buffer = torch.zeros(x.shape[0] + 2, x.shape[1], dtype=torch.float64)
    buffer[1:-1].copy_(h)
    return (buffer.float().tanh()[1:-1] * x.sum(1, keepdim=True)).sum() + buffer.sum()


@pytest.mark.parametrize("create_graph", [False, True])
def test_in_place_ops_on_views_take_changing_shapes_as_inputs(create_graph):
    """CopySlices and CopyBackwards sizes are replay inputs like those of generated nodes:
    one replay, traced again once with dynamic sizes, serves every shape."""
    w = torch.randn(12, requires_grad=True)

    def loss(x, w):
        if not create_graph:
            return _in_place_on_views(x, w)
        gx, gw = torch.autograd.grad(_in_place_on_views(x, w), (x, w), create_graph=True)
        return gx.square().sum() + gw.pow(3).sum()

    counters.clear()
    for batch in (3, 5, 4, 7, 3, 6):
        assert_like_eager(loss, [torch.randn(batch, 12, requires_grad=True), w])
    assert lookups() == (1, 5)
    assert unique_graphs() <= 2, f"{unique_graphs()} Dynamo graphs"


def _masked_update(x: torch.Tensor, w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """MoE-style routing: only the rows a boolean mask selects are updated (the backward of
    ``out[mask] += ...`` indexes with the mask: its sizes depend on the mask's data)."""
    h = x @ w
    out = torch.zeros_like(h)
    out[mask] += h[mask].tanh()
    return out.square().sum()


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_mask_selecting_another_count_each_call_compiles_one_replay(compiler):
    """The first call runs the masked step outside the graph (Dynamo cannot size its
    output); the replay is then compiled again capturing such ops, once more with dynamic
    sizes when the count changes, and serves every count from then on, with no graph
    break."""
    w = torch.randn(4, 4, requires_grad=True)
    counters.clear()
    graphs = []
    for count in (2, 5, 3, 7, 6, 4):
        x = torch.randn(8, 4)
        mask = torch.zeros(8, dtype=torch.bool)
        mask[torch.randperm(8)[:count]] = True
        expected = torch.autograd.grad(_masked_update(x, w, mask), w)[0]
        w.grad = None
        replaygrad.backward(_masked_update(x, w, mask), compiler=compiler)
        torch.testing.assert_close(w.grad, expected)
        graphs.append((unique_graphs(), sum(counters["graph_break"].values())))
    assert lookups() == (1, 5)
    assert graphs[2:] == [graphs[2]] * 4, f"Dynamo graphs and graph breaks per call: {graphs}"
    assert graphs[2][1] == graphs[0][1], "graph breaks after the first call"


def test_a_replay_that_fails_to_compile_capturing_data_dependent_sizes_breaks_the_graph():
    """If the compiler fails on a replay compiled to capture ``aten.nonzero``, the replay
    runs such steps outside the graph again, from that call on."""
    failures = []

    def backend(gm, example_inputs):
        if torch._dynamo.config.capture_dynamic_output_shape_ops:
            failures.append(gm)
            raise RuntimeError("this backend takes no data-dependent sizes")
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def compiler(fn):
        return torch.compile(fn, backend=backend)

    w = torch.randn(4, 4, requires_grad=True)
    counters.clear()
    for count in (2, 5, 3, 6):
        x = torch.randn(8, 4)
        mask = torch.zeros(8, dtype=torch.bool)
        mask[:count] = True
        expected = torch.autograd.grad(_masked_update(x, w, mask), w)[0]
        w.grad = None
        replaygrad.backward(_masked_update(x, w, mask), compiler=compiler)
        torch.testing.assert_close(w.grad, expected)
    assert len(failures) == 1
    assert lookups() == (1, 3)


class BranchOnMaskCount(torch.autograd.Function):
    """A traceable Function whose backward branches on how many elements a mask selects:
    a size only known at run time once Dynamo captures ``nonzero``."""

    is_traceable = True

    @staticmethod
    def forward(ctx, x, mask):
        ctx.save_for_backward(mask)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        selected = mask.nonzero()
        scale = 3.0 if selected.shape[0] > 3 else 2.0
        return grad * scale, None


def _branching_loss(w: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    h = BranchOnMaskCount.apply(w, mask).view(2, 4)
    return _masked_update(h, torch.eye(4), mask[:2])


def test_a_backward_branching_on_a_data_dependent_size_runs_outside_the_graph():
    """Once its region captures data-dependent ops, such a step makes Dynamo fail on the
    branch: it then runs outside the graph (and a count of 1, a new graph, compiles a new
    replay whose steps are traced in a resume function after a graph break)."""
    w = torch.randn(8, requires_grad=True)
    for count in (2, 5, 3, 6, 1, 7):
        mask = torch.zeros(8, dtype=torch.bool)
        mask[:count] = True
        assert_like_eager(functools.partial(_branching_loss, mask=mask), [w])


def test_dynamic_false_specialises_every_shape():
    counters.clear()
    _mlp_over_batches((*BATCH_SIZES, 8), dynamic=False)
    assert lookups() == (1, len(BATCH_SIZES))
    assert unique_graphs() == len(BATCH_SIZES)


def test_new_parameters_of_the_same_structure_hit():
    compiles = []

    def compiler(fn):
        compiles.append(fn)
        return torch.compile(fn, backend=COMPILER)

    keys = set()
    for _ in range(3):
        model = mlp()  # new parameters, new input values
        x = torch.randn(4, 8)
        params = list(model.parameters())
        loss = model(x).square().mean()
        keys.add(key(loss))
        expected = torch.autograd.grad(loss, params, retain_graph=True)
        replaygrad.backward(loss, compiler=compiler)
        for p, e in zip(params, expected):
            torch.testing.assert_close(p.grad, e)
    assert len(keys) == 1 and len(compiles) == 1
    assert lookups() == (1, 2)


def test_grad_tensors_values_are_inputs():
    w = torch.randn(4, requires_grad=True)
    assert key(w.exp() * w) == key(w.exp() * w)
    for scale in (1.0, 3.0, -2.0):
        g = torch.full((4,), scale)
        assert_like_eager(lambda w: w.exp() * w, [w], grad_tensors=g)
    assert lookups() == (1, 2)


def test_retain_graph_is_not_part_of_the_key():
    w = torch.randn(4, requires_grad=True)
    loss = (w.exp() * w).sum()
    expected = w.detach().exp() * (w.detach() + 1)
    replaygrad.backward(loss, retain_graph=True, compiler=COMPILER)
    replaygrad.backward(loss, compiler=COMPILER)  # the same graph, released this time
    torch.testing.assert_close(w.grad, 2 * expected)
    assert lookups() == (1, 1)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        replaygrad.backward(loss, compiler=COMPILER)


# ---- which gradients are needed -------------------------------------------------------------


def two_branch_loss(a, b):
    return (a.exp() * b).sum() + (b.sin() * 2).sum()


@pytest.mark.parametrize("first_needs_both", [True, False])
def test_requires_grad_of_a_leaf_changes_the_key(first_needs_both):
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    a_const = a.detach()
    with_a, without_a = key(two_branch_loss(a, b)), key(two_branch_loss(a_const, b))
    assert with_a != without_a
    order = [a, a_const, a] if first_needs_both else [a_const, a, a_const]
    for left in order:
        assert_like_eager(two_branch_loss, [left, b])
        if not left.requires_grad:
            assert left.grad is None
    assert lookups() == (2, 1)


def test_backward_inputs_subsets_have_their_own_keys():
    a = torch.randn(4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    full = key(two_branch_loss(a, b))
    only_a = key(two_branch_loss(a, b), [a])
    only_b = key(two_branch_loss(a, b), [b])
    assert len({full, only_a, only_b}) == 3
    assert key(two_branch_loss(a, b), [a]) == only_a
    for inputs in ([0], [1], [0], None, [1]):
        assert_like_eager(two_branch_loss, [a, b], inputs=inputs)
        if inputs is not None:
            other = (b, a)[inputs[0]]
            assert other.grad is None, "only `inputs` accumulate"
    assert lookups() == (3, 2)


# ---- what the cache keeps alive -------------------------------------------------------------


class SaveInput(torch.autograd.Function):
    is_traceable = True

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * g * x


def test_cache_keeps_no_old_graph_tensors_or_parameters_alive():
    refs = []
    for _ in range(2):  # compile the replay, then hit it with a new graph
        model = mlp()
        x = torch.randn(3, 8)
        hidden = model[1](model[0](x))  # TanhBackward0 saves this activation
        hidden.retain_grad()
        hidden.register_hook(lambda g: g * 1)
        out = model[2](hidden)  # SaveInput saves this with save_for_backward
        loss = SaveInput.apply(out).mean()
        refs += [weakref.ref(t) for t in (*model.parameters(), x, hidden, out)]
        replaygrad.backward(loss, compiler=COMPILER)
        assert hidden.grad is not None
        del model, x, hidden, out, loss
    gc.collect()
    alive = [i for i, r in enumerate(refs) if r() is not None]
    assert alive == [], f"still alive: {alive} of {len(refs)}"
    info = replaygrad.cache_info()
    assert (info.size, info.misses, info.hits) == (1, 1, 1)  # the replay itself stays cached


# ---- hooks with side effects, compiled with fullgraph=True ----------------------------------


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_hook_side_effect_on_a_tensor_compiles_once_fullgraph():
    w = torch.randn(4, requires_grad=True)
    calls = torch.zeros(())

    def hook(g):
        calls.add_(1)

    counters.clear()
    for i in range(10):
        h = w.exp()
        h.register_hook(hook)
        w.grad = None
        replaygrad.backward((h * w).sum(), compiler=COMPILER, fullgraph=True)
        assert calls.item() == i + 1
        torch.testing.assert_close(w.grad, w.detach().exp() * (w.detach() + 1))
    assert lookups() == (1, 9)
    assert unique_graphs() == 1


def test_hook_appending_to_a_list_runs_once_per_call():
    w = torch.randn(4, requires_grad=True)
    seen = []
    for _ in range(10):
        h = w.exp()
        h.register_hook(lambda g: seen.append("hook"))
        replaygrad.backward((h * w).sum(), compiler=COMPILER)
    assert seen == ["hook"] * 10
    assert lookups() == (1, 9)


@pytest.mark.parametrize("how", ["option", "callable"])
def test_hook_appending_to_a_list_stops_recompiling_fullgraph(how):
    """Traced, the hook makes Dynamo guard on ``len(seen)``, so the second call recompiles
    (plain torch.compile of a function calling the hook recompiles on every call, then
    fails on the recompile limit under fullgraph=True, as torch's compiled autograd does).
    The replay then calls the hook between compiled regions, none of which breaks its graph,
    and later calls compile nothing. A compiler callable that refuses graph breaks is found
    to do so when the hook outside the graph fails to compile (the call starts over)."""
    w = torch.randn(4, requires_grad=True)
    seen = []
    graphs = []
    options = {"compiler": COMPILER, "fullgraph": True}
    if how == "callable":
        options = {"compiler": torch.compile(backend=COMPILER, fullgraph=True)}
    counters.clear()
    for _ in range(12):
        h = w.exp()
        h.register_hook(lambda g: seen.append("hook"))
        w.grad = None
        replaygrad.backward((h * w).sum(), **options)
        torch.testing.assert_close(w.grad, w.detach().exp() * (w.detach() + 1))
        graphs.append(unique_graphs())
    assert seen == ["hook"] * 12
    assert lookups() == (1, 11)
    assert graphs[3:] == [graphs[3]] * 9, graphs
    (entry,) = _compile.cache._entries.values()
    assert not entry.replay.hooks_in_graph
    assert False in [region.compiled for region in entry.replay.regions]


def test_torch_compiled_autograd_works_after_dynamic_replays():
    """Tracing with dynamic sizes runs torch's nodes through their compiled-autograd entry
    point, which binds each node type's functional form once per process: replaygrad binds
    it where torch's compiled autograd finds it."""
    model = mlp()
    params = list(model.parameters())
    for batch in (4, 6):
        replaygrad.backward(model(torch.randn(batch, 8)).square().mean(), compiler=COMPILER)
    x = torch.randn(3, 8)
    expected = torch.autograd.grad(model(x).square().mean(), params)
    for p in params:
        p.grad = None
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=COMPILER)):
        model(x).square().mean().backward()
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.grad, e)


def _upsampled(x: torch.Tensor) -> torch.Tensor:
    interpolate = torch.nn.functional.interpolate
    return (
        interpolate(x, scale_factor=2, mode="bilinear").pow(2).sum()
        + interpolate(x, scale_factor=1.5, mode="bicubic", align_corners=True).pow(2).sum()
    )


def test_nodes_failing_on_symbolic_sizes_run_outside_the_graph_when_sizes_change():
    """Upsampling's backward kernels take no symbolic sizes in their fake implementation:
    in the graph Dynamo compiles with dynamic sizes, those steps run outside the graph (a
    graph break), and that graph serves every later shape: no new replay, no recompile."""
    shapes = [(2, 3, 4, 4), (3, 3, 5, 5), (4, 3, 4, 6), (2, 3, 4, 4), (5, 3, 6, 7)]
    counters.clear()
    seen = []
    for _ in range(3):
        for shape in shapes:
            x = torch.randn(*shape, requires_grad=True)
            (expected,) = torch.autograd.grad(_upsampled(x), x)
            (got,) = replaygrad.grad(_upsampled(x), x, compiler=COMPILER)
            torch.testing.assert_close(got, expected)
        seen.append((replaygrad.cache_info().misses, unique_graphs()))
    assert seen[0][0] == 1
    assert seen[1] == seen[2] == seen[0], f"(replays, Dynamo graphs) per round: {seen}"
    assert any("takes no symbolic sizes" in k for k in counters["graph_break"])


def test_nodes_failing_on_symbolic_sizes_keep_them_in_the_key_under_fullgraph():
    """Where no graph break is allowed, such a step is traced with its own sizes instead,
    and its type's sizes go into later keys."""
    counters.clear()
    for shape in [(2, 3, 4, 4), (3, 3, 5, 5), (4, 3, 4, 6), (3, 3, 5, 5)]:
        x = torch.randn(*shape, requires_grad=True)
        (expected,) = torch.autograd.grad(_upsampled(x), x)
        (got,) = replaygrad.grad(_upsampled(x), x, compiler=COMPILER, fullgraph=True)
        torch.testing.assert_close(got, expected)
    assert not counters["graph_break"]
    assert replaygrad.cache_info().misses == 3


def test_a_formula_that_fixes_a_symbolic_size_runs_outside_the_graph():
    """masked_select's backward reads plain sizes(), which fixes the batch size being
    traced: in the graph with dynamic sizes that step runs outside the graph, so new batch
    sizes stop compiling new graphs (before, one per size up to Dynamo's recompile limit)."""
    w = torch.randn(6, 6, requires_grad=True)
    counters.clear()
    graphs = []
    for batch in (6, 9, 4, 12, 7, 5, 10, 11):
        x = torch.randn(batch, 6)

        def loss(w, x=x):
            h = (x @ w).tanh()
            return torch.masked_select(h, h > 0).pow(3).sum()

        assert_like_eager(loss, [w])
        graphs.append(unique_graphs())
    assert lookups() == (1, 7)
    assert graphs[3:] == [graphs[3]] * 5, f"Dynamo graphs after each call: {graphs}"
    assert any("specialises symbolic sizes" in k for k in counters["graph_break"])
    # Dynamo runs the step as Python, without compiling replaygrad's own frames (whose
    # ints are symbolic too: before 2026-12-07 they broke the graph again).
    assert all(k.startswith("replaygrad: ") for k in counters["graph_break"]), counters[
        "graph_break"
    ]


def test_a_formula_that_fixes_a_stride_to_one_stays_in_the_graph():
    """Linear's AddmmBackward0 asks whether the weight's stride is 1. Under dynamic=True
    that stride, a lifted int, is a symbol, which the question fixes to 1: no size, so the
    step stays in the graph (before 2026-12-07 every Linear step broke the graph there)."""
    w1, b1 = torch.randn(8, 6, requires_grad=True), torch.randn(8, requires_grad=True)
    w2 = torch.randn(3, 8, requires_grad=True)
    counters.clear()
    before = unique_graphs()
    for batch in (4, 7, 5):
        x = torch.randn(batch, 6)

        def loss(w1, b1, w2, x=x):
            return F.linear(F.linear(x, w1, b1).tanh(), w2).square().sum()

        leaves = [w1, b1, w2]
        expected = eager_grads(loss, leaves)
        torch.testing.assert_close(replay_grads(loss, leaves, dynamic=True), expected)
    assert not counters["graph_break"]
    assert unique_graphs() == before + 1


def test_sizes_fixed_by_the_graph_structure_stay_in_the_graph():
    """nn.GRU's backward (CPU) stacks one gradient per time step (UnbindBackward0: as many
    as the node has inputs), and the next steps' formulas meet that stack's constant length,
    which fixes the symbolic sequence length to it. No graph of the same key can see another
    length there, so under dynamic=True those steps stay in the graph (before 2026-12-07,
    two graph breaks per layer)."""
    torch.manual_seed(0)
    # (Sizes chosen so that no formula meets a coincidental relation between them, e.g. a
    # hidden size twice the batch size: Dynamo guards on one, and compiles again when it
    # ends.)
    gru = torch.nn.GRU(8, 11, num_layers=2, batch_first=True)
    names = [name for name, _ in gru.named_parameters()]
    leaves = [p.detach().clone().requires_grad_() for p in gru.parameters()]
    counters.clear()
    before = unique_graphs()
    for batch in (5, 7, 9, 4):
        x = torch.randn(batch, 6, 8)

        def loss(*params, x=x):
            out, _ = torch.func.functional_call(gru, dict(zip(names, params)), (x,))
            return out.square().mean()

        expected = eager_grads(loss, leaves)
        torch.testing.assert_close(replay_grads(loss, leaves, dynamic=True), expected)
    assert not counters["graph_break"]
    assert unique_graphs() == before + 1


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_an_empty_input_after_sizes_became_dynamic(compiler):
    """``cat``'s backward narrows its gradient by the sizes it keeps. With those sizes
    dynamic (after a second batch size), an empty input fixes one to 0 while AOTAutograd
    runs the graph to collect its metadata: that pass is not Dynamo's run of the step,
    where such a step can leave the graph, so it must not try to (before, the compile failed
    with Dynamo's Unsupported)."""
    b = torch.randn(5, 5, requires_grad=True)
    for n in (3, 4, 0, 2):
        a = torch.randn(n, 5, requires_grad=True)
        g = torch.randn(n + 5, 5)
        expected = torch.autograd.grad(torch.cat([a, b]), [a, b], g)
        got = replaygrad.grad(torch.cat([a, b]), [a, b], g, compiler=compiler)
        for e, r in zip(expected, got):
            torch.testing.assert_close(r, e)


class ToDouble(torch.autograd.Function):
    """Hands back a float64 gradient: the engine casts it to the leaf's ``grad_dtype``."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.double() * 2


@pytest.mark.parametrize("compiler", ["aot_eager", "inductor"])
def test_a_leafs_grad_dtype_is_part_of_the_key(compiler):
    # The engine casts a leaf's gradient to its grad_dtype (None: no cast), which a compiled
    # replay bakes in: a replay made for one grad_dtype gave another leaf its cast.
    def run(grad_dtype, backward):
        w = torch.tensor([3.0, 4.0], requires_grad=True)
        if grad_dtype != "unset":
            w.grad_dtype = grad_dtype
        backward((ToDouble.apply(w.sin()) * 2).sum())
        return w.grad

    keys = set()
    for grad_dtype in ("unset", None, torch.float16, torch.float64):
        expected = run(grad_dtype, torch.autograd.backward)
        got = run(grad_dtype, lambda loss: replaygrad.backward(loss, compiler=compiler))
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
        w = torch.tensor([3.0, 4.0], requires_grad=True)
        if grad_dtype != "unset":
            w.grad_dtype = grad_dtype
        keys.add(key((ToDouble.apply(w.sin()) * 2).sum()))
    assert len(keys) == 4
