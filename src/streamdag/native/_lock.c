/* A plain lock, as ``threading.Lock``, that the compiled submit takes and lets go of with C calls.
 *
 * ``threading.Lock().acquire`` parses its arguments on every call (a few hundred instructions);
 * the compiled submit and finish take two such locks per op (the runtime's done lock and the
 * futures' ``_LAZY``). The runtime makes those two of this type where the module is built; Python
 * code uses them as it uses ``threading.Lock`` (``acquire(blocking, timeout)``, ``release``,
 * ``locked``, ``with``), and ``threading.Condition`` works on them as on a ``threading.Lock``.
 * A blocking acquire lets go of the GIL while it waits. Unlike ``threading.Lock``, a wait is not
 * cut short by a signal: these locks guard a few lines each.
 *
 * On Linux the lock is a POSIX semaphore of its own: CPython's lock (3.11, 3.12) reads the
 * monotonic clock at every acquire, even one that does not wait, to make a deadline it then does
 * not use, and such clock reads are ~1.3% of a chain's samples under perf. Elsewhere it is
 * CPython's lock.
 *
 * ``RLock`` is the re-entrant kind, as ``threading.RLock`` (``acquire``, ``release``, ``with``),
 * with ``is_owned``, ``release_all`` and ``reacquire`` for the runtime's own code (``ops.new_rlock``
 * gives ``threading.RLock`` the same names where this module is not built): the runtime's central
 * lock, taken once per submit. It is not a lock for ``threading.Condition``, which the runtime does
 * not build on it. A blocking acquire of it can be
 * cut short by a signal, as ``threading.RLock``'s: a thread waiting for the runtime while an op's
 * launch holds it still gets its KeyboardInterrupt.
 *
 * Included by _speedups.c (one module). Plain CPython API.
 */

#if defined(__linux__)
#include <errno.h>
#include <semaphore.h>
#include <time.h>
#define FAST_LOCK_SEM 1
#endif

typedef struct {
    PyObject_HEAD
#ifdef FAST_LOCK_SEM
    sem_t sem;  /* 1: free */
    char made;
#else
    PyThread_type_lock lock;
#endif
    char locked;
} FastLock;

static PyTypeObject *fast_lock_type;

static PyObject *fast_lock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
        return NULL;
    }
    FastLock *self = (FastLock *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
#ifdef FAST_LOCK_SEM
    if (sem_init(&self->sem, 0, 1) != 0) {
        Py_DECREF(self);
        PyErr_SetFromErrno(PyExc_RuntimeError);
        return NULL;
    }
    self->made = 1;
#else
    if ((self->lock = PyThread_allocate_lock()) == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_RuntimeError, "cannot allocate a lock");
        return NULL;
    }
#endif
    return (PyObject *)self;
}

static void fast_lock_dealloc(FastLock *self) {
    PyTypeObject *tp = Py_TYPE(self);
#ifdef FAST_LOCK_SEM
    if (self->made) sem_destroy(&self->sem);
#else
    if (self->lock != NULL) {
        if (self->locked) PyThread_release_lock(self->lock);
        PyThread_free_lock(self->lock);
    }
#endif
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

#ifdef FAST_LOCK_SEM
/* whether ``timeout`` (seconds, < 0: none) is a limit at all (threading.Lock takes up to ~292 years:
 * as good as none); if so, ``deadline`` is when it ends, on the realtime clock sem_timedwait takes */
static int deadline_after(double timeout, struct timespec *deadline) {
    if (timeout < 0 || timeout > 1e9) return 0;
    clock_gettime(CLOCK_REALTIME, deadline);
    double whole = (double)deadline->tv_sec + timeout;
    long nsec = deadline->tv_nsec + (long)((timeout - (double)(long long)timeout) * 1e9);
    deadline->tv_sec = (time_t)(long long)whole + nsec / 1000000000L;
    deadline->tv_nsec = nsec % 1000000000L;
    return 1;
}

/* the semaphore, waited for without the GIL: 1 taken, 0 the timeout (seconds, < 0: none) passed */
static int fast_lock_wait(FastLock *self, double timeout) {
    int rc;
    struct timespec deadline;
    int limited = deadline_after(timeout, &deadline);
    Py_BEGIN_ALLOW_THREADS
    if (!limited) {
        while ((rc = sem_wait(&self->sem)) != 0 && errno == EINTR) {}
    } else {
        while ((rc = sem_timedwait(&self->sem, &deadline)) != 0 && errno == EINTR) {}
    }
    Py_END_ALLOW_THREADS
    return rc == 0;
}

/* as fast_lock_wait, but a signal cuts it short: its Python handler runs (with the GIL), and if
 * that raises (KeyboardInterrupt) the wait ends: -1 with the exception set */
static int fast_lock_wait_interruptibly(FastLock *self, double timeout) {
    struct timespec deadline;
    int limited = deadline_after(timeout, &deadline);
    for (;;) {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = limited ? sem_timedwait(&self->sem, &deadline) : sem_wait(&self->sem);
        Py_END_ALLOW_THREADS
        if (rc == 0) return 1;
        if (errno != EINTR) return 0;
        if (PyErr_CheckSignals() < 0) return -1;
    }
}
#endif

/* 1 acquired, 0 not (not blocking, or the timeout passed); ``timeout`` in seconds, < 0: none */
static int fast_lock_take(FastLock *self, int blocking, double timeout) {
#ifdef FAST_LOCK_SEM
    int got = sem_trywait(&self->sem) == 0;
    if (!got && blocking && timeout != 0) got = fast_lock_wait(self, timeout);
    if (got) self->locked = 1;
    return got;
#else
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        self->locked = 1;
        return 1;
    }
    if (!blocking) return 0;
    PY_TIMEOUT_T us = -1;
    if (timeout >= 0) us = timeout * 1e6 >= (double)PY_TIMEOUT_MAX ? -1 : (PY_TIMEOUT_T)(timeout * 1e6);
    PyLockStatus got;
    Py_BEGIN_ALLOW_THREADS
    got = PyThread_acquire_lock_timed(self->lock, us, 0);
    Py_END_ALLOW_THREADS
    if (got != PY_LOCK_ACQUIRED) return 0;
    self->locked = 1;
    return 1;
#endif
}

static int fast_lock_give(FastLock *self) {
    if (!self->locked) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return -1;
    }
    self->locked = 0;
#ifdef FAST_LOCK_SEM
    sem_post(&self->sem);
#else
    PyThread_release_lock(self->lock);
#endif
    return 0;
}

/* ``acquire(blocking=True, timeout=-1)``'s arguments, checked as threading.Lock checks them: 0, or -1 */
static int acquire_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int *blocking,
                        double *timeout) {
    PyObject *blocking_obj = nargs > 0 ? args[0] : NULL, *timeout_obj = nargs > 1 ? args[1] : NULL;
    if (nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "acquire(blocking=True, timeout=-1)");
        return -1;
    }
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(key, "blocking") == 0 && blocking_obj == NULL) {
            blocking_obj = args[nargs + i];
        } else if (PyUnicode_CompareWithASCIIString(key, "timeout") == 0 && timeout_obj == NULL) {
            timeout_obj = args[nargs + i];
        } else {
            PyErr_Format(PyExc_TypeError, "acquire() got an unexpected or repeated keyword %R", key);
            return -1;
        }
    }
    *blocking = blocking_obj == NULL ? 1 : PyObject_IsTrue(blocking_obj);
    if (*blocking < 0) return -1;
    *timeout = -1;
    if (timeout_obj != NULL && timeout_obj != Py_None) {
        *timeout = PyFloat_AsDouble(timeout_obj);
        if (*timeout == -1 && PyErr_Occurred()) return -1;
        if (!*blocking && *timeout != -1) {
            PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
            return -1;
        }
        if (*timeout < 0 && *timeout != -1) {
            PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
            return -1;
        }
    }
    return 0;
}

static PyObject *fast_lock_acquire(FastLock *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int blocking;
    double timeout;
    if (acquire_args(args, nargs, kwnames, &blocking, &timeout) < 0) return NULL;
    return PyBool_FromLong(fast_lock_take(self, blocking, timeout));
}

static PyObject *fast_lock_enter(FastLock *self, PyObject *unused) {
    fast_lock_take(self, 1, -1);
    Py_RETURN_TRUE;
}

static PyObject *fast_lock_release(FastLock *self, PyObject *unused) {
    if (fast_lock_give(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *fast_lock_exit(FastLock *self, PyObject *const *args, Py_ssize_t nargs) {
    if (fast_lock_give(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *fast_lock_locked(FastLock *self, PyObject *unused) {
    return PyBool_FromLong(self->locked);
}

static PyMethodDef fast_lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))fast_lock_acquire, METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool, as threading.Lock's"},
    {"release", (PyCFunction)fast_lock_release, METH_NOARGS, "Let go of the lock (held: else RuntimeError)."},
    {"locked", (PyCFunction)fast_lock_locked, METH_NOARGS, "Whether the lock is held."},
    {"__enter__", (PyCFunction)fast_lock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))fast_lock_exit, METH_FASTCALL, NULL},
    {NULL}
};

static PyType_Slot fast_lock_slots[] = {
    {Py_tp_new, fast_lock_new},
    {Py_tp_dealloc, fast_lock_dealloc},
    {Py_tp_methods, fast_lock_methods},
    {Py_tp_doc, "A plain lock (as threading.Lock) that compiled code takes without a Python call."},
    {0, NULL}
};

static PyType_Spec fast_lock_spec = {
    "streamdag.native.Lock", sizeof(FastLock), 0, Py_TPFLAGS_DEFAULT, fast_lock_slots
};

/* ------------------------------------------------------------------ RLock */

typedef struct {
    PyObject_HEAD
    FastLock *lock;        /* held while count > 0 */
    unsigned long owner;   /* PyThread_get_thread_ident() of the holder */
    unsigned long count;   /* how many times the holder took it */
} FastRLock;

static PyTypeObject *fast_rlock_type;

static PyObject *fast_rlock_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "RLock() takes no arguments");
        return NULL;
    }
    PyObject *lock = fast_lock_new(fast_lock_type, args, kwds);
    if (lock == NULL) return NULL;
    FastRLock *self = (FastRLock *)type->tp_alloc(type, 0);
    if (self == NULL) { Py_DECREF(lock); return NULL; }
    self->lock = (FastLock *)lock;
    return (PyObject *)self;
}

static void fast_rlock_dealloc(FastRLock *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->lock != NULL && self->count) fast_lock_give(self->lock);
    Py_CLEAR(self->lock);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* the inner lock, blocking (a signal's exception cuts it short: -1), as threading.RLock waits */
static int fast_rlock_take_inner(FastRLock *self, int blocking, double timeout) {
#ifdef FAST_LOCK_SEM
    FastLock *lock = self->lock;
    if (sem_trywait(&lock->sem) == 0) { lock->locked = 1; return 1; }
    if (!blocking || timeout == 0) return 0;
    int got = fast_lock_wait_interruptibly(lock, timeout);
    if (got == 1) lock->locked = 1;
    return got;
#else
    FastLock *lock = self->lock;
    if (PyThread_acquire_lock(lock->lock, NOWAIT_LOCK)) { lock->locked = 1; return 1; }
    if (!blocking || timeout == 0) return 0;
    for (;;) {  /* CPython's own loop: a signal interrupts the wait, its handler runs, the wait goes on */
        PY_TIMEOUT_T us = timeout < 0 || timeout * 1e6 >= (double)PY_TIMEOUT_MAX ? -1 : (PY_TIMEOUT_T)(timeout * 1e6);
        PyLockStatus got;
        Py_BEGIN_ALLOW_THREADS
        got = PyThread_acquire_lock_timed(lock->lock, us, 1);
        Py_END_ALLOW_THREADS
        if (got == PY_LOCK_ACQUIRED) { lock->locked = 1; return 1; }
        if (got == PY_LOCK_FAILURE) return 0;
        if (PyErr_CheckSignals() < 0) return -1;  /* (the timeout restarts: good enough for a signal) */
    }
#endif
}

/* 1 acquired, 0 not, -1 a signal's handler raised */
static int fast_rlock_take(FastRLock *self, int blocking, double timeout) {
    unsigned long me = PyThread_get_thread_ident();
    if (self->count && self->owner == me) {
        if (self->count == ULONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "internal lock count overflowed");
            return -1;
        }
        self->count++;
        return 1;
    }
    int got = fast_rlock_take_inner(self, blocking, timeout);
    if (got == 1) {
        self->owner = me;
        self->count = 1;
    }
    return got;
}

static int fast_rlock_give(FastRLock *self) {
    if (!self->count || self->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return -1;
    }
    if (--self->count == 0) {
        self->owner = 0;
        return fast_lock_give(self->lock);
    }
    return 0;
}

static PyObject *fast_rlock_acquire(FastRLock *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    int blocking;
    double timeout;
    if (acquire_args(args, nargs, kwnames, &blocking, &timeout) < 0) return NULL;
    int got = fast_rlock_take(self, blocking, timeout);
    return got < 0 ? NULL : PyBool_FromLong(got);
}

static PyObject *fast_rlock_enter(FastRLock *self, PyObject *unused) {
    return fast_rlock_take(self, 1, -1) < 0 ? NULL : Py_NewRef(Py_True);
}

static PyObject *fast_rlock_release(FastRLock *self, PyObject *unused) {
    if (fast_rlock_give(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *fast_rlock_exit(FastRLock *self, PyObject *const *args, Py_ssize_t nargs) {
    if (fast_rlock_give(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *fast_rlock_is_owned(FastRLock *self, PyObject *unused) {
    return PyBool_FromLong(self->count && self->owner == PyThread_get_thread_ident());
}

/* let go of the lock however often it is held, and say how to take it back (``reacquire``): for a
 * thread that must wait for others which need the lock (the runtime's submit at its in-flight bound) */
static PyObject *fast_rlock_release_all(FastRLock *self, PyObject *unused) {
    if (self->count == 0) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    unsigned long count = self->count, owner = self->owner;
    self->count = 0;
    self->owner = 0;
    if (fast_lock_give(self->lock) < 0) return NULL;
    return Py_BuildValue("(kk)", count, owner);
}

static PyObject *fast_rlock_reacquire(FastRLock *self, PyObject *state) {
    unsigned long count, owner;
    if (!PyArg_ParseTuple(state, "kk:reacquire", &count, &owner)) return NULL;
    fast_lock_take(self->lock, 1, -1);  /* as threading.RLock's: not cut short by a signal */
    self->owner = owner;
    self->count = count;
    Py_RETURN_NONE;
}

static PyMethodDef fast_rlock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))fast_rlock_acquire, METH_FASTCALL | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1) -> bool, as threading.RLock's"},
    {"release", (PyCFunction)fast_rlock_release, METH_NOARGS, "Let go once (held by this thread: else RuntimeError)."},
    {"__enter__", (PyCFunction)fast_rlock_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))fast_rlock_exit, METH_FASTCALL, NULL},
    {"is_owned", (PyCFunction)fast_rlock_is_owned, METH_NOARGS, "Whether this thread holds it."},
    {"release_all", (PyCFunction)fast_rlock_release_all, METH_NOARGS,
     "Let go however often it is held; returns what reacquire() takes."},
    {"reacquire", (PyCFunction)fast_rlock_reacquire, METH_O, "Take it back as often as release_all() let go."},
    {NULL}
};

static PyType_Slot fast_rlock_slots[] = {
    {Py_tp_new, fast_rlock_new},
    {Py_tp_dealloc, fast_rlock_dealloc},
    {Py_tp_methods, fast_rlock_methods},
    {Py_tp_doc, "A re-entrant lock (as threading.RLock) that compiled code takes without a Python call."},
    {0, NULL}
};

static PyType_Spec fast_rlock_spec = {
    "streamdag.native.RLock", sizeof(FastRLock), 0, Py_TPFLAGS_DEFAULT, fast_rlock_slots
};

/* take (1) or let go of (0) ``lock``: in C if it is a FastLock, else through its bound ``method`` */
static int lock_take(PyObject *lock, PyObject *acquire) {
    if (lock != NULL && Py_TYPE(lock) == fast_lock_type) {
        fast_lock_take((FastLock *)lock, 1, -1);
        return 0;
    }
    if (lock != NULL && Py_TYPE(lock) == fast_rlock_type) return fast_rlock_take((FastRLock *)lock, 1, -1) < 0 ? -1 : 0;
    PyObject *r = PyObject_CallNoArgs(acquire);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int lock_give(PyObject *lock, PyObject *release) {
    if (lock != NULL && Py_TYPE(lock) == fast_lock_type) return fast_lock_give((FastLock *)lock);
    if (lock != NULL && Py_TYPE(lock) == fast_rlock_type) return fast_rlock_give((FastRLock *)lock);
    PyObject *r = PyObject_CallNoArgs(release);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static int fast_lock_init_type(PyObject *m) {
    fast_lock_type = (PyTypeObject *)PyType_FromSpec(&fast_lock_spec);
    if (fast_lock_type == NULL || PyModule_AddObjectRef(m, "Lock", (PyObject *)fast_lock_type) < 0) return -1;
    fast_rlock_type = (PyTypeObject *)PyType_FromSpec(&fast_rlock_spec);
    if (fast_rlock_type == NULL) return -1;
    return PyModule_AddObjectRef(m, "RLock", (PyObject *)fast_rlock_type);
}
