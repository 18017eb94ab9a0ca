/* The runtime's submit and finish, compiled: what runs for every op between the user's call and
 * the backend's launch, and again when the op's completion is observed.
 *
 * Mirrors ``Runtime.submit`` -> ``_submit`` -> ``_enqueue`` -> ``_admit`` -> ``_launch`` ->
 * ``_finish_launch`` -> ``_watch``, and ``Runtime._finish``, in ``runtime/core.py`` (the reference,
 * which runs where no compiler is). Only the common case is here: one device, no recording, no
 * profiler, no inline markers, no failure. Anything else calls the Python methods, at the point
 * where the paths part, so each rare case has one implementation. On CUDA the backend's launch
 * (order after the caller's stream, switch streams, run, switch back), its event pool and its
 * completion queue are done here too: in C++ through the torch extension's hooks where it built
 * (_torch.cpp), else through PyTorch's own C entry points (``torch._C``), as ``backends/cuda.py``
 * does. ``completions_pass`` at the end is the CUDA completion pass.
 *
 * Included by _speedups.c (one module). Plain CPython API.
 */

/* The future record: the fields of a Future that the compiled code sets and reads (``ops.Future``
 * subclasses its type, ``FutureFields``, adding only the fields made lazily, and its methods). */
enum { F_STATE, F_RESULT, F_EXCEPTION, F_WATCHED, F_HURRY, F_DONE_TOKEN, F_FENCE, F_OP_NAME, F_OP_NUMBER,
       F_FIELDS };

typedef struct {
    PyObject_HEAD
    PyObject *fields[F_FIELDS];
} FutureRecord;

#define FUTF(future, f) (((FutureRecord *)(future))->fields[f])

static const char *future_field_names[F_FIELDS] = {
    "_state", "_result", "_exception", "_watched", "_hurry", "_done_token", "_fence", "_op_name", "_op_number"
};
/* the op record's fields by name, in the order of the OP_ enum (_speedups.c) */
static const char *op_field_names[OP_FIELDS] = {
    "seq", "_name", "fn", "args", "kwargs", "accesses", "deps", "stamp", "event", "future",
    "done", "error", "root_name", "root_error", "value", "keep", "run_id", "finish", "_numbered"
};

static PyTypeObject *op_fields_type, *future_fields_type;  /* the records' types: OpFields, FutureFields */

static struct {
    PyTypeObject *op_type;  /* ops.Op: a subclass of OpFields that adds no fields */
    PyObject *op_names[OP_FIELDS];  /* interned */
    PyTypeObject *future_type;  /* ops.Future: a subclass of FutureFields */
    PyTypeObject *marker_type;
    PyObject *lazy;      /* ops._LAZY: orders a future's condition against setting its outcome */
    PyObject *pending;   /* concurrent.futures' PENDING and FINISHED */
    PyObject *finished;
    PyObject *empty_tuple;
    PyObject *empty_str;
    PyObject *empty_list;  /* never added to */
    /* devices lost so far (note_loss), and the backend type whose ``lost`` notes each (note_losses_of):
     * until one is lost, ``lost`` of a backend of that type is None without a look-up */
    Py_ssize_t losses;
    PyTypeObject *loss_noting_type;
    PyObject *empty_dict;  /* never added to */
    PyTypeObject *deque_type;  /* collections.deque, and its methods' descriptors (no look-up per call) */
    PyObject *deque_append, *deque_popleft;
    PyObject *release_frames;  /* frames.release_frames */
} sub;

static PyObject *s_acquire, *s_release, *s_link, *s_tail, *s_place, *s_execute, *s_launch, *s_event,
                *s_wait, *s_when_done, *s_name_attr, *s_reads, *s_writes,
                *s_name, *s_run_on, *s_lost, *s_index, *s_append, *s_set, *s_popleft,
                *s_timing, *s_query, *s_mark_lost, *s_marker_value, *s_marker_write,
                *s_recycle, *s_is_pinned, *s_dtype, *s_shape, *s_hold_bytes, *s_copy_h2d, *s_copy_d2h, *s_copy_kwnames;


/* ``q.append(item)`` / ``q.popleft()``: through the method's descriptor for a collections.deque */
static PyObject *queue_append(PyObject *q, PyObject *item) {
    if (Py_TYPE(q) == sub.deque_type) return PyObject_Vectorcall(sub.deque_append, (PyObject *[]){q, item}, 2, NULL);
    return PyObject_CallMethodOneArg(q, s_append, item);
}

static PyObject *queue_popleft(PyObject *q) {
    if (Py_TYPE(q) == sub.deque_type) return PyObject_Vectorcall(sub.deque_popleft, &q, 1, NULL);
    return PyObject_CallMethodNoArgs(q, s_popleft);
}

/* set a Future's field (its type checked by the caller: sub.future_type exactly) */
static void future_set(PyObject *future, int f, PyObject *value) {
    PyObject *old = FUTF(future, f);
    FUTF(future, f) = Py_NewRef(value);
    Py_XDECREF(old);
}

/* a field of a tracker node: an Op's directly, anything else by name */
static PyObject *field(PyObject *node, int f) {
    if (Py_TYPE(node) == sub.op_type) {
        PyObject *v = OPF(node, f);
        if (v != NULL) return Py_NewRef(v);
    }
    return PyObject_GetAttr(node, sub.op_names[f]);
}

static void op_set(PyObject *op, int f, PyObject *value) {
    PyObject *old = OPF(op, f);
    OPF(op, f) = Py_NewRef(value);
    Py_XDECREF(old);
}

static int call_method0(PyObject *obj, PyObject *name) {
    PyObject *r = PyObject_CallMethodNoArgs(obj, name);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* an int attribute of ``obj`` */
static int get_int(PyObject *obj, PyObject *name, Py_ssize_t *out) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL) return -1;
    *out = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* whether two str are equal: by identity where both are interned (keywords and names are) */
static int same_str(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    if (PyUnicode_CheckExact(a) && PyUnicode_CHECK_INTERNED(a) && PyUnicode_CHECK_INTERNED(b)) return 0;
    return PyUnicode_Compare(a, b) == 0;
}

/* the raised exception, taken (normalized, with its traceback); NULL if none */
static PyObject *take_exception(void) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (type == NULL) return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* raise ``exc`` again (a reference taken by take_exception, consumed) */
static void restore_exception(PyObject *exc) {
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc, PyException_GetTraceback(exc));
}

static PyObject *setup_submit(PyObject *module, PyObject *args) {
    PyObject *op_type, *future_type, *marker_type, *lazy, *pending, *finished, *finished_ok_fn, *release_frames;
    if (!PyArg_ParseTuple(args, "O!O!O!OOOOO", &PyType_Type, &op_type, &PyType_Type, &future_type,
                          &PyType_Type, &marker_type, &lazy, &pending, &finished, &finished_ok_fn,
                          &release_frames))
        return NULL;
    /* an Op made in C has the record's fields and no others: a field added in Python alone would be
     * missing from every op (an AttributeError far from its cause) */
    if (!PyType_IsSubtype((PyTypeObject *)op_type, op_fields_type)
            || ((PyTypeObject *)op_type)->tp_basicsize != op_fields_type->tp_basicsize) {
        PyErr_SetString(PyExc_TypeError,
                        "setup_submit: Op must subclass native OpFields and add no fields (__slots__ = ()): "
                        "declare a new field in the op record in native/_submit.c (op_field_names, new_op)");
        return NULL;
    }
    /* (the Future's own slots, which stay unset until made, are checked by runtime/seam.py) */
    if (!PyType_IsSubtype((PyTypeObject *)future_type, future_fields_type)) {
        PyErr_SetString(PyExc_TypeError, "setup_submit: Future must subclass native FutureFields");
        return NULL;
    }
    Py_XSETREF(sub.op_type, (PyTypeObject *)Py_NewRef(op_type));
    Py_XSETREF(finished_ok.fn, Py_NewRef(finished_ok_fn));
    Py_XSETREF(finished_ok.op_type, (PyTypeObject *)Py_NewRef(op_type));
    Py_XSETREF(sub.future_type, (PyTypeObject *)Py_NewRef(future_type));
    Py_XSETREF(sub.marker_type, (PyTypeObject *)Py_NewRef(marker_type));
    Py_XSETREF(sub.lazy, Py_NewRef(lazy));
    Py_XSETREF(sub.pending, Py_NewRef(pending));
    Py_XSETREF(sub.finished, Py_NewRef(finished));
    Py_XSETREF(sub.release_frames, Py_NewRef(release_frames));
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ the records */

/* a record type's traverse, clear and dealloc: ``n`` object fields, each NULL until set */
#define RECORD_FUNCTIONS(prefix, Record, n) \
    static int prefix##_traverse(Record *self, visitproc visit, void *arg) { \
        Py_VISIT(Py_TYPE(self)); \
        for (int f = 0; f < (n); f++) Py_VISIT(self->fields[f]); \
        return 0; \
    } \
    static int prefix##_clear(Record *self) { \
        for (int f = 0; f < (n); f++) Py_CLEAR(self->fields[f]); \
        return 0; \
    } \
    static void prefix##_dealloc(Record *self) { \
        PyTypeObject *tp = Py_TYPE(self); \
        PyObject_GC_UnTrack(self); \
        prefix##_clear(self); \
        tp->tp_free((PyObject *)self); \
        Py_DECREF(tp); \
    }

RECORD_FUNCTIONS(op_fields, OpRecord, OP_FIELDS)
RECORD_FUNCTIONS(future_fields, FutureRecord, F_FIELDS)

/* their members, from op_field_names and future_field_names (submit_init) */
static PyMemberDef op_fields_members[OP_FIELDS + 1], future_fields_members[F_FIELDS + 1];

static PyType_Slot op_fields_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_members, op_fields_members},
    {Py_tp_traverse, op_fields_traverse},
    {Py_tp_clear, op_fields_clear},
    {Py_tp_dealloc, op_fields_dealloc},
    {Py_tp_doc, "The fields of a submitted op (ops.Op adds its methods), read and written by the "
                "compiled submit in C."},
    {0, NULL}
};

static PyType_Spec op_fields_spec = {
    "streamdag.native.OpFields", sizeof(OpRecord), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, op_fields_slots
};

static PyType_Slot future_fields_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_members, future_fields_members},
    {Py_tp_traverse, future_fields_traverse},
    {Py_tp_clear, future_fields_clear},
    {Py_tp_dealloc, future_fields_dealloc},
    {Py_tp_doc, "The fields of an op's future that the compiled submit and finish set and read in C "
                "(ops.Future adds the lazily made ones and its methods)."},
    {0, NULL}
};

static PyType_Spec future_fields_spec = {
    "streamdag.native.FutureFields", sizeof(FutureRecord), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC, future_fields_slots
};

/* ------------------------------------------------------------------ Counters */

/* the runtime's counts (``rt._counts``): ops submitted (the last op's number), completed, and the
 * most pending at once. Python code reads and writes them as attributes; the compiled submit and
 * finish as C fields, with no dictionary and no int object per op. A CUDA backend's completion
 * queues count in one too (``_Completions._counts``: ``seq`` is their last entry's token, ``woken``
 * whether a wake-up of their thread is pending). */
typedef struct {
    PyObject_HEAD
    Py_ssize_t seq, completed, peak;
    Py_ssize_t free, waiting;  /* the in-flight bound's (``completion.Slots``): slots free, submitters waiting */
    Py_ssize_t calling;  /* finished ops whose done-callbacks still run (``completion``; under ``_done_lock``) */
    char woken;  /* completion queues: their thread's wake-up is set and not yet taken */
} Counters;

static PyTypeObject *counters_type;

static PyMemberDef counters_members[] = {
    {"seq", T_PYSSIZET, offsetof(Counters, seq), 0, "ops submitted: the last op's number"},
    {"completed", T_PYSSIZET, offsetof(Counters, completed), 0, "ops finished without an error"},
    {"peak", T_PYSSIZET, offsetof(Counters, peak), 0, "the most ops pending at once"},
    {"free", T_PYSSIZET, offsetof(Counters, free), 0, "slots free under max_inflight"},
    {"waiting", T_PYSSIZET, offsetof(Counters, waiting), 0, "submitters waiting for a slot"},
    {"calling", T_PYSSIZET, offsetof(Counters, calling), 0, "finished ops whose done-callbacks still run"},
    {"woken", T_BOOL, offsetof(Counters, woken), 0, "completion queues: a wake-up of their thread is pending"},
    {NULL}
};

static PyType_Slot counters_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_members, counters_members},
    {Py_tp_doc, "A runtime's counts (seq, completed, peak; the in-flight bound's free and waiting; the "
                "ops calling back; a completion thread's woken), read and written by the compiled submit in C."},
    {0, NULL}
};

static PyType_Spec counters_spec = {
    "streamdag.native.Counters", sizeof(Counters), 0, Py_TPFLAGS_DEFAULT, counters_slots
};

/* A byte budget's counts (``budgets.ByteBudget``): bytes in flight, the most at once, its limit,
 * acquirers asleep. The compiled copy counts a copy's bytes here under the budget's lock (a Lock of
 * this module) without a Python call: the budget's Python methods cost a 1 KiB copy ~2.6 µs. */
typedef struct {
    PyObject_HEAD
    Py_ssize_t limit, peak, used, waiting;
} BudgetCounts;

static PyTypeObject *budget_counts_type;

static PyMemberDef budget_counts_members[] = {
    {"limit", T_PYSSIZET, offsetof(BudgetCounts, limit), 0, "bytes in flight before acquire() waits"},
    {"peak", T_PYSSIZET, offsetof(BudgetCounts, peak), 0, "the most bytes in flight at once"},
    {"used", T_PYSSIZET, offsetof(BudgetCounts, used), 0, "bytes in flight"},
    {"waiting", T_PYSSIZET, offsetof(BudgetCounts, waiting), 0, "acquirers asleep on the budget"},
    {NULL}
};

static PyType_Slot budget_counts_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_members, budget_counts_members},
    {Py_tp_doc, "A byte budget's counts (limit, peak, used, waiting), read and written by the compiled "
                "copy in C."},
    {0, NULL}
};

static PyType_Spec budget_counts_spec = {
    "streamdag.native.BudgetCounts", sizeof(BudgetCounts), 0, Py_TPFLAGS_DEFAULT, budget_counts_slots
};

/* A runtime's parts that every submit reads: its dependency tracker, stream clocks, profiler, the
 * backends' finish_ready and how often to call them, whether it is closed. The runtime's attributes
 * of those names are properties over these fields (core.py), so the compiled submit reads them in C,
 * not from the runtime's __dict__ (a look-up each). */
typedef struct {
    PyObject_HEAD
    PyObject *tracker, *clocks, *profiler, *finish_ready;
    Py_ssize_t finish_every;
    char closed;
} Parts;

static PyTypeObject *parts_type;

static PyMemberDef parts_members[] = {
    {"tracker", T_OBJECT_EX, offsetof(Parts, tracker), 0, "the dependency tracker"},
    {"clocks", T_OBJECT_EX, offsetof(Parts, clocks), 0, "the stream clocks"},
    {"profiler", T_OBJECT_EX, offsetof(Parts, profiler), 0, "the profiler, or None"},
    {"finish_ready", T_OBJECT_EX, offsetof(Parts, finish_ready), 0, "the backends' finish_ready"},
    {"finish_every", T_PYSSIZET, offsetof(Parts, finish_every), 0, "call them every so many submits"},
    {"closed", T_BOOL, offsetof(Parts, closed), 0, "whether the runtime is closed"},
    {NULL}
};

static int parts_traverse(Parts *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->tracker);
    Py_VISIT(self->clocks);
    Py_VISIT(self->profiler);
    Py_VISIT(self->finish_ready);
    return 0;
}

static int parts_clear(Parts *self) {
    Py_CLEAR(self->tracker);
    Py_CLEAR(self->clocks);
    Py_CLEAR(self->profiler);
    Py_CLEAR(self->finish_ready);
    return 0;
}

static void parts_dealloc(Parts *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    parts_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyType_Slot parts_slots[] = {
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_members, parts_members},
    {Py_tp_traverse, parts_traverse},
    {Py_tp_clear, parts_clear},
    {Py_tp_dealloc, parts_dealloc},
    {Py_tp_doc, "A runtime's parts that every submit reads (tracker, clocks, profiler, finish_ready, "
                "finish_every, closed), fields the compiled submit reads in C."},
    {0, NULL}
};

static PyType_Spec parts_spec = {
    "streamdag.native.Parts", sizeof(Parts), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, parts_slots
};

/* ------------------------------------------------------------------ Submitter */

typedef struct {
    PyObject_HEAD
    PyObject *rt;
    PyObject *lock, *done_lock, *busy, *pending, *streams, *backend, *hurry_of, *spaces, *recordings,
             *host_ops, *slots, *accesses_fn, *device, *next_stream, *finish, *counts, *parts,
             *lane_threads;
    const char *builtin_c_name;  /* the last builtin op's C name, and its __name__ (see op_name_of) */
    PyObject *builtin_name;
    /* the Python methods of the rare paths (``runtime.seam.SubmitterParts``), bound */
    PyObject *submit_py, *take_slot_py, *would_block, *fail_lost, *launch_placed, *finish_launch, *finish_py,
             *settle, *hold, *host_deps, *caller_fence, *release_slot_locked;
    /* CUDA (``CudaBackend.launch_parts``): torch._C's getDevice, getCurrentStream, setStream, setDevice,
     * _CudaEventBase.record and .wait, the backend's caller event and its caller streams (dict), its
     * event pool, ..., whether a PyTorch profiler runs (``threads.torch_profiler_on``); else NULL */
    PyObject *get_device, *get_stream, *set_stream, *set_device, *record, *wait, *caller_event,
             *callers, *free_events, *device_index, *queues, *completions, *completion_counts, *wake,
             *refuse_in_capture, *profiler_on;
    /* the locks' bound acquire and release: no method look-up per call */
    PyObject *lock_acquire, *lock_release, *done_acquire, *done_release, *lazy_acquire, *lazy_release;
    /* rt.copy's compiled case (setup_copies): the copy op's function, the copy streams by device space
     * (dicts: space -> index) each way, the byte budget; NULL until set up */
    PyObject *copy_fn, *copy_h2d, *copy_d2h, *budget, *copy_py;
    /* the budget's counts, lock (and its bound acquire, release) and held copies by stream, where the
     * compiled copy counts bytes itself (see budget_take); NULL: through the budget's methods */
    PyObject *budget_counts, *budget_lock, *budget_acquire, *budget_release, *budget_held;
    const StreamdagTorchHooks *torch;  /* CUDA calls in C++ (the torch extension), or NULL */
    Py_ssize_t n_compute;
    int deferred, can_be_lost, drop_waits;
    int streams_indexed;  /* each stream's ``index`` (its completion queue) is its place in ``streams`` */
} Submitter;

static PyTypeObject *submitter_type;
static PyObject *new_finish_call(Submitter *submitter, PyObject *op);

#define SUBMITTER_OBJECTS(X) X(rt) X(lock) X(done_lock) X(busy) X(pending) X(streams) X(backend) \
    X(hurry_of) X(spaces) X(recordings) X(host_ops) X(slots) X(accesses_fn) X(device) X(next_stream) X(finish) \
    X(counts) X(builtin_name) X(parts) X(lane_threads) \
    X(submit_py) X(take_slot_py) X(would_block) X(fail_lost) X(launch_placed) X(finish_launch) X(finish_py) \
    X(settle) X(hold) X(host_deps) X(caller_fence) X(release_slot_locked) \
    X(get_device) X(get_stream) X(set_stream) X(set_device) X(record) X(wait) X(caller_event) \
    X(callers) X(free_events) X(device_index) X(queues) X(completions) X(completion_counts) X(wake) \
    X(refuse_in_capture) X(profiler_on) \
    X(lock_acquire) X(lock_release) X(done_acquire) X(done_release) X(lazy_acquire) X(lazy_release) \
    X(copy_fn) X(copy_h2d) X(copy_d2h) X(budget) X(copy_py) \
    X(budget_counts) X(budget_lock) X(budget_acquire) X(budget_release) X(budget_held)

static int submitter_traverse(Submitter *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    SUBMITTER_OBJECTS(VISIT)
#undef VISIT
    Py_VISIT(Py_TYPE(self));
    return 0;
}

static int submitter_clear(Submitter *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    SUBMITTER_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

static void submitter_dealloc(Submitter *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    submitter_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* Submitter(rt, parts, accesses, drop_waits, cuda): ``parts`` is the runtime's
 * ``runtime.seam.SubmitterParts``, read by position (its state, then its bound methods, then the
 * compute stream count and whether the device may be lost); ``cuda`` is None, or the tuple of what the
 * CUDA launch calls (``CudaBackend.launch_parts``; see the struct); completions call this object's
 * ``finish`` */
static int submitter_init(Submitter *self, PyObject *args, PyObject *kwds) {
    PyObject *rt, *seam, *accesses_fn, *cuda;
    int drop_waits;
    if (!PyArg_ParseTuple(args, "OO!OpO", &rt, &PyTuple_Type, &seam, &accesses_fn, &drop_waits, &cuda)) return -1;
    if (sub.op_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "streamdag.native: setup_submit() was not called");
        return -1;
    }
    submitter_clear(self);
    self->rt = Py_NewRef(rt);
    PyObject **seam_state[] = {
        &self->lock, &self->done_lock, &self->busy, &self->pending, &self->streams, &self->backend, &self->device,
        &self->hurry_of, &self->spaces, &self->recordings, &self->host_ops, &self->slots, &self->next_stream,
        &self->counts, &self->parts, &self->lane_threads,
    };
    PyObject **seam_methods[] = {
        &self->submit_py, &self->take_slot_py, &self->would_block, &self->fail_lost, &self->launch_placed,
        &self->finish_launch, &self->finish_py, &self->settle, &self->hold, &self->host_deps, &self->caller_fence,
        &self->release_slot_locked,
    };
    const Py_ssize_t n_state = (Py_ssize_t)(sizeof(seam_state) / sizeof(seam_state[0]));
    const Py_ssize_t n_methods = (Py_ssize_t)(sizeof(seam_methods) / sizeof(seam_methods[0]));
    const Py_ssize_t n_seam = n_state + n_methods + 2;  /* and compute, can_be_lost */
    if (PyTuple_GET_SIZE(seam) != n_seam) {
        PyErr_Format(PyExc_TypeError, "Submitter: parts must be a runtime.seam.SubmitterParts (%zd fields), not %zd",
                     n_seam, PyTuple_GET_SIZE(seam));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n_state; i++) *seam_state[i] = Py_NewRef(PyTuple_GET_ITEM(seam, i));
    for (Py_ssize_t i = 0; i < n_methods; i++) {
        PyObject *f = PyTuple_GET_ITEM(seam, n_state + i);
        if (!PyCallable_Check(f)) {
            PyErr_Format(PyExc_TypeError, "Submitter: field %zd of the SubmitterParts is not callable", n_state + i);
            return -1;
        }
        *seam_methods[i] = Py_NewRef(f);
    }
    self->accesses_fn = Py_NewRef(accesses_fn);
    self->drop_waits = drop_waits;
    if (!PyList_CheckExact(self->busy) || !PyDict_CheckExact(self->pending) || !PyList_CheckExact(self->streams)
            || !PyList_CheckExact(self->hurry_of) || !PyAnySet_Check(self->spaces)
            || !PyDict_CheckExact(self->recordings) || !PyDict_CheckExact(self->host_ops)
            || !PyDict_CheckExact(self->next_stream) || !PyAnySet_Check(self->lane_threads)
            || Py_TYPE(self->counts) != counters_type || Py_TYPE(self->parts) != parts_type) {
        PyErr_SetString(PyExc_TypeError, "Submitter: the SubmitterParts' state is not of the expected types");
        return -1;
    }
    PyObject *slot_counts = PyObject_GetAttrString(self->slots, "counts");
    if (slot_counts == NULL) return -1;
    Py_DECREF(slot_counts);
    if (slot_counts != self->counts) {  /* take_slot and finish count slots in ``counts`` */
        PyErr_SetString(PyExc_TypeError, "Submitter: the SubmitterParts' slots must count in its counts");
        return -1;
    }
    Py_ssize_t compute = PyLong_AsSsize_t(PyTuple_GET_ITEM(seam, n_state + n_methods));
    if (compute < 1) { if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "no compute stream"); return -1; }
    self->n_compute = compute;
    PyObject *v = PyObject_GetAttrString(self->backend, "deferred");
    if (v == NULL) return -1;
    self->deferred = PyObject_IsTrue(v);
    Py_DECREF(v);
    if ((self->can_be_lost = PyObject_IsTrue(PyTuple_GET_ITEM(seam, n_state + n_methods + 1))) < 0) return -1;
    if ((self->finish = PyObject_GetAttrString((PyObject *)self, "finish")) == NULL
            || (self->lock_acquire = PyObject_GetAttr(self->lock, s_acquire)) == NULL
            || (self->lock_release = PyObject_GetAttr(self->lock, s_release)) == NULL
            || (self->done_acquire = PyObject_GetAttr(self->done_lock, s_acquire)) == NULL
            || (self->done_release = PyObject_GetAttr(self->done_lock, s_release)) == NULL
            || (self->lazy_acquire = PyObject_GetAttr(sub.lazy, s_acquire)) == NULL
            || (self->lazy_release = PyObject_GetAttr(sub.lazy, s_release)) == NULL)
        return -1;
    if (cuda != Py_None) {
        /* the completion queues, and what their put() touches (``_Completions.put_parts``): the
         * queues, their counts (the last entry's token, whether their thread's wake-up is pending:
         * C fields) and the wake-up event */
        if (!PyArg_ParseTuple(cuda, "OOOOOOOO!O!OO(O!O!O)OO", &self->get_device, &self->get_stream,
                              &self->set_stream, &self->set_device, &self->record, &self->wait, &self->caller_event,
                              &PyDict_Type, &self->callers, &PyList_Type, &self->free_events,
                              &self->device_index, &self->completions, &PyList_Type, &self->queues,
                              counters_type, &self->completion_counts, &self->wake, &self->refuse_in_capture,
                              &self->profiler_on)) {
            self->get_device = self->get_stream = self->set_stream = self->set_device = self->record = NULL;
            self->wait = self->caller_event = self->callers = self->free_events = self->device_index = NULL;
            self->completions = self->queues = self->completion_counts = self->wake = self->refuse_in_capture = NULL;
            self->profiler_on = NULL;
            return -1;
        }
        Py_INCREF(self->get_device); Py_INCREF(self->get_stream); Py_INCREF(self->set_stream);
        Py_INCREF(self->set_device); Py_INCREF(self->record); Py_INCREF(self->wait);
        Py_INCREF(self->caller_event); Py_INCREF(self->callers); Py_INCREF(self->free_events);
        Py_INCREF(self->device_index); Py_INCREF(self->completions); Py_INCREF(self->queues);
        Py_INCREF(self->completion_counts); Py_INCREF(self->wake); Py_INCREF(self->refuse_in_capture);
        Py_INCREF(self->profiler_on);
        self->torch = state.torch;
        self->streams_indexed = 1;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(self->streams); i++) {
            Py_ssize_t index;
            if (get_int(PyList_GET_ITEM(self->streams, i), s_index, &index) < 0) return -1;
            self->streams_indexed &= index == i;
        }
    }
    return 0;
}

static int is_cpu_space(PyObject *space) {
    return PyUnicode_CheckExact(space) && same_str(space, state.cpu);
}

/* ``fn``'s name for the op: ``name or fn.__name__ or type(fn).__name__``. A builtin's ``__name__``
 * is a new str made from its C name each time: the last one is kept, for the C name it was made of
 * (PyTorch's functions and tensor methods are builtins) */
static PyObject *op_name_of(Submitter *self, PyObject *fn, PyObject *name) {
    if (name != Py_None) {
        int truth = PyObject_IsTrue(name);
        if (truth < 0) return NULL;
        if (truth) return Py_NewRef(name);
    }
    const char *c_name = PyCFunction_Check(fn) ? ((PyCFunctionObject *)fn)->m_ml->ml_name : NULL;
    if (c_name != NULL && c_name == self->builtin_c_name && self->builtin_name != NULL)
        return Py_NewRef(self->builtin_name);
    PyObject *n = PyObject_GetAttr(fn, s_name_attr);
    if (n == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
    } else {
        int truth = PyObject_IsTrue(n);
        if (truth > 0) {
            if (c_name != NULL) {
                self->builtin_c_name = c_name;
                Py_XSETREF(self->builtin_name, Py_NewRef(n));
            }
            return n;
        }
        Py_DECREF(n);
        if (truth < 0) return NULL;
    }
    return PyObject_GetAttr((PyObject *)Py_TYPE(fn), s_name_attr);
}

/* a new Future, its state set as Future.__init__ sets it (without the Python call); its op's name,
 * and the number that follows it (None: none) */
static PyObject *new_future(PyObject *op_name, PyObject *op_number) {
    PyTypeObject *tp = sub.future_type;
    PyObject *f = tp->tp_new(tp, sub.empty_tuple, NULL);
    if (f == NULL) return NULL;
    future_set(f, F_STATE, sub.pending); future_set(f, F_RESULT, Py_None); future_set(f, F_EXCEPTION, Py_None);
    future_set(f, F_WATCHED, Py_False); future_set(f, F_HURRY, Py_None); future_set(f, F_DONE_TOKEN, Py_None);
    future_set(f, F_FENCE, Py_None); future_set(f, F_OP_NAME, op_name); future_set(f, F_OP_NUMBER, op_number);
    return f;
}

/* a new Op, its slots as Op.__init__ sets them, and its future. ``numbered``: its name is ``name#seq``,
 * made when first asked for (Op.name): most ops' names are never read. ``keep``: the buffers it
 * declares written (``Op.keep``) */
static PyObject *new_op(PyObject *seq, PyObject *name, int numbered, PyObject *fn, PyObject *args,
                        PyObject *kwargs, PyObject *accesses, PyObject *keep) {
    PyTypeObject *tp = sub.op_type;
    PyObject *op = tp->tp_new(tp, sub.empty_tuple, NULL);
    if (op == NULL) return NULL;
    PyObject *future = new_future(name, numbered ? seq : Py_None);
    if (future == NULL) { Py_DECREF(op); return NULL; }
    PyObject *zero = PyLong_FromLong(0);
    op_set(op, OP_SEQ, seq); op_set(op, OP_NAME, name); op_set(op, OP_FN, fn); op_set(op, OP_ARGS, args);
    op_set(op, OP_KWARGS, kwargs); op_set(op, OP_ACCESSES, accesses); op_set(op, OP_DEPS, sub.empty_tuple);
    op_set(op, OP_STAMP, Py_None); op_set(op, OP_EVENT, Py_None); op_set(op, OP_DONE, Py_False);
    op_set(op, OP_ERROR, Py_None); op_set(op, OP_ROOT_NAME, sub.empty_str); op_set(op, OP_ROOT_ERROR, Py_None);
    op_set(op, OP_VALUE, Py_None); op_set(op, OP_KEEP, keep); op_set(op, OP_RUN_ID, zero);
    op_set(op, OP_FINISH, Py_None); op_set(op, OP_NUMBERED, numbered ? Py_True : Py_False);
    OPF(op, OP_FUTURE) = future;  /* the reference made above */
    Py_DECREF(zero);
    return op;
}

/* Python's ``_submit`` for whatever the compiled path does not cover; ``placed`` (>= 0): onto that
 * stream, ordered on the device only (``submit_on``) */
static PyObject *submit_in_python(Submitter *self, PyObject *fn, PyObject *args, PyObject *kwargs,
                                  PyObject *reads, PyObject *writes, PyObject *name, PyObject *run_on,
                                  Py_ssize_t placed, int blocking) {
    PyObject *stream = placed >= 0 ? PyLong_FromSsize_t(placed) : Py_NewRef(Py_None);
    if (stream == NULL) return NULL;
    PyObject *call[] = {self->rt, fn, args, kwargs, reads, writes, name, blocking ? Py_True : Py_False,
                        stream, placed >= 0 ? Py_True : Py_False, run_on};
    PyObject *r = PyObject_Vectorcall(self->submit_py, call + 1, 10 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    Py_DECREF(stream);
    return r;
}

/* a free slot under max_inflight, taken if there is one (``completion.Slots.acquire(False)`` written out):
 * ``blocking``: else the runtime's ``_take_slot``, which waits; else ``Runtime._would_block``, which
 * raises what ``submit_nowait`` raises at the bound. 0, or -1 with an exception. */
static int take_slot(Submitter *self, int blocking) {
    if (lock_take(self->done_lock, self->done_acquire) < 0) return -1;
    Counters *counts = (Counters *)self->counts;
    int got = counts->free > 0;
    if (got) counts->free--;
    if (lock_give(self->done_lock, self->done_release) < 0) return -1;
    if (got) return 0;
    PyObject *r = blocking ? PyObject_CallOneArg(self->take_slot_py, Py_True) : PyObject_CallNoArgs(self->would_block);
    if (r == NULL) return -1;
    Py_DECREF(r);
    if (blocking) return 0;
    PyErr_SetString(PyExc_RuntimeError, "streamdag: _would_block returned");
    return -1;
}

/* ``Runtime._choose_stream`` on a runtime of one device: the stream index, or -1 */
static Py_ssize_t choose_stream(Submitter *self, PyObject *clocks, PyObject *live) {
    Py_ssize_t n = self->n_compute;
    for (Py_ssize_t i = PyList_GET_SIZE(live) - 1; i >= 0; i--) {
        PyObject *stamp = field(PyList_GET_ITEM(live, i), OP_STAMP);
        if (stamp == NULL) return -1;
        if (stamp != Py_None) {
            Py_ssize_t st = PyLong_AsSsize_t(PyTuple_GET_ITEM(stamp, 0));
            if (st == -1 && PyErr_Occurred()) { Py_DECREF(stamp); return -1; }
            if (st >= 0 && st < n && is_kind(clocks, state.clocks_type, &state.seen_clocks)
                    && st < ((Clocks *)clocks)->n && ((Clocks *)clocks)->known != NULL) {
                /* this module's clocks: the stream's tail read in C, no int made for it */
                Clocks *c = (Clocks *)clocks;
                long long pos = as_long_long(PyTuple_GET_ITEM(stamp, 1));
                if (pos == -1 && PyErr_Occurred()) { Py_DECREF(stamp); return -1; }
                if (clock_tail(c, st) == pos) { Py_DECREF(stamp); return st; }
            } else if (st >= 0 && st < n) {
                PyObject *tail = PyObject_CallMethodOneArg(clocks, s_tail, PyTuple_GET_ITEM(stamp, 0));
                if (tail == NULL) { Py_DECREF(stamp); return -1; }
                int same = PyObject_RichCompareBool(tail, PyTuple_GET_ITEM(stamp, 1), Py_EQ);
                Py_DECREF(tail);
                if (same != 0) { Py_DECREF(stamp); return same < 0 ? -1 : st; }
            }
        }
        Py_DECREF(stamp);
    }
    /* the least busy, round robin among them */
    Py_ssize_t least = PY_SSIZE_T_MAX;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t b = PyLong_AsSsize_t(PyList_GET_ITEM(self->busy, i));
        if (b == -1 && PyErr_Occurred()) return -1;
        if (b < least) least = b;
    }
    PyObject *next = PyDict_GetItemWithError(self->next_stream, self->device);
    if (next == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_KeyError, "no round robin for the runtime's device");
        return -1;
    }
    Py_ssize_t chosen = PyLong_AsSsize_t(next);
    if (chosen == -1 && PyErr_Occurred()) return -1;
    for (Py_ssize_t k = 0; k < n; k++, chosen = (chosen + 1) % n)
        if (PyLong_AsSsize_t(PyList_GET_ITEM(self->busy, chosen)) == least) break;
    PyObject *after = PyLong_FromSsize_t((chosen + 1) % n);
    if (after == NULL || PyDict_SetItem(self->next_stream, self->device, after) < 0) {
        Py_XDECREF(after);
        return -1;
    }
    Py_DECREF(after);
    return chosen;
}

/* ``list[i] += delta`` for a list of ints (a count of a few ops: a cached small int, no number call) */
static int list_add(PyObject *list, Py_ssize_t i, long delta) {
    PyObject *v = PyList_GET_ITEM(list, i);
    Py_ssize_t now = PyLong_AsSsize_t(v);
    if (now == -1 && PyErr_Occurred()) return -1;
    PyObject *sum = PyLong_FromSsize_t(now + delta);
    if (sum == NULL) return -1;
    PyList_SET_ITEM(list, i, sum);
    Py_DECREF(v);
    return 0;
}

/* ``Op.execute`` for an op whose deps did not fail: 0, or -1 with an interrupt raised (no Exception:
 * an Exception is the op's failure, kept in its error). A failed dep: the Python method. */
static PyObject *numbered_name(PyObject *name, Py_ssize_t seq);

/* ``op.name`` (borrowed: the op keeps it), made and kept if the op is numbered (see new_op). Called
 * with an op's exception taken: where the name cannot be made (no memory), its base serves. */
static PyObject *op_full_name(PyObject *op) {
    if (OPF(op, OP_NUMBERED) == Py_True) {
        Py_ssize_t seq = PyLong_AsSsize_t(OPF(op, OP_SEQ));
        PyObject *full = seq == -1 && PyErr_Occurred() ? NULL : numbered_name(OPF(op, OP_NAME), seq);
        if (full == NULL) {
            PyErr_Clear();
            return OPF(op, OP_NAME);
        }
        op_set(op, OP_NAME, full);
        Py_DECREF(full);
        op_set(op, OP_NUMBERED, Py_False);
    }
    return OPF(op, OP_NAME);
}

/* ``ops.refuse_coroutine``: ``coroutine`` (what an op's function returned; the reference is taken)
 * closed, and NULL with the TypeError that says what to do */
static PyObject *refuse_coroutine(PyObject *op, PyObject *coroutine) {
    PyObject *ops = PyImport_ImportModule("streamdag.runtime.ops");  /* (imported: a dict look-up) */
    PyObject *r = ops == NULL ? NULL
        : PyObject_CallMethod(ops, "refuse_coroutine", "OO", coroutine, op_full_name(op));
    Py_XDECREF(ops);
    Py_DECREF(coroutine);
    if (r != NULL) {
        Py_DECREF(r);
        PyErr_SetString(PyExc_TypeError, "streamdag: an op returned a coroutine");
    }
    return NULL;
}

static int execute(PyObject *op) {
    PyObject *deps = OPF(op, OP_DEPS);
    Py_ssize_t n = PyTuple_Check(deps) ? PyTuple_GET_SIZE(deps) : PyList_Check(deps) ? PyList_GET_SIZE(deps) : -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dep = PyTuple_Check(deps) ? PyTuple_GET_ITEM(deps, i) : PyList_GET_ITEM(deps, i);
        PyObject *err = field(dep, OP_ERROR);
        if (err == NULL) return -1;
        Py_DECREF(err);
        if (err != Py_None) n = -1;
    }
    if (n < 0) return call_method0(op, s_execute);
    PyObject *kwargs = OPF(op, OP_KWARGS);
    PyObject *value = PyObject_Call(OPF(op, OP_FN), OPF(op, OP_ARGS),
                                    PyDict_GET_SIZE(kwargs) ? kwargs : NULL);
    if (value != NULL && PyCoro_CheckExact(value)) value = refuse_coroutine(op, value);
    if (value == NULL) {
        PyObject *exc = take_exception();
        int interrupt = !PyErr_GivenExceptionMatches(exc, PyExc_Exception);
        if (!interrupt) {  /* kept as long as the future: without the locals of fn's frames */
            PyObject *r = PyObject_CallOneArg(sub.release_frames, exc);
            if (r == NULL) {  /* (no memory: the op's own error is the one to report) */
                PyErr_Clear();
            }
            Py_XDECREF(r);
        }
        PyObject *name = op_full_name(op);
        op_set(op, OP_ERROR, exc);
        op_set(op, OP_ROOT_NAME, name);
        op_set(op, OP_ROOT_ERROR, exc);
        if (interrupt) {
            op_set(op, OP_DEPS, sub.empty_tuple);
            restore_exception(exc);
            return -1;
        }
        Py_DECREF(exc);
    } else {
        op_set(op, OP_VALUE, value);
        Py_DECREF(value);
    }
    op_set(op, OP_DEPS, sub.empty_tuple);
    return 0;
}

/* ``threads.torch_profiler_on()`` (handed over in ``launch_parts``): whether a PyTorch profiler runs.
 * Then a device op launches through Python, whose ``CudaBackend.launch`` names it with
 * ``torch.profiler.record_function`` around its kernels. 1, 0, or -1 with an exception */
static int torch_profiling(Submitter *self) {
    PyObject *on = PyObject_CallNoArgs(self->profiler_on);
    if (on == NULL) return -1;
    int r = PyObject_IsTrue(on);
    Py_DECREF(on);
    return r;
}

/* ``CudaBackend.launch(stream, op.execute)``: order ``s`` after the caller's current stream, run the
 * op with ``s`` current, switch back. 1: the caller's stream is new to the backend (the Python
 * launch makes its object); -1: raised. */
static int cuda_launch(Submitter *self, PyObject *s, PyObject *op, PyObject *events, long long *device) {
    const StreamdagTorchHooks *torch = self->torch;
    if (torch != NULL) {  /* the same calls, in C++; the waits on deps' events too, on the stream's device */
        StreamdagSaved saved;
        if (torch->enter(s, self->caller_event, &saved) < 0) return -1;
        *device = saved.device;  /* current again after leave() */
        int rc = 0;
        for (Py_ssize_t k = 0; events != NULL && k < PyList_GET_SIZE(events) && rc == 0; k++)
            rc = torch->wait(PyList_GET_ITEM(events, k), s, saved.device_index);
        if (rc == 0) rc = execute(op);
        PyObject *exc = rc < 0 ? take_exception() : NULL;
        int left = torch->leave(&saved);  /* restored whatever the op did */
        if (exc != NULL) {
            PyErr_Clear();
            restore_exception(exc);
            return -1;
        }
        return left < 0 ? -1 : 0;
    }
    PyObject *caller_device = PyObject_CallNoArgs(self->get_device);
    if (caller_device == NULL) return -1;
    PyObject *refused = PyObject_CallFunctionObjArgs(self->refuse_in_capture, self->device_index,
                                                     caller_device, NULL);  /* raises inside a capture */
    if (refused == NULL) { Py_DECREF(caller_device); return -1; }
    Py_DECREF(refused);
    PyObject *prev = PyObject_CallOneArg(self->get_stream, self->device_index);
    if (prev == NULL) { Py_DECREF(caller_device); return -1; }
    int rc = -1;
    PyObject *caller = PyDict_GetItemWithError(self->callers, prev);
    if (caller == NULL) {
        rc = PyErr_Occurred() ? -1 : 1;
        goto done;
    }
    PyObject *r = PyObject_CallFunctionObjArgs(self->record, self->caller_event, caller, NULL);
    if (r == NULL) goto done;
    Py_DECREF(r);
    if ((r = PyObject_CallFunctionObjArgs(self->wait, self->caller_event, s, NULL)) == NULL) goto done;
    Py_DECREF(r);
    PyObject *ids = PyObject_GetAttrString(s, "ids");
    if (ids == NULL) goto done;
    r = PyObject_Call(self->set_stream, ids, NULL);
    Py_DECREF(ids);
    if (r == NULL) goto done;
    Py_DECREF(r);
    rc = execute(op);
    PyObject *exc = rc < 0 ? take_exception() : NULL;
    r = PyObject_Call(self->set_stream, prev, NULL);  /* restored whatever the op did */
    if (r != NULL) {
        Py_DECREF(r);
        if (PyObject_RichCompareBool(caller_device, self->device_index, Py_NE) == 1)
            r = PyObject_CallOneArg(self->set_device, caller_device);
        Py_XDECREF(r);
    }
    if (exc != NULL) {
        PyErr_Clear();
        restore_exception(exc);
    } else if (r == NULL) {
        rc = -1;
    }
done:
    Py_DECREF(caller_device);
    Py_DECREF(prev);
    return rc;
}

/* ``CudaBackend.when_done`` -> ``_Completions.put``: queue (number, event, callback) on the stream's
 * queue, wake the completion thread if it sleeps; the entry's token */
static PyObject *completions_put(Submitter *self, PyObject *s, Py_ssize_t stream, PyObject *event,
                                 PyObject *callback) {
    Py_ssize_t index = stream, n = PyList_GET_SIZE(self->queues);
    Counters *tokens = (Counters *)self->completion_counts;  /* seq: the last entry's token */
    if (!self->streams_indexed && get_int(s, s_index, &index) < 0) return NULL;
    if (index < 0 || index >= n) {
        PyErr_SetString(PyExc_IndexError, "a stream of no completion queue");
        return NULL;
    }
    /* one int numbers the entry, names its queue, and is the token returned (see put()) */
    Py_ssize_t token_n = (tokens->seq / n + 1) * n + index;
    PyObject *token = PyLong_FromSsize_t(token_n);
    if (token == NULL) return NULL;
    PyObject *entry = PyTuple_Pack(3, token, event, callback);
    int bad = entry == NULL;
    if (!bad) {
        tokens->seq = token_n;
        PyObject *r = queue_append(PyList_GET_ITEM(self->queues, index), entry);
        bad = r == NULL;
        Py_XDECREF(r);
    }
    Py_XDECREF(entry);
    if (bad) { Py_DECREF(token); return NULL; }
    if (!tokens->woken) {  /* no wake-up pending: the completion thread may sleep */
        tokens->woken = 1;
        if (call_method0(self->wake, s_set) < 0) { Py_DECREF(token); return NULL; }
    }
    return token;
}

/* ``op.error = op.root_error = the raised exception; op.root_name = op.name`` and
 * ``Runtime._finish_launch(op, stream, failed=True)`` (which raises it again unless an Exception) */
static int launch_failed(Submitter *self, PyObject *op, PyObject *stream) {
    PyObject *exc = take_exception();
    PyObject *name = op_full_name(op);
    op_set(op, OP_ERROR, exc);
    op_set(op, OP_ROOT_NAME, name);
    op_set(op, OP_ROOT_ERROR, exc);
    Py_DECREF(exc);
    PyObject *call[] = {self->rt, op, stream, Py_True};
    PyObject *r = PyObject_Vectorcall(self->finish_launch, call + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* ``Runtime._launch`` after ``_admit``, for the common case; the rest goes to ``_launch_placed``.
 * ``fence`` (or NULL): an event the stream waits for first (see admit_and_launch) */
static int launch(Submitter *self, PyObject *op, PyObject *deps, Py_ssize_t stream, PyObject *live,
                  PyObject *waits, int host_inputs, PyObject *fence) {
    PyObject *stream_obj = PyLong_FromSsize_t(stream);
    if (stream_obj == NULL) return -1;
    int rc = -1;
    PyObject *event = NULL, *callback = NULL, *token = NULL, *events = NULL, *r;
    if (self->can_be_lost && (sub.losses != 0 || Py_TYPE(self->backend) != sub.loss_noting_type)) {
        PyObject *lost = PyObject_GetAttr(self->backend, s_lost);
        if (lost == NULL) goto done;
        Py_DECREF(lost);  /* (compared by identity only: the backend keeps it) */
        if (lost != Py_None) {
            r = PyObject_CallFunctionObjArgs(self->fail_lost, op, self->backend, NULL);
            Py_XDECREF(r);
            rc = r == NULL ? -1 : 0;
            goto done;
        }
    }
    PyObject *s = PyList_GET_ITEM(self->streams, stream);
    Parts *parts = (Parts *)self->parts;
    int python = (parts->profiler != NULL && parts->profiler != Py_None) || (host_inputs && PyList_GET_SIZE(live));
    if (!python && self->get_device != NULL && (python = torch_profiling(self)) < 0) {
        rc = launch_failed(self, op, stream_obj);  /* as CudaBackend.launch raising */
        goto done;
    }
    Py_ssize_t nwaits = self->drop_waits ? 0 : PyList_GET_SIZE(waits);
    if (fence == Py_None) fence = NULL;
    if ((nwaits || fence != NULL) && (events = PyList_New(0)) == NULL) goto done;
    if (fence != NULL && PyList_Append(events, fence) < 0) goto done;
    for (Py_ssize_t k = 0; k < nwaits && !python; k++) {  /* a dep still launching has no event yet */
        Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(waits, k));
        if (i == -1 && PyErr_Occurred()) goto done;
        PyObject *ev = field(PyList_GET_ITEM(live, i), OP_EVENT);
        if (ev == NULL) goto done;
        python = ev == Py_None;
        int bad = PyList_Append(events, ev) < 0;
        Py_DECREF(ev);
        if (bad) goto done;
    }
    if (python) {
        PyObject *call[] = {self->rt, op, deps, stream_obj, live, waits, host_inputs ? Py_True : Py_False,
                            fence != NULL ? fence : Py_None};
        r = PyObject_Vectorcall(self->launch_placed, call + 1, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(r);
        rc = r == NULL ? -1 : 0;
        goto done;
    }
    for (Py_ssize_t k = 0; self->torch == NULL && events != NULL && k < PyList_GET_SIZE(events); k++) {
        PyObject *ev = PyList_GET_ITEM(events, k);  /* (with the torch extension cuda_launch waits) */
        r = self->wait != NULL ? PyObject_CallFunctionObjArgs(self->wait, ev, s, NULL)
                               : PyObject_CallMethodOneArg(ev, s_wait, s);
        if (r == NULL) { rc = launch_failed(self, op, stream_obj); goto done; }
        Py_DECREF(r);
    }
    long long device = -1;  /* the current device, where known */
    int launched = self->get_device != NULL ? cuda_launch(self, s, op, events, &device) : 1;
    if (launched == 1) {  /* the backend's own launch */
        PyObject *work = PyObject_GetAttr(op, s_execute);
        if (work == NULL) goto done;
        r = PyObject_CallMethodObjArgs(self->backend, s_launch, s, work, NULL);
        Py_DECREF(work);
        launched = r == NULL ? -1 : 0;
        Py_XDECREF(r);
    }
    if (launched < 0) { rc = launch_failed(self, op, stream_obj); goto done; }
    if (OPF(op, OP_ERROR) != Py_None) {  /* the op raised: the Python code tells a sticky device error */
        PyObject *call[] = {self->rt, op, stream_obj};
        r = PyObject_Vectorcall(self->finish_launch, call + 1, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_XDECREF(r);
        rc = r == NULL ? -1 : 0;
        goto done;
    }
    if (self->free_events != NULL && PyList_GET_SIZE(self->free_events)) {
        Py_ssize_t last = PyList_GET_SIZE(self->free_events) - 1;
        event = Py_NewRef(PyList_GET_ITEM(self->free_events, last));
        if (PyList_SetSlice(self->free_events, last, last + 1, NULL) < 0) goto done;
    } else if ((event = PyObject_CallMethodNoArgs(self->backend, s_event)) == NULL) {
        rc = launch_failed(self, op, stream_obj);
        goto done;
    }
    if (self->torch != NULL) {
        if (self->torch->record(event, s, device) < 0) { rc = launch_failed(self, op, stream_obj); goto done; }
    } else {
        r = self->record != NULL ? PyObject_CallFunctionObjArgs(self->record, event, s, NULL)
                                 : PyObject_CallMethodOneArg(event, s_record, s);
        if (r == NULL) { rc = launch_failed(self, op, stream_obj); goto done; }
        Py_DECREF(r);
    }
    op_set(op, OP_EVENT, event);
    /* Runtime._watch */
    PyObject *future = OPF(op, OP_FUTURE);  /* made by new_future: of the Future type exactly */
    future_set(future, F_HURRY, PyList_GET_ITEM(self->hurry_of, stream));
    future_set(future, F_FENCE, event);
    if (self->completions != NULL && self->finish != NULL) {
        /* the op is its CUDA completion entry's callback: the compiled pass calls submitter_finish
         * at once (see finish_head), and op(error) calls op.finish(op, error) */
        op_set(op, OP_FINISH, self->finish);
        callback = Py_NewRef(op);
    } else if ((callback = new_finish_call(self, op)) == NULL) {  /* another backend calls it */
        goto done;
    }
    if (self->completions != NULL) {
        if ((token = completions_put(self, s, stream, event, callback)) == NULL) goto done;
    } else if ((token = PyObject_CallMethodObjArgs(self->backend, s_when_done, s, event, callback, NULL)) == NULL) {
        goto done;
    }
    future_set(future, F_DONE_TOKEN, token);
    rc = 0;
done:
    Py_DECREF(stream_obj);
    Py_XDECREF(events);
    Py_XDECREF(event);
    Py_XDECREF(callback);
    Py_XDECREF(token);
    return rc;
}

/* ``f"{name}#{seq}"``, written out for an ASCII name (PyUnicode_FromFormat costs ~2k instructions,
 * snprintf ~1k) */
static PyObject *numbered_name(PyObject *name, Py_ssize_t seq) {
    if (!PyUnicode_CheckExact(name) || !PyUnicode_IS_ASCII(name) || PyUnicode_GET_LENGTH(name) > 200 || seq < 0)
        return PyUnicode_FromFormat("%S#%zd", name, seq);
    char buf[232], digits[24];
    Py_ssize_t n = PyUnicode_GET_LENGTH(name), k = 0;
    memcpy(buf, PyUnicode_DATA(name), (size_t)n);
    size_t v = (size_t)seq;
    do { digits[k++] = (char)('0' + v % 10); v /= 10; } while (v);
    buf[n++] = '#';
    while (k) buf[n++] = digits[--k];
    return PyUnicode_FromStringAndSize(buf, n);
}

static int launch(Submitter *self, PyObject *op, PyObject *deps, Py_ssize_t stream, PyObject *live,
                  PyObject *waits, int host_inputs, PyObject *fence);
static PyObject *host_deps_among(PyObject *host_ops, PyObject *deps);

/* ``Runtime._admit`` and ``_launch`` for ``op``, linked already (``deps``: what the tracker's link
 * returned; ``fresh``: a list our tracker made for this op alone, which may serve as its live deps),
 * onto stream ``placed`` (>= 0) or a chosen one. ``fence`` (or NULL): an event its stream waits for
 * first (a held op's, see ``Runtime._hold``). Caller holds the lock and a slot. The op's future, or NULL */
static PyObject *admit_and_launch(Submitter *self, PyObject *op, PyObject *deps, int fresh, Py_ssize_t placed,
                                  int host_inputs, PyObject *fence) {
    PyObject *clocks = NULL, *live = NULL, *kept = NULL, *stamp = NULL, *waits = NULL, *future = NULL;
    PyObject *local_stamps[8], **stamp_items = local_stamps;
    Py_ssize_t local_live_at[8], *live_at = local_live_at, n_stamps = 0;
    Counters *counts = (Counters *)self->counts;
    PyObject *seq = OPF(op, OP_SEQ);
    Parts *parts = (Parts *)self->parts;
    if (parts->clocks == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the runtime has no clocks");
        return NULL;
    }
    clocks = Py_NewRef(parts->clocks);  /* (held: its work may run code) */
    PyObject *dep_list = PySequence_Fast(deps, "the tracker's link returns a list");
    if (dep_list == NULL) goto done;
    Py_ssize_t nd = PySequence_Fast_GET_SIZE(dep_list);
    /* the live deps' stamps, borrowed: an op's stamp is set once, as it is placed, and the op is
     * held by ``live`` */
    if (nd > 8) {
        stamp_items = PyMem_Malloc(nd * sizeof(PyObject *));
        live_at = PyMem_Malloc(nd * sizeof(Py_ssize_t));
        if (stamp_items == NULL || live_at == NULL) { PyErr_NoMemory(); Py_DECREF(dep_list); goto done; }
    }
    if (!nd) {  /* no dependency: nothing is added to it, so one empty list serves every op */
        live = Py_NewRef(sub.empty_list);
    } else {  /* Runtime._admit: op.deps keeps the unfinished deps and the failed ones */
        int failed_deps = 0, finished_deps = 0;
        for (Py_ssize_t i = 0; i < nd; i++) {
            PyObject *d = PySequence_Fast_GET_ITEM(dep_list, i);
            PyObject *done = field(d, OP_DONE), *error = done == NULL ? NULL : field(d, OP_ERROR);
            int ok = error != NULL;
            if (ok && done != Py_True) {
                PyObject *stamp = field(d, OP_STAMP);
                ok = stamp != NULL;
                if (ok) {
                    live_at[n_stamps] = i;
                    stamp_items[n_stamps++] = stamp;
                }
                Py_XDECREF(stamp);
            } else if (ok) {
                finished_deps = 1;
                failed_deps |= error != Py_None;
            }
            Py_XDECREF(done);
            Py_XDECREF(error);
            if (!ok) { Py_DECREF(dep_list); goto done; }
        }
        if (!finished_deps && deps == dep_list && fresh) {
            live = Py_NewRef(dep_list);  /* the list our tracker made for this op: all live */
        } else {
            if ((live = PyList_New(n_stamps)) == NULL) { Py_DECREF(dep_list); goto done; }
            for (Py_ssize_t k = 0; k < n_stamps; k++)
                PyList_SET_ITEM(live, k, Py_NewRef(PySequence_Fast_GET_ITEM(dep_list, live_at[k])));
        }
        if (!failed_deps) {  /* then the deps kept are the live ones: one list serves both */
            kept = Py_NewRef(live);
        } else {  /* the live ones and the failed ones, in their order */
            if ((kept = PyList_New(0)) == NULL) { Py_DECREF(dep_list); goto done; }
            for (Py_ssize_t i = 0; i < nd; i++) {
                PyObject *d = PySequence_Fast_GET_ITEM(dep_list, i);
                PyObject *done = field(d, OP_DONE), *error = done == NULL ? NULL : field(d, OP_ERROR);
                int ok = error != NULL && ((done == Py_True && error == Py_None) || PyList_Append(kept, d) == 0);
                Py_XDECREF(done);
                Py_XDECREF(error);
                if (!ok) { Py_DECREF(dep_list); goto done; }
            }
        }
        op_set(op, OP_DEPS, kept);
    }
    Py_DECREF(dep_list);
    Py_ssize_t stream = placed >= 0 ? placed : choose_stream(self, clocks, live);
    if (stream < 0) goto done;
    if (is_kind(clocks, state.clocks_type, &state.seen_clocks) && stream < ((Clocks *)clocks)->n) {
        /* this module's own: no (stamp, waits) tuple, and one shared list for no wait */
        if (clocks_place_into((Clocks *)clocks, stream, stamp_items, n_stamps, sub.empty_list, &stamp, &waits) < 0)
            goto done;
    } else {
        PyObject *stream_obj = PyLong_FromSsize_t(stream), *stamps = PyList_New(n_stamps);
        if (stream_obj == NULL || stamps == NULL) { Py_XDECREF(stream_obj); Py_XDECREF(stamps); goto done; }
        for (Py_ssize_t k = 0; k < n_stamps; k++) PyList_SET_ITEM(stamps, k, Py_NewRef(stamp_items[k]));
        PyObject *pcall[] = {clocks, stream_obj, stamps};
        PyObject *placed = PyObject_VectorcallMethod(s_place, pcall, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(stream_obj);
        Py_DECREF(stamps);
        if (placed == NULL) goto done;
        if (!PyTuple_Check(placed) || PyTuple_GET_SIZE(placed) != 2 || !PyList_Check(PyTuple_GET_ITEM(placed, 1))) {
            PyErr_SetString(PyExc_TypeError, "clocks.place returns (stamp, waits)");
            Py_DECREF(placed);
            goto done;
        }
        stamp = Py_NewRef(PyTuple_GET_ITEM(placed, 0));
        waits = Py_NewRef(PyTuple_GET_ITEM(placed, 1));
        Py_DECREF(placed);
    }
    op_set(op, OP_STAMP, stamp);
    /* counted pending */
    if (lock_take(self->done_lock, self->done_acquire) < 0) goto done;
    int bad = PyDict_SetItem(self->pending, seq, op) < 0 || list_add(self->busy, stream, 1) < 0;
    if (!bad && PyDict_GET_SIZE(self->pending) > counts->peak) counts->peak = PyDict_GET_SIZE(self->pending);
    if (lock_give(self->done_lock, self->done_release) < 0 || bad) goto done;
    future = Py_NewRef(OPF(op, OP_FUTURE));
    if (launch(self, op, deps, stream, live, waits, host_inputs, fence) < 0)
        Py_CLEAR(future);
done:
    Py_XDECREF(clocks); Py_XDECREF(live); Py_XDECREF(kept); Py_XDECREF(stamp); Py_XDECREF(waits);
    if (stamp_items != local_stamps) PyMem_Free(stamp_items);
    if (live_at != local_live_at) PyMem_Free(live_at);
    return future;
}

/* ``Runtime._enqueue`` (blocking, on the runtime's device) under its lock, after the slot is taken;
 * ``placed`` (>= 0): onto that stream, ordered on the device only (no host wait for host memory).
 * ``holders`` (or NULL: none): the held and host-lane ops the op follows (``Runtime._host_deps``), or
 * False: those among the deps its link finds; with ``fence`` from ``Runtime._caller_fence``: the op is
 * held behind them (``Runtime._hold``). ``written``: the buffers the op declares written, which it holds */
static PyObject *enqueue_locked(Submitter *self, PyObject *fn, PyObject *args, PyObject *kwargs,
                                PyObject *accesses, PyObject *name, PyObject *op_name, int on_host,
                                Py_ssize_t placed, Py_ssize_t *seq_out, PyObject *holders, PyObject *fence,
                                PyObject *written) {
    PyObject *op = NULL, *seq = NULL, *tracker = NULL, *deps = NULL, *future = NULL, *found = NULL;
    Counters *counts = (Counters *)self->counts;
    Py_ssize_t seq_n = *seq_out = ++counts->seq;
    if ((seq = PyLong_FromSsize_t(seq_n)) == NULL) goto done;
    int named = name != Py_None ? PyObject_IsTrue(name) : 0;
    if (named < 0) goto done;
    if ((op = new_op(seq, op_name, !named, fn, args, kwargs, accesses, written)) == NULL) goto done;
    Parts *parts = (Parts *)self->parts;
    if (parts->tracker == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the runtime has no tracker");
        goto done;
    }
    tracker = Py_NewRef(parts->tracker);  /* (held: the tracker's work may run code) */
    PyObject *call[] = {tracker, op, accesses};
    int own = is_kind(tracker, state.tracker_type, &state.seen_tracker);
    deps = own ? tracker_link((Tracker *)tracker, call + 1, 2)  /* this module's own: no look-up */
               : PyObject_VectorcallMethod(s_link, call, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (deps == NULL) goto done;
    int host_inputs = on_host && !self->deferred && placed < 0;
    if (holders == Py_False) {  /* found now, among its deps */
        if ((holders = host_deps_among(self->host_ops, deps)) == NULL) goto done;
        found = holders;  /* (released at the end) */
        if (!PyList_GET_SIZE(holders)) holders = NULL;
    }
    if (holders != NULL) {  /* Runtime._launch_or_hold */
        PyObject *stream = placed >= 0 ? PyLong_FromSsize_t(placed) : Py_NewRef(Py_None);
        if (stream == NULL) goto done;
        PyObject *hcall[] = {self->rt, op, deps, holders, stream, self->device,
                             host_inputs ? Py_True : Py_False, fence};
        PyObject *held = PyObject_Vectorcall(self->hold, hcall + 1, 7 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(stream);
        if (held == NULL) goto done;
        Py_DECREF(held);
        if (held == Py_True) {
            future = Py_NewRef(OPF(op, OP_FUTURE));
            goto done;
        }
    }
    if (fence != NULL && fence != Py_None) {  /* not held (none, or all finished meanwhile): unused */
        PyObject *r = PyObject_CallMethodOneArg(self->backend, s_recycle, fence);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    future = admit_and_launch(self, op, deps, own, placed, host_inputs, NULL);
done:
    Py_XDECREF(op); Py_XDECREF(seq); Py_XDECREF(tracker); Py_XDECREF(deps); Py_XDECREF(found);
    return future;
}

/* ``arguments._unwrap`` for an inline marker (``sd.read(a)``, ``sd.write(b)``): its access appended to
 * ``accesses``, and its value (a new reference), which the op receives in its place */
static PyObject *unwrap_marker(PyObject *marker, PyObject *accesses) {
    PyObject *value = PyObject_GetAttr(marker, s_marker_value);
    if (value == NULL) return NULL;
    PyObject *flag = PyObject_GetAttr(marker, s_marker_write);
    int write = flag == NULL ? -1 : PyObject_IsTrue(flag);
    Py_XDECREF(flag);
    PyObject *access = write < 0 ? NULL : access_of(value, write);
    if (access == NULL || PyList_Append(accesses, access) < 0) {
        Py_XDECREF(access);
        Py_DECREF(value);
        return NULL;
    }
    Py_DECREF(access);
    return value;
}

/* ``arguments.collect_accesses`` for the markers among an op's arguments: unwrapped in place (``args`` and
 * ``kwargs`` are this submit's own), their accesses after the declared ones, args first */
static int unwrap_markers(PyObject *args, PyObject *kwargs, PyObject *accesses) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++) {
        PyObject *marker = PyTuple_GET_ITEM(args, i);
        if (Py_TYPE(marker) != sub.marker_type) continue;
        PyObject *value = unwrap_marker(marker, accesses);
        if (value == NULL) return -1;
        PyTuple_SET_ITEM(args, i, value);
        Py_DECREF(marker);
    }
    Py_ssize_t pos = 0;
    PyObject *key, *marker;
    while (PyDict_Next(kwargs, &pos, &key, &marker)) {  /* values replaced, keys unchanged: allowed */
        if (Py_TYPE(marker) != sub.marker_type) continue;
        PyObject *value = unwrap_marker(marker, accesses);
        int bad = value == NULL || PyDict_SetItem(kwargs, key, value) < 0;
        Py_XDECREF(value);
        if (bad) return -1;
    }
    return 0;
}

/* whether ``x`` is an Access as buffers.py makes it: ((space, start, end), write) */
static int is_access(PyObject *x) {
    return PyTuple_Check(x) && PyTuple_GET_SIZE(x) == 2 && PyTuple_Check(PyTuple_GET_ITEM(x, 0))
           && PyTuple_GET_SIZE(PyTuple_GET_ITEM(x, 0)) == 3;
}

/* whether a list holds Accesses only */
static int all_accesses(PyObject *list) {
    if (!PyList_CheckExact(list)) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++)
        if (!is_access(PyList_GET_ITEM(list, i))) return 0;
    return 1;
}

/* whether an access of ``a`` and one of ``b`` (lists of Access) touch the same bytes, one of them
 * writing: 1, 0, or -1 with an exception */
static int accesses_conflict(PyObject *a, PyObject *b) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(a); i++) {
        PyObject *x = PyList_GET_ITEM(a, i), *rx = PyTuple_GET_ITEM(x, 0);
        int wx = PyTuple_GET_ITEM(x, 1) == Py_True;
        long long lo = as_long_long(PyTuple_GET_ITEM(rx, 1)), hi = as_long_long(PyTuple_GET_ITEM(rx, 2));
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(b); j++) {
            PyObject *y = PyList_GET_ITEM(b, j), *ry = PyTuple_GET_ITEM(y, 0);
            if (!wx && PyTuple_GET_ITEM(y, 1) != Py_True) continue;
            long long ylo = as_long_long(PyTuple_GET_ITEM(ry, 1)), yhi = as_long_long(PyTuple_GET_ITEM(ry, 2));
            if (PyErr_Occurred()) return -1;
            if (lo < yhi && ylo < hi) {
                int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(rx, 0), PyTuple_GET_ITEM(ry, 0), Py_EQ);
                if (same != 0) return same;
            }
        }
    }
    return PyErr_Occurred() ? -1 : 0;
}

/* whether an unfinished op of ``host_ops`` (the runtime's host-lane and held ops, by number) touches memory
 * that ``accesses`` touch, one of them writing: a superset of the host-lane ops the tracker would
 * find this op depends on (each such dep conflicts with it), found without the tracker's Python
 * look-up (~5 µs). 1, 0, or -1 with an exception. */
static int host_conflict(PyObject *host_ops, PyObject *accesses) {
    Py_ssize_t pos = 0;
    PyObject *key, *op;
    if (!all_accesses(accesses)) return 1;  /* (where any is not an Access, the link's deps tell) */
    while (PyDict_Next(host_ops, &pos, &key, &op)) {  /* (no Python code runs here: it cannot change) */
        if (Py_TYPE(op) != sub.op_type) return 1;
        PyObject *theirs = OPF(op, OP_ACCESSES);
        if (OPF(op, OP_DONE) == Py_True) continue;
        if (!all_accesses(theirs)) return 1;
        int c = accesses_conflict(accesses, theirs);
        if (c != 0) return c;
    }
    return 0;
}

/* whether the calling thread is a lane's (``cpu.LANE_THREADS``, the runtime's ``_lane_threads``): 1, 0,
 * or -1 with an exception. On a runtime of lanes an op submitted there goes the Python way, whose
 * stream choice keeps it off the calling op's own lane (``Runtime._choose_stream``) */
static int lane_thread_here(Submitter *self) {
    if (PySet_GET_SIZE(self->lane_threads) == 0) return 0;
    PyObject *ident = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
    if (ident == NULL) return -1;
    int found = PySet_Contains(self->lane_threads, ident);
    Py_DECREF(ident);
    return found;
}

/* whether the calling thread is a host lane's, where an op that would wait for that lane's op is
 * refused (``Runtime._host_deps``): True, False, or NULL with an exception */
static PyObject *on_a_host_lane(Submitter *self) {
    int found = lane_thread_here(self);
    return found < 0 ? NULL : Py_NewRef(found ? Py_True : Py_False);
}

/* the unfinished ops of ``host_ops`` among ``deps`` (``Runtime._host_deps`` from what the link found),
 * a new list, or NULL with an exception */
static PyObject *host_deps_among(PyObject *host_ops, PyObject *deps) {
    PyObject *seq = PySequence_Fast(deps, "the tracker's link returns a list");
    if (seq == NULL) return NULL;
    PyObject *found = PyList_New(0);
    for (Py_ssize_t i = 0; found != NULL && i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *d = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *done = field(d, OP_DONE), *number = done == NULL ? NULL : field(d, OP_SEQ);
        int in = number == NULL ? -1 : done == Py_True ? 0 : PyDict_Contains(host_ops, number);
        if (in < 0 || (in && PyList_Append(found, d) < 0)) Py_CLEAR(found);
        Py_XDECREF(done);
        Py_XDECREF(number);
    }
    Py_DECREF(seq);
    return found;
}

/* whether ``x`` is a list, tuple or dict (exactly), where ``arguments.collect_accesses`` looks for markers */
static inline int is_container(PyObject *x) {
    return PyList_CheckExact(x) || PyTuple_CheckExact(x) || PyDict_CheckExact(x);
}

/* whether the container ``v`` (see is_container) may hold an inline marker, at any depth: 1 where one
 * is found, or where the look goes deeper than 32 or past ``*budget`` items (a container inside
 * itself, or a huge one: the Python code, which unwraps them, looks); else 0. No Python code runs. */
static int may_hold_marker(PyObject *v, int depth, Py_ssize_t *budget) {
    if (depth > 32) return 1;
    Py_ssize_t pos = 0, n = PyDict_CheckExact(v) ? 0 : Py_SIZE(v);
    PyObject *key, *x;
    for (Py_ssize_t i = 0;; i++) {
        if (PyDict_CheckExact(v)) {
            if (!PyDict_Next(v, &pos, &key, &x)) return 0;
        } else {
            if (i >= n) return 0;
            x = PyList_CheckExact(v) ? PyList_GET_ITEM(v, i) : PyTuple_GET_ITEM(v, i);
        }
        if (--*budget < 0 || Py_TYPE(x) == sub.marker_type) return 1;
        if (is_container(x) && may_hold_marker(x, depth + 1, budget)) return 1;
    }
}

/* undo unwrap_markers: the caller's markers back in ``args`` and ``kwargs`` (made from ``argv``, as
 * given to submit), for the Python path, which reads the accesses from them again */
static int rewrap_markers(PyObject *args, PyObject *kwargs, PyObject *const *argv, Py_ssize_t nargs,
                          PyObject *kwnames) {
    for (Py_ssize_t i = 1; i < nargs; i++) {
        if (Py_TYPE(argv[i]) != sub.marker_type) continue;
        PyObject *old = PyTuple_GET_ITEM(args, i - 1);
        PyTuple_SET_ITEM(args, i - 1, Py_NewRef(argv[i]));
        Py_DECREF(old);
    }
    for (Py_ssize_t i = 0; kwnames != NULL && i < PyTuple_GET_SIZE(kwnames); i++) {
        PyObject *value = argv[nargs + i];
        if (Py_TYPE(value) == sub.marker_type && PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), value) < 0)
            return -1;
    }
    return 0;
}

/* Runtime.submit(fn, /, *args, reads=(), writes=(), name=None, run_on=None, **kwargs); ``placed``
 * (>= 0, a stream of the runtime): Runtime._submit_on(placed, fn, ...); not ``blocking``:
 * Runtime.submit_nowait (WouldBlock at the in-flight bound) */
static PyObject *submit_with(Submitter *self, PyObject *const *argv, Py_ssize_t nargs, PyObject *kwnames,
                             Py_ssize_t placed, int blocking) {
    PyObject *fn = argv[0];
    PyObject *reads = sub.empty_tuple, *writes = sub.empty_tuple, *name = Py_None, *run_on = Py_None;
    /* the function's keywords: one shared empty dict unless it gets some (an op only reads them) */
    PyObject *args = PyTuple_New(nargs - 1), *kwargs = Py_NewRef(sub.empty_dict), *result = NULL,
             *accesses = NULL, *op_name = NULL;
    int markers = 0, unwrapped = 0, nested = 0;  /* nested: markers in a container, which Python unwraps */
    Py_ssize_t budget = 1 << 20;
    if (args == NULL) goto done;
    for (Py_ssize_t i = 1; i < nargs; i++) {
        PyTuple_SET_ITEM(args, i - 1, Py_NewRef(argv[i]));
        markers |= Py_TYPE(argv[i]) == sub.marker_type;
        if (!nested && is_container(argv[i])) nested = may_hold_marker(argv[i], 0, &budget);
    }
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, i), *value = argv[nargs + i];
        if (same_str(key, s_reads)) reads = value;
        else if (same_str(key, s_writes)) writes = value;
        else if (same_str(key, s_name)) name = value;
        else if (same_str(key, s_run_on)) run_on = value;
        else {
            if (kwargs == sub.empty_dict) {
                Py_DECREF(kwargs);
                if ((kwargs = PyDict_New()) == NULL) goto done;
            }
            if (PyDict_SetItem(kwargs, key, value) < 0) goto done;
            markers |= Py_TYPE(value) == sub.marker_type;
            if (!nested && is_container(value)) nested = may_hold_marker(value, 0, &budget);
        }
    }
    Parts *parts = (Parts *)self->parts;
    int own_accesses = PyCFunction_Check(self->accesses_fn)
        && PyCFunction_GET_FUNCTION(self->accesses_fn) == (PyCFunction)(void (*)(void))accesses_of;
    /* markers are unwrapped here where the accesses are this module's (else by the Python code); while
     * a pending op may give an object new memory, the Python code adds the accesses to the objects */
    if (parts->closed || !PyCallable_Check(fn) || run_on != Py_None || (markers && !own_accesses) || nested
            || state.resizing == NULL || PyDict_GET_SIZE(state.resizing)
            || !(PyList_CheckExact(reads) || PyTuple_CheckExact(reads))
            || !(PyList_CheckExact(writes) || PyTuple_CheckExact(writes))
            || PyDict_GET_SIZE(self->recordings))
        goto in_python;
    {  /* from a lane's thread, the Python way: it chooses the stream, and counts the lane as waiting
        * while it waits for the runtime's lock (Runtime._wait_for_the_lock) */
        int here = lane_thread_here(self);
        if (here < 0) goto done;
        if (here) goto in_python;
    }
    PyObject *both[] = {reads, writes};
    accesses = own_accesses
        ? accesses_of(NULL, both, 2)  /* this module's own */
        : PyObject_Vectorcall(self->accesses_fn, both, 2, NULL);
    if (accesses == NULL) goto done;
    unwrapped = markers;  /* (the Python path, should the op go there, gets them back: rewrap_markers) */
    if (markers && unwrap_markers(args, kwargs, accesses) < 0) goto done;
    if ((op_name = op_name_of(self, fn, name)) == NULL) goto done;
    int on_host = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(accesses); i++) {
        PyObject *access = PyList_GET_ITEM(accesses, i), *region = PyTuple_GET_ITEM(access, 0);
        PyObject *space = PyTuple_GET_ITEM(region, 0);
        if (PyTuple_GET_ITEM(access, 1) == Py_True) {  /* an empty write: by the object, in Python */
            int empty = PyObject_RichCompareBool(PyTuple_GET_ITEM(region, 1), PyTuple_GET_ITEM(region, 2), Py_EQ);
            if (empty < 0) goto done;
            if (empty) goto in_python;
        }
        int known = PySet_Contains(self->spaces, space);
        if (known < 0) goto done;
        if (!known) goto in_python;  /* objects (buffers.OBJECTS, a graph's replay), or the error that says what to do */
        on_host |= is_cpu_space(space);
    }
    if (take_slot(self, blocking) < 0) goto done;
    if (lock_take(self->lock, self->lock_acquire) < 0) goto done;
    if (parts->closed) {  /* closed since the check above (a wait for a slot, say): Runtime._submit decides */
        int bad = lock_give(self->lock, self->lock_release) < 0;
        PyObject *r = bad ? NULL : PyObject_CallMethodNoArgs(self->slots, s_release);
        if (r == NULL) goto done;
        Py_DECREF(r);
        goto in_python;
    }
    PyObject *holders = NULL, *fence = NULL;
    if (PyDict_GET_SIZE(self->host_ops)) {  /* host-lane ops pending: may this op follow one? */
        int conflict = host_conflict(self->host_ops, accesses);
        if (conflict == 1) {  /* it may be held behind them (Runtime._holders): what must come first */
            holders = on_a_host_lane(self);
            if (holders == Py_True) {  /* the check that it would wait for its own lane: before its link */
                Py_SETREF(holders, PyObject_CallFunctionObjArgs(self->host_deps, accesses, op_name, NULL));
                if (holders != NULL && !PyList_CheckExact(holders)) {
                    PyErr_SetString(PyExc_TypeError, "Runtime._host_deps returns a list");
                    Py_CLEAR(holders);
                }
                if (holders != NULL && !PyList_GET_SIZE(holders)) Py_SETREF(holders, Py_NewRef(Py_None));
            }  /* else False: its holders are found among the deps its link returns */
            if (holders != NULL && holders != Py_None) {  /* a fence, which raises in the caller's capture */
                fence = PyObject_CallOneArg(self->caller_fence, self->device);
                if (fence == NULL) Py_CLEAR(holders);
            }
            if (holders == Py_None) Py_CLEAR(holders);
            conflict = holders == NULL && PyErr_Occurred() ? -1 : 0;
        }
        if (conflict != 0) {  /* refused, or no memory: the op is not submitted */
            PyObject *exc = take_exception();
            int bad = lock_give(self->lock, self->lock_release) < 0;
            PyObject *r = bad ? NULL : PyObject_CallMethodNoArgs(self->slots, s_release);
            Py_XDECREF(r);
            if (r != NULL) restore_exception(exc);
            else Py_DECREF(exc);
            goto done;
        }
    }
    Py_ssize_t seq = 0;
    result = enqueue_locked(self, fn, args, kwargs, accesses, name, op_name, on_host, placed, &seq, holders,
                            fence, writes);
    Py_XDECREF(holders);
    Py_XDECREF(fence);
    PyObject *exc = result == NULL ? take_exception() : NULL;
    int released = lock_give(self->lock, self->lock_release);
    if (exc != NULL) {
        if (released == 0) restore_exception(exc);
        else Py_DECREF(exc);
        goto done;
    }
    if (released < 0) { Py_CLEAR(result); goto done; }
    /* outside the lock: finish what has completed, every so many submits (callbacks may submit) */
    PyObject *ready = Py_XNewRef(parts->finish_ready);
    if (ready == NULL) {
        PyErr_SetString(PyExc_AttributeError, "the runtime has no finish_ready");
        Py_CLEAR(result);
        goto done;
    }
    Py_ssize_t every = parts->finish_every;
    if (PyList_Check(ready) && PyList_GET_SIZE(ready) && every > 0 && seq % every == 0) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ready); i++) {
            PyObject *r = PyObject_CallNoArgs(PyList_GET_ITEM(ready, i));
            if (r == NULL) break;
            Py_DECREF(r);
        }
    }
    Py_DECREF(ready);
    if (PyErr_Occurred()) Py_CLEAR(result);
    goto done;
in_python:  /* every case but the common one: the Python methods */
    if (unwrapped && rewrap_markers(args, kwargs, argv, nargs, kwnames) < 0) goto done;
    if (kwargs == sub.empty_dict) {  /* the Python path gets a dict of its own, as **kwargs makes */
        Py_DECREF(kwargs);
        if ((kwargs = PyDict_New()) == NULL) goto done;
    }
    result = submit_in_python(self, fn, args, kwargs, reads, writes, name, run_on, placed, blocking);
done:
    Py_XDECREF(args);
    Py_XDECREF(kwargs);
    Py_XDECREF(accesses);
    Py_XDECREF(op_name);
    return result;
}

static PyObject *submitter_submit(Submitter *self, PyObject *const *argv, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "submit() needs the function to run first: rt.submit(fn, *args)");
        return NULL;
    }
    return submit_with(self, argv, nargs, kwnames, -1, 1);
}

/* Runtime.submit_nowait: as submit, but WouldBlock at the bound instead of waiting */
static PyObject *submitter_submit_nowait(Submitter *self, PyObject *const *argv, Py_ssize_t nargsf,
                                         PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError,
                        "submit_nowait() needs the function to run first: rt.submit_nowait(fn, *args)");
        return NULL;
    }
    return submit_with(self, argv, nargs, kwnames, -1, 0);
}

/* Runtime._submit_on(stream, fn, /, *args, reads=(), writes=(), name=None, **kwargs): an op onto
 * that stream (a copy stream), ordered on the device only: the transfers' path */
static PyObject *submitter_submit_on(Submitter *self, PyObject *const *argv, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 2 || !PyLong_Check(argv[0])) {
        PyErr_SetString(PyExc_TypeError, "_submit_on(stream: int, fn, *args, reads=..., writes=...)");
        return NULL;
    }
    Py_ssize_t stream = PyLong_AsSsize_t(argv[0]);
    if (stream == -1 && PyErr_Occurred()) return NULL;
    if (stream < 0 || stream >= PyList_GET_SIZE(self->streams)) {
        PyErr_Format(PyExc_IndexError, "_submit_on: stream %zd out of range (the runtime has %zd)", stream,
                     PyList_GET_SIZE(self->streams));
        return NULL;
    }
    return submit_with(self, argv + 1, nargs - 1, kwnames, stream, 1);
}

/* Runtime._finish(op, device_error=None): a successful op whose future nobody watches is finished
 * here; anything else by the Python method (or, once counted, its ``_settle``) */
static PyObject *submitter_finish(Submitter *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "finish(op, device_error=None)");
        return NULL;
    }
    PyObject *op = args[0];
    if ((nargs == 2 && args[1] != Py_None) || Py_TYPE(op) != sub.op_type || OPF(op, OP_ERROR) != Py_None
            || OPF(op, OP_STAMP) == NULL || OPF(op, OP_STAMP) == Py_None) {
        if (Py_TYPE(op) == sub.op_type) op_set(op, OP_FINISH, Py_None);  /* no reference to the runtime */
        return PyObject_Vectorcall(self->finish_py, (PyObject *[]){NULL, op, nargs == 2 ? args[1] : Py_None} + 1,
                                   2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    op_set(op, OP_DONE, Py_True);
    /* a future someone watches (``_watched`` never turns back) is counted as calling back in the
     * same hold as it leaves pending: synchronize() never sees neither; one nobody watches costs
     * nothing here */
    PyObject *fut = OPF(op, OP_FUTURE);
    int counted = Py_TYPE(fut) != sub.future_type || FUTF(fut, F_WATCHED) != Py_False;
    if (lock_take(self->done_lock, self->done_acquire) < 0) return NULL;
    Counters *counts = (Counters *)self->counts;
    Py_ssize_t stream = PyLong_AsSsize_t(PyTuple_GET_ITEM(OPF(op, OP_STAMP), 0));
    int bad = (stream == -1 && PyErr_Occurred()) || PyDict_DelItem(self->pending, OPF(op, OP_SEQ)) < 0
              || list_add(self->busy, stream, -1) < 0;
    if (!bad && counted) counts->calling++;
    if (!bad && counts->waiting) {  /* Slots.release_locked: the slot back, and a waiter woken */
        PyObject *r = PyObject_CallNoArgs(self->release_slot_locked);
        bad = r == NULL;
        Py_XDECREF(r);
    } else if (!bad) {
        counts->free++;
    }
    if (!bad) counts->completed++;
    if (lock_give(self->done_lock, self->done_release) < 0 || bad) return NULL;
    PyObject *value = Py_NewRef(OPF(op, OP_VALUE));
    PyObject *future = Py_NewRef(OPF(op, OP_FUTURE));
    op_set(op, OP_FN, Py_None); op_set(op, OP_ARGS, Py_None); op_set(op, OP_KWARGS, Py_None);
    op_set(op, OP_VALUE, Py_None); op_set(op, OP_KEEP, Py_None);  /* no reference to user data is kept */
    op_set(op, OP_FINISH, Py_None);  /* nor to the runtime */
    /* Future._settle_unobserved */
    PyObject *result = NULL;
    int settled = 0;
    if (lock_take(sub.lazy, self->lazy_acquire) < 0) goto done;
    if (Py_TYPE(future) != sub.future_type || FUTF(future, F_WATCHED) == NULL || FUTF(future, F_STATE) == NULL) {
        settled = -1;  /* not one new_future made: the Python code settles it */
    } else if (FUTF(future, F_WATCHED) == Py_False && FUTF(future, F_STATE) == sub.pending) {
        future_set(future, F_RESULT, value);
        future_set(future, F_EXCEPTION, Py_None);
        future_set(future, F_STATE, sub.finished);
        settled = 1;
    } else {
        settled = -1;  /* someone watches: the Python code settles it */
    }
    {
        PyObject *exc = PyErr_Occurred() ? take_exception() : NULL;
        if (lock_give(sub.lazy, self->lazy_release) < 0) { Py_XDECREF(exc); goto done; }
        if (exc != NULL) { restore_exception(exc); goto done; }
    }
    if (settled == 1) {  /* nobody watches: no callbacks */
        result = Py_NewRef(Py_None);
    } else if (settled == -1) {
        if (!counted) {  /* watched since: counted now */
            if (lock_take(self->done_lock, self->done_acquire) < 0) goto done;
            ((Counters *)self->counts)->calling++;
            if (lock_give(self->done_lock, self->done_release) < 0) goto done;
        }
        PyObject *call[] = {self->rt, future, value, Py_None};
        result = PyObject_Vectorcall(self->settle, call + 1, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
done:
    Py_DECREF(value);
    Py_DECREF(future);
    return result;
}


/* whether ``event`` has completed: 1, 0, or -1 with an exception; in C++ for a ``event_type`` (our
 * CudaEvent) where the torch extension is loaded, else its ``query()`` through PyTorch's bindings */
/* ``partial(submitter.finish, op)``, what an op's completion entry calls (with the device error or
 * None, or with nothing), made without partial's argument tuple and keyword dict */
typedef struct {
    PyObject_HEAD
    Submitter *submitter;
    PyObject *op;
    vectorcallfunc vectorcall;
} FinishCall;

static PyTypeObject *finish_call_type;

static PyObject *finish_call_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                        PyObject *kwnames) {
    FinishCall *self = (FinishCall *)callable;
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n > 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "an op's finish takes at most its device error");
        return NULL;
    }
    PyObject *call[2] = {self->op, n ? args[0] : Py_None};
    return submitter_finish(self->submitter, call, 2);
}

static PyObject *new_finish_call(Submitter *submitter, PyObject *op) {
    FinishCall *self = PyObject_GC_New(FinishCall, finish_call_type);
    if (self == NULL) return NULL;
    self->submitter = (Submitter *)Py_NewRef((PyObject *)submitter);
    self->op = Py_NewRef(op);
    self->vectorcall = finish_call_vectorcall;
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

static int finish_call_traverse(FinishCall *self, visitproc visit, void *arg) {
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->submitter);
    Py_VISIT(self->op);
    return 0;
}

static int finish_call_clear(FinishCall *self) {
    Py_CLEAR(self->submitter);
    Py_CLEAR(self->op);
    return 0;
}

static void finish_call_dealloc(FinishCall *self) {
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    finish_call_clear(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyMemberDef finish_call_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(FinishCall, vectorcall), READONLY, NULL},
    {"op", T_OBJECT, offsetof(FinishCall, op), READONLY, NULL},
    {NULL}
};

static PyType_Slot finish_call_slots[] = {
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, finish_call_traverse},
    {Py_tp_clear, finish_call_clear},
    {Py_tp_dealloc, finish_call_dealloc},
    {Py_tp_members, finish_call_members},
    {Py_tp_doc, "partial(Runtime._finish, op), compiled: what an op's completion entry calls."},
    {0, NULL}
};

static PyType_Spec finish_call_spec = {
    "streamdag.native.FinishCall", sizeof(FinishCall), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL, finish_call_slots
};

static int event_query(PyObject *event, PyObject *event_type) {
    if (state.torch != NULL && PyObject_TypeCheck(event, (PyTypeObject *)event_type))
        return state.torch->query(event);
    PyObject *r = PyObject_CallMethodNoArgs(event, s_query);
    if (r == NULL) return -1;
    int done = PyObject_IsTrue(r);
    Py_DECREF(r);
    return done;
}

/* ``entry`` (a new reference, or NULL with an exception) if it is a completion entry (number,
 * event, callback); else NULL with a TypeError, its reference dropped */
static PyObject *checked_entry(PyObject *entry) {
    if (entry != NULL && (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3)) {
        Py_DECREF(entry);
        PyErr_SetString(PyExc_TypeError, "a completion entry is (number, event, callback)");
        return NULL;
    }
    return entry;
}

/* the event of queue entry ``q[index]`` (a new reference), or NULL with an exception */
static PyObject *entry_event(PyObject *q, Py_ssize_t index) {
    PyObject *entry = checked_entry(PySequence_GetItem(q, index));
    if (entry == NULL) return NULL;
    PyObject *event = Py_NewRef(PyTuple_GET_ITEM(entry, 1));
    Py_DECREF(entry);
    return event;
}

/* call a dequeued entry's callback with None and give its event to ``free`` unless it times:
 * _Completions._settle for an entry that completed (the entry's reference is the caller's) */
static int settle_done(PyObject *entry, PyObject *free_events, PyObject *event_type) {
    PyObject *event = PyTuple_GET_ITEM(entry, 1), *callback = PyTuple_GET_ITEM(entry, 2), *r;
    PyObject *finish = Py_TYPE(callback) == sub.op_type ? OPF(callback, OP_FINISH) : NULL;
    if (finish != NULL && PyCFunction_Check(finish) && PyCFunction_GET_SELF(finish) != NULL
            && Py_TYPE(PyCFunction_GET_SELF(finish)) == submitter_type
            && PyCFunction_GET_FUNCTION(finish) == (PyCFunction)(void (*)(void))submitter_finish) {
        /* op(None), without the call */
        PyObject *call[] = {callback, Py_None};
        r = submitter_finish((Submitter *)PyCFunction_GET_SELF(finish), call, 2);
    } else {
        r = PyObject_CallOneArg(callback, Py_None);
    }
    int bad = r == NULL;
    Py_XDECREF(r);
    if (!bad && Py_TYPE(event) == (PyTypeObject *)event_type) {  /* exactly CudaEvent: never one that times */
        bad = PyList_Append(free_events, event) < 0;
    } else if (!bad) {
        PyObject *timing = PyObject_GetAttr(event, s_timing);
        int times = timing == NULL ? -1 : PyObject_IsTrue(timing);
        Py_XDECREF(timing);
        bad = times < 0 || (!times && PyList_Append(free_events, event) < 0);
    }
    return bad ? -1 : 0;
}

/* pop the head entry of ``q`` and settle it (settle_done) */
static int finish_head(PyObject *q, PyObject *free_events, PyObject *event_type) {
    PyObject *entry = checked_entry(queue_popleft(q));
    if (entry == NULL) return -1;
    int rc = settle_done(entry, free_events, event_type);
    Py_DECREF(entry);
    return rc;
}

/* ``owner.lost`` (borrowed: the owner keeps it), or NULL on error; None without a look-up where the
 * owner's type notes each loss and none happened */
static PyObject *owner_lost(PyObject *owner) {
    if (sub.losses == 0 && Py_TYPE(owner) == sub.loss_noting_type) return Py_None;
    PyObject *lost = PyObject_GetAttr(owner, s_lost);
    Py_XDECREF(lost);
    return lost;
}

/* the query of ``event`` raised: ``owner.mark_lost(exc)`` for an Exception (a new reference to the
 * error it returns), as the Python pass's ``except Exception``; anything else propagates (NULL) */
static PyObject *mark_lost(PyObject *owner) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *exc = take_exception();
    if (exc == NULL) return NULL;
    PyObject *error = PyObject_CallMethodOneArg(owner, s_mark_lost, exc);
    Py_DECREF(exc);
    return error;
}

/* completions_pass(settle, queues, owner, free, event_type) -> progressed: ``_Completions._pass``
 * (backends/cuda_completions.py, the reference) without the stream sanitizer. Per queue, one query
 * of its newest event covers the whole queue (a stream runs in order); else its entries are queried
 * from the head until one has not completed. A finished entry's callback is called with None and its event given
 * to ``free`` unless it times (``CudaBackend.recycle``). A query that raises marks the device lost
 * (``owner.mark_lost``); from then on every entry is settled with that error (``settle``: the bound ``_Completions._settle``).
 * Unless ``mark_lost`` returns None (a query refused during a CUDA graph capture): that entry and
 * the rest of its queue stay queued.
 * A callback's exception propagates, as in the Python pass. */
static PyObject *completions_pass_queues(PyObject *settle, PyObject *queues, PyObject *owner,
                                         PyObject *free_events, PyObject *event_type);

static PyObject *note_loss(PyObject *module, PyObject *unused) {
    sub.losses++;
    Py_RETURN_NONE;
}

static PyObject *note_losses_of(PyObject *module, PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "note_losses_of(backend_type)");
        return NULL;
    }
    Py_XSETREF(sub.loss_noting_type, (PyTypeObject *)Py_NewRef(type));
    Py_RETURN_NONE;
}

static PyObject *completions_pass(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[1]) || !PyList_Check(args[3]) || !PyType_Check(args[4])) {
        PyErr_SetString(PyExc_TypeError, "completions_pass(settle, queues: list, owner, free: list, event_type)");
        return NULL;
    }
    PyObject *settle = args[0], *queues = args[1], *owner = args[2], *free_events = args[3];
    PyObject *event_type = args[4];
    return completions_pass_queues(settle, queues, owner, free_events, event_type);
}

static PyObject *completions_pass_queues(PyObject *settle, PyObject *queues, PyObject *owner,
                                         PyObject *free_events, PyObject *event_type) {
    int progressed = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(queues); i++) {
        PyObject *q = PyList_GET_ITEM(queues, i);
        Py_ssize_t known = 0, n = PyObject_Size(q);  /* appended meanwhile: not covered */
        if (n < 0) return NULL;
        if (n == 0) continue;
        PyObject *lost = owner_lost(owner);
        if (lost == NULL) return NULL;
        if (lost == Py_None) {
            PyObject *event = entry_event(q, n - 1);
            if (event == NULL) return NULL;
            int done = event_query(event, event_type);
            Py_DECREF(event);
            if (done < 0) {  /* a sticky error surfaces here */
                PyObject *error = mark_lost(owner);
                if (error == NULL) return NULL;
                Py_DECREF(error);
            } else if (done) {
                known = n;
            }
        }
        for (;;) {
            Py_ssize_t left = PyObject_Size(q);
            if (left < 0) return NULL;
            if (left == 0) break;
            PyObject *error = owner_lost(owner);  /* a callback may have marked it */
            if (error == NULL) return NULL;
            Py_INCREF(error);
            if (error == Py_None && known <= 0) {
                PyObject *event = entry_event(q, 0);
                if (event == NULL) { Py_DECREF(error); return NULL; }
                int done = event_query(event, event_type);
                Py_DECREF(event);
                if (done == 0) { Py_DECREF(error); break; }
                if (done < 0) {
                    Py_SETREF(error, mark_lost(owner));
                    if (error == NULL) return NULL;
                    if (error == Py_None) { Py_DECREF(error); break; }  /* refused during a capture */
                }
            }
            known--;
            progressed = 1;
            if (error == Py_None) {
                Py_DECREF(error);
                if (finish_head(q, free_events, event_type) < 0) return NULL;
                continue;
            }
            PyObject *entry = checked_entry(queue_popleft(q));
            if (entry == NULL) {
                Py_DECREF(error);
                return NULL;
            }
            PyObject *r = PyObject_CallFunctionObjArgs(settle, PyTuple_GET_ITEM(entry, 1), PyTuple_GET_ITEM(entry, 2),
                                                       error, NULL);
            Py_DECREF(entry);
            Py_DECREF(error);
            if (r == NULL) return NULL;
            Py_DECREF(r);
        }
    }
    return PyBool_FromLong(progressed);
}

/* finish_one(completions, queue, token, owner, free, event_type) -> True, False or None:
 * ``_Completions._finish_one`` with its query made by the torch extension (relaxed), for a waiter on
 * one op: the entry ``token`` of ``queue`` (entries in the order of their tokens) finished ahead of
 * the ones before it if its event has completed (True), else left queued (False: not completed, or
 * the device is lost, or its query raised and marked it lost); None if it has left the queue. The
 * caller holds ``_passing``, inside ``callbacks_later``. In Python, a ``result()`` after a tiny op
 * makes ~25 Python calls, 7 of them here. */
static PyObject *completions_finish_one(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyLong_Check(args[2]) || !PyList_Check(args[4]) || !PyType_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "finish_one(completions, queue, token: int, owner, free: list, event_type)");
        return NULL;
    }
    PyObject *q = args[1], *owner = args[3], *free_events = args[4], *event_type = args[5];
    long long token = as_long_long(args[2]);
    if (token == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t lo = 0, hi = PyObject_Size(q);
    if (hi < 0) return NULL;
    PyObject *entry = NULL;
    while (lo < hi) {  /* bisect on the entries' tokens */
        Py_ssize_t mid = lo + (hi - lo) / 2;
        PyObject *e = checked_entry(PySequence_GetItem(q, mid));
        if (e == NULL) return NULL;
        long long t = as_long_long(PyTuple_GET_ITEM(e, 0));
        if (t == -1 && PyErr_Occurred()) { Py_DECREF(e); return NULL; }
        if (t == token) { entry = e; lo = mid; break; }
        Py_DECREF(e);
        if (t < token) lo = mid + 1;
        else hi = mid;
    }
    if (entry == NULL) Py_RETURN_NONE;  /* finished already */
    PyObject *lost = owner_lost(owner);
    if (lost != Py_None) {  /* the next pass fails everything, in order */
        Py_DECREF(entry);
        if (lost == NULL) return NULL;
        Py_RETURN_FALSE;
    }
    int done = event_query(PyTuple_GET_ITEM(entry, 1), event_type);
    if (done <= 0) {
        Py_DECREF(entry);
        if (done == 0) Py_RETURN_FALSE;
        PyObject *error = mark_lost(owner);  /* a sticky error surfaces here */
        if (error == NULL) return NULL;
        Py_DECREF(error);
        Py_RETURN_FALSE;
    }
    if (PySequence_DelItem(q, lo) < 0) { Py_DECREF(entry); return NULL; }  /* appends go to the other end */
    int rc = settle_done(entry, free_events, event_type);
    Py_DECREF(entry);
    if (rc < 0) return NULL;
    Py_RETURN_TRUE;
}

/* launch_held(op, deps, stream, host_inputs, fence): ``Runtime._launch`` for a held op of this
 * runtime's device, released (see ``Runtime._release_held``; the caller holds the lock) */
static PyObject *submitter_launch_held(Submitter *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "launch_held(op, deps, stream, host_inputs, fence)");
        return NULL;
    }
    if (Py_TYPE(argv[0]) != sub.op_type) {
        PyErr_SetString(PyExc_TypeError, "launch_held() takes an op of the runtime");
        return NULL;
    }
    Py_ssize_t placed = -1;
    if (argv[2] != Py_None && (placed = PyLong_AsSsize_t(argv[2])) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "launch_held(): a negative stream");
        return NULL;
    }
    int host_inputs = PyObject_IsTrue(argv[3]);
    if (host_inputs < 0) return NULL;
    PyObject *future = admit_and_launch(self, argv[0], argv[1], 0, placed, host_inputs, argv[4]);
    if (future == NULL) return NULL;
    Py_DECREF(future);
    Py_RETURN_NONE;
}

/* let_go(): drop this object's own bound ``finish`` (a reference cycle through itself), once its
 * runtime is closed: the submitter, and the runtime it holds, are then freed by reference counting */
static PyObject *submitter_let_go(Submitter *self, PyObject *unused) {
    Py_CLEAR(self->finish);
    Py_RETURN_NONE;
}

/* setup_copies(copy_fn, h2d, d2h, budget, copy_py, budget_parts): what ``copy`` needs (see
 * seam.use_compiled_submit); ``budget_parts``: None, or ``ByteBudget.compiled_parts()`` */
static PyObject *submitter_setup_copies(Submitter *self, PyObject *args) {
    PyObject *fn, *h2d, *d2h, *budget, *copy_py, *budget_parts;
    if (!PyArg_ParseTuple(args, "OO!O!OOO", &fn, &PyDict_Type, &h2d, &PyDict_Type, &d2h, &budget, &copy_py,
                          &budget_parts))
        return NULL;
    Py_XSETREF(self->copy_py, Py_NewRef(copy_py));
    Py_XSETREF(self->copy_fn, Py_NewRef(fn));
    Py_XSETREF(self->copy_h2d, Py_NewRef(h2d));
    Py_XSETREF(self->copy_d2h, Py_NewRef(d2h));
    Py_XSETREF(self->budget, Py_NewRef(budget));
    Py_CLEAR(self->budget_counts);
    Py_CLEAR(self->budget_lock);
    Py_CLEAR(self->budget_acquire);
    Py_CLEAR(self->budget_release);
    Py_CLEAR(self->budget_held);
    /* the budget's counts, lock and held copies, where they are this module's: counted in C; else
     * (None, or another budget's) its methods count */
    if (budget_parts == Py_None) Py_RETURN_NONE;
    if (!PyTuple_Check(budget_parts) || PyTuple_GET_SIZE(budget_parts) != 3) {
        PyErr_SetString(PyExc_TypeError, "setup_copies: budget_parts must be None or (counts, lock, held)");
        return NULL;
    }
    PyObject *counts = PyTuple_GET_ITEM(budget_parts, 0), *lock = PyTuple_GET_ITEM(budget_parts, 1);
    PyObject *held = PyTuple_GET_ITEM(budget_parts, 2);
    if (Py_TYPE(counts) == budget_counts_type && Py_TYPE(lock) == fast_lock_type && PyDict_CheckExact(held)) {
        self->budget_counts = Py_NewRef(counts);
        self->budget_lock = Py_NewRef(lock);
        self->budget_held = Py_NewRef(held);
        if ((self->budget_acquire = PyObject_GetAttr(lock, s_acquire)) == NULL
                || (self->budget_release = PyObject_GetAttr(lock, s_release)) == NULL)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* ``ByteBudget.acquire(n)`` where the bytes fit at once: 1 (counted); 0 where they do not (the caller
 * calls ``acquire``, which gives back done copies' bytes or waits); -1 with an exception */
static int budget_take(Submitter *self, Py_ssize_t n) {
    BudgetCounts *c = (BudgetCounts *)self->budget_counts;
    if (lock_take(self->budget_lock, self->budget_acquire) < 0) return -1;
    int fits = c->used == 0 || c->used + n <= c->limit;
    if (fits) {
        c->used += n;
        if (c->used > c->peak) c->peak = c->used;
    }
    if (lock_give(self->budget_lock, self->budget_release) < 0) return -1;
    return fits;
}

/* whether a future is done: 1, 0, or -1 (``future.done()``, its state read in C for ours) */
static int future_is_done(PyObject *future) {
    if (Py_TYPE(future) == sub.future_type) {
        PyObject *state = FUTF(future, F_STATE);
        if (state == sub.pending) return 0;
        if (state == sub.finished) return 1;
    }
    PyObject *r = PyObject_CallMethod(future, "done", NULL);
    if (r == NULL) return -1;
    int done = PyObject_IsTrue(r);
    Py_DECREF(r);
    return done;
}

/* ``ByteBudget.hold(future, n, stream)``: 1 held; 0 where the budget's method must (acquirers asleep
 * to wake, or no copies held on that stream yet); -1 with an exception. As the method: the bytes of
 * up to two done copies at the stream's head come back first (a little per copy). */
static int budget_hold(Submitter *self, PyObject *future, Py_ssize_t n, PyObject *stream) {
    BudgetCounts *c = (BudgetCounts *)self->budget_counts;
    PyObject *ref = PyWeakref_NewRef(future, NULL);
    if (ref == NULL) return -1;
    PyObject *size = PyLong_FromSsize_t(n);
    PyObject *entry = size != NULL ? PyTuple_Pack(2, ref, size) : NULL;
    Py_DECREF(ref);
    Py_XDECREF(size);
    if (entry == NULL) return -1;
    if (lock_take(self->budget_lock, self->budget_acquire) < 0) { Py_DECREF(entry); return -1; }
    int rc = 0;
    PyObject *held = c->waiting ? NULL : PyDict_GetItemWithError(self->budget_held, stream);
    if (held == NULL || Py_TYPE(held) != sub.deque_type) {
        rc = PyErr_Occurred() ? -1 : 0;
        goto unlock;
    }
    Py_INCREF(held);
    for (int k = 0; k < 2 && Py_SIZE(held) > 0 && rc == 0; k++) {
        PyObject *head = PySequence_GetItem(held, 0);
        if (head == NULL || !PyTuple_Check(head) || PyTuple_GET_SIZE(head) != 2) {
            if (head != NULL) PyErr_SetString(PyExc_TypeError, "a held copy is (weakref, nbytes)");
            Py_XDECREF(head);
            rc = -1;
            break;
        }
        PyObject *f = Py_XNewRef(PyWeakref_GetObject(PyTuple_GET_ITEM(head, 0)));  /* None once freed */
        int done = f == NULL ? -1 : f == Py_None ? 1 : future_is_done(f);
        Py_XDECREF(f);
        Py_ssize_t bytes = done == 1 ? PyLong_AsSsize_t(PyTuple_GET_ITEM(head, 1)) : 0;
        Py_DECREF(head);
        if (done < 0 || (bytes == -1 && PyErr_Occurred())) { rc = -1; break; }
        if (!done) break;  /* the oldest still in flight: the rest too (a stream runs in order) */
        PyObject *popped = queue_popleft(held);
        if (popped == NULL) { rc = -1; break; }
        Py_DECREF(popped);
        c->used -= bytes;
    }
    if (rc == 0) {
        PyObject *r = queue_append(held, entry);
        rc = r == NULL ? -1 : 1;
        Py_XDECREF(r);
    }
    Py_DECREF(held);
unlock:
    Py_DECREF(entry);
    if (rc < 0) {
        PyObject *exc = take_exception();
        int given = lock_give(self->budget_lock, self->budget_release);
        if (given < 0) PyErr_Clear();
        restore_exception(exc);
        return -1;
    }
    if (lock_give(self->budget_lock, self->budget_release) < 0) return -1;
    return rc;
}

/* whether two objects' attribute ``attr`` are equal: 1, 0, or -1 with an exception */
static int same_attr(PyObject *a, PyObject *b, PyObject *attr) {
    PyObject *x = PyObject_GetAttr(a, attr);
    if (x == NULL) return -1;
    PyObject *y = PyObject_GetAttr(b, attr);
    if (y == NULL) { Py_DECREF(x); return -1; }
    int same = PyObject_RichCompareBool(x, y, Py_EQ);
    Py_DECREF(x);
    Py_DECREF(y);
    return same;
}

/* ``transfers.copy`` for its common case, compiled: ``copy(dst, src, name)`` between a torch tensor in
 * pinned host memory and one on a device of the runtime with a copy stream, of one dtype and shape.
 * The copy op on that stream, its bytes counted against the byte budget until it completes, as
 * ``transfers._device_copy`` makes it. None where the Python code decides instead: any other copy
 * (pageable memory, numpy, a peer copy, layouts that differ, which it refuses), and inside a
 * recording. 4.3 µs less per 1 KiB copy than the Python path, timed in turns with it. */
static PyObject *copy_pinned(Submitter *self, PyObject *dst, PyObject *src, PyObject *name) {
    int own_accesses = PyCFunction_Check(self->accesses_fn)
        && PyCFunction_GET_FUNCTION(self->accesses_fn) == (PyCFunction)(void (*)(void))accesses_of;
    if (self->copy_fn == NULL || !own_accesses || PyDict_GET_SIZE(self->recordings)) Py_RETURN_NONE;
    PyObject *tensors[] = {dst, src};
    for (int i = 0; i < 2; i++) {  /* torch tensors, whose accesses this module reads */
        PyObject *handler = PyDict_GetItemWithError(state.handlers, (PyObject *)Py_TYPE(tensors[i]));
        if (handler == NULL && PyErr_Occurred()) return NULL;
        if (handler == NULL || handler != state.torch_region) Py_RETURN_NONE;
    }
    PyObject *reads = NULL, *writes = NULL, *accesses = NULL, *nbytes = NULL, *result = NULL;
    if ((reads = PyList_New(1)) == NULL || (writes = PyList_New(1)) == NULL) goto done;
    PyList_SET_ITEM(reads, 0, Py_NewRef(src));
    PyList_SET_ITEM(writes, 0, Py_NewRef(dst));
    PyObject *both[] = {reads, writes};
    if ((accesses = accesses_of(NULL, both, 2)) == NULL) goto done;
    PyObject *read = PyTuple_GET_ITEM(PyList_GET_ITEM(accesses, 0), 0);
    PyObject *written = PyTuple_GET_ITEM(PyList_GET_ITEM(accesses, 1), 0);
    PyObject *src_space = PyTuple_GET_ITEM(read, 0), *dst_space = PyTuple_GET_ITEM(written, 0);
    int in = is_cpu_space(src_space), out = is_cpu_space(dst_space);
    if (in == out) { result = Py_NewRef(Py_None); goto done; }  /* within one memory, or a peer copy */
    PyObject *stream_obj = PyDict_GetItemWithError(in ? self->copy_h2d : self->copy_d2h, in ? dst_space : src_space);
    if (stream_obj == NULL) {  /* a device without copy streams here: the Python code says what to do */
        if (!PyErr_Occurred()) result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t stream = PyLong_AsSsize_t(stream_obj);
    if (stream == -1 && PyErr_Occurred()) goto done;
    if (stream < 0 || stream >= PyList_GET_SIZE(self->streams)) {
        PyErr_Format(PyExc_IndexError, "copy: copy stream %zd out of range", stream);
        goto done;
    }
    if (self->torch != NULL) {  /* the checks in C++ */
        int ok = self->torch->pinned_alike(dst, src, in ? src : dst);
        if (ok != 1) {  /* 0: pageable (staged by the Python code), or layouts that differ (it refuses) */
            if (ok == 0) result = Py_NewRef(Py_None);
            goto done;
        }
    } else {  /* the same through PyTorch's Python bindings */
        PyObject *pinned = PyObject_CallMethodNoArgs(in ? src : dst, s_is_pinned);
        if (pinned == NULL) goto done;
        Py_DECREF(pinned);
        if (pinned != Py_True) { result = Py_NewRef(Py_None); goto done; }  /* staged by the Python code */
        int same = same_attr(dst, src, s_dtype);
        if (same == 1) same = same_attr(dst, src, s_shape);
        if (same != 1) {  /* (0: the Python code raises the error that says what to do) */
            if (same == 0) result = Py_NewRef(Py_None);
            goto done;
        }
    }
    if ((nbytes = PyNumber_Subtract(PyTuple_GET_ITEM(read, 2), PyTuple_GET_ITEM(read, 1))) == NULL) goto done;
    Py_ssize_t n = PyLong_AsSsize_t(nbytes);
    if (n == -1 && PyErr_Occurred()) goto done;
    int counted = self->budget_counts != NULL ? budget_take(self, n) : 0;
    if (counted < 0) goto done;
    PyObject *r;
    if (!counted) {  /* the budget's method: it gives back done copies' bytes, or waits */
        if ((r = PyObject_CallMethodOneArg(self->budget, s_acquire, nbytes)) == NULL) goto done;
        Py_DECREF(r);
    }
    int named = name == Py_None ? 0 : PyObject_IsTrue(name);
    PyObject *future = NULL;
    if (named >= 0) {
        PyObject *call[] = {self->copy_fn, dst, src, reads, writes, named ? name : in ? s_copy_h2d : s_copy_d2h};
        future = submit_with(self, call, 3, s_copy_kwnames, stream, 1);
    }
    if (future == NULL) {  /* not submitted: its bytes back */
        PyObject *exc = take_exception();
        r = PyObject_CallMethodOneArg(self->budget, s_release, nbytes);
        if (r != NULL) {
            Py_DECREF(r);
            restore_exception(exc);
        } else {
            Py_DECREF(exc);
        }
        goto done;
    }
    int held = 0;
    if (PyObject_TypeCheck(future, sub.future_type)) {  /* (else recorded: counted as the graph runs) */
        held = self->budget_counts != NULL ? budget_hold(self, future, n, stream_obj) : 0;
        r = held < 0 ? NULL : held ? Py_NewRef(Py_None)
                                   : PyObject_CallMethodObjArgs(self->budget, s_hold_bytes, future, nbytes, stream_obj, NULL);
    } else {
        r = PyObject_CallMethodOneArg(self->budget, s_release, nbytes);
    }
    if (r == NULL) { Py_DECREF(future); goto done; }
    Py_DECREF(r);
    result = future;
done:
    Py_XDECREF(reads);
    Py_XDECREF(writes);
    Py_XDECREF(accesses);
    Py_XDECREF(nbytes);
    return result;
}

/* ``copy_pinned(dst, src, name)``: the compiled case alone, None where the Python code decides */
static PyObject *submitter_copy_pinned(Submitter *self, PyObject *const *argv, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_pinned(dst, src, name)");
        return NULL;
    }
    return copy_pinned(self, argv[0], argv[1], argv[2]);
}

/* Runtime.copy(dst, src, name=None): the compiled case, else ``transfers.copy`` (``copy_py``) */
static PyObject *submitter_copy(Submitter *self, PyObject *const *argv, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    PyObject *name = nargs == 3 ? argv[2] : Py_None;
    int bad = nargs < 2 || nargs > 3 || nkw > 1 || (nkw == 1 && nargs == 3);
    if (!bad && nkw == 1) {
        bad = !same_str(PyTuple_GET_ITEM(kwnames, 0), s_name);
        name = argv[nargs];
    }
    if (bad) {
        PyErr_SetString(PyExc_TypeError, "copy(dst, src, name=None)");
        return NULL;
    }
    PyObject *future = copy_pinned(self, argv[0], argv[1], name);
    if (future != Py_None) return future;
    Py_DECREF(future);
    if (self->copy_py == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "streamdag: setup_copies() was not called");
        return NULL;
    }
    PyObject *call[] = {self->rt, argv[0], argv[1], name};
    return PyObject_Vectorcall(self->copy_py, call, 4, NULL);
}

static PyMethodDef submitter_methods[] = {
    {"setup_copies", (PyCFunction)submitter_setup_copies, METH_VARARGS,
     "setup_copies(copy_fn, h2d, d2h, budget, copy_py, budget_parts): what copy() needs (copy streams by "
     "device space each way; copy_py: transfers.copy, for every other case; budget_parts: "
     "ByteBudget.compiled_parts(), or None to count through the budget's methods)."},
    {"copy_pinned", (PyCFunction)(void (*)(void))submitter_copy_pinned, METH_FASTCALL,
     "transfers.copy for pinned host memory and a device, compiled; None where the Python code decides."},
    {"copy", (PyCFunction)(void (*)(void))submitter_copy, METH_FASTCALL | METH_KEYWORDS,
     "Runtime.copy, compiled for pinned host memory and a device: see streamdag.Runtime.copy."},
    {"let_go", (PyCFunction)submitter_let_go, METH_NOARGS,
     "Drop the submitter's reference to its own finish, once its runtime is closed."},
    {"submit", (PyCFunction)(void (*)(void))submitter_submit, METH_FASTCALL | METH_KEYWORDS,
     "Runtime.submit, compiled: see streamdag.Runtime.submit."},
    {"submit_nowait", (PyCFunction)(void (*)(void))submitter_submit_nowait, METH_FASTCALL | METH_KEYWORDS,
     "Runtime.submit_nowait, compiled: see streamdag.Runtime.submit_nowait."},
    {"submit_on", (PyCFunction)(void (*)(void))submitter_submit_on, METH_FASTCALL | METH_KEYWORDS,
     "Runtime._submit_on, compiled: an op onto a given stream, ordered on the device only."},
    {"launch_held", (PyCFunction)(void (*)(void))submitter_launch_held, METH_FASTCALL,
     "Runtime._launch for a released held op of the runtime's device (the caller holds the lock)."},
    {"finish", (PyCFunction)(void (*)(void))submitter_finish, METH_FASTCALL,
     "Runtime._finish, compiled for a successful op nobody watches."},
    {NULL}
};

static PyType_Slot submitter_slots[] = {
    {Py_tp_init, submitter_init},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_traverse, submitter_traverse},
    {Py_tp_clear, submitter_clear},
    {Py_tp_dealloc, submitter_dealloc},
    {Py_tp_methods, submitter_methods},
    {Py_tp_doc, "The runtime's submit and finish, compiled (see native/_submit.c)."},
    {0, NULL}
};

static PyType_Spec submitter_spec = {
    "streamdag.native.Submitter", sizeof(Submitter), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, submitter_slots
};

#define SUBMIT_METHODS \
    {"setup_submit", setup_submit, METH_VARARGS, "Hand over Op, Future, Marker, _LAZY, PENDING, FINISHED, finished_ok."}, \
    {"completions_pass", (PyCFunction)(void (*)(void))completions_pass, METH_FASTCALL, \
     "_Completions._pass, compiled for its common case (backends/cuda_completions.py)."}, \
    {"completions_finish_one", (PyCFunction)(void (*)(void))completions_finish_one, METH_FASTCALL, \
     "_Completions._finish_one with the torch extension's relaxed query, compiled (backends/cuda_completions.py)."}, \
    {"note_loss", note_loss, METH_NOARGS, "A device was lost (CudaBackend.lost was set)."}, \
    {"note_losses_of", note_losses_of, METH_O, \
     "note_losses_of(backend_type): its lost notes each loss; until one, it is None without a look-up."},

static int submit_init(PyObject *m) {
#define S(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return -1;
    S(s_acquire, "acquire") S(s_release, "release") S(s_link, "link") S(s_tail, "tail") S(s_place, "place")
    S(s_execute, "execute") S(s_launch, "launch") S(s_event, "event") S(s_wait, "wait") S(s_when_done, "when_done")
    S(s_name_attr, "__name__") S(s_reads, "reads") S(s_writes, "writes") S(s_name, "name")
    S(s_run_on, "run_on") S(s_lost, "lost")
    S(s_index, "index") S(s_append, "append") S(s_set, "set")
    S(s_popleft, "popleft") S(s_timing, "timing") S(s_query, "query")
    S(s_mark_lost, "mark_lost")
    S(s_marker_value, "value") S(s_marker_write, "write") S(s_recycle, "recycle")
    S(s_is_pinned, "is_pinned") S(s_dtype, "dtype") S(s_shape, "shape") S(s_hold_bytes, "hold")
    S(s_copy_h2d, "copy_h2d") S(s_copy_d2h, "copy_d2h")
#undef S
    if ((s_copy_kwnames = PyTuple_Pack(3, s_reads, s_writes, s_name)) == NULL) return -1;
    if ((sub.empty_tuple = PyTuple_New(0)) == NULL || (sub.empty_str = PyUnicode_New(0, 0)) == NULL
            || (sub.empty_list = PyList_New(0)) == NULL || (sub.empty_dict = PyDict_New()) == NULL)
        return -1;
    PyObject *collections = PyImport_ImportModule("collections");
    if (collections == NULL) return -1;
    sub.deque_type = (PyTypeObject *)PyObject_GetAttrString(collections, "deque");
    Py_DECREF(collections);
    if (sub.deque_type == NULL || !PyType_Check(sub.deque_type)
            || (sub.deque_append = PyObject_GetAttr((PyObject *)sub.deque_type, s_append)) == NULL
            || (sub.deque_popleft = PyObject_GetAttr((PyObject *)sub.deque_type, s_popleft)) == NULL)
        return -1;
    for (int f = 0; f < OP_FIELDS; f++) {
        op_fields_members[f] = (PyMemberDef){op_field_names[f], T_OBJECT_EX,
                                             offsetof(OpRecord, fields) + f * sizeof(PyObject *), 0, NULL};
        if ((sub.op_names[f] = PyUnicode_InternFromString(op_field_names[f])) == NULL) return -1;
    }
    for (int f = 0; f < F_FIELDS; f++)
        future_fields_members[f] = (PyMemberDef){future_field_names[f], T_OBJECT_EX,
                                                 offsetof(FutureRecord, fields) + f * sizeof(PyObject *), 0, NULL};
    op_fields_type = (PyTypeObject *)PyType_FromSpec(&op_fields_spec);
    if (op_fields_type == NULL || PyModule_AddObjectRef(m, "OpFields", (PyObject *)op_fields_type) < 0) return -1;
    future_fields_type = (PyTypeObject *)PyType_FromSpec(&future_fields_spec);
    if (future_fields_type == NULL || PyModule_AddObjectRef(m, "FutureFields", (PyObject *)future_fields_type) < 0)
        return -1;
    counters_type = (PyTypeObject *)PyType_FromSpec(&counters_spec);
    if (counters_type == NULL || PyModule_AddObjectRef(m, "Counters", (PyObject *)counters_type) < 0) return -1;
    budget_counts_type = (PyTypeObject *)PyType_FromSpec(&budget_counts_spec);
    if (budget_counts_type == NULL || PyModule_AddObjectRef(m, "BudgetCounts", (PyObject *)budget_counts_type) < 0)
        return -1;
    parts_type = (PyTypeObject *)PyType_FromSpec(&parts_spec);
    if (parts_type == NULL || PyModule_AddObjectRef(m, "Parts", (PyObject *)parts_type) < 0) return -1;
    submitter_type = (PyTypeObject *)PyType_FromSpec(&submitter_spec);
    if (submitter_type == NULL) return -1;
    finish_call_type = (PyTypeObject *)PyType_FromSpec(&finish_call_spec);
    if (finish_call_type == NULL || PyModule_AddObjectRef(m, "FinishCall", (PyObject *)finish_call_type) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "Submitter", (PyObject *)submitter_type);
}
