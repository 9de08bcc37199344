/*
 * services.protocol._speedups: optional C fast paths for services/protocol/codec.py.
 *
 * Why it exists: speed only. A small observation frame (39 float32 + a task name)
 * spent most of its round trip in the Python callbacks msgpack makes for every map
 * (object_hook) and every NumPy array (default), in the tree walk after decoding,
 * and in the packb/unpackb wrappers around msgpack themselves (their Python frames,
 * the keyword arguments to msgpack.unpackb, a new msgpack.Packer per frame). Doing
 * the common case in C brings the round trip near bare msgpack.
 *
 * What it does: the fast paths and nothing else. codec.py is the reference: any
 * case that is unusual or wrong (text keys, a dtype not yet accepted, a bad shape,
 * NumPy scalars, non-contiguous arrays, ...) is handed to the Python function that
 * configure() was given, so error messages and semantics live in one place. The
 * module is optional; codec.py works without it (EVALFORGE_PURE_PYTHON_CODEC=1).
 *
 * Threads: everything here runs with the GIL held (no free-threaded build is
 * supported). Where a call can run Python code (msgpack calling a Python fallback),
 * shared state is either taken out of its slot for the duration (the cached packer)
 * or held by a strong reference (the limits cache entry).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h> /* offsetof */
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#if NPY_ABI_VERSION < 0x02000000 /* building against NumPy 1.x headers */
#define PyDataType_ELSIZE(descr) ((descr)->elsize)
#endif

#define FAST_MAX_NDIM 32    /* shapes with more dimensions go to Python */
#define FAST_MAX_DEPTH 1024 /* larger depth limits go to Python: bounds the C recursion */

/* Set by configure(): strong references, held for the life of the process. */
static PyObject *py_object_hook, *py_encode_default, *py_check_tree, *py_packb, *py_unpackb;
static PyObject *dtype_cache;  /* codec._DTYPE_CACHE: accepted dtype str -> np.dtype */
static PyObject *encode_cache; /* codec._ENCODE_DTYPE_STR: np.dtype -> dtype str */
static PyObject *protocol_error, *timestamp_type;
static Py_ssize_t zero_copy_bytes, max_ndim;
/* For packb/unpackb: msgpack.Packer, msgpack.unpackb, msgpack.ExtraData, the tuple of
 * exceptions codec.unpackb reports as a malformed frame, codec._refuse_ext, and
 * codec.Limits with its default instance. */
static PyObject *packer_type, *msgpack_unpackb, *extra_data, *malformed_errors, *refuse_ext;
static PyObject *limits_type, *default_limits;
/* Made by configure(): the keyword arguments codec.packb gives msgpack.Packer, with
 * this module's encode_default, and this module's object_hook for unpackb. */
static PyObject *packer_kwargs, *fast_object_hook;
/* The keys of the array maps the encoder makes, and a map with all four, made at import. */
static PyObject *k_ndarray, *k_data, *k_dtype, *k_shape, *map_template;
/* Made at import for packb and unpackb: interned names, msgpack.unpackb's keyword names. */
static PyObject *empty_tuple, *str_pack, *str_extra, *unpack_kwnames;
static PyObject *str_max_frame, *str_max_str, *str_max_container, *str_max_depth;
/* Caches of packb and unpackb (see there), emptied by configure(). */
static PyObject *spare_packer; /* a msgpack.Packer kept between frames, or NULL */
static PyObject *limits_entry; /* (limits, max_frame_bytes, max_str_len, max_container_len, max_depth) */

static PyObject *
not_configured(void)
{
    PyErr_SetString(PyExc_RuntimeError, "services.protocol._speedups.configure() was not called");
    return NULL;
}

static PyObject *
configure(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"object_hook", "encode_default", "check_tree", "packb", "unpackb",
                             "dtype_cache", "encode_cache", "protocol_error", "timestamp_type",
                             "zero_copy_bytes", "max_ndim", "packer_type", "msgpack_unpackb",
                             "extra_data", "malformed_errors", "refuse_ext", "limits_type",
                             "default_limits", NULL};
    PyObject *hook, *dflt, *check, *pack, *unpack, *dcache, *ecache, *perr, *ts;
    PyObject *ptype, *munpack, *extra, *malformed, *refuse, *ltype, *dlimits;
    Py_ssize_t zc, nd;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwargs, "OOOOOO!O!OO!nnO!OOO!OO!O:configure", kwlist, &hook, &dflt, &check,
            &pack, &unpack, &PyDict_Type, &dcache, &PyDict_Type, &ecache, &perr, &PyType_Type,
            &ts, &zc, &nd, &PyType_Type, &ptype, &munpack, &extra, &PyTuple_Type, &malformed,
            &refuse, &PyType_Type, &ltype, &dlimits))
        return NULL;
    if (nd < 0 || nd > FAST_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "max_ndim must be between 0 and %d", FAST_MAX_NDIM);
        return NULL;
    }
    /* This module's own functions, as msgpack will call them. */
    PyObject *own_hook = PyObject_GetAttrString(self, "object_hook");
    PyObject *own_default = own_hook ? PyObject_GetAttrString(self, "encode_default") : NULL;
    PyObject *pkw = own_default ? Py_BuildValue("{sOsO}", "default", own_default,
                                                "use_bin_type", Py_True)
                                : NULL;
    Py_XDECREF(own_default);
    if (pkw == NULL) {
        Py_XDECREF(own_hook);
        return NULL;
    }
    Py_XSETREF(fast_object_hook, own_hook);
    Py_XSETREF(packer_kwargs, pkw);
    Py_XSETREF(py_packb, Py_NewRef(pack));
    Py_XSETREF(py_unpackb, Py_NewRef(unpack));
    Py_XSETREF(packer_type, Py_NewRef(ptype));
    Py_XSETREF(msgpack_unpackb, Py_NewRef(munpack));
    Py_XSETREF(extra_data, Py_NewRef(extra));
    Py_XSETREF(malformed_errors, Py_NewRef(malformed));
    Py_XSETREF(refuse_ext, Py_NewRef(refuse));
    Py_XSETREF(limits_type, Py_NewRef(ltype));
    Py_XSETREF(default_limits, Py_NewRef(dlimits));
    Py_CLEAR(spare_packer);
    Py_CLEAR(limits_entry);
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

/* codec._check_tree(obj, max_depth): 0, or -1 with the exception set. */
static int
tree_check(PyObject *obj, PyObject *max_depth_obj)
{
    Py_ssize_t max_depth = -1;
    if (PyLong_CheckExact(max_depth_obj)) {
        max_depth = PyLong_AsSsize_t(max_depth_obj);
        if (max_depth == -1 && PyErr_Occurred())
            PyErr_Clear(); /* OverflowError: Python's turn */
    }
    if (IS_CONTAINER(obj) && max_depth >= 0 && max_depth <= FAST_MAX_DEPTH)
        return walk(obj, 1, max_depth);
    PyObject *res = PyObject_CallFunctionObjArgs(py_check_tree, obj, max_depth_obj, NULL);
    if (res == NULL)
        return -1;
    Py_DECREF(res);
    return 0;
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
    if (tree_check(args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- packb ---------------------------------------------------------------------- */

/* codec.packb makes a msgpack.Packer per frame. Making and freeing one (with its
 * 256 KiB buffer) costs about 0.18 us, an eighth of a small frame's round trip, so
 * this keeps one between calls (SPARE_PACKER), but only while it is what a fresh one
 * would be. After a successful pack() a packer is back in its initial state (empty
 * buffer, nothing exported) except that its buffer never shrinks, so it is kept only
 * after a frame of at most REUSE_MAX_FRAME bytes, well under the initial buffer
 * (msgpack 1.x: 256 KiB), which such a frame cannot have grown. After a larger frame
 * or an error it is dropped and the next call makes a new one, exactly as codec.packb
 * does. (A long-lived frame-sized buffer is what codec.packb's comment warns about.)
 *
 * The packer is taken out of the slot while it packs: msgpack may run Python code
 * (codec._encode_default), another thread may call packb meanwhile, and that call then
 * makes its own packer instead of sharing a half-written buffer. */
#define REUSE_MAX_FRAME (64 * 1024)

static PyObject *
packb(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (py_packb == NULL)
        return not_configured();
    if (nargs != 1 || kwnames != NULL) /* packb(obj=...), or a wrong call: Python's */
        return PyObject_Vectorcall(py_packb, args, nargs, kwnames);
    PyObject *packer = spare_packer;
    spare_packer = NULL;
    if (packer == NULL) {
        /* msgpack.Packer(default=encode_default, use_bin_type=True) */
        packer = PyObject_Call(packer_type, empty_tuple, packer_kwargs);
        if (packer == NULL)
            return NULL;
    }
    /* packer.pack(obj); slot 0 is free for the callee (PY_VECTORCALL_ARGUMENTS_OFFSET). */
    PyObject *call[3] = {NULL, packer, args[0]};
    PyObject *frame = PyObject_VectorcallMethod(str_pack, call + 1,
                                                2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (frame != NULL && spare_packer == NULL && PyBytes_CheckExact(frame) &&
        PyBytes_GET_SIZE(frame) <= REUSE_MAX_FRAME)
        spare_packer = packer; /* the reference moves to the slot */
    else
        Py_DECREF(packer);
    return frame;
}

/* ---- unpackb -------------------------------------------------------------------- */

/* msgpack.unpackb's keyword arguments, as codec.unpackb passes them (UNPACK_KWNAMES,
 * interned, which lets msgpack's Cython argument parser match them by identity). The
 * values come from the Limits in use: LIMITS_ENTRY holds them for the last Limits
 * instance seen, as a tuple indexed by the E_ constants below. Limits is a frozen
 * dataclass, so an instance's values are read once. */
#define N_UNPACK_KW 9
enum { E_LIMITS, E_MAX_FRAME, E_MAX_STR, E_MAX_CONTAINER, E_MAX_DEPTH, E_SIZE };

/* The entry for LIMITS (a new reference): the cached one, or one read now and cached.
 * NULL with an exception set when out of memory. NULL with none when the values are
 * not all ints or the frame cap does not fit a Py_ssize_t: codec.unpackb's own
 * arithmetic then decides what happens. */
static PyObject *
limits_values(PyObject *limits)
{
    if (limits_entry != NULL && PyTuple_GET_ITEM(limits_entry, E_LIMITS) == limits)
        return Py_NewRef(limits_entry);
    PyObject *entry = PyTuple_New(E_SIZE);
    if (entry == NULL)
        return NULL;
    PyTuple_SET_ITEM(entry, E_LIMITS, Py_NewRef(limits));
    PyObject *names[E_SIZE] = {NULL, str_max_frame, str_max_str, str_max_container, str_max_depth};
    for (int i = 1; i < E_SIZE; i++) {
        PyObject *value = PyObject_GetAttr(limits, names[i]);
        if (value == NULL || !PyLong_CheckExact(value)) {
            Py_XDECREF(value);
            Py_DECREF(entry);
            PyErr_Clear(); /* codec.unpackb will raise it again */
            return NULL;
        }
        PyTuple_SET_ITEM(entry, i, value);
    }
    if (PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, E_MAX_FRAME)) == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        Py_DECREF(entry);
        return NULL;
    }
    /* Freeing the old entry runs no Python code: it holds ints and an exact Limits. */
    Py_XSETREF(limits_entry, Py_NewRef(entry));
    return entry;
}

/* The exception being raised, normalized, with its traceback, and cleared. */
static PyObject *
take_exception(void)
{
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* codec.unpackb's except clauses around msgpack.unpackb: a ProtocolError (from a
 * hook) goes through as it is; ExtraData and the malformed-frame exceptions become a
 * ProtocolError raised `from None` (no cause, the original kept as its context, as
 * Python's raise inside an except clause does); anything else goes through. */
static void
translate_unpack_error(void)
{
    if (PyErr_ExceptionMatches(protocol_error))
        return;
    int is_extra = PyErr_ExceptionMatches(extra_data);
    if (!is_extra && !PyErr_ExceptionMatches(malformed_errors))
        return;
    PyObject *exc = take_exception();
    if (exc == NULL)
        return; /* cannot happen: an exception was set */
    PyObject *message = NULL;
    if (is_extra) {
        PyObject *extra = PyObject_GetAttr(exc, str_extra);
        Py_ssize_t n = extra ? PyObject_Size(extra) : -1;
        Py_XDECREF(extra);
        if (n >= 0)
            message = PyUnicode_FromFormat("frame has %zd bytes after its message", n);
    }
    else {
        message = PyUnicode_FromFormat("malformed frame: %S", exc);
    }
    PyObject *error = message ? PyObject_CallOneArg(protocol_error, message) : NULL;
    Py_XDECREF(message);
    if (error == NULL) { /* the error making the message is what propagates */
        Py_DECREF(exc);
        return;
    }
    PyException_SetCause(error, NULL);  /* `from None`: also sets __suppress_context__ */
    PyException_SetContext(error, exc); /* steals exc */
    /* PyErr_Restore, unlike PyErr_SetObject, leaves the context alone. */
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(error)), error, NULL);
}

static PyObject *
unpackb(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (py_unpackb == NULL)
        return not_configured();
    /* The fast case: unpackb(frame: bytes) or unpackb(frame: bytes, limits: Limits).
     * Keywords, other frame types (text, bytearray, memoryview), Limits subclasses and
     * wrong calls go to codec.unpackb. */
    PyObject *limits = nargs == 2 ? args[1] : default_limits;
    if (kwnames != NULL || nargs < 1 || nargs > 2 || !PyBytes_CheckExact(args[0]) ||
        !Py_IS_TYPE(limits, (PyTypeObject *)limits_type))
        return PyObject_Vectorcall(py_unpackb, args, nargs, kwnames);
    PyObject *entry = limits_values(limits);
    if (entry == NULL)
        return PyErr_Occurred() ? NULL : PyObject_Vectorcall(py_unpackb, args, nargs, kwnames);

    PyObject *frame = args[0], *value = NULL;
    PyObject *max_frame = PyTuple_GET_ITEM(entry, E_MAX_FRAME);
    PyObject *max_container = PyTuple_GET_ITEM(entry, E_MAX_CONTAINER);
    Py_ssize_t size = PyBytes_GET_SIZE(frame);
    if (size > PyLong_AsSsize_t(max_frame)) { /* fits: limits_values checked */
        PyErr_Format(protocol_error, "frame of %zd bytes is over the %S-byte cap", size, max_frame);
        goto done;
    }
    if (size == 0) {
        PyErr_SetString(protocol_error, "empty frame");
        goto done;
    }
    /* msgpack.unpackb(frame, object_hook=..., raw=False, strict_map_key=True,
     *     max_str_len=, max_bin_len=, max_array_len=, max_map_len=, max_ext_len=,
     *     ext_hook=) -- in the order of unpack_kwnames; slot 0 is free for the callee. */
    PyObject *call[2 + N_UNPACK_KW] = {
        NULL, frame, fast_object_hook, Py_False, Py_True, PyTuple_GET_ITEM(entry, E_MAX_STR),
        max_frame, max_container, max_container, max_frame, refuse_ext,
    };
    value = PyObject_Vectorcall(msgpack_unpackb, call + 1, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                unpack_kwnames);
    if (value == NULL) {
        translate_unpack_error();
        goto done;
    }
    if (PyDict_CheckExact(value) || PyList_CheckExact(value)) {
        if (tree_check(value, PyTuple_GET_ITEM(entry, E_MAX_DEPTH)) < 0)
            Py_CLEAR(value);
    }
    else if (Py_IS_TYPE(value, (PyTypeObject *)timestamp_type)) {
        PyErr_SetString(protocol_error,
                        "msgpack extension type -1 (timestamp) is not part of the protocol");
        Py_CLEAR(value);
    }
done:
    Py_DECREF(entry);
    return value;
}

/* ---- entry points --------------------------------------------------------------- */

/* packb and unpackb are instances of this type rather than builtin functions: just as
 * cheap to call (vectorcall), but with an instance __dict__, so that codec.py can
 * functools.update_wrapper() them with the Python functions they stand in for. Their
 * __doc__, __name__ and __module__ are then those functions', and inspect.signature()
 * follows __wrapped__ to the Python signature, whose default (DEFAULT_LIMITS) a
 * builtin's text signature could not express. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *dict;
} EntryPoint;

static int
entry_traverse(EntryPoint *self, visitproc visit, void *arg)
{
    Py_VISIT(self->dict);
    return 0;
}

static int
entry_clear(EntryPoint *self)
{
    Py_CLEAR(self->dict);
    return 0;
}

static void
entry_dealloc(EntryPoint *self)
{
    PyObject_GC_UnTrack(self);
    entry_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Pickled by reference, as functions are: pickle looks __qualname__ up in __module__. */
static PyObject *
entry_reduce(PyObject *self, PyObject *unused)
{
    return PyObject_GetAttrString(self, "__qualname__");
}

/* Not bound when stored on a class, like a builtin function; having __get__ also makes
 * inspect.isroutine() true, so pydoc documents it as the function it stands in for. */
static PyObject *
entry_get(PyObject *self, PyObject *obj, PyObject *type)
{
    return Py_NewRef(self);
}

static PyMethodDef entry_methods[] = {
    {"__reduce__", entry_reduce, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef entry_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EntryPoint_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "services.protocol._speedups.EntryPoint",
    .tp_doc = "A C entry point of the codec (packb or unpackb).",
    .tp_basicsize = sizeof(EntryPoint),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(EntryPoint, vectorcall),
    .tp_dictoffset = offsetof(EntryPoint, dict),
    .tp_traverse = (traverseproc)entry_traverse,
    .tp_clear = (inquiry)entry_clear,
    .tp_dealloc = (destructor)entry_dealloc,
    .tp_methods = entry_methods,
    .tp_getset = entry_getset,
    .tp_descr_get = entry_get,
};

/* Adds an entry point NAME calling FN to the module; NULL on error. */
static PyObject *
add_entry_point(PyObject *module, const char *name, vectorcallfunc fn)
{
    EntryPoint *entry = PyObject_GC_New(EntryPoint, &EntryPoint_Type);
    if (entry == NULL)
        return NULL;
    entry->vectorcall = fn;
    entry->dict = Py_BuildValue("{ssss}", "__name__", name, "__qualname__", name);
    PyObject_GC_Track(entry);
    if (entry->dict == NULL || PyModule_AddObjectRef(module, name, (PyObject *)entry) < 0) {
        Py_DECREF(entry);
        return NULL;
    }
    Py_DECREF(entry); /* the module holds it */
    return (PyObject *)entry;
}

/* ---- module -------------------------------------------------------------------- */

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Hand over codec.py's fallbacks, caches, exceptions, limits and msgpack's entry points. "
     "Call once at import."},
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
                                       Py_None, k_shape, Py_None)) ||
        !(empty_tuple = PyTuple_New(0)) || !(str_pack = PyUnicode_InternFromString("pack")) ||
        !(str_extra = PyUnicode_InternFromString("extra")) ||
        !(str_max_frame = PyUnicode_InternFromString("max_frame_bytes")) ||
        !(str_max_str = PyUnicode_InternFromString("max_str_len")) ||
        !(str_max_container = PyUnicode_InternFromString("max_container_len")) ||
        !(str_max_depth = PyUnicode_InternFromString("max_depth")))
        return NULL;
    static const char *kwnames[N_UNPACK_KW] = {"object_hook", "raw", "strict_map_key",
                                               "max_str_len", "max_bin_len", "max_array_len",
                                               "max_map_len", "max_ext_len", "ext_hook"};
    if (!(unpack_kwnames = PyTuple_New(N_UNPACK_KW)))
        return NULL;
    for (int i = 0; i < N_UNPACK_KW; i++) {
        PyObject *name = PyUnicode_InternFromString(kwnames[i]);
        if (name == NULL)
            return NULL;
        PyTuple_SET_ITEM(unpack_kwnames, i, name);
    }
    if (PyType_Ready(&EntryPoint_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL || !add_entry_point(m, "packb", packb) || !add_entry_point(m, "unpackb", unpackb)) {
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
