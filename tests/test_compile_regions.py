"""Region plans, region programs and regions compiled end to end.

The planning and ordering tests run region graphs eagerly (no Inductor, fast).
The end-to-end tests compile with Inductor's CPU code generator, which calls a
C++ compiler per graph: they use tiny models and are marked ``slow``. The
``cuda`` tests need a GPU.
"""

import random

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from compile_models import Inception, inception, inception_args, inception_in_regions  # noqa: E402
from streamdag.frontend.inductor_regions import CompiledRegion, RegionProgram, region_graph  # noqa: E402
from streamdag.frontend.regions import plan_regions  # noqa: E402

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def eager_program(gm, plan):
    """The plan's regions run as eager FX graphs, in a RegionProgram: checks cuts and waits, not Inductor."""
    compiled = []
    for region in plan.regions:
        sub = region_graph(gm, region, [n.meta.get("val") for n in region.inputs])
        compiled.append(CompiledRegion(region, lambda args, sub=sub: sub(*args)))
    return RegionProgram(gm, plan, compiled)


def traced(fn, args):
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*args)


def random_branchy_fn(seed, width=16):
    """A random DAG of matmuls, activations and sums over one input: branches, joins, shared values."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    steps = []
    for i in range(rng.randint(4, 14)):
        kind = rng.choice(["mm", "mm", "act", "add"])
        srcs = [rng.randrange(i + 1) for _ in range(2 if kind == "add" else 1)]
        w = torch.randn(width, width, generator=g) / width ** 0.5
        steps.append((kind, srcs, w, rng.choice([torch.tanh, torch.relu, torch.sigmoid])))

    def fn(x):
        vals = [x]
        for kind, srcs, w, act in steps:
            a = vals[srcs[0]]
            vals.append(a @ w if kind == "mm" else act(a) if kind == "act" else a + vals[srcs[1]])
        return vals[-1], vals[len(vals) // 2]

    return fn


# -- region plans --------------------------------------------------------------------------------------

def test_an_inception_block_is_cut_into_one_region_per_branch_and_a_join():
    args = inception_args()
    gm = traced(inception, args)
    plan = plan_regions(gm, max_streams=4)
    assert plan.streams == 4 and plan.width == 4
    join = plan.regions[-1]
    assert any(n.target is torch.ops.aten.cat.default for n in join.nodes)
    assert set(plan.preds[-1]) == set(range(len(plan.regions) - 1)), "the join waits on every branch"
    branches = {r.stream for r in plan.regions[:-1]}
    assert branches == {0, 1, 2, 3}
    assert plan.gain > 0 and "regions on 4 streams" in str(plan)


def test_a_chain_stays_one_region_on_one_stream():
    ws = [torch.randn(8, 8) for _ in range(4)]

    def chain(x, *ws):
        for w in ws:
            x = torch.tanh(x @ w)
        return x

    plan = plan_regions(traced(chain, [torch.randn(2, 8), *ws]), max_streams=4)
    assert plan.streams == 1 and len(plan.regions) == 1 and plan.gain == 0


def test_writes_that_only_end_a_graph_leave_its_ops_without_flops_to_join_their_neighbours():
    """A training forward ends with AOTAutograd's ``copy_`` into the inputs it mutates (batch
    norm's running statistics): the activations and joins before it are cut as they are without
    the writes, not one region per pointwise op (each a tensor of its own, which Inductor's
    whole graph fuses away)."""
    w1, w2 = torch.randn(32, 32), torch.randn(32, 32)

    def branches(x, w1, w2):  # two branches and a normalization of their join, as a batch norm's
        y = torch.cat([torch.relu(x @ w1), torch.tanh(x @ w2)], 1)
        return ((y - y.mean(0)) * torch.rsqrt(y.var(0) + 1e-5)).relu().sum(1)

    def updating(x, w1, w2, stat):
        y = branches(x, w1, w2)
        stat.copy_(y)
        return y

    x, stat = torch.randn(64, 32), torch.zeros(64)
    plain = plan_regions(traced(branches, [x, w1, w2]), max_streams=4, min_stream_share=0.0)
    written = plan_regions(traced(updating, [x, w1, w2, stat]), max_streams=4, min_stream_share=0.0)
    assert plain.streams == written.streams == 2
    copy_ = torch.ops.aten.copy_.default
    cut = [[n.name for n in r.nodes if n.target is not copy_] for r in written.regions]
    assert cut == [[n.name for n in r.nodes] for r in plain.regions], (plain, written)
    assert written.regions[-1].nodes[-1].target is copy_


def test_a_branch_with_a_negligible_share_of_the_work_goes_back_to_stream_zero():
    big, small = torch.randn(1024, 1024), torch.randn(1024, 1)

    def lopsided(x, big, small):
        return (x @ big @ big @ big).sum() + (x @ small).sum()

    gm = traced(lopsided, [torch.randn(1024, 1024), big, small])
    assert plan_regions(gm, max_streams=4, min_stream_share=0).streams == 2
    assert plan_regions(gm, max_streams=4, min_stream_share=0.1).streams == 1


def test_regions_of_the_same_structure_have_the_same_code():
    ws = [torch.randn(8, 8) for _ in range(4)]

    def two_blocks(x, w1, w2, w3, w4):
        for a, b in ((w1, w2), (w3, w4)):
            x = torch.tanh(x @ a) + torch.relu(x @ b)
        return x

    gm = traced(two_blocks, [torch.randn(2, 8), *ws])
    plan = plan_regions(gm, max_streams=2, min_stream_share=0)
    codes = [region_graph(gm, r, [n.meta["val"] for n in r.inputs]).code for r in plan.regions]
    assert len(codes) == 6 and codes[0:3] == codes[3:6], "the second block repeats the first"


def test_work_on_parameters_and_epilogues_join_the_convolution_whose_kernels_take_them():
    def two_normalized_branches(x, w1, w2, v1, v2, g1, g2):
        conv = torch.nn.functional.conv2d
        a = conv(x, w1) * torch.rsqrt(v1 + 1e-5) * g1  # BatchNorm's scale, computed on parameters
        b = conv(x, w2) * torch.rsqrt(v2 + 1e-5) * g2
        return (a.relu() + b.relu()).sum(1)

    args = [torch.randn(1, 4, 8, 8), torch.randn(4, 4, 1, 1), torch.randn(4, 4, 1, 1),
            *[torch.rand(1, 4, 1, 1) + 0.5 for _ in range(4)]]
    plan = plan_regions(traced(two_normalized_branches, args), max_streams=4)
    assert plan.width == 2 and plan.streams == 2, "two convolutions: two branches, not one per op"
    assert len(plan.regions) == 3
    for branch in plan.regions[:2]:
        names = {n.target.__name__.split(".")[0] for n in branch.nodes}
        assert {"convolution", "rsqrt", "mul", "relu"} <= names, names


def test_the_cost_model_expects_many_small_independent_ops_to_pay_on_streams():
    from streamdag.frontend.inductor_backend import MIN_GAIN

    ws = [torch.randn(64, 64) / 8 for _ in range(4)]

    def four_chains(x, *ws):
        outs = []
        for w in ws:
            y = x
            for _ in range(6):
                y = torch.tanh(y @ w)
            outs.append(y)
        return sum(outs)

    plan = plan_regions(traced(four_chains, [torch.randn(8, 64), *ws]), max_streams=4)
    assert plan.streams == 4 and plan.gain >= MIN_GAIN, str(plan)


def test_the_cost_model_expects_a_residual_stage_not_to_pay_on_streams():
    from streamdag.frontend.inductor_backend import MIN_GAIN

    conv = torch.nn.functional.conv2d

    def block(x, w1, w2, w3, shortcut):
        return (conv(conv(conv(x, w1).relu(), w2, padding=1).relu(), w3) + shortcut).relu()

    def stage(x, wd, *ws):  # a ResNet stage: one projection shortcut beside the first block's three
        x = block(x, *ws[0:3], conv(x, wd))
        for i in range(3, len(ws), 3):
            x = block(x, *ws[i:i + 3], x)
        return x

    def w(o, i, k=1):
        return torch.randn(o, i, k, k) / 8

    ws = [w(32, 64), w(32, 32, 3), w(128, 32)] + [w(32, 128), w(32, 32, 3), w(128, 32)] * 3
    plan = plan_regions(traced(stage, [torch.randn(1, 64, 28, 28), w(128, 64), *ws]), max_streams=4)
    assert plan.streams == 2 and plan.gain < MIN_GAIN, str(plan)


def test_plan_regions_rejects_a_stream_budget_under_one():
    with pytest.raises(ValueError, match="max_streams must be at least 1"):
        plan_regions(traced(torch.relu, [torch.randn(2)]), max_streams=0)


# -- region programs: the waits order every reader after its writer ----------------------------------

@pytest.mark.parametrize("streams", [2, 3, 4])
def test_an_inception_block_equals_eager_in_any_order_its_waits_allow(streams):
    args = inception_args()
    gm = traced(inception, args)
    program = eager_program(gm, plan_regions(gm, max_streams=4))
    want = inception(*args)
    for seed in range(8):
        order = program.interleaving(streams, seed)
        (got,) = program.run(list(args), order=order)
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(25))
def test_random_branchy_graphs_equal_eager_in_any_order_their_waits_allow(seed):
    fn = random_branchy_fn(seed)
    x = torch.randn(4, 16)
    gm = traced(fn, [x])
    plan = plan_regions(gm, max_streams=3, min_stream_share=0)
    program = eager_program(gm, plan)
    want = fn(x)
    for streams in (1, 2, 3):
        for s in range(4):
            got = program.run([x], order=program.interleaving(streams, s))
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_a_write_into_an_input_waits_for_every_branch_that_reads_the_input():
    def reads_then_writes(x, w1, w2):
        y1, y2 = torch.tanh(x @ w1), torch.relu(x @ w2)
        x.mul_(2)
        return y1 + y2 + x

    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)
    x = torch.randn(4, 8)
    gm = traced(torch.func.functionalize(reads_then_writes, remove="mutations_and_views"), [x, w1, w2])
    assert any(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes)
    program = eager_program(gm, plan_regions(gm, max_streams=4, min_stream_share=0))
    assert program.plan.streams >= 2
    x_want = x.clone()
    want = reads_then_writes(x_want, w1, w2)
    for seed in range(8):
        x_got = x.clone()
        (got,) = program.run([x_got, w1, w2], order=program.interleaving(4, seed))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(x_got, x_want, rtol=0, atol=0)


# -- end to end with Inductor on the CPU (slow: a C++ compile per graph) -------------------------------

@pytest.mark.slow
def test_an_inception_block_compiled_into_regions_equals_eager_in_any_order():
    m, c, x = inception_in_regions()
    with torch.no_grad():
        program = c.backend.runners[0].switch.program
        assert program is not None and program.plan.streams == 4
        seen, run = [], program.run
        program.run = lambda args, *rest, **kw: seen.append(list(args)) or run(args, *rest, **kw)
        torch.testing.assert_close(c(x), m(x))
        (args,) = seen
        for seed in range(4):
            (got,) = program.run(list(args), order=program.interleaving(4, seed))
            torch.testing.assert_close(got, m(x))
    assert "regions on 4 streams" in c.explain()


def _inception_on_regions_as_eager():
    """An Inception block compiled with regions="always", called once without gradients (checked
    against eager); the compiled model."""
    torch.manual_seed(0)
    m = Inception().eval()
    c = sd.compile(m, regions="always")
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
    return c


@pytest.mark.slow
def test_a_graph_the_region_planner_fails_on_still_runs_inductors_whole_graph(monkeypatch):
    import streamdag.frontend.inner_compile as inner

    def broken(*args, **kwargs):
        raise AssertionError("the units of the graph form a cycle")

    monkeypatch.setattr(inner, "plan_regions", broken)
    c = _inception_on_regions_as_eager()
    assert c.statistics().fallbacks == 0
    assert "no region plan (AssertionError: the units of the graph form a cycle)" in c.explain()


@pytest.mark.slow
def test_regions_compiled_on_the_cpu_leave_inductors_whole_graph_running_and_explain_says_so():
    said = _inception_on_regions_as_eager().explain()
    assert "candidate regions x2" in said, said
    assert "on the CPU: inductor runs uncaptured (nothing is timed: candidates= picks another)" in said, said


def test_a_regions_label_a_graph_cannot_offer_runs_inductors_graph_and_says_why():
    model = torch.nn.Linear(8, 8)
    fast = sd.compile(model, regions="always", candidates=["regions x2"])
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    assert "no candidate of ['regions x2'] for this graph" in fast.explain(), fast.explain()


# -- CUDA --------------------------------------------------------------------------------------------

@pytest.mark.cuda
def test_an_inception_block_runs_its_regions_on_several_streams_in_one_cuda_graph(no_tf32):
    torch.manual_seed(0)
    m = Inception(c=64).eval().cuda()
    c = sd.compile(m, regions="always", candidates=["regions"])
    with torch.inference_mode():
        pairs = []
        for _ in range(4):
            x = torch.randn(1, 64, 28, 28, device="cuda")
            pairs.append((c(x), m(x)))
        for got, want in pairs:  # earlier outputs are the caller's: later replays leave them alone
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    runner = c.backend.runners[0]
    assert runner.chosen.label.startswith("regions") and runner.chosen.streams >= 1
    stats = c.statistics()
    assert stats.captures >= 1 and stats.replays >= 3 and stats.uncaptured_calls == 0


@pytest.mark.cuda
def test_a_replay_on_a_side_stream_is_ordered_with_the_callers_work(no_tf32):
    torch.manual_seed(0)
    m = Inception(c=32).eval().cuda()
    c = sd.compile(m, regions="always", candidates=["regions"])
    side = torch.cuda.Stream()
    with torch.inference_mode():
        x = torch.randn(1, 32, 16, 16, device="cuda")
        c(x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x2 = torch.randn(1, 32, 16, 16, device="cuda") * 3
            got = c(x2) + 0  # used on the caller's stream with no synchronization in between
        torch.cuda.current_stream().wait_stream(side)
        torch.testing.assert_close(got, m(x2), rtol=1e-4, atol=1e-4)
