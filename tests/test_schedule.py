"""The pure scheduler: small hand-drawn graphs, then random DAGs."""

import itertools

import networkx as nx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamdag import CycleError, build_schedule
from streamdag.schedule import from_edges
from streamdag.schedule.reduction import reduce_transitively

#: each test runs on the compiled hot path and on its Python reference (the path fixture)
pytestmark = pytest.mark.usefixtures("path")


def brute_width(preds):
    g = nx.DiGraph()
    g.add_nodes_from(range(len(preds)))
    g.add_edges_from((u, v) for v, ps in enumerate(preds) for u in ps)
    tc = nx.transitive_closure_dag(g)
    best = 0
    for r in range(1, len(preds) + 1):
        for subset in itertools.combinations(range(len(preds)), r):
            pairs = itertools.combinations(subset, 2)
            if all(not tc.has_edge(a, b) and not tc.has_edge(b, a) for a, b in pairs):
                best = r
                break
    return best


def execution_graph(sched, drop=None):
    """Edges the device enforces: stream order plus event waits (optionally minus one wait)."""
    g = nx.DiGraph()
    g.add_nodes_from(range(sched.num_ops))
    for ops in sched.order:
        g.add_edges_from(itertools.pairwise(ops))
    for v, ws in enumerate(sched.waits):
        g.add_edges_from((u, v) for u in ws if (u, v) != drop)
    return g


def assert_valid(preds, sched):
    g = execution_graph(sched)
    assert nx.is_directed_acyclic_graph(g)
    tc = nx.transitive_closure_dag(g)
    for v, ps in enumerate(preds):
        for u in ps:
            assert tc.has_edge(u, v), f"dependency {u}->{v} not enforced"
    for v, ws in enumerate(sched.waits):
        for u in ws:
            assert sched.stream[u] != sched.stream[v]
            without = nx.transitive_closure_dag(execution_graph(sched, drop=(u, v)))
            assert not without.has_edge(u, v), f"wait {u}->{v} is redundant"


def test_chain():
    """a -> b -> c: one stream, no waits."""
    s = build_schedule([[], [0], [1]], max_streams=4)
    assert s.chains == s.width == 1
    assert s.num_streams == 1 and s.num_waits == 0


def test_fork_join():
    r"""
        x
      / | \
     a  b  c
      \ | /
        j
    """
    s = build_schedule([[], [0], [0], [0], [1, 2, 3]], max_streams=8)
    assert s.chains == s.width == 3
    assert s.num_streams == 3
    assert s.num_waits == 4  # two forks, two joins: the rest continue their stream
    assert [list(lv) for lv in s.levels] == [[0], [1, 2, 3], [4]]
    assert_valid([[], [0], [0], [0], [1, 2, 3]], s)


def test_x_shape_needs_the_closure_to_reach_the_width():
    r"""
    a   b
     \ /
      x          a path cover of the reduction needs 3 paths (a-x-c, b, d);
     / \         chains over the closure need only 2 = the width: {a,x,c}, {b,d}
    c   d
    """
    preds = [[], [], [0, 1], [2], [2]]
    s = build_schedule(preds, max_streams=8)
    assert s.width == s.chains == 2
    assert_valid(preds, s)


def test_implied_edge_is_removed_and_needs_no_wait():
    """a -> b -> c and a -> c: the edge a -> c is implied."""
    s = build_schedule([[], [0], [0, 1]], max_streams=4)
    assert s.preds == ((), (0,), (1,))
    assert s.removed_edges == 1


def test_stream_merge_never_exceeds_the_budget():
    preds = [[]] + [[0] for _ in range(16)] + [list(range(1, 17))]
    s = build_schedule(preds, max_streams=4)
    assert s.num_streams == 4
    assert_valid(preds, s)


def test_single_stream_needs_no_waits():
    preds = [[]] + [[0] for _ in range(5)] + [list(range(1, 6))]
    s = build_schedule(preds, max_streams=1)
    assert s.num_waits == 0 and s.num_streams == 1


def test_backward_edge_is_refused():
    with pytest.raises(ValueError, match="topological"):
        build_schedule([[1], []], max_streams=2)


def test_from_edges_names_the_cycle():
    with pytest.raises(CycleError, match="cycle") as caught:
        from_edges("abcd", [("d", "a"), ("a", "b"), ("b", "c"), ("c", "a")])
    cycle = caught.value.cycle
    assert sorted(cycle) == ["a", "b", "c"]
    edges = {("a", "b"), ("b", "c"), ("c", "a")}
    assert all((u, v) in edges for u, v in zip(cycle, [*cycle[1:], cycle[0]]))


def test_from_edges_names_a_self_loop_as_a_cycle():
    with pytest.raises(CycleError) as caught:
        from_edges("ab", [("a", "b"), ("b", "b")])
    assert caught.value.cycle == ["b"]


@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=30))))
def test_from_edges_numbers_as_networkx_lexicographic_topological_sort_does(case):
    n, pairs = case
    edges = [(f"n{min(u, v)}", f"n{max(u, v)}") for u, v in pairs if u != v]  # acyclic: low to high
    nodes = [f"n{i}" for i in reversed(range(n))]
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    order, preds = from_edges(nodes, edges)
    assert order == list(nx.lexicographical_topological_sort(g, key=str))
    assert preds == [sorted(order.index(p) for p in g.predecessors(v)) for v in order]


def test_from_edges_numbers_topologically():
    order, preds = from_edges("abc", [("c", "a"), ("a", "b")])
    assert order == ["c", "a", "b"]
    assert preds == [[], [0], [1]]


def test_critical_path_uses_costs():
    s = build_schedule([[], [0], [0], [1, 2]], max_streams=4, costs=[1, 5, 1, 1])
    assert s.critical_path == (0, 1, 3) and s.critical_cost == 7


@st.composite
def dags(draw, max_nodes=14):
    n = draw(st.integers(1, max_nodes))
    preds = []
    for v in range(n):
        preds.append(sorted(draw(st.sets(st.integers(0, v - 1), max_size=3)) if v else set()))
    return preds


@given(dags(), st.integers(1, 5))
def test_random_dag_schedules_keep_every_dependency_without_redundant_waits(preds, streams):
    s = build_schedule(preds, max_streams=streams)
    assert s.num_streams <= streams
    assert_valid(preds, s)


@given(dags(max_nodes=10))
def test_chain_count_equals_width(preds):
    s = build_schedule(preds, max_streams=64)
    assert s.chains == s.width == brute_width(preds)


@given(dags(max_nodes=30))
def test_transitive_reduction_matches_networkx(preds):
    reduced, _ = reduce_transitively(preds)
    g = nx.DiGraph()
    g.add_nodes_from(range(len(preds)))
    g.add_edges_from((u, v) for v, ps in enumerate(preds) for u in ps)
    expect = nx.transitive_reduction(g)
    assert {(u, v) for v, ps in enumerate(reduced) for u in ps} == set(expect.edges)
