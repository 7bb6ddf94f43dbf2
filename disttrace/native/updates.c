/* The update record's reduction in C (run/record/updates.py): the largest element of |after - before * factor|
 * over two float32 arrays in one pass that writes nothing, where torch needs three (the decay in place, the
 * difference in place, a min-max) and writes the parameter's bytes twice.
 *
 * Exactness: torch's float32 CPU kernels, operation by operation. `before.mul_(factor)` multiplies by the Python
 * float converted to float32 (the operation's compute type) and rounds the product to float32; `sub_` rounds
 * the difference to float32; the largest magnitude is then exact. setup.py compiles this with
 * -ffp-contract=off, so the product is rounded before the subtraction, as torch's separate operations round it.
 * A factor of exactly 1 skips the product, as updates.py skips the decay where there is none.
 * Two results have more than one bit pattern, and both paths write the one given here: a NaN anywhere gives
 * the quiet NaN 0x7ff8000000000000 (torch would keep some input's payload), and no difference at all gives +0.
 *
 * Safety: both arrays through the buffer protocol (C-contiguous, format 'f', one dimension, equal lengths);
 * the loop runs without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

static int take_f32(PyObject *obj, Py_buffer *v, const char *name) {
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (v->ndim != 1 || f[0] != 'f' || f[1] != '\0' || v->itemsize != 4 || ((uintptr_t)v->buf) % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "largest_update: %s: not an aligned 1-D float32 array", name);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

/* one element's term, folded into a running maximum and NaN flag */
static inline void fold(float b, float a, float factor, int scale, float *top, int *nan) {
    float decayed = scale ? b * factor : b;
    float d = fabsf(decayed - a);
    *nan |= d != d;
    *top = d > *top ? d : *top;
}

/* the largest |after[i] - before[i] * factor| (float32 arithmetic), NaN if any is. With SSE2 (every x86-64):
 * eight elements a round in two vectors of running maxima; a single scalar maximum is a chain of
 * compare-and-selects a few cycles an element, which the compiler does not vectorise without fast-math. NaN
 * is tracked apart (d != d; the vector maximum may drop it). The values are the scalar loop's: each element's
 * product and difference are rounded alike, and the maximum of magnitudes does not depend on its order. */
static double largest(const float *before, const float *after, Py_ssize_t n, float factor, int scale) {
    float top = 0.0f;
    int nan = 0;
    Py_ssize_t i = 0;
#if defined(__SSE2__) || defined(_M_X64)
    const __m128 f = _mm_set1_ps(factor), magnitude = _mm_castsi128_ps(_mm_set1_epi32(0x7fffffff));
    __m128 t0 = _mm_setzero_ps(), t1 = _mm_setzero_ps(), bad = _mm_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m128 b0 = _mm_loadu_ps(before + i), b1 = _mm_loadu_ps(before + i + 4);
        if (scale) {
            b0 = _mm_mul_ps(b0, f);
            b1 = _mm_mul_ps(b1, f);
        }
        __m128 d0 = _mm_and_ps(_mm_sub_ps(b0, _mm_loadu_ps(after + i)), magnitude);
        __m128 d1 = _mm_and_ps(_mm_sub_ps(b1, _mm_loadu_ps(after + i + 4)), magnitude);
        bad = _mm_or_ps(bad, _mm_or_ps(_mm_cmpunord_ps(d0, d0), _mm_cmpunord_ps(d1, d1)));
        t0 = _mm_max_ps(t0, d0);
        t1 = _mm_max_ps(t1, d1);
    }
    float lanes[8];
    _mm_storeu_ps(lanes, t0);
    _mm_storeu_ps(lanes + 4, t1);
    for (int k = 0; k < 8; k++)
        top = lanes[k] > top ? lanes[k] : top;
    nan = _mm_movemask_ps(bad) != 0;
#endif
    for (; i < n; i++)
        fold(before[i], after[i], factor, scale, &top, &nan);
    return nan ? NAN : (double)top;
}

PyDoc_STRVAR(largest_update_doc,
             "largest_update(before, after, factor) -> float\n\n"
             "The largest |after - before * factor| of two 1-D float32 arrays of one length, in float32 arithmetic "
             "(the product rounded, then the difference), as a float; factor 1.0 skips the product. NaN if any "
             "element's is NaN (always the quiet NaN 0x7ff8000000000000); +0.0 when all are equal.");

static PyObject *py_largest_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "largest_update: takes before, after, factor");
        return NULL;
    }
    double factor = PyFloat_AsDouble(args[2]);
    if (factor == -1.0 && PyErr_Occurred())
        return NULL;
    Py_buffer b, a;
    if (take_f32(args[0], &b, "before") < 0)
        return NULL;
    if (take_f32(args[1], &a, "after") < 0) {
        PyBuffer_Release(&b);
        return NULL;
    }
    if (a.shape[0] != b.shape[0]) {
        PyErr_Format(PyExc_ValueError, "largest_update: before has %zd elements, after %zd", b.shape[0], a.shape[0]);
        PyBuffer_Release(&b);
        PyBuffer_Release(&a);
        return NULL;
    }
    double out;
    Py_BEGIN_ALLOW_THREADS;
    out = largest((const float *)b.buf, (const float *)a.buf, a.shape[0], (float)factor, factor != 1.0);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&b);
    PyBuffer_Release(&a);
    return PyFloat_FromDouble(out);
}

static PyMethodDef methods[] = {
    {"largest_update", (PyCFunction)(void (*)(void))py_largest_update, METH_FASTCALL, largest_update_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc, "run/record/updates.py's reduction in C (see updates.c).");

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_updates", module_doc, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__updates(void) { return PyModule_Create(&module); }
