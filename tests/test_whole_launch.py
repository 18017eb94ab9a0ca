"""The launch of a whole-call graph for a later call: the torch extension's ``whole_launch`` compares
the call with the captured one in C++ and must launch exactly where the call's key (``call_key``)
is the captured call's, copying the call's tensors into the graph's inputs."""

import itertools
import random

import pytest

import streamdag as sd

torch = pytest.importorskip("torch")
nn = torch.nn

from streamdag.frontend.call_key import call_key  # noqa: E402


def _variants():
    """Calls around a captured ``f(x, 2, scale=1.5, mode="a")``: each argument kept or changed."""
    x = torch.randn(4, 6, device="cuda")
    xs = {
        "same": lambda: torch.randn(4, 6, device="cuda"),
        "shape": lambda: torch.randn(5, 6, device="cuda"),
        "strides": lambda: torch.randn(6, 4, device="cuda").t(),
        "dtype": lambda: torch.randn(4, 6, device="cuda", dtype=torch.float64),
        "requires_grad": lambda: torch.randn(4, 6, device="cuda", requires_grad=True),
        "cpu": lambda: torch.randn(4, 6),
        "parameter": lambda: nn.Parameter(torch.randn(4, 6, device="cuda"), requires_grad=False),
        "number": lambda: 2,
        # no strides to compare: the native launch must say no, not fail (call_key has no key for it)
        "nested": lambda: torch.nested.nested_tensor([torch.randn(4, 6), torch.randn(4, 6)], device="cuda"),
    }
    ints = {"same": 2, "other": 3, "float": 2.0, "bool": True, "none": None}
    scales = {"same": 1.5, "other": 2.5, "int": 1, "missing": ...}
    modes = {"same": "a", "other": "b", "missing": ...}
    return x, xs, ints, scales, modes


@pytest.mark.cuda
def test_on_cuda_the_native_launch_launches_exactly_for_calls_that_key_as_the_captured_one():
    from streamdag.frontend.candidates import SharedPool
    from streamdag.frontend.whole_replay import CudaCalls
    from streamdag.native import load_torch

    if load_torch() is None or not hasattr(load_torch(), "launch_plan"):
        pytest.skip("the torch extension did not build here")
    x, xs, ints, scales, modes = _variants()
    dev = CudaCalls(torch.device("cuda"), SharedPool())
    launches = []
    static = torch.empty_like(x)
    args, kwargs = (x, 2), {"scale": 1.5, "mode": "a"}
    launch = dev.launch_plan(args, kwargs, [static], lambda: launches.append(static.clone()), False)
    assert launch is not None
    key = call_key(args, kwargs)
    rng = random.Random(0)
    combos = list(itertools.product(xs, ints, scales, modes))
    rng.shuffle(combos)
    # every argument as captured, each one changed alone, then a sample of the rest
    groups = (xs, ints, scales, modes)
    alone = [tuple(k if j == i else "same" for j in range(4))
             for i, group in enumerate(groups) for k in group]
    checked = 0
    for inference, grad in [(False, False), (True, False), (False, True)]:
        for xk, ik, sk, mk in alone + combos[:60]:
            call_args = (xs[xk](), ints[ik])
            call_kwargs = {k: v for k, v in (("mode", modes[mk]), ("scale", scales[sk])) if v is not ...}
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                want = not grad and call_key(call_args, call_kwargs) == key  # (a str where it has none)
                before = len(launches)
                got = launch(call_args, call_kwargs)
            assert got is want, (xk, ik, sk, mk, inference, grad)
            assert len(launches) == before + got  # launched once where it matched, never otherwise
            if got:
                torch.testing.assert_close(launches[-1], call_args[0], rtol=0, atol=0)
            checked += got
    assert checked > 0
    assert not launch([x, 2], {"scale": 1.5, "mode": "a"})  # not a tuple: the Python path keys it
    # an inference tensor keys apart from a plain one of the same layout
    with torch.inference_mode():
        inference_x = torch.randn(4, 6, device="cuda")
    assert not launch((inference_x, 2), {"scale": 1.5, "mode": "a"})


@pytest.mark.cuda
def test_on_cuda_calls_the_native_launch_cannot_copy_have_no_plan():
    from streamdag.frontend.candidates import SharedPool
    from streamdag.frontend.whole_replay import CudaCalls
    from streamdag.native import load_torch

    if load_torch() is None or not hasattr(load_torch(), "launch_plan"):
        pytest.skip("the torch extension did not build here")
    dev = CudaCalls(torch.device("cuda"), SharedPool())
    x = torch.randn(8, 8, device="cuda")
    sliced = x[:, ::2]
    plan = dev.launch_plan

    def nothing():
        return None

    assert plan((nn.Parameter(x),), {}, [torch.empty_like(x)], nothing, False) is None  # keyed by address
    assert plan((sliced,), {}, [torch.empty_strided(sliced.shape, sliced.stride(), device="cuda")],
                nothing, False) is None  # not one span of bytes
    assert plan((x,), {}, [], nothing, False) is None  # no input for the tensor
    assert plan((x,), {}, [torch.empty(8, 8, device="cuda", dtype=torch.float64)], nothing, False) is None
    assert plan((x, 2), {"k": x}, [torch.empty_like(x), torch.empty_like(x)], nothing, False) is not None


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 8)

    def forward(self, x, k: int = 1, *, bias=None, scale: float = 1.0):
        h = self.a(x).relu() * k
        if bias is not None:
            h = h + bias
        return self.b(h) * scale


@pytest.mark.cuda
def test_on_cuda_replays_launched_natively_follow_each_calls_arguments(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = Scaled().eval().cuda()
    c = sd.compile(m)
    bias = torch.randn(32, device="cuda")
    calls = [((torch.randn(4, 16, device="cuda"),), {}),
             ((torch.randn(4, 16, device="cuda"), 2), {"scale": 0.5}),
             ((torch.randn(4, 16, device="cuda"), 2), {"scale": 0.5, "bias": bias}),
             ((torch.randn(6, 16, device="cuda"),), {"bias": bias})]
    # the same signatures over other tensors (made outside inference mode: an inference tensor keys apart)
    again = [(tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args), kwargs)
             for args, kwargs in calls]
    with torch.inference_mode():
        for _ in range(4):  # each signature captured, then replayed, alternating
            for args, kwargs in calls + again:
                torch.testing.assert_close(c(*args, **kwargs), m(*args, **kwargs), rtol=1e-5, atol=1e-5)
    entries = c.whole.current.entries
    assert len(entries) == len(calls), c.explain()  # one graph per signature
    assert all(e.replays >= 3 for e in entries.values()), c.explain()
    from streamdag.native import load_torch

    if load_torch() is not None and hasattr(load_torch(), "launch_plan"):
        assert all(e.native is not None for e in entries.values() if e.speculative), c.explain()
        assert "launched in C++" in c.explain()


def _ext():
    from streamdag.native import load_torch

    ext = load_torch()
    if ext is None or not hasattr(ext, "fresh_copies"):
        pytest.skip("the torch extension did not build here")
    return ext


@pytest.mark.cuda
def test_on_cuda_fresh_copies_have_each_tensors_layout_and_values_in_memory_of_their_own():
    ext = _ext()
    base = torch.randn(4, 6, 8, device="cuda")
    dense = [base, base.permute(2, 0, 1), torch.empty(0, 3, device="cuda"),
             torch.arange(5, device="cuda", dtype=torch.int64), base[1]]
    copies = ext.fresh_copies(dense)
    for t, c in zip(dense, copies, strict=True):
        assert c.stride() == t.stride() and c.dtype == t.dtype and c.device == t.device
        torch.testing.assert_close(c, t, rtol=0, atol=0)
        assert c.numel() == 0 or c.data_ptr() != t.data_ptr()
    base.zero_()
    assert copies[0].abs().sum() > 0, "a copy shares the original's memory"
    assert ext.fresh_copies([base, base[:, ::2]]) is None  # not one span of bytes: nothing made
    assert ext.fresh_copies([torch.randn(3)]) is None  # not on the GPU


@pytest.mark.cuda
def test_on_cuda_fresh_copies_of_many_tensors_of_one_dtype_copy_each_outside_autograd():
    ext = _ext()
    base = torch.randn(4, 6, 8, device="cuda")
    grads = torch.randn(5, 7, device="cuda", requires_grad=True)
    many = [base, base.permute(2, 0, 1), torch.empty(0, 3, device="cuda"), base[1], grads,
            *(torch.randn(i + 1, 3, device="cuda") for i in range(20))]  # a cache's worth: one launch
    copies = ext.fresh_copies(many)
    for t, c in zip(many, copies, strict=True):
        assert c.stride() == t.stride() and c.dtype == t.dtype and c.device == t.device
        torch.testing.assert_close(c, t.detach(), rtol=0, atol=0)
        assert c.numel() == 0 or c.data_ptr() != t.data_ptr()
        assert not c.requires_grad and c.grad_fn is None  # a copy of a result, not a step of a graph
    base.zero_()
    assert copies[0].abs().sum() > 0 and copies[3].abs().sum() > 0, "a copy shares the original's memory"


class Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(1024, 1024)

    def forward(self, x):
        return self.a(x).relu()


@pytest.mark.cuda
def test_on_cuda_a_whole_calls_graph_inputs_lie_in_its_graphs_pool(fresh_dynamo):
    # an input of 1-10 MiB allocated outside the pool holds a 20 MiB segment of its own for as long
    # as the graph lives; inside, the graph's temporaries share its segment
    m = Wide().eval().cuda()
    c = sd.compile(m)
    x = torch.randn(2048, 1024, device="cuda")  # 8 MiB
    with torch.inference_mode():
        for _ in range(4):
            torch.testing.assert_close(c(x), m(x), rtol=1e-3, atol=1e-3)
        x2 = torch.randn_like(x)
        torch.testing.assert_close(c(x2), m(x2), rtol=1e-3, atol=1e-3)  # the inputs take each call's values
    entries = list(c.whole.current.entries.values())
    assert entries and all(e.replays >= 1 for e in entries), c.explain()
    pools = {(seg["address"], seg["address"] + seg["total_size"]): tuple(seg.get("segment_pool_id", (0, 0)))
             for seg in torch.cuda.memory_snapshot()}
    for entry in entries:
        for s in entry.statics:
            pool = next(p for (lo, hi), p in pools.items() if lo <= s.data_ptr() < hi)
            assert pool != (0, 0), "a graph input lies outside every graph's pool"


@pytest.mark.cuda
def test_on_cuda_same_layouts_notices_any_tensor_moved_resized_or_restrided():
    ext = _ext()
    tensors = [torch.randn(4, 6, device="cuda"), torch.randn(3, device="cuda"),
               torch.randn(2, 2, 2, device="cuda")]
    snapshot = ext.layouts(tensors)
    assert ext.same_layouts(tensors, snapshot)
    changes = [lambda ts: ts[0].set_(torch.randn(4, 6, device="cuda")),  # other memory
               lambda ts: ts[1].resize_(4),
               lambda ts: ts[2].as_strided_((2, 2, 2), (1, 2, 4)),
               lambda ts: ts.append(torch.randn(1, device="cuda")),  # one more tensor
               lambda ts: ts.pop()]  # one fewer
    for change in changes:
        changed = [t.clone() for t in tensors]
        moved = ext.layouts(changed)
        change(changed)
        assert not ext.same_layouts(changed, moved), change
    with pytest.raises(TypeError):
        ext.same_layouts([1], snapshot)


class Shapes(nn.Module):
    """Outputs of several layouts: contiguous, permuted, a strided slice, and ones in a dict."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 24)

    def forward(self, x):
        h = self.lin(x).relu()
        return {"h": h, "t": h.reshape(-1, 4, 6).permute(2, 0, 1) * 2, "s": (h + 1)[:, ::3], "n": h.sum()}


@pytest.mark.cuda
def test_on_cuda_each_replay_returns_outputs_of_its_own_that_later_calls_leave_alone(no_tf32, fresh_dynamo):
    torch.manual_seed(0)
    m = Shapes().eval().cuda()
    c = sd.compile(m)
    xs = [torch.randn(5, 8, device="cuda") for _ in range(6)]
    with torch.inference_mode():
        got = [c(x) for x in xs]  # every result kept while the later calls run
        want = [m(x) for x in xs]
    for g, w in zip(got, want):
        for k in w:
            assert g[k].shape == w[k].shape, k
            torch.testing.assert_close(g[k], w[k], rtol=1e-5, atol=1e-5)
    assert c.statistics().whole_replays >= 3, c.explain()
