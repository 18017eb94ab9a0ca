"""The compiled lock and re-entrant lock (``native/_lock.c``) behave as ``threading``'s: they
exclude under contention, the lock works with conditions, the re-entrant one lets go of all its holds
for a wait and takes them back, and a wait for one is cut short by Ctrl-C."""

import pytest

from streamdag import native

compiled = pytest.mark.skipif(native.load() is None, reason=f"no compiled hot path: {native.status()}")


def _excludes_under_contention(lock, depth: int = 1) -> None:
    """Four threads count to 20,000 under ``lock`` (taken ``depth`` times), handing over mid-section."""
    import threading
    import time
    from contextlib import ExitStack

    count = [0]

    def add(n):
        for _ in range(n):
            with ExitStack() as held:
                for _ in range(depth):
                    held.enter_context(lock)
                seen = count[0]
                if seen % 97 == 0:
                    time.sleep(0)  # hand over mid-section now and then
                count[0] = seen + 1

    threads = [threading.Thread(target=add, args=(5000,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count[0] == 20000


def _condition_waits_on(lock) -> None:
    """``threading.Condition(lock)`` waits for another thread's notify, and holds the lock again after."""
    import threading
    import time

    cond, box = threading.Condition(lock), []

    def produce():
        time.sleep(0.02)
        with cond:
            box.append(1)
            cond.notify()

    producer = threading.Thread(target=produce)
    producer.start()
    with cond:
        assert cond.wait_for(lambda: box, timeout=5)
        assert lock.locked()
    producer.join()


@compiled
def test_the_compiled_lock_behaves_as_threading_lock():
    """``native.Lock`` stands in for ``threading.Lock`` (the runtime's done lock, the futures'
    ``_LAZY``): the same answers to every call, mutual exclusion under contention, and
    ``threading.Condition`` on it."""
    import threading
    import time

    from streamdag.runtime import ops

    assert ops._LAZY.__class__ is native.load().Lock  # the runtime uses it where it is built
    for make in (threading.Lock, native.load().Lock):
        lock = make()
        answers = [lock.locked(), lock.acquire(), lock.locked(), lock.acquire(False),
                   lock.acquire(blocking=False), lock.acquire(timeout=0.01)]
        lock.release()
        answers.append(lock.locked())
        with pytest.raises(RuntimeError):
            lock.release()
        with lock:
            answers.append(lock.locked())
        answers.append(lock.locked())
        with pytest.raises(ValueError):
            lock.acquire(False, 1.0)
        assert answers == [False, True, True, False, False, False, False, True, False], make

    _excludes_under_contention(native.load().Lock())
    _condition_waits_on(native.load().Lock())
    held = native.load().Lock()
    held.acquire()  # another thread waits on it, with a timeout, and gets it once let go
    got = []
    waiter = threading.Thread(
        target=lambda: got.append((held.acquire(timeout=0.01), held.acquire(timeout=5))))
    waiter.start()
    time.sleep(0.1)
    held.release()
    waiter.join()
    assert got == [(False, True)]


@compiled
def test_the_compiled_rlock_behaves_as_the_runtimes_python_rlock():
    """``native.RLock`` stands in for ``threading.RLock`` (``ops.new_rlock``'s Python twin, which
    has the same names) as the runtime's central lock: the same answers to every call (re-entry,
    release by a thread that does not hold it), mutual exclusion under contention, and a wait
    that lets go of it however often it is held (``release_all``) and takes it back."""
    import threading

    import streamdag as sd
    from streamdag.runtime import ops

    with sd.Runtime(streams=2) as rt:
        assert rt._lock.__class__ is native.load().RLock  # the runtime uses it where it is built
    for make in (ops._PyRLock, native.load().RLock):
        lock, answers = make(), []
        answers += [lock.acquire(), lock.acquire(False), lock.acquire(timeout=0.01), lock.is_owned()]
        other = threading.Thread(target=lambda lock=lock, answers=answers: answers.append(
            (lock.acquire(False), lock.acquire(timeout=0.01), lock.is_owned())))
        other.start()
        other.join()
        for _ in range(3):
            lock.release()
        answers.append(lock.is_owned())
        with pytest.raises(RuntimeError):
            lock.release()
        with lock, lock:
            answers.append(lock.is_owned())
            state = lock.release_all()  # another thread takes it meanwhile
            taker = threading.Thread(target=lambda lock=lock, answers=answers: answers.append(
                (lock.acquire(timeout=5), lock.release())))
            taker.start()
            taker.join()
            answers.append(lock.is_owned())
            lock.reacquire(state)
            answers.append(lock.is_owned())
        answers.append(lock.is_owned())
        with pytest.raises(ValueError):
            lock.acquire(False, 1.0)
        assert answers == [True, True, True, True, (False, False, False), False, True, (True, None), False,
                           True, False], make
        with pytest.raises(RuntimeError):
            lock.release()  # reacquire took it back exactly twice: both let go of by the with

    _excludes_under_contention(native.load().RLock(), depth=2)


@compiled
def test_a_wait_for_the_compiled_rlock_is_cut_short_by_ctrl_c():
    """A thread waiting for the runtime's lock (held by a long launch, say) still gets its
    KeyboardInterrupt, as with ``threading.RLock``."""
    import signal
    import threading
    import time

    lock, held, done = native.load().RLock(), threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(5)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    started = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
        assert time.perf_counter() - started < 5
        assert not lock.is_owned()
    finally:
        done.set()
        thread.join()
        timer.cancel()
    assert lock.acquire(timeout=5)  # and the lock still works
    lock.release()
