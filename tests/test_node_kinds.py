"""Kinds of backward nodes and gradient plumbing, against eager: Python autograd.Functions,
checkpointing, compiled forwards, views and in-place ops, sparse and mixed-dtype gradients,
the gradient layout contract, several roots, retained graphs and double backward.

Each test builds its graph in ``run(backward)`` from a fixed seed and runs once with the
engine and once with replaygrad; what the run logs and the gradients must match.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import sysconfig
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

import replaygrad

from conftest import (
    COMPILERS,
    FAST_COMPILERS,
    assert_grads_equal,
    assert_same,
    compare,
    counting_backend,
    eager_backward,
    grads_of,
    replay_backward,
    summary,
    uncompiled_and_failing_aot_eager,
)

# ---- Python autograd.Functions -------------------------------------------------------------


class ExpScale(torch.autograd.Function):
    """Saves an input and its output; non-tensor inputs (a float, a list to log into) and a
    ctx attribute; returns None for what needs no gradient."""

    @staticmethod
    def forward(ctx, x, w, scale, log):
        y = x.exp() * scale
        ctx.save_for_backward(x, y, w)
        ctx.scale = scale
        ctx.log = log
        return y * w

    @staticmethod
    def backward(ctx, grad):
        _, y, w = ctx.saved_tensors
        if ctx.log is not None:
            ctx.log.append(("ExpScale", ctx.needs_input_grad, ctx.scale, summary(grad)))
        gx = grad * y * w if ctx.needs_input_grad[0] else None
        gw = grad * y if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


class ExpScaleTraceable(ExpScale):
    is_traceable = True


class ExpScaleSetupContext(torch.autograd.Function):
    """The same, in the forward/setup_context style."""

    @staticmethod
    def forward(x, w, scale, log):
        return x.exp() * scale * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, scale, log = inputs
        ctx.save_for_backward(x, w, output)
        ctx.scale = scale
        ctx.log = log

    @staticmethod
    def backward(ctx, grad):
        x, _, out = ctx.saved_tensors
        if ctx.log is not None:
            ctx.log.append(("setup_context", ctx.needs_input_grad, ctx.scale, summary(grad)))
        gx = grad * out if ctx.needs_input_grad[0] else None
        gw = grad * x.exp() * ctx.scale if ctx.needs_input_grad[1] else None
        return gx, gw, None, None


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("function", [ExpScale, ExpScaleTraceable, ExpScaleSetupContext])
@pytest.mark.parametrize("w_requires_grad", [True, False])
def test_function_saved_values_and_ctx(compiler, function, w_requires_grad):
    def run(backward):
        torch.manual_seed(0)
        # A traced backward runs at trace time with fake tensors: log only opaque ones.
        log = None if function is ExpScaleTraceable else []
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=w_requires_grad)
        h = x * 2
        out = function.apply(h, w, 1.5, log)
        backward((out.sin() + h).sum())
        return log or [], grads_of([x, w])

    compare(run, compiler)


@pytest.mark.parametrize("how", ["option", "callable"])
@pytest.mark.parametrize("function", [ExpScale, ExpScaleSetupContext])
def test_function_runs_between_compiled_regions_under_fullgraph(function, how):
    """A Function that is not traceable runs as itself; under fullgraph=True, which allows
    no graph break, it runs between compiled regions, none of which breaks its graph. A
    compiler callable that refuses graph breaks is found to do so when the replay fails to
    compile (the call starts over)."""

    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        for _ in range(2):
            h = x * 2
            out = function.apply(h, w, 1.5, log)
            backward((out.sin() + h).sum())
        return log, grads_of([x, w])

    if how == "option":
        compare(run, "aot_eager", fullgraph=True)
    else:
        compare(run, torch.compile(backend="aot_eager", fullgraph=True))
    assert replaygrad.cache_info().misses == 1
    (entry,) = replaygrad._compile.cache._entries.values()
    assert [region.compiled for region in entry.replay.regions] == [True, False, True]


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("materialize", [True, False])
def test_function_outputs_one_unused(compiler, materialize):
    # Without materialized grads the unused output's gradient reaches backward as None.
    class Split(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, log):
            ctx.set_materialize_grads(materialize)
            ctx.log = log
            return x * 2, x * 3, x * 4

        @staticmethod
        def backward(ctx, ga, gb, gc):
            ctx.log.append(("Split", summary((ga, gb, gc))))
            total = ga * 2 if ga is not None else torch.zeros(())
            if gb is not None:
                total = total + gb * 3
            if gc is not None:
                total = total + gc * 4
            return total, None

    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(5, requires_grad=True)
        a, _, c = Split.apply(x, log)
        backward((a * c).sum())
        return log, grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_function_mark_non_differentiable(compiler):
    class SortValues(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, log):
            values, indices = x.sort()
            ctx.mark_non_differentiable(indices)
            ctx.save_for_backward(indices)
            ctx.log = log
            return values, indices

        @staticmethod
        def backward(ctx, grad_values, grad_indices):
            (indices,) = ctx.saved_tensors
            ctx.log.append(("SortValues", summary((grad_values, grad_indices))))
            return torch.zeros_like(grad_values).scatter(0, indices, grad_values), None

    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(6, requires_grad=True)
        values, indices = SortValues.apply(x * 1.0, log)
        log.append(("indices", indices.requires_grad))
        backward((values * torch.arange(6.0)).sum() + indices.float().sum())
        return log, grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_function_once_differentiable_and_mark_dirty(compiler):
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, log):
            ctx.save_for_backward(x)
            ctx.log = log
            return x * x

        @staticmethod
        @once_differentiable
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            ctx.log.append(("Square", torch.is_grad_enabled(), summary(grad)))
            return 2 * x * grad, None

    class MulInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, k, log):
            ctx.mark_dirty(x)
            ctx.k = k
            ctx.log = log
            return x.mul_(k)

        @staticmethod
        def backward(ctx, grad):
            ctx.log.append(("MulInPlace", summary(grad)))
            return grad * ctx.k, None, None

    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(4, requires_grad=True)
        h = x.sin()
        out = MulInPlace.apply(h, 3.0, log)
        log.append(("dirty", out is h, h.grad_fn.name()))
        backward((Square.apply(out, log) + h.exp()).sum())
        return log, grads_of([x])

    compare(run, compiler)


# ---- checkpointing and compiled forwards ---------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpoint(compiler, use_reentrant):
    def run(backward):
        torch.manual_seed(0)
        log = []
        block = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 4))
        head = nn.Linear(4, 1)
        x = torch.randn(5, 4, requires_grad=True)

        def body(t):
            log.append(("forward", tuple(t.shape)))  # runs again in the backward
            return block(t).tanh()

        h = checkpoint(body, x * 2, use_reentrant=use_reentrant)
        backward(head(h).square().sum())
        return log, grads_of([x, *block.parameters(), *head.parameters()])

    compare(run, compiler)


def _checkpointed_blocks(backward, batch: int = 5, nested: bool = False):
    """Three non-reentrant checkpointed blocks (each Linear, LayerNorm, GELU, Linear), the
    middle one with a tensor hook inside and, if ``nested``, a checkpoint inside it; logs
    each block's forward (run again in the backward, in engine order) and the hook."""
    torch.manual_seed(0)
    log = []
    blocks = [
        nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 4))
        for _ in range(3)
    ]
    x = torch.randn(batch, 4, requires_grad=True)

    def body(k, t):
        log.append(("forward", k, tuple(t.shape)))
        if k != 1:
            return blocks[k](t)
        a = blocks[k][1](blocks[k][0](t))
        a.register_hook(lambda g: log.append(("hook", summary(g))) or g * 2)
        rest = lambda u: blocks[k][3](blocks[k][2](u))  # noqa: E731
        return checkpoint(rest, a, use_reentrant=False) if nested else rest(a)

    h = x
    for k in range(3):
        h = checkpoint(body, k, h, use_reentrant=False)
    backward((h.tanh() * h).sum())
    return log, grads_of([x, *(p for b in blocks for p in b.parameters())])


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("nested", [False, True])
def test_non_reentrant_checkpointed_blocks(compiler, nested):
    compare(lambda backward: _checkpointed_blocks(backward, nested=nested), compiler)


@pytest.mark.parametrize("nested", [False, True])
def test_checkpointed_blocks_under_fullgraph(nested):
    """Under fullgraph=True the nodes of a checkpointed block run as themselves, each
    unpacking its values, between compiled regions (the unpack of a whole block at its first
    node would be a graph break)."""
    compare(lambda b: _checkpointed_blocks(b, nested=nested), "aot_eager", fullgraph=True)
    (entry,) = replaygrad._compile.cache._entries.values()
    assert entry.replay.breakless
    assert {region.compiled for region in entry.replay.regions} == {True, False}


def test_a_checkpointed_block_breaks_the_graph_once():
    """The nodes of a non-reentrant checkpointed block are traced: their saved values are
    unpacked at the block's first node (one graph break, which recomputes the block), not
    by each node run as itself (a graph break per node)."""
    backend, graphs = counting_backend()
    compare(_checkpointed_blocks, torch.compile(backend=backend))
    # One graph before the first block's unpack and one after each of the three; the hook
    # inside the middle block is traced.
    assert len(graphs) == 4, f"{len(graphs)} graphs"


def test_checkpointed_blocks_alike_compile_once():
    """A region starts at each checkpointed block: blocks alike share one compiled region."""

    def run(backward):
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.GELU()) for _ in range(6)]
        x = torch.randn(5, 4, requires_grad=True)
        h = x
        for block in blocks:
            h = h + checkpoint(block, h, use_reentrant=False)
        backward(h.square().sum())
        return [], grads_of([x, *(p for b in blocks for p in b.parameters())])

    backend, graphs = counting_backend()
    compare(run, torch.compile(backend=backend))
    # Before the blocks, the five blocks alike, the last one (with what follows it): where a
    # region is not cut, each block is a graph of its own (7).
    assert len(graphs) == 3, f"{len(graphs)} graphs"


def test_checkpointed_blocks_over_changing_batch_sizes_compile_one_replay():
    """The sizes of checkpointed nodes are replay inputs too (the unpacked values stand in
    for their saved variables when traced with symbolic sizes)."""
    before = replaygrad.cache_info()
    for batch in (5, 8, 3, 11):
        compare(functools.partial(_checkpointed_blocks, batch=batch), "aot_eager")
    after = replaygrad.cache_info()
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 3)


def test_checkpointed_nodes_are_traced_with_symbolic_sizes():
    """A checkpointed node's formula is traced on its unpacked values with symbolic sizes,
    inside the graph: no step goes outside it as a formula that takes no symbolic sizes (the
    traced apply once read past a node's plain saved values into its hooked ones and failed:
    the step broke the graph, or, where no break is allowed, its node type was keyed on
    static sizes from then on)."""
    counters = torch._dynamo.utils.counters
    counters.clear()
    for batch in (5, 8):
        compare(functools.partial(_checkpointed_blocks, batch=batch), "aot_eager")
    outside = [reason for reason in counters["graph_break"] if "no symbolic sizes" in reason]
    assert outside == []


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_compiled_forward(compiler):
    def run(backward):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.SiLU(), nn.Linear(8, 2))
        compiled = torch.compile(model, backend="aot_eager")
        x = torch.randn(3, 4, requires_grad=True)
        out = compiled(x * 3)
        names = [node.name() for node in _all_nodes(out)]
        assert "CompiledFunctionBackward" in names
        backward((out.exp() + out).sum())
        return names, grads_of([x, *model.parameters()])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_double_backward_through_a_compiled_forward_raises_eagers_error(compiler):
    # The first backward's graph holds the node of AOTAutograd's compiled backward, whose
    # `_compiled_autograd_key` raises AttributeError (it has no `symints`): planning took that
    # error for its own. The node runs as itself and raises what eager raises.
    f = torch.compile(lambda a: a.pow(3).sum(), backend="aot_eager")

    def second_order() -> None:
        a = torch.randn(4, requires_grad=True)
        (g,) = torch.autograd.grad(f(a), a, create_graph=True)
        g.sum().backward()

    def replayed() -> None:
        with replaygrad.enable(compiler):
            second_order()

    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        second_order()
    with pytest.raises(RuntimeError, match="does not currently support double backward"):
        replayed()


class RaisingKey(torch.autograd.Function):
    """A Function whose compiled-autograd key cannot be made."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * x.cos()

    @staticmethod
    def _compiled_autograd_key(ctx):
        raise AttributeError("no key")


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_a_function_whose_key_raises_runs_as_itself(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(5, requires_grad=True)
        backward((RaisingKey.apply(x * 2) * x).sum())
        return (), grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_compiled_function_calling_autograd_grad(compiler):
    # The call breaks the function's graph, and Dynamo runs it with its frame evaluation on:
    # it compiled the replay's Python frames too (under inductor 593 frames, 21 graph breaks
    # and warnings about replaygrad's builtins, against eager's 57 frames and one break).
    # The replay's own regions compile as they do outside.
    counters = torch._dynamo.utils.counters

    def run(enabled: bool) -> tuple:
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        w = torch.randn(6, 5, requires_grad=True)

        @torch.compile(backend="aot_eager")
        def step(x):
            (g,) = torch.autograd.grad((x @ w).sin().sum(), w)
            return g * 2

        outs = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                x = torch.randn(4, 6)
                with replaygrad.enable(compiler) if enabled else contextlib.nullcontext():
                    outs.append(step(x))
        ours = [str(m.message) for m in caught if "replaygrad" in str(m.message)]
        return outs, ours, counters["frames"]["total"]

    expected, _, eager_frames = run(False)
    got, warned, frames = run(True)
    assert_same(tuple(expected), tuple(got), compiler is None, "results")
    assert warned == []
    assert frames <= eager_frames
    assert replaygrad.cache_info().hits == 1


def _all_nodes(root: torch.Tensor) -> list:
    seen, stack, nodes = set(), [root.grad_fn], []
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        nodes.append(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return nodes


# ---- views and in-place ops ----------------------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_in_place_on_views(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        y = x.clone()
        y[1:].mul_(2)  # CopySlices over MulBackward0
        y.diagonal().mul_(w)  # a view of the base: CopySlices again
        y[:, 0].unsqueeze(0).squeeze(0).exp_()  # a view of a view
        z = x.clone() * 1
        row = z[0]
        z.mul_(w)  # the base changes after the view was taken: row's grad_fn is regenerated
        strided = x.as_strided((2, 3), (1, 2), 1)  # AsStridedBackward0
        loss = (y * w).sum() + (row * 3).sum() + z.sum() + strided.square().sum()
        names = sorted({node.name() for node in _all_nodes(loss)})
        backward(loss)
        return names, grads_of([x, w])

    compare(run, compiler)


@pytest.mark.parametrize("options", [{}, {"mode": "max-autotune-no-cudagraphs"}])
def test_gradient_of_in_place_ops_on_two_views_with_inductor(options):
    # The double backward of two in-place ops on views: the graph of the first backward has
    # two CopySlices steps in a row (each writes a window of a copy of its gradient; the
    # second reads the first one's result). Inductor's reordering for locality (torch 2.13)
    # moved the read of the second window after a write to it: zeros in place of ones, as
    # under torch's compiled autograd (found by PyTorch's test_inplace_on_view_python run
    # under enable("inductor")).
    def run(backward):
        torch.manual_seed(0)
        a = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
        b = torch.randn(2, 2, dtype=torch.double, requires_grad=True)
        go = torch.randn(4, 4, dtype=torch.double, requires_grad=True)
        x = a.clone()
        x.narrow(1, 2, 2).narrow(0, 1, 2).add_(b)
        x.narrow(1, 0, 2).narrow(0, 1, 2).add_(b)
        ga, gb = torch.autograd.grad(x, (a, b), go, create_graph=True)
        names = sorted({node.name() for node in _all_nodes(ga)})
        backward((ga, gb), (torch.ones_like(ga), torch.ones_like(gb)), inputs=[go])
        return names, grads_of([go])

    compare(run, "inductor", **options)


@pytest.mark.parametrize("options", [{}, {"mode": "max-autotune-no-cudagraphs"}])
def test_gradient_penalty_through_scatter_add_on_a_view_with_inductor(options):
    # With inductor's reordering for locality off (and fusion on), the double backward of
    # scatter_add_ on a slice read the scatter's buffer before the scatter wrote it (the bug
    # replaygrad._compile._mend_inductor_scheduler mends); a region tracing an in-place op
    # on a view also compiles without fusion (for another bug of inductor's).
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(4, 5, requires_grad=True)
        v = torch.randn(4, 3, requires_grad=True)
        y = x * 2
        index = torch.tensor([[0, 2, 2], [1, 0, 2], [2, 2, 0], [0, 0, 0]])
        y[:, 1:4].scatter_add_(1, index, v * v)
        gx, gv = torch.autograd.grad(y.sin().sum(), (x, v), create_graph=True)
        penalty = (gx.norm() - 1) ** 2 + (gv.norm() - 1) ** 2
        names = sorted({node.name() for node in _all_nodes(penalty)})
        backward(penalty)
        return names, grads_of([x, v])

    compare(run, "inductor", **options)


#: Average poolings whose backward inductor's lowering (torch 2.13) gets wrong or rejects.
_AVG_POOLS = {
    # A last window overhanging the input (ceil_mode) divided by the whole kernel.
    "1d_ceil": lambda x: F.avg_pool1d(x.flatten(2), 2, ceil_mode=True),
    "2d_ceil": lambda x: F.avg_pool2d(x, 2, ceil_mode=True),
    "2d_ceil_padded": lambda x: F.avg_pool2d(x[..., :4, :4], 3, 2, 1, ceil_mode=True),
    "3d_ceil": lambda x: F.avg_pool3d(x[None], 2, ceil_mode=True),
    # One padding for both dimensions: the lowering asserts one per dimension.
    "2d_one_padding": lambda x: F.avg_pool2d(x, (3, 3), (1, 1), (1,)),
}


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("pool", sorted(_AVG_POOLS))
def test_average_pooling_that_inductor_lowers_unlike_eager(pool, compiler):
    # Found by an OpInfo sweep under inductor; torch's compiled autograd gets the same wrong
    # gradients. Such a node runs as itself.
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(1, 2, 5, 5, requires_grad=True)
        w = torch.randn(2, 1, 1, requires_grad=True)
        y = _AVG_POOLS[pool](x * w)
        backward((y.sin() + F.avg_pool2d(x, 2).sum()).sum())
        return [y.grad_fn.name()], grads_of([x, w])

    compare(run, compiler)


#: 2-d nearest upsamplings: inductor's lowering of their backward ignores the scale.
_NEAREST_2D = {
    "scale_2": dict(scale_factor=2),
    "scale_1.7": dict(scale_factor=1.7, recompute_scale_factor=False),
    "scale_0.6": dict(scale_factor=0.6, recompute_scale_factor=False),
    "size": dict(size=(5, 7)),
}


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("kind", sorted(_NEAREST_2D))
def test_nearest_upsampling_over_changing_image_sizes(kind, compiler):
    # Inductor's lowering of upsample_nearest2d_backward (torch 2.13) computes from the sizes
    # only: wrong gradients for a scale that is not output size / input size, and a failed
    # compile once the spatial sizes are dynamic (the second image size here).
    def run(backward):
        grads = []
        for shape in [(2, 3, 4, 4), (2, 3, 6, 6), (3, 3, 6, 5)]:
            torch.manual_seed(0)
            x = torch.randn(shape, requires_grad=True)
            y = F.interpolate(x, mode="nearest", **_NEAREST_2D[kind])
            backward((y.sin() * y.size(-1)).sum())
            grads += grads_of([x])
        return [], grads

    compare(run, compiler)


# ---- sparse, mixed dtypes, broadcasting ---------------------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_sparse_embedding_grads(compiler):
    def run(backward):
        torch.manual_seed(0)
        emb = nn.Embedding(10, 3, sparse=True)
        dense = nn.Embedding(10, 3)
        idx = torch.tensor([[1, 2, 4, 4], [4, 3, 2, 9]])
        backward((emb(idx) * dense(idx)).sum())
        first = grads_of([emb.weight, dense.weight])
        # A second backward accumulates sparse into sparse; then a dense use of the sparse
        # weight in the same graph: the dense gradient absorbs the sparse one.
        backward(emb(idx[0]).square().sum())
        second = grads_of([emb.weight])
        backward(emb(idx[1]).sum() + emb.weight.sum())
        return [], first + second + grads_of([emb.weight])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_mixed_dtypes(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w16 = torch.randn(4, dtype=torch.float16, requires_grad=True)
        wbf = torch.randn(4, dtype=torch.bfloat16, requires_grad=True)
        w64 = torch.randn(4, dtype=torch.float64, requires_grad=True)
        h = x * w16.to(torch.float32) + wbf.float()
        low = (h.to(torch.bfloat16) * wbf).to(torch.float16) * w16
        loss = low.float().sum() + (h.double() * w64).sum().float() + h.half().sum().float()
        backward(loss)
        return [], grads_of([x, w16, wbf, w64])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_broadcasting_reduces_to_input_shapes(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(3, 1, 4, requires_grad=True)
        y = torch.randn(5, 4, requires_grad=True)
        b = torch.randn(1, requires_grad=True)
        s = torch.tensor(2.0, requires_grad=True)  # 0-dim
        out = (x * y + b) / s - y.exp()
        backward(out.sin().sum())
        return [], grads_of([x, y, b, s])

    compare(run, compiler)


# ---- accumulation and the gradient layout contract ----------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_accumulation_into_an_existing_grad(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        w = torch.randn(3, 2, requires_grad=True)
        v = torch.randn(2, requires_grad=True)
        v.grad = torch.ones(2)  # set by the user
        preset = v.grad
        backward((w * v).sum())
        backward((w.exp() @ v).sum())
        # Whether .grad was updated in place (the user's tensor sees it) must match too.
        log.append(("same object", v.grad is preset, summary(preset)))
        return log, grads_of([w, v])

    compare(run, compiler)


def _buffer_ops(backward) -> tuple[dict[str, int], list]:
    """The additions a backward makes (aten::add and aten::add_ counts) and its gradients:
    x feeds four nodes, so four gradients meet in its buffer."""
    torch.manual_seed(0)
    x = torch.randn(64, 64, requires_grad=True)
    h = x * 1.5
    loss = (h.sin() + h.cos() * 2 + h.exp() / 3 + h.tanh()).sum()
    with torch.profiler.profile() as prof:
        backward(loss)
    counts = {e.key: e.count for e in prof.key_averages() if e.key in ("aten::add", "aten::add_")}
    return counts, grads_of([x])


#: Uncompiled replays sum in place only where CPython's reference counts prove that nothing
#: else holds a gradient (see _core.buffer_sum).
_COUNTS_REFERENCES = pytest.mark.skipif(
    sys.version_info >= (3, 14) or bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
    reason="in-place sums need CPython's reference counts (before 3.14, with the GIL)",
)


@_COUNTS_REFERENCES
def test_uncompiled_replay_sums_gradients_in_place_where_the_engine_does():
    # InputBuffer::add sums into a gradient in place when nothing else holds it: the
    # uncompiled replay makes the same additions, not a new tensor per gradient.
    expected, expected_grads = _buffer_ops(eager_backward)
    got, got_grads = _buffer_ops(replay_backward(None))
    assert expected.get("aten::add_", 0) >= 3, f"eager sums in place: {expected}"
    assert got == expected
    assert_grads_equal(expected_grads, got_grads, exact=True)


@_COUNTS_REFERENCES
def test_uncompiled_sum_into_a_gradient_keeps_its_strides():
    # A channels_last 1x1 conv weight used twice: the engine sums its second gradient into
    # the first in place, whose strides in size-1 dims (16, 1, 16, 16) a new sum would not
    # keep ((16, 1, 1, 1)); .grad takes them. The uncompiled replay sums in place too.
    def run(backward):
        torch.manual_seed(0)
        w = torch.randn(16, 16, 1, 1).to(memory_format=torch.channels_last).requires_grad_()
        x = torch.randn(2, 16, 4, 4)
        backward((F.conv2d(x, w) + F.conv2d(x * 2, w)).sum())
        return w.grad

    expected, got = run(eager_backward), run(replay_backward(None))
    assert got.stride() == expected.stride() == (16, 1, 16, 16)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("holder", ["post_hook", "tensor_hook", "retain_grad"])
def test_gradient_summed_into_a_buffer_while_held_elsewhere_is_not_changed(compiler, holder):
    # The first gradient to reach h's buffer is a's, passed through by clone's backward: a
    # hook that kept it (clone's post hook, or a tensor hook on a) or a's retained .grad
    # still sees the gradient that arrived, not the sum made in h's buffer.
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(4, requires_grad=True)
        h = x * 2
        b = h.exp()
        a = h.clone()  # made last, run first
        kept = []
        if holder == "post_hook":
            a.grad_fn.register_hook(lambda grad_inputs, grads: kept.extend(grad_inputs))
        elif holder == "tensor_hook":
            a.register_hook(lambda g: kept.append(g))
        else:
            a.retain_grad()
        backward((a * 3 + b).sum())
        log.append(("kept", summary(kept)))
        if holder == "retain_grad":
            log.append(("retained", summary(a.grad)))
        return log, grads_of([x])

    compare(run, compiler)


def _stride_log(tensors):
    return [("stride", tuple(t.grad.stride())) for t in tensors]


@pytest.mark.parametrize("compiler", COMPILERS)
def test_grad_layout_follows_the_parameter(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(5, 4)
        wt = torch.randn(3, 4).t().detach().requires_grad_()  # (4, 3), strides (1, 4)
        conv_w = torch.randn(6, 3, 3, 3).to(memory_format=torch.channels_last).requires_grad_()
        image = torch.randn(2, 3, 8, 8)
        # A hook hands AccumulateGrad an expanded (stride 0) gradient for a transposed leaf.
        expanded = torch.randn(3, 2).t().detach().requires_grad_()
        expanded.register_hook(lambda g: g.sum().expand_as(g))
        loss = (x @ wt).tanh().sum() + F.conv2d(image, conv_w).square().mean()
        backward(loss + (expanded * 2).sum())
        log = _stride_log([wt, conv_w, expanded])
        backward((x @ wt).sum() + F.conv2d(image, conv_w).sum())  # accumulate
        return log + _stride_log([wt, conv_w]), grads_of([wt, conv_w, expanded])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_grads_do_not_alias(compiler):
    # AddBackward0 passes the root gradient on as is, to both inputs, and a leaf root gets
    # the user's gradient tensor itself: AccumulateGrad must copy what others still hold.
    def run(backward):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        leaf = torch.randn(3, requires_grad=True)
        g = torch.ones(3)
        backward([w + b, leaf], [g, g])
        backward((w * 2).sum() + (leaf * 3).sum())  # accumulates in place
        w.grad.mul_(10)
        log = [("user grad", summary(g)), ("aliases", w.grad.data_ptr() == b.grad.data_ptr())]
        return log, grads_of([w, b, leaf])

    compare(run, compiler)


# ---- several roots, retained graphs, double backward --------------------------------------


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_several_roots_with_grad_tensors(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        a = x * w
        b = a.sum(0).exp()
        c = (x.cos() * 2).sum()
        backward([a, b, c], [torch.full((3, 4), 0.5), torch.arange(4.0), None])
        return [], grads_of([x, w])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_retain_graph_then_second_backward(compiler):
    def run(backward):
        torch.manual_seed(0)
        log = []
        x = torch.randn(4, requires_grad=True)
        h = x.exp()
        loss = (h * h.sin()).sum()
        backward(loss, retain_graph=True)
        log.append(("first", summary(x.grad)))
        backward(loss)  # frees the saved values
        try:
            backward(loss)
        except RuntimeError as error:
            log.append(("third", "second time" in str(error)))
        return log, grads_of([x])

    compare(run, compiler)


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_double_backward(compiler):
    # create_graph=True runs in the engine; the backward of the graph it built (double
    # backward nodes such as TanhBackwardBackward0) is then replayed.
    def run(grad, backward):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 1))
        x = torch.randn(4, 3, requires_grad=True)
        out = model(x).sum()
        (gx,) = grad(out, x, create_graph=True)
        backward(out + gx.square().sum())  # a gradient penalty
        return [summary(gx)], grads_of([x, *model.parameters()])

    def replay_grad(*args, **kwargs):
        return replaygrad.grad(*args, compiler=compiler, **kwargs)

    expected = run(torch.autograd.grad, eager_backward)
    got = run(replay_grad, replay_backward(compiler))
    exact = compiler is None
    assert_same(tuple(expected[0]), tuple(got[0]), exact, "gx")
    assert_same(tuple(expected[1]), tuple(got[1]), exact, "grads")


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_backward_create_graph_leaves_a_differentiable_grad(compiler):
    def run(backward_create_graph, backward):
        torch.manual_seed(0)
        w = torch.randn(4, requires_grad=True)
        backward_create_graph((w.sin() * w).sum(), create_graph=True)
        first = w.grad
        log = [("grad requires grad", first.requires_grad), ("value", summary(first))]
        w.grad = None
        backward((first * first).sum())  # through the graph create_graph built
        return log, grads_of([w])

    def replay_create_graph(*args, **kwargs):
        replaygrad.backward(*args, compiler=compiler, **kwargs)  # the engine runs it

    expected = run(eager_backward, eager_backward)
    got = run(replay_create_graph, replay_backward(compiler))
    assert_same(tuple(expected[0]), tuple(got[0]), compiler is None, "log")
    assert_same(tuple(expected[1]), tuple(got[1]), compiler is None, "grads")


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
def test_in_place_custom_function_on_a_view_runs_its_backward_every_call(compiler):
    # CopySlices wraps the Function's node: it must not be traced into a compiled replay
    # (the Python backward would run once, at trace time).
    calls = []

    class AddInPlace(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            a.add_(b)
            ctx.mark_dirty(a)
            return a

        @staticmethod
        def backward(ctx, grad):
            calls.append(1)
            return grad * 2, grad * 3

    for i in range(3):
        a = torch.ones(2, requires_grad=True)
        b = torch.ones(2, requires_grad=True)
        out = AddInPlace.apply(a.clone().view_as(a), b)
        replaygrad.backward(out.sum(), compiler=compiler)
        assert len(calls) == i + 1
        torch.testing.assert_close(a.grad, torch.full((2,), 2.0))
        torch.testing.assert_close(b.grad, torch.full((2,), 3.0))


# ---- a tensor saved by several nodes -------------------------------------------------------


def test_a_tensor_saved_by_several_nodes_is_one_replay_input():
    # As in torch's compiled autograd, a compiled replay takes each saved tensor once, not
    # once per node (or slot) that saved it.
    x = torch.randn(4, 5, requires_grad=True)
    w = torch.randn(4, 5, requires_grad=True)
    loss = (x * x).sum() + w.max() + w.amax(1).sum() + (w * x).sum()
    plan = replaygrad.plan(loss)
    values = plan._plan.saved_values()
    x_slots = [v for v in values if v is not None and v.shape == x.shape and torch.equal(v, x)]
    w_slots = [v for v in values if v is not None and v.shape == w.shape and torch.equal(v, w)]
    assert (len(x_slots), len(w_slots)) == (3, 3)  # x * x, w * x; w * x, max(), amax()
    assert all(v is x_slots[0] for v in x_slots) and all(v is w_slots[0] for v in w_slots)
    # Plus the results max() and amax() save for themselves.
    assert len({id(v) for v in values if v is not None}) == 4


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_tensor_saved_by_reductions_and_a_scatter(compiler):
    # w saved by kthvalue (whose backward scatters), max() and amax(): inductor dropped the
    # scatter's part when the replay passed w as three inputs (its kernel read the scatter
    # buffer before writing it).
    def run(backward):
        torch.manual_seed(0)
        w = torch.randn(6, 7, requires_grad=True)
        backward(w.kthvalue(2, dim=1)[0].sum() + w.max() + w.amax(1).sum())
        return [], grads_of([w])

    compare(run, compiler)


def _poolings(x):
    p, idx = F.max_pool2d(x, 2, return_indices=True)
    return (
        F.max_unpool2d(p * 2, idx, 2).pow(2).sum()
        + F.adaptive_max_pool2d(x, (4, 3)).sum()
        + F.adaptive_avg_pool2d(x, 4).pow(2).sum()
        + F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False).sum()
    )


#: Sums of gradients, one of them a scatter's (into a zero-filled buffer), that torch 2.13's
#: inductor compiled wrong on CPU (also under plain torch.compile): the node reading the
#: scatter's buffer was fused with a node of other, compatible loop ranges, which recomputed
#: its dependencies without the scatter's, and the fused kernel read the buffer before the
#: scatter wrote it. Each lost its scatter's term (max diff 1.0, 18.9, 1.0).
_SCATTER_SUMS = {
    "selections": (
        (3, 6),
        lambda x: (
            x.median(1)[0].sum()
            + x.cummax(1)[0].sum()
            + x.logcumsumexp(1).sum()
            + x.cumprod(1).sum()
            + torch.nanmedian(x)
            + x.msort().sum()
        ),
    ),
    "poolings": ((1, 2, 6, 6), _poolings),
    "maxima": ((6, 7), lambda a: a.max(1)[0].sum() + a.min() + a.amax(0).sum() + a.max()),
}


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("case", sorted(_SCATTER_SUMS))
def test_a_scatter_read_by_a_node_fused_with_other_loop_ranges(case, compiler):
    shape, loss_of = _SCATTER_SUMS[case]

    def run(backward):
        torch.manual_seed(1)
        x = torch.randn(shape, requires_grad=True)
        backward(loss_of(x))
        backward(loss_of(x))  # the cached replay
        return [], grads_of([x])

    compare(run, compiler)


class ScalesItsSavedInput(torch.autograd.Function):
    is_traceable = True

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (saved,) = ctx.saved_tensors
        saved.mul_(3)
        return g * 2


@pytest.mark.parametrize(
    "compiler",
    uncompiled_and_failing_aot_eager(
        "a traced Function's backward runs inside the compiled graph, where its in-place "
        "change of a tensor a later node saved is not checked: the later node uses the "
        "changed value"
    ),
)
def test_traced_function_modifying_a_tensor_a_later_node_saved(compiler):
    def run(backward):
        torch.manual_seed(0)
        x = torch.randn(4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        t = x * 1
        u = t * w  # MulBackward0 saves t and runs after the Function's backward
        v = ScalesItsSavedInput.apply(t)
        with pytest.raises(RuntimeError) as raised:
            # (v.exp(): the Function's gradient is not an expanded one, with which it
            # would run as itself.)
            backward(u.sum() + v.exp().sum())
        return [str(raised.value)], grads_of([x, w])

    compare(run, compiler)


class MutatesItsGradient(torch.autograd.Function):
    """A traced Function whose backward changes its incoming gradient in place."""

    is_traceable = True
    op = staticmethod(lambda g: None)

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        MutatesItsGradient.op(grad)
        return grad * 1


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("op", ["mul_", "fill_", "first_fill_"])
def test_traced_function_mutating_an_expanded_gradient_in_place(compiler, op, monkeypatch):
    # sum()'s gradient is expanded (stride 0): in eager, mul_ raises (internal overlap) and
    # fill_ writes every alias. Traced, neither happens (mul_ gave a wrong gradient instead
    # of the error: functionalization of an in-place op on an expanded tensor); such a step
    # runs as itself, as a hook given such a gradient does.
    ops = {
        "mul_": lambda g: g.mul_(2),
        "fill_": lambda g: g.fill_(3.0),
        "first_fill_": lambda g: g[0].fill_(5.0),
    }
    monkeypatch.setattr(MutatesItsGradient, "op", staticmethod(ops[op]))

    def run(backward):
        x = torch.ones(4, requires_grad=True)
        y = MutatesItsGradient.apply(x * 2).sum()
        try:
            backward(y)
        except RuntimeError as error:
            return [("error", str(error).splitlines()[0])], []
        return [], grads_of([x])

    compare(run, compiler)


class ScaledParameter(torch.nn.Parameter):
    """Products with it are scaled by 10: a __torch_function__ subclass."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if func in (torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__):
            out = out.as_subclass(torch.Tensor) * 10
        return out


class MulBySaved(torch.autograd.Function):
    """A traced Function whose backward depends on the object it saved (no ctx state: that
    alone would make it run as itself)."""

    is_traceable = True

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w.as_subclass(torch.Tensor)

    @staticmethod
    def backward(ctx, grad):
        _, w = ctx.saved_tensors
        return w * grad * (3 if getattr(w, "tag", None) == "w" else 1), None


@pytest.mark.parametrize("compiler", FAST_COMPILERS)
@pytest.mark.parametrize("kind", ["subclass", "attribute"])
def test_traced_function_saving_a_subclass_or_an_attributed_tensor(compiler, kind):
    # Its backward sees what it saved: a __torch_function__ subclass runs its override there
    # (here a 10x product), an attribute set on the tensor is there (here a 3x factor). A
    # compiled replay would give it plain traced tensors, so such a node runs as itself.
    def run(backward):
        torch.manual_seed(0)
        w = torch.randn(3)
        if kind == "subclass":
            w = ScaledParameter(w)
        else:
            w.tag = "w"
        x = torch.randn(3, requires_grad=True)
        backward((MulBySaved.apply(x.exp(), w) * 2).sum())
        return [], grads_of([x])

    compare(run, compiler)


def test_uncompiled_traced_function_gets_the_tensors_it_saved():
    # Uncompiled, a traced Function runs for real: ctx.saved_tensors are the very objects.
    class Identity(torch.autograd.Function):
        is_traceable = True

        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(w)
            return x * 1

        @staticmethod
        def backward(ctx, grad):
            (saved,) = ctx.saved_tensors
            seen.append((saved is w, saved.grad_fn is not None))
            return grad * 1, None

    seen = []
    x = torch.randn(3, requires_grad=True)
    w = x.exp()
    loss = (Identity.apply(x, w) * 2).sum() + w.sum()
    replay_backward(None)(loss)
    assert seen == [(True, True)]
