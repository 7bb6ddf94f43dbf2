/* placeholder: filled in by the port of the numba kernels */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_compare", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__compare(void) { return PyModule_Create(&module); }
