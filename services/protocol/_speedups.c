/*
 * services.protocol._speedups: optional C fast paths for services/protocol/codec.py.
 *
 * Why it exists: speed only. A small observation frame (39 float32 + a task name)
 * spent most of its round trip in the Python callbacks msgpack makes for every map
 * (object_hook) and every NumPy array (default), and in the tree walk after
 * decoding. Doing the common case in C brings the round trip near bare msgpack.
 *
 * What it does: the fast paths and nothing else. codec.py is the reference: any
 * case that is unusual or wrong (text keys, a dtype not yet accepted, a bad shape,
 * NumPy scalars, non-contiguous arrays, ...) is handed to the Python function that
 * configure() was given, so error messages and semantics live in one place. The
 * module is optional; codec.py works without it (EVALFORGE_PURE_PYTHON_CODEC=1).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#if NPY_ABI_VERSION < 0x02000000 /* building against NumPy 1.x headers */
#define PyDataType_ELSIZE(descr) ((descr)->elsize)
#endif

#define FAST_MAX_NDIM 32    /* shapes with more dimensions go to Python */
#define FAST_MAX_DEPTH 1024 /* larger depth limits go to Python: bounds the C recursion */

/* Set by configure(): strong references, held for the life of the process. */
static PyObject *py_object_hook, *py_encode_default, *py_check_tree;
static PyObject *dtype_cache;  /* codec._DTYPE_CACHE: accepted dtype str -> np.dtype */
static PyObject *encode_cache; /* codec._ENCODE_DTYPE_STR: np.dtype -> dtype str */
static PyObject *protocol_error, *timestamp_type;
static Py_ssize_t zero_copy_bytes, max_ndim;
/* The keys of the array maps the encoder makes, and a map with all four, made at import. */
static PyObject *k_ndarray, *k_data, *k_dtype, *k_shape, *map_template;

static PyObject *
not_configured(void)
{
    PyErr_SetString(PyExc_RuntimeError, "services.protocol._speedups.configure() was not called");
    return NULL;
}

static PyObject *
configure(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"object_hook", "encode_default", "check_tree", "dtype_cache",
                             "encode_cache", "protocol_error", "timestamp_type",
                             "zero_copy_bytes", "max_ndim", NULL};
    PyObject *hook, *dflt, *check, *dcache, *ecache, *perr, *ts;
    Py_ssize_t zc, nd;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO!O!OO!nn:configure", kwlist, &hook,
                                     &dflt, &check, &PyDict_Type, &dcache, &PyDict_Type, &ecache,
                                     &perr, &PyType_Type, &ts, &zc, &nd))
        return NULL;
    if (nd < 0 || nd > FAST_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "max_ndim must be between 0 and %d", FAST_MAX_NDIM);
        return NULL;
    }
    Py_XSETREF(py_object_hook, Py_NewRef(hook));
    Py_XSETREF(py_encode_default, Py_NewRef(dflt));
    Py_XSETREF(py_check_tree, Py_NewRef(check));
    Py_XSETREF(dtype_cache, Py_NewRef(dcache));
    Py_XSETREF(encode_cache, Py_NewRef(ecache));
    Py_XSETREF(protocol_error, Py_NewRef(perr));
    Py_XSETREF(timestamp_type, Py_NewRef(ts));
    zero_copy_bytes = zc;
    max_ndim = nd;
    Py_RETURN_NONE;
}

/* ---- decoding ------------------------------------------------------------------ */

/* Which markers a map's keys hold, read in one pass (cheaper than a lookup per key
 * name, and linear in what msgpack already parsed). Fills the openpi fields. */
enum { NDARRAY = 1, OTHER_MARKER = 2 };

static int
scan_keys(PyObject *map, PyObject **data, PyObject **spec, PyObject **shape)
{
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    int found = 0;
    while (PyDict_Next(map, &pos, &key, &value)) {
        if (PyBytes_CheckExact(key)) {
            const char *s = PyBytes_AS_STRING(key);
            Py_ssize_t n = PyBytes_GET_SIZE(key);
            if (n == 4 && memcmp(s, "data", 4) == 0)
                *data = value;
            else if (n == 5 && memcmp(s, "dtype", 5) == 0)
                *spec = value;
            else if (n == 5 && memcmp(s, "shape", 5) == 0)
                *shape = value;
            else if (n == 11 && memcmp(s, "__ndarray__", 11) == 0)
                found |= NDARRAY;
            else if (n == 13 && memcmp(s, "__npgeneric__", 13) == 0)
                found |= OTHER_MARKER;
        }
        else if (PyUnicode_CheckExact(key)) {
            Py_ssize_t n = PyUnicode_GET_LENGTH(key);
            if ((n == 11 && PyUnicode_CompareWithASCIIString(key, "__ndarray__") == 0) ||
                (n == 13 && PyUnicode_CompareWithASCIIString(key, "__npgeneric__") == 0))
                found |= OTHER_MARKER;
        }
        else {
            found |= OTHER_MARKER; /* not a key msgpack makes: let Python look */
        }
    }
    return found;
}

/* The array an openpi-keyed map describes, as a read-only view of its data bytes.
 * NULL with no exception set: not the fast case, let Python decide. */
static PyObject *
fast_ndarray(PyObject *data, PyObject *spec, PyObject *shape)
{
    if (data == NULL || spec == NULL || shape == NULL || !PyBytes_CheckExact(data) ||
        !PyUnicode_CheckExact(spec) || !PyList_CheckExact(shape))
        return NULL;
    PyObject *descr = PyDict_GetItemWithError(dtype_cache, spec);
    if (descr == NULL || !PyArray_DescrCheck(descr))
        return NULL;
    Py_ssize_t ndim = PyList_GET_SIZE(shape);
    if (ndim > max_ndim)
        return NULL;
    npy_intp dims[FAST_MAX_NDIM];
    Py_ssize_t count = 1; /* element count; any overflow goes to Python's exact arithmetic */
    for (Py_ssize_t i = 0; i < ndim; i++) {
        PyObject *dim = PyList_GET_ITEM(shape, i);
        if (!PyLong_CheckExact(dim)) /* bool and other int subclasses too */
            return NULL;
        Py_ssize_t n = PyLong_AsSsize_t(dim);
        if (n == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* OverflowError: Python reports the shape */
            return NULL;
        }
        if (n < 0 || (n != 0 && count > PY_SSIZE_T_MAX / n))
            return NULL;
        dims[i] = n;
        count *= n;
    }
    Py_ssize_t itemsize = PyDataType_ELSIZE((PyArray_Descr *)descr);
    if (itemsize <= 0 || count > PY_SSIZE_T_MAX / itemsize ||
        count * itemsize != PyBytes_GET_SIZE(data))
        return NULL;

    Py_INCREF(descr); /* PyArray_NewFromDescr steals a reference */
    PyObject *arr = PyArray_NewFromDescr(&PyArray_Type, (PyArray_Descr *)descr, (int)ndim, dims,
                                         NULL, PyBytes_AS_STRING(data), 0, NULL);
    if (arr == NULL)
        return NULL;
    /* The bytes object owns the memory: the array keeps it alive and must not write. */
    if (PyArray_SetBaseObject((PyArrayObject *)arr, Py_NewRef(data)) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    PyArray_CLEARFLAGS((PyArrayObject *)arr, NPY_ARRAY_WRITEABLE);
    PyArray_UpdateFlags((PyArrayObject *)arr, NPY_ARRAY_UPDATE_ALL); /* contiguity, alignment */
    return arr;
}

static PyObject *
object_hook(PyObject *self, PyObject *map)
{
    if (py_object_hook == NULL)
        return not_configured();
    if (!PyDict_CheckExact(map))
        return PyObject_CallOneArg(py_object_hook, map);
    PyObject *data = NULL, *spec = NULL, *shape = NULL;
    int found = scan_keys(map, &data, &spec, &shape);
    if (found == 0)
        return Py_NewRef(map); /* an ordinary map */
    if (found & NDARRAY) {
        PyObject *arr = fast_ndarray(data, spec, shape);
        if (arr != NULL || PyErr_Occurred())
            return arr;
    }
    return PyObject_CallOneArg(py_object_hook, map);
}

/* ---- encoding ------------------------------------------------------------------ */

/* A 1-D read-only memoryview of unsigned bytes over a C-contiguous array; it keeps
 * the array alive through a uint8 array view whose base is the array. */
static PyObject *
byte_view(PyArrayObject *arr)
{
    npy_intp n = PyArray_NBYTES(arr);
    PyObject *bytes = PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(NPY_UINT8), 1, &n,
                                           NULL, PyArray_DATA(arr), 0, NULL);
    if (bytes == NULL)
        return NULL;
    if (PyArray_SetBaseObject((PyArrayObject *)bytes, Py_NewRef((PyObject *)arr)) < 0) {
        Py_DECREF(bytes);
        return NULL;
    }
    PyArray_CLEARFLAGS((PyArrayObject *)bytes, NPY_ARRAY_WRITEABLE);
    PyObject *view = PyMemoryView_FromObject(bytes);
    Py_DECREF(bytes);
    return view;
}

static PyObject *
array_map(PyArrayObject *arr, PyObject *dtype_str)
{
    Py_ssize_t nbytes = PyArray_NBYTES(arr);
    PyObject *data = nbytes < zero_copy_bytes
                         ? PyBytes_FromStringAndSize(PyArray_DATA(arr), nbytes)
                         : byte_view(arr);
    PyObject *shape = data ? PyArray_IntTupleFromIntp(PyArray_NDIM(arr), PyArray_DIMS(arr)) : NULL;
    /* Copying a template that has all four keys is quicker than inserting them. */
    PyObject *map = shape ? PyDict_Copy(map_template) : NULL;
    if (map != NULL && (PyDict_SetItem(map, k_data, data) < 0 ||
                        PyDict_SetItem(map, k_dtype, dtype_str) < 0 ||
                        PyDict_SetItem(map, k_shape, shape) < 0))
        Py_CLEAR(map);
    Py_XDECREF(data);
    Py_XDECREF(shape);
    return map;
}

static PyObject *
encode_default(PyObject *self, PyObject *obj)
{
    if (py_object_hook == NULL)
        return not_configured();
    if (Py_IS_TYPE(obj, &PyArray_Type) && PyArray_IS_C_CONTIGUOUS((PyArrayObject *)obj)) {
        PyObject *descr = (PyObject *)PyArray_DESCR((PyArrayObject *)obj);
        PyObject *dtype_str = PyDict_GetItemWithError(encode_cache, descr);
        if (dtype_str != NULL)
            return array_map((PyArrayObject *)obj, dtype_str);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_CallOneArg(py_encode_default, obj);
}

/* ---- tree check ---------------------------------------------------------------- */

/* The next value of a dict or list (borrowed); 0 when there is none. */
static int
next_value(PyObject *node, Py_ssize_t *pos, PyObject **value)
{
    if (PyDict_CheckExact(node)) {
        PyObject *key;
        return PyDict_Next(node, pos, &key, value);
    }
    if (*pos >= PyList_GET_SIZE(node))
        return 0;
    *value = PyList_GET_ITEM(node, (*pos)++);
    return 1;
}

#define IS_CONTAINER(o) (PyDict_CheckExact(o) || PyList_CheckExact(o))

/* codec._check_tree, recursively. Python's version pops an explicit stack, so it
 * scans a node's values in order, then visits child containers last to first; this
 * does the same, so a frame with two faults reports the same one. Runs no Python
 * code, so the borrowed references stay valid. */
static int
walk(PyObject *node, Py_ssize_t depth, Py_ssize_t max_depth)
{
    if (depth > max_depth) {
        PyErr_Format(protocol_error, "frame nests containers deeper than %zd levels", max_depth);
        return -1;
    }
    Py_ssize_t pos = 0, children = 0;
    PyObject *value;
    while (next_value(node, &pos, &value)) {
        if (IS_CONTAINER(value)) {
            children++;
        }
        else if (Py_IS_TYPE(value, (PyTypeObject *)timestamp_type)) {
            PyErr_SetString(protocol_error,
                            "msgpack extension type -1 (timestamp) is not part of the protocol");
            return -1;
        }
    }
    if (children == 0)
        return 0;
    PyObject *values = PyDict_CheckExact(node) ? PyDict_Values(node) : Py_NewRef(node);
    if (values == NULL)
        return -1;
    int rc = 0;
    for (Py_ssize_t i = PyList_GET_SIZE(values) - 1; i >= 0 && rc == 0; i--) {
        value = PyList_GET_ITEM(values, i);
        if (IS_CONTAINER(value))
            rc = walk(value, depth + 1, max_depth);
    }
    Py_DECREF(values);
    return rc;
}

static PyObject *
check_tree(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (py_object_hook == NULL)
        return not_configured();
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "check_tree() takes exactly 2 arguments (obj, max_depth)");
        return NULL;
    }
    Py_ssize_t max_depth = -1;
    if (PyLong_CheckExact(args[1])) {
        max_depth = PyLong_AsSsize_t(args[1]);
        if (max_depth == -1 && PyErr_Occurred())
            PyErr_Clear(); /* OverflowError: Python's turn */
    }
    if (!IS_CONTAINER(args[0]) || max_depth < 0 || max_depth > FAST_MAX_DEPTH)
        return PyObject_Vectorcall(py_check_tree, args, nargs, NULL);
    if (walk(args[0], 1, max_depth) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- module -------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Hand over codec.py's fallbacks, caches, exception and limits. Call once at import."},
    {"object_hook", object_hook, METH_O, "Fast path of codec._object_hook."},
    {"encode_default", encode_default, METH_O, "Fast path of codec._encode_default."},
    {"check_tree", (PyCFunction)(void (*)(void))check_tree, METH_FASTCALL,
     "Fast path of codec._check_tree(obj, max_depth)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "services.protocol._speedups",
    "Optional C fast paths for services.protocol.codec; the Python code is the reference.",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    import_array();
    if (!(k_ndarray = PyBytes_FromString("__ndarray__")) || !(k_data = PyBytes_FromString("data")) ||
        !(k_dtype = PyBytes_FromString("dtype")) || !(k_shape = PyBytes_FromString("shape")) ||
        !(map_template = Py_BuildValue("{OOOOOOOO}", k_ndarray, Py_True, k_data, Py_None, k_dtype,
                                       Py_None, k_shape, Py_None)))
        return NULL;
    return PyModule_Create(&module);
}
