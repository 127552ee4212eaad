"""Large graphs are split into regions, each compiled on its own; regions of the same
structure share one compiled function (``replaygrad.set_region_size``). Every test runs with
regions of a few steps and compares with eager autograd."""

from __future__ import annotations

import functools
from itertools import pairwise

import pytest
import torch

import replaygrad
from replaygrad._compile import cache

from conftest import Doubling, assert_grads_equal, assert_same, compare, grads_of, summary

REGION = 4


@pytest.fixture(autouse=True)
def small_regions():
    prior = cache.region_size
    replaygrad.set_region_size(REGION)
    yield
    replaygrad.set_region_size(prior)


def counting(compiles: list, backend: str | None = None):
    """A compiler callable that records each function it is given (a region's) and
    compiles it with ``backend`` (None: runs it as Python)."""

    def compiler(fn):
        compiles.append(fn)
        return fn if backend is None else torch.compile(fn, backend=backend)

    return compiler


def chain(leaf: torch.Tensor, w: torch.Tensor, n: int = 45) -> torch.Tensor:
    """sin, ``* w`` and ``+ 0.1`` in turn: every third step sends a gradient to ``w``,
    whose AccumulateGrad runs last, so gradients cross every region boundary."""
    y = leaf
    for i in range(n):
        y = torch.sin(y) if i % 3 == 0 else y * w if i % 3 == 1 else y + 0.1
    return y.sum()


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_a_chain_compiles_one_region_per_shape_and_matches_eager(backend):
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    chain(leaf, w).backward()
    expected = grads_of([leaf, w])
    compiles: list = []
    compiler = counting(compiles, backend)
    for _ in range(3):
        leaf.grad = w.grad = None
        replaygrad.backward(chain(leaf, w), compiler=compiler)
        assert_grads_equal(expected, grads_of([leaf, w]), exact=backend is None)
    (entry,) = cache._entries.values()
    regions = entry.replay.regions
    assert len(regions) >= 7
    # Each region hands on the chain's gradient and the sum of w's gradients so far.
    assert all(len(r.exports) == 2 for r in regions[:-1])
    # The first region (the root's), the repeated one, the last (AccumulateGrads): 3
    # functions compiled, once, for 7+ regions over 3 calls.
    assert len({r.key for r in regions}) == len(compiles) <= 3
    assert cache.misses == 1 and cache.hits == 2


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_chains_of_other_lengths_reuse_the_repeated_region(backend):
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    compiles: list = []
    compiler = counting(compiles, backend)
    keys = []
    for n in (45, 60):
        replaygrad.backward(chain(leaf, w, n), compiler=compiler)
        keys.append({r.key for r in cache._entries[next(reversed(cache._entries))].replay.regions})
    assert keys[0] & keys[1]
    assert len(compiles) == len(keys[0] | keys[1])


@pytest.mark.parametrize("compiler", ["python", None, "aot_eager"])
def test_hooks_in_many_regions_run_as_in_eager(compiler):
    if compiler == "python":
        compiler = counting([])  # compiled regions, run as Python

    def run(backward):
        torch.manual_seed(0)
        leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
        log = []
        y = leaf
        for i in range(30):
            y = torch.sin(y) if i % 2 else y * w
            if i % 7 == 3:
                y.register_hook(lambda g, i=i: log.append(("tensor", i, summary(g))) or g * 2)
            if i % 9 == 4:
                y.grad_fn.register_prehook(lambda gs, i=i: log.append(("pre", i, summary(gs))))
                y.grad_fn.register_hook(lambda gi, go, i=i: log.append(("post", i, summary(gi))))
            if i == 11:
                y.retain_grad()
                kept = y
        w.register_post_accumulate_grad_hook(lambda p: log.append(("acc", summary(p.grad))))
        backward(y.sum())
        log.append(("retained", summary(kept.grad)))
        return log, (leaf.grad, w.grad)

    compare(run, compiler)


@pytest.mark.parametrize("compiler", ["python", None, "aot_eager"])
def test_grad_captures_inputs_across_regions(compiler):
    if compiler == "python":
        compiler = counting([])  # compiled regions, run as Python
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    y = leaf
    middles = []
    for i in range(40):
        y = torch.sin(y) if i % 2 else y * w
        if i % 10 == 5:
            middles.append(y)
    unused = torch.randn(3, requires_grad=True)
    inputs = [w, *middles, leaf, unused]
    expected = torch.autograd.grad(y.sum(), inputs, retain_graph=True, allow_unused=True)
    got = replaygrad.grad(y.sum(), inputs, retain_graph=True, allow_unused=True, compiler=compiler)
    assert_grads_equal(list(expected), list(got), exact=not isinstance(compiler, str))


class Raise(Exception):
    pass


@pytest.mark.parametrize("compiler", ["python", None, "aot_eager"])
def test_an_error_in_a_late_region_keeps_the_earlier_accumulations(compiler):
    if compiler == "python":
        compiler = counting([])  # compiled regions, run as Python

    def fail(g):
        raise Raise("hook")

    def run(backward):
        torch.manual_seed(0)
        early, mid, late = (torch.randn(4, requires_grad=True) for _ in range(3))
        y = late
        for i in range(24):
            y = y * mid if i == 12 else y.sin()
            if i == 1:
                y.register_hook(fail)  # near the leaf: runs in the last region
        loss = early.sum() * 2 + y.sum()
        with pytest.raises(Raise, match="hook"):
            backward(loss)
        return [], (early.grad, mid.grad, late.grad)

    compare(run, compiler)


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_graph_breaks_inside_regions_run_the_current_nodes(backend):
    def make(scale):
        leaf = torch.full((4,), scale, requires_grad=True)
        y = leaf
        for i in range(24):
            y = Doubling.apply(y) if i % 5 == 2 else y.sin()
        return leaf, y.sum()

    compiles: list = []
    compiler = counting(compiles, backend)
    for scale in (0.5, 1.5):
        leaf, loss = make(scale)
        expected = torch.autograd.grad(loss, leaf, retain_graph=True)
        replaygrad.backward(loss, compiler=compiler)
        assert_grads_equal(list(expected), [leaf.grad], exact=backend is None)
    assert cache.misses == 1


def test_training_a_deep_mlp_compiles_once():
    def make():
        layers = []
        for _ in range(6):
            layers += [torch.nn.Linear(16, 16), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers)

    from conftest import compare_training

    compare_training(make, lambda: torch.randn(5, 16), "aot_eager", iterations=3)
    assert cache.misses == 1
    (entry,) = cache._entries.values()
    assert len(entry.replay.regions) > 3


def test_fullgraph_with_a_traced_hook_in_a_region():
    a = torch.randn(3, requires_grad=True)
    y = a
    for _ in range(12):
        y = y.sin()
    stuff = []

    def hook(grads):
        stuff.append(grads[0])
        return grads

    y.grad_fn.next_functions[0][0].register_prehook(hook)
    expected = torch.autograd.grad(y.sum(), a, retain_graph=True)
    seen_by_eager = stuff[:]
    stuff.clear()
    replaygrad.backward(y.sum(), compiler=torch.compile(backend="eager", fullgraph=True))
    assert_same(tuple(seen_by_eager), tuple(stuff), False, "hook")
    assert_same(expected[0], a.grad, False, "grad")


@pytest.mark.parametrize(
    "bad, error",
    [(0, ValueError), (-3, ValueError), (2.5, TypeError), ("4", TypeError), (True, TypeError)],
)
def test_region_size_must_be_a_positive_int(bad, error):
    with pytest.raises(error, match="region size"):
        replaygrad.set_region_size(bad)


def test_uncompiled_replays_run_in_regions_one_function_per_key():
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    chain(leaf, w).backward()
    expected = grads_of([leaf, w])
    for _ in range(2):
        leaf.grad = w.grad = None
        replaygrad.backward(chain(leaf, w), compiler=None)
        assert_grads_equal(expected, grads_of([leaf, w]), exact=True)
    (entry,) = cache._entries.values()
    regions = entry.replay.regions
    assert len(regions) >= 7
    functions = {id(entry.replay.fn.__globals__[f"R{r}"]) for r in range(len(regions))}
    assert len(functions) == len({r.key for r in regions}) <= 3


def test_no_regions_with_none():
    replaygrad.set_region_size(None)
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    replaygrad.backward(chain(leaf, w), compiler=counting([]))
    (entry,) = cache._entries.values()
    assert len(entry.replay.regions) == 1


def failing_from_the_second_region(compiles: list):
    """A compiler whose second region fails to compile when first called (Dynamo wraps a
    backend's errors in a TorchDynamoException)."""

    def compiler(fn):
        compiles.append(fn)
        if len(compiles) != 2:
            return fn

        def fail(*args):
            raise torch._dynamo.exc.TorchDynamoException("the backend failed")

        return fail

    return compiler


def early_and_late(graph_break: bool):
    """Leaves ``early`` (accumulated in the first region) and ``late`` (the last), and
    the loss; with ``graph_break``, a node that runs as itself in the first region."""
    torch.manual_seed(0)
    early, late = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    y = late
    for _ in range(20):
        y = y.sin()
    if graph_break:
        y = Doubling.apply(y)
    return early, late, early.sum() * 2 + y.sum()


def test_a_compile_failure_after_a_graph_break_is_not_handed_to_the_engine():
    # The graph break (seen outside the graphs) and early's accumulation are both in the
    # first region: when the second region fails, the engine cannot run the call again,
    # and early's accumulation is performed, as after an error.
    make = functools.partial(early_and_late, graph_break=True)
    early, late, loss = make()
    loss.backward()
    expected = grads_of([early, late])
    compiler = failing_from_the_second_region([])
    early, late, loss = make()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException) as info:
        replaygrad.backward(loss, compiler=compiler, fallback="eager")
    assert any("cannot run it instead" in note for note in info.value.__notes__)
    assert_grads_equal([expected[0]], [early.grad], exact=True)
    # Later calls with this plan run in the engine.
    early, late, loss = make()
    before = replaygrad.cache_info()
    replaygrad.backward(loss, compiler=compiler, fallback="eager")
    assert replaygrad.cache_info().hits == before.hits + 1
    assert_grads_equal(expected, grads_of([early, late]), exact=True)


def test_a_compile_failure_after_a_graph_break_is_remedied_for_later_calls():
    # Without fallback: the call cannot start over and raises, as after an error (early's
    # accumulation is performed); the replay is rebuilt with what ran outside the graphs
    # between compiled regions, and later calls replay it.
    make = functools.partial(early_and_late, graph_break=True)
    early, late, loss = make()
    loss.backward()
    expected = grads_of([early, late])
    compiles = []

    def compiler(fn):  # the second region fails on its first call only
        compiles.append(fn)
        if len(compiles) != 2:
            return fn

        def fail_once(*args):
            if compiles[1] is fn:
                compiles[1] = None
                raise torch._dynamo.exc.TorchDynamoException("the backend failed")
            return fn(*args)

        return fail_once

    early, late, loss = make()
    with pytest.raises(torch._dynamo.exc.TorchDynamoException) as info:
        replaygrad.backward(loss, compiler=compiler)
    assert any("could not start over" in note for note in info.value.__notes__)
    assert_grads_equal([expected[0]], [early.grad], exact=True)
    for _ in range(2):
        early, late, loss = make()
        replaygrad.backward(loss, compiler=compiler)
        assert_grads_equal(expected, grads_of([early, late]), exact=True)
    (entry,) = replaygrad._compile.cache._entries.values()
    assert entry.replay.breakless
    lookups = replaygrad.cache_info()
    assert (lookups.misses, lookups.hits) == (1, 2)


def test_a_compile_failure_before_anything_ran_falls_back_to_the_engine():
    make = functools.partial(early_and_late, graph_break=False)
    early, late, loss = make()
    loss.backward()
    expected = grads_of([early, late])
    early, late, loss = make()
    # early's accumulation is reached in the first region but only performed at the end:
    # nothing was seen outside the graph when the second region fails, so the engine
    # runs the call (accumulating once).
    replaygrad.backward(loss, compiler=failing_from_the_second_region([]), fallback="eager")
    assert_grads_equal(expected, grads_of([early, late]), exact=True)


def test_cuts_align_with_the_repeated_structure():
    from replaygrad._replay import _cuts

    # A head, 40 repeats of a 7-step block, a tail: regions start at the block's most
    # common step, so all but the first and the last are the same.
    block = ["a", "b", "a", "c", "d", "a", "e"]
    what = ["root", "x"] + block * 40 + ["acc", "acc"]
    cuts = _cuts(what, 20)
    assert cuts[0] == 0 and cuts[-1] == len(what)
    middle = [what[a:b] for a, b in pairwise(cuts[1:-1])]
    assert len(middle) >= 8 and all(m == middle[0] for m in middle)
    # Nothing repeats: cut every 20 steps. Small graphs: one region.
    assert _cuts([str(i) for i in range(100)], 20) == [0, 20, 40, 60, 80, 100]
    assert _cuts(what[:60], 20) == [0, 60]
    assert _cuts(what, None) == [0, len(what)]


def test_a_sparse_embedding_in_a_late_region_matches_eager_with_inductor():
    # The embedding's backward (a sparse gradient, which inductor cannot compile) runs in
    # the last region, after dense layers' accumulations were reached in earlier ones.
    torch.manual_seed(0)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append((torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 4)))
    (emb_e, lin_e), (emb_r, lin_r) = models

    def loss(emb, lin, ids):
        y = emb(ids)
        for _ in range(6):
            y = lin(y).tanh()
        return y.sum()

    for step in range(2):
        ids = torch.tensor([[1, 2, 2], [7, 1, 0]]) + step
        for emb, lin in models:
            emb.zero_grad(), lin.zero_grad()
        loss(emb_e, lin_e, ids).backward()
        replaygrad.backward(loss(emb_r, lin_r, ids), compiler="inductor")
        (entry,) = cache._entries.values()
        assert len(entry.replay.regions) > 3
        assert_same(summary(emb_e.weight.grad), summary(emb_r.weight.grad), False, "emb")
        assert_same(summary(lin_e.weight.grad), summary(lin_r.weight.grad), False, "lin")
    assert cache.misses == 1 and cache.hits == 1


def test_a_sparse_gradient_in_a_late_region_starts_the_call_over(monkeypatch):
    # gather(sparse_grad=True)'s gradient meets a dense one in the last region; inductor
    # fails on it there, after earlier regions ran and reached an accumulation, but nothing
    # was seen outside the graphs: the call starts over with that step run as itself.
    # (gather's saved flag is ignored here, as for a node not known to make sparse ones.)
    monkeypatch.setattr(replaygrad._replay, "_SPARSE_FLAGS", ())

    def run(backward):
        torch.manual_seed(0)
        leaf, early = torch.rand(4, 3, requires_grad=True), torch.rand(3, requires_grad=True)
        y = leaf.gather(0, torch.tensor([[0, 2, 1], [3, 3, 0]]), sparse_grad=True)
        y = y.sum(0) + (leaf * 2).sum(0)
        for _ in range(20):
            y = y.sin()
        backward((y + early).sum() * 3)
        return (), (leaf.grad, early.grad)

    compare(run, "inductor")
    (entry,) = cache._entries.values()
    assert len(entry.replay.regions) > 3 and entry.opaque


@pytest.mark.parametrize(
    ("value", "size"), [("", 300), ("none", None), (" NONE ", None), ("12", 12)]
)
def test_region_size_from_the_environment(monkeypatch, value, size):
    from replaygrad._compile import _region_size_from_env

    monkeypatch.setenv("REPLAYGRAD_REGION_SIZE", value)
    assert _region_size_from_env() == size


@pytest.mark.parametrize("value", ["0", "-4", "abc", "2.5"])
def test_a_bad_region_size_in_the_environment_is_an_error(monkeypatch, value):
    from replaygrad._compile import _region_size_from_env

    monkeypatch.setenv("REPLAYGRAD_REGION_SIZE", value)
    with pytest.raises(ValueError, match="REPLAYGRAD_REGION_SIZE"):
        _region_size_from_env()


def test_plan_source_shows_the_regions_a_compiler_runs():
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    loss = chain(leaf, w)
    source = replaygrad.plan(loss).source
    replaygrad.backward(loss, compiler=counting([]))
    (entry,) = cache._entries.values()
    assert source.count("def region(") == len(entry.replay.regions) > 3
    assert source == entry.replay.source


def test_only_the_region_of_a_data_dependent_step_is_compiled_again():
    """A step whose formula sizes its output from data (the backward of ``x[mask] += ...``)
    makes its region be compiled again capturing such ops; the other regions keep their
    compiled functions."""
    leaf, w = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)

    def loss(mask):
        h = chain(leaf, w, 30).expand(8) * leaf
        out = torch.zeros(8)
        out[mask] += h[mask].tanh()
        return out.square().sum()

    compiles: list = []
    compiler = counting(compiles, "aot_eager")
    for count in (2, 5, 3, 6):
        mask = torch.zeros(8, dtype=torch.bool)
        mask[:count] = True
        loss(mask).backward()
        expected = grads_of([leaf, w])
        leaf.grad = w.grad = None
        replaygrad.backward(loss(mask), compiler=compiler)
        assert_grads_equal(expected, grads_of([leaf, w]), exact=False)
        leaf.grad = w.grad = None
    (entry,) = cache._entries.values()
    regions = len(entry.replay.regions)
    assert regions > 3
    assert len(entry.capture) == 1
    assert len(compiles) == len({r.key for r in entry.replay.regions}) + 1


def test_regions_do_not_read_undefined_saved_values():
    """Dynamo guards on every value a compiled region reads. An undefined saved value (here
    MulBackward0's ``self``: ``y * w`` saves it only for ``w``'s gradient) is known to be
    None from the key, so the region passes None without reading it; and every region's
    compile gets the user's ``options`` (torch.compile pops ``guard_filter_fn`` from the
    dict it is given)."""
    leaf = torch.randn(8, requires_grad=True)
    w = torch.randn(8)
    guards: list = []

    def record(entries):
        guards.append([(g.guard_type, g.name) for g in entries])
        return [True] * len(entries)

    chain(leaf, w).backward()
    expected = grads_of([leaf])
    leaf.grad = None
    with replaygrad.enable("aot_eager", options={"guard_filter_fn": record}):
        chain(leaf, w).backward()
    assert_grads_equal(expected, grads_of([leaf]), exact=False)
    (entry,) = cache._entries.values()
    assert len(guards) == len({r.key for r in entry.replay.regions}) >= 3
    # TENSOR_MATCH, DUPLICATE_INPUT (w is saved by every MulBackward0), no NONE_MATCH.
    read = {kind for region in guards for kind, name in region if name.startswith("saved[")}
    assert "TENSOR_MATCH" in read and "CONSTANT_MATCH" not in read
