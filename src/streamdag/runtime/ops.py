"""Ops as the runtime holds them, and the futures users get back."""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED
from concurrent.futures._base import FINISHED as _FINISHED
from concurrent.futures._base import PENDING as _PENDING
from types import CoroutineType
from typing import TYPE_CHECKING, Any, TypeVar

from ..backends.threads import callbacks_later, deferring_callbacks
from ..backends.threads import new_counters as new_counters
from ..errors import DependencyFailed
from ..graph.buffers import Access
from ..native import twin
from ..schedule.waits import Stamp
from .frames import release_frames
from .lane_waits import CALLBACKS, WatchedWaiters, in_done_callback, refuse_hanging_wait

__all__ = ["Future", "Op", "callbacks_later", "deferring_callbacks", "in_done_callback", "then"]

T = TypeVar("T")
_DONE_STATES = (CANCELLED, CANCELLED_AND_NOTIFIED, _FINISHED)


#: a lock as ``threading.Lock``; where the compiled hot path is built, one it takes without a Python
#: call (``native/_lock.c``: the compiled finish takes this one and the runtime's done lock per op)
new_lock: Callable[[], Any] = twin("Lock", threading.Lock)


class _PyRLock(_thread.RLock):
    """``threading.RLock`` under the compiled RLock's method names (``native/_lock.c``): ``is_owned``,
    ``release_all`` / ``reacquire`` (let go however often it is held, take it back)."""

    __slots__ = ()
    is_owned = _thread.RLock._is_owned
    release_all = _thread.RLock._release_save
    reacquire = _thread.RLock._acquire_restore


#: the runtime's central lock: re-entrant, and taken by the compiled submit without a Python call
new_rlock: Callable[[], Any] = twin("RLock", _PyRLock)
_LAZY = new_lock()  # orders making a future's condition against setting its result


class _Parts:
    """A runtime's parts that every submit reads: tracker, clocks, profiler, finish_ready,
    finish_every, closed (``core.Runtime``'s properties of those names are over these)."""

    __slots__ = ("clocks", "closed", "finish_every", "finish_ready", "profiler", "tracker")


#: a runtime's parts; where the compiled hot path is built, fields it reads in C
new_parts: Callable[[], Any] = twin("Parts", _Parts)
#: seconds between a lock-holding waiter's checks that the host lane it waits on does not wait on it
_LOCK_CHECK_EVERY = 0.02
_LAZY_LISTS = frozenset({"_waiters", "_done_callbacks"})
#: a Future's fields made when first asked for (its own slots; the compiled submit leaves them unset)
LAZY_FIELDS = frozenset({"_condition", *_LAZY_LISTS})
#: how long an ``await`` polls for its op before it waits to be woken
AWAIT_HELP_SECONDS = 2e-3
def _running_callbacks(settle: Callable[[Any], None], value: Any) -> None:
    CALLBACKS.depth = getattr(CALLBACKS, "depth", 0) + 1
    try:
        settle(value)
    finally:
        CALLBACKS.depth -= 1


def _numbered_name(name: str, number: int) -> str:
    """An unnamed op's name: its function's and its number (``native/_submit.c``'s numbered_name
    writes the same)."""
    return f"{name}#{number}"


class _PyFutureFields:
    """The fields of a future that the compiled submit sets and reads (all but the lazy ones), where
    the compiled hot path is not built; where it is, the record ``native.FutureFields`` declares
    the same fields in C."""

    __slots__ = ("_done_token", "_exception", "_fence", "_hurry", "_op_name", "_op_number", "_result",
                 "_state", "_watched")


if TYPE_CHECKING:
    _FutureFields = _PyFutureFields
else:  # the future record Future builds on: compiled (native/_submit.c), else Python; the same fields
    _FutureFields = twin("FutureFields", _PyFutureFields)


class Future(_FutureFields, concurrent.futures.Future[T]):
    """A :class:`concurrent.futures.Future` that can also be awaited in asyncio.

    Generic in the op's return value: ``rt.submit(fn, ...)`` gives a ``Future[T]``
    where ``fn`` returns ``T``, and ``result()`` and ``await`` give that ``T``.

    Its condition variable, and the lists of waiters and callbacks, are made
    only when something waits on it or adds a callback: most futures of small
    ops are set before anyone looks. The condition would cost more than the
    rest of their bookkeeping, and every object a pending op holds brings
    Python's cycle collector nearer (whose full passes take tens of ms).

    Its state is in the fields of a record (``_FutureFields``) and in slots, not
    in an instance dict (the base class has one, left empty): one object less
    per op, and the compiled submit sets and reads the record's fields in C.
    The lazy ones, slots of its own, stay unset until made (a read of an unset
    slot comes to ``__getattr__``).
    """

    # The lazy ones (``_condition``, ``_waiters``, ``_done_callbacks``) stay unset until first asked for
    # (``__getattr__``); ``_watched``: whether the condition was made (someone waits or a callback is
    # set); ``_hurry`` asks whoever finishes this future to look now, and with the future and a time
    # limit lets the waiting thread finish it itself (see ``CudaBackend.hurry``); ``_done_token``: the
    # backend's token for the op's completion entry, so that a waiter gets it finished first;
    # ``_fence``: the op's completion event, for ``Runtime.current_stream_wait`` (None: the host waits).
    __slots__ = tuple(sorted(LAZY_FIELDS))
    streamdag_future = True  # (how lane_waits tells a streamdag future among a wait's futures)

    def __init__(self) -> None:  # the base's state, without its Condition and lists (the compiled
        # submit, native/_submit.c, sets the same fields without this call: keep the two equal)
        self._state = _PENDING
        self._result = None
        self._exception = None
        self._watched = False
        self._hurry = self._done_token = self._fence = None
        self._op_name, self._op_number = "", None

    @property
    def op_name(self) -> str:
        """The name of the op whose result this is (``name#number`` where the submit named none)."""
        if self._op_number is not None:  # the submit leaves the number on until asked
            self._op_name, self._op_number = _numbered_name(self._op_name, self._op_number), None
        return self._op_name

    @op_name.setter
    def op_name(self, name: str) -> None:
        self._op_name, self._op_number = name, None

    if not TYPE_CHECKING:  # hidden from type checkers: a misspelt attribute must fail type checking

        def __getattr__(self, name: str) -> Any:  # an unset slot (or no such attribute)
            if name != "_condition" and name not in _LAZY_LISTS:
                raise AttributeError(name)
            # the condition or a list of the base class's, asked for the first time: all three made
            if (self._make_condition() and name == "_condition" and self._hurry is not None
                    and self._state not in _DONE_STATES):
                # someone waits in a way that does not go through result() (concurrent.futures.wait,
                # as_completed): ask for a prompt finish
                self._ask_first()
            return _SLOTS[name].__get__(self, Future)

    def _ask_first(self) -> None:
        """Ask whoever finishes this future to finish it promptly, ahead of others if it can."""
        token = self._done_token
        if token is None:
            self._hurry()  # type: ignore[misc]
        else:
            self._hurry(wanted=token)  # type: ignore[misc]

    def done(self) -> bool:
        return self._state in _DONE_STATES

    def cancel(self) -> bool:
        """Refuses, like a running ``concurrent.futures.Future``: returns False.

        The op was handed to its stream at submit and runs to its end; ops
        after it may depend on what it writes. (``asyncio.wait_for`` and
        ``concurrent.futures`` helpers call this; the future still completes.)
        """
        return False

    def _waited_on(self, timeout: float | None) -> float | None:
        """Let the waiting thread help finish this future; returns what is left of ``timeout``."""
        if self._state in _DONE_STATES:
            return timeout
        # (a done-callback first: one run on a lane after an op it submitted is not that op)
        if timeout is None and in_done_callback():
            raise RuntimeError(
                f"waiting on the unfinished streamdag future of {self.op_name!r} inside a done-callback "
                "would hang: the callback runs in a thread that finishes ops. Chain instead (add a "
                "done-callback to this future, or submit the follow-up as an op that reads its data), "
                "or pass a timeout"
            )
        if self.__dict__.get("_behind") == threading.get_ident():
            raise RuntimeError(
                f"waiting inside an op for op {self.op_name!r}, which it submitted and which is queued "
                "behind it on the same lane (or behind, or after, ops that wait for it), would wait "
                "forever: it runs only once the waiting op has returned. Give the runtime another lane "
                "(streams= on a CPU runtime, host_lanes= beside a device), so that it runs elsewhere, "
                "or add a done-callback instead of waiting")
        if self._hurry is None:
            return timeout
        started = time.perf_counter()
        self._hurry(self, timeout)
        return None if timeout is None else max(0.0, timeout - (time.perf_counter() - started))

    def result(self, timeout: float | None = None) -> T:
        timeout = self._waited_on(timeout)
        if self._state is _FINISHED:  # (waiting helped finish it) no condition to make, to read it
            if self._exception is not None:
                try:
                    raise self._exception
                finally:  # as the base class does: the traceback's frame must not hold this future
                    del self
            return self._result  # type: ignore[return-value]
        lanes = self.__dict__.get("_lanes_of")  # submitted from a lane to a lane: see LaneWaits
        if lanes is not None and self._state not in _DONE_STATES:
            with lanes.waiting(self, timeout):
                self._wait_holding_the_lock(timeout)
                return super().result(timeout)
        self._wait_holding_the_lock(timeout)
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        timeout = self._waited_on(timeout)
        if self._state is _FINISHED:
            return self._exception
        lanes = self.__dict__.get("_lanes_of")
        if lanes is not None and self._state not in _DONE_STATES:
            with lanes.waiting(self, timeout):
                self._wait_holding_the_lock(timeout)
                return super().exception(timeout)
        self._wait_holding_the_lock(timeout)
        return super().exception(timeout)

    def _wait_holding_the_lock(self, timeout: float | None) -> None:
        """For a host-lane op's future, waited for without a timeout by a thread that holds its
        runtime's lock: wait in slices until it is done, checking between them that its lane is
        not waiting for that lock (``LaneWaits.check_lock_holder``), which would never end."""
        lanes = self.__dict__.get("_lock_waits") if timeout is None else None
        if lanes is None or self._state in _DONE_STATES or not lanes.holds_the_lock():
            return
        condition = self._condition
        while True:
            lanes.check_lock_holder(self)
            with condition:
                if self._state in _DONE_STATES or condition.wait(_LOCK_CHECK_EVERY):
                    return

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future[T]], object]) -> None:
        self._make_condition()
        if self._hurry is not None and self._state not in _DONE_STATES:
            self._ask_first()  # a callback waits too, but nobody here can finish ops for it
        super().add_done_callback(fn)

    def _on_done(self, fn: Callable[[concurrent.futures.Future[T]], object]) -> None:
        """``add_done_callback`` for the runtime's own bookkeeping: nobody waits, so no hurry."""
        self._make_condition()
        super().add_done_callback(fn)

    def _make_condition(self) -> bool:
        """Make the condition, and the lists the base class uses with it, once (here rather than
        in ``__getattr__``, which asks for a prompt finish); whether this call made them. The
        three exist exactly when ``_watched`` is True: no unset slot is looked up, whose
        ``AttributeError`` cost a condition's making 1.5 µs a look."""
        if self._watched:
            return False
        with _LAZY:
            if self._watched:
                return False
            self._condition = threading.Condition()
            self._waiters = self._new_waiters()
            self._done_callbacks = []
            self._watched = True
            return True

    def _new_waiters(self) -> list[Any]:
        """The base class's waiter list, made with the condition, where ``concurrent.futures``
        installs its waiters: checked there (``lane_waits.WatchedWaiters``) for a wait that would
        never end (inside a done-callback; from a lane op, for a lane op it submitted)."""
        return WatchedWaiters(refuse_hanging_wait, self.__dict__.get("_lanes_of"))

    def _settle_unobserved(self, result: Any, exception: BaseException | None) -> bool:
        """Finish at once if nobody waits and no callback is set (no condition to notify)."""
        with _LAZY:
            if self._watched or self._state != _PENDING:
                return False
            self._result, self._exception, self._state = result, exception, _FINISHED
            return True

    def _settle_keeping_callbacks(self, result: Any, exception: BaseException | None) -> list[Any]:
        """Set the outcome and wake the waiters, but run no done-callback: returns them, for
        :meth:`_run_callbacks`. (The base class runs them inside ``set_result``.)"""
        with self._condition:  # re-entrant: ``set_result`` takes it again
            kept = self._done_callbacks
            self._done_callbacks = []
            if exception is None:
                super().set_result(result)
            else:
                super().set_exception(exception)
        return kept

    def _has_callbacks(self) -> bool:
        """Whether done-callbacks are set (one added meanwhile may run in the finishing thread)."""
        return self._watched and bool(self._done_callbacks)

    def _run_callbacks(self, callbacks: list[Any]) -> None:
        """Run done-callbacks kept by :meth:`_settle_keeping_callbacks`, as ``set_result`` would."""
        if callbacks:
            self._done_callbacks = callbacks  # the future is done: nothing else adds to this list
            _running_callbacks(lambda _: self._invoke_callbacks(), None)  # type: ignore[attr-defined]

    def set_result(self, result: T) -> None:
        if not self._settle_unobserved(result, None):
            _running_callbacks(super().set_result, result)

    def set_exception(self, exception: BaseException | None) -> None:
        if not self._settle_unobserved(None, exception):
            _running_callbacks(super().set_exception, exception)

    def __await__(self) -> Generator[Any, None, T]:
        """Await in asyncio: for a short while the awaiting task finishes the op itself, as soon
        as it has completed, yielding to the other tasks between polls; then it waits for the
        finishing thread to wake the event loop (a cross-thread wake-up: slower)."""
        if self._hurry is not None and self._state not in _DONE_STATES:
            deadline = time.perf_counter() + AWAIT_HELP_SECONDS
            while True:
                self._hurry(self, 0.0)  # one poll: finishes the op here if its event has completed
                if self._state in _DONE_STATES or time.perf_counter() >= deadline:
                    break
                yield from asyncio.sleep(0).__await__()  # lets the loop's other tasks run
        if self._state in _DONE_STATES:
            return self.result()
        return (yield from asyncio.wrap_future(self).__await__())

    def __repr__(self) -> str:
        return f"<streamdag.Future {self.op_name!r} {self._state.lower()}>"


#: the lazily made slots' member descriptors, through which ``__getattr__`` reads a slot it has just made
_SLOTS = {name: Future.__dict__[name] for name in LAZY_FIELDS}


def after_all(count: int, then_call: Callable[[], None]) -> Callable[[Any], None]:
    """A done-callback that calls ``then_call()`` once it has itself been called ``count`` times,
    from whichever threads finish the futures it is added to."""
    left = [count]
    lock = threading.Lock()

    def done(_f: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        then_call()

    return done


def all_of(futures: Sequence[Future[Any]], value: Any, op_name: str) -> Future[Any]:
    """A Future of ``value`` once all ``futures`` are done; the first exception among them, if any.

    Waiting on it helps finish the last of them (the others are hurried too): where they run in
    order on one stream, the last is done after the rest.
    """
    out: Future[Any] = Future()
    out.op_name = op_name
    if not futures:
        out.set_result(value)
        return out
    out._hurry = getattr(futures[-1], "_hurry", None)

    def settle() -> None:
        error = next((e for e in (f.exception() for f in futures) if e is not None), None)
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(value)

    done = after_all(len(futures), settle)
    for f in futures:
        f._on_done(done)
    return out


def then(source: concurrent.futures.Future[Any], fn: Callable[[Any], Any], op_name: str) -> Future[Any]:
    """A Future of ``fn(result)`` once ``source`` is done; its exception passes through as it is."""
    out = Future()
    out.op_name = op_name
    out._hurry = getattr(source, "_hurry", None)  # waiting on ``out`` is waiting on ``source``
    out._fence = getattr(source, "_fence", None)
    out._done_token = getattr(source, "_done_token", None)  # finishing ``source`` finishes ``out``

    def done(f: concurrent.futures.Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
            return
        try:
            value = fn(f.result())
        except Exception as exc:  # a raise here would only be logged, and ``out`` never finish
            out.set_exception(exc)
        else:
            out.set_result(value)

    if isinstance(source, Future):
        source._on_done(done)
    else:
        source.add_done_callback(done)
    return out


def failed_input(accesses: Sequence[Access], deps: Iterable[Any]) -> Any:
    """The first failed dep whose failure passes to an op with ``accesses``, or None.

    It passes where the failed op wrote (or was to write) memory the op reads
    or writes: a write may read first (an in-place update declared as a write),
    so only what a failed op merely read may be overwritten by the next op, as
    a reused buffer is. A failed reader changed nothing.
    """
    for dep in deps:
        if dep.error is None:
            continue
        for (space, start, end), write in dep.accesses:
            if write:
                for (s, lo, hi), _ in accesses:
                    if lo < end and start < hi and s == space:
                        return dep
    return None


class _PyOpFields:
    """The fields of an op where the compiled hot path is not built; where it is, the op record
    ``native.OpFields`` declares the same fields in C."""

    __slots__ = (
        "_name",
        "_numbered",
        "accesses",
        "args",
        "deps",
        "done",
        "error",
        "event",
        "finish",
        "fn",
        "future",
        "keep",
        "kwargs",
        "root_error",
        "root_name",
        "run_id",
        "seq",
        "stamp",
        "value",
    )


if TYPE_CHECKING:
    _OpFields = _PyOpFields
else:  # the op record Op builds on: compiled (native/_submit.c), else Python; the same fields
    _OpFields = twin("OpFields", _PyOpFields)


class Op(_OpFields):
    """One submitted op. References to its arguments are dropped once it has finished.

    Its fields are the op record's (``_OpFields``); the compiled submit (``native/_submit.c``) makes
    ops without calling ``__init__`` and sets each field itself. A field is added to both records,
    and set there too: its setup refuses an Op that adds fields of its own.
    """

    __slots__ = ()

    def __init__(
        self,
        seq: int,
        name: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        accesses: list[Access],
        numbered: bool = False,
    ) -> None:
        self.seq: int = seq
        self._name, self._numbered = name, numbered  # numbered: ``name#seq``, made when first read
        self.fn: Callable[..., Any] = fn
        self.args: tuple[Any, ...] = args
        self.kwargs: dict[str, Any] = kwargs
        self.accesses: list[Access] = accesses
        self.deps: Sequence[Op] = ()
        self.stamp: Stamp | None = None
        self.event: Any = None
        self.future: Future[Any] = Future()
        self.future._op_name, self.future._op_number = name, seq if numbered else None
        self.done: bool = False
        self.error: BaseException | None = None
        self.root_name: str = ""
        self.root_error: BaseException | None = None
        self.value: Any = None
        #: the buffers it declares written: held while it is pending, and after a failure until
        #: ``synchronize`` (its memory must not go to a new buffer while its failure passes on)
        self.keep: Any = None
        self.run_id: int = 0
        #: what finishes it once its completion event has been observed, called as
        #: ``finish(op, device_error)`` (see ``__call__``); set by the compiled submit, else None
        self.finish: Callable[[Op, BaseException | None], Any] | None = None

    @property
    def name(self) -> str:
        """The op's name: the one given to submit, else its function's followed by ``#seq`` (made
        when first asked for: the submit keeps the function's name and ``_numbered``)."""
        if self._numbered:
            self._name, self._numbered = _numbered_name(self._name, self.seq), False
        return self._name

    @name.setter
    def name(self, name: str) -> None:
        self._name, self._numbered = name, False

    def __repr__(self) -> str:
        return f"<op {self.name!r} #{self.seq}>"

    def __call__(self, device_error: BaseException | None = None) -> Any:
        """Finish the op: the callback of its completion entry, where the compiled submit made it
        (one object less per op than a ``partial``; the compiled pass calls ``finish`` directly)."""
        assert self.finish is not None, "an op the compiled submit did not make is no callback"
        return self.finish(self, device_error)

    def execute(self) -> None:
        """Run the op unless a dependency failed; raises only what is no ``Exception`` (Ctrl-C)."""
        dep = failed_input(self.accesses, self.deps) if self.deps else None
        if dep is not None:
            self.error = DependencyFailed(self.name, dep.root_name, dep.root_error)
            self.root_name, self.root_error = dep.root_name, dep.root_error
        else:
            try:
                value = self.fn(*self.args, **self.kwargs)
                if type(value) is CoroutineType:
                    refuse_coroutine(value, self.name)
                self.value = value
            except BaseException as exc:  # the op's failure is its future's, not ours
                if not isinstance(exc, Exception):  # an interrupt or SystemExit goes on up too (to
                    self.error = self.root_error = exc  # the caller, or to a lane that reports it)
                    self.root_name, self.deps = self.name, ()
                    raise
                self.error = self.root_error = release_frames(exc, caught_here=True)
                self.root_name = self.name
        self.deps = ()


def refuse_coroutine(coroutine: CoroutineType[Any, Any, Any], op_name: str) -> None:
    """Fail an op whose function returned a coroutine (an ``async def`` function): an op runs its
    function to its end on a stream, inside its submit on a GPU, where the submitting code's event
    loop may be running, so there is no one place to run the coroutine; awaiting is the caller's
    (``await rt.submit(...)``). Closed here, it warns of no coroutine never awaited.
    (The compiled execute, ``native/_submit.c``, calls this too.)"""
    coroutine.close()
    raise TypeError(
        f"op {op_name!r} returned a coroutine: streamdag runs an op's function to its end and does "
        "not await it. Submit a plain function (for an async def f, e.g. lambda: asyncio.run(f())), "
        "and await the op's future in async code instead")


def wait_for_host_inputs(accesses: list[Access], deps: list[Op], op: Any = None) -> None:
    """A host function on a GPU runtime runs at submit time: its host inputs must be final by then.

    Device work (kernels, copies) is ordered by events; host code reading or
    writing host memory that pending device work touches waits on the host.
    """
    if not deps:
        return
    for a in accesses:  # a plain loop: this runs for every op on a GPU runtime
        if a.region.space == "cpu":
            break
    else:
        return
    for dep in deps:
        if not dep.done and any(a.region.space == "cpu" for a in dep.accesses):
            event_of(dep, op).synchronize()


def event_of(dep: Op, op: Any) -> Any:
    """``dep``'s completion event; it has none while it launches, so ``op`` was submitted inside it."""
    event = dep.event
    if event is None:
        name = f"op {op.name!r}" if op is not None else "this copy"
        raise RuntimeError(
            f"{name} was submitted from inside op {dep.name!r}, whose memory it touches: on this "
            "device an op's function runs inside its submit. Run that work directly in the "
            "function (it lands on the op's stream), or submit it after")
    return event
