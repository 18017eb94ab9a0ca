"""How the driver learns that a worker's eager ops ended: one report for many ops, not an answer each.

Each eager op is an actor call whose answer Ray keeps for the driver. Reading those answers one by
one (a completion callback or a ``ray.get`` per op) takes the driver's GIL for about 15-20 µs per op
on Ray's callback thread, taken from the thread that submits: it made an eager submit cost 1.40x
the same actor call written by hand. So the worker keeps what is worth telling (the answers that
are not None: failures, returned values, timings) and tells it in a report: the answer of an op
flagged to report (the first op sent while none is in flight), or of a ``report`` call sent after
the ops waiting since. A worker runs its calls in order, so a report's answer comes after those of
every op sent to it before. Each op's own answer is still there: where a report cannot tell (the
worker died or restarted, an op raised to Ray, a large answer), the driver reads them instead.

State, guarded by the runtime's lock (``lock``):

- ``waiting[w]``: ``(op, ref)`` of each op sent to worker ``w`` and not settled, in the order sent.
- ``reporting[w]``: a report of ``w`` is in flight, or queued to the reporter thread.
  Invariant: ``waiting[w]`` is not empty only while ``reporting[w]``; so every op sent is settled,
  by a report or by its own answer.
- ``told[w]``: ``(token, ops run)`` of ``w``'s last report read, where the next report's positions
  start; None where unknown (after a report that failed).
- ``held[w]``: the refs of ``w``'s ops settled by the last report, kept until the next: an answer
  not read may land in the driver's store after a later one's, and Ray fails hard where an answer
  lands after the last ref to it is dropped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import ray

from ._worker import READ_OWN

_NOT_YET = object()


class Reports:
    """The eager ops in flight on each worker, and the reports that settle them (see the module)."""

    def __init__(self, handles: list[Any], lock: threading.RLock, tokens: list[str],
                 settle: Callable[[list[tuple[Any, Any]]], None]) -> None:
        n = len(handles)
        self.handles = handles
        self.lock = lock
        self.settle = settle  # settles ops from their answers: [(op, answer)]
        self.waiting: list[list[tuple[Any, Any]]] = [[] for _ in range(n)]
        self.reporting = [False] * n
        self.told: list[tuple[str, int] | None] = [(t, 0) for t in tokens]
        self.held: list[list[tuple[Any, Any]]] = [[] for _ in range(n)]
        self._asks: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._reporter = threading.Thread(target=self._ask_reports, name="streamdag-ray-reports", daemon=True)
        self._reporter.start()

    def send(self, worker: int, op: Any, call: bytes, incoming: list) -> None:
        """Send ``op``'s call to ``worker`` (under ``lock``, which orders it among the reports)."""
        if self.reporting[worker]:
            ref = self.handles[worker].run_op.remote((call, incoming) if incoming else call)
            self.waiting[worker].append((op, ref))
            return
        self.reporting[worker] = True  # nothing waits there (the invariant): this op reports
        ref = self.handles[worker].run_op.remote((call, incoming, True))
        self.waiting[worker].append((op, ref))
        ref._on_completed(lambda answer: self._reported(worker, 1, answer, flagged=True))

    def close(self) -> None:
        self._asks.put(None)

    def _ask_reports(self) -> None:
        """The reporter thread: sends the ``report`` calls that ``_reported`` asks for (not from Ray's
        callback thread, which a call may wait on)."""
        while (worker := self._asks.get()) is not None:
            try:
                with self.lock:
                    count = len(self.waiting[worker])
                    ref = self.handles[worker].report.remote()
                ref._on_completed(lambda answer, w=worker, n=count: self._reported(w, n, answer))
            except Exception:  # Ray cannot send it (shutting down): each op's own answer settles it
                with self.lock:
                    left, self.waiting[worker] = self.waiting[worker], []
                    self.reporting[worker] = False
                for op, ref in left:
                    ref._on_completed(lambda answer, op=op, ref=ref: self.settle([(op, answer)]))

    def _reported(self, worker: int, count: int, answer: Any, flagged: bool = False) -> None:
        """A report of ``worker`` answered (a Ray callback thread): settle the ``count`` ops it covers,
        then ask for the next report where more ops wait."""
        try:
            if flagged:  # the op alone (nothing waited before it); the report's answers are settled
                report = answer[2:] if type(answer) is tuple and answer[:1] == ("report",) else None
            else:
                report = answer if type(answer) is tuple else None
            with self.lock:
                batch = self.waiting[worker][:count]
                del self.waiting[worker][:count]
                base = self.told[worker]
                self.told[worker] = report[:2] if report is not None else None
            if flagged:
                answers = [answer[1] if report is not None else answer]
            else:
                answers = self._answers_of(batch, base, report)
            self.held[worker] = batch
            answered = []
            for (op, ref), got in zip(batch, answers):
                if got is _NOT_YET:  # an answer overtaken by a later one's: wait for it alone
                    ref._on_completed(lambda answer, op=op, ref=ref: self.settle([(op, answer)]))
                else:
                    answered.append((op, got))
            self.settle(answered)
        finally:
            with self.lock:
                more = bool(self.waiting[worker])
                self.reporting[worker] = more
            if more:
                self._asks.put(worker)

    def _answers_of(self, batch: list[tuple[Any, Any]], base: tuple[str, int] | None,
                    report: tuple | None) -> list[Any]:
        """The answers of ``batch``'s ops: from the report where it covers exactly them (same worker
        incarnation, as many ops run since the last report as sent), else each op's own."""
        if report is not None and base is not None and report[0] == base[0] \
                and report[1] - base[1] == len(batch):
            told = dict(report[2])
            answers = [told.get(base[1] + i + 1) for i in range(len(batch))]
            own = [i for i, a in enumerate(answers) if a == READ_OWN]  # (a copy of the str)
            for i, got in zip(own, _answers([batch[i][1] for i in own])):
                answers[i] = got
            return answers
        return _answers([ref for _, ref in batch])


def _answers(refs: list[Any]) -> list[Any]:
    """The answers of ``refs`` already in the driver's store, without waiting: a ref's value, the error
    Ray raises for it, or ``_NOT_YET``."""
    if not refs:
        return []
    try:
        return ray.get(refs, timeout=0)
    except Exception:  # one failed or is not there yet: ask each
        pass
    out = []
    for r in refs:
        try:
            out.append(ray.get(r, timeout=0))
        except ray.exceptions.GetTimeoutError:
            out.append(_NOT_YET)
        except Exception as e:  # what Ray raises for it is its answer
            out.append(e)
    return out
