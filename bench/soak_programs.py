"""The soak's random programs: what each does to a runtime, and what running it serially must give.

A program is drawn for one category (``CATEGORIES``) and one runtime configuration: eager
submits over overlapping views of three shared buffers, ops that raise, recorded graphs run
several times, eager ops and graph runs on the same buffers, ops that submit ops and wait for
them (or run a graph) from inside, done-callbacks that submit and wait, several submitting
threads, ``close()`` racing submitters, ``synchronize()``/``close()`` from inside an op, inline
markers nested in lists, zero-size views, and ops that raise a ``BaseException``.

The oracle runs the same ops serially, in submission order, and says what every future, every
graph run and every ``synchronize()`` must give and what every buffer must hold at the end: an op
fails with its own error where it raises, with ``DependencyFailed`` (naming a root that reaches
it) where an op failed since the last ``synchronize()`` that wrote memory it reads or writes (by
extent, the documented conservative rule), and runs otherwise. Where the runtime may choose,
as documented, the oracle follows the choice it made: a wait inside an op that the runtime
refuses because it could never end (lanes waiting for each other) fails that op, and a submit
refused with a ``TypeError`` (markers it cannot track) submits nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

import streamdag as sd
from programs import VIEW_KINDS, N, elements, initial_bases, make_view
from streamdag.backends.inline import InlineBackend

#: array numbers: 0-2 the shared buffers, CONST read-only, SCRATCH + j private to one op, ZERO + j empty
CONST, SCRATCH, ZERO = 3, 10, 100
#: what a wait inside an op raises where the runtime refuses it (lanes that would wait for each other)
REFUSED_WAIT = "would wait forever"


class Injected(Exception):
    """An op's injected failure."""


class BaseInjected(BaseException):
    """An op's injected failure that is no ``Exception`` (as ``SystemExit`` is not)."""


ERRORS: dict[str, type[BaseException]] = {
    "ValueError": ValueError, "KeyError": KeyError, "ZeroDivisionError": ZeroDivisionError,
    "Injected": Injected, "BaseInjected": BaseInjected, "RuntimeError": RuntimeError,
}


def expected_error(kind: str, message: str) -> tuple[str, str]:
    """What an error raised as ``ERRORS[kind](message)`` looks like: its type's name and its text."""
    return kind, str(ERRORS[kind](message))


def seen_error(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


class Hang(Exception):
    """A wait of the program's own ran past its deadline."""


# ----------------------------------------------------------------------------------- programs
@dataclass(frozen=True)
class Config:
    """A runtime to run programs on. ``device``: ``cpu`` (lanes), ``sim`` (the simulated device,
    with host lanes), ``inline`` (ops run inside their submit, as on CUDA) or ``inline_host``
    (the same beside host lanes)."""

    device: str
    streams: int
    max_inflight: int
    host_lanes: int
    seed: int

    def make(self) -> sd.Runtime:
        if self.device == "inline":
            return sd.Runtime(backend=InlineBackend("cpu", self.streams), max_inflight=self.max_inflight)
        if self.device == "inline_host":
            return sd.Runtime(backend=InlineBackend("sim", self.streams), max_inflight=self.max_inflight,
                              host_lanes=self.host_lanes)
        return sd.Runtime(self.device, streams=self.streams, max_inflight=self.max_inflight,
                          seed=self.seed, host_lanes=self.host_lanes)

    @property
    def has_host_lanes(self) -> bool:
        return self.device in ("sim", "inline_host")


@dataclass(frozen=True)
class Callback:
    """A done-callback on an eager op: it submits ``child`` (over memory of its own), waits for it
    without a timeout (``wait``: documented to raise inside a callback unless it is done), and adds
    a callback to it that submits ``then``."""

    child: OpSpec
    wait: bool
    then: OpSpec | None


@dataclass(frozen=True)
class OpSpec:
    """One op: reads views, updates ``write`` in place with what it read; raises on the calls
    (counted from 0) in ``fail_at``. From inside, it submits ``children`` and waits for them,
    runs inner graph ``graph_child``, or calls ``rt.synchronize()``/``rt.close()`` (``inner``)."""

    name: str
    reads: tuple[tuple, ...]
    write: tuple
    k: int
    fail_at: frozenset[int] = frozenset()
    error: str = "ValueError"
    host: bool = False
    form: str = "explicit"  # explicit reads=/writes=, "markers" (sd.read/sd.write), "nested_markers"
    children: tuple[OpSpec, ...] = ()
    graph_child: int | None = None
    inner: str | None = None
    callback: Callback | None = None
    sleep: float = 0.0
    nowait: bool = False


@dataclass
class Graph:
    ops: list[OpSpec]


@dataclass
class Part:
    """What one submitting thread does, over arrays of its own: ``events`` in order, each
    ``("op", OpSpec)``, ``("run", graph, wait)``, ``("wait", op name, how)`` or ``("sync",)``."""

    arrays: list[int]
    graphs: list[Graph]
    inner_graphs: list[Graph]
    events: list[tuple]


@dataclass
class Program:
    index: int
    category: str
    config: Config
    parts: list[Part]
    own_runtime: bool = False  # closes its runtime itself (close races, close inside an op)
    close_after: float | None = None  # close_race: seconds before the main thread closes

    def ops(self) -> int:
        n = 0
        for part in self.parts:
            for ev in part.events:
                if ev[0] == "op":
                    n += 1 + len(ev[1].children)
                elif ev[0] == "run":
                    n += sum(1 + len(o.children) for o in part.graphs[ev[1]].ops)
        return n


CATEGORIES = {
    # name: (weight, devices it runs on)
    "eager": (10, ("cpu", "sim", "inline", "inline_host")),
    "eager_fail": (10, ("cpu", "sim", "inline", "inline_host")),
    "graph": (6, ("cpu", "sim", "inline", "inline_host")),
    "graph_eager": (6, ("cpu", "sim", "inline", "inline_host")),
    "graph_fail": (8, ("cpu", "sim", "inline", "inline_host")),
    "mixed": (8, ("cpu", "sim", "inline", "inline_host")),
    "callbacks": (6, ("cpu", "sim", "inline", "inline_host")),
    "nested": (6, ("cpu", "sim", "inline", "inline_host")),
    "nested_graph": (3, ("cpu", "sim", "inline", "inline_host")),
    "threads": (5, ("cpu", "sim", "inline", "inline_host")),
    "close_race": (3, ("cpu", "sim", "inline", "inline_host")),
    "sync_in_op": (2, ("cpu", "sim", "inline", "inline_host")),
    "markers_nested": (2, ("cpu", "sim", "inline", "inline_host")),
    "zero_size": (3, ("cpu", "sim", "inline", "inline_host")),
    "base_exc": (2, ("cpu", "sim")),
    "base_exc_graph": (2, ("cpu", "sim")),
}

#: how the submitting thread waits for an op in the middle of a program
WAITS = ["result", "exception", "cf_wait", "as_completed", "current_stream_wait", "await"]

#: programs in a chunk share one configuration, and one runtime where they can
CHUNK = 25


def config_for(seed: int, chunk: int) -> Config:
    rng = random.Random(f"{seed}:config:{chunk}")
    device = rng.choice(["cpu", "cpu", "sim", "sim", "inline", "inline_host"])
    return Config(device, rng.randint(1, 4), rng.choice([2, 3, 4, 6, 8, 64]), rng.randint(1, 2),
                  rng.randrange(1 << 16))


def generate(seed: int, index: int, categories: list[str]) -> Program:
    """Program ``index`` of the soak ``seed`` (the same every time), of one of ``categories``."""
    config = config_for(seed, index // CHUNK)
    rng = random.Random(f"{seed}:program:{index}")
    allowed = [c for c in categories if config.device in CATEGORIES[c][1]]
    if not allowed:  # none of the chosen runs on this chunk's device: one that does
        allowed = categories
        config = replace(config, device="cpu")
    category = rng.choices(allowed, [CATEGORIES[c][0] for c in allowed])[0]
    return _Generator(rng, config, category).program(index)


class _Generator:
    def __init__(self, rng: random.Random, config: Config, category: str) -> None:
        self.rng, self.config, self.category = rng, config, category
        self.scratch = SCRATCH
        self.zeros = ZERO

    # views and ops
    def view(self, arrays: list[int], empty: float = 0.0, own: bool = True) -> tuple:
        """A view of one of ``arrays``; with chance ``empty`` a zero-size one (an array of its own,
        where ``own``, else a view ``a[i:i]``)."""
        rng = self.rng
        base = rng.choice(arrays)
        if rng.random() < empty:
            if rng.random() < 0.5 and own:  # a zero-size array of its own
                self.zeros += 1
                return (self.zeros, "whole", 0, 0)
            a = rng.randrange(N)
            return (base, "empty", a, a)
        return (base, rng.choice(VIEW_KINDS), rng.randrange(N), rng.randrange(N))

    def op(self, name: str, arrays: list[int], fail: float = 0.0, runs: int = 1, recorded: bool = False,
           **extra: Any) -> OpSpec:
        """An op; a ``recorded`` one writes no zero-size array that owns its data: an op may give such
        an array new memory, so a recording refuses it (by design, tested in test_moving_buffers)."""
        rng, cat = self.rng, self.category
        empty = 0.3 if cat == "zero_size" else 0.0
        reads = tuple(self.view(arrays, empty) for _ in range(rng.randint(0, 3)))
        fail_at = frozenset(n for n in range(runs) if rng.random() < fail)
        if cat.startswith("base_exc"):
            error = "BaseInjected" if rng.random() < 0.5 else "ValueError"
        else:
            error = rng.choice(["ValueError", "KeyError", "ZeroDivisionError", "Injected"])
        host = self.config.has_host_lanes and rng.random() < 0.25
        form = rng.choice(["explicit", "explicit", "markers"])
        if cat == "markers_nested" and rng.random() < 0.5:
            form = "nested_markers"
        write = self.view(arrays, empty, own=not recorded)
        return OpSpec(name, reads, write, rng.randrange(100), fail_at, error, host, form,
                      nowait=rng.random() < 0.1, **extra)

    def own_array(self) -> int:
        self.scratch += 1
        return self.scratch

    def child(self, name: str, fail: float, host: bool) -> OpSpec:
        """An op over an array of its own (and the read-only one), for an op or callback to submit."""
        mine = self.own_array()
        rng = self.rng
        return OpSpec(name, ((CONST, rng.choice(VIEW_KINDS), rng.randrange(N), rng.randrange(N)),),
                      (mine, rng.choice(VIEW_KINDS), rng.randrange(N), rng.randrange(N)), rng.randrange(100),
                      frozenset([0]) if rng.random() < fail else frozenset(), "Injected", host)

    def parent_host(self) -> bool:
        """Where an op that waits inside runs: a lane, or inside its submit (never on the simulated
        device's one thread, which runs its ops as a GPU runs kernels: nothing there can wait)."""
        device = self.config.device
        return device == "sim" or (device == "inline_host" and self.rng.random() < 0.3)

    # programs
    def program(self, index: int) -> Program:
        cat = self.category
        build = getattr(self, f"_{cat}")
        parts = build()
        program = Program(index, cat, self.config, parts)
        if cat == "close_race":
            program.own_runtime = True
            program.close_after = self.rng.choice([0.0, 0.0005, 0.002, 0.005])
        if cat == "sync_in_op":
            program.own_runtime = True
        if len(parts) == 1 and cat != "close_race":  # what is left to report, reported
            parts[0].events.append(("sync",))
        return program

    def _eager_events(self, arrays: list[int], prefix: str, count: int, fail: float, syncs: bool,
                      waits: bool = True) -> list[tuple]:
        rng, events, names = self.rng, [], []
        for i in range(count):
            spec = self.op(f"{prefix}{i}", arrays, fail)
            events.append(("op", spec))
            names.append(spec.name)
            if waits and rng.random() < 0.1:
                events.append(("wait", rng.choice(names), rng.choice(WAITS)))
            if syncs and rng.random() < 0.1:
                events.append(("sync",))
        return events

    def _eager(self) -> list[Part]:
        return [self._eager_part(0.0, False)]

    def _eager_fail(self) -> list[Part]:
        return [self._eager_part(0.2, True)]

    def _eager_part(self, fail: float, syncs: bool, arrays: list[int] | None = None,
                    prefix: str = "e") -> Part:
        arrays = arrays or [0, 1, 2]
        return Part(arrays, [], [], self._eager_events(arrays, prefix, self.rng.randint(2, 12), fail, syncs))

    def _either(self, arrays: list[int], prefix: str, fail: float, syncs: bool) -> Part:
        """Eager ops and graph runs without failures, or eager ops alone with some: the category's
        own feature, kept apart from failures in graphs (``graph_fail``, ``mixed``) so that what
        it finds is its own."""
        if self.rng.random() < 0.5:
            return self._mixed_part(arrays, prefix, fail=0.0, syncs=syncs)
        return self._eager_part(fail, syncs, arrays, f"{prefix}e")

    def _zero_size(self) -> list[Part]:
        return [self._either([0, 1, 2], "", 0.15, True)]

    def _markers_nested(self) -> list[Part]:
        return [self._either([0, 1, 2], "", 0.15, True)]

    def _base_exc(self) -> list[Part]:
        return [self._eager_part(0.2, True)]

    def _base_exc_graph(self) -> list[Part]:
        return [self._mixed_part([0, 1, 2], "", fail=0.15, syncs=True, eager=False)]

    def _graph_ops(self, arrays: list[int], prefix: str, runs: int, fail: float) -> Graph:
        n = self.rng.randint(1, 5)
        return Graph([self.op(f"{prefix}o{j}", arrays, fail, runs, recorded=True) for j in range(n)])

    def _mixed_part(self, arrays: list[int], prefix: str, fail: float, syncs: bool, graphs: int = 2,
                    eager: bool = True) -> Part:
        rng = self.rng
        runs = rng.randint(1, 3)
        gs = [self._graph_ops(arrays, f"{prefix}g{i}", runs * 2, fail) for i in range(rng.randint(1, graphs))]
        events: list[tuple] = []
        for r in range(runs * len(gs)):
            if eager:
                events += self._eager_events(arrays, f"{prefix}e{r}_", rng.randint(0, 3), fail, syncs)
            events.append(("run", rng.randrange(len(gs)), rng.random() < 0.3))
            if syncs and rng.random() < 0.15:
                events.append(("sync",))
        return Part(arrays, gs, [], events)

    def _graph(self) -> list[Part]:
        return [self._mixed_part([0, 1, 2], "", fail=0.0, syncs=False, eager=False)]

    def _graph_eager(self) -> list[Part]:
        return [self._mixed_part([0, 1, 2], "", fail=0.0, syncs=False)]

    def _graph_fail(self) -> list[Part]:
        return [self._mixed_part([0, 1, 2], "", fail=0.2, syncs=True, eager=False)]

    def _mixed(self) -> list[Part]:
        return [self._mixed_part([0, 1, 2], "", fail=0.12, syncs=True)]

    def _callbacks(self) -> list[Part]:
        rng = self.rng
        events = self._eager_events([0, 1, 2], "e", rng.randint(2, 8), 0.15, True)
        out = []
        for ev in events:
            if ev[0] == "op" and rng.random() < 0.5:
                spec = ev[1]
                then = self.child(f"{spec.name}_then", 0.2, False) if rng.random() < 0.5 else None
                cb = Callback(self.child(f"{spec.name}_cb", 0.2, False), rng.random() < 0.5, then)
                ev = ("op", replace(spec, callback=cb))
            out.append(ev)
        return [Part([0, 1, 2], [], [], out)]

    def _with_children(self, spec: OpSpec, fail: float) -> OpSpec:
        rng = self.rng
        host = self.parent_host()
        kids = tuple(self.child(f"{spec.name}_c{j}", fail, self.config.has_host_lanes and rng.random() < 0.5)
                     for j in range(rng.randint(1, 2)))
        return replace(spec, children=kids, host=host)

    def _nested(self) -> list[Part]:
        rng = self.rng
        part = self._either([0, 1, 2], "", 0.1, True)
        fail = 0.0 if part.graphs else 0.2
        part.events = [("op", self._with_children(ev[1], fail)) if ev[0] == "op" and rng.random() < 0.4
                       else ev
                       for ev in part.events]
        for g in part.graphs:
            g.ops = [self._with_children(o, 0.0) if rng.random() < 0.4 else o for o in g.ops]
        return [part]

    def _nested_graph(self) -> list[Part]:
        rng = self.rng
        inner = Graph([self.child(f"ig0o{j}", 0.0, False) for j in range(rng.randint(1, 3))])
        events = self._eager_events([0, 1, 2], "e", rng.randint(1, 6), 0.0, False)
        for i, ev in enumerate(events):
            if ev[0] == "op" and (rng.random() < 0.4 or i == 0):
                events[i] = ("op", replace(ev[1], graph_child=0, host=self.parent_host()))
        return [Part([0, 1, 2], [], [inner], events)]

    def _threads(self) -> list[Part]:
        parts = []
        for t in range(self.rng.randint(2, 3)):
            arrays = [3 * t + 20, 3 * t + 21, 3 * t + 22]  # each thread's own buffers
            parts.append(self._either(arrays, f"t{t}", 0.15, False))
        return parts

    def _close_race(self) -> list[Part]:
        parts = []
        for t in range(self.rng.randint(1, 3)):
            arrays = [3 * t + 20, 3 * t + 21, 3 * t + 22]
            events = self._eager_events(arrays, f"t{t}e", self.rng.randint(5, 30), 0.1, False, waits=False)
            events = [("op", replace(ev[1], sleep=self.rng.choice([0.0, 0.0, 0.0005, 0.002])))
                      for ev in events]
            parts.append(Part(arrays, [], [], events))
        return parts

    def _sync_in_op(self) -> list[Part]:
        rng = self.rng
        events = self._eager_events([0, 1, 2], "e", rng.randint(2, 8), 0.0, False)
        ops = [i for i, ev in enumerate(events) if ev[0] == "op"]
        if rng.random() < 0.3:  # close() inside the last op
            i = ops[-1]
            events[i] = ("op", replace(events[i][1], inner="close"))
        else:
            i = rng.choice(ops)
            events[i] = ("op", replace(events[i][1], inner="synchronize"))
        return [Part([0, 1, 2], [], [], events)]


def fresh_arrays(part: Part) -> dict[int, np.ndarray]:
    """The arrays a part's ops use, as they start: its buffers, the read-only one, and the
    arrays of its ops' children, callbacks and zero-size views."""
    bases = initial_bases()
    arrays: dict[int, np.ndarray] = {a: bases[i % 3].copy() * (1 + a) for i, a in enumerate(part.arrays)}
    arrays[CONST] = np.arange(N, dtype=np.int64) * 11
    for spec in _every_spec(part):
        for v in (*spec.reads, spec.write):
            if v[0] not in arrays:
                arrays[v[0]] = (np.zeros(0, dtype=np.int64) if v[0] >= ZERO
                                else np.arange(N, dtype=np.int64) * (v[0] % 7 + 2))
    return arrays


def _every_spec(part: Part):
    specs = [ev[1] for ev in part.events if ev[0] == "op"]
    specs += [o for g in part.graphs + part.inner_graphs for o in g.ops]
    while specs:
        spec = specs.pop()
        yield spec
        specs += spec.children
        if spec.callback is not None:
            specs.append(spec.callback.child)
            if spec.callback.then is not None:
                specs.append(spec.callback.then)


def view(arrays: dict[int, np.ndarray], spec: tuple) -> np.ndarray:
    base, kind, a, _ = spec
    if kind == "empty":
        return arrays[base][a:a]
    return make_view(arrays, spec)


def extent(spec: tuple) -> tuple[int, int, int] | None:
    """The elements a view spans by its extent; None for a zero-size one (it conflicts with nothing)."""
    base, kind, a, b = spec
    if kind == "empty" or base >= ZERO:
        return None
    _, lo, hi = elements((0, kind, a, b))
    return base, lo, hi


def _overlap(x: tuple[int, int, int], y: tuple[int, int, int]) -> bool:
    return x[0] == y[0] and x[1] <= y[2] and y[1] <= x[2]


# ----------------------------------------------------------------------------- the serial run
class Serial:
    """The serial run that the oracle is: one op at a time, in submission order.

    ``refused``: ``(op name, call, child)`` of the waits inside ops that the runtime refused
    (``child``: the child's number, or ``"graph"``), with the text raised; ``skipped``: ops whose
    submit was refused.
    """

    def __init__(self, arrays: dict[int, np.ndarray], refused: dict[tuple, str], skipped: set[str],
                 roots: list[tuple[str, str]]) -> None:
        self.arrays = {k: v.copy() for k, v in arrays.items()}
        self.poison: list[tuple[tuple[int, int, int], frozenset[str]]] = []
        self.roots = roots  # (shared by the threads of one program: one synchronize sees them all)
        self.calls: Counter[str] = Counter()
        self.refused, self.skipped = refused, skipped
        self.injected = 0
        self.ops = 0  # op runs, each run of a graph's op and each child counted
        self.children: dict[tuple, tuple] = {}  # (parent, call, j) -> outcome

    def execute(self, spec: OpSpec, inner_graphs: list[Graph] | None = None) -> tuple:
        """One op's outcome: ``("ok", value)``, ``("own", type, text)`` or ``("dep", roots)``."""
        self.ops += 1
        spans = [e for e in (extent(v) for v in (*spec.reads, spec.write)) if e is not None]
        roots = frozenset().union(*(r for p, r in self.poison if any(_overlap(p, e) for e in spans)))
        written = extent(spec.write)
        if roots:
            if written is not None:
                self.poison.append((written, roots))
            return ("dep", roots)
        n = self.calls[spec.name]
        self.calls[spec.name] += 1
        acc = spec.k
        for r in spec.reads:
            acc += int(view(self.arrays, r).sum()) % 1009
        error = None
        for j, child in enumerate(spec.children):
            got = self.execute(child)
            self.children[(spec.name, n, j)] = got
            why = self.refused.get((spec.name, n, j))
            if why is not None:
                got = ("own", *expected_error("RuntimeError", why))
            if got[0] == "ok":
                acc += got[1][0] + got[1][1]
            elif error is None:
                error = got[1:]
        if spec.graph_child is not None and inner_graphs is not None:
            why = self.refused.get((spec.name, n, "graph"))
            outcome = self.run_graph(inner_graphs[spec.graph_child], inner_graphs)
            if why is not None:
                error = error or expected_error("RuntimeError", why)
            elif outcome[0] == "ok":  # (what it read alone: parents on two lanes run it in either order)
                acc += sum(v[0] for v in outcome[1])
            elif error is None:
                error = ("graph failed", repr(outcome))
        if error is None and n in spec.fail_at:
            self.injected += 1
            error = expected_error(spec.error, f"injected {spec.name} call {n}")
        if error is not None:
            self.roots.append(error)
            if written is not None:
                self.poison.append((written, frozenset([spec.name])))
            return ("own", *error)
        out = view(self.arrays, spec.write)
        if out.size:
            out[...] = (out * 3 + acc) % 1000003
        return ("ok", (acc, int(out.sum())))

    def execute_with_callbacks(self, spec: OpSpec, inner_graphs: list[Graph]) -> tuple[tuple, dict]:
        outcome = self.execute(spec, inner_graphs)
        extra: dict[str, tuple] = {}
        cb = spec.callback
        if cb is not None:  # (over memory of their own: where they come in the order changes nothing)
            extra[cb.child.name] = self.execute(cb.child)
            if cb.then is not None:
                extra[cb.then.name] = self.execute(cb.then)
        return outcome, extra

    def run_graph(self, graph: Graph, inner_graphs: list[Graph] | None = None) -> tuple:
        """One run's outcome: ``("ok", values)``, ``("group", own errors)`` or ``("group_dep",
        names of the failed ops, roots)``."""
        ops = [o for o in graph.ops if o.name not in self.skipped]
        outs = [self.execute(o, inner_graphs) for o in ops]
        if all(o[0] == "ok" for o in outs):
            return ("ok", [o[1] for o in outs])
        own = sorted(o[1:] for o in outs if o[0] == "own")
        if own:
            return ("group", own)
        names = [o.name for o, out in zip(ops, outs) if out[0] == "dep"]
        return ("group_dep", frozenset(names), frozenset().union(*(o[1] for o in outs if o[0] == "dep")))

    def sync(self) -> list[tuple[str, str]]:
        roots = sorted(self.roots)
        self.roots.clear()
        self.poison.clear()
        return roots


# ------------------------------------------------------------------------------- the real run
@dataclass
class Observed:
    """What the runtime gave for one part of a program."""

    arrays: dict[int, np.ndarray]
    futures: dict[str, Any] = field(default_factory=dict)  # eager ops, callbacks' ops
    runs: list[Any] = field(default_factory=list)  # one future per graph run event
    children: dict[tuple, Any] = field(default_factory=dict)
    cb_waits: dict[str, tuple] = field(default_factory=dict)
    syncs: list[list[tuple[str, str]]] = field(default_factory=list)
    refused: dict[tuple, str] = field(default_factory=dict)
    skipped: set[str] = field(default_factory=set)
    accepted: int | None = None  # close_race: events submitted before the runtime closed
    inner: list[str] = field(default_factory=list)  # outcomes of synchronize()/close() inside ops
    unexpected: list[str] = field(default_factory=list)


class Body:
    """An op's function: what the oracle's ``Serial.execute`` computes, on the real arrays."""

    def __init__(self, spec: OpSpec, run: PartRun) -> None:
        self.spec, self.run, self.calls = spec, run, 0

    def __call__(self, *reads: Any, out: Any) -> tuple[int, int]:
        spec = self.spec
        n = self.calls
        self.calls += 1
        if spec.sleep:
            time.sleep(spec.sleep)
        if spec.form == "nested_markers":
            reads = reads[0]
        acc = spec.k
        for r in reads:
            acc += int(r.sum()) % 1009
        acc += self.run.inside(spec, n)
        if n in spec.fail_at:
            raise ERRORS[spec.error](f"injected {spec.name} call {n}")
        if out.size:
            out[...] = (out * 3 + acc) % 1000003
        return acc, int(out.sum())


class PartRun:
    """Runs one part of a program on a runtime, recording what it observed."""

    def __init__(self, rt: sd.Runtime, part: Part, deadline: float) -> None:
        self.rt, self.part, self.deadline = rt, part, deadline
        self.seen = Observed(fresh_arrays(part))
        self.bodies: dict[str, Body] = {}
        self.inner_graphs: list[Any] = []
        self.graphs: list[Any] = []

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def body(self, spec: OpSpec) -> Body:
        body = self.bodies.get(spec.name)
        if body is None:
            body = self.bodies[spec.name] = Body(spec, self)
        return body

    def submit(self, spec: OpSpec) -> Any:
        """Submit (or record) ``spec`` in its form; None where the submit was refused with a TypeError."""
        arrays, rt = self.seen.arrays, self.rt
        reads = [view(arrays, r) for r in spec.reads]
        out = view(arrays, spec.write)
        run_on = "host" if spec.host else None
        body = self.body(spec)
        submit = rt.submit_nowait if spec.nowait else rt.submit
        try:
            for attempt in (submit, rt.submit):
                try:
                    if spec.form == "explicit":
                        return attempt(body, *reads, out=out, reads=reads, writes=[out], name=spec.name,
                                       run_on=run_on)
                    if spec.form == "markers":
                        return attempt(body, *[sd.read(r) for r in reads], out=sd.write(out), name=spec.name,
                                       run_on=run_on)
                    return attempt(body, [sd.read(r) for r in reads], out=sd.write(out), name=spec.name,
                                   run_on=run_on)
                except sd.WouldBlock:
                    continue
        except TypeError as exc:  # documented for markers streamdag cannot track: nothing submitted
            if spec.form != "nested_markers":
                raise
            self.seen.skipped.add(spec.name)
            self.seen.inner.append(f"refused submit: {exc}")
            return None
        raise AssertionError("unreachable")

    def inside(self, spec: OpSpec, n: int) -> int:
        """What an op does from inside: submits its children and waits; runs its inner graph;
        calls synchronize() or close(). Returns what it adds to the op's value."""
        total, error = 0, None
        futures = []
        for j, child in enumerate(spec.children):
            f = self.submit(child)
            self.seen.children[(spec.name, n, j)] = f
            futures.append(f)
        for j, f in enumerate(futures):
            try:
                value = f.result()  # no timeout: a wait that could never end raises instead
            except Exception as exc:
                if isinstance(exc, RuntimeError) and REFUSED_WAIT in str(exc):
                    self.seen.refused[(spec.name, n, j)] = str(exc)
                error = error or exc
            else:
                total += value[0] + value[1]
        if spec.graph_child is not None:
            try:
                result = self.inner_graphs[spec.graph_child].run().result()
            except Exception as exc:
                if isinstance(exc, RuntimeError) and REFUSED_WAIT in str(exc):
                    self.seen.refused[(spec.name, n, "graph")] = str(exc)
                error = error or exc
            else:
                total += sum(v[0] for v in result)
        if spec.inner is not None:
            try:
                getattr(self.rt, spec.inner)()
            except BaseException as exc:  # what it raises is recorded, not judged
                self.seen.inner.append(f"{spec.inner} inside an op raised {type(exc).__name__}: {exc}")
            else:
                self.seen.inner.append(f"{spec.inner} inside an op returned")
        if error is not None:
            raise error
        return total

    def callback(self, cb: Callback):
        def submit_child(_f: Any) -> None:
            try:
                f = self.submit(cb.child)
                self.seen.futures[cb.child.name] = f
                if cb.then is not None:
                    f.add_done_callback(self.then(cb.then))
                if cb.wait:
                    try:
                        self.seen.cb_waits[cb.child.name] = ("value", f.result())
                    except Exception as exc:
                        self.seen.cb_waits[cb.child.name] = ("raised", *seen_error(exc))
            except BaseException as exc:  # a callback's raise is only logged: keep it
                self.seen.unexpected.append(f"callback of {cb.child.name}: {exc!r}")
        return submit_child

    def then(self, spec: OpSpec):
        def submit_then(_f: Any) -> None:
            try:
                self.seen.futures[spec.name] = self.submit(spec)
            except BaseException as exc:
                self.seen.unexpected.append(f"callback of {spec.name}: {exc!r}")
        return submit_then

    def record(self) -> None:
        rt = self.rt
        for g in self.part.inner_graphs + self.part.graphs:
            with rt.record() as recorded:
                for spec in g.ops:
                    self.submit(spec)
            (self.inner_graphs if g in self.part.inner_graphs else self.graphs).append(recorded)

    def wait(self, f: Any, how: str = "exception") -> None:
        """Wait for ``f`` as ``how`` says (one of ``WAITS``); its outcome is checked later."""
        try:
            if how == "cf_wait":
                if not concurrent.futures.wait([f], timeout=self.left())[0]:
                    raise TimeoutError
            elif how == "as_completed":
                next(concurrent.futures.as_completed([f], timeout=self.left()))
            elif how == "current_stream_wait":  # on the CPU and the simulated device: waits for the op
                self.rt.current_stream_wait(f)
            elif how == "await":
                asyncio.run(asyncio.wait_for(_awaited(f), self.left()))
            elif how == "result":
                f.result(timeout=self.left())
            else:
                f.exception(timeout=self.left())
        except (TimeoutError, concurrent.futures.TimeoutError, asyncio.TimeoutError):
            raise Hang(f"waiting ({how}) for {f!r}") from None
        except (Exception, BaseInjected):  # the op's outcome: checked later
            pass

    def events(self, closing: threading.Event | None = None) -> None:
        """Run the part's events; with ``closing`` (close_race), stop at the first RuntimeClosed."""
        seen = self.seen
        done = 0
        for ev in self.part.events:
            kind = ev[0]
            try:
                if kind == "op":
                    spec = ev[1]
                    f = self.submit(spec)
                    if f is not None:
                        seen.futures[spec.name] = f
                        if spec.callback is not None:
                            f.add_done_callback(self.callback(spec.callback))
                elif kind == "run":
                    f = self.graphs[ev[1]].run()
                    seen.runs.append(f)
                    if ev[2]:
                        self.wait(f)
                elif kind == "wait":
                    if ev[1] in seen.futures:
                        self.wait(seen.futures[ev[1]], ev[2])
                elif kind == "sync":
                    seen.syncs.append(self.sync())
            except sd.RuntimeClosed:
                if closing is None:
                    raise
                break
            done += 1
        seen.accepted = done

    def sync(self) -> list[tuple[str, str]]:
        try:
            self.rt.synchronize()
        except BaseException as exc:  # an ExceptionGroup, or a BaseExceptionGroup
            if not isinstance(exc, BaseExceptionGroup):
                raise
            return sorted(seen_error(e) for e in exc.exceptions)
        return []

    def wait_all(self) -> None:
        """Wait for every future the part has made (some made while waiting: callbacks' ops)."""
        waited: set[int] = set()
        while True:
            pending = [f for f in (*self.seen.futures.values(), *self.seen.runs, *self.seen.children.values())
                       if f is not None and id(f) not in waited]
            if not pending:
                return
            for f in pending:
                self.wait(f)
                waited.add(id(f))


async def _awaited(f: Any) -> Any:
    return await f


try:
    BaseExceptionGroup  # noqa: B018
except NameError:  # Python 3.10
    from streamdag.errors import BaseExceptionGroup


# ------------------------------------------------------------------------------------ checks
def _done(name: str, f: Any, want: Any, problems: list[str]) -> bool:
    """Whether ``f`` is done; a problem noted where it is not."""
    done = f.done()
    if not done:
        problems.append(f"{name}: not done (want {want})")
    return done


def _check_value(name: str, f: Any, want: Any, problems: list[str], shown: Callable[[BaseException], str],
                 noun: str = "value", as_got: Callable[[Any], Any] = lambda value: value) -> None:
    """``f`` (done) has the value ``want`` (``as_got`` of its result); a problem noted where it raised
    (its error as ``shown`` says) or has another value."""
    exc = f.exception(timeout=0)
    if exc is not None:
        problems.append(f"{name}: raised {shown(exc)}, want {noun} {want}")
    elif as_got(f.result(timeout=0)) != want:
        problems.append(f"{name}: {noun} {as_got(f.result(timeout=0))}, want {want}")


def _check_future(name: str, f: Any, want: tuple, problems: list[str]) -> None:
    if f is None:
        problems.append(f"{name}: no future (want {want})")
        return
    if not _done(name, f, want, problems):
        return
    exc = f.exception(timeout=0)
    if want[0] == "ok":
        _check_value(name, f, want[1], problems, seen_error)
    elif want[0] == "own":
        if exc is None or seen_error(exc) != want[1:]:
            problems.append(f"{name}: got {_show(f)}, want its own error {want[1:]}")
    elif not isinstance(exc, sd.DependencyFailed) or exc.root_name not in want[1] or exc.op_name != name:
        problems.append(f"{name}: got {_show(f)}, want DependencyFailed from one of {sorted(want[1])}")


def _show(f: Any) -> str:
    exc = f.exception(timeout=0)
    if exc is None:
        return f"value {f.result(timeout=0)}"
    extra = f" (root {exc.root_name!r})" if isinstance(exc, sd.DependencyFailed) else ""
    return f"{seen_error(exc)}{extra}"


def _check_run(i: int, f: Any, want: tuple, problems: list[str]) -> None:
    name = f"graph run {i}"
    if not _done(name, f, want[0], problems):
        return
    if want[0] == "ok":
        _check_value(name, f, want[1], problems, _group, noun="values", as_got=list)
        return
    exc = f.exception(timeout=0)
    if not isinstance(exc, BaseExceptionGroup):
        problems.append(f"{name}: got {_show(f)}, want a group of {want[1:]}")
        return
    got = sorted(seen_error(e) for e in exc.exceptions)
    if want[0] == "group":
        if got != want[1]:
            problems.append(f"{name}: group {got}, want {want[1]}")
        return
    ok = (len(exc.exceptions) == 1 and isinstance(exc.exceptions[0], sd.DependencyFailed)
          and exc.exceptions[0].op_name in want[1] and exc.exceptions[0].root_name in want[2])
    if not ok:
        problems.append(f"{name}: group {_group(exc)}, want one DependencyFailed of {sorted(want[1])} "
                        f"from one of {sorted(want[2])}")


def _callback_wait_ok(waited: tuple, want: tuple) -> bool:
    """A wait without a timeout inside a done-callback gets the child's outcome, or raises at once
    where the child is not done (documented: waiting there could hang)."""
    if waited[0] == "value":
        return want == ("ok", waited[1])
    if "done-callback" in waited[2]:
        return True
    if want[0] == "own":
        return waited[1:] == want[1:]
    return want[0] == "dep" and waited[1] == "DependencyFailed"


def _group(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return repr([seen_error(e) for e in exc.exceptions])
    return repr(seen_error(exc))


def check_part(part: Part, seen: Observed, roots: list[tuple[str, str]], closing: bool = False) -> tuple[
        list[str], int, int]:
    """What differs between the part's run and its serial run; the failures it injected; its op runs."""
    serial = Serial(fresh_arrays(part), seen.refused, seen.skipped, roots)
    problems: list[str] = []
    runs = iter(seen.runs)
    syncs = iter(seen.syncs)
    run_no = 0
    events = part.events if seen.accepted is None else part.events[:seen.accepted]
    for ev in events:
        kind = ev[0]
        if kind == "op":
            spec = ev[1]
            if spec.name in seen.skipped:
                continue
            want, extra = serial.execute_with_callbacks(spec, part.inner_graphs)
            _check_future(spec.name, seen.futures.get(spec.name), want, problems)
            for name, want_cb in extra.items():
                _check_future(name, seen.futures.get(name), want_cb, problems)
                waited = seen.cb_waits.get(name)
                if waited is not None and not _callback_wait_ok(waited, want_cb):
                    problems.append(f"{name}: the callback's wait got {waited}, want {want_cb}")
        elif kind == "run":
            want = serial.run_graph(part.graphs[ev[1]], part.inner_graphs)
            _check_run(run_no, next(runs), want, problems)
            run_no += 1
        elif kind == "sync":
            want = serial.sync()
            got = next(syncs)
            if got != want:
                problems.append(f"synchronize {got}, want {want}")
    for key, f in seen.children.items():
        want = serial.children.get(key)
        if want is None:
            problems.append(f"child {key}: ran, but its parent does not run serially")
        else:
            _check_future(f"{key[0]}_c{key[2]}", f, want, problems)
    for key in serial.children:
        if key not in seen.children:
            problems.append(f"child {key}: never submitted")
    for a, want_arr in serial.arrays.items():
        got_arr = seen.arrays[a]
        if not np.array_equal(got_arr, want_arr):
            problems.append(f"array {a}: {got_arr.tolist()}, want {want_arr.tolist()}")
    problems += seen.unexpected
    return problems, serial.injected, serial.ops


# ------------------------------------------------------------------------------- one program
def run_program(program: Program, rt: sd.Runtime, deadline: float) -> dict[str, Any]:
    """Run ``program`` on ``rt`` (a runtime of its own where it closes it) and check it against its
    serial run. Raises :class:`Hang` where one of its waits runs past ``deadline``."""
    runs = [PartRun(rt, part, deadline) for part in program.parts]
    final: list[tuple[str, str]] | None = None
    if program.category == "close_race":
        _race_close(program, rt, runs, deadline)
    elif len(runs) == 1:
        one = runs[0]
        one.record()
        one.events()
        one.wait_all()
    else:
        _in_threads(runs, deadline, lambda r: (r.record(), r.events(), r.wait_all()))
        final = runs[0].sync()
    problems: list[str] = []
    roots: list[tuple[str, str]] = []
    injected = ops = 0
    for i, (part, run) in enumerate(zip(program.parts, runs)):
        found, n, ran = check_part(part, run.seen, roots)
        injected += n
        ops += ran
        problems += [f"thread {i}: {p}" for p in found] if len(runs) > 1 else found
    if final is not None and final != sorted(roots):
        problems.append(f"synchronize {final}, want {sorted(roots)}")
    seen = [r.seen for r in runs]
    return {
        "problems": problems,
        "injected": injected,
        "ops": ops,
        "refused_waits": sum(len(s.refused) for s in seen),
        "refused_submits": sum(len(s.skipped) for s in seen),
        "inner": [x for s in seen for x in s.inner],
    }


def _in_threads(runs: list[PartRun], deadline: float, work: Any) -> None:
    errors: list[BaseException] = []

    def main(run: PartRun) -> None:
        try:
            work(run)
        except BaseException as exc:  # raised again in the program's thread
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(r,), daemon=True, name=f"soak-submitter-{i}")
               for i, r in enumerate(runs)]
    for t in threads:
        t.start()
    _join_by(deadline, threads, errors, "submitting thread {} still running")


def _join_by(deadline: float, threads: list[threading.Thread], errors: list[BaseException],
             hang: str) -> None:
    """Wait for ``threads`` until ``deadline``: a thread left running is a hang (``hang``, formatted
    with its name); then the first error a thread caught is raised again here."""
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            raise Hang(hang.format(t.name))
    if errors:
        raise errors[0]


def _race_close(program: Program, rt: sd.Runtime, runs: list[PartRun], deadline: float) -> None:
    """Submitters run until the runtime closes under them; each op submitted must then finish."""
    closing = threading.Event()
    started = threading.Barrier(len(runs) + 1)

    def submitter(run: PartRun) -> None:
        started.wait(5)
        run.events(closing)

    errors: list[BaseException] = []
    threads = []
    for i, run in enumerate(runs):
        def main(run: PartRun = run) -> None:
            try:
                submitter(run)
            except BaseException as exc:
                errors.append(exc)
        threads.append(threading.Thread(target=main, daemon=True, name=f"soak-submitter-{i}"))
    for t in threads:
        t.start()
    started.wait(5)
    time.sleep(program.close_after or 0.0)
    closing.set()
    rt.close()
    _join_by(deadline, threads, errors, "submitter {} still running after close() returned")
    for run in runs:
        run.wait_all()


def describe(program: Program) -> str:
    """The program as text, an op a line (for ``--replay``)."""
    lines = [f"program {program.index}: {program.category} on {program.config}"]

    def op(spec: OpSpec, indent: str) -> None:
        extra = [f"fails at call {sorted(spec.fail_at)} with {spec.error}" if spec.fail_at else "",
                 "on a host lane" if spec.host else "", spec.form if spec.form != "explicit" else "",
                 f"inner graph {spec.graph_child}" if spec.graph_child is not None else "",
                 f"calls {spec.inner}() inside" if spec.inner else "",
                 f"sleeps {spec.sleep}" if spec.sleep else ""]
        lines.append(f"{indent}{spec.name}: reads {list(spec.reads)} writes {spec.write} k={spec.k} "
                     + " ".join(x for x in extra if x))
        for child in spec.children:
            op(child, indent + "    child ")
        if spec.callback is not None:
            op(spec.callback.child, indent + "    callback submits ")
            if spec.callback.then is not None:
                op(spec.callback.then, indent + "    then ")
    for t, part in enumerate(program.parts):
        lines.append(f"part {t} over arrays {part.arrays}")
        for i, g in enumerate(part.inner_graphs):
            lines.append(f"  inner graph {i}:")
            for spec in g.ops:
                op(spec, "    ")
        for i, g in enumerate(part.graphs):
            lines.append(f"  graph {i}:")
            for spec in g.ops:
                op(spec, "    ")
        for ev in part.events:
            if ev[0] == "op":
                op(ev[1], "  submit ")
            else:
                lines.append(f"  {' '.join(map(str, ev))}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- shrinking
def smaller(program: Program):
    """Programs one step smaller than ``program``: an event, graph op, read, child, callback or
    failure left out, or an op made plainer (for ``--shrink``, which keeps those that still fail)."""
    for t in range(len(program.parts)):
        if len(program.parts) > 1:
            yield replace(program, parts=program.parts[:t] + program.parts[t + 1:])
    for t, part in enumerate(program.parts):
        def with_part(new: Part, t: int = t) -> Program:
            return replace(program, parts=[*program.parts[:t], new, *program.parts[t + 1:]])

        for i in range(len(part.events)):
            yield with_part(replace(part, events=part.events[:i] + part.events[i + 1:]))
        for gi, g in enumerate(part.graphs):
            for j in range(len(g.ops)):
                graphs = list(part.graphs)
                graphs[gi] = Graph(g.ops[:j] + g.ops[j + 1:])
                yield with_part(replace(part, graphs=graphs))
            for j, spec in enumerate(g.ops):
                for simpler in _plainer(spec):
                    graphs = list(part.graphs)
                    graphs[gi] = Graph([*g.ops[:j], simpler, *g.ops[j + 1:]])
                    yield with_part(replace(part, graphs=graphs))
        for i, ev in enumerate(part.events):
            if ev[0] == "op":
                for simpler in _plainer(ev[1]):
                    events = [*part.events[:i], ("op", simpler), *part.events[i + 1:]]
                    yield with_part(replace(part, events=events))


def _plainer(spec: OpSpec):
    for i in range(len(spec.reads)):
        yield replace(spec, reads=spec.reads[:i] + spec.reads[i + 1:])
    for n in spec.fail_at:
        yield replace(spec, fail_at=spec.fail_at - {n})
    for i in range(len(spec.children)):
        yield replace(spec, children=spec.children[:i] + spec.children[i + 1:])
    defaults = OpSpec("", (), (), 0)
    waits = bool(spec.children) or spec.graph_child is not None
    for name in ("callback", "host", "form", "nowait", "sleep", "graph_child", "inner", "error", "k"):
        if name == "host" and waits:  # (off a lane, on the simulated device, no op may wait)
            continue
        if getattr(spec, name) != getattr(defaults, name):
            yield replace(spec, **{name: getattr(defaults, name)})


def outcome(program: Program, hang_seconds: float) -> str:
    """``"ok"``, ``"mismatch"`` or ``"hang"``: one run of ``program`` on a fresh runtime (a hung one
    is left behind, its threads stuck)."""
    box: list[str] = []

    def run() -> None:
        rt = program.config.make()
        try:
            box.append("mismatch" if run_program(program, rt, time.monotonic() + hang_seconds)["problems"]
                       else "ok")
        except Hang:
            box.append("hang")
            return
        except BaseException:
            box.append("mismatch")
        rt.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(hang_seconds + 2)
    return box[0] if box else "hang"


def shrink(program: Program, hang_seconds: float, tries: int = 3) -> tuple[Program, str]:
    """A smaller program that fails as ``program`` does (a mismatch, or a hang), step by step."""
    def fails_as(candidate: Program, how: str) -> bool:
        return any(outcome(candidate, hang_seconds) == how for _ in range(tries))

    how = next((o for o in (outcome(program, hang_seconds) for _ in range(tries)) if o != "ok"), "ok")
    if how == "ok":
        return program, how
    progress = True
    while progress:
        progress = False
        for candidate in smaller(program):
            if fails_as(candidate, how):
                program, progress = candidate, True
                break
    return program, how
