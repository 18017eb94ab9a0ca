/* The hot path of dependency tracking, compiled: an op's accesses and their link into the tracker
 * (and, included at the end, the runtime's submit and finish: _submit.c).
 *
 * Mirrors ``streamdag.graph.hazards`` (records, spaces, ``DepsTracker.link``) and
 * ``streamdag.graph.buffers`` (the byte range of a contiguous torch tensor) exactly; the Python
 * code stays the reference, and the tests check the two against each other. The rare paths
 * (a new range, a compaction, ranges that overlap others) call back into that Python code, which
 * reads and writes the same fields through the member descriptors below.
 *
 * Plain CPython API, no torch headers: a tensor is read through its Python methods.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdlib.h>
#include <string.h>
#include "_torch_hooks.h"

/* ------------------------------------------------------------------ module state */

typedef struct {
    PyTypeObject *record_type;
    PyTypeObject *space_type;
    PyTypeObject *tracker_type;
    PyTypeObject *clocks_type;
    /* set by setup(): what the Python side owns */
    PyObject *handlers;      /* buffers._HANDLERS: type -> region function */
    PyObject *torch_region;  /* buffers._torch_region */
    PyObject *numpy_region;  /* buffers._numpy_like_region */
    PyTypeObject *ndarray;   /* numpy.ndarray, whose memory is read through the buffer protocol */
    PyObject *region_of;     /* buffers.region_of */
    PyObject *cuda_spaces;   /* buffers._CUDA_SPACES: device index -> "cuda:N" */
    PyObject *resizing;      /* buffers._RESIZING: objects pending ops may give new memory */
    PyObject *strided;       /* torch.strided, once a tensor is seen */
    PyTypeObject *region_type;
    PyTypeObject *access_type;
    PyObject *cpu;           /* "cpu" */
    const StreamdagTorchHooks *torch;  /* from the torch extension (use_torch()), or NULL */
    PyObject *torch_module;  /* keeps it loaded */
    /* setup_compaction(): the tracker and space classes whose compaction is hazards.py's own
     * (_TrackerMethods._space/_compact, _Space.keep), done here without those calls */
    PyTypeObject *compact_tracker, *compact_space;
    PyObject *max_horizon;
    PyObject *space_of;  /* _TrackerMethods._space(tracker, name): a space made, or compacted, in Python */
    /* the last subclass that passed each check of is_kind(): runtime/accel.py's classes
     * derive from this module's types, and PyObject_TypeCheck walks a subclass's MRO every time */
    PyTypeObject *seen_space, *seen_tracker, *seen_clocks;
} State;

static State state;  /* one interpreter: the module is not meant for subinterpreters */

/* ``PyLong_AsLongLong``, through ``PyLong_AsLong`` where a long is as wide (LP64): for an int past
 * 2**30 (an address, a byte offset) CPython's long long conversion goes through a byte array, while
 * its long conversion reads the digits; same result, same errors */
static inline long long as_long_long(PyObject *obj) {
#if LONG_MAX == LLONG_MAX
    return PyLong_AsLong(obj);
#else
    return PyLong_AsLongLong(obj);
#endif
}

/* PyObject_TypeCheck(obj, base), with the last subclass that passed kept in ``*seen`` */
static inline int is_kind(PyObject *obj, PyTypeObject *base, PyTypeObject **seen) {
    PyTypeObject *tp = Py_TYPE(obj);
    if (tp == base || tp == *seen) return 1;
    if (base == NULL || !PyType_IsSubtype(tp, base)) return 0;
    Py_INCREF(tp);
    Py_XSETREF(*seen, tp);
    return 1;
}

static PyObject *s_record, *s_is_cuda, *s_is_cpu, *s_get_device, *s_layout,
                *s_data_ptr, *s_is_contiguous, *s_nbytes, *s_torch, *s_strided;

/* ------------------------------------------------------------------ Record */

typedef struct {
    PyObject_HEAD
    long long start;
    long long end;
    PyObject *writer;   /* (node, order) or None */
    PyObject *readers;  /* list of (node, order) */
    char shared;
    char stale;  /* keep(): to be dropped */
    long long last;
} Record;

static int record_init(Record *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"start", "end", NULL};
    long long start, end;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL", kwlist, &start, &end)) return -1;
    PyObject *readers = PyList_New(0);
    if (readers == NULL) return -1;
    self->start = start;
    self->end = end;
    Py_XSETREF(self->writer, Py_NewRef(Py_None));
    Py_XSETREF(self->readers, readers);
    self->shared = 0;
    self->last = 0;
    return 0;
}

static int record_traverse(Record *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->writer);
    Py_VISIT(self->readers);
    return 0;
}

static int record_clear(Record *self) {
    Py_CLEAR(self->writer);
    Py_CLEAR(self->readers);
    return 0;
}

static void record_dealloc(Record *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    record_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *record_size(Record *self, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t n = self->readers == NULL ? 0 : PyList_GET_SIZE(self->readers);
    return PyLong_FromSsize_t(n + (self->writer != NULL && self->writer != Py_None));
}

static PyMemberDef record_members[] = {
    {"start", T_LONGLONG, offsetof(Record, start), 0, NULL},
    {"end", T_LONGLONG, offsetof(Record, end), 0, NULL},
    {"writer", T_OBJECT, offsetof(Record, writer), 0, NULL},
    {"readers", T_OBJECT_EX, offsetof(Record, readers), 0, NULL},
    {"shared", T_BOOL, offsetof(Record, shared), 0, NULL},
    {"last", T_LONGLONG, offsetof(Record, last), 0, NULL},
    {NULL}
};

static PyMethodDef record_methods[] = {
    {"size", (PyCFunction)record_size, METH_NOARGS, "Writers and readers held."},
    {NULL}
};

static PyType_Slot record_slots[] = {
    {Py_tp_doc, "One byte range: its last writer and the readers since, each as (node, order added)."},
    {Py_tp_init, record_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, record_traverse},
    {Py_tp_clear, record_clear},
    {Py_tp_dealloc, record_dealloc},
    {Py_tp_members, record_members},
    {Py_tp_methods, record_methods},
    {0, NULL}
};

static PyType_Spec record_spec = {
    "streamdag.native.Record", sizeof(Record), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, record_slots
};

/* ------------------------------------------------------------------ Space */

typedef struct {
    PyObject_HEAD
    PyObject *by_range;  /* dict (start, end) -> Record */
    PyObject *starts;
    PyObject *records;
    PyObject *dropped;
    long long longest, count, scanned, compact_at, horizon, made, came_back;
} Space;

static int space_traverse(Space *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->by_range);
    Py_VISIT(self->starts);
    Py_VISIT(self->records);
    Py_VISIT(self->dropped);
    return 0;
}

static int space_clear(Space *self) {
    Py_CLEAR(self->by_range);
    Py_CLEAR(self->starts);
    Py_CLEAR(self->records);
    Py_CLEAR(self->dropped);
    return 0;
}

static void space_dealloc(Space *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    space_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef space_members[] = {
    {"by_range", T_OBJECT_EX, offsetof(Space, by_range), 0, NULL},
    {"starts", T_OBJECT_EX, offsetof(Space, starts), 0, NULL},
    {"records", T_OBJECT_EX, offsetof(Space, records), 0, NULL},
    {"dropped", T_OBJECT_EX, offsetof(Space, dropped), 0, NULL},
    {"longest", T_LONGLONG, offsetof(Space, longest), 0, NULL},
    {"count", T_LONGLONG, offsetof(Space, count), 0, NULL},
    {"scanned", T_LONGLONG, offsetof(Space, scanned), 0, NULL},
    {"compact_at", T_LONGLONG, offsetof(Space, compact_at), 0, NULL},
    {"horizon", T_LONGLONG, offsetof(Space, horizon), 0, NULL},
    {"made", T_LONGLONG, offsetof(Space, made), 0, NULL},
    {"came_back", T_LONGLONG, offsetof(Space, came_back), 0, NULL},
    {NULL}
};


static PyObject *record_key(Record *rec) {
    PyObject *start = PyLong_FromLongLong(rec->start), *end = PyLong_FromLongLong(rec->end);
    PyObject *key = (start && end) ? PyTuple_Pack(2, start, end) : NULL;
    Py_XDECREF(start);
    Py_XDECREF(end);
    return key;
}

/* The op record: the fields of every submitted op (``ops.Op`` is a Python subclass that adds
 * methods, no fields). Its type, ``OpFields``, is made in _submit.c from ``op_field_names``. */
enum {
    OP_SEQ, OP_NAME, OP_FN, OP_ARGS, OP_KWARGS, OP_ACCESSES, OP_DEPS, OP_STAMP, OP_EVENT, OP_FUTURE,
    OP_DONE, OP_ERROR, OP_ROOT_NAME, OP_ROOT_ERROR, OP_VALUE, OP_KEEP, OP_RUN_ID, OP_FINISH, OP_NUMBERED,
    OP_FIELDS
};

typedef struct {
    PyObject_HEAD
    PyObject *fields[OP_FIELDS];  /* NULL: unset (reading it raises AttributeError, as a slot) */
} OpRecord;

#define OPF(op, f) (((OpRecord *)(op))->fields[f])

/* the runtime's ``completion.finished_ok``, and its Op type (setup_submit() sets them): compaction
 * asks it of every node it visits, answered here from the op's fields without the Python call */
static struct { PyObject *fn; PyTypeObject *op_type; } finished_ok;

/* whether ``gone(entry[0])`` for an entry (node, order) */
static int entry_gone(PyObject *gone, PyObject *entry) {
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "a record's entries must be (node, order) tuples");
        return -1;
    }
    PyObject *node = PyTuple_GET_ITEM(entry, 0);
    if (gone == finished_ok.fn && Py_TYPE(node) == finished_ok.op_type) {
        PyObject *done = OPF(node, OP_DONE), *error = OPF(node, OP_ERROR);
        if (done != NULL && error != NULL) return done == Py_True && error == Py_None;
    }
    PyObject *out = PyObject_CallOneArg(gone, node);
    if (out == NULL) return -1;
    int truth = PyObject_IsTrue(out);
    Py_DECREF(out);
    return truth;
}

/* _SpaceMethods.keep (hazards.py, the reference): drop the nodes that are gone, and the empty
 * records idle for ``horizon`` accesses once half are */
static PyObject *space_keep(Space *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_keep(gone, now, max_horizon)");
        return NULL;
    }
    PyObject *gone = args[0];
    long long now = as_long_long(args[1]), max_horizon = as_long_long(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (self->records == NULL || !PyList_Check(self->records) || self->by_range == NULL
            || self->dropped == NULL) {
        PyErr_SetString(PyExc_TypeError, "a space's records must be a list, with by_range and dropped");
        return NULL;
    }
    if (self->came_back && 4 * self->came_back >= self->made)
        self->horizon = 2 * self->horizon < max_horizon ? 2 * self->horizon : max_horizon;
    self->made = self->came_back = 0;
    long long idle_since = now - self->horizon, count = 0;
    Py_ssize_t stale = 0;
    PyObject *records = Py_NewRef(self->records);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(records); i++) {
        PyObject *item = PyList_GET_ITEM(records, i);
        if (!PyObject_TypeCheck(item, state.record_type)) {
            PyErr_SetString(PyExc_TypeError, "records must be of this module's type");
            goto error;
        }
        Record *rec = (Record *)Py_NewRef(item);
        rec->stale = 0;
        if (rec->writer != NULL && rec->writer != Py_None) {
            int g = entry_gone(gone, rec->writer);
            if (g < 0) { Py_DECREF(rec); goto error; }
            if (g) Py_XSETREF(rec->writer, Py_NewRef(Py_None));
        }
        if (rec->readers != NULL && PyList_GET_SIZE(rec->readers)) {
            /* a new list without the readers gone (as the Python code makes), only where one is */
            PyObject *old = Py_NewRef(rec->readers), *kept = NULL;
            for (Py_ssize_t j = 0; j < PyList_GET_SIZE(old); j++) {
                PyObject *entry = PyList_GET_ITEM(old, j);
                int g = entry_gone(gone, entry);
                if (g < 0) { Py_XDECREF(kept); Py_DECREF(old); Py_DECREF(rec); goto error; }
                if (g && kept == NULL && (kept = PyList_GetSlice(old, 0, j)) == NULL) {
                    Py_DECREF(old); Py_DECREF(rec); goto error;
                }
                if (!g && kept != NULL && PyList_Append(kept, entry) < 0) {
                    Py_DECREF(kept); Py_DECREF(old); Py_DECREF(rec); goto error;
                }
            }
            Py_DECREF(old);
            if (kept != NULL) Py_XSETREF(rec->readers, kept);
        }
        long long size = (rec->readers ? PyList_GET_SIZE(rec->readers) : 0)
                         + (rec->writer != NULL && rec->writer != Py_None);
        count += size;
        if (!size && rec->last < idle_since) {
            rec->stale = 1;
            stale++;
        }
        Py_DECREF(rec);
    }
    self->count = count;
    Py_ssize_t n = PyList_GET_SIZE(records);
    if (stale && 2 * stale >= n) {
        PyObject *kept = PyList_New(0), *starts = PyList_New(0);
        if (kept == NULL || starts == NULL) { Py_XDECREF(kept); Py_XDECREF(starts); goto error; }
        for (Py_ssize_t i = 0; i < n; i++) {
            Record *rec = (Record *)PyList_GET_ITEM(records, i);
            if (!rec->stale) {
                PyObject *start = PyLong_FromLongLong(rec->start);
                if (start == NULL || PyList_Append(kept, (PyObject *)rec) < 0 || PyList_Append(starts, start) < 0) {
                    Py_XDECREF(start); Py_DECREF(kept); Py_DECREF(starts); goto error;
                }
                Py_DECREF(start);
                continue;
            }
            PyObject *key = record_key(rec);
            if (key == NULL || PyDict_DelItem(self->by_range, key) < 0
                    || PyDict_SetItem(self->dropped, key, Py_None) < 0) {
                Py_XDECREF(key); Py_DECREF(kept); Py_DECREF(starts); goto error;
            }
            Py_DECREF(key);
        }
        Py_ssize_t excess = PyDict_GET_SIZE(self->dropped) - (Py_ssize_t)max_horizon;
        if (excess > 0) {  /* forget the oldest dropped ranges */
            PyObject *oldest = PyList_New(0), *key, *value;
            Py_ssize_t pos = 0;
            if (oldest == NULL) { Py_DECREF(kept); Py_DECREF(starts); goto error; }
            while (PyList_GET_SIZE(oldest) < excess && PyDict_Next(self->dropped, &pos, &key, &value))
                if (PyList_Append(oldest, key) < 0) { Py_DECREF(oldest); Py_DECREF(kept); Py_DECREF(starts); goto error; }
            for (Py_ssize_t i = 0; i < PyList_GET_SIZE(oldest); i++)
                if (PyDict_DelItem(self->dropped, PyList_GET_ITEM(oldest, i)) < 0) {
                    Py_DECREF(oldest); Py_DECREF(kept); Py_DECREF(starts); goto error;
                }
            Py_DECREF(oldest);
        }
        Py_XSETREF(self->records, kept);
        Py_XSETREF(self->starts, starts);
    }
    Py_DECREF(records);
    Py_RETURN_NONE;
error:
    Py_DECREF(records);
    return NULL;
}


/* bisect.bisect_right (right=1) or bisect_left (right=0) over a sorted list of ints; -1 on error */
static Py_ssize_t bisect_ints(PyObject *list, long long x, int right) {
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        long long v = as_long_long(PyList_GET_ITEM(list, mid));
        if (v == -1 && PyErr_Occurred()) return -1;
        if (right ? x < v : !(v < x)) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

/* _SpaceMethods.overlapping (hazards.py, the reference): the records overlapping [start, end) */
static PyObject *overlapping(Space *self, long long start, long long end) {
    if (self->starts == NULL || self->records == NULL || !PyList_Check(self->starts)
            || !PyList_Check(self->records)) {
        PyErr_SetString(PyExc_TypeError, "a space's starts and records must be lists");
        return NULL;
    }
    Py_ssize_t lo = bisect_ints(self->starts, start - self->longest, 1);
    Py_ssize_t hi = lo < 0 ? -1 : bisect_ints(self->starts, end, 0);
    if (hi < 0) return NULL;
    PyObject *out = PyList_New(0), *records = Py_NewRef(self->records);  /* (see collect_record) */
    for (Py_ssize_t i = lo; out != NULL && i < hi && i < PyList_GET_SIZE(records); i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        if (!PyObject_TypeCheck(rec, state.record_type)) {
            PyErr_SetString(PyExc_TypeError, "records must be of this module's type");
            Py_CLEAR(out);
        } else if (((Record *)rec)->end > start && PyList_Append(out, rec) < 0) {
            Py_CLEAR(out);
        }
    }
    Py_DECREF(records);
    return out;
}

static PyObject *space_overlapping(Space *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "overlapping(start, end)");
        return NULL;
    }
    long long start = as_long_long(args[0]), end = as_long_long(args[1]);
    if (PyErr_Occurred()) return NULL;
    return overlapping(self, start, end);
}

static PyMethodDef space_methods[] = {
    {"_keep", (PyCFunction)(void (*)(void))space_keep, METH_FASTCALL,
     "_keep(gone, now, max_horizon): the compiled keep()."},
    {"_overlapping", (PyCFunction)(void (*)(void))space_overlapping, METH_FASTCALL,
     "_overlapping(start, end): the compiled overlapping()."},
    {NULL}
};

static PyType_Slot space_slots[] = {
    {Py_tp_doc, "The fields of one address space's records (the methods are Python's)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, space_traverse},
    {Py_tp_clear, space_clear},
    {Py_tp_dealloc, space_dealloc},
    {Py_tp_members, space_members},
    {Py_tp_methods, space_methods},
    {0, NULL}
};

static PyType_Spec space_spec = {
    "streamdag.native.SpaceFields", sizeof(Space), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, space_slots
};

/* ------------------------------------------------------------------ Tracker */

typedef struct {
    PyObject_HEAD
    PyObject *spaces;   /* dict name -> Space */
    PyObject *retired;
    long long order;
} Tracker;

static int tracker_traverse(Tracker *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->spaces);
    Py_VISIT(self->retired);
    return 0;
}

static int tracker_clear(Tracker *self) {
    Py_CLEAR(self->spaces);
    Py_CLEAR(self->retired);
    return 0;
}

static void tracker_dealloc(Tracker *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    tracker_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* The nodes an op must follow, each with its earliest order (the reference's ``found`` dict). Ops
 * (the runtime's nodes, told apart by identity) go into a small array, holding its own references;
 * any other node, or more than FOUND_LINEAR of them (a write after many reads of one range), and it
 * becomes the dict the Python code has: node -> order, hashed and compared as there. */
#define FOUND_LINEAR 32
typedef struct { PyObject *node; long long order; } Found;
typedef struct {
    Found items[FOUND_LINEAR];
    Py_ssize_t n;
    PyObject *dict;  /* NULL while the array serves */
} FoundSet;

static void found_init(FoundSet *f) {
    f->n = 0;
    f->dict = NULL;
}

static void found_clear(FoundSet *f) {
    for (Py_ssize_t i = 0; i < f->n; i++) Py_DECREF(f->items[i].node);
    f->n = 0;
    Py_CLEAR(f->dict);
}

/* from the array to the dict */
static int found_to_dict(FoundSet *f) {
    if ((f->dict = PyDict_New()) == NULL) return -1;
    for (Py_ssize_t i = 0; i < f->n; i++) {
        PyObject *order = PyLong_FromLongLong(f->items[i].order);
        int bad = order == NULL || PyDict_SetItem(f->dict, f->items[i].node, order) < 0;
        Py_XDECREF(order);
        if (bad) return -1;
    }
    for (Py_ssize_t i = 0; i < f->n; i++) Py_DECREF(f->items[i].node);
    f->n = 0;
    return 0;
}

/* found[node] = min(found.get(node), order) */
static int note(FoundSet *f, PyObject *node, PyObject *order_obj) {
    if (f->dict == NULL && Py_TYPE(node) == finished_ok.op_type) {
        long long order = as_long_long(order_obj);
        if (order == -1 && PyErr_Occurred()) return -1;
        for (Py_ssize_t i = 0; i < f->n; i++)
            if (f->items[i].node == node) {
                if (order < f->items[i].order) f->items[i].order = order;
                return 0;
            }
        if (f->n < FOUND_LINEAR) {
            f->items[f->n].node = Py_NewRef(node);
            f->items[f->n].order = order;
            f->n++;
            return 0;
        }
    }
    if (f->dict == NULL && found_to_dict(f) < 0) return -1;
    PyObject *had = PyDict_GetItemWithError(f->dict, node);
    if (had == NULL) {
        if (PyErr_Occurred()) return -1;
        return PyDict_SetItem(f->dict, node, order_obj);
    }
    long long order = as_long_long(order_obj), old = as_long_long(had);
    if ((order == -1 || old == -1) && PyErr_Occurred()) return -1;
    return order < old ? PyDict_SetItem(f->dict, node, order_obj) : 0;
}

/* Holds its own references to what it reads: a dict insertion may run the cycle collector, and a
 * finalizer that submits (re-entering the tracker) may replace the record's writer or readers. */
static int collect_record(Record *rec, int write, FoundSet *found) {
    int failed = 0;
    PyObject *w = rec->writer == NULL ? NULL : Py_NewRef(rec->writer);
    if (w != NULL && w != Py_None) {
        if (!PyTuple_Check(w) || PyTuple_GET_SIZE(w) != 2) {
            PyErr_SetString(PyExc_TypeError, "a record's writer must be a (node, order) tuple");
            failed = -1;
        } else {
            failed = note(found, PyTuple_GET_ITEM(w, 0), PyTuple_GET_ITEM(w, 1));
        }
    }
    Py_XDECREF(w);
    if (failed || !write || rec->readers == NULL) return failed;
    PyObject *readers = Py_NewRef(rec->readers);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(readers) && !failed; i++) {
        PyObject *r = Py_NewRef(PyList_GET_ITEM(readers, i));
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 2) {
            PyErr_SetString(PyExc_TypeError, "a record's reader must be a (node, order) tuple");
            failed = -1;
        } else {
            failed = note(found, PyTuple_GET_ITEM(r, 0), PyTuple_GET_ITEM(r, 1));
        }
        Py_DECREF(r);
    }
    Py_DECREF(readers);
    return failed;
}

static int by_order(const void *a, const void *b) {
    long long x = ((const Found *)a)->order, y = ((const Found *)b)->order;
    return (x > y) - (x < y);
}

/* the nodes found, by their earliest order (no two share one: each access has its own) */
static PyObject *in_order(FoundSet *f) {
    if (f->dict != NULL) {  /* its nodes into the array's place, sorted the same way */
        Py_ssize_t n = PyDict_GET_SIZE(f->dict), pos = 0, i = 0;
        if (n < 2) return PyDict_Keys(f->dict);
        Found *items = PyMem_Malloc(n * sizeof(Found));
        if (items == NULL) return PyErr_NoMemory();
        PyObject *key, *value;
        while (PyDict_Next(f->dict, &pos, &key, &value)) {
            items[i].node = key;
            items[i].order = as_long_long(value);
            i++;
        }
        PyObject *out = NULL;
        if (!PyErr_Occurred()) {
            qsort(items, n, sizeof(Found), by_order);
            if ((out = PyList_New(n)) != NULL)
                for (i = 0; i < n; i++) PyList_SET_ITEM(out, i, Py_NewRef(items[i].node));
        }
        PyMem_Free(items);
        return out;
    }
    if (f->n > 1) qsort(f->items, f->n, sizeof(Found), by_order);
    PyObject *out = PyList_New(f->n);
    if (out != NULL)
        for (Py_ssize_t i = 0; i < f->n; i++) PyList_SET_ITEM(out, i, Py_NewRef(f->items[i].node));
    return out;
}

typedef struct { Space *space; Record *rec; int write; } Touched;

/* ``by_range.get((start, end))`` (borrowed, NULL if absent or on error) without making the key: a
 * tuple kept for look-ups is filled with the two ints for the time of the look-up. Hashing and
 * comparing ints runs no Python code, so nothing can see it meanwhile; it is not tracked by the
 * cycle collector, and is emptied again before this returns. */
static PyObject *range_lookup(PyObject *by_range, PyObject *start, PyObject *end) {
    static PyObject *key = NULL;
    if (key == NULL || Py_REFCNT(key) != 1) {  /* (a look-up never keeps it; be sure) */
        PyObject *fresh = PyTuple_New(2);
        if (fresh == NULL) return NULL;
        PyObject_GC_UnTrack(fresh);
        Py_XSETREF(key, fresh);
    }
    if (!PyLong_CheckExact(start) || !PyLong_CheckExact(end)) {  /* made as it is (an int subclass) */
        PyObject *made = PyTuple_Pack(2, start, end);
        if (made == NULL) return NULL;
        PyObject *rec = PyDict_GetItemWithError(by_range, made);
        Py_DECREF(made);
        return rec;
    }
    PyTuple_SET_ITEM(key, 0, start);  /* borrowed, for the look-up only */
    PyTuple_SET_ITEM(key, 1, end);
    PyObject *rec = PyDict_GetItemWithError(by_range, key);
    PyTuple_SET_ITEM(key, 0, NULL);
    PyTuple_SET_ITEM(key, 1, NULL);
    return rec;
}

/* _TrackerMethods._compact (hazards.py, the reference) for the classes setup_compaction() named:
 * drop retired nodes (``space.keep``), and put the next compaction after at least as many adds (or
 * records scanned) as this one visited. The caller holds a reference to ``space``. */
static int compact(Space *space, Tracker *tracker) {
    if (tracker->retired != NULL && tracker->retired != Py_None) {
        PyObject *now = PyLong_FromLongLong(tracker->order);
        if (now == NULL) return -1;
        PyObject *retired = Py_NewRef(tracker->retired);  /* keep() may run code */
        PyObject *args[] = {retired, now, state.max_horizon};
        PyObject *r = space_keep(space, args, 3);
        Py_DECREF(now);
        Py_DECREF(retired);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    if (space->records == NULL || !PyList_Check(space->records)) {
        PyErr_SetString(PyExc_TypeError, "a space's records must be a list");
        return -1;
    }
    long long visited = PyList_GET_SIZE(space->records) + space->count;
    space->scanned = 0;
    space->compact_at = space->count + (visited > 64 ? visited : 64);
    return 0;
}

/* setup_compaction(tracker_type, space_type, max_horizon, space_of): see State */
static PyObject *setup_compaction(PyObject *module, PyObject *args) {
    PyObject *tracker_type, *space_type, *max_horizon, *space_of;
    if (!PyArg_ParseTuple(args, "O!O!O!O", &PyType_Type, &tracker_type, &PyType_Type, &space_type,
                          &PyLong_Type, &max_horizon, &space_of))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)tracker_type, state.tracker_type)
            || !PyType_IsSubtype((PyTypeObject *)space_type, state.space_type)) {
        PyErr_SetString(PyExc_TypeError, "setup_compaction takes subclasses of TrackerFields and SpaceFields");
        return NULL;
    }
    Py_XSETREF(state.compact_tracker, (PyTypeObject *)Py_NewRef(tracker_type));
    Py_XSETREF(state.compact_space, (PyTypeObject *)Py_NewRef(space_type));
    Py_XSETREF(state.max_horizon, Py_NewRef(max_horizon));
    Py_XSETREF(state.space_of, Py_NewRef(space_of));
    Py_RETURN_NONE;
}

/* DepsTracker.link: depends_on then add in one pass (see hazards.py, the reference) */
static PyObject *tracker_link(Tracker *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "link(node, accesses)");
        return NULL;
    }
    PyObject *node = args[0];
    PyObject *seq = PySequence_Fast(args[1], "link() needs a sequence of accesses");
    if (seq == NULL) return NULL;
    if (self->spaces == NULL || !PyDict_Check(self->spaces)) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_TypeError, "the tracker's _spaces must be a dict");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), used = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Touched local[8];
    Touched *touched = n <= 8 ? local : PyMem_Malloc(n * sizeof(Touched));
    FoundSet found;
    found_init(&found);
    PyObject *result = NULL;
    if (touched == NULL) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *acc = items[i];
        if (!PyTuple_Check(acc) || PyTuple_GET_SIZE(acc) != 2 || !PyTuple_Check(PyTuple_GET_ITEM(acc, 0))
                || PyTuple_GET_SIZE(PyTuple_GET_ITEM(acc, 0)) != 3) {
            PyErr_SetString(PyExc_TypeError, "an access is ((space, start, end), write)");
            goto done;
        }
        PyObject *region = PyTuple_GET_ITEM(acc, 0);
        int write = PyObject_IsTrue(PyTuple_GET_ITEM(acc, 1));
        if (write < 0) goto done;
        PyObject *name = PyTuple_GET_ITEM(region, 0);
        PyObject *start_o = PyTuple_GET_ITEM(region, 1), *end_o = PyTuple_GET_ITEM(region, 2);
        long long start = as_long_long(start_o), end = as_long_long(end_o);
        if ((start == -1 || end == -1) && PyErr_Occurred()) goto done;
        if (start == end) continue;
        PyObject *space = PyDict_GetItemWithError(self->spaces, name);  /* borrowed */
        if (space == NULL && PyErr_Occurred()) goto done;
        if (space != NULL && !is_kind(space, state.space_type, &state.seen_space)) {
            PyErr_SetString(PyExc_TypeError, "a tracker's spaces must be its own");
            goto done;
        }
        int due = space != NULL && ((Space *)space)->count + ((Space *)space)->scanned >= ((Space *)space)->compact_at;
        if (due && Py_TYPE(self) == state.compact_tracker && Py_TYPE(space) == state.compact_space) {
            Py_INCREF(space);  /* compacting may run code (the retired test, deallocs) */
            if (compact((Space *)space, self) < 0) { Py_DECREF(space); goto done; }  /* _space -> _compact */
        } else if (space == NULL || due) {
            if (state.space_of == NULL) {
                PyErr_SetString(PyExc_RuntimeError, "streamdag.native: setup_compaction() was not called");
                goto done;
            }
            space = PyObject_CallFunctionObjArgs(state.space_of, (PyObject *)self, name, NULL);  /* made or compacted */
            if (space == NULL) goto done;
            if (!is_kind(space, state.space_type, &state.seen_space)) {
                Py_DECREF(space);
                PyErr_SetString(PyExc_TypeError, "space_of() must return a space of this module's type");
                goto done;
            }
        } else {
            Py_INCREF(space);
        }
        Space *sp = (Space *)space;
        if (sp->by_range == NULL) {
            Py_DECREF(space);
            PyErr_SetString(PyExc_AttributeError, "by_range");
            goto done;
        }
        PyObject *rec = range_lookup(sp->by_range, start_o, end_o);
        if (rec != NULL) {
            Py_INCREF(rec);
        } else {
            if (PyErr_Occurred()) { Py_DECREF(space); goto done; }
            rec = PyObject_CallMethodObjArgs(space, s_record, start_o, end_o, NULL);
            if (rec == NULL) { Py_DECREF(space); goto done; }
        }
        if (!PyObject_TypeCheck(rec, state.record_type)) {
            Py_DECREF(rec);
            Py_DECREF(space);
            PyErr_SetString(PyExc_TypeError, "records must be of this module's type");
            goto done;
        }
        /* used now: a compaction later in this link (at another access) must not drop it as idle,
         * which left this op's entry in a record no look-up finds */
        ((Record *)rec)->last = self->order + 1;
        touched[used].space = sp;  /* the references are the entry's now */
        touched[used].rec = (Record *)rec;
        touched[used].write = write;
        used++;
        if (((Record *)rec)->shared) {
            PyObject *near_seq = overlapping(sp, start, end);
            if (near_seq == NULL) goto done;
            Py_ssize_t m = PySequence_Fast_GET_SIZE(near_seq);
            sp->scanned += m;
            for (Py_ssize_t j = 0; j < m; j++) {
                PyObject *other = PySequence_Fast_GET_ITEM(near_seq, j);
                if (!PyObject_TypeCheck(other, state.record_type)) {
                    PyErr_SetString(PyExc_TypeError, "records must be of this module's type");
                    Py_DECREF(near_seq);
                    goto done;
                }
                if (collect_record((Record *)other, write, &found) < 0) { Py_DECREF(near_seq); goto done; }
            }
            Py_DECREF(near_seq);
            continue;
        }
        if (collect_record((Record *)rec, write, &found) < 0) goto done;
    }
    /* after the look-ups: an op never depends on itself. One entry (node, order) serves all of the
     * node's accesses: its first order (deps are sorted by order, and a link's orders come after
     * every earlier link's, so the sort is the same as with an order per access) */
    long long order = self->order;
    PyObject *entry = NULL;
    if (used) {
        PyObject *order_obj = PyLong_FromLongLong(order + 1);
        if (order_obj == NULL) goto done;
        entry = PyTuple_Pack(2, node, order_obj);
        Py_DECREF(order_obj);
        if (entry == NULL) goto done;
    }
    for (Py_ssize_t i = 0; i < used; i++) {
        Record *rec = touched[i].rec;
        Space *sp = touched[i].space;
        order++;
        rec->last = order;
        if (touched[i].write) {
            Py_ssize_t readers = rec->readers ? PyList_GET_SIZE(rec->readers) : 0;
            sp->count += 1 - readers - (rec->writer != NULL && rec->writer != Py_None);
            Py_XSETREF(rec->writer, Py_NewRef(entry));
            if (rec->readers != NULL && Py_REFCNT(rec->readers) == 1) {  /* only the record holds it */
                if (readers && PyList_SetSlice(rec->readers, 0, readers, NULL) < 0) goto done_entry;
            } else {
                PyObject *fresh = PyList_New(0);
                if (fresh == NULL) goto done_entry;
                Py_XSETREF(rec->readers, fresh);
            }
        } else {
            if (rec->readers == NULL && (rec->readers = PyList_New(0)) == NULL) goto done_entry;
            if (PyList_Append(rec->readers, entry) < 0) goto done_entry;
            sp->count += 1;
        }
        self->order = order;
    }
    Py_XDECREF(entry);
    result = in_order(&found);
    goto done;
done_entry:
    Py_DECREF(entry);
done:
    for (Py_ssize_t i = 0; i < used; i++) {
        Py_DECREF(touched[i].rec);
        Py_DECREF(touched[i].space);
    }
    if (touched != local) PyMem_Free(touched);
    found_clear(&found);
    Py_DECREF(seq);
    return result;
}

static PyMemberDef tracker_members[] = {
    {"_spaces", T_OBJECT_EX, offsetof(Tracker, spaces), 0, NULL},
    {"_retired", T_OBJECT, offsetof(Tracker, retired), 0, NULL},
    {"_order", T_LONGLONG, offsetof(Tracker, order), 0, NULL},
    {NULL}
};

static PyMethodDef tracker_methods[] = {
    {"link", (PyCFunction)(void (*)(void))tracker_link, METH_FASTCALL,
     "depends_on then add in one pass over the records: the runtime's path."},
    {NULL}
};

static PyType_Slot tracker_slots[] = {
    {Py_tp_doc, "The fields of a DepsTracker, and its link (the other methods are Python's)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, tracker_traverse},
    {Py_tp_clear, tracker_clear},
    {Py_tp_dealloc, tracker_dealloc},
    {Py_tp_members, tracker_members},
    {Py_tp_methods, tracker_methods},
    {0, NULL}
};

static PyType_Spec tracker_spec = {
    "streamdag.native.TrackerFields", sizeof(Tracker), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, tracker_slots
};

/* ------------------------------------------------------------------ accesses */

static PyObject *new_tuple_of(PyTypeObject *type, PyObject *a, PyObject *b, PyObject *c) {
    Py_ssize_t n = c == NULL ? 2 : 3;
    PyObject *t = type->tp_alloc(type, n);  /* a named tuple, as tuple.__new__(type, ...) makes it */
    if (t == NULL) return NULL;
    PyTuple_SET_ITEM(t, 0, Py_NewRef(a));
    PyTuple_SET_ITEM(t, 1, Py_NewRef(b));
    if (c != NULL) PyTuple_SET_ITEM(t, 2, Py_NewRef(c));
    return t;
}

static PyObject *call0(PyObject *obj, PyObject *name) {
    return PyObject_CallMethodNoArgs(obj, name);
}

/* The accesses of recently seen tensors, by (space, start, end): the Region and its two Access
 * tuples, made once and handed out again (they are immutable values). A submit that reads and writes
 * tensors seen before then makes no tuple and no int for them. Direct-mapped: a slot holds the last
 * range that hashed to it. */
#define ACCESS_CACHE_SLOTS 1024
typedef struct { PyObject *space; long long start, end; PyObject *read, *write; } CachedAccess;
static CachedAccess access_cache[ACCESS_CACHE_SLOTS];

static CachedAccess *cache_slot(PyObject *space, long long start, long long end) {
    unsigned long long h = (unsigned long long)start * 0x9E3779B97F4A7C15ULL
                           ^ (unsigned long long)end * 0xC2B2AE3D27D4EB4FULL ^ (unsigned long long)(uintptr_t)space;
    h ^= h >> 31;
    return &access_cache[h & (ACCESS_CACHE_SLOTS - 1)];
}

/* the Access of [start, end) in ``space`` (borrowed; a str that lives as long as the module's
 * state), a read or a write: the cached one, or made and cached */
static PyObject *cached_access(PyObject *space, long long start, long long end, PyObject *start_obj,
                               PyObject *end_obj, int write) {
    CachedAccess *slot = cache_slot(space, start, end);
    if (slot->space == space && slot->start == start && slot->end == end)
        return Py_NewRef(write ? slot->write : slot->read);
    PyObject *lo = start_obj ? Py_NewRef(start_obj) : PyLong_FromLongLong(start);
    PyObject *hi = end_obj ? Py_NewRef(end_obj) : PyLong_FromLongLong(end);
    PyObject *region = lo && hi ? new_tuple_of(state.region_type, space, lo, hi) : NULL;
    Py_XDECREF(lo);
    Py_XDECREF(hi);
    if (region == NULL) return NULL;
    PyObject *read = new_tuple_of(state.access_type, region, Py_False, NULL);
    PyObject *written = read ? new_tuple_of(state.access_type, region, Py_True, NULL) : NULL;
    Py_DECREF(region);
    if (written == NULL) { Py_XDECREF(read); return NULL; }
    PyObject *old_read = slot->read, *old_write = slot->write, *old_space = slot->space;
    slot->space = Py_NewRef(space);
    slot->start = start;
    slot->end = end;
    slot->read = read;
    slot->write = written;
    Py_XDECREF(old_read);  /* after the slot is whole: a dealloc may run code */
    Py_XDECREF(old_write);
    Py_XDECREF(old_space);
    return Py_NewRef(write ? written : read);
}

/* buffers._torch_region for the common case (a contiguous strided tensor on the CPU or a known GPU),
 * as its Access (``write``): anything else goes to the Python function, which also raises the
 * errors, and returns NULL with no error set */
static PyObject *torch_access(PyObject *t, int write) {
    PyObject *space = NULL, *access = NULL, *start = NULL, *nbytes = NULL, *end = NULL;
    if (state.torch != NULL) {  /* read in C++ */
        long long device, lo, hi;
        int read = state.torch->region(t, &device, &lo, &hi);
        if (read < 0) return NULL;
        if (read) {
            if (device < 0) {
                space = Py_NewRef(state.cpu);
            } else {
                PyObject *index = PyLong_FromLongLong(device);
                if (index == NULL) return NULL;
                space = Py_XNewRef(PyDict_GetItemWithError(state.cuda_spaces, index));
                Py_DECREF(index);
                if (space == NULL && PyErr_Occurred()) return NULL;
            }
            if (space != NULL) {  /* else a GPU not seen yet: the Python code names it */
                access = cached_access(space, lo, hi, NULL, NULL, write);
                Py_DECREF(space);
                return access;
            }
        }
    }
    PyObject *flag = PyObject_GetAttr(t, s_is_cuda);
    if (flag == NULL) return NULL;
    int on_cuda = flag == Py_True;
    Py_DECREF(flag);
    if (on_cuda) {
        PyObject *index = call0(t, s_get_device);
        if (index == NULL) return NULL;
        space = Py_XNewRef(PyDict_GetItemWithError(state.cuda_spaces, index));  /* NULL: not seen yet */
        Py_DECREF(index);
        if (space == NULL) return NULL;
    } else {
        PyObject *cpu = PyObject_GetAttr(t, s_is_cpu);
        if (cpu == NULL) return NULL;
        int is_cpu = cpu == Py_True;
        Py_DECREF(cpu);
        if (!is_cpu) return NULL;
        space = Py_NewRef(state.cpu);
    }
    if (state.strided == NULL) {  /* a tensor is here: torch is imported */
        PyObject *torch = PyImport_GetModule(s_torch);
        if (torch == NULL) goto done;
        state.strided = PyObject_GetAttr(torch, s_strided);
        Py_DECREF(torch);
        if (state.strided == NULL) goto done;
    }
    PyObject *layout = PyObject_GetAttr(t, s_layout);
    if (layout == NULL) goto done;
    Py_DECREF(layout);  /* compared by identity, as the Python code does (torch.strided is one object) */
    if (layout != state.strided) goto done;
    PyObject *contiguous = call0(t, s_is_contiguous);
    if (contiguous == NULL) goto done;
    Py_DECREF(contiguous);
    if (contiguous != Py_True) goto done;
    if ((start = call0(t, s_data_ptr)) == NULL || (nbytes = PyObject_GetAttr(t, s_nbytes)) == NULL
            || (end = PyNumber_Add(start, nbytes)) == NULL)
        goto done;
    long long lo = as_long_long(start), hi = as_long_long(end);
    if ((lo == -1 || hi == -1) && PyErr_Occurred()) {
        PyErr_Clear();  /* out of range for the cache: made as it is */
        PyObject *region = new_tuple_of(state.region_type, space, start, end);
        access = region ? new_tuple_of(state.access_type, region, write ? Py_True : Py_False, NULL) : NULL;
        Py_XDECREF(region);
    } else {
        access = cached_access(space, lo, hi, start, end, write);
    }
done:
    Py_XDECREF(space);
    Py_XDECREF(start);
    Py_XDECREF(nbytes);
    Py_XDECREF(end);
    return access;
}

/* buffers._numpy_like_region for a numpy array, as its Access (``write``), read through the buffer
 * protocol: the same pointer, shape and strides as its ``__array_interface__``, without the dict
 * that makes (~2 µs a buffer). NULL with no error set where the array exports no buffer (an
 * object or datetime dtype, say): the Python function reads those. */
static PyObject *ndarray_access(PyObject *a, int write) {
    Py_buffer view;
    if (PyObject_GetBuffer(a, &view, PyBUF_STRIDES) < 0) {
        PyErr_Clear();
        return NULL;
    }
    /* buffers._extent (the reference): the lowest and one-past-highest byte touched */
    long long lo = (long long)(uintptr_t)view.buf, hi = lo;
    int empty = 0;
    for (int i = 0; i < view.ndim; i++) empty |= view.shape[i] == 0;
    if (!empty) {
        for (int i = 0; i < view.ndim; i++) {
            long long span = (long long)(view.shape[i] - 1) * (long long)view.strides[i];
            if (span < 0) lo += span;
            else hi += span;
        }
        hi += view.itemsize;
    }
    PyBuffer_Release(&view);
    return cached_access(state.cpu, lo, hi, NULL, NULL, write);
}

/* Access(region_of(value), write), the way buffers._py_accesses makes it */
static PyObject *access_of(PyObject *value, int write) {
    PyObject *handler = PyDict_GetItemWithError(state.handlers, (PyObject *)Py_TYPE(value));
    if (handler == NULL && PyErr_Occurred()) return NULL;
    if (handler == state.torch_region) {
        PyObject *access = torch_access(value, write);
        if (access != NULL || PyErr_Occurred()) return access;
    } else if (handler != NULL && handler == state.numpy_region && state.ndarray != NULL
               && PyObject_TypeCheck(value, state.ndarray)) {
        PyObject *access = ndarray_access(value, write);
        if (access != NULL || PyErr_Occurred()) return access;
    }
    PyObject *region = PyObject_CallOneArg(handler == state.torch_region ? state.torch_region : state.region_of,
                                           value);
    if (region == NULL) return NULL;
    PyObject *access = new_tuple_of(state.access_type, region, write ? Py_True : Py_False, NULL);
    Py_DECREF(region);
    return access;
}

static int add_accesses(PyObject *out, PyObject *values, int write) {
    PyObject *seq = PySequence_Fast(values, "reads= and writes= take lists of buffers");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *access = access_of(PySequence_Fast_GET_ITEM(seq, i), write);
        if (access == NULL || PyList_Append(out, access) < 0) {
            Py_XDECREF(access);
            Py_DECREF(seq);
            return -1;
        }
        Py_DECREF(access);
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *accesses_of(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "accesses(reads, writes)");
        return NULL;
    }
    if (state.handlers == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "streamdag.native: setup() was not called");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    if (add_accesses(out, args[0], 0) < 0 || add_accesses(out, args[1], 1) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    return out;
}

static PyObject *use_torch(PyObject *module, PyObject *torch_module) {
    if (torch_module == Py_None) {  /* back to PyTorch's bindings (runtimes made from now on) */
        state.torch = NULL;
        Py_CLEAR(state.torch_module);
        Py_RETURN_NONE;
    }
    PyObject *capsule = PyObject_GetAttrString(torch_module, "hooks");
    if (capsule == NULL) return NULL;
    const StreamdagTorchHooks *hooks = PyCapsule_GetPointer(capsule, STREAMDAG_TORCH_HOOKS_CAPSULE);
    Py_DECREF(capsule);
    if (hooks == NULL) return NULL;
    if (hooks->version != STREAMDAG_TORCH_HOOKS_VERSION) {
        PyErr_Format(PyExc_RuntimeError, "the torch extension has hooks version %d, this module %d",
                     hooks->version, STREAMDAG_TORCH_HOOKS_VERSION);
        return NULL;
    }
    Py_XSETREF(state.torch_module, Py_NewRef(torch_module));
    state.torch = hooks;
    Py_RETURN_NONE;
}

/* whether the torch extension's hooks are in use (its event queries are made in relaxed capture mode) */
static PyObject *uses_torch(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(state.torch != NULL);
}

static PyObject *setup(PyObject *module, PyObject *args) {
    PyObject *handlers, *torch_region_fn, *region_of_fn, *cuda_spaces, *region_type, *access_type, *resizing;
    PyObject *numpy_region;
    if (!PyArg_ParseTuple(args, "O!OOO!O!O!O!O", &PyDict_Type, &handlers, &torch_region_fn, &region_of_fn,
                          &PyDict_Type, &cuda_spaces, &PyType_Type, &region_type, &PyType_Type, &access_type,
                          &PyDict_Type, &resizing, &numpy_region))
        return NULL;
    Py_XSETREF(state.handlers, Py_NewRef(handlers));
    Py_XSETREF(state.torch_region, Py_NewRef(torch_region_fn));
    Py_XSETREF(state.region_of, Py_NewRef(region_of_fn));
    Py_XSETREF(state.cuda_spaces, Py_NewRef(cuda_spaces));
    Py_XSETREF(state.region_type, (PyTypeObject *)Py_NewRef(region_type));
    Py_XSETREF(state.access_type, (PyTypeObject *)Py_NewRef(access_type));
    Py_XSETREF(state.resizing, Py_NewRef(resizing));
    /* numpy arrays read through the buffer protocol, where numpy is there (buffers.py imports it) */
    Py_XSETREF(state.numpy_region, Py_NewRef(numpy_region));
    Py_CLEAR(state.ndarray);
    PyObject *numpy = PyImport_ImportModule("numpy");
    PyObject *ndarray = numpy != NULL ? PyObject_GetAttrString(numpy, "ndarray") : NULL;
    Py_XDECREF(numpy);
    if (ndarray != NULL && PyType_Check(ndarray)) state.ndarray = (PyTypeObject *)ndarray;
    else Py_XDECREF(ndarray);
    PyErr_Clear();  /* no numpy: its arrays (none then) would go through the Python function */
    Py_RETURN_NONE;
}


/* ------------------------------------------------------------------ Clocks */

/* schedule/waits.py's StreamClocks (the reference): a vector clock per stream */
typedef struct {
    PyObject_HEAD
    Py_ssize_t n;
    long long *known;  /* n rows of n: row s is what stream s has waited for */
    /* the clock tuple of the last stamp placed on each stream, and its values: the next stamp on
     * that stream reuses the int objects of the entries that did not change (most of them) */
    PyObject **last;
    long long *last_values;
} Clocks;

static PyTypeObject *stamp_type;  /* schedule.waits.Stamp, from setup_clocks() */

/* free the rows and the last clocks (init again, or dealloc) */
static void clocks_forget(Clocks *self) {
    if (self->last != NULL)
        for (Py_ssize_t s = 0; s < self->n; s++) Py_CLEAR(self->last[s]);
    PyMem_Free(self->last);
    PyMem_Free(self->last_values);
    PyMem_Free(self->known);
    self->last = NULL;
    self->last_values = NULL;
    self->known = NULL;
}

static int clocks_init(Clocks *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"num_streams", NULL};
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "n", kwlist, &n)) return -1;
    if (n < 1 || n > 1 << 15) {
        PyErr_SetString(PyExc_ValueError, "num_streams must be between 1 and 32768");
        return -1;
    }
    long long *known = PyMem_Calloc((size_t)(n * n), sizeof(long long));
    long long *last_values = PyMem_Calloc((size_t)(n * n), sizeof(long long));
    PyObject **last = PyMem_Calloc((size_t)n, sizeof(PyObject *));
    if (known == NULL || last_values == NULL || last == NULL) {
        PyMem_Free(known);
        PyMem_Free(last_values);
        PyMem_Free(last);
        PyErr_NoMemory();
        return -1;
    }
    clocks_forget(self);
    self->known = known;
    self->last = last;
    self->last_values = last_values;
    self->n = n;
    return 0;
}

static void clocks_dealloc(Clocks *self) {
    PyTypeObject *tp = Py_TYPE(self);
    clocks_forget(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int stream_arg(Clocks *self, PyObject *obj, Py_ssize_t *out) {
    Py_ssize_t s = PyLong_AsSsize_t(obj);
    if (s == -1 && PyErr_Occurred()) return -1;
    if (self->known == NULL || s < 0 || s >= self->n) {
        PyErr_Format(PyExc_IndexError, "stream %zd out of range (0..%zd)", s, self->n - 1);
        return -1;
    }
    *out = s;
    return 0;
}

typedef struct { Py_ssize_t stream; long long pos; long long sum; PyObject *clock; } Dep;

/* ``d`` from ``stamp``; ``with_sum``: also the sum of its clock (only a sort of several deps needs it:
 * an op that follows one producer, as in a chain, reads one int of its stamp, not every stream's) */
static int read_stamp(Clocks *self, PyObject *stamp, Dep *d, int with_sum) {
    if (!PyTuple_Check(stamp) || PyTuple_GET_SIZE(stamp) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(stamp, 2))
            || PyTuple_GET_SIZE(PyTuple_GET_ITEM(stamp, 2)) != self->n) {
        PyErr_SetString(PyExc_TypeError, "a stamp is (stream, pos, clock) with one entry per stream");
        return -1;
    }
    if (stream_arg(self, PyTuple_GET_ITEM(stamp, 0), &d->stream) < 0) return -1;
    d->pos = as_long_long(PyTuple_GET_ITEM(stamp, 1));
    d->clock = PyTuple_GET_ITEM(stamp, 2);
    d->sum = 0;
    for (Py_ssize_t k = 0; with_sum && k < self->n; k++) d->sum += as_long_long(PyTuple_GET_ITEM(d->clock, k));
    return PyErr_Occurred() ? -1 : 0;
}

static void max_into(long long *into, PyObject *clock, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        long long v = as_long_long(PyTuple_GET_ITEM(clock, k));  /* an error: the caller checks */
        if (v > into[k]) into[k] = v;
    }
}

/* the position of the last op placed on stream ``s`` (in range) */
static long long clock_tail(const Clocks *self, Py_ssize_t s) {
    return self->known[s * self->n + s];
}

static PyObject *clocks_tail(Clocks *self, PyObject *arg) {
    Py_ssize_t s;
    if (stream_arg(self, arg, &s) < 0) return NULL;
    return PyLong_FromLongLong(clock_tail(self, s));
}

static PyObject *clocks_implied(Clocks *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t s;
    Dep d;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "implied(stream, dep)"); return NULL; }
    if (stream_arg(self, args[0], &s) < 0 || read_stamp(self, args[1], &d, 1) < 0) return NULL;
    return PyBool_FromLong(self->known[s * self->n + d.stream] >= d.pos);
}

/* order of visit: dependencies that know most first, ties in their given order */
static int by_sum(const void *a, const void *b) {
    const Dep *x = *(Dep *const *)a, *y = *(Dep *const *)b;
    if (x->sum != y->sum) return x->sum > y->sum ? -1 : 1;
    return (x > y) - (x < y);
}

/* place() on stream ``s`` (in range): the op's stamp and the indices of the deps to wait on, new
 * references in ``*stamp_out`` and ``*waits_out``; 0, or -1 with an exception. ``no_waits``: a list
 * to hand out (shared, never added to) where there is no wait, instead of a new one. */
static int clocks_place_into(Clocks *self, Py_ssize_t s, PyObject *const *stamps, Py_ssize_t m,
                             PyObject *no_waits, PyObject **stamp_out, PyObject **waits_out) {
    Py_ssize_t n = self->n;
    *stamp_out = *waits_out = NULL;
    if (stamp_type == NULL) { PyErr_SetString(PyExc_RuntimeError, "setup_clocks() was not called"); return -1; }
    int rc = -1;
    PyObject *waits = NULL, *clock = NULL;
    /* on the stack for the usual few deps and streams */
    Dep local_deps[8], *local_order[8];
    Py_ssize_t local_chosen[8];
    long long local_known[64];
    int small = m <= 8, few = n <= 32;
    Dep *deps = small ? local_deps : PyMem_Malloc((m ? m : 1) * sizeof(Dep));
    Dep **order = small ? local_order : PyMem_Malloc((m ? m : 1) * sizeof(Dep *));
    Py_ssize_t *chosen = small ? local_chosen : PyMem_Malloc((m ? m : 1) * sizeof(Py_ssize_t));
    long long *known = few ? local_known : PyMem_Malloc(2 * n * sizeof(long long));
    long long *others = known == NULL ? NULL : known + n;
    long long *base = self->known + s * n;
    Py_ssize_t nw = 0;
    if (deps == NULL || order == NULL || chosen == NULL || known == NULL) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (read_stamp(self, stamps[i], &deps[i], m > 1) < 0) goto done;
        order[i] = &deps[i];
    }
    memcpy(known, base, n * sizeof(long long));
    if (m > 1) qsort(order, m, sizeof(Dep *), by_sum);
    for (Py_ssize_t k = 0; k < m; k++) {
        Dep *d = order[k];
        if (known[d->stream] < d->pos) {
            chosen[nw++] = d - deps;
            max_into(known, d->clock, n);
        }
    }
    if (nw > 1) {  /* a later wait may imply an earlier one: drop those (in the order chosen) */
        Py_ssize_t total = nw;
        Py_ssize_t *snapshot = PyMem_Malloc(total * sizeof(Py_ssize_t));
        if (snapshot == NULL) { PyErr_NoMemory(); goto done; }
        memcpy(snapshot, chosen, total * sizeof(Py_ssize_t));
        for (Py_ssize_t a = 0; a < total; a++) {
            Py_ssize_t i = snapshot[a];
            memcpy(others, base, n * sizeof(long long));
            for (Py_ssize_t b = 0; b < nw; b++)
                if (chosen[b] != i) max_into(others, deps[chosen[b]].clock, n);
            if (others[deps[i].stream] >= deps[i].pos) {  /* remove i from chosen */
                Py_ssize_t w = 0;
                for (Py_ssize_t b = 0; b < nw; b++)
                    if (chosen[b] != i) chosen[w++] = chosen[b];
                nw = w;
            }
        }
        PyMem_Free(snapshot);
    }
    if (PyErr_Occurred()) goto done;  /* a clock entry that is no int (max_into) */
    if ((waits = nw == 0 && no_waits != NULL ? Py_NewRef(no_waits) : PyList_New(nw)) == NULL) goto done;
    for (Py_ssize_t k = 0; k < nw; k++) {
        PyObject *index = PyLong_FromSsize_t(chosen[k]);
        if (index == NULL) goto done;
        PyList_SET_ITEM(waits, k, index);
    }
    known[s] += 1;
    memcpy(base, known, n * sizeof(long long));
    clock = PyTuple_New(n);
    if (clock == NULL) goto done;
    PyObject *prev = self->last[s];
    long long *prev_values = self->last_values + s * n;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = prev != NULL && prev_values[k] == known[k] ? Py_NewRef(PyTuple_GET_ITEM(prev, k))
                                                                 : PyLong_FromLongLong(known[k]);
        if (v == NULL) goto done;
        PyTuple_SET_ITEM(clock, k, v);
    }
    Py_XSETREF(self->last[s], Py_NewRef(clock));
    memcpy(prev_values, known, n * sizeof(long long));
    PyObject *stream_obj = PyLong_FromSsize_t(s), *pos = Py_NewRef(PyTuple_GET_ITEM(clock, s));
    PyObject *stamp = stream_obj ? new_tuple_of(stamp_type, stream_obj, pos, clock) : NULL;
    Py_XDECREF(stream_obj);
    Py_DECREF(pos);
    if (stamp != NULL) {
        *stamp_out = stamp;
        *waits_out = Py_NewRef(waits);
        rc = 0;
    }
done:
    Py_XDECREF(clock);
    Py_XDECREF(waits);
    if (!small) {
        PyMem_Free(deps);
        PyMem_Free(order);
        PyMem_Free(chosen);
    }
    if (!few) PyMem_Free(known);
    return rc;
}

static PyObject *clocks_place(Clocks *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t s;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "place(stream, deps)"); return NULL; }
    if (stream_arg(self, args[0], &s) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[1], "place() needs a list of stamps"), *stamp, *waits;
    if (seq == NULL) return NULL;
    int rc = clocks_place_into(self, s, PySequence_Fast_ITEMS(seq), PySequence_Fast_GET_SIZE(seq), NULL,
                               &stamp, &waits);
    Py_DECREF(seq);
    if (rc < 0) return NULL;
    PyObject *result = PyTuple_Pack(2, stamp, waits);
    Py_DECREF(stamp);
    Py_DECREF(waits);
    return result;
}

static PyObject *clocks_num_streams(Clocks *self, void *closure) {
    return PyLong_FromSsize_t(self->n);
}

static PyGetSetDef clocks_getset[] = {
    {"num_streams", (getter)clocks_num_streams, NULL, NULL, NULL},
    {NULL}
};

static PyMethodDef clocks_methods[] = {
    {"tail", (PyCFunction)clocks_tail, METH_O, "Position of the last op placed on the stream (0 when none)."},
    {"implied", (PyCFunction)(void (*)(void))clocks_implied, METH_FASTCALL, NULL},
    {"place", (PyCFunction)(void (*)(void))clocks_place, METH_FASTCALL,
     "place(stream, deps) -> (stamp, indices of deps to wait on)"},
    {NULL}
};

static PyType_Slot clocks_slots[] = {
    {Py_tp_doc, "Vector clocks for num_streams streams (compiled StreamClocks)."},
    {Py_tp_init, clocks_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_dealloc, clocks_dealloc},
    {Py_tp_methods, clocks_methods},
    {Py_tp_getset, clocks_getset},
    {0, NULL}
};

static PyType_Spec clocks_spec = {
    "streamdag.native.Clocks", sizeof(Clocks), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, clocks_slots
};

static PyObject *setup_clocks(PyObject *module, PyObject *arg) {
    if (!PyType_Check(arg) || !PyType_IsSubtype((PyTypeObject *)arg, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "setup_clocks(Stamp) takes the Stamp named tuple");
        return NULL;
    }
    Py_XSETREF(stamp_type, (PyTypeObject *)Py_NewRef(arg));
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ dict version tags */
/* What the whole-call graph of streamdag.compile checks on every call (frontend/whole_call.py):
 * whether any of the dicts that hold a model's state (each submodule's __dict__, _parameters,
 * _buffers, _modules, ...) changed since a snapshot. CPython gives a dict a new version tag
 * whenever a value in it is set to another object, added or removed (PEP 509), so one loop of
 * loads and compares covers a few hundred submodules in a few microseconds; comparing their
 * values (module_state.ModuleState.holds, the Python code) costs a hundred. CPython 3.14 drops
 * the tag; CPython 3.13 keeps a new object's attributes in an inline array whose stores skip the
 * tag, until the object's dict is made its own (state_watch's probe finds which is needed). */
static int check_dicts(PyObject *list) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "takes a list of dicts");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        if (!PyDict_Check(PyList_GET_ITEM(list, i))) {
            PyErr_SetString(PyExc_TypeError, "takes a list of dicts");
            return -1;
        }
    }
    return 0;
}

#if PY_VERSION_HEX < 0x030E0000
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
static inline uint64_t dict_tag(PyObject *d) { return ((PyDictObject *)d)->ma_version_tag; }
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

/* dict_versions(dicts: list[dict]) -> bytes: their version tags, for same_dict_versions() */
static PyObject *dict_versions(PyObject *module, PyObject *list) {
    if (check_dicts(list) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(uint64_t));
    if (out == NULL) return NULL;
    uint64_t *tags = (uint64_t *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) tags[i] = dict_tag(PyList_GET_ITEM(list, i));
    return out;
}

/* same_dict_versions(dicts: list[dict], snapshot: bytes) -> bool: whether no dict changed since
 * dict_versions() took the snapshot. The list is checked when the snapshot is taken: only its
 * length is checked here, on the hot path. */
static PyObject *same_dict_versions(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "same_dict_versions(dicts: list, snapshot: bytes)");
        return NULL;
    }
    PyObject *list = args[0];
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (PyBytes_GET_SIZE(args[1]) != n * (Py_ssize_t)sizeof(uint64_t)) Py_RETURN_FALSE;
    const uint64_t *tags = (const uint64_t *)PyBytes_AS_STRING(args[1]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *d = PyList_GET_ITEM(list, i);
        if (!PyDict_Check(d) || dict_tag(d) != tags[i]) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}
#define DICT_TAG_METHODS \
    {"dict_versions", dict_versions, METH_O, "dict_versions(dicts): the dicts' version tags, as bytes."}, \
    {"same_dict_versions", (PyCFunction)(void (*)(void))same_dict_versions, METH_FASTCALL, \
     "same_dict_versions(dicts, snapshot): whether no dict changed since dict_versions() saw them."},
#else
#define DICT_TAG_METHODS
#endif

/* ------------------------------------------------------------------ dict watcher */
/* The same question answered without a loop: CPython 3.12 calls a dict watcher before any change
 * to a dict it watches, and the watcher here only counts. While the count is what a check saw
 * last, no watched dict changed: a model of 700 submodules (4,284 dicts) skips a loop of about
 * 10 µs per call. The count is shared by every watched dict, so a change to any of them sends each
 * watch back to its tags (or values) once. Dicts stay watched while they live; CPython allows a
 * process eight watchers, of which this takes one. Attribute stores into CPython 3.13's inline
 * values bypass the dict, as for the tags above. */
#if PY_VERSION_HEX >= 0x030C0000
static int dict_watcher = -1;
static uint64_t dict_changes = 0;  /* under the GIL; a lost increment in a free-threaded build
                                    * still leaves the count moved */

static int count_dict_change(PyDict_WatchEvent event, PyObject *d, PyObject *key, PyObject *value) {
    dict_changes++;
    return 0;
}

/* watch_dicts(dicts: list[dict]) -> int: watch them; the change count now */
static PyObject *watch_dicts(PyObject *module, PyObject *list) {
    if (check_dicts(list) < 0) return NULL;
    if (dict_watcher < 0 && (dict_watcher = PyDict_AddWatcher(count_dict_change)) < 0) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (PyDict_Watch(dict_watcher, PyList_GET_ITEM(list, i)) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(dict_changes);
}

/* dict_changes() -> int: how many changes the watched dicts have had */
static PyObject *dict_change_count(PyObject *module, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(dict_changes);
}

/* no_dict_change_since(count: int) -> bool: whether the count is still ``count`` */
static PyObject *no_dict_change_since(PyObject *module, PyObject *count) {
    unsigned long long seen = PyLong_AsUnsignedLongLong(count);
    if (seen == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(seen == dict_changes);
}
#define DICT_WATCH_METHODS \
    {"watch_dicts", watch_dicts, METH_O, "watch_dicts(dicts): watch them for changes; the change count"}, \
    {"dict_changes", dict_change_count, METH_NOARGS, "dict_changes(): the watched dicts' change count"}, \
    {"no_dict_change_since", no_dict_change_since, METH_O, \
     "no_dict_change_since(count): whether no watched dict changed since the count was read"},
#else
#define DICT_WATCH_METHODS
#endif

/* ------------------------------------------------------------------ container contents */
/* The lists and sets a model's modules hold as attributes (a window size, a list of layer
 * indices): a change inside one sets no dict's version tag, so the state check of
 * streamdag.compile compares their items on every call. In Python (state_watch.StateWatch,
 * a chain over them and a map of operator.is_) 96 two-item lists took 7.5 µs, here 0.4 µs (24
 * lists: 1.95 against 0.17); a Swin-T's state check on an H200's host took 10.3 µs, about half
 * of it in its lists. */

/* same_items(containers: list[list | set], lengths: tuple[int], items: tuple) -> bool: whether each
 * container still has its length and, in order, the very objects of ``items`` (all the
 * containers' items in a row, as a chain over them gave them) */
static PyObject *same_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_Check(args[0]) || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "same_items(containers: list, lengths: tuple, items: tuple)");
        return NULL;
    }
    PyObject *containers = args[0], *lengths = args[1], *items = args[2];
    Py_ssize_t n = PyList_GET_SIZE(containers), at = 0, total = PyTuple_GET_SIZE(items);
    if (PyTuple_GET_SIZE(lengths) != n) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyList_GET_ITEM(containers, i);
        Py_ssize_t size = PyObject_Length(c);
        if (size < 0) return NULL;
        Py_ssize_t was = PyLong_AsSsize_t(PyTuple_GET_ITEM(lengths, i));
        if (was == -1 && PyErr_Occurred()) return NULL;
        if (size != was || at + size > total) Py_RETURN_FALSE;
        if (PyList_Check(c)) {
            for (Py_ssize_t k = 0; k < size; k++)
                if (PyList_GET_ITEM(c, k) != PyTuple_GET_ITEM(items, at + k)) Py_RETURN_FALSE;
            at += size;
            continue;
        }
        PyObject *it = PyObject_GetIter(c);  /* a set: in its iteration order, as the chain took it */
        if (it == NULL) return NULL;
        PyObject *item;
        int same = 1;
        while (same && (item = PyIter_Next(it)) != NULL) {
            same = at < total && item == PyTuple_GET_ITEM(items, at);
            at++;
            Py_DECREF(item);
        }
        Py_DECREF(it);
        if (PyErr_Occurred()) return NULL;
        if (!same) Py_RETURN_FALSE;
    }
    return PyBool_FromLong(at == total);
}

#include "_lock.c"
#include "_submit.c"

static PyMethodDef module_methods[] = {
    {"accesses", (PyCFunction)(void (*)(void))accesses_of, METH_FASTCALL,
     "accesses(reads, writes): the Access of every buffer, reads first (buffers.region_of each)."},
    {"setup", setup, METH_VARARGS, "Hand over what the Python side of buffers owns."},
    {"setup_clocks", setup_clocks, METH_O, "Hand over schedule.waits.Stamp."},
    {"setup_compaction", setup_compaction, METH_VARARGS,
     "Name the tracker and space classes whose compaction is hazards.py's own (done in C for them), and "
     "the function that makes or compacts a tracker's space otherwise (_TrackerMethods._space)."},
    SUBMIT_METHODS
    DICT_TAG_METHODS
    DICT_WATCH_METHODS
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(containers, lengths, items): whether each list or set holds the very items it held."},
    {"use_torch", use_torch, METH_O, "Take the torch extension's hooks (native/_torch.cpp); None drops them."},
    {"uses_torch", uses_torch, METH_NOARGS, "Whether the torch extension's hooks are in use."},
    {NULL}
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "streamdag.native._speedups", "streamdag's compiled hot path.", -1, module_methods
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__speedups(void) {
    INTERN(s_record, "record");
    INTERN(s_is_cuda, "is_cuda");
    INTERN(s_is_cpu, "is_cpu");
    INTERN(s_get_device, "get_device");
    INTERN(s_layout, "layout");
    INTERN(s_data_ptr, "data_ptr");
    INTERN(s_is_contiguous, "is_contiguous");
    INTERN(s_nbytes, "nbytes");
    INTERN(s_torch, "torch");
    INTERN(s_strided, "strided");
    if ((state.cpu = PyUnicode_InternFromString("cpu")) == NULL) return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    state.record_type = (PyTypeObject *)PyType_FromSpec(&record_spec);
    state.space_type = (PyTypeObject *)PyType_FromSpec(&space_spec);
    state.tracker_type = (PyTypeObject *)PyType_FromSpec(&tracker_spec);
    PyObject *clocks_type = PyType_FromSpec(&clocks_spec);
    state.clocks_type = (PyTypeObject *)clocks_type;  /* the module holds the reference */
    if (clocks_type == NULL || PyModule_AddObject(m, "Clocks", clocks_type) < 0) {
        Py_XDECREF(clocks_type);
        Py_DECREF(m);
        return NULL;
    }
    if (state.record_type == NULL || state.space_type == NULL || state.tracker_type == NULL
            || PyModule_AddObjectRef(m, "Record", (PyObject *)state.record_type) < 0
            || PyModule_AddObjectRef(m, "SpaceFields", (PyObject *)state.space_type) < 0
            || PyModule_AddObjectRef(m, "TrackerFields", (PyObject *)state.tracker_type) < 0
            || fast_lock_init_type(m) < 0 || submit_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
