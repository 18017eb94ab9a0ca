"""The Inductor compile path: region plans, region programs, candidate choice, and models end to end.

The planning and ordering tests run region graphs eagerly (no Inductor, fast).
The end-to-end tests compile with Inductor's CPU code generator, which calls a
C++ compiler per graph: they use tiny models and are marked ``slow``. The
``cuda`` tests need a GPU.
"""

import copy
import dataclasses
import random
import warnings

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from streamdag.frontend.candidates import Candidate, pick  # noqa: E402
from streamdag.frontend.compiled_model import CompiledModel  # noqa: E402
from streamdag.frontend.inductor_regions import CompiledRegion, RegionProgram, region_graph  # noqa: E402
from streamdag.frontend.regions import plan_regions  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Dynamo's caches per code object: each test's models start from none (and its recompile limit)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def inception(x, w1, w2a, w2b, w3a, w3b, w4):
    """A googlenet-like inception block: four branches of one input, concatenated."""
    conv = torch.nn.functional.conv2d
    b1 = conv(x, w1).relu()
    b2 = conv(conv(x, w2a).relu(), w2b, padding=1).relu()
    b3 = conv(conv(x, w3a).relu(), w3b, padding=2).relu()
    b4 = conv(torch.nn.functional.max_pool2d(x, 3, 1, 1), w4).relu()
    return torch.cat([b1, b2, b3, b4], 1)


def inception_args(c=8, hw=8):
    g = torch.Generator().manual_seed(0)

    def r(*s):
        return torch.randn(*s, generator=g) / 4

    return [r(1, c, hw, hw), r(4, c, 1, 1), r(4, c, 1, 1), r(4, 4, 3, 3), r(2, c, 1, 1), r(4, 2, 5, 5),
            r(4, c, 1, 1)]


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


# -- the choice between candidates --------------------------------------------------------------------

def _cand(label, streams, ms, mib=10.0):
    return Candidate(label, streams, lambda args: args, ms=ms, peak_mib=mib)


def test_the_fastest_candidate_is_kept():
    cands = [_cand("eager", 1, 2.0), _cand("inductor", 1, 1.5), _cand("regions x2", 2, 1.0)]
    assert cands[pick(cands)].label == "regions x2"


def test_a_tie_goes_to_fewer_streams():
    cands = [_cand("eager", 1, 1.2), _cand("inductor", 1, 1.0), _cand("regions x2", 2, 0.99),
             _cand("regions x3", 3, 0.985)]
    assert cands[pick(cands, tie=0.02)].label == "inductor"


def test_more_streams_must_beat_the_best_on_fewer_not_only_their_own_kind():
    cands = [_cand("inductor", 1, 1.0), _cand("regions x2", 2, 0.9), _cand("regions x3", 3, 0.89)]
    assert cands[pick(cands, tie=0.02)].label == "regions x2"


def test_a_multi_stream_candidate_that_needs_much_more_memory_is_not_kept():
    cands = [_cand("inductor", 1, 1.0, mib=100), _cand("regions x2", 2, 0.5, mib=200)]
    assert cands[pick(cands, memory_ratio=1.1)].label == "inductor"
    assert "not kept" in cands[1].notes[0]


def test_the_memory_rule_counts_the_graphs_weights_with_each_candidates_pool():
    # a one-stream capture that needs no pool of its own must not reject every second stream
    cands = [_cand("inductor", 1, 1.0, mib=0.0), _cand("regions x3", 3, 0.9, mib=22.0)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=250.0)].label == "regions x3"
    cands = [_cand("inductor", 1, 1.0, mib=0.0), _cand("regions x3", 3, 0.9, mib=80.0)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=20.0)].label == "inductor"
    assert "with the graph's inputs it needs 100.0 MiB" in cands[1].notes[0]


def test_each_added_stream_may_hold_its_own_allocator_segments_over_the_memory_ratio():
    """A small model's streams each draw whole segments from the pool (the googlenet case: 24 MiB of
    pool on one stream, 52 on three), which the ratio alone would count against a faster replay."""
    from streamdag.frontend.candidates import STREAM_SEGMENTS_MIB

    lean, weights = 24.0, 26.0
    within = lean + 2 * STREAM_SEGMENTS_MIB
    cands = [_cand("inductor", 1, 1.0, mib=lean), _cand("regions x3", 3, 0.67, mib=within)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=weights)].label == "regions x3"
    cands = [_cand("inductor", 1, 1.0, mib=lean), _cand("regions x2", 2, 0.67, mib=within)]
    assert cands[pick(cands, memory_ratio=1.1, base_mib=weights)].label == "inductor", \
        "one added stream is allowed one stream's segments, not two"


def test_picking_needs_every_candidate_timed():
    with pytest.raises(ValueError, match="needs its time"):
        pick([Candidate("inductor", 1, lambda a: a)])


# -- the entry points ---------------------------------------------------------------------------------

def test_the_make_fx_path_stays_available_by_name():
    from streamdag.frontend import Compiled

    assert isinstance(sd.compile(torch.relu, engine="aten"), Compiled)
    assert isinstance(sd.compile(torch.relu), CompiledModel)


def test_options_of_the_make_fx_path_name_the_engine_that_takes_them():
    with pytest.raises(TypeError, match="engine='aten'"):
        sd.compile(torch.relu, device="cpu")
    with pytest.raises(ValueError, match="engine must be one of"):
        sd.compile(torch.relu, engine="triton")
    with pytest.raises(ValueError, match="regions must be"):
        sd.compile(torch.relu, regions="sometimes")


def test_a_misspelt_option_is_refused_by_streamdag_compile_listing_the_options_it_takes():
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'stream'; it takes streams, regions, "):
        sd.compile(torch.relu, stream=2)


def test_a_graph_inductor_cannot_compile_runs_on_the_make_fx_path_and_says_so(monkeypatch):
    import torch._inductor.compile_fx as cfx

    def broken(*args, **kwargs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m)
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(c(x), m(x))
    assert any("make_fx path" in str(w.message) for w in caught)
    said = c.explain()
    assert "graph 0: Inductor failed (RuntimeError: no kernels today)" in said, said
    assert "1 call(s) without gradients ran on the make_fx path" in said, said
    assert c.statistics().fallbacks == 1 and c.statistics().calls == 1


def test_a_graph_inductor_fails_on_itself_runs_on_the_make_fx_path():
    """Inductor wraps its own failures (here: no working C++ compiler, as on a slim container) in an
    exception that is also one of Dynamo's; the backend still takes it for a failure of Inductor's,
    not for a signal to Dynamo."""
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m, inductor={"cpp.cxx": (None, "/no/such/c++"), "fx_graph_cache": False})
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        torch.testing.assert_close(c(x), m(x))
        torch.testing.assert_close(c(x), m(x))
    assert any("make_fx path" in str(w.message) for w in caught)
    said = c.explain()
    assert "graph 0: Inductor failed (InductorError: InvalidCxxCompiler" in said, said
    assert c.statistics().fallbacks == 1


def test_dynamos_signals_pass_on_and_inductors_failures_fall_back_however_they_are_wrapped():
    import torch._dynamo.exc as dynamo_exc
    import torch._inductor.exc as inductor_exc

    from streamdag.frontend.inductor_backend import _signal_in

    skip = dynamo_exc.SkipFrame("run the frame as written")
    assert _signal_in(skip) is skip
    assert _signal_in(inductor_exc.InductorError(skip, None)) is skip  # (wrapped past Inductor's cache)
    assert _signal_in(inductor_exc.InductorError(RuntimeError("no compiler"), None)) is None
    for failure in ("TritonMissing", "GPUTooOldForTriton"):  # (Dynamo's ShortenTraceback, not signals)
        kind = getattr(inductor_exc, failure, None)
        if kind is not None:
            assert _signal_in(kind.__new__(kind)) is None


def test_a_training_call_of_a_graph_inductor_cannot_compile_runs_the_traced_graph_with_its_gradients(
        monkeypatch):
    import torch._inductor.compile_fx as cfx

    def broken(*args, **kwargs):
        raise RuntimeError("no kernels today")

    monkeypatch.setattr(cfx, "compile_fx", broken)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c(x).square().sum().backward()
    ref(x).square().sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    said = [str(w.message) for w in caught if issubclass(w.category, sd.StreamdagWarning)]
    assert any("runs as Dynamo traced it, op by op, where it needs gradients" in w for w in said), said
    assert not any("runs inference graphs" in w for w in said), said
    stats = c.statistics()
    assert stats.calls == 1 and stats.uncaptured_calls == 1 and stats.eager_calls == 0, stats
    assert "1 call(s) with gradients ran it as Dynamo traced it" in c.explain(), c.explain()


# -- end to end with Inductor on the CPU (slow: a C++ compile per graph) -------------------------------

class Inception(torch.nn.Module):
    def __init__(self, c=8):
        super().__init__()
        conv = torch.nn.Conv2d
        self.b1 = conv(c, 4, 1)
        self.b2 = torch.nn.Sequential(conv(c, 4, 1), torch.nn.ReLU(), conv(4, 4, 3, padding=1))
        self.b3 = torch.nn.Sequential(conv(c, 2, 1), torch.nn.ReLU(), conv(2, 4, 5, padding=2))
        self.b4 = torch.nn.Sequential(torch.nn.MaxPool2d(3, 1, 1), conv(c, 4, 1))

    def forward(self, x):
        return torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], 1).relu()


def inception_in_regions():
    """An inception block compiled into regions alone, its first call equal to eager's: (the model,
    the compiled model, the input)."""
    torch.manual_seed(0)
    m = Inception().eval()
    c = sd.compile(m, regions="always", candidates=["regions"])
    x = torch.randn(2, 8, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), m(x))
    return m, c, x


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_sequential_model_equals_eager_and_compiles_no_regions():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32),
                            torch.nn.Linear(32, 4)).eval()
    c = sd.compile(m)
    x = torch.randn(3, 16)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(c(x), m(x))
    sw = c.backend.runners[0].switch
    assert sw.program is None and c.statistics().graphs == 1
    assert "candidate inductor" in c.explain()


@pytest.mark.slow
def test_switching_between_train_and_eval_compiles_again_and_follows_the_mode():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8)).eval()
    ref = copy.deepcopy(m)
    c = sd.compile(m)
    x = torch.randn(6, 8)
    with torch.no_grad():
        torch.testing.assert_close(c(x), ref(x))
        m.train()
        ref.train()
        torch.testing.assert_close(c(x), ref(x))  # batch statistics, not the running ones
        torch.testing.assert_close(m[1].running_mean, ref[1].running_mean)  # updated once, as eager
        m.eval()
        ref.eval()
        torch.testing.assert_close(c(x), ref(x))
    assert c.statistics().graphs == 2


@pytest.mark.slow
def test_a_replaced_parameter_is_read_at_the_next_call():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m)
    x = torch.randn(2, 8)
    with torch.no_grad():
        c(x)
        m[0].weight = torch.nn.Parameter(torch.randn(8, 8))
        torch.testing.assert_close(c(x), m(x))
        m[0].weight.mul_(3)  # and an in-place update of it
        torch.testing.assert_close(c(x), m(x))


@dataclasses.dataclass
class Out:
    logits: "torch.Tensor"
    hidden: "torch.Tensor"


class Structured(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return {"dict": {"a": h, "b": h.relu()}, "list": [h.sum(), h * 2], "dataclass": Out(h.tanh(), h)}


@pytest.mark.slow
def test_dict_list_and_dataclass_outputs_keep_their_types():
    torch.manual_seed(0)
    m = Structured().eval()
    c = sd.compile(m)
    x = torch.randn(2, 8)
    with torch.no_grad():
        got, want = c(x), m(x)
    assert isinstance(got["dict"], dict) and set(got["dict"]) == {"a", "b"}
    assert isinstance(got["list"], list) and len(got["list"]) == 2
    assert isinstance(got["dataclass"], Out)
    torch.testing.assert_close(got["dict"]["b"], want["dict"]["b"])
    torch.testing.assert_close(got["list"][1], want["list"][1])
    torch.testing.assert_close(got["dataclass"].logits, want["dataclass"].logits)
    assert c.statistics().fallbacks == 0


@pytest.mark.slow
def test_parameters_made_under_inference_mode_compile_without_a_fallback():
    torch.manual_seed(0)
    with torch.inference_mode():
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()).eval()
        x = torch.randn(2, 8)
        want = m(x)
    c = sd.compile(m)
    with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ResourceWarning)  # (what an earlier test dropped, freed now)
        got = c(x)
    torch.testing.assert_close(got, want)
    assert not [w for w in caught if "streamdag" in str(w.message)]
    assert c.statistics().fallbacks == 0 and c.statistics().graphs == 1


@pytest.mark.slow
def test_bfloat16_models_compile_and_match_eager():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU(), torch.nn.Linear(16, 8)).eval()
    m = m.to(torch.bfloat16)
    c = sd.compile(m)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        got = c(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, m(x), rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_a_new_batch_size_compiles_a_new_specialization():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    c = sd.compile(m)
    with torch.no_grad():
        for batch in (1, 3, 1):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(c(x), m(x))
    assert c.statistics().graphs == 2


@pytest.mark.slow
def test_the_dynamo_backend_by_name_takes_the_inductor_path():
    import streamdag.frontend.dynamo  # noqa: F401 - registers the name
    from streamdag.frontend.inductor_backend import default_backend

    before = len(default_backend().runners)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Sigmoid()).eval()
    opt = torch.compile(m, backend="streamdag")
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x))
    assert len(default_backend().runners) == before + 1


class DataDependentArange(torch.nn.Module):
    """``arange`` of a tensor's value (Longformer's global attention does it): the graph Dynamo hands
    over fails AOTAutograd's trace with a fake-tensor exception, which Dynamo turns into a graph break."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, is_global):
        num = is_global.long().sum(dim=1)
        top = num.max()
        local = torch.arange(top, device=x.device) < num.unsqueeze(-1)
        keys = x.new_zeros(x.shape[0], top, 8)  # (Dynamo breaks the graph here)
        return self.proj(x).sum() + keys.sum() + local.sum()


@pytest.mark.slow
@pytest.mark.parametrize("grad", [False, True])
def test_an_op_whose_output_depends_on_data_breaks_the_graph_as_under_torch_compile(grad):
    torch.manual_seed(0)
    m = DataDependentArange()
    x, is_global = torch.randn(2, 16, 8), torch.zeros(2, 16, dtype=torch.bool)
    is_global[:, :3] = True
    c = sd.compile(m)
    with torch.set_grad_enabled(grad), warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        for _ in range(2):
            torch.testing.assert_close(c(x, is_global), m(x, is_global))
    stats = c.statistics()
    assert stats.fallbacks == 0 and stats.eager_calls == 0 and stats.graphs >= 1, c.explain()


@pytest.mark.slow
def test_a_float_argument_that_changes_is_traced_again_by_dynamo_not_left_to_a_fallback():
    """Under torch.compile's default (dynamic=None) a float argument that changes becomes a symbolic
    input; where Inductor cannot keep it so (a scale an attention kernel takes as a number), it asks
    Dynamo, by an exception, to trace again with the number fixed. The backend passes that on: each
    call runs compiled, and nothing falls back or warns."""
    import streamdag.frontend.dynamo  # noqa: F401 - registers the name
    from streamdag.frontend.inductor_backend import default_backend

    def attend(t, scale):
        return torch.nn.functional.scaled_dot_product_attention(t, t, t, scale=scale) * 2

    opt = torch.compile(attend, backend="streamdag")
    t = torch.randn(1, 2, 4, 8)
    fallbacks = default_backend().stats.fallbacks
    with warnings.catch_warnings():
        warnings.simplefilter("error", sd.StreamdagWarning)
        for scale in (0.5, 0.25, 0.125):
            torch.testing.assert_close(opt(t, scale), attend(t, scale))
    assert default_backend().stats.fallbacks == fallbacks


@pytest.mark.slow
def test_inputs_the_model_changes_in_place_are_changed_as_eager_changes_them():
    def f(x, w1, w2):
        y = torch.tanh(x @ w1) + torch.relu(x @ w2)
        x.add_(1)
        return y + x

    w1, w2 = torch.randn(16, 16), torch.randn(16, 16)
    for options in ({}, {"regions": "always", "candidates": ["regions"]}):
        torch._dynamo.reset()
        c = sd.compile(f, **options)
        x_got = torch.randn(4, 16)
        x_want = x_got.clone()
        with torch.no_grad():
            torch.testing.assert_close(c(x_got, w1, w2), f(x_want, w1, w2))
        torch.testing.assert_close(x_got, x_want)
        if options:  # the write into x is in a region after both branches
            assert c.backend.runners[0].switch.program.plan.streams == 2


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
def test_every_candidate_is_captured_and_timed_and_the_fastest_kept(no_tf32):
    torch.manual_seed(0)
    m = Inception(c=64).eval().cuda()
    c = sd.compile(m, regions="always")
    x = torch.randn(1, 64, 28, 28, device="cuda")
    with torch.inference_mode():
        torch.testing.assert_close(c(x), m(x), rtol=1e-4, atol=1e-4)
    runner = c.backend.runners[0]
    labels = [cand.label for cand in runner.candidates]
    assert labels[:2] == ["eager", "inductor"] and any(lb.startswith("regions x") for lb in labels)
    timed = [cand for cand in runner.candidates if cand.ms is not None]
    assert len(timed) == len(runner.candidates), c.explain()
    fewest = min(cand.ms for cand in timed if cand.streams == 1)
    assert runner.chosen.ms <= fewest * 1.0001, c.explain()
    assert "<- chosen" in c.explain()


@pytest.mark.cuda
def test_a_candidates_capture_is_measured_as_what_its_pool_holds():
    from streamdag.frontend.candidates import CapturedGraph, SharedPool

    x = torch.randn(1024, 1024, device="cuda")
    held = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    del held  # cached by the allocator: the capture's own emptying of the cache must not offset it
    cand = Candidate("inductor", 1, lambda args: [args[0] * 2 + 1])
    graph = CapturedGraph(cand, [x], [], [], SharedPool(), x.device, private=True)
    assert graph.peak_bytes >= 2 * x.nbytes  # two temporaries of 4 MiB at least


@pytest.mark.cuda
def test_a_candidate_that_cannot_be_captured_leaves_the_random_generator_and_the_pool_usable():
    from streamdag.frontend.candidates import CapturedGraph, SharedPool

    x = torch.randn(64, device="cuda")
    pool = SharedPool()
    syncs = Candidate("eager", 1, lambda args: [args[0] * float(args[0].sum().item())])
    with pytest.raises(RuntimeError):
        CapturedGraph(syncs, [x], [], [], pool, x.device)
    torch.randn(4, device="cuda")  # no "Offset increment outside graph capture"
    fine = CapturedGraph(Candidate("inductor", 1, lambda args: [args[0] * 2]), [x], [], [], pool, x.device)
    torch.testing.assert_close(fine([x])[0], x * 2)


@pytest.mark.cuda
def test_a_replaced_parameter_is_captured_again_on_cuda():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).eval().cuda()
    c = sd.compile(m)
    x = torch.randn(8, 64, device="cuda")
    with torch.inference_mode():
        c(x)
        c(x)
        with torch.inference_mode(False), torch.no_grad():
            m[0].weight = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
        torch.testing.assert_close(c(x), m(x))
    assert c.statistics().recaptures == 1


@pytest.mark.cuda
@pytest.mark.parametrize("whole_call", [True, False])
def test_on_cuda_a_convolution_captured_with_tf32_is_captured_again_when_cudnn_tf32_goes_off(whole_call):
    """cuDNN's TF32 switch, which Dynamo does not guard, reaches a compiled model as it reaches eager
    code: after it goes off, the outputs equal eager's without TF32 (bit for bit where both run the
    same algorithm, so compared closer than TF32's rounding)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 3, padding=1), torch.nn.ReLU()).eval().cuda()
    c = sd.compile(m, whole_call=whole_call)
    x = torch.randn(8, 64, 32, 32, device="cuda")
    was = torch.backends.cudnn.allow_tf32

    def captures():
        stats = c.statistics()
        return stats.whole_captures if whole_call else stats.captures

    try:
        torch.backends.cudnn.allow_tf32 = True
        with torch.no_grad():
            for _ in range(3):
                c(x)
            before = captures()
            torch.backends.cudnn.allow_tf32 = False
            for _ in range(3):
                got, want = c(x), m(x)
    finally:
        torch.backends.cudnn.allow_tf32 = was
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert captures() == before + 1


@pytest.mark.cuda
def test_the_dynamo_backend_by_name_replays_a_cuda_graph():
    import streamdag.frontend.dynamo  # noqa: F401
    from streamdag.frontend.inductor_backend import default_backend

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).eval().cuda()
    opt = torch.compile(m, backend="streamdag")
    x = torch.randn(4, 64, device="cuda")
    before = default_backend().statistics().replays
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(opt(x), m(x), rtol=1e-3, atol=1e-3)
    assert default_backend().statistics().replays >= before + 2


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


@pytest.mark.cuda
def test_inputs_changed_in_place_are_written_back_after_a_replay():
    def f(x, w):
        y = x @ w
        x.add_(1)
        return y + x

    w = torch.randn(16, 16, device="cuda")
    c = sd.compile(f)
    with torch.no_grad():
        for _ in range(3):
            x_got = torch.randn(4, 16, device="cuda")
            x_want = x_got.clone()
            torch.testing.assert_close(c(x_got, w), f(x_want, w), rtol=1e-3, atol=1e-3)
            torch.testing.assert_close(x_got, x_want)


@pytest.mark.cuda
def test_bfloat16_and_dict_outputs_on_cuda():
    torch.manual_seed(0)
    m = Structured().eval().cuda().to(torch.bfloat16)
    c = sd.compile(m)
    x = torch.randn(2, 8, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        got, want = c(x), m(x)
        got2 = c(x)
    assert isinstance(got["dataclass"], Out) and got["dict"]["a"].dtype == torch.bfloat16
    torch.testing.assert_close(got["dict"]["b"], want["dict"]["b"], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got2["list"][1], want["list"][1], rtol=2e-2, atol=2e-2)


def test_a_regions_label_a_graph_cannot_offer_runs_inductors_graph_and_says_why():
    model = torch.nn.Linear(8, 8)
    fast = sd.compile(model, regions="always", candidates=["regions x2"])
    x = torch.randn(4, 8)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    assert "no candidate of ['regions x2'] for this graph" in fast.explain(), fast.explain()


@pytest.mark.cuda
def test_on_cuda_a_capture_holds_the_cublas_workspace_in_its_pool_not_outside_it():
    """A warm-up on the capture stream allocates cuBLAS's workspace outside any pool; dropped
    around the capture, the graph's workspace is allocated in its pool and given back to it, so
    less stays allocated after the capture than before it, and the replay is still right."""
    from streamdag.frontend.candidates import _capture_stream, workspaces_in_pool
    from streamdag.native import load_torch

    if getattr(load_torch(), "clear_blas_workspaces", None) is None:
        pytest.skip("the torch extension drops no workspace on this PyTorch")
    device = torch.device("cuda")
    a = torch.randn(256, 256, device=device)
    stream = _capture_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        a @ a  # the workspace of this thread's handle on the capture stream
    expected = a @ a  # (first: a workspace of the current stream's, in both measurements)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with workspaces_in_pool(stream), torch.cuda.graph(graph, stream=stream):
        out = a @ a
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("kwargs, match", [
    (dict(candidates=["inductr"]), "unknown candidates \\['inductr'\\]: name some of 'eager', 'inductor'"),
    (dict(candidates=["regions x0"]), "a label such as 'regions x2'"),
    (dict(min_gain=-0.1), "min_gain .* at least 0"),
    (dict(min_gain=float("nan")), "min_gain .* at least 0"),
])
def test_a_misspelt_candidate_or_a_negative_min_gain_is_refused_at_compile_naming_the_choices(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sd.compile(torch.nn.Linear(4, 4), **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(streams="2"), "streams takes a number of streams, e.g. streams=2"),
    (dict(clone_outputs="no"), "clone_outputs takes True or False"),
    (dict(min_gain="15%"), "min_gain takes a fraction, e.g. min_gain=0.15"),
])
def test_an_option_of_the_wrong_type_is_refused_at_compile_naming_what_it_takes(kwargs, match):
    with pytest.raises(TypeError, match=match):
        sd.compile(torch.nn.Linear(4, 4), **kwargs)


@pytest.mark.parametrize("inductor, error, match", [
    ({"combo_kernel": True}, ValueError, "no Inductor setting named 'combo_kernel'"),
    ({"triton.cudagraph": True}, ValueError, "nested ones by dotted name"),
    (["combo_kernels"], TypeError, "a dict of Inductor settings by name"),
    ({"combo_kernels": "no"}, TypeError, "Inductor's combo_kernels takes a bool .*, got 'no'"),
])
def test_an_unknown_inductor_setting_is_refused_at_compile_not_at_the_first_call(inductor, error, match):
    with pytest.raises(error, match=match):
        sd.compile(torch.nn.Linear(4, 4), inductor=inductor)


class _SeenPass:
    """An Inductor graph pass that counts the graphs it sees (only a compile under the setting runs it)."""

    def __init__(self):
        from torch._inductor.custom_graph_pass import CustomGraphPass

        seen = self.seen = []

        class Count(CustomGraphPass):
            def __call__(self, graph):
                seen.append(len(graph.nodes))

            def uuid(self):
                return None  # (no cache entry: every compile runs the pass)

        self.graph_pass = Count()


def test_inductor_settings_read_dashes_as_underscores_as_torch_compile_does():
    fast = sd.compile(torch.nn.Linear(4, 4), inductor={"combo-kernels": True})
    assert fast.backend.options.inductor == {"combo_kernels": True}


def test_the_aten_engine_refuses_inductor_settings_naming_the_engine():
    with pytest.raises(TypeError, match="the aten engine runs no Inductor"):
        sd.compile(torch.nn.Linear(4, 4), engine="aten", inductor={"combo_kernels": True})


def test_models_compiled_by_name_with_equal_settings_share_a_backend_and_other_objects_do_not():
    from streamdag.frontend.inductor_backend import default_backend

    class Pass:  # equal-looking objects that are not equal: two passes
        def __repr__(self):
            return "Pass()"

    a, b = Pass(), Pass()
    assert default_backend({"post_grad_custom_post_pass": a}) is default_backend(
        {"post_grad_custom_post_pass": a})
    assert default_backend({"post_grad_custom_post_pass": a}) is not default_backend(
        {"post_grad_custom_post_pass": b})
    assert default_backend({"combo-kernels": True}) is default_backend({"combo_kernels": True})
    assert default_backend({"combo_kernels": True}) is not default_backend()


@pytest.mark.slow
def test_inductor_settings_reach_every_region_a_graph_is_cut_into():
    seen = _SeenPass()
    args = inception_args()
    fast = sd.compile(inception, regions="always", inductor={"post_grad_custom_post_pass": seen.graph_pass})
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), inception(*args))
    text = fast.explain()
    assert "regions" in text
    assert len(seen.seen) > 1, text  # the whole graph, then each region


@pytest.mark.slow
def test_inductor_settings_reach_the_forward_and_the_backward_compiled_later():
    seen = _SeenPass()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    fast = sd.compile(model, inductor={"post_grad_custom_post_pass": seen.graph_pass})
    x = torch.randn(4, 8)
    out = fast(x)
    assert len(seen.seen) == 1  # the forward
    out.sum().backward()
    assert len(seen.seen) == 2  # the backward, compiled at the first backward() (outside the compile call)
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(got, want)
    plain = sd.compile(torch.nn.Linear(8, 2).eval())
    with torch.no_grad():
        plain(x)
    assert len(seen.seen) == 2  # a model compiled without the settings does not get them


@pytest.mark.slow
def test_the_dynamo_backend_by_name_takes_inductor_settings_as_options_and_refuses_a_mode():
    import streamdag.frontend.dynamo  # noqa: F401 - registers the name

    seen = _SeenPass()
    m = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Sigmoid()).eval()
    opt = torch.compile(m, backend="streamdag", options={"post_grad_custom_post_pass": seen.graph_pass})
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), m(x))
    assert len(seen.seen) == 1
    torch._dynamo.reset()
    no_mode = r"takes no mode .* pass Inductor settings as options"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=no_mode) as failed, torch.no_grad():
        torch.compile(m, backend="streamdag", mode="max-autotune")(x)
    assert isinstance(failed.value.inner_exception, TypeError)
    torch._dynamo.reset()
    unknown = "no Inductor setting named 'combo_kernel'"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=unknown) as failed, torch.no_grad():
        torch.compile(m, backend="streamdag", options={"combo_kernel": True})(x)
    assert isinstance(failed.value.inner_exception, ValueError)


def test_one_candidate_given_as_a_string_is_one_label_not_its_letters():
    model = torch.nn.Linear(4, 4).eval()
    fast = sd.compile(model, candidates="inductor")
    assert fast.backend.options.candidates == ("inductor",)
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
