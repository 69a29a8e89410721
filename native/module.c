/*
 * The array API as a CPython function: adaptive_llama._adaptive_native.adaptive(x, eps,
 * want_stats) -> (k, kept_mass, entropy), for adaptive_llama.kernel's C backend.
 *
 * Why not ctypes, as for the samplers: a ctypes call plus numpy's `x.ctypes.data` cost about
 * 4 us, which is 0.05x of a softmax at V 32k; this entry reads the array through the buffer
 * protocol and keeps each thread's workspace in C, for well under 1 us. It reads only a
 * non-empty 1-D contiguous float32 or float64 buffer in this machine's byte order and raises
 * TypeError for anything else (kernel/choice.py then converts the input); the values are the
 * kernel's business, and kernel/choice.py turns its codes into exceptions.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>

#include "adaptive.h"

/* One workspace per thread (a call writes into it), freed when the thread ends. */
static pthread_key_t workspace_key;
static pthread_once_t workspace_key_once = PTHREAD_ONCE_INIT;

static void free_workspace(void *ws) { al_workspace_free(ws); }
static void make_workspace_key(void) { pthread_key_create(&workspace_key, free_workspace); }

static al_workspace *thread_workspace(void) {
    pthread_once(&workspace_key_once, make_workspace_key);
    al_workspace *ws = pthread_getspecific(workspace_key);
    if (!ws && (ws = al_workspace_new()) && pthread_setspecific(workspace_key, ws) != 0) {
        al_workspace_free(ws);
        ws = NULL;
    }
    return ws;
}

/* 'f' or 'd' for a buffer format naming native float32 or float64 (numpy writes "f"; arrays
 * over ctypes memory, such as llama.cpp's logits, say "<f"), else 0. */
static char float_format(const char *format) {
    if (!format) return 0;
    const char order = format[0];
    const int native_order = order == '@' || order == '=' ||
                             order == (PY_LITTLE_ENDIAN ? '<' : '>') ||
                             (order == '!' && !PY_LITTLE_ENDIAN);
    if (native_order) format++;
    return (format[0] == 'f' || format[0] == 'd') && !format[1] ? format[0] : 0;
}

/* adaptive(x, eps, want_stats): (k, kept_mass, entropy); k is AL_INVALID_LOGITS for bad
 * values and -1 when memory ran out; kept_mass and entropy are NaN unless want_stats. */
static PyObject *adaptive(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "adaptive(x, eps, want_stats) takes 3 arguments");
        return NULL;
    }
    const double eps = PyFloat_AsDouble(args[1]);
    if (eps == -1.0 && PyErr_Occurred()) return NULL;
    const int want_stats = PyObject_IsTrue(args[2]);
    if (want_stats < 0) return NULL;
    Py_buffer view;
    const char *unreadable =
        "adaptive() needs a non-empty 1-D contiguous float32 or float64 array";
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_SetString(PyExc_TypeError, unreadable); /* whatever the exporter said */
        return NULL;
    }
    const char format = float_format(view.format);
    if (view.ndim != 1 || view.shape[0] < 1 || !format) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_TypeError, unreadable);
        return NULL;
    }
    al_workspace *ws = thread_workspace();
    if (!ws) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    al_stats stats = {.kept_mass = NAN, .entropy = NAN};
    int32_t k;
    const size_t n = (size_t)view.shape[0];
    Py_BEGIN_ALLOW_THREADS
    k = format == 'f' ? al_adaptive_f32(view.buf, n, eps, ws, want_stats ? &stats : NULL)
                      : al_adaptive_f64(view.buf, n, eps, ws, want_stats ? &stats : NULL);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("(idd)", (int)k, stats.kept_mass, stats.entropy);
}

static PyMethodDef methods[] = {
    {"adaptive", (PyCFunction)(void (*)(void))adaptive, METH_FASTCALL,
     "adaptive(x, eps, want_stats) -> (k, kept_mass, entropy)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_adaptive_native",
    "adaptive-llama's C kernel (array API; the samplers are reached through ctypes)", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__adaptive_native(void) { return PyModule_Create(&module_def); }
