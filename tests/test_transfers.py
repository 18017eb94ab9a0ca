"""The byte budget of transfers (``ByteBudget``) against a model, on the CPU.

Copies are acquired and held on a few streams, finished in each stream's
order (as a stream runs them), and their futures dropped by the caller; the
budget must count exactly the bytes of the copies not yet finished: never
give back a pending copy's bytes early (the bound would be passed), never
keep a finished copy's bytes (a later copy would wait for nothing).
"""

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from streamdag.runtime.budgets import ByteBudget
from streamdag.runtime.ops import Future

LIMIT = 100
EXAMPLES = settings(max_examples=300 if os.environ.get("CI") else 60, deadline=None)

steps = st.lists(
    st.one_of(
        st.tuples(st.just("copy"), st.integers(1, 60), st.integers(0, 2)),  # bytes, stream
        st.tuples(st.just("finish"), st.integers(0, 2)),  # the stream's oldest pending copy
        st.tuples(st.just("drop"), st.integers(0, 40)),  # the caller lets go of a future
        st.tuples(st.just("unheld"), st.integers(1, 60)),  # counted, then not made (a recording)
    ),
    max_size=80,
)


@EXAMPLES
@given(steps)
def test_the_budget_counts_exactly_the_bytes_of_unfinished_copies(program):
    budget = ByteBudget(LIMIT)
    pending: dict[int, list[tuple[Future, int]]] = {0: [], 1: [], 2: []}  # the runtime holds these
    kept: list[Future] = []  # futures the caller still holds
    for step in program:
        in_flight = sum(n for copies in pending.values() for _, n in copies)
        assert budget.reclaim() == in_flight
        if step[0] in ("copy", "unheld"):
            n = step[1]
            if in_flight and in_flight + n > LIMIT:
                continue  # acquire would wait for a copy to finish: no other thread finishes them here
            budget.acquire(n)
            assert budget.peak <= LIMIT or budget.peak == n
            if step[0] == "unheld":
                budget.release(n)
                continue
            future = Future()
            budget.hold(future, n, step[2])
            pending[step[2]].append((future, n))
            kept.append(future)
        elif step[0] == "finish" and pending[step[1]]:
            future, _ = pending[step[1]].pop(0)
            future.set_result(None)  # the runtime lets go of it once finished
        elif step[0] == "drop" and kept:
            kept.pop(step[1] % len(kept))
    for copies in pending.values():
        for future, _ in copies:
            future.set_result(None)
    pending.clear()
    assert budget.reclaim() == 0


def test_the_budget_keeps_no_record_of_copies_long_done_however_far_below_its_limit():
    """An acquire that fits looks at no earlier copy (that cost every copy microseconds); each hold
    gives back some done ones instead, so the records stay few while copies stream through."""
    budget = ByteBudget(1 << 40)
    futures = []
    for i in range(10_000):
        budget.acquire(1024)
        future = Future()
        budget.hold(future, 1024, stream=i % 2)
        futures.append(future)
        if len(futures) > 4:  # the copies finish a few behind the submits
            futures.pop(0).set_result(None)
    assert sum(len(held) for held in budget._held.values()) <= 8
    assert budget.used <= 8 * 1024
