/* Probe only (scripts/probe_capture_path.py --compiled): the sanitizer's capture_begin common path, compiled.
 * It does what the probe's `py_minimal` side does in Python, so the two differ only by the interpreter:
 * read the process backend, judge the default stream where a judge rules, call the original, take the
 * stack (CAPTURE_STACK_DEPTH frames as code objects and offsets), make a weak reference on the graph with
 * a callback and a record of the capture, tag the graph with it and queue it. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>
#include <stddef.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *original, *proc, *judges, *current_device, *stream_of, *default_of, *tag, *gone, *queue, *ctx;
    PyObject *defaults;
    int depth;
} Wrapper;

static PyObject *s_process, *s_world;

static PyObject *
wrapper_call(PyObject *self_, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Wrapper *self = (Wrapper *)self_;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1) {
        PyErr_SetString(PyExc_TypeError, "capture_begin needs the graph");
        return NULL;
    }
    PyObject *graph = args[0];
    PyObject *pool = nargs > 1 ? args[1] : Py_None;
    PyObject *be = PyObject_GetAttr(self->proc, s_process);
    if (be == NULL) return NULL;
    PyObject *world = PyObject_GetAttr(be, s_world);
    if (world == NULL) { Py_DECREF(be); return NULL; }
    PyObject *device = NULL;
    PyObject *rules = PyDict_GetItemWithError(self->judges, world);  /* borrowed */
    if (rules != NULL && PyObject_IsTrue(rules) == 1) {
        device = PyObject_CallNoArgs(self->current_device);
        if (device == NULL) goto fail;
        PyObject *def = PyDict_GetItemWithError(self->defaults, device);  /* borrowed */
        if (def == NULL && PyErr_Occurred()) goto fail;
        if (def == NULL) {
            PyObject *t = PyObject_CallOneArg(self->default_of, device);
            if (t == NULL) goto fail;
            def = PySequence_GetItem(t, 0);
            Py_DECREF(t);
            if (def == NULL || PyDict_SetItem(self->defaults, device, def) < 0) { Py_XDECREF(def); goto fail; }
            Py_DECREF(def);
        }
        PyObject *cur = PyObject_CallOneArg(self->stream_of, device);
        if (cur == NULL) goto fail;
        PyObject *first = PySequence_GetItem(cur, 0);
        Py_DECREF(cur);
        if (first == NULL) goto fail;
        int same = PyObject_RichCompareBool(first, def, Py_EQ);
        Py_DECREF(first);
        if (same < 0) goto fail;
        if (same) {
            PyErr_SetString(PyExc_RuntimeError, "probe: capture on the default stream");
            goto fail;
        }
    } else if (PyErr_Occurred()) {
        goto fail;
    }
    PyObject *out = PyObject_Vectorcall(self->original, args, nargsf, kwnames);
    if (out == NULL) goto fail;
    Py_DECREF(out);
    if (device == NULL) {
        device = PyObject_CallNoArgs(self->current_device);
        if (device == NULL) goto fail;
    }
    PyObject *frames = PyList_New(0);
    if (frames == NULL) goto fail;
    PyFrameObject *f = PyEval_GetFrame();  /* borrowed: the caller (a C function pushes no frame) */
    Py_XINCREF(f);
    for (int i = 0; f != NULL && i < self->depth; i++) {
        PyCodeObject *code = PyFrame_GetCode(f);
#if PY_VERSION_HEX >= 0x030B0000
        PyObject *lasti = PyLong_FromLong(PyFrame_GetLasti(f));
#else
        PyObject *lasti = PyLong_FromLong(f->f_lasti * 2);  /* Python 3.10: in code units */
#endif
        if (lasti == NULL || PyList_Append(frames, (PyObject *)code) < 0 || PyList_Append(frames, lasti) < 0) {
            Py_DECREF(code); Py_XDECREF(lasti); Py_DECREF(f); Py_DECREF(frames); goto fail;
        }
        Py_DECREF(code);
        Py_DECREF(lasti);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    Py_XDECREF(f);
    PyObject *ref = PyWeakref_NewRef(graph, self->gone);
    if (ref == NULL) { Py_DECREF(frames); goto fail; }
    PyObject *entry = PyTuple_Pack(6, ref, world, pool, device, frames, self->ctx);
    Py_DECREF(ref);
    Py_DECREF(frames);
    if (entry == NULL) goto fail;
    if (PyObject_SetAttr(graph, self->tag, entry) < 0 || PyList_Append(self->queue, entry) < 0) {
        Py_DECREF(entry); goto fail;
    }
    Py_DECREF(entry);
    Py_DECREF(device);
    Py_DECREF(world);
    Py_DECREF(be);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(device);
    Py_DECREF(world);
    Py_DECREF(be);
    return NULL;
}

static void
wrapper_dealloc(Wrapper *self)
{
    Py_XDECREF(self->original); Py_XDECREF(self->proc); Py_XDECREF(self->judges);
    Py_XDECREF(self->current_device); Py_XDECREF(self->stream_of); Py_XDECREF(self->default_of);
    Py_XDECREF(self->tag); Py_XDECREF(self->gone); Py_XDECREF(self->queue); Py_XDECREF(self->ctx);
    Py_XDECREF(self->defaults);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
wrapper_get(PyObject *self, PyObject *obj, PyObject *type)
{   /* a method: bind the graph as the first argument */
    if (obj == NULL || obj == Py_None) { Py_INCREF(self); return self; }
    return PyMethod_New(self, obj);
}

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "probe_compiled_wrapper.Wrapper",
    .tp_basicsize = sizeof(Wrapper),
    .tp_dealloc = (destructor)wrapper_dealloc,
    .tp_vectorcall_offset = offsetof(Wrapper, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_descr_get = wrapper_get,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
};

static PyObject *
make(PyObject *mod, PyObject *args)
{
    Wrapper *w = PyObject_New(Wrapper, &WrapperType);
    if (w == NULL) return NULL;
    w->vectorcall = wrapper_call;
    w->defaults = PyDict_New();
    if (w->defaults == NULL) {
        w->original = w->proc = w->judges = w->current_device = w->stream_of = w->default_of = NULL;
        w->tag = w->gone = w->queue = w->ctx = NULL;
        Py_DECREF(w);
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOi", &w->original, &w->proc, &w->judges, &w->current_device,
                          &w->stream_of, &w->default_of, &w->tag, &w->gone, &w->queue, &w->ctx, &w->depth)) {
        w->original = w->proc = w->judges = w->current_device = w->stream_of = w->default_of = NULL;
        w->tag = w->gone = w->queue = w->ctx = NULL;
        Py_DECREF(w);
        return NULL;
    }
    Py_INCREF(w->original); Py_INCREF(w->proc); Py_INCREF(w->judges); Py_INCREF(w->current_device);
    Py_INCREF(w->stream_of); Py_INCREF(w->default_of); Py_INCREF(w->tag); Py_INCREF(w->gone);
    Py_INCREF(w->queue); Py_INCREF(w->ctx);
    return (PyObject *)w;
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(original, proc, judges, current_device, stream_of, default_of, tag, gone, "
                                 "queue, ctx, depth)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "probe_compiled_wrapper", NULL, -1, methods};

PyMODINIT_FUNC
PyInit_probe_compiled_wrapper(void)
{
    if (PyType_Ready(&WrapperType) < 0) return NULL;
    s_process = PyUnicode_InternFromString("_process");
    s_world = PyUnicode_InternFromString("world");
    return PyModule_Create(&module);
}
