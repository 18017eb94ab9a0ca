"""The cost model's simulator on hand-drawn schedules."""

import pytest

from streamdag import build_schedule
from streamdag.schedule.cost import CostModel, simulate

FREE = CostModel(launch_ms=0.0, wait_ms=0.0, saturating_ms=1.0, min_use=0.05)


def wide(branches, layers):
    """x -> branches x layers -> join, numbered as submitted."""
    preds = [[]]
    tails = []
    for _ in range(branches):
        prev = 0
        for _ in range(layers):
            preds.append([prev])
            prev = len(preds) - 1
        tails.append(prev)
    preds.append(tails)
    return preds


def test_a_chain_takes_the_sum_of_its_ops():
    s = build_schedule([[], [0], [1]], max_streams=4)
    assert simulate(s, [1.0, 2.0, 3.0], FREE) == pytest.approx(6.0)


def test_small_ops_overlap_on_streams():
    """Ops that use a tenth of the device each: 8 streams run 8 at once at full speed."""
    preds = wide(8, 4)
    durations = [0.1] * len(preds)
    one = simulate(build_schedule(preds, 1), durations, FREE)
    eight = simulate(build_schedule(preds, 8), durations, FREE)
    assert one == pytest.approx(0.1 * len(preds))
    assert eight == pytest.approx(0.1 * 6)  # x, four layers, join


def test_ops_that_fill_the_device_gain_nothing():
    preds = wide(4, 2)
    durations = [2.0] * len(preds)  # longer than saturating: each uses the whole device
    one = simulate(build_schedule(preds, 1), durations, FREE)
    four = simulate(build_schedule(preds, 4), durations, FREE)
    assert four == pytest.approx(one)


def test_launch_and_wait_costs_count():
    model = CostModel(launch_ms=0.01, wait_ms=0.005, saturating_ms=1.0)
    s = build_schedule([[], [0], [0], [1, 2]], max_streams=2)
    base = simulate(s, [0.1, 0.1, 0.1, 0.1], CostModel(0.0, 0.0, 1.0))
    est = simulate(s, [0.1, 0.1, 0.1, 0.1], model)
    assert est == pytest.approx(base + 3 * 0.01 + 0.005 * 2)  # 3 launches on the path, 2 waits


def test_copies_on_their_own_engines_overlap_compute_like_a_pipeline():
    """8 chunks: copy in -> compute -> copy out. Copy streams per direction, as captures place them."""
    from streamdag.schedule.plan import pin_ops

    preds, keys, engines, durations = [], [], [], []
    for _ in range(8):
        base = len(preds)
        preds += [[], [base], [base + 1]]
        keys += [("cuda:0", "h2d"), None, ("cuda:0", "d2h")]
        engines += ["h2d", "compute", "d2h"]
        durations += [1.25, 0.55, 1.25]
    sched = pin_ops(build_schedule(preds, 1), keys)
    assert sched.num_streams == 3 and set(sched.stream[0::3]) == {1} and set(sched.stream[2::3]) == {2}
    # all copies in back to back, then the last chunk's compute and copy out
    assert simulate(sched, durations, FREE, engines=engines) == pytest.approx(8 * 1.25 + 0.55 + 1.25)
    # one engine for everything: copies in, computes and copies out slow each other down
    assert simulate(sched, durations, FREE) > 15


def test_pinned_ops_keep_every_dependency_through_waits():
    from streamdag.schedule.plan import pin_ops

    preds = wide(4, 2)
    keys = [("d", "h2d") if v % 3 == 0 else None for v in range(len(preds))]
    sched = pin_ops(build_schedule(preds, 2), keys)
    on_copy = [v for v, k in enumerate(keys) if k]
    assert {sched.stream[v] for v in on_copy} == {sched.num_streams - 1}
    for s, ops in enumerate(sched.order):
        assert list(ops) == sorted(ops) and all(sched.stream[v] == s for v in ops)
    # every cross-stream dependency is implied by a wait (directly or through stream order)
    done_before = {}
    for v in range(len(preds)):
        seen = set()
        for u in sched.waits[v]:
            seen |= done_before[u] | {u}
        prev = [u for u in sched.order[sched.stream[v]] if u < v]
        if prev:
            seen |= done_before[prev[-1]] | {prev[-1]}
        done_before[v] = seen
        assert set(sched.preds[v]) <= seen, v
