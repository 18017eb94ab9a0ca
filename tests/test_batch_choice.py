"""Per-group choice between batching and streams: the estimate, and a pass limited to chosen groups."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from programs import wide_fn
from streamdag.frontend.batch_choice import estimate_groups, linked_sets, paying_groups
from streamdag.frontend.batching import BatchGroup, batch_independent_ops
from streamdag.frontend.fx_ops import ops_from_graph


def _traced(fn, *examples):
    with torch.no_grad():
        return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(*examples)


def test_a_pass_limited_to_some_groups_makes_only_those_and_keeps_the_results():
    torch.manual_seed(0)
    ws = [[torch.randn(16, 16) / 4 for _ in range(3)] for _ in range(6)]
    wide = wide_fn(ws)
    x = torch.randn(8, 16)
    batched, _, full = batch_independent_ops(_traced(wide, x))
    matmuls = [g for g in full.groups if g.kind == "matmul"]
    assert len(matmuls) == 3 and all(len(g.members) == 6 for g in matmuls)
    # what the estimates look up: members are ops of the unbatched graph, ops of the batched one
    plain_ops = {op.node.name for op in ops_from_graph(_traced(wide, x))[0]}
    batched_ops = {op.node.name for op in ops_from_graph(batched)[0]}
    for g in full.groups:
        assert set(g.members) <= plain_ops and g.ops and set(g.ops) <= batched_ops

    chosen = matmuls[1]  # the second layer only: its relus read separate products, so stay apart
    gm, _, limited = batch_independent_ops(_traced(wide, x), only=[chosen.key])
    assert [g.key for g in limited.groups] == [chosen.key]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), wide(x), rtol=1e-5, atol=1e-5)
    assert not batch_independent_ops(_traced(wide, x), only=[])[2].groups


def _group(kind, n, tag):
    return BatchGroup(kind, tuple(f"{tag}{i}" for i in range(n)), (f"{tag}_batched",))


def test_a_group_pays_when_its_batched_op_beats_its_members_side_by_side():
    many_small = _group("matmul", 8, "a")  # 8 x 10 us that barely load the device: ~2 launches' worth
    two_large = _group("matmul", 2, "b")  # 2 x 1 ms that each fill it
    streams_ms = {**{m: 0.01 for m in many_small.members}, **{m: 1.0 for m in two_large.members}}
    batched_ms = {"a_batched": 0.012, "b_batched": 2.3}
    est = {e.group.kind + e.group.members[0]: e for e in
           estimate_groups([many_small, two_large], streams_ms, batched_ms, streams=4)}
    small, large = est["matmula0"], est["matmulb0"]
    assert small.serial_ms == 0.08 and small.streams_ms < small.serial_ms and small.pays
    assert 2.0 <= large.streams_ms <= 2.01 and not large.pays  # both saturate: sharing gains nothing
    assert "keep on streams" in str(large) and "batch" in str(small)

    assert paying_groups(list(est.values()), [many_small, two_large]) == frozenset({many_small.key})
    # all groups paying, or one not timed: no mixed variant to try
    assert paying_groups([small], [many_small]) is None
    assert paying_groups([small], [many_small, two_large]) is None


def test_groups_that_read_each_others_results_are_decided_together():
    """Unbatching a relu group under a batched matmul group would cost a stack neither sees."""
    matmuls = _group("matmul", 4, "mm")
    relus = _group("relu", 4, "relu")
    apart = _group("matmul", 4, "other")
    inputs_of = {f"relu{i}": [f"mm{i}"] for i in range(4)}
    assert sorted(map(sorted, linked_sets([matmuls, relus, apart], inputs_of))) == [[0, 1], [2]]

    streams_ms = {**{m: 0.2 for m in matmuls.members}, **{m: 0.01 for m in relus.members},
                  **{m: 0.2 for m in apart.members}}
    batched_ms = {"mm_batched": 0.3, "relu_batched": 0.05, "other_batched": 0.9}
    est = estimate_groups([matmuls, relus, apart], streams_ms, batched_ms, streams=4)
    assert [e.pays for e in est] == [True, False, False]  # alone, the relus would stay apart
    chosen = paying_groups(est, [matmuls, relus, apart], inputs_of)
    assert chosen == frozenset({matmuls.key, relus.key})  # together, they pay: batched as a pair
    assert paying_groups(est, [matmuls, relus, apart]) == frozenset({matmuls.key})  # without links


def test_groups_that_feed_each_other_are_not_merged_into_a_cycle():
    """Two matmul groups, each of independent members, where a member of each feeds the other group:
    merged together they would wait on each other; the pass merges one and leaves the other."""
    torch.manual_seed(2)
    wa1, wa2 = torch.randn(6, 6), torch.randn(6, 6)
    wb1, wb2 = torch.randn(6, 8), torch.randn(6, 8)

    def crossed(x):
        a1 = x @ wa1
        b2 = a1 @ wb2  # group b reads group a's member
        b1 = x @ wb1
        a2 = b1[:, :6] @ wa2  # group a reads group b's member
        return a2, b2

    x = torch.randn(4, 6)
    gm, _, report = batch_independent_ops(_traced(crossed, x))
    assert [g.kind for g in report.groups] == ["matmul"]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), crossed(x))
