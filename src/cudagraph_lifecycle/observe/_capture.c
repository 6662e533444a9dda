/* The capture_begin and capture_end wrappers' common paths, and the cache flushes' gate, compiled (observe/compiled.py builds it; wrappers.py has the
 * whole wrapper in Python, which this one calls for everything off the common path).
 *
 * Why C: the wrapper runs right after a model's warm-up has evicted the host's caches, where each Python
 * bytecode and object touched costs microseconds; the same work compiled costs about half (issue 21's probe).
 *
 * The common path: a graph of a known world, no pool or a pool id no dead pool carries, nothing queued, and
 * (where a judge rules) a capture off the default stream. It calls the original, takes the caller's stack,
 * makes the graph's ledger entry (a GraphEntry, its slots set directly), tags the graph with it and queues it,
 * exactly as wrappers.recorder's record does. Anything else goes to the Python wrapper before the original is
 * called, so both paths give the ledger the same entries (tests/test_capture_paths.py compares them).
 * capture_end's common path (the graph's own entry, its pool known) marks the entry captured; the rest is
 * Hooks.ended and Hooks.capture_failed, as in the Python wrapper. A flush passes straight to the original
 * while its gate is disarmed (nothing waits for a flush: torch.cuda.graph flushes twice before each capture),
 * else to the Python wrapper, which disarms the gate when it finds nothing to record. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <structmember.h>
#include <stddef.h>

/* the GraphEntry slots this path sets, in this order (ledger.GraphEntry.__slots__ names them) */
enum { S_GID, S_WORLD, S_POOL, S_DEVICE, S_FRAMES, S_SCOPE, S_TEST, S_GENERATION, S_SEQ, S_CAPTURED, S_REPLAYS,
       S_ALIVE, S_COUNTED, N_SLOTS };
static const char *slot_names[N_SLOTS] = {"gid", "world", "pool_id", "device", "frames", "scope", "test",
                                          "generation", "seq", "captured", "replays", "alive", "counted"};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;  /* functools.update_wrapper's attributes (__wrapped__, __name__, ...) */
    /* what the Python wrapper reads, bound once (the ledger's containers are cleared in place, never rebound) */
    PyObject *original, *fallback, *proc, *backend_of, *current_device, *device_of, *stream_of, *default_of,
        *on_default, *judges, *dead_ids, *pending_keys, *ledger, *seq_counter, *pending_append, *pending,
        *entry_cls, *gone, *tag, *worlds, *saw, *untagged, *register_, *drain, *begin_failed;
    PyObject *defaults;    /* device -> its default stream's first item (it never changes) */
    PyObject *last_world;  /* the world of the previous capture: the set of worlds is read only on a change */
    Py_ssize_t offsets[N_SLOTS];
    int depth;
    Py_ssize_t compiled_calls, python_calls;
} CaptureBegin;

static PyObject *s_process, *s_world, *s_scope, *s_test, *s_generation, *s_seq, *s_pool, *zero_pair, *zero;

static inline void
set_slot(PyObject *o, Py_ssize_t offset, PyObject *v)  /* steals v */
{
    PyObject **p = (PyObject **)((char *)o + offset);
    PyObject *old = *p;
    *p = v;
    Py_XDECREF(old);
}

static inline int
get_optional_attr(PyObject *o, PyObject *name, PyObject **result)
{
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(o, name, result);
#else
    return _PyObject_LookupAttr(o, name, result);
#endif
}

/* The caller's stack as Stack keeps it: [code, offset, code, offset, ...], `depth` frames at most. */
static PyObject *
take_frames(int depth)
{
    PyObject *items[2 * 64];
    Py_ssize_t n = 0;
    if (depth > 64) depth = 64;
    PyFrameObject *f = PyEval_GetFrame();  /* borrowed: the caller's (a C function pushes no frame) */
    Py_XINCREF(f);
    for (int i = 0; f != NULL && i < depth; i++) {
#if PY_VERSION_HEX >= 0x030B0000
        PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(f));
#else
        PyObject *lasti = PyLong_FromLong(f->f_lasti < 0 ? -1 : f->f_lasti * 2);  /* f.f_lasti: in bytes */
#endif
        if (lasti == NULL) {
            Py_DECREF(f);
            goto fail;
        }
        items[n++] = (PyObject *)PyFrame_GetCode(f);
        items[n++] = lasti;
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    PyObject *frames = PyList_New(n);
    if (frames == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(frames, i, items[i]);
    return frames;
fail:
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(items[i]);
    return NULL;
}

/* wrappers.recorder's record: the graph's new entry, or NULL with an error set */
static PyObject *
record(CaptureBegin *self, PyObject *graph, PyObject *be, PyObject *world, PyObject *device, PyObject *pool,
       PyObject *frames)
{
    PyObject *call_args[2] = {graph, self->gone};
    PyObject *g = PyObject_Vectorcall(self->entry_cls, call_args, 2, NULL);
    if (g == NULL) return NULL;
    PyObject *seq = PyIter_Next(self->seq_counter);
    if (seq == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the ledger's sequence counter ended");
        goto fail;
    }
    if (PyObject_SetAttr(self->ledger, s_seq, seq) < 0) {
        Py_DECREF(seq);
        goto fail;
    }
    Py_INCREF(seq);
    set_slot(g, self->offsets[S_SEQ], seq);
    set_slot(g, self->offsets[S_GID], seq);
    Py_INCREF(world);
    set_slot(g, self->offsets[S_WORLD], world);
    Py_INCREF(pool);
    set_slot(g, self->offsets[S_POOL], pool);
    Py_INCREF(device);
    set_slot(g, self->offsets[S_DEVICE], device);
    Py_INCREF(frames);
    set_slot(g, self->offsets[S_FRAMES], frames);
    PyObject *v = PyObject_GetAttr(self->ledger, s_scope);
    if (v == NULL) goto fail;
    set_slot(g, self->offsets[S_SCOPE], v);
    if ((v = PyObject_GetAttr(self->ledger, s_test)) == NULL) goto fail;
    set_slot(g, self->offsets[S_TEST], v);
    if ((v = PyObject_GetAttr(self->ledger, s_generation)) == NULL) goto fail;
    set_slot(g, self->offsets[S_GENERATION], v);
    set_slot(g, self->offsets[S_CAPTURED], Py_NewRef(Py_False));
    set_slot(g, self->offsets[S_COUNTED], Py_NewRef(Py_False));
    set_slot(g, self->offsets[S_ALIVE], Py_NewRef(Py_True));
    set_slot(g, self->offsets[S_REPLAYS], Py_NewRef(zero));

    PyObject *old;
    if (get_optional_attr(graph, self->tag, &old) < 0) goto fail;
    if (PyObject_SetAttr(graph, self->tag, g) < 0) {
        Py_XDECREF(old);
        if (!PyErr_ExceptionMatches(PyExc_AttributeError) && !PyErr_ExceptionMatches(PyExc_TypeError)) goto fail;
        PyErr_Clear();  /* a graph that takes no attribute: tagged and counted at once, in Python */
        PyObject *r = PyObject_CallFunctionObjArgs(self->untagged, graph, g, NULL);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    } else {
        PyObject *item;
        if (old != NULL && Py_TYPE(old) == (PyTypeObject *)self->entry_cls) {  /* a graph captured again */
            item = Py_BuildValue("(O(OO))", self->register_, g, old);
            if (item == NULL) {
                Py_DECREF(old);
                goto fail;
            }
        } else {
            item = Py_NewRef(g);
        }
        Py_XDECREF(old);
        PyObject *r = PyObject_CallOneArg(self->pending_append, item);
        Py_DECREF(item);
        if (r == NULL) goto fail;
        Py_DECREF(r);
        Py_ssize_t queued = PyObject_Size(self->pending);
        if (queued < 0) goto fail;
        if (queued > 256) {  /* a process that only captures must not grow the queue for ever */
            if ((r = PyObject_CallNoArgs(self->drain)) == NULL) goto fail;
            Py_DECREF(r);
        }
    }
    if (world != self->last_world) {
        int seen = PySet_Contains(self->worlds, world);
        if (seen < 0) goto fail;
        if (!seen) {
            PyObject *r = PyObject_CallOneArg(self->saw, be);
            if (r == NULL) goto fail;
            Py_DECREF(r);
        }
        Py_XSETREF(self->last_world, Py_NewRef(world));
    }
    return g;
fail:
    Py_DECREF(g);
    return NULL;
}

/* CaptureBegin.record(graph, be, device, pool, frames): the same entry, for DirectCapture (the runner takes
 * the stack once for all its graphs and judges the pool itself) */
static PyObject *
capture_begin_record(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "record(graph, be, device, pool, frames) takes 5 arguments, %zd given", nargs);
        return NULL;
    }
    PyObject *world = PyObject_GetAttr(args[1], s_world);
    if (world == NULL) return NULL;
    PyObject *g = record((CaptureBegin *)self, args[0], args[1], world, args[2], args[3], args[4]);
    Py_DECREF(world);
    return g;
}

/* The call raised: hand the exception to `hook(graph, ..., exception)` (which never raises), and leave it
 * raised for the caller (torch's error is what the caller must see). */
static void
tell_failure(PyObject *hook, PyObject *graph, PyObject *be, PyObject *pool)
{
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *value = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL) PyException_SetTraceback(value, tb);
#endif
    PyObject *r = be == NULL ? PyObject_CallFunctionObjArgs(hook, graph, value, NULL)
                             : PyObject_CallFunctionObjArgs(hook, graph, be, pool, value, NULL);
    Py_XDECREF(r);
    PyErr_Clear();
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(value);
#else
    PyErr_Restore(type, value, tb);
#endif
}

static PyObject *
fall_back(CaptureBegin *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    self->python_calls++;
    return PyObject_Vectorcall(self->fallback, args, nargsf, kwnames);
}

static PyObject *
device_now(CaptureBegin *self, PyObject *graph)
{
    return self->current_device != Py_None ? PyObject_CallNoArgs(self->current_device)
                                           : PyObject_CallOneArg(self->device_of, graph);
}

/* Whether a capture begun now would be on its device's default stream: 1, 0, or -1 with an error set. */
static int
on_default_stream(CaptureBegin *self, PyObject *graph, PyObject *device)
{
    if (self->stream_of == Py_None) {
        if (self->on_default == Py_None) return 0;
        PyObject *r = PyObject_CallOneArg(self->on_default, graph);
        if (r == NULL) return -1;
        int yes = PyObject_IsTrue(r);
        Py_DECREF(r);
        return yes;
    }
    PyObject *def = PyDict_GetItemWithError(self->defaults, device);  /* borrowed */
    if (def == NULL) {
        if (PyErr_Occurred()) return -1;
        PyObject *t = PyObject_CallOneArg(self->default_of, device);
        if (t == NULL) return -1;
        def = PySequence_GetItem(t, 0);
        Py_DECREF(t);
        if (def == NULL) return -1;
        int rc = PyDict_SetItem(self->defaults, device, def);
        Py_DECREF(def);  /* the dict keeps it */
        if (rc < 0) return -1;
    }
    PyObject *cur = PyObject_CallOneArg(self->stream_of, device);
    if (cur == NULL) return -1;
    PyObject *first = PySequence_GetItem(cur, 0);
    Py_DECREF(cur);
    if (first == NULL) return -1;
    int same = PyObject_RichCompareBool(first, def, Py_EQ);
    Py_DECREF(first);
    return same;
}

static PyObject *
capture_begin_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CaptureBegin *self = (CaptureBegin *)self_;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || nargs > 2) return fall_back(self, args, nargsf, kwnames);
    PyObject *graph = args[0];
    PyObject *pool = nargs > 1 ? args[1] : Py_None;  /* what the ledger records (the original gets the args) */
    if (kwnames != NULL) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kwnames); i++) {
            PyObject *name = PyTuple_GET_ITEM(kwnames, i);
            if (name == s_pool || PyUnicode_Compare(name, s_pool) == 0) {
                if (nargs > 1) return fall_back(self, args, nargsf, kwnames);  /* (given twice: Python's error) */
                pool = args[nargs + i];
            }
        }
    }
    PyObject *be = NULL, *world = NULL, *device = NULL, *frames = NULL;
    if (self->proc != Py_None) {
        be = PyObject_GetAttr(self->proc, s_process);
        if (be == NULL) return NULL;
        if (be == Py_None) Py_CLEAR(be);
    }
    if (be == NULL) {
        be = PyObject_CallOneArg(self->backend_of, graph);
        if (be == NULL) return NULL;
    }
    if (be == Py_None) goto python;  /* no world answers for it: the Python wrapper calls the original */
    if (pool != Py_None) {
        if (!PyTuple_CheckExact(pool)) goto python;
        int unpooled = PyObject_RichCompareBool(pool, zero_pair, Py_EQ);
        if (unpooled < 0) goto fail;
        if (unpooled) {
            pool = Py_None;
        } else {
            if (PySet_GET_SIZE(self->pending_keys)) goto python;  /* an event is queued: maybe about this pool */
            if (PyDict_GET_SIZE(self->dead_ids)) {
                int dead = PyDict_Contains(self->dead_ids, pool);
                if (dead < 0) goto fail;
                if (dead) goto python;  /* a dead pool carries this id: judged in Python */
            }
        }
    }
    world = PyObject_GetAttr(be, s_world);
    if (world == NULL) goto fail;
    if (PyDict_GET_SIZE(self->judges)) {
        PyObject *rules = PyDict_GetItemWithError(self->judges, world);  /* borrowed */
        if (rules == NULL && PyErr_Occurred()) goto fail;
        if (rules != NULL) {
            int ruled = PyObject_IsTrue(rules);
            if (ruled < 0) goto fail;
            if (ruled) {
                if ((device = device_now(self, graph)) == NULL) goto fail;
                int on_default = on_default_stream(self, graph, device);
                if (on_default < 0) goto fail;
                if (on_default) goto python;  /* recorded and judged in Python, before torch sees it */
            }
        }
    }
    PyObject *out = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (out == NULL) {  /* torch's refusal of the default stream poisons random ops: recorded in Python */
        tell_failure(self->begin_failed, graph, be, pool);
        goto fail;
    }
    Py_DECREF(out);
    self->compiled_calls++;
    if (device == NULL && (device = device_now(self, graph)) == NULL) goto fail;
    if ((frames = take_frames(self->depth)) == NULL) goto fail;
    {
        PyObject *g = record(self, graph, be, world, device, pool, frames);
        if (g == NULL) goto fail;
        Py_DECREF(g);
    }
    Py_DECREF(frames);
    Py_DECREF(device);
    Py_DECREF(world);
    Py_DECREF(be);
    Py_RETURN_NONE;
python:
    Py_XDECREF(device);
    Py_XDECREF(world);
    Py_DECREF(be);
    return fall_back(self, args, nargsf, kwnames);
fail:
    Py_XDECREF(frames);
    Py_XDECREF(device);
    Py_XDECREF(world);
    Py_XDECREF(be);
    return NULL;
}

#define FIELDS(X) X(original) X(fallback) X(proc) X(backend_of) X(current_device) X(device_of) X(stream_of) \
    X(default_of) X(on_default) X(judges) X(dead_ids) X(pending_keys) X(ledger) X(seq_counter) X(pending_append) \
    X(pending) X(entry_cls) X(gone) X(tag) X(worlds) X(saw) X(untagged) X(register_) X(drain) X(begin_failed) \
    X(defaults) X(last_world) X(dict)

static int
capture_begin_traverse(CaptureBegin *self, visitproc visit, void *arg)
{
#define VISIT(f) Py_VISIT(self->f);
    FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int
capture_begin_clear(CaptureBegin *self)
{
#define CLEAR(f) Py_CLEAR(self->f);
    FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void
capture_begin_dealloc(CaptureBegin *self)
{
    PyObject_GC_UnTrack(self);
    capture_begin_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
method_get(PyObject *self, PyObject *obj, PyObject *type)
{   /* a method, like the Python function it stands for: bound to the graph it is read from */
    if (obj == NULL) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* The slot offsets of GraphEntry, read from its member descriptors: 0, or -1 with an error set. */
static int
read_offsets(PyObject *entry_cls, Py_ssize_t *offsets)
{
    if (!PyType_Check(entry_cls)) {
        PyErr_SetString(PyExc_TypeError, "entry_cls must be ledger.GraphEntry");
        return -1;
    }
    PyTypeObject *cls = (PyTypeObject *)entry_cls;
    if (!PyType_IsSubtype(cls, &_PyWeakref_RefType)) {
        PyErr_SetString(PyExc_TypeError, "entry_cls must be a subclass of weakref.ref");
        return -1;
    }
    for (int i = 0; i < N_SLOTS; i++) {
        PyObject *d = PyDict_GetItemString(cls->tp_dict, slot_names[i]);  /* borrowed */
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type) {
            PyErr_Format(PyExc_TypeError, "entry_cls has no slot %s", slot_names[i]);
            return -1;
        }
        PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
        if (m->type != T_OBJECT_EX || (m->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError, "entry_cls's slot %s is not a writable object slot", slot_names[i]);
            return -1;
        }
        offsets[i] = m->offset;
    }
    return 0;
}

static PyObject *capture_begin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs);

static PyMemberDef capture_begin_members[] = {
    {"compiled_calls", T_PYSSIZET, offsetof(CaptureBegin, compiled_calls), READONLY,
     "captures that took the compiled path"},
    {"python_calls", T_PYSSIZET, offsetof(CaptureBegin, python_calls), READONLY,
     "calls handed to the Python wrapper (off the common path)"},
    {"__dictoffset__", T_PYSSIZET, offsetof(CaptureBegin, dict), READONLY},
    {NULL},
};

static PyMethodDef capture_begin_methods[] = {
    {"record", (PyCFunction)(void (*)(void))capture_begin_record, METH_FASTCALL,
     "record(graph, be, device, pool, frames): the entry of a capture begun now, as wrappers.recorder makes it"},
    {NULL},
};

static PyGetSetDef capture_begin_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict},
    {NULL},
};

static PyTypeObject CaptureBeginType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudagraph_lifecycle.observe._capture.CaptureBegin",
    .tp_doc = "capture_begin, observed: the common path compiled, the rest through the Python wrapper",
    .tp_basicsize = sizeof(CaptureBegin),
    .tp_dealloc = (destructor)capture_begin_dealloc,
    .tp_vectorcall_offset = offsetof(CaptureBegin, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_dictoffset = offsetof(CaptureBegin, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_members = capture_begin_members,
    .tp_methods = capture_begin_methods,
    .tp_getset = capture_begin_getset,
    .tp_traverse = (traverseproc)capture_begin_traverse,
    .tp_clear = (inquiry)capture_begin_clear,
    .tp_new = capture_begin_new,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_GC,
};

static PyObject *
capture_begin_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", "fallback", "proc", "backend_of", "current_device", "device_of",
                            "stream_of", "default_of", "on_default", "judges", "dead_ids", "pending_keys",
                            "ledger", "seq_counter", "pending", "entry_cls", "gone", "tag", "worlds", "saw",
                            "untagged", "register", "drain", "begin_failed", "depth", NULL};
    PyObject *o[24];
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOOOOOOO!O!O!OOOOOUO!OOOOOi", names, &o[0], &o[1], &o[2],
                                     &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &PyDict_Type, &o[9], &PyDict_Type,
                                     &o[10], &PySet_Type, &o[11], &o[12], &o[13], &o[14], &o[15], &o[16], &o[17],
                                     &PySet_Type, &o[18], &o[19], &o[20], &o[21], &o[22], &o[23], &depth))
        return NULL;
    CaptureBegin *self = (CaptureBegin *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = capture_begin_call;
    PyObject **fields[24] = {&self->original, &self->fallback, &self->proc, &self->backend_of,
                             &self->current_device, &self->device_of, &self->stream_of, &self->default_of,
                             &self->on_default, &self->judges, &self->dead_ids, &self->pending_keys,
                             &self->ledger, &self->seq_counter, &self->pending, &self->entry_cls, &self->gone,
                             &self->tag, &self->worlds, &self->saw, &self->untagged, &self->register_,
                             &self->drain, &self->begin_failed};
    for (int i = 0; i < 24; i++) *fields[i] = Py_NewRef(o[i]);
    self->depth = depth;
    if (!PyDict_CheckExact(self->judges) || !PyDict_Check(self->dead_ids) || !PySet_CheckExact(self->pending_keys)) {
        PyErr_SetString(PyExc_TypeError, "judges and dead_ids must be dicts, pending_keys a set");
        goto fail;
    }
    if ((self->defaults = PyDict_New()) == NULL) goto fail;
    if ((self->pending_append = PyObject_GetAttrString(self->pending, "append")) == NULL) goto fail;
    if (read_offsets(self->entry_cls, self->offsets) < 0) goto fail;
    return (PyObject *)self;
fail:
    Py_DECREF(self);
    return NULL;
}

/* capture_end --------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *original, *capture_failed, *ended, *entry_cls, *tag, *ledger;
    Py_ssize_t offsets[N_SLOTS];
    Py_ssize_t compiled_calls, python_calls;
} CaptureEnd;

static PyObject *
capture_end_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CaptureEnd *self = (CaptureEnd *)self_;
    if (PyVectorcall_NARGS(nargsf) < 1) return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    PyObject *graph = args[0];
    PyObject *out = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (out == NULL) {  /* on failure the graph keeps its references through reset: recorded in Python */
        tell_failure(self->capture_failed, graph, NULL, NULL);
        return NULL;
    }
    Py_DECREF(out);
    PyObject *g;
    if (get_optional_attr(graph, self->tag, &g) < 0) return NULL;
    if (g != NULL && Py_TYPE(g) == (PyTypeObject *)self->entry_cls) {
        PyObject *pool = *(PyObject **)((char *)g + self->offsets[S_POOL]);
        PyObject *generation = *(PyObject **)((char *)g + self->offsets[S_GENERATION]);
        PyObject *now = PyObject_GetAttr(self->ledger, s_generation);
        if (now == NULL) {
            Py_DECREF(g);
            return NULL;
        }
        int same = generation == NULL ? 0 : PyObject_RichCompareBool(generation, now, Py_EQ);
        Py_DECREF(now);
        if (same < 0) {
            Py_DECREF(g);
            return NULL;
        }
        if (same && pool != NULL && pool != Py_None) {  /* its pool known since capture_begin */
            set_slot(g, self->offsets[S_CAPTURED], Py_NewRef(Py_True));
            Py_DECREF(g);
            self->compiled_calls++;
            Py_RETURN_NONE;
        }
    }
    Py_XDECREF(g);
    self->python_calls++;  /* no entry of its own here, an entry of before a fork, or a pool learnt only now */
    PyObject *r = PyObject_CallOneArg(self->ended, graph);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE;
}

static int
capture_end_traverse(CaptureEnd *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->capture_failed);
    Py_VISIT(self->ended);
    Py_VISIT(self->entry_cls);
    Py_VISIT(self->tag);
    Py_VISIT(self->ledger);
    return 0;
}

static int
capture_end_clear(CaptureEnd *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->capture_failed);
    Py_CLEAR(self->ended);
    Py_CLEAR(self->entry_cls);
    Py_CLEAR(self->tag);
    Py_CLEAR(self->ledger);
    return 0;
}

static void
capture_end_dealloc(CaptureEnd *self)
{
    PyObject_GC_UnTrack(self);
    capture_end_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
capture_end_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", "capture_failed", "ended", "entry_cls", "tag", "ledger", NULL};
    PyObject *o[6];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOUO", names, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5]))
        return NULL;
    CaptureEnd *self = (CaptureEnd *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = capture_end_call;
    PyObject **fields[6] = {&self->original, &self->capture_failed, &self->ended, &self->entry_cls, &self->tag,
                            &self->ledger};
    for (int i = 0; i < 6; i++) *fields[i] = Py_NewRef(o[i]);
    if (read_offsets(self->entry_cls, self->offsets) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static PyMemberDef capture_end_members[] = {
    {"compiled_calls", T_PYSSIZET, offsetof(CaptureEnd, compiled_calls), READONLY,
     "captures ended on the compiled path"},
    {"python_calls", T_PYSSIZET, offsetof(CaptureEnd, python_calls), READONLY,
     "ends handed to Hooks.ended (off the common path)"},
    {"__dictoffset__", T_PYSSIZET, offsetof(CaptureEnd, dict), READONLY},
    {NULL},
};

static PyTypeObject CaptureEndType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudagraph_lifecycle.observe._capture.CaptureEnd",
    .tp_doc = "capture_end, observed: the common path compiled, the rest through Hooks",
    .tp_basicsize = sizeof(CaptureEnd),
    .tp_dealloc = (destructor)capture_end_dealloc,
    .tp_vectorcall_offset = offsetof(CaptureEnd, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_dictoffset = offsetof(CaptureEnd, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_members = capture_end_members,
    .tp_getset = capture_begin_getset,
    .tp_traverse = (traverseproc)capture_end_traverse,
    .tp_clear = (inquiry)capture_end_clear,
    .tp_new = capture_end_new,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_GC,
};

/* a cache flush --------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
    PyObject *original, *slow;  /* slow: wrappers.flush's Python wrapper, which shares this gate */
    char armed;
    Py_ssize_t compiled_calls, python_calls;
} FlushGate;

static PyObject *
flush_gate_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    FlushGate *self = (FlushGate *)self_;
    if (!self->armed || self->slow == NULL || self->slow == Py_None) {  /* nothing waits for a flush */
        self->compiled_calls++;
        return PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    }
    self->python_calls++;
    return PyObject_Vectorcall(self->slow, args, nargsf, kwnames);
}

static PyObject *
flush_gate_arm(PyObject *self, PyObject *unused)
{
    ((FlushGate *)self)->armed = 1;
    Py_RETURN_NONE;
}

static int
flush_gate_traverse(FlushGate *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    Py_VISIT(self->original);
    Py_VISIT(self->slow);
    return 0;
}

static int
flush_gate_clear(FlushGate *self)
{
    Py_CLEAR(self->dict);
    Py_CLEAR(self->original);
    Py_CLEAR(self->slow);
    return 0;
}

static void
flush_gate_dealloc(FlushGate *self)
{
    PyObject_GC_UnTrack(self);
    flush_gate_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
flush_gate_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"original", NULL};
    PyObject *original;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O", names, &original)) return NULL;
    FlushGate *self = (FlushGate *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = flush_gate_call;
    self->original = Py_NewRef(original);
    self->armed = 1;
    return (PyObject *)self;
}

static PyMethodDef flush_gate_methods[] = {
    {"arm", flush_gate_arm, METH_NOARGS, "something may wait for a flush: the next one goes to the slow path"},
    {NULL},
};

static PyMemberDef flush_gate_members[] = {
    {"armed", T_BOOL, offsetof(FlushGate, armed), 0, "a flush may have something to record"},
    {"slow", T_OBJECT, offsetof(FlushGate, slow), 0, "the Python wrapper an armed flush goes to"},
    {"compiled_calls", T_PYSSIZET, offsetof(FlushGate, compiled_calls), READONLY,
     "flushes passed straight to the original"},
    {"python_calls", T_PYSSIZET, offsetof(FlushGate, python_calls), READONLY, "flushes handed to the slow path"},
    {"__dictoffset__", T_PYSSIZET, offsetof(FlushGate, dict), READONLY},
    {NULL},
};

static PyTypeObject FlushGateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudagraph_lifecycle.observe._capture.FlushGate",
    .tp_doc = "a cache flush, observed: straight to the original while nothing waits for a flush",
    .tp_basicsize = sizeof(FlushGate),
    .tp_dealloc = (destructor)flush_gate_dealloc,
    .tp_vectorcall_offset = offsetof(FlushGate, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_dictoffset = offsetof(FlushGate, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_methods = flush_gate_methods,
    .tp_members = flush_gate_members,
    .tp_getset = capture_begin_getset,
    .tp_traverse = (traverseproc)flush_gate_traverse,
    .tp_clear = (inquiry)flush_gate_clear,
    .tp_new = flush_gate_new,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_GC,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cudagraph_lifecycle.observe._capture",
    "The capture_begin wrapper's common path, compiled (see observe/compiled.py).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__capture(void)
{
    if (PyType_Ready(&CaptureBeginType) < 0 || PyType_Ready(&CaptureEndType) < 0 || PyType_Ready(&FlushGateType) < 0)
        return NULL;
    s_process = PyUnicode_InternFromString("_process");
    s_world = PyUnicode_InternFromString("world");
    s_scope = PyUnicode_InternFromString("scope");
    s_test = PyUnicode_InternFromString("test");
    s_generation = PyUnicode_InternFromString("generation");
    s_seq = PyUnicode_InternFromString("seq");
    s_pool = PyUnicode_InternFromString("pool");
    zero = PyLong_FromLong(0);
    zero_pair = Py_BuildValue("(ii)", 0, 0);
    if (!s_process || !s_world || !s_scope || !s_test || !s_generation || !s_seq || !s_pool || !zero || !zero_pair)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObject(m, "CaptureBegin", Py_NewRef((PyObject *)&CaptureBeginType)) < 0) {
        Py_DECREF((PyObject *)&CaptureBeginType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "CaptureEnd", Py_NewRef((PyObject *)&CaptureEndType)) < 0) {
        Py_DECREF((PyObject *)&CaptureEndType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "FlushGate", Py_NewRef((PyObject *)&FlushGateType)) < 0) {
        Py_DECREF((PyObject *)&FlushGateType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
