"""Tensor-parallel layers, chains and pipelines over simulated devices; the split/single cost model."""

import itertools

import numpy as np
import pytest

import streamdag as sd
from streamdag.backends.sim import SimArray
from streamdag.parallel import (
    Block,
    LayerCost,
    LinearChain,
    LinkCost,
    Links,
    choose_layout,
    choose_stages,
    column_linear,
    estimate,
    pipeline,
    place_stages,
    row_linear,
)


def relu(x):
    return np.maximum(x, 0)


def sim(x, device="sim:0"):
    return SimArray(np.asarray(x, dtype=np.float64), device)


@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((12, 12)) / 3 for _ in range(4)]


def test_column_then_row_linear_equal_the_matmuls():
    rng = np.random.default_rng(1)
    x, w1, w2 = rng.standard_normal((5, 6)), rng.standard_normal((6, 9)), rng.standard_normal((9, 4))
    with sd.Runtime(devices=["sim:0", "sim:1", "sim:2"], seed=4) as rt:
        blocks = column_linear(rt, sim(x), sim(w1), activation="relu")
        assert [b.device for b in blocks] == ["sim:0", "sim:1", "sim:2"]
        out = row_linear(rt, blocks, sim(w2), out_device="sim:1")
        rt.synchronize()
    np.testing.assert_allclose(np.hstack([b.value.data for b in blocks]), relu(x @ w1))
    assert out.device == "sim:1"
    np.testing.assert_allclose(out.data, relu(x @ w1) @ w2)


@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize(("row_chunks", "exchange"), [(1, "ksplit"), (3, "ksplit"), (2, "gathered")])
@pytest.mark.parametrize("plan", ["split", "single", ["split", "single", "split", "split"],
                                  ["single", "split", "split", "single"]])
def test_chain_equals_the_layers_run_one_after_another(weights, devices, plan, row_chunks, exchange):
    names = [f"sim:{i}" for i in range(devices)]
    rng = np.random.default_rng(2)
    with sd.Runtime(devices=names, streams=2, seed=devices) as rt:
        chain = LinearChain(rt, [sim(w) for w in weights], plan=plan, row_chunks=row_chunks,
                            exchange=exchange)
        for _ in range(3):  # new inputs, same recorded graph
            x = rng.standard_normal((7, 12))
            got = chain(sim(x))
            want = x
            for w in weights:
                want = relu(want @ w)
            assert got.device == "sim:0"
            np.testing.assert_allclose(got.data, want, rtol=1e-12, atol=1e-12)
    assert "given" in chain.explain()


@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize("exchange", ["ksplit", "gathered"])
def test_chain_takes_split_inputs_and_leaves_split_outputs(weights, gather, exchange):
    rng = np.random.default_rng(6)
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2, seed=9) as rt:
        chain = LinearChain(rt, [sim(w) for w in weights], plan="split", gather=gather, exchange=exchange,
                            row_chunks=2)
        x = rng.standard_normal((4, 12))
        own = chain.input_blocks(sim(x))
        for b in own:
            b.value.data[:] = x[:, b.start:b.stop]
        got = chain(own)
        other = [Block(sim(x[:, b.start:b.stop], b.device), b.device, b.start, b.stop) for b in own]
        again = chain(other)  # not the chain's own blocks: copied in
    want = x
    for w in weights:
        want = relu(want @ w)
    for out in (got, again):
        full = out.data if gather else np.hstack([b.value.data for b in out])
        np.testing.assert_allclose(full, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("exchange", ["ksplit", "gathered"])
def test_chain_graph_reads_other_devices_only_through_peer_copies(weights, exchange):
    with sd.Runtime(devices=["sim:0", "sim:1"], streams=2) as rt:
        chain = LinearChain(rt, [sim(w) for w in weights], plan="split", exchange=exchange, row_chunks=2)
        chain(sim(np.ones((3, 12))))
        ((graph, _, _),) = chain._graphs.values()
    ops, preds = graph._ops, graph.schedule.preds
    ancestors = []
    for v in range(len(ops)):
        ancestors.append(set(preds[v]).union(*(ancestors[u] for u in preds[v])))
    copies = 0
    for v, rec in enumerate(ops):
        spaces = {a.region.space for a in rec.accesses}
        if rec.stream is None:  # compute: its own device's memory only
            assert spaces == {rec.device}, (rec.name, spaces)
            continue
        # a peer copy, placed on its destination, after every producer of what it reads
        copies += 1
        assert rt._stream_device[rec.stream] == rec.device
        (src,) = [a.region for a in rec.accesses if not a.write]
        for u in range(v):
            if any(a.write and a.region.overlaps(src) for a in ops[u].accesses):
                assert u in ancestors[v], (ops[u].name, rec.name)
    assert copies >= 2 * (len(weights) - 1)  # each device fetches the other's block per layer
    assert graph.devices == ["sim:0", "sim:1"]


def test_pipeline_runs_every_micro_batch_through_every_stage_in_order():
    stages = [(lambda h: SimArray(h.data * 2, h.device), "sim:0"),
              (lambda h: SimArray(h.data + 1, h.device), "sim:1"),
              (lambda h: SimArray(h.data ** 2, h.device), "sim:0")]
    batches = [sim(np.full(4, i)) for i in range(9)]
    with sd.Runtime(devices=["sim:0", "sim:1"], seed=5) as rt:
        outs = pipeline(rt, stages, batches, max_in_flight=2)
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out.data, np.full(4, (2 * i + 1) ** 2))
    with pytest.raises(ValueError, match="max_in_flight"):
        pipeline(rt, stages, batches, max_in_flight=0)


LINK = LinkCost(latency_ms=0.02, ms_per_mb=1 / 350)


def layer(single_ms, rows, d=8192, size=2, n=2, floor=0.0):
    """A layer whose block products cost 5% more than their share of the whole, and at least ``floor``
    (a launch-bound product of a few rows costs about as much as the whole layer)."""
    mb = rows * d * size / 1e6
    products = {(p, k): max(floor, single_ms / (p * k) * 1.05) for p in (1, 2, 4, 8) for k in (1, 2, 4, 8)
                if floor and (p, k) != (1, 1)}
    return LayerCost(single_ms=single_ms, block_ms=max(floor, single_ms / (n * n) * 1.05), in_mb=mb,
                     out_mb=mb, products=products)


def roofline(rows, d=8192, size=2, tflops=700.0, gbps=4800.0, launch=0.012):
    """A layer of ``rows`` x ``d`` by ``d`` x ``d`` as an H200 runs it: each product costs a launch plus
    its arithmetic or its memory traffic, whichever takes longer (few rows: reading the weight)."""
    def mm(r, kin, kout):
        flops, moved = 2 * r * kin * kout, (kin * kout + r * kin + r * kout) * size
        return launch + max(flops / tflops / 1e9, moved / gbps / 1e6)

    counts = (1, 2, 4, 8)
    mb = rows * d * size / 1e6
    return LayerCost(single_ms=mm(rows, d, d), block_ms=mm(rows, d // 2, d // 2), in_mb=mb, out_mb=mb,
                     products={(p, k): mm(rows, d // p, d // k) for p in counts for k in counts},
                     rows_ms={k: mm(max(rows // k, 1), d, d) for k in counts[1:]})


def test_cost_model_keeps_small_layers_on_one_device_and_splits_large_ones():
    small = [layer(0.03, 8)] * 8  # the copy's latency alone outweighs the halved product
    plan, est = choose_layout(small, 2, LinkCost(latency_ms=0.03, ms_per_mb=1 / 350), row_sizes=())
    assert plan == ["single"] * 8 and est == pytest.approx(0.24)
    large = [layer(3.2, 16384)] * 4  # input already split, as a previous layer leaves it
    plan, est = choose_layout(large, 2, LINK, start="split", row_sizes=())
    assert plan == ["split2"] * 4
    assert est < 0.6 * estimate(["single"] * 4, large, 2, LINK, start="split")
    # starting whole on one device, the first layer's input must be sent over first
    assert estimate(["split"] * 4, large, 2, LINK) > est
    assert estimate(["split"] * 4, large, 2, LINK) == estimate(["split2"] * 4, large, 2, LINK)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_cost_model_dynamic_program_finds_the_best_plan_over_all_plans(n):
    rng = np.random.default_rng(3 + n)
    steps = ["single"] + [f"{kind}{k}" for k in (2, 4, 8) if k <= n for kind in ("split", "rows")]
    for _ in range(4 if n == 8 else 20):
        layers = [layer(float(rng.uniform(0.01, 2)), int(rng.integers(8, 8192))) for _ in range(3)]
        links = random_links(rng, n)
        for start in ("single", "split"):
            plan, est = choose_layout(layers, n, links, start=start, margin=0.0)
            brute = min(estimate(p, layers, n, links, start=start)
                        for p in itertools.product(steps, repeat=3))
            assert est == pytest.approx(brute)
            assert estimate(plan, layers, n, links, start=start) == pytest.approx(est)


def random_links(rng, n):
    def one():
        return LinkCost(float(rng.uniform(0.005, 0.1)), float(rng.uniform(0.001, 0.02)))

    return Links([[None if i == j else one() for j in range(n)] for i in range(n)])


def test_chain_rejects_bad_plans_and_shapes(weights):
    with sd.Runtime(devices=["sim:0", "sim:1"]) as rt:
        with pytest.raises(ValueError, match="do not chain"):
            LinearChain(rt, [sim(np.ones((3, 4))), sim(np.ones((5, 2)))])
        with pytest.raises(ValueError, match="relu"):
            LinearChain(rt, [sim(w) for w in weights], activation="gelu")
        with pytest.raises(ValueError, match="one entry per layer"):
            LinearChain(rt, [sim(w) for w in weights], plan=["split"])
    assert isinstance(Block(None, "sim:0", 0, 1), Block)


def test_chain_on_one_cpu_runtime_with_torch_tensors():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    ws = [torch.randn(16, 16, dtype=torch.float64) / 4 for _ in range(3)]
    x = torch.randn(5, 16, dtype=torch.float64)
    want = x
    for w in ws:
        want = torch.relu(want @ w)
    with sd.Runtime("cpu", streams=2) as rt:
        chain = LinearChain(rt, ws)
        got = chain(x)
    assert "one device" in chain.explain()
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------ N devices: 2, 4, 8


def sims(n):
    return [f"sim:{i}" for i in range(n)]


def chain_reference(x, weights):
    for w in weights:
        x = relu(x @ w)
    return x


@pytest.fixture
def wide_weights():
    """Widths every split of 2, 4 and 8 divides."""
    rng = np.random.default_rng(10)
    return [rng.standard_normal((16, 16)) / 4 for _ in range(4)]


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("exchange", ["ksplit", "gathered"])
def test_chain_over_n_simulated_devices_equals_one_device(wide_weights, n, exchange):
    plans = ["split", "split2", ["split2", f"split{n}", "single", f"split{n}"],
             [f"split{n}", "split2", "split2", "single"], f"rows{n}",
             ["rows2", "rows2", f"split{n}", f"rows{n}"], [f"split{n}", f"rows{n}", f"rows{n}", "single"],
             ["single", f"rows{n}", "split2", "rows2"]]
    rng = np.random.default_rng(n)
    with sd.Runtime(devices=sims(n), streams=2, seed=n) as rt:
        for plan in plans:
            chain = LinearChain(rt, [sim(w) for w in wide_weights], plan=plan, exchange=exchange,
                                row_chunks=2)
            for _ in range(2):
                x = rng.standard_normal((6, 16))
                got = chain(sim(x))
                assert got.device == "sim:0"
                np.testing.assert_allclose(got.data, chain_reference(x, wide_weights), rtol=1e-12, atol=1e-12)
            ((graph, _, _),) = chain._graphs.values()
            # without links a split of k takes the first k devices; a row split, one row each at most
            steps = [plan] * 4 if isinstance(plan, str) else plan
            widest = max(n if s == "split" else 1 if s == "single" else
                         min(int(s[4:]), 6) if s.startswith("rows") else int(s[5:]) for s in steps)
            assert sorted(graph.devices) == sims(widest)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_chain_on_the_first_n_devices_of_a_larger_runtime_touches_only_those(wide_weights, n):
    rng = np.random.default_rng(20 + n)
    x = rng.standard_normal((5, 16))
    with sd.Runtime(devices=sims(8), streams=2, seed=n) as rt:
        chain = LinearChain(rt, [sim(w) for w in wide_weights], plan="split", devices=n, gather=False)
        own = chain.input_blocks(sim(x))
        for b in own:
            b.value.data[:] = x[:, b.start:b.stop]
        got = chain(own)
        ((graph, _, _),) = chain._graphs.values()
    full = got.data if n == 1 else np.hstack([b.value.data for b in got])
    np.testing.assert_allclose(full, chain_reference(x, wide_weights), rtol=1e-12, atol=1e-12)
    assert chain.devices == sims(n)
    assert set(graph.devices) == set(sims(n))


def test_a_plan_chosen_by_the_cost_model_on_uneven_links_runs_on_the_best_linked_devices(wide_weights):
    links = uneven_links(4, slow=1)
    costs = [roofline(16384)] * 4
    by_rows, _ = choose_layout(costs, 4, links)
    by_cols, _ = choose_layout(costs, 4, links, row_sizes=())
    assert by_rows == ["rows2"] * 4 and by_cols == ["split2"] * 4
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 16))
    for plan in (by_rows, by_cols, ["split2", "rows2", "rows2", "single"]):
        with sd.Runtime(devices=sims(4), streams=2, seed=1) as rt:
            chain = LinearChain(rt, [sim(w) for w in wide_weights], plan=plan, links=links)
            got = chain(sim(x))
            ((graph, _, _),) = chain._graphs.values()
        np.testing.assert_allclose(got.data, chain_reference(x, wide_weights), rtol=1e-12, atol=1e-12)
        assert chain._group(plan[0]) == ["sim:0", "sim:2"]
        assert sorted(graph.devices) == ["sim:0", "sim:2"]  # the slowly linked device is left out


NVLINK = LinkCost(latency_ms=0.02, ms_per_mb=1 / 350)
PCIE = LinkCost(latency_ms=0.03, ms_per_mb=1 / 25)


def uneven_links(n, slow):
    """NVLink between every pair but those of device ``slow``, which go over PCIe."""
    return Links([[None if i == j else (PCIE if slow in (i, j) else NVLINK) for j in range(n)]
                  for i in range(n)])


@pytest.mark.parametrize("n", [2, 4, 8])
def test_cost_model_keeps_tiny_layers_on_one_device_and_splits_big_ones_over_all_n(n):
    links = Links.uniform(n, NVLINK)
    tiny = [roofline(8)] * 8  # launch-bound products, and each device would read every weight whole
    plan, est = choose_layout(tiny, n, links, gather_chunks=2)
    assert plan == ["single"] * 8 and est == pytest.approx(8 * roofline(8).single_ms)
    big = [roofline(16384)] * 4
    single = estimate(["single"] * 4, big, n, links, start="split", gather_chunks=2)
    plan, est = choose_layout(big, n, links, start="split", gather_chunks=2)
    assert plan == [f"rows{n}"] * 4  # no copies between row-split layers
    assert single / est > {2: 1.9, 4: 3.5, 8: 6.3}[n]
    # split by columns, each device receives (n-1)/n of every layer's input: at 350 GB/s the copies
    # outlast the compute as n grows
    plan, est = choose_layout(big, n, links, start="split", gather_chunks=2, row_sizes=())
    assert plan == [f"split{n}"] * 4
    assert {2: 1.9, 4: 3.3, 8: 3.6}[n] < single / est < {2: 2.0, 4: 3.6, 8: 3.9}[n]


def test_uneven_links_change_the_choice():
    big = [roofline(16384)] * 4
    for kinds, wide, narrow in (({}, "rows4", "rows2"), ({"row_sizes": ()}, "split4", "split2")):
        even, _ = choose_layout(big, 4, Links.uniform(4, NVLINK), **kinds)
        uneven, _ = choose_layout(big, 4, uneven_links(4, slow=1), **kinds)
        assert even == [wide] * 4
        assert uneven == [narrow] * 4  # a group of four would wait on the PCIe device's copies
    assert Links.uniform(4, NVLINK).group(2) == (0, 1)
    assert uneven_links(4, slow=1).group(2) == (0, 2)
    assert uneven_links(8, slow=3).group(4) == (0, 1, 2, 4)


def test_cost_model_keeps_one_device_when_a_split_is_estimated_to_win_too_little():
    costs = [layer(1.0, 2048)] * 2
    plan, est = choose_layout(costs, 2, NVLINK, margin=0.0)
    assert plan != ["single"] * 2
    single = estimate(["single"] * 2, costs, 2, NVLINK)
    gain = 1 - est / single
    plan, est = choose_layout(costs, 2, NVLINK, margin=gain + 0.01)
    assert plan == ["single"] * 2 and est == pytest.approx(single)
    plan, _ = choose_layout(costs, 2, NVLINK, margin=gain - 0.01)
    assert plan != ["single"] * 2


def test_chain_bad_device_counts_splits_and_links_get_errors_naming_the_fix(wide_weights):
    weights = [sim(w) for w in wide_weights]
    with sd.Runtime(devices=sims(4)) as rt:
        with pytest.raises(ValueError, match=r"devices=8\): the runtime has 4 .*use 1 to 4"):
            LinearChain(rt, weights, devices=8)
        with pytest.raises(ValueError, match="not of the runtime: sim:7"):
            LinearChain(rt, weights, devices=["sim:0", "sim:7"])
        with pytest.raises(ValueError, match=r"'split8' of layer 0 needs 8 devices.*use split4 or less"):
            LinearChain(rt, weights, plan="split8")
        with pytest.raises(ValueError, match=r"'splitK' \(by columns over K >= 2 devices.*'rowsK' \(by rows"):
            LinearChain(rt, weights, plan="split1")
        with pytest.raises(ValueError, match="links cover 2 devices, the chain 4"):
            LinearChain(rt, weights, links=Links.uniform(2, NVLINK))
    odd = [sim(np.ones((16, 12))), sim(np.ones((12, 12)))]
    with sd.Runtime(devices=sims(8)) as rt:
        with pytest.raises(ValueError, match=r"'split8' of layer 0: 8 devices do not divide its 12 output "
                                             r"columns; use a split the columns divide \(split2, split3, "
                                             r"split4, split6\) or 'single', or pad the weight to a multiple "
                                             r"of 8 columns"):
            LinearChain(rt, odd, plan="split8")
        chain = LinearChain(rt, odd, plan=["split6", "split4"])  # uneven device counts that divide are fine
        x = np.random.default_rng(0).standard_normal((3, 16))
        np.testing.assert_allclose(chain(sim(x)).data, chain_reference(x, [w.data for w in odd]))
    with pytest.raises(ValueError, match="square matrix"):
        Links([[None, NVLINK]])
    with pytest.raises(ValueError, match="has no LinkCost"):
        Links([[None, None], [NVLINK, None]])
    with pytest.raises(ValueError, match="needs 8 devices, the plan has 4"):
        estimate(["split8"], [layer(1.0, 64)], 4, NVLINK)
    with pytest.raises(ValueError, match="covers 8 devices, the plan 4: give the links of exactly"):
        choose_layout([layer(1.0, 64)], 4, Links.uniform(8, NVLINK))


# ------------------------------------------------------------------ pipelines placed by the cost model


def stage_makers(count):
    """Stage s adds s + 1 then squares; each maker builds it for the device it is placed on."""
    def make(s):
        return lambda device: (lambda h: SimArray(np.tanh(h.data + s + 1), h.device))
    return [make(s) for s in range(count)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pipeline_placed_over_n_simulated_devices_equals_one_device(n):
    makers = stage_makers(8)
    batches = [sim(np.full(3, i / 10)) for i in range(6)]
    stages, in_flight = place_stages(makers, sims(n), stage_ms=[1.0] * 8, out_mb=[0.1] * 8,
                                     links=Links.uniform(n, NVLINK))
    assert [d for _, d in stages] == [f"sim:{s * n // 8}" for s in range(8)]  # balanced runs of stages
    assert in_flight == n + 1
    with sd.Runtime(devices=sims(n), seed=n) as rt:
        outs = pipeline(rt, stages, batches, max_in_flight=in_flight)
    for x, y in zip(batches, outs):
        want = x.data
        for s in range(8):
            want = np.tanh(want + s + 1)
        np.testing.assert_allclose(y.data, want, rtol=1e-12)
        assert y.device == stages[-1][1]


def test_pipeline_placement_keeps_cheap_stages_on_one_device_and_avoids_a_slow_link():
    cheap, est = choose_stages([0.005] * 4, [8.0] * 4, 4, NVLINK)  # copies cost more than the stages
    assert cheap == [0, 0, 0, 0] and est == pytest.approx(0.02)
    even, _ = choose_stages([1.0] * 3, [50.0] * 3, 4, Links.uniform(4, NVLINK))
    assert even == [0, 1, 2]
    uneven, est = choose_stages([1.0] * 3, [50.0] * 3, 4, uneven_links(4, slow=1))
    assert uneven == [0, 2, 3] and est == pytest.approx(1.0)  # 50 MB over PCIe would take 2 ms
    nearly, _ = choose_stages([1.0, 1.0], [0.1, 0.1], 2, LinkCost(1.97, 0.0))  # 1.5% better on paper
    assert nearly == [0, 0]


def test_pipeline_placement_bad_input_gets_errors_naming_the_fix():
    makers = stage_makers(2)
    with pytest.raises(ValueError, match="links are measured between GPUs only; pass links="):
        place_stages(makers, sims(2), stage_ms=[1.0, 1.0], out_mb=[1.0, 1.0])
    with pytest.raises(ValueError, match="pass stage_ms= and out_mb=, or an example"):
        place_stages(makers, sims(2), links=Links.uniform(2, NVLINK))
    with pytest.raises(ValueError, match="2 stages but 3 stage times"):
        place_stages(makers, sims(2), stage_ms=[1.0] * 3, out_mb=[1.0] * 3, links=Links.uniform(2, NVLINK))
    with pytest.raises(ValueError, match="links cover 2 devices, the stages 4"):
        place_stages(makers, sims(4), stage_ms=[1.0] * 2, out_mb=[1.0] * 2, links=Links.uniform(2, NVLINK))
    with pytest.raises(ValueError, match="one of each per stage"):
        choose_stages([1.0, 1.0], [1.0], 2, NVLINK)


def test_pipeline_placement_is_the_best_over_every_cut_into_runs_of_stages():
    rng = np.random.default_rng(11)
    for _ in range(40):
        n, count = int(rng.integers(2, 6)), int(rng.integers(2, 7))
        stage_ms = [float(v) for v in rng.uniform(0.1, 2.0, count)]
        out_mb = [float(v) for v in rng.uniform(1.0, 200.0, count)]
        links = random_links(rng, n)
        placed, est = choose_stages(stage_ms, out_mb, n, links, margin=0.0)
        best = sum(stage_ms)
        for parts in range(2, min(n, count) + 1):
            group = links.group(parts)
            for cuts in itertools.combinations(range(1, count), parts - 1):
                bounds = [0, *cuts, count]
                busiest = 0.0
                for j in range(parts):
                    busy = sum(stage_ms[bounds[j]:bounds[j + 1]])
                    if j:
                        busy = max(busy, links(group[j - 1], group[j]).copy_ms(out_mb[bounds[j] - 1]))
                    busiest = max(busiest, busy)
                best = min(best, busiest)
        assert est == pytest.approx(best)
        assert placed == sorted(placed, key=lambda d: placed.index(d))  # runs of consecutive stages


@pytest.mark.parametrize("n", [2, 4, 8])
def test_row_split_chains_take_split_inputs_and_equal_one_device(wide_weights, n):
    rng = np.random.default_rng(30 + n)
    with sd.Runtime(devices=sims(n), streams=2, seed=n) as rt:
        for plan in (f"rows{n}", [f"rows{n}", f"rows{n}", "single", "split2"], ["rows2", f"split{n}"] * 2):
            chain = LinearChain(rt, [sim(w) for w in wide_weights], plan=plan, row_chunks=3)
            for rows in (1, 5, 19):  # fewer rows than devices, and more than the row chunks
                x = rng.standard_normal((rows, 16))
                own = chain.input_blocks(sim(x))
                for b in own:
                    b.value.data[:] = x[:, b.start:b.stop]
                np.testing.assert_allclose(chain(own).data, chain_reference(x, wide_weights), rtol=1e-12,
                                           atol=1e-12)


def test_a_run_of_row_split_layers_copies_nothing_between_its_layers(wide_weights):
    with sd.Runtime(devices=sims(4), streams=2) as rt:
        chain = LinearChain(rt, [sim(w) for w in wide_weights], plan="rows4")
        chain(sim(np.ones((16, 16))))
        ((graph, _, _),) = chain._graphs.values()
    copies = [rec.name for rec in graph._ops if rec.stream is not None]
    # each device's rows arrive once, in 4 row chunks; the outputs come back the same way; no weights
    # move per run (each device holds its own copy, made when the plan was recorded)
    assert len(copies) == 2 * 3 * 4, copies


def test_row_split_plans_the_chain_cannot_run_get_errors_naming_the_fix(wide_weights):
    weights = [sim(w) for w in wide_weights]
    with sd.Runtime(devices=sims(4)) as rt:
        with pytest.raises(ValueError, match=r"'rows4' of layer 2 follows 'rows2': row splits in a row share "
                                             r"their devices; use one K"):
            LinearChain(rt, weights, plan=["rows2", "rows2", "rows4", "single"])
        with pytest.raises(ValueError, match=r"leaves the output in row blocks, but gather=False wants "
                                             r"column blocks: end with 'single' or a 'splitK', or "
                                             r"gather=True"):
            LinearChain(rt, weights, plan="rows4", gather=False)
        LinearChain(rt, weights, plan=["rows2", "rows2", "split4", "rows4"])  # a column split between
    assert estimate(["rows2", "rows4"], [layer(1.0, 64)] * 2, 4, NVLINK) == float("inf")
    assert estimate(["rows2"], [layer(1.0, 64)], 4, NVLINK, gather=False) == float("inf")


def test_split_layers_cut_into_more_row_chunks_than_rows_equal_the_layers(wide_weights):
    with sd.Runtime(devices=sims(2), streams=2, seed=3) as rt:
        chain = LinearChain(rt, [sim(w) for w in wide_weights], plan="split", row_chunks=3)
        x = np.random.default_rng(8).standard_normal((1, 16))
        np.testing.assert_allclose(chain(sim(x)).data, chain_reference(x, wide_weights), rtol=1e-12)
