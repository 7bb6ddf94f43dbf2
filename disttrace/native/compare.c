/* The column-wise comparison of a block of steps in C: analysis/columnar.py's numpy path (compare, then
 * by_step) as four kernels (in_set, factors, classify, compare_block), so that a diff of any size takes the
 * compiled pass (this module loads in about a millisecond).
 *
 * Exactness: the numpy path's results, operation by operation in the same order, in double (float64),
 * and the same lowering numba gives each operation:
 * - builtin max(a, b) / min(a, b) on floats and ints: b if b > a (b < a) else a (numba's do_minmax: Python's
 *   algorithm, the first argument kept on a NaN);
 * - abs of a float: fabs (numba: math.fabs); sqrt: the correctly rounded square root (llvm.sqrt);
 * - float division under error_model="numpy": IEEE division (x/0 is inf or nan, never an exception);
 * - int64 -> double: the conversion rounding to nearest (sitofp); float32 -> double: exact widening (fpext);
 * - int64 floor division: Python's (floor), int64 addition: two's complement wrap-around (LLVM's add);
 * - a boolean array's byte: true when it is not 0 (numba's BooleanModel.from_data);
 * - np.nan: the quiet NaN 0x7ff8000000000000.
 * setup.py compiles this with -ffp-contract=off (no fused multiply-add) and without -ffast-math.
 *
 * Safety: every array is taken through the buffer protocol (C-contiguous, its format and item size checked)
 * and every length against what the kernel indexes; every index derived from the data (string offsets,
 * shape offsets, sketch rows, phase orders, step starts, the rows already in `first`, `g_best`, `g_ratio`) is
 * checked by passes over whole columns before the loop that uses it (stricter than numba needs in places:
 * offsets must not decrease, a sketch must not be valid past its values), so a hostile store raises
 * ValueError, with the outputs untouched, instead of reading out of bounds. The loops run without the GIL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#endif

/* analysis/tolerance.py's constants (columnar.py checks them against this module's CONSTANTS at import) */
#define TINY 1e-300
#define U32 (1.0 / 16777216.0)         /* 2**-24 */
#define U64 (1.0 / 9007199254740992.0) /* 2**-53 */
#define SKETCH_ROWS 512
#define STAT_CHUNK 128
#define FLOAT64_STATS 16384

/* ------------------------------------------------------------------------------------------------------ */
/* arrays */

enum { T_F64, T_F32, T_BOOL, T_I8, T_U8, T_I32, T_I64, T_U32 };
static const char *const TYPE_NAMES[] = {"float64", "float32", "bool", "int8", "uint8", "int32", "int64", "uint32"};

typedef struct {
    Py_buffer view;
    int held;
    const void *p; /* the data, aligned to its item size (a copy where the buffer was not) */
    void *copy;
    Py_ssize_t len;  /* shape[0] */
    Py_ssize_t len2; /* shape[1] of a 2-D array, else 0 */
} Arr;

static int format_ok(const Py_buffer *v, int type) {
    const char *f = v->format ? v->format : "B";
    if (*f == '@' || *f == '=')
        f++;
#if PY_LITTLE_ENDIAN
    else if (*f == '<')
        f++;
#else
    else if (*f == '>' || *f == '!')
        f++;
#endif
    if (f[0] == '\0' || f[1] != '\0')
        return 0;
    char c = f[0];
    Py_ssize_t size = v->itemsize;
    int is_signed = strchr("hilqn", c) != NULL, is_unsigned = strchr("HILQN", c) != NULL;
    switch (type) {
    case T_F64:
        return c == 'd' && size == 8;
    case T_F32:
        return c == 'f' && size == 4;
    case T_BOOL:
        return c == '?' && size == 1;
    case T_I8:
        return c == 'b' && size == 1;
    case T_U8:
        return c == 'B' && size == 1;
    case T_I32:
        return is_signed && size == 4;
    case T_I64:
        return is_signed && size == 8;
    case T_U32:
        return is_unsigned && size == 4;
    }
    return 0;
}

/* `obj` as a C-contiguous array of `type` and `ndim` dimensions (writable where `out`), else ValueError (a
 * BufferError of the exporter, e.g. not contiguous or read-only, becomes one too; an object without the buffer
 * protocol is a TypeError) */
static int take(PyObject *obj, Arr *a, const char *fn, const char *name, int type, int ndim, int out) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (out ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &a->view, flags) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyObject *t, *v, *tb;
            PyErr_Fetch(&t, &v, &tb);
            PyErr_Format(PyExc_ValueError, "%s: %s: %S", fn, name, v ? v : Py_None);
            Py_XDECREF(t);
            Py_XDECREF(v);
            Py_XDECREF(tb);
        }
        return -1;
    }
    a->held = 1;
    if (a->view.ndim != ndim) {
        PyErr_Format(PyExc_ValueError, "%s: %s: %d dimensions, not %d", fn, name, a->view.ndim, ndim);
        return -1;
    }
    if (!format_ok(&a->view, type)) {
        PyErr_Format(PyExc_ValueError, "%s: %s: format %s (item size %zd), not %s", fn, name,
                     a->view.format ? a->view.format : "B", a->view.itemsize, TYPE_NAMES[type]);
        return -1;
    }
    if (out && a->view.readonly) {
        PyErr_Format(PyExc_ValueError, "%s: %s: read-only", fn, name);
        return -1;
    }
    if (!PyBuffer_IsContiguous(&a->view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s: %s: not C-contiguous", fn, name);
        return -1;
    }
    a->len = ndim >= 1 ? a->view.shape[0] : 1;
    a->len2 = ndim == 2 ? a->view.shape[1] : 0;
    a->p = a->view.buf;
    if (((uintptr_t)a->view.buf) % (uintptr_t)a->view.itemsize != 0 && a->view.len > 0) {
        if (out) {
            PyErr_Format(PyExc_ValueError, "%s: %s: not aligned to its item size", fn, name);
            return -1;
        }
        /* an input at an odd address (an Arrow buffer need not be aligned): read from an aligned copy */
        a->copy = PyMem_Malloc((size_t)a->view.len);
        if (a->copy == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(a->copy, a->view.buf, (size_t)a->view.len);
        a->p = a->copy;
    }
    return 0;
}

static void release(Arr *arrs, int count) {
    for (int i = 0; i < count; i++) {
        if (arrs[i].held)
            PyBuffer_Release(&arrs[i].view);
        PyMem_Free(arrs[i].copy);
        arrs[i].held = 0;
        arrs[i].copy = NULL;
    }
}

static int need_len(const Arr *a, Py_ssize_t n, const char *fn, const char *name) {
    if (a->len != n) {
        PyErr_Format(PyExc_ValueError, "%s: %s: length %zd, not %zd", fn, name, a->len, n);
        return -1;
    }
    return 0;
}

static int check_args(Py_ssize_t nargs, Py_ssize_t want, const char *fn) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", fn, want, nargs);
        return -1;
    }
    return 0;
}

/* a string column's offsets (n + 1 of them): the first not negative, none smaller than the one before, the
 * last within the data; returns -1 if so, else the first offending position */
static Py_ssize_t bad_offsets_i32(const int32_t *o, Py_ssize_t count, Py_ssize_t data_len) {
    if (count == 0)
        return -1;
    if (o[0] < 0)
        return 0;
    for (Py_ssize_t i = 1; i < count; i++)
        if (o[i] < o[i - 1])
            return i;
    return (int64_t)o[count - 1] > (int64_t)data_len ? count - 1 : -1;
}

static Py_ssize_t bad_offsets_i64(const int64_t *o, Py_ssize_t count, Py_ssize_t data_len) {
    if (count == 0)
        return -1;
    if (o[0] < 0)
        return 0;
    for (Py_ssize_t i = 1; i < count; i++)
        if (o[i] < o[i - 1])
            return i;
    return o[count - 1] > (int64_t)data_len ? count - 1 : -1;
}

/* numba's builtin max and min (do_minmax): the second argument where it compares greater (less), else the
 * first, NaN included */
static inline double max_f(double a, double b) { return b > a ? b : a; }
static inline int64_t max_i(int64_t a, int64_t b) { return b > a ? b : a; }
static inline int64_t min_i(int64_t a, int64_t b) { return b < a ? b : a; }

/* Python's (and numba's) floor division, for d >= 1 (no overflow, no division by zero) */
static inline int64_t floordiv_pos(int64_t x, int64_t d) {
    int64_t q = x / d, m = x % d;
    if (m != 0 && ((m < 0) != (d < 0)))
        q -= 1;
    return q;
}

/* int64 addition wrapping around as numba's (LLVM's add without nsw): no signed overflow in C */
static inline int64_t add_wrap(int64_t a, int64_t b) {
    uint64_t s = (uint64_t)a + (uint64_t)b;
    int64_t out;
    memcpy(&out, &s, sizeof out);
    return out;
}

static inline void incr(int64_t *x) { *x = add_wrap(*x, 1); }

/* the correctly rounded square root (IEEE 754, as numba's llvm.sqrt): on x86-64 the SSE2 instruction itself,
 * since C's sqrt also checks its argument to set errno (a sixth of compare_block's time under GCC's default
 * -fmath-errno, which setup.py leaves as it is) */
static inline double sqrt_ieee(double x) {
#if defined(__SSE2__) || defined(_M_X64)
    __m128d v = _mm_set_sd(x);
    return _mm_cvtsd_f64(_mm_sqrt_sd(v, v));
#else
    return sqrt(x);
#endif
}

/* np.nan's bits */
static inline double np_nan(void) {
    const uint64_t bits = UINT64_C(0x7ff8000000000000);
    double out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* ------------------------------------------------------------------------------------------------------ */
/* in_set(offsets, data, set_offsets, set_data, out) */

PyDoc_STRVAR(in_set_doc, "in_set(offsets, data, set_offsets, set_data, out): out[row] = whether the row's string "
                         "(int32 offsets, uint8 data) is one of the set's (int64 offsets, uint8 data), byte "
                         "for byte.");

static PyObject *py_in_set(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char *fn = "in_set";
    Arr a[5];
    memset(a, 0, sizeof a);
    PyObject *ret = NULL;
    if (check_args(nargs, 5, fn) < 0)
        return NULL;
    if (take(args[0], &a[0], fn, "offsets", T_I32, 1, 0) < 0 || take(args[1], &a[1], fn, "data", T_U8, 1, 0) < 0 ||
        take(args[2], &a[2], fn, "set_offsets", T_I64, 1, 0) < 0 ||
        take(args[3], &a[3], fn, "set_data", T_U8, 1, 0) < 0 || take(args[4], &a[4], fn, "out", T_BOOL, 1, 1) < 0)
        goto done;
    Py_ssize_t n = a[4].len, ns = a[2].len - 1;
    if (need_len(&a[0], n + 1, fn, "offsets") < 0)
        goto done;
    const int32_t *off = a[0].p;
    const uint8_t *data = a[1].p, *sdata = a[3].p;
    const int64_t *soff = a[2].p;
    uint8_t *out = a[4].view.buf;
    Py_ssize_t bad = bad_offsets_i32(off, n + 1, a[1].len);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "%s: offsets[%zd] out of order or out of the data's range", fn, bad);
        goto done;
    }
    bad = bad_offsets_i64(soff, a[2].len, a[3].len);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "%s: set_offsets[%zd] out of order or out of the data's range", fn, bad);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < n; r++) {
        int64_t s0 = off[r], s1 = off[r + 1], len = s1 - s0;
        uint8_t found = 0;
        for (Py_ssize_t c = 0; c < ns; c++) {
            int64_t x = soff[c], y = soff[c + 1];
            if (y - x != len)
                continue;
            int same = 1;
            for (int64_t i = 0; i < len; i++) {
                if (data[s0 + i] != sdata[x + i]) {
                    same = 0;
                    break;
                }
            }
            if (same) {
                found = 1;
                break;
            }
        }
        out[r] = found;
    }
    Py_END_ALLOW_THREADS;
    ret = Py_NewRef(Py_None);
done:
    release(a, 5);
    return ret;
}

/* ------------------------------------------------------------------------------------------------------ */
/* factors(offsets, data, suffix, out) */

PyDoc_STRVAR(factors_doc, "factors(offsets, data, suffix, out): out[row] = 2.0 where the row's string ends with "
                          "`suffix` (bytes), else 1.0.");

static PyObject *py_factors(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char *fn = "factors";
    Arr a[4];
    memset(a, 0, sizeof a);
    PyObject *ret = NULL;
    if (check_args(nargs, 4, fn) < 0)
        return NULL;
    if (take(args[0], &a[0], fn, "offsets", T_I32, 1, 0) < 0 || take(args[1], &a[1], fn, "data", T_U8, 1, 0) < 0 ||
        take(args[2], &a[2], fn, "suffix", T_U8, 1, 0) < 0 || take(args[3], &a[3], fn, "out", T_F64, 1, 1) < 0)
        goto done;
    Py_ssize_t n = a[3].len;
    if (need_len(&a[0], n + 1, fn, "offsets") < 0)
        goto done;
    const int32_t *off = a[0].p;
    const uint8_t *data = a[1].p, *suffix = a[2].p;
    double *out = a[3].view.buf;
    int64_t k = a[2].len;
    Py_ssize_t bad = bad_offsets_i32(off, n + 1, a[1].len);
    if (bad >= 0) {
        PyErr_Format(PyExc_ValueError, "%s: offsets[%zd] out of order or out of the data's range", fn, bad);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < n; r++) {
        int64_t s0 = off[r], s1 = off[r + 1];
        int hit = s1 - s0 >= k;
        if (hit) {
            for (int64_t i = 0; i < k; i++) {
                if (data[s1 - k + i] != suffix[i]) {
                    hit = 0;
                    break;
                }
            }
        }
        out[r] = hit ? 2.0 : 1.0;
    }
    Py_END_ALLOW_THREADS;
    ret = Py_NewRef(Py_None);
done:
    release(a, 4);
    return ret;
}

/* ------------------------------------------------------------------------------------------------------ */
/* classify(da, db, dev_a, dev_b, same_type, sa, sb, na, nb, numel_a, nf_a, nf_b, kind) -> int */

PyDoc_STRVAR(classify_doc,
             "classify(da, db, dev_a, dev_b, same_type, sa, sb, na, nb, numel_a, nf_a, nf_b, kind) -> int: per "
             "row, into kind (int8): 0 bit-equal, 1 compared here, 2 handed to the record path; returns how "
             "many rows are of kind 1 (columnar.py's classify call).");

static PyObject *py_classify(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char *fn = "classify";
    static const char *const names[] = {"da", "db", "dev_a", "dev_b", "same_type", "sa",  "sb",
                                        "na", "nb", "numel_a", "nf_a", "nf_b",    "kind"};
    static const int types[] = {T_U8,  T_U8,  T_BOOL, T_BOOL, T_BOOL, T_F64, T_F64,
                                T_F64, T_F64, T_I64,  T_I64,  T_I64,  T_I8};
    Arr a[13];
    memset(a, 0, sizeof a);
    PyObject *ret = NULL;
    if (check_args(nargs, 13, fn) < 0)
        return NULL;
    for (int i = 0; i < 13; i++)
        if (take(args[i], &a[i], fn, names[i], types[i], i < 2 ? 2 : 1, i == 12) < 0)
            goto done;
    Py_ssize_t n = a[12].len;
    for (int i = 0; i < 2; i++) {
        if (a[i].len != n || a[i].len2 != 16) {
            PyErr_Format(PyExc_ValueError, "%s: %s: shape (%zd, %zd), not (%zd, 16)", fn, names[i], a[i].len,
                         a[i].len2, n);
            goto done;
        }
    }
    for (int i = 2; i < 12; i++)
        if (need_len(&a[i], n, fn, names[i]) < 0)
            goto done;
    const uint8_t *da = a[0].p, *db = a[1].p, *dev_a = a[2].p, *dev_b = a[3].p, *same_type = a[4].p;
    const double *sa = a[5].p, *sb = a[6].p, *na = a[7].p, *nb = a[8].p;
    const int64_t *numel_a = a[9].p, *nf_a = a[10].p, *nf_b = a[11].p;
    int8_t *kind = a[12].view.buf;
    int64_t m = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t r = 0; r < n; r++) {
        int same = (dev_a[r] != 0) == (dev_b[r] != 0) && same_type[r] != 0;
        if (same) { /* the 16 bytes equal: as two 8-byte words */
            uint64_t wa[2], wb[2];
            memcpy(wa, da + r * 16, 16);
            memcpy(wb, db + r * 16, 16);
            same = wa[0] == wb[0] && wa[1] == wb[1];
        }
        if (same) {
            kind[r] = 0;
            continue;
        }
        int finite = nf_a[r] == 0 && nf_b[r] == 0 && isfinite(sa[r]) && isfinite(sb[r]) && isfinite(na[r]) &&
                     isfinite(nb[r]);
        if (finite && same_type[r] != 0 && numel_a[r] > 0) {
            kind[r] = 1;
            m += 1;
        } else {
            kind[r] = 2;
        }
    }
    Py_END_ALLOW_THREADS;
    ret = PyLong_FromLongLong(m);
done:
    release(a, 13);
    return ret;
}

/* ------------------------------------------------------------------------------------------------------ */
/* compare_block: the rows of kind 1 compared and summed up per step (columnar.py's _fused_summary) */

PyDoc_STRVAR(compare_doc, "compare_block(kind, f32, sa, sb, na, nb, numel_a, numel_b, k32a, v32a, k64a, v64a, "
                          "k32b, v32b, k64b, v64b, shape_off, shape_val, order, micro_batch, index, starts, "
                          "bitwise, user, rtol, atol, use_table, table, factor, row_base, has_mags, extra, "
                          "unbounded, copied_from, projections, K, n_orders, counts, first, specials, g_best, "
                          "g_ratio, rel_out, bnd_out) -> int: columnar.compare followed by columnar.by_step "
                          "over the rows of `kind` (columnar.py's _fused_summary); returns how many rows "
                          "went into specials.");

enum {
    A_KIND, A_F32, A_SA, A_SB, A_NA, A_NB, A_NUMEL_A, A_NUMEL_B, A_K32A, A_V32A, A_K64A, A_V64A, A_K32B, A_V32B,
    A_K64B, A_V64B, A_SHAPE_OFF, A_SHAPE_VAL, A_ORDER, A_MB, A_INDEX, A_STARTS, A_TABLE, A_FACTOR, A_ROW_BASE,
    A_EXTRA, A_UNBOUNDED, A_COUNTS, A_FIRST, A_SPECIALS, A_G_BEST, A_G_RATIO, A_REL, A_BND, N_ARRAYS
};

/* the arrays' positions among the 44 arguments, their types and dimensions; outputs from A_COUNTS on */
static const int ARG_POS[N_ARRAYS] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 16,
                                      17, 18, 19, 20, 21, 27, 28, 29, 31, 32, 37, 38, 39, 40, 41, 42, 43};
static const int ARG_TYPE[N_ARRAYS] = {T_I8,  T_BOOL, T_F64, T_F64, T_F64, T_F64, T_I64, T_I64, T_F32,
                                       T_BOOL, T_F64, T_BOOL, T_F32, T_BOOL, T_F64, T_BOOL, T_I64, T_I64,
                                       T_I64, T_U32, T_U32, T_I64, T_F64, T_F64, T_F64, T_F64, T_BOOL, T_I64,
                                       T_I64, T_I64, T_I64, T_I64, T_F64, T_F64};
static const char *const ARG_NAME[N_ARRAYS] = {
    "kind",   "f32",     "sa",       "sb",       "na",        "nb",     "numel_a",   "numel_b", "k32a",
    "v32a",   "k64a",    "v64a",     "k32b",     "v32b",      "k64b",   "v64b",      "shape_off",
    "shape_val", "order", "micro_batch", "index", "starts",   "table",  "factor",    "row_base",
    "extra",  "unbounded", "counts", "first",    "specials",  "g_best", "g_ratio",   "rel_out", "bnd_out"};

enum { OK = 0, E_STEP, E_ORDER, E_SHAPE, E_SKETCH, E_FIRST, E_G_BEST, E_G_RATIO };

static int as_bool(PyObject *o, int *out) {
    int v = PyObject_IsTrue(o);
    if (v < 0)
        return -1;
    *out = v;
    return 0;
}

static int as_i64(PyObject *o, int64_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = (int64_t)v;
    return 0;
}

static int as_f64(PyObject *o, double *out) {
    double v = PyFloat_AsDouble(o);
    if (v == -1.0 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* how many rows of K values an array of len holds (every row where K is 0) */
static inline Py_ssize_t rows_held(Py_ssize_t len, int64_t K) { return K == 0 ? PY_SSIZE_T_MAX : (Py_ssize_t)(len / K); }

static PyObject *py_compare_block(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    static const char *fn = "compare_block";
    Arr a[N_ARRAYS];
    memset(a, 0, sizeof a);
    PyObject *ret = NULL;
    double *scratch = NULL;
    if (check_args(nargs, 44, fn) < 0)
        return NULL;
    int bitwise, user, use_table, has_mags;
    double rtol, atol;
    int64_t copied_from, projections, K, n_orders;
    if (as_bool(args[22], &bitwise) < 0 || as_bool(args[23], &user) < 0 || as_f64(args[24], &rtol) < 0 ||
        as_f64(args[25], &atol) < 0 || as_bool(args[26], &use_table) < 0 || as_bool(args[30], &has_mags) < 0 ||
        as_i64(args[33], &copied_from) < 0 || as_i64(args[34], &projections) < 0 || as_i64(args[35], &K) < 0 ||
        as_i64(args[36], &n_orders) < 0)
        return NULL;
    for (int i = 0; i < N_ARRAYS; i++) {
        int ndim = (i == A_TABLE || i == A_COUNTS) ? 2 : 1;
        if (take(args[ARG_POS[i]], &a[i], fn, ARG_NAME[i], ARG_TYPE[i], ndim, i >= A_COUNTS) < 0)
            goto done;
    }
    Py_ssize_t n = a[A_KIND].len, n_steps = a[A_STARTS].len;
    /* the arrays read at every compared row, and the outputs */
    static const int per_row[] = {A_F32,   A_SA,    A_SB,   A_NA,       A_NB,       A_NUMEL_A, A_NUMEL_B,
                                  A_V32A,  A_V64A,  A_V32B, A_V64B,     A_ORDER,    A_MB,      A_INDEX,
                                  A_SPECIALS, A_REL, A_BND};
    for (size_t i = 0; i < sizeof per_row / sizeof per_row[0]; i++)
        if (need_len(&a[per_row[i]], n, fn, ARG_NAME[per_row[i]]) < 0)
            goto done;
    if (need_len(&a[A_SHAPE_OFF], n + 1, fn, "shape_off") < 0 || need_len(&a[A_FIRST], n_steps, fn, "first") < 0)
        goto done;
    /* the arrays a flag asks for */
    if (!user && use_table && need_len(&a[A_FACTOR], n, fn, "factor") < 0)
        goto done;
    if (!user && !use_table && need_len(&a[A_ROW_BASE], n, fn, "row_base") < 0)
        goto done;
    if (has_mags && (need_len(&a[A_EXTRA], n, fn, "extra") < 0 || need_len(&a[A_UNBOUNDED], n, fn, "unbounded") < 0))
        goto done;
    if (a[A_COUNTS].len != 3 || a[A_COUNTS].len2 != n_steps) {
        PyErr_Format(PyExc_ValueError, "%s: counts: shape (%zd, %zd), not (3, %zd)", fn, a[A_COUNTS].len,
                     a[A_COUNTS].len2, n_steps);
        goto done;
    }
    if (n_orders < 1) {
        PyErr_Format(PyExc_ValueError, "%s: n_orders %lld < 1", fn, (long long)n_orders);
        goto done;
    }
    for (int i = A_G_BEST; i <= A_G_RATIO; i++) {
        Py_ssize_t len = a[i].len;
        if (len % n_orders != 0 || len / n_orders != n_steps) {
            PyErr_Format(PyExc_ValueError, "%s: %s: length %zd, not %zd steps x %lld orders", fn, ARG_NAME[i], len,
                         n_steps, (long long)n_orders);
            goto done;
        }
    }
    if (!user && use_table && (a[A_TABLE].len < n_steps || a[A_TABLE].len2 < n_orders)) {
        PyErr_Format(PyExc_ValueError, "%s: table: shape (%zd, %zd), not at least (%zd, %lld)", fn, a[A_TABLE].len,
                     a[A_TABLE].len2, n_steps, (long long)n_orders);
        goto done;
    }
    if (K < 0 || (uint64_t)K > (uint64_t)(PY_SSIZE_T_MAX / (3 * (Py_ssize_t)sizeof(double)))) {
        PyErr_Format(PyExc_ValueError, "%s: K %lld out of range", fn, (long long)K);
        goto done;
    }
    if (copied_from < 0) {
        PyErr_Format(PyExc_ValueError, "%s: copied_from %lld < 0", fn, (long long)copied_from);
        goto done;
    }
    scratch = PyMem_Malloc(K > 0 ? (size_t)K * 3 * sizeof(double) : 1);
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    const int8_t *kind = a[A_KIND].p;
    const uint8_t *f32 = a[A_F32].p, *v32a = a[A_V32A].p, *v64a = a[A_V64A].p, *v32b = a[A_V32B].p,
                  *v64b = a[A_V64B].p, *unbounded = a[A_UNBOUNDED].p;
    const double *sa = a[A_SA].p, *sb = a[A_SB].p, *na = a[A_NA].p, *nb = a[A_NB].p, *k64a = a[A_K64A].p,
                 *k64b = a[A_K64B].p, *table = a[A_TABLE].p, *factor = a[A_FACTOR].p, *row_base = a[A_ROW_BASE].p,
                 *extra = a[A_EXTRA].p;
    const float *k32a = a[A_K32A].p, *k32b = a[A_K32B].p;
    const int64_t *numel_a = a[A_NUMEL_A].p, *numel_b = a[A_NUMEL_B].p, *shape_off = a[A_SHAPE_OFF].p,
                  *shape_val = a[A_SHAPE_VAL].p, *order = a[A_ORDER].p, *starts = a[A_STARTS].p;
    const uint32_t *micro_batch = a[A_MB].p, *index = a[A_INDEX].p;
    int64_t *counts = a[A_COUNTS].view.buf, *first = a[A_FIRST].view.buf, *specials = a[A_SPECIALS].view.buf,
            *g_best = a[A_G_BEST].view.buf, *g_ratio = a[A_G_RATIO].view.buf;
    double *rel_out = a[A_REL].view.buf, *bnd_out = a[A_BND].view.buf;
    /* rows r < rows_k..: row r's K sketch values lie within the array */
    Py_ssize_t rows_k32a = rows_held(a[A_K32A].len, K), rows_k64a = rows_held(a[A_K64A].len, K),
               rows_k32b = rows_held(a[A_K32B].len, K), rows_k64b = rows_held(a[A_K64B].len, K);
    Py_ssize_t len_shape_val = a[A_SHAPE_VAL].len, t_cols = a[A_TABLE].len2, n_cells = a[A_G_BEST].len;
    int err = OK;
    Py_ssize_t err_at = 0;
    int64_t n_special = 0;

    Py_BEGIN_ALLOW_THREADS;
    /* every index the loop derives from the data, checked first (simple passes over whole columns: as many
     * checks inside the loop cost it a tenth of its time); the loop then stays within bounds */
    /* the rows the outputs already name (the loop reads them back) */
    for (Py_ssize_t i = 0; i < n_steps && !err; i++)
        if (first[i] >= n)
            err = E_FIRST, err_at = i;
    for (Py_ssize_t i = 0; i < n_cells && !err; i++) {
        if (g_best[i] >= n)
            err = E_G_BEST, err_at = i;
        else if (g_ratio[i] >= n)
            err = E_G_RATIO, err_at = i;
    }
    /* the rows before the first step's start have no step (s = -1): none of them is compared */
    for (Py_ssize_t r = 0; r < n && (n_steps == 0 || starts[0] > r) && !err; r++)
        if (kind[r] != 0 && kind[r] != 2)
            err = E_STEP, err_at = r;
    /* each row's phase order (its cell, the table's column) */
    for (Py_ssize_t r = 0; r < n && !err; r++)
        if (order[r] < 0 || order[r] >= n_orders)
            err = E_ORDER, err_at = r;
    /* the shape offsets: increasing from 0 or more to at most the values' length, so a row's last axis
     * shape_val[o1 - 1] (where o1 > o0) is within the values */
    if (!err && shape_off[0] < 0)
        err = E_SHAPE, err_at = 0;
    for (Py_ssize_t r = 0; r < n && !err; r++)
        if (shape_off[r + 1] < shape_off[r])
            err = E_SHAPE, err_at = r;
    if (!err && shape_off[n] > len_shape_val)
        err = E_SHAPE, err_at = n;
    /* no sketch valid past the rows its values hold (the loop reads k64 where v64, else k32 where v32) */
    {
        const uint8_t *valid[4] = {v32a, v64a, v32b, v64b};
        const Py_ssize_t held[4] = {rows_k32a, rows_k64a, rows_k32b, rows_k64b};
        for (int i = 0; i < 4 && !err; i++)
            for (Py_ssize_t r = held[i]; r < n && !err; r++)
                if (valid[i][r])
                    err = E_SKETCH, err_at = r;
    }
    if (!err) {
        double *ka = scratch, *kb = scratch + K, *tk = scratch + 2 * K;
        const double nan = np_nan();
        Py_ssize_t s = -1;
        for (Py_ssize_t r = 0; r < n; r++) {
            while (s + 1 < n_steps && starts[s + 1] <= r)
                s++;
            int8_t kd = kind[r];
            if (kd == 0)
                continue;
            if (kd == 2) {
                specials[n_special] = r;
                n_special += 1;
                continue;
            }
            double x_sa = sa[r], x_sb = sb[r], x_na = na[r], x_nb = nb[r];
            int64_t numel = max_i(max_i(numel_a[r], numel_b[r]), 1);
            double top = max_f(x_na, x_nb);
            int unb = 0;
            if (has_mags) {
                top = max_f(top, extra[r]);
                unb = unbounded[r] != 0;
            }
            double scale_n = max_f(top, TINY);
            double scale_s = max_f(top * sqrt_ieee((double)numel), TINY);
            int has_sketch = projections > 0;
            /* the numpy path's _sketches: sketch64 where valid, else the float32 sketch widened, else nan */
            int wa = v64a[r] ? 2 : (v32a[r] ? 1 : 0);
            int wb = v64b[r] ? 2 : (v32b[r] ? 1 : 0);
            for (int64_t j = 0; j < K; j++) {
                double x, y;
                if (wa == 2)
                    x = k64a[r * K + j];
                else if (wa == 1)
                    x = (double)k32a[r * K + j];
                else
                    x = nan;
                if (wb == 2)
                    y = k64b[r * K + j];
                else if (wb == 1)
                    y = (double)k32b[r * K + j];
                else
                    y = nan;
                if (isnan(x) || isnan(y))
                    has_sketch = 0;
                ka[j] = x;
                kb[j] = y;
            }
            for (int64_t j = copied_from; j < K; j++)
                kb[j] = ka[j];
            double tn = fabs(x_na - x_nb) / scale_n;
            double ts = fabs(x_sa - x_sb) / scale_s;
            for (int64_t j = 0; j < K; j++)
                tk[j] = fabs(ka[j] - kb[j]) / scale_s;
            double bn, bs;
            if (user) {
                bn = (atol + rtol * scale_n) / scale_n;
                bs = (atol + rtol * scale_s) / scale_s;
            } else {
                if (use_table)
                    bn = table[s * t_cols + order[r]] * factor[r];
                else
                    bn = row_base[r];
                bs = bn;
            }
            int is32 = f32[r] != 0;
            int64_t x_numel = numel_a[r];
            int64_t o0 = shape_off[r], o1 = shape_off[r + 1];
            int64_t last = o1 > o0 ? shape_val[o1 - 1] : 0;
            /* _sketch_rounding */
            double u = is32 ? U32 : U64;
            int64_t c = max_i(last, 1);
            int64_t rows = max_i(floordiv_pos(x_numel, c), 1);
            double sk_r = u * sqrt_ieee((double)min_i(rows, SKETCH_ROWS)) + U64 * sqrt_ieee((double)add_wrap(rows, c)) +
                          (is32 ? U32 : 0.0);
            if (!(last > 0))
                sk_r = 0.0;
            double rounding = 2.0 * sk_r;
            if (unb) {
                bn = INFINITY;
                bs = INFINITY;
            }
            double bk = bs + rounding;
            if (!bitwise && !user) {
                /* _stat_rounding */
                int64_t nn = max_i(x_numel, 1);
                int in32 = is32 && nn > FLOAT64_STATS;
                double run = sqrt_ieee((double)min_i(nn, STAT_CHUNK));
                double norm_r = in32 ? 0.5 * (U32 * (run + 1.0) + U64 * sqrt_ieee((double)nn)) + U64 : 0.0;
                double sum_r = (in32 && last > 0) ? U32 * run + U64 * sqrt_ieee((double)nn) : 0.0;
                bn = bn + 2.0 * (bn > 0 ? norm_r : 0.0);
                bs = bs + 2.0 * (bs > 0 ? sum_r : 0.0);
            }
            int over = tn > bn || ts > bs;
            if (has_sketch && !over) {
                for (int64_t j = 0; j < K; j++) {
                    if (tk[j] > bk) {
                        over = 1;
                        break;
                    }
                }
            }
            int all_equal = bn == bn && bs == bn && (!has_sketch || bk == bn);
            /* argmax over the picks (norm, sum, each projection): the first maximum, the first NaN if any */
            int64_t best_i = 0;
            double best_v = all_equal ? tn : (bn > 0 ? tn / bn : (tn > 0 ? INFINITY : 0.0));
            if (!isnan(best_v)) {
                double v = all_equal ? ts : (bs > 0 ? ts / bs : (ts > 0 ? INFINITY : 0.0));
                if (isnan(v)) {
                    best_i = 1;
                } else {
                    if (v > best_v) {
                        best_i = 1;
                        best_v = v;
                    }
                    for (int64_t j = 0; j < K; j++) {
                        if (has_sketch) {
                            double t = tk[j];
                            v = all_equal ? t : (bk > 0 ? t / bk : (t > 0 ? INFINITY : 0.0));
                        } else {
                            v = -INFINITY;
                        }
                        if (isnan(v)) {
                            best_i = 2 + j;
                            break;
                        }
                        if (v > best_v) {
                            best_i = 2 + j;
                            best_v = v;
                        }
                    }
                }
            }
            double rel, bnd;
            if (best_i == 0) {
                rel = tn;
                bnd = bn;
            } else if (best_i == 1) {
                rel = ts;
                bnd = bs;
            } else {
                rel = tk[best_i - 2];
                bnd = bk;
            }
            if (!isfinite(rel))
                rel = nan;
            int diverged = bitwise ? 1 : (over || isnan(rel));
            rel_out[r] = rel;
            bnd_out[r] = bnd;
            /* by_step */
            incr(&counts[s]);
            if (diverged) {
                incr(&counts[n_steps + s]);
                if (isnan(rel))
                    incr(&counts[2 * n_steps + s]);
                int64_t f = first[s];
                if (f < 0) {
                    first[s] = r;
                } else {
                    uint32_t mb_r = micro_batch[r], mb_f = micro_batch[f];
                    if (mb_r < mb_f ||
                        (mb_r == mb_f && (order[r] < order[f] || (order[r] == order[f] && index[r] < index[f]))))
                        first[s] = r;
                }
            }
            if (!isnan(rel)) {
                Py_ssize_t cell = s * (Py_ssize_t)n_orders + (Py_ssize_t)order[r];
                int64_t g = g_best[cell];
                if (g < 0 || rel > rel_out[g])
                    g_best[cell] = r;
                double ratio = bnd > 0 ? rel / bnd : -1.0;
                g = g_ratio[cell];
                if (g < 0) {
                    g_ratio[cell] = r;
                } else {
                    double bg = bnd_out[g];
                    if (ratio > (bg > 0 ? rel_out[g] / bg : -1.0))
                        g_ratio[cell] = r;
                }
            }
        }
    }
    Py_END_ALLOW_THREADS;

    switch (err) {
    case OK:
        ret = PyLong_FromLongLong(n_special);
        break;
    case E_STEP:
        PyErr_Format(PyExc_ValueError, "%s: row %zd is compared but comes before the first step's start", fn, err_at);
        break;
    case E_ORDER:
        PyErr_Format(PyExc_ValueError, "%s: order[%zd] out of range [0, %lld)", fn, err_at, (long long)n_orders);
        break;
    case E_SHAPE:
        PyErr_Format(PyExc_ValueError, "%s: shape_off[%zd] out of order or out of shape_val's range", fn, err_at);
        break;
    case E_SKETCH:
        PyErr_Format(PyExc_ValueError, "%s: row %zd: a sketch valid past its values", fn, err_at);
        break;
    case E_FIRST:
        PyErr_Format(PyExc_ValueError, "%s: first[%zd] is not a row", fn, err_at);
        break;
    case E_G_BEST:
        PyErr_Format(PyExc_ValueError, "%s: g_best[%zd] is not a row", fn, err_at);
        break;
    case E_G_RATIO:
        PyErr_Format(PyExc_ValueError, "%s: g_ratio[%zd] is not a row", fn, err_at);
        break;
    }
done:
    PyMem_Free(scratch);
    release(a, N_ARRAYS);
    return ret;
}

/* ------------------------------------------------------------------------------------------------------ */

static PyMethodDef methods[] = {
    {"in_set", (PyCFunction)(void (*)(void))py_in_set, METH_FASTCALL, in_set_doc},
    {"factors", (PyCFunction)(void (*)(void))py_factors, METH_FASTCALL, factors_doc},
    {"classify", (PyCFunction)(void (*)(void))py_classify, METH_FASTCALL, classify_doc},
    {"compare_block", (PyCFunction)(void (*)(void))py_compare_block, METH_FASTCALL, compare_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(module_doc, "analysis/columnar.py's block comparison in C (see compare.c); CONSTANTS: the tolerance constants "
                         "compiled in (TINY, U32, U64, SKETCH_ROWS, STAT_CHUNK, FLOAT64_STATS).");

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_compare", module_doc, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__compare(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    PyObject *c = Py_BuildValue("(dddiii)", TINY, U32, U64, SKETCH_ROWS, STAT_CHUNK, FLOAT64_STATS);
    if (c == NULL || PyModule_AddObject(m, "CONSTANTS", c) < 0) {
        Py_XDECREF(c);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
