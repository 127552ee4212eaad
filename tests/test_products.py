"""Weights whose gradient is a matrix product (``nn.Linear``, ``x @ W``) or a sum of them
(an unrolled cell's): compiled replays hand back the factors, and one matrix product makes
the gradient or adds it to an existing ``.grad`` (``addmm_``). The factors held for a weight
take no more memory than its gradient: the tests' weights are wide for their few rows. Each
test compares with eager over several backward calls that accumulate, the first into no
``.grad``."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import replaygrad
from replaygrad._compile import cache
from replaygrad._replay import _product_blocks

from conftest import assert_grads_equal


def aot(fn):
    """torch.compile with aot_eager as a compiler callable: replays compiled with it take
    products' factors, which replays compiled with torch's debugging backends by name do not
    (``Config.products``)."""
    return torch.compile(fn, backend="aot_eager")


FACTORING = [aot, "inductor"]


def factored(source: str) -> int:
    return source.count("product_factors(")


def blocks(source: str) -> int:
    return source.count("product_block(")


def replay_sources() -> list[str]:
    return [entry.replay.source for entry in cache._entries.values()]


def assert_factored_where_compiled(compiler) -> None:
    """The scenario took the products' path (which compiled replays but aot_eager's by name
    take, see ``Config.products``)."""
    expected = compiler not in (None, "aot_eager")
    assert any(factored(source) for source in replay_sources()) == expected


class Forms(torch.nn.Module):
    """One weight per way a matrix product reaches it (on inputs of two rows)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        p = lambda *shape: torch.nn.Parameter(torch.randn(*shape, dtype=dtype))  # noqa: E731
        self.linear = p(8, 8)  # F.linear with a bias: addmm(b, x, W.t())
        self.bias = p(8)
        self.nobias = p(8, 8)  # F.linear without a bias: mm(x, W.t())
        self.right = p(8, 6)  # x @ W
        self.addmm = p(6, 6)  # addmm(b, x, W)
        self.scaled = p(6, 8)  # addmm(b, x, W, alpha=2): not factored
        self.shared = p(8, 8)  # in two products: its gradient is their sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.linear, self.bias).tanh()
        h = F.linear(h, self.nobias).tanh()
        h = (h @ self.right).tanh()
        h = torch.addmm(self.bias[:6], h, self.addmm).tanh()
        h = torch.addmm(self.bias, h, self.scaled, alpha=2.0)
        return (h @ self.shared @ self.shared).square().sum()


def accumulate(model: torch.nn.Module, inputs: list[torch.Tensor], compiler=None) -> list:
    """Backward of each input without zeroing (the first into no .grad): the gradients after
    each call, and the .grad objects."""
    seen = []
    for x in inputs:
        if compiler is False:
            model(x).backward()
        else:
            replaygrad.backward(model(x), compiler=compiler)
        seen.append([p.grad.clone() for p in model.parameters()])
    return seen


@pytest.mark.parametrize("compiler", FACTORING)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_of_matrix_products_accumulate_as_in_eager(compiler, dtype):
    eager = Forms(dtype)
    rg = copy.deepcopy(eager)
    inputs = [torch.randn(2, 8, dtype=dtype) for _ in range(4)]
    expected = accumulate(eager, inputs, compiler=False)
    got = accumulate(rg, inputs, compiler=compiler)
    for after_eager, after_rg in zip(expected, got):
        assert_grads_equal(after_eager, after_rg, exact=False, scaled=True)
    for e, g in zip(eager.parameters(), rg.parameters()):
        assert g.grad.stride() == e.grad.stride()
    # All but scaled (alpha 2).
    (source,) = replay_sources()
    assert factored(source) == 5


def test_an_existing_grad_is_added_to_in_place():
    model = torch.nn.Linear(8, 6)
    x = torch.randn(2, 8)
    replaygrad.backward(model(x).sum(), compiler=aot)
    grad = model.weight.grad
    version = grad._version
    before = grad.clone()
    replaygrad.backward(model(x).sum(), compiler=aot)
    assert model.weight.grad is grad and grad._version > version
    torch.testing.assert_close(grad, 2 * before)


@pytest.mark.parametrize("compiler", [None, "aot_eager"])
def test_uncompiled_and_debugging_replays_run_the_nodes_formulas(compiler):
    # Bit for bit eager's: uncompiled, and with aot_eager, which runs eager's ops.
    model = Forms()
    eager = copy.deepcopy(model)
    inputs = [torch.randn(2, 8) for _ in range(3)]
    expected = accumulate(eager, inputs, compiler=False)
    got = accumulate(model, inputs, compiler=compiler)
    for after_eager, after_rg in zip(expected, got):
        assert_grads_equal(after_eager, after_rg, exact=True)
    assert all(factored(source) == 0 for source in replay_sources())


def run_both(make, step, compiler=aot, calls=3):
    """Runs ``step(model)`` (a backward) on an eager model and a replaygrad copy ``calls``
    times and compares every parameter's .grad after each."""
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    rg = make()
    for _ in range(calls):
        step(eager)
        with replaygrad.enable(compiler):
            step(rg)
        for e, g in zip(eager.parameters(), rg.parameters()):
            if e.grad is None:
                assert g.grad is None
            else:
                assert_grads_equal([e.grad], [g.grad], exact=False, scaled=True)
    return eager, rg


@pytest.mark.parametrize("compiler", [None, aot])
def test_a_non_contiguous_grad_stays_the_grad(compiler):
    # .grad set by the user with other strides: eager adds to it in place, as addmm_ does.
    def make():
        model = torch.nn.Linear(8, 6)
        model.weight.grad = torch.ones(8, 6).t()
        return model

    x = torch.randn(2, 8)
    eager, rg = run_both(make, lambda m: m(x).sum().backward(), compiler)
    assert rg.weight.grad.stride() == eager.weight.grad.stride() == (1, 6)
    assert_factored_where_compiled(compiler)


@pytest.mark.parametrize("compiler", [None, aot])
def test_a_grad_that_holds_the_input(compiler):
    # x is the first rows of W.grad, which the product reads: eager forms the product, then
    # adds it to W.grad, x included.
    def step(model):
        grad = torch.arange(64.0).view(8, 8) / 100
        x = grad[:2]
        model.weight.grad = grad
        (model(x) ** 2).sum().backward()
        model.x = x

    eager, rg = run_both(lambda: torch.nn.Linear(8, 8, bias=False), step, compiler, calls=1)
    torch.testing.assert_close(rg.x, eager.x)
    assert_factored_where_compiled(compiler)


@pytest.mark.parametrize("compiler", [None, aot])
def test_hooks_on_the_weight_see_what_eager_shows(compiler):
    def make():
        model = torch.nn.Linear(8, 6)
        model.seen = []
        model.weight.register_hook(lambda g: g * 2)
        model.weight.register_post_accumulate_grad_hook(lambda p: model.seen.append(p.grad.clone()))
        return model

    x = torch.randn(2, 8)
    eager, rg = run_both(make, lambda m: m(x).sum().backward(), compiler, calls=2)
    assert len(rg.seen) == len(eager.seen) == 2
    assert_grads_equal(eager.seen, rg.seen, exact=False)


@pytest.mark.parametrize("compiler", [None, aot])
def test_a_hook_registered_on_the_weight_during_the_backward(compiler):
    # The first module's weight gets a hook from a hook that runs before its AccumulateGrad:
    # the accumulation then forms the product and runs the node with its hooks.
    def make():
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 4))
        model.calls = []

        def register(grad):
            model[0].weight.register_hook(lambda g: model.calls.append(1) or g * 3)
            return grad

        model[2].weight.register_hook(register)
        return model

    x = torch.randn(2, 8)
    eager, rg = run_both(make, lambda m: m(x).sum().backward(), compiler, calls=2)
    assert rg.calls == eager.calls
    assert_factored_where_compiled(compiler)


@pytest.mark.parametrize("compiler", [None, aot])
def test_a_weight_that_stops_requiring_grad_after_the_forward(compiler):
    def step(model):
        loss = model(torch.randn(2, 8)).sum()
        model.weight.requires_grad_(False)
        loss.backward()
        model.weight.requires_grad_(True)

    run_both(lambda: torch.nn.Linear(8, 6), step, compiler)
    assert_factored_where_compiled(compiler)


def test_complex_weights_accumulate_the_conjugate_product():
    def make():
        model = torch.nn.Linear(8, 6, dtype=torch.complex64)
        return model

    x = torch.randn(2, 8, dtype=torch.complex64)
    run_both(make, lambda m: m(x).abs().sum().backward())


def test_a_batch_of_sequences_through_linear_layers():
    # 3-d inputs: linear flattens them into one addmm.
    def make():
        return torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 16)
        )

    x = torch.randn(2, 1, 16)
    run_both(make, lambda m: m(x).square().mean().backward(), "inductor")
    (source,) = replay_sources()
    assert factored(source) == 2


def unrolled_cell(steps: int, rows: int | list[int], compiler) -> str:
    """Compares a GRUCell(16, 16) unrolled ``steps`` steps over ``rows`` rows (a list: per
    call) with eager (see :func:`run_both`); the replay's source."""
    batches = rows if isinstance(rows, list) else [rows] * 3
    # run_both steps the eager model, then replaygrad's: each batch twice.
    inputs = iter([xs for b in batches for xs in [torch.randn(steps, b, 16)] * 2])

    def step(cell):
        xs = next(inputs)
        h = torch.zeros(xs.shape[1], 16)
        for x in xs:
            h = cell(x, h)
        h.square().sum().backward()

    run_both(lambda: torch.nn.GRUCell(16, 16), step, compiler, calls=len(batches))
    (source,) = replay_sources()
    return source


@pytest.mark.parametrize("compiler", FACTORING)
def test_an_unrolled_cells_weights_take_one_product(compiler):
    # Each weight of the cell is in one addmm per step: their gradients' sum is one product
    # of the steps' factors stacked.
    assert factored(unrolled_cell(4, 2, compiler)) == 2


def test_a_weight_in_a_product_and_elsewhere_is_not_factored():
    # W's gradient is a product plus the gradient of W.sum(): formed as in eager.
    def make():
        return torch.nn.Linear(8, 6)

    x = torch.randn(2, 8)
    run_both(make, lambda m: (m(x).sum() + m.weight.sum()).backward())
    (source,) = replay_sources()
    assert factored(source) == 0


@contextlib.contextmanager
def region_size(steps: int | None):
    prior = cache.region_size
    replaygrad.set_region_size(steps)
    try:
        yield
    finally:
        replaygrad.set_region_size(prior)


@pytest.mark.parametrize("compiler", FACTORING)
def test_a_long_unrolled_cell_adds_blocks_of_products_up_in_the_graph(compiler):
    # Each step's factors of a weight take 3 * (48 + 16) elements, its gradient 48 * 16: four
    # steps' fit. Of ten steps in one region, the first eight are added up in the graph in
    # two blocks as they arrive, the last two's product added to that sum.
    with region_size(None):
        source = unrolled_cell(10, 3, compiler)
    assert source.count("def region") == 1
    assert (factored(source), blocks(source)) == (2, 4)


@pytest.mark.parametrize("compiler", FACTORING)
def test_an_unrolled_cell_is_cut_into_regions_of_a_blocks_steps(compiler):
    # As above, with regions (the default): a compiler schedules a region's kernels as it
    # sees fit (inductor made every block at the region's end, holding all the factors until
    # then), so the regions span a block's steps, each sending its products on.
    source = unrolled_cell(10, 3, compiler)
    assert source.count("def region") == 3
    assert source.count("product_sum(") == 2 * 2
    assert (factored(source), blocks(source)) == (2, 0)


@pytest.mark.parametrize("compiler", FACTORING)
def test_a_product_larger_than_the_gradient_is_formed_by_its_node(compiler):
    # The factors of 7 rows take 7 * (5 + 3) elements, the gradient 5 * 3: holding them until
    # the accumulation would take more memory than eager holds.
    x = torch.randn(7, 5)
    run_both(lambda: torch.nn.Linear(5, 3), lambda m: m(x).sum().backward(), compiler)
    (source,) = replay_sources()
    assert factored(source) == 0


def test_blocks_hold_no_more_than_the_gradient():
    # Products of 2, 2, 4 and 1 rows: factors of 16 elements a row on a weight of 6 x 10 (60
    # elements), 20 on one of 10 x 10.
    rows = [torch.empty(2, 10), torch.empty(2, 10), torch.empty(4, 10), torch.empty(1, 10)]
    uses = [(s, s, False, s) for s in range(4)]  # (matmul step, slot, transposed, source)
    assert _product_blocks(uses, (6, 10), rows) == ()  # each alone: nothing gained
    assert _product_blocks(uses[:3], (10, 10), rows) == ((uses[0], uses[1]), (uses[2],))
    assert _product_blocks(uses[:1], (6, 10), rows) == ((uses[0],),)
    assert _product_blocks(uses[2:3], (6, 10), rows) == ()
    assert _product_blocks(uses, (10, 10), rows) == ((uses[0], uses[1]), (uses[2], uses[3]))
    assert _product_blocks(uses[:2], (6, 10), rows) == ()


def aot_fullgraph(fn):
    """aot_eager as a compiler callable that allows no graph break."""
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize(
    ("region", "compiler"), [(7, aot), (20, aot), (60, aot), (20, "inductor"), (20, aot_fullgraph)]
)
def test_products_across_regions(region, compiler):
    # An unrolled cell split into regions: each region sends the products it made on to the
    # next (what came before plus its own, one matrix product), and the last region's go
    # into the accumulation.
    with region_size(region):
        source = unrolled_cell(30, 3, compiler)
    assert source.count("def region") > 1
    assert source.count("product_sum(") > 0
    assert factored(source) == 2


def test_blocks_are_sized_by_the_first_batch():
    # Blocks of four steps at 3 rows; other batch sizes (dynamic) keep them.
    with region_size(None):
        source = unrolled_cell(10, [3, 7, 2, 12], aot)
    assert (factored(source), blocks(source)) == (2, 4)


@pytest.mark.parametrize("compiler", FACTORING)
def test_a_backward_under_autocast_takes_the_products_of_its_nodes(compiler):
    # Under autocast a matrix product is made in low precision, and the engine casts each
    # product's gradient to the weight's dtype (validate_outputs) before it is summed or
    # accumulated: factors handed back (or blocks summed in the graph) would give the weight
    # a bfloat16 .grad. Calls alternate between autocast and none; the first is into no .grad.
    # run_both steps the eager cell, then replaygrad's: each input and autocast state twice.
    calls = [(x, k % 2 == 0) for k, x in enumerate(torch.randn(4, 4, 3, 16)) for _ in range(2)]
    inputs = iter(calls)

    def step(cell):
        xs, autocast = next(inputs)
        h = torch.zeros(3, 16)
        for x in xs:
            h = cell(x, h)
        loss = h.square().sum()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss.backward()

    _, rg = run_both(lambda: torch.nn.GRUCell(16, 16), step, compiler, calls=4)
    assert all(p.grad.dtype == torch.float32 for p in rg.parameters())


def test_weights_on_a_device_without_autocast():
    # Whether autocast is on is asked only of devices that have it (meta has not: asking
    # raises).
    w = torch.randn(8, 8, device="meta", requires_grad=True)
    x = torch.randn(4, 8, device="meta")
    for _ in range(2):
        replaygrad.backward((x @ w).sum(), compiler=aot)
    assert (w.grad.shape, w.grad.device, w.grad.dtype) == (w.shape, w.device, w.dtype)
    assert_factored_where_compiled(aot)
