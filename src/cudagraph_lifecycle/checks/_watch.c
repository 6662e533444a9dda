/* Checked mode's op watch, its per-op path compiled (checks/capture_watch.py has the same watch in Python and
 * builds this one around it: CompiledCaptureWatch).
 *
 * Why C: every op of a watched capture passes through the watch. Each op pays the dispatch mode's own entry
 * (most of the cost, and no watch avoids it) and then the watch's body (walk the arguments, look each storage
 * up, note the output's): compiled, the body costs about half (measured on the CPU; on the H100's host the
 * entry dominates). Only the first look at a storage (a weak reference, its address and size:
 * CaptureWatch._read), an op that raised (CaptureWatch._failed) and the backend's validity probe
 * (CaptureWatch._after, sim only) go back to Python, so both give the same reads, births and offender
 * (tests/test_checks.py compares them).
 *
 * The hook is a method of the mode: torch reads mode.__torch_dispatch__ and requires it bound to the mode, so
 * the type binds like a Python function (tp_descr_get) and reads the watch's containers from the mode's
 * _state tuple: (born set, reads dict, known dict, the validity probe or None). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *ops;          /* dict: op -> (readable name, what to call), shared with the Python watch */
    PyObject *op_of;        /* (op) -> that pair, filling ops */
    PyObject *tensor_type;  /* torch.Tensor */
    PyObject *storage_id;   /* (tensor) -> its storage's identity */
    PyObject *read, *failed, *after;  /* CaptureWatch._read, _failed, _after: called with the mode first */
} Dispatch;

static PyObject *s_state;

/* A storage not born in the capture and not read before: known from an earlier graph of the set, or looked
 * at for the first time (Python). 0, or -1 with an error set. */
static int
read_one(Dispatch *d, PyObject *mode, PyObject *t, PyObject *born, PyObject *reads, PyObject *known,
         PyObject *name)
{
    PyObject *key = PyObject_CallOneArg(d->storage_id, t);
    if (key == NULL) return -1;
    int r = PySet_Contains(born, key);
    if (r == 0) r = PyDict_Contains(reads, key);
    if (r != 0) {
        Py_DECREF(key);
        return r < 0 ? -1 : 0;
    }
    PyObject *seen = PyDict_GetItemWithError(known, key);  /* borrowed */
    if (seen != NULL && PyTuple_Check(seen) && PyTuple_GET_SIZE(seen) > 0) {
        r = PyDict_SetItem(reads, key, PyTuple_GET_ITEM(seen, 0));
        Py_DECREF(key);
        return r;
    }
    if (PyErr_Occurred()) {
        Py_DECREF(key);
        return -1;
    }
    PyObject *args[4] = {mode, t, key, name};
    PyObject *res = PyObject_Vectorcall(d->read, args, 4, NULL);
    Py_DECREF(key);
    if (res == NULL) return -1;
    Py_DECREF(res);
    return 0;
}

/* Every tensor among items (a tuple or list; aten ops nest lists of tensors, not deeper containers of
 * other kinds). */
static int
read_all(Dispatch *d, PyObject *mode, PyObject *items, PyObject *born, PyObject *reads, PyObject *known,
         PyObject *name)
{
    PyObject *seq = PySequence_Fast(items, "the op's arguments");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **item = PySequence_Fast_ITEMS(seq);
    int r = 0;
    for (Py_ssize_t i = 0; i < n && r == 0; i++) {
        PyObject *a = item[i];
        if (PyObject_TypeCheck(a, (PyTypeObject *)d->tensor_type))
            r = read_one(d, mode, a, born, reads, known, name);
        else if (PyList_Check(a) || PyTuple_Check(a))
            r = read_all(d, mode, a, born, reads, known, name);
    }
    Py_DECREF(seq);
    return r;
}

/* The op's outputs: storages born in the capture. */
static int
note_born(Dispatch *d, PyObject *out, PyObject *born)
{
    if (PyObject_TypeCheck(out, (PyTypeObject *)d->tensor_type)) {
        PyObject *key = PyObject_CallOneArg(d->storage_id, out);
        if (key == NULL) return -1;
        int r = PySet_Add(born, key);
        Py_DECREF(key);
        return r;
    }
    if (PyList_Check(out) || PyTuple_Check(out)) {
        Py_ssize_t n = PySequence_Size(out);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *t = PySequence_GetItem(out, i);
            if (t == NULL) return -1;
            int r = note_born(d, t, born);
            Py_DECREF(t);
            if (r < 0) return -1;
        }
    }
    return 0;
}

/* mode.__torch_dispatch__(func, types, args=(), kwargs=None), bound: (mode, func, types[, args[, kwargs]]) */
static PyObject *
dispatch_call(Dispatch *d, PyObject *const *argv, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__ takes its arguments by position");
        return NULL;
    }
    if (nargs < 3 || nargs > 5) {
        PyErr_Format(PyExc_TypeError, "__torch_dispatch__(self, func, types, args=(), kwargs=None): %zd given",
                     nargs);
        return NULL;
    }
    PyObject *mode = argv[0], *func = argv[1];
    PyObject *args = nargs > 3 ? argv[3] : NULL, *kwargs = nargs > 4 ? argv[4] : NULL;
    if (args != NULL && !PyTuple_Check(args)) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__: args must be a tuple");
        return NULL;
    }
    if (kwargs == Py_None || (kwargs != NULL && PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) == 0))
        kwargs = NULL;
    if (kwargs != NULL && !PyDict_Check(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__: kwargs must be a dict or None");
        return NULL;
    }

    PyObject *entry = PyDict_GetItemWithError(d->ops, func);  /* borrowed */
    if (entry != NULL) {
        Py_INCREF(entry);
    } else {
        if (PyErr_Occurred()) return NULL;
        entry = PyObject_CallOneArg(d->op_of, func);
        if (entry == NULL) return NULL;
    }
    PyObject *state = NULL, *out = NULL;
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) {
        PyErr_SetString(PyExc_TypeError, "the watch's op table holds (name, callable) pairs");
        goto done;
    }
    PyObject *name = PyTuple_GET_ITEM(entry, 0), *call = PyTuple_GET_ITEM(entry, 1);
    state = PyObject_GetAttr(mode, s_state);
    if (state == NULL) goto done;
    if (!PyTuple_Check(state) || PyTuple_GET_SIZE(state) != 4) {
        PyErr_SetString(PyExc_TypeError, "CaptureWatch._state is (born, reads, known, invalidated)");
        goto done;
    }
    PyObject *born = PyTuple_GET_ITEM(state, 0), *reads = PyTuple_GET_ITEM(state, 1);
    PyObject *known = PyTuple_GET_ITEM(state, 2), *invalidated = PyTuple_GET_ITEM(state, 3);

    if (args != NULL && read_all(d, mode, args, born, reads, known, name) < 0) goto done;
    if (kwargs != NULL) {
        PyObject *values = PyDict_Values(kwargs);
        if (values == NULL) goto done;
        int r = read_all(d, mode, values, born, reads, known, name);
        Py_DECREF(values);
        if (r < 0) goto done;
    }

    out = args != NULL ? PyObject_Call(call, args, kwargs) : PyObject_VectorcallDict(call, NULL, 0, kwargs);
    if (out == NULL) {
        /* the op raised: note it as the offender (Python: the user's frame), then raise what it raised */
#if PY_VERSION_HEX >= 0x030C0000
        PyObject *raised = PyErr_GetRaisedException();
#else
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
#endif
        PyObject *fargs[2] = {mode, name};
        PyObject *res = PyObject_Vectorcall(d->failed, fargs, 2, NULL);
        if (res == NULL)  /* the op's own error is the one to raise; the watch's is shown, not lost */
            PyErr_WriteUnraisable(d->failed);
        Py_XDECREF(res);
#if PY_VERSION_HEX >= 0x030C0000
        PyErr_SetRaisedException(raised);
#else
        PyErr_Restore(type, value, tb);
#endif
        goto done;
    }
    if (note_born(d, out, born) < 0) goto fail;
    if (invalidated != Py_None) {
        PyObject *aargs[2] = {mode, name};
        PyObject *res = PyObject_Vectorcall(d->after, aargs, 2, NULL);
        if (res == NULL) goto fail;
        Py_DECREF(res);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    Py_XDECREF(state);
    Py_DECREF(entry);
    return out;
}

static PyObject *
method_get(PyObject *self, PyObject *obj, PyObject *type)
{   /* a method, like the Python function it stands for: bound to the mode it is read from */
    if (obj == NULL) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static int
dispatch_traverse(Dispatch *self, visitproc visit, void *arg)
{
    Py_VISIT(self->ops);
    Py_VISIT(self->op_of);
    Py_VISIT(self->tensor_type);
    Py_VISIT(self->storage_id);
    Py_VISIT(self->read);
    Py_VISIT(self->failed);
    Py_VISIT(self->after);
    return 0;
}

static int
dispatch_clear(Dispatch *self)
{
    Py_CLEAR(self->ops);
    Py_CLEAR(self->op_of);
    Py_CLEAR(self->tensor_type);
    Py_CLEAR(self->storage_id);
    Py_CLEAR(self->read);
    Py_CLEAR(self->failed);
    Py_CLEAR(self->after);
    return 0;
}

static void
dispatch_dealloc(Dispatch *self)
{
    PyObject_GC_UnTrack(self);
    dispatch_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
dispatch_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ops", "op_of", "tensor_type", "storage_id", "read", "failed", "after", NULL};
    PyObject *ops, *op_of, *tensor_type, *storage_id, *read, *failed, *after;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!OO!OOOO:Dispatch", kwlist, &PyDict_Type, &ops, &op_of,
                                     &PyType_Type, &tensor_type, &storage_id, &read, &failed, &after))
        return NULL;
    Dispatch *self = (Dispatch *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->vectorcall = (vectorcallfunc)dispatch_call;
    self->ops = Py_NewRef(ops);
    self->op_of = Py_NewRef(op_of);
    self->tensor_type = Py_NewRef(tensor_type);
    self->storage_id = Py_NewRef(storage_id);
    self->read = Py_NewRef(read);
    self->failed = Py_NewRef(failed);
    self->after = Py_NewRef(after);
    return (PyObject *)self;
}

static PyTypeObject DispatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cudagraph_lifecycle.checks._watch.Dispatch",
    .tp_doc = "CaptureWatch.__torch_dispatch__, compiled: the Python watch's helpers for a first look, a raise "
              "and the validity probe",
    .tp_basicsize = sizeof(Dispatch),
    .tp_dealloc = (destructor)dispatch_dealloc,
    .tp_vectorcall_offset = offsetof(Dispatch, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = method_get,
    .tp_traverse = (traverseproc)dispatch_traverse,
    .tp_clear = (inquiry)dispatch_clear,
    .tp_new = dispatch_new,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR | Py_TPFLAGS_HAVE_GC,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cudagraph_lifecycle.checks._watch",
    "Checked mode's op watch, its per-op path compiled (see checks/capture_watch.py).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__watch(void)
{
    if (PyType_Ready(&DispatchType) < 0) return NULL;
    s_state = PyUnicode_InternFromString("_state");
    if (s_state == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Dispatch", (PyObject *)&DispatchType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
