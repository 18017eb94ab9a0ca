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
    choose_layout,
    column_linear,
    estimate,
    pipeline,
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


def layer(single_ms, rows, d=8192, size=2):
    mb = rows * d * size / 1e6
    return LayerCost(single_ms=single_ms, block_ms=single_ms / 4 * 1.05, in_mb=mb, out_mb=mb)


def test_cost_model_keeps_small_layers_on_one_device_and_splits_large_ones():
    small = [layer(0.03, 8)] * 8  # the copy's latency alone outweighs the halved product
    plan, est = choose_layout(small, 2, LinkCost(latency_ms=0.03, ms_per_mb=1 / 350))
    assert plan == ["single"] * 8 and est == pytest.approx(0.24)
    large = [layer(3.2, 16384)] * 4  # input already split, as a previous layer leaves it
    plan, est = choose_layout(large, 2, LINK, start="split")
    assert plan == ["split"] * 4
    assert est < 0.6 * estimate(["single"] * 4, large, 2, LINK, start="split")
    # starting whole on one device, the first layer's input must be sent over first
    assert estimate(["split"] * 4, large, 2, LINK) > est


def test_cost_model_dynamic_program_finds_the_best_plan_over_all_plans():
    rng = np.random.default_rng(3)
    for _ in range(50):
        layers = [layer(float(rng.uniform(0.01, 2)), int(rng.integers(8, 8192))) for _ in range(4)]
        link = LinkCost(float(rng.uniform(0.005, 0.1)), float(rng.uniform(0.001, 0.01)))
        plan, est = choose_layout(layers, 2, link)
        brute = min(estimate(p, layers, 2, link) for p in itertools.product(["single", "split"], repeat=4))
        assert est == pytest.approx(brute)
        assert estimate(plan, layers, 2, link) == pytest.approx(est)


def test_chain_rejects_bad_plans_and_shapes(weights):
    with sd.Runtime(devices=["sim:0", "sim:1"]) as rt:
        with pytest.raises(ValueError, match="do not chain"):
            LinearChain(rt, [sim(np.ones((3, 4))), sim(np.ones((5, 2)))])
        with pytest.raises(ValueError, match="relu"):
            LinearChain(rt, [sim(w) for w in weights], activation="gelu")
        chain = LinearChain(rt, [sim(w) for w in weights], plan=["split"])
        with pytest.raises(ValueError, match="one entry per layer"):
            chain(sim(np.ones((2, 12))))
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
