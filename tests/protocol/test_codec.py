"""Codec: round trips, openpi interoperability, and refusal of every malformed frame.

Every test runs twice: with the C accelerator (``_speedups``) and with the pure
Python functions it falls back to, which are the reference. The tests at the end
compare the two directly.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from services.protocol import codec
from services.protocol.codec import Limits, ProtocolError

PURE_REQUESTED = os.environ.get("EVALFORGE_PURE_PYTHON_CODEC") == "1"

# The codec's attributes for each implementation: the entry points packb and unpackb,
# and the callbacks the Python entry points use. The tests call codec.packb and
# codec.unpackb (never names imported from codec) so that the fixture's swap reaches them.
IMPLEMENTATIONS = {"pure": {"packb": codec._py_packb, "unpackb": codec._py_unpackb,
                            "_OBJECT_HOOK": codec._object_hook, "_DEFAULT": codec._encode_default,
                            "_CHECK_TREE": codec._check_tree}}
if codec.ACCELERATED:
    IMPLEMENTATIONS["accelerated"] = {
        "packb": codec._speedups.packb, "unpackb": codec._speedups.unpackb,
        "_OBJECT_HOOK": codec._speedups.object_hook, "_DEFAULT": codec._speedups.encode_default,
        "_CHECK_TREE": codec._speedups.check_tree,
    }


def _use(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    for attribute, implementation in IMPLEMENTATIONS[name].items():
        monkeypatch.setattr(codec, attribute, implementation)


# Module scope: hypothesis refuses function-scoped fixtures around @given tests.
@pytest.fixture(scope="module", autouse=True, params=["accelerated", "pure"])
def implementation(request):
    if request.param not in IMPLEMENTATIONS:
        pytest.skip("C accelerator not in use (EVALFORGE_PURE_PYTHON_CODEC=1, or not built: "
                    "see test_accelerator_is_built_and_in_use)")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _use(monkeypatch, request.param)
        yield request.param


# Runs once (under the pure parameter, so that it runs, and fails, where nothing was built).
@pytest.mark.parametrize("implementation", ["pure"], indirect=True)
def test_accelerator_is_built_and_in_use():
    if PURE_REQUESTED:
        pytest.skip("EVALFORGE_PURE_PYTHON_CODEC=1 turns the C accelerator off")
    from services.protocol import _speedups  # ImportError: `pip install -e .` did not build it

    assert codec.ACCELERATED
    assert codec._speedups is _speedups
    # What importers of the codec got (the fixture swaps only codec's own names, and
    # the package imported them from codec before any test ran).
    from services import protocol

    assert protocol.packb is _speedups.packb
    assert protocol.unpackb is _speedups.unpackb

# openpi's own msgpack_numpy, reproduced from its published behaviour, to prove
# that frames cross between the two implementations in both directions.


def _openpi_pack_array(obj):
    if isinstance(obj, np.ndarray | np.generic) and obj.dtype.kind in ("V", "O", "c"):
        raise ValueError(f"Unsupported dtype: {obj.dtype}")
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": obj.tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    return obj


def _openpi_unpack_array(obj):
    if b"__ndarray__" in obj:
        return np.ndarray(buffer=obj[b"data"], dtype=np.dtype(obj[b"dtype"]), shape=obj[b"shape"])
    if b"__npgeneric__" in obj:
        return np.dtype(obj[b"dtype"]).type(obj[b"data"])
    return obj


openpi_packb = functools.partial(msgpack.packb, default=_openpi_pack_array)
openpi_unpackb = functools.partial(msgpack.unpackb, object_hook=_openpi_unpack_array)

SUPPORTED_DTYPES = [
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64,
]


def _dtype_strategy():
    endian = st.sampled_from(["<", ">"])
    return st.one_of(
        st.sampled_from([np.dtype(t) for t in SUPPORTED_DTYPES]),
        st.builds(lambda e, t: np.dtype(t).newbyteorder(e), endian,
                  st.sampled_from([np.int32, np.uint16, np.float32, np.float64])),
    )


@settings(max_examples=300, deadline=None)
@given(hnp.arrays(dtype=_dtype_strategy(), shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)))
def test_every_supported_dtype_and_shape_round_trips(arr):
    out = codec.unpackb(codec.packb({"x": arr}))["x"]
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


@settings(max_examples=100, deadline=None)
@given(hnp.arrays(dtype=st.sampled_from([np.float32, np.uint8, np.int64]), shape=hnp.array_shapes(max_dims=3)))
def test_frames_cross_between_openpi_and_us_in_both_directions(arr):
    np.testing.assert_array_equal(openpi_unpackb(codec.packb({"a": arr}))["a"], arr)
    np.testing.assert_array_equal(codec.unpackb(openpi_packb({"a": arr}))["a"], arr)


def test_numpy_scalars_round_trip_with_their_dtype():
    for value in [np.float32(1.5), np.int64(-3), np.uint8(200), np.bool_(True), np.float16(0.5)]:
        out = codec.unpackb(codec.packb({"v": value}))["v"]
        assert type(out) is type(value) and out == value
        assert codec.unpackb(openpi_packb({"v": value}))["v"] == value
    # np.float64 subclasses Python's float, so msgpack sends it as a plain float (openpi too).
    assert codec.unpackb(codec.packb(np.float64(2.25))) == 2.25


def test_non_contiguous_arrays_are_sent_as_their_logical_contents():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    for view in (base.T, base[:, ::2], base[::-1]):
        np.testing.assert_array_equal(codec.unpackb(codec.packb(view)), view)


def test_decoded_arrays_are_read_only_views_not_copies():
    arr = np.arange(1000, dtype=np.float32)
    out = codec.unpackb(codec.packb({"a": arr}))["a"]
    assert not out.flags.writeable
    assert not out.flags.owndata
    assert isinstance(out.base, bytes)


def test_text_keyed_array_maps_are_accepted_for_other_languages():
    frame = msgpack.packb({"__ndarray__": True, "data": b"\x01\x00\x02\x00", "dtype": "<u2", "shape": [2]})
    np.testing.assert_array_equal(codec.unpackb(frame), np.array([1, 2], dtype=np.uint16))


@pytest.mark.parametrize("dtype", [np.complex64, object, np.dtype([("a", "<f4")]), np.dtype("V8")])
def test_encoder_refuses_object_void_and_complex_dtypes(dtype):
    with pytest.raises(TypeError, match="refused"):
        codec.packb(np.zeros(2, dtype=dtype))


def test_encoder_refuses_unknown_python_objects():
    with pytest.raises(TypeError, match="cannot encode"):
        codec.packb({"x": object()})


def _array_frame(data: bytes, dtype: object, shape: object) -> bytes:
    return msgpack.packb({b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape})


BAD_FRAMES = {
    "truncated": (codec.packb({"state": np.zeros(39, np.float32), "task": "reach"})[:-7], "malformed"),
    "shape larger than data": (_array_frame(b"\x00" * 8, "<f4", [3]), "needs 12 bytes"),
    "shape smaller than data": (_array_frame(b"\x00" * 16, "<f4", [3]), "carries 16"),
    "negative shape": (_array_frame(b"", "<f4", [-1]), "non-negative"),
    "huge shape": (_array_frame(b"\x00" * 4, "<f4", [2**62, 2**62]), "needs"),
    "shape not a list": (_array_frame(b"\x00" * 4, "<f4", 1), "shape must be a list"),
    "float in shape": (_array_frame(b"\x00" * 4, "<f4", [1.0]), "non-negative integer"),
    "too many dims": (_array_frame(b"\x00" * 4, "<f4", [1] * 40), "dimensions"),
    "object dtype": (_array_frame(b"\x00" * 8, "|O", [1]), "refused"),
    "complex dtype": (_array_frame(b"\x00" * 8, "<c8", [1]), "refused"),
    "void dtype": (_array_frame(b"\x00" * 8, "|V8", [1]), "refused"),
    "structured dtype": (_array_frame(b"\x00" * 8, "[('a', '<f8')]", [1]), "dtype"),
    "nonsense dtype": (_array_frame(b"\x00" * 8, "not-a-dtype", [1]), "not a NumPy dtype"),
    "zero itemsize": (_array_frame(b"", "<U0", [3]), "zero item size"),
    "dtype not a string": (_array_frame(b"\x00" * 4, 5, [1]), "dtype must be a string"),
    "data not binary": (msgpack.packb({b"__ndarray__": True, b"data": "text", b"dtype": "<f4", b"shape": [1]}), "binary"),
    "missing data": (msgpack.packb({b"__ndarray__": True, b"dtype": "<f4", b"shape": [1]}), "'data'"),
    "ext type": (msgpack.packb(msgpack.ExtType(5, b"abc")), "extension"),
    "timestamp ext": (msgpack.packb(msgpack.Timestamp(1, 0)), "extension type -1"),
    "nested timestamp ext": (msgpack.packb({"t": [msgpack.Timestamp(1, 0)]}), "extension type -1"),
    "deep nesting": (msgpack.packb(functools.reduce(lambda acc, _: [acc], range(40), 0)), "deeper than 32"),
    "deep maps": (msgpack.packb(functools.reduce(lambda acc, _: {"k": acc}, range(40), 0)), "deeper than 32"),
    "extra bytes": (codec.packb({"a": 1}) + b"\x00", "after its message"),
    "empty": (b"", "empty frame"),
    "reserved byte": (b"\xc1", "malformed"),
    "non-string map key": (msgpack.packb({1: 2}), "malformed"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_malformed_frames_raise_protocol_error_naming_the_problem(name):
    frame, pattern = BAD_FRAMES[name]
    with pytest.raises(ProtocolError, match=pattern):
        codec.unpackb(frame)


def test_text_frames_are_refused():
    with pytest.raises(ProtocolError, match="text frames"):
        codec.unpackb('{"type": "ping"}')  # type: ignore[arg-type]


def test_frame_size_string_and_container_caps():
    limits = Limits(max_frame_bytes=1000, max_str_len=10, max_container_len=5)
    with pytest.raises(ProtocolError, match="over the 1000-byte cap"):
        codec.unpackb(b"\x00" * 1001, limits)
    with pytest.raises(ProtocolError, match="malformed"):
        codec.unpackb(msgpack.packb("x" * 11), limits)
    with pytest.raises(ProtocolError, match="malformed"):
        codec.unpackb(msgpack.packb(list(range(6))), limits)
    with pytest.raises(ProtocolError, match="malformed"):
        codec.unpackb(msgpack.packb({str(i): i for i in range(6)}), limits)
    assert codec.unpackb(msgpack.packb(list(range(5))), limits) == [0, 1, 2, 3, 4]


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=256))
def test_random_bytes_decode_or_raise_protocol_error(frame):
    try:
        codec.unpackb(frame)
    except ProtocolError:
        pass


@settings(max_examples=500, deadline=None)
@given(st.data())
def test_mutated_valid_frames_decode_or_raise_protocol_error(data):
    frame = bytearray(codec.packb({"type": "infer", "request_id": 7, "obs": {"state": np.ones(5, np.float32), "task": "t"}}))
    for _ in range(data.draw(st.integers(1, 4))):
        index = data.draw(st.integers(0, len(frame) - 1))
        frame[index] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(1, len(frame)))
    try:
        codec.unpackb(bytes(frame[:cut]))
    except ProtocolError:
        pass


# The accelerator against the reference: same bytes out, same values or the same
# error back. These switch implementation themselves, so they run once.


def needs_accelerator(test):
    test = pytest.mark.parametrize("implementation", ["accelerated"], indirect=True)(test)
    return pytest.mark.skipif(not codec.ACCELERATED, reason="C accelerator not in use")(test)


def _outcome(fn, *args, **kwargs):
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # the exception is the outcome being compared
        return type(exc), str(exc)


def _both(fn, *args, **kwargs):
    """The outcome of ``codec.<fn>(*args, **kwargs)`` under each implementation."""
    outcomes = {}
    for name in ("accelerated", "pure"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            _use(monkeypatch, name)
            outcomes[name] = _outcome(getattr(codec, fn), *args, **kwargs)
    return outcomes["accelerated"], outcomes["pure"]


def _assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, np.ndarray):
        assert (a.dtype, a.shape, a.flags.writeable, a.flags.c_contiguous, a.flags.aligned) == (
            b.dtype, b.shape, b.flags.writeable, b.flags.c_contiguous, b.flags.aligned)
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b or (a != a and b != b)  # NaN scalars


def _assert_same_outcome(fn, *args):
    (kind_a, a), (kind_b, b) = _both(fn, *args)
    assert kind_a == kind_b, (a, b)
    _assert_same(a, b)


@needs_accelerator
@settings(max_examples=300, deadline=None)
@given(hnp.arrays(dtype=_dtype_strategy(), shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)),
       st.sampled_from(["plain", "transposed", "large"]))
def test_accelerated_and_pure_encoders_write_the_same_bytes(arr, layout):
    if layout == "transposed":
        arr = arr.T
    elif layout == "large":  # over the zero-copy threshold: packed from a memoryview
        arr = np.resize(arr, (codec._ZERO_COPY_ENCODE_BYTES // max(arr.itemsize, 1) + 3,))
    (kind_a, a), (kind_b, b) = _both("packb", {"x": arr, "s": arr.dtype.type(0) if arr.size else 1})
    assert kind_a == kind_b == "ok"
    assert a == b


@needs_accelerator
@settings(max_examples=1000, deadline=None)
@given(st.data())
def test_accelerated_and_pure_decoders_agree_on_mutated_frames(data):
    obs = {"state": np.arange(6, dtype=np.float32).reshape(2, 3), "n": np.int16(3), "t": [{"k": "v"}, [1]]}
    frame = bytearray(codec.packb({"type": "infer", "request_id": 7, "obs": obs}))
    for _ in range(data.draw(st.integers(1, 4))):
        frame[data.draw(st.integers(0, len(frame) - 1))] = data.draw(st.integers(0, 255))
    frame = bytes(frame[: data.draw(st.integers(1, len(frame)))])
    _assert_same_outcome("unpackb", frame)
    _assert_same_outcome("unpackb", frame, Limits(max_depth=2, max_container_len=3))


ODD_MAPS = {
    "text keys": {"__ndarray__": True, "data": b"\x00" * 4, "dtype": "<f4", "shape": [1]},
    "both markers": {b"__ndarray__": True, b"__npgeneric__": True, b"data": b"\x00" * 4, b"dtype": "<f4", b"shape": [1]},
    "text generic marker": {"__npgeneric__": True, "data": 3, "dtype": "<i4"},
    "generic": {b"__npgeneric__": True, b"data": 3, b"dtype": "<i8"},
    "bool in shape": {b"__ndarray__": True, b"data": b"\x00" * 4, b"dtype": "<f4", b"shape": [True]},
    "tuple shape": {b"__ndarray__": True, b"data": b"\x00" * 8, b"dtype": "<f4", b"shape": (2,)},
    "shape overflows": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**62, 2**62, 0]},
    "shape overflows int64": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**70, 0]},
    "huge but empty": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**40, 0]},
    "too big but empty": {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": [2**61, 0]},
    "33 dims": {b"__ndarray__": True, b"data": b"\x00" * 4, b"dtype": "<f4", b"shape": [1] * 33},
    "32 dims": {b"__ndarray__": True, b"data": b"\x00" * 4, b"dtype": "<f4", b"shape": [1] * 32},
    "0-d": {b"__ndarray__": True, b"data": b"\x00" * 8, b"dtype": "<f8", b"shape": []},
    "empty": {b"__ndarray__": True, b"data": b"", b"dtype": "<u2", b"shape": [3, 0]},
    "big-endian": {b"__ndarray__": True, b"data": b"\x00\x01" * 6, b"dtype": ">i2", b"shape": [2, 3]},
    "data is None": {b"__ndarray__": True, b"data": None, b"dtype": "<f4", b"shape": [1], "data": b"\x00" * 4},
    "bytearray data": {b"__ndarray__": True, b"data": bytearray(4), b"dtype": "<f4", b"shape": [1]},
    "unseen dtype": {b"__ndarray__": True, b"data": b"\x00" * 8, b"dtype": "<u8", b"shape": [1]},
    "non-string key": {1: 2, b"__ndarray__": True},
    "plain": {"a": 1, b"b": 2},
    "similar keys": {b"__ndarray_": 1, "__npgeneri__": 2, b"dat": 3},
}


@needs_accelerator
@pytest.mark.parametrize("name", list(ODD_MAPS))
def test_accelerated_object_hook_matches_python_on_odd_maps(name):
    obj = ODD_MAPS[name]
    for _ in range(2):  # the second time, any dtype the first accepted is cached
        a = _outcome(codec._speedups.object_hook, dict(obj))
        b = _outcome(codec._object_hook, dict(obj))
        assert a[0] == b[0], (a, b)
        _assert_same(a[1], b[1])


@needs_accelerator
@pytest.mark.parametrize("tree, max_depth", [
    ([[msgpack.Timestamp(1, 0)], [[[1]]]], 3),  # too deep is found first (children last-first)
    ([[[[1]]], [msgpack.Timestamp(1, 0)]], 3),
    ({"a": [[[1]]], "b": msgpack.Timestamp(1, 0)}, 3),  # a node's own values are scanned first
    ({"a": [[1]], "b": {"c": [2]}}, 3),
    ([[]], 1),
    ([[]], 0),
    ([1], -1),
    ([[[1]]], 2000),  # over the C cap: the Python walk
    ("not a container", 3),
    ([1], 2**80),
    ([1], 3.0),
    ([np.zeros(3)], 1),
])
def test_accelerated_check_tree_matches_python(tree, max_depth):
    a = _outcome(codec._speedups.check_tree, tree, max_depth)
    b = _outcome(codec._check_tree, tree, max_depth)
    assert a == b


@needs_accelerator
def test_accelerated_encoder_defers_everything_unusual_to_python():
    class Sub(np.ndarray):
        pass

    cases = [np.float32(1.5), np.arange(6, dtype=np.int32).reshape(2, 3).T, np.zeros(3).view(Sub),
             np.zeros(2, np.complex64), object(), np.zeros((0, 5), ">f8")]
    for obj in cases:
        a, b = _outcome(codec._speedups.encode_default, obj), _outcome(codec._encode_default, obj)
        assert a[0] == b[0], (a, b)
        if a[0] == "ok":
            a, b = a[1], b[1]
            assert list(a) == list(b)
            for key in a:
                assert (bytes(a[key]) if isinstance(a[key], memoryview) else a[key]) == (
                    bytes(b[key]) if isinstance(b[key], memoryview) else b[key])


@needs_accelerator
def test_accelerated_encoder_keeps_large_arrays_alive_through_its_memoryview():
    arr = np.arange(codec._ZERO_COPY_ENCODE_BYTES, dtype=np.float64).reshape(-1, 8)
    expected = arr.tobytes()
    codec._encode_default(arr)  # caches the dtype string
    view = codec._speedups.encode_default(arr)[b"data"]
    del arr
    assert (view.format, view.ndim, view.readonly) == ("B", 1, True)
    assert bytes(view) == expected


def test_entry_points_keep_their_signatures_and_docstrings(implementation):
    for name in ("packb", "unpackb"):
        fn, reference = getattr(codec, name), getattr(codec, f"_py_{name}")
        assert fn.__doc__ == reference.__doc__
        assert [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()] == [
            (p.name, p.kind, p.default) for p in inspect.signature(reference).parameters.values()]
    assert inspect.signature(codec.unpackb).parameters["limits"].default is codec.DEFAULT_LIMITS


class _LimitsSubclass(Limits):
    pass


_FRAME = codec._py_packb({"state": np.arange(4, dtype=np.float32), "task": "t", "n": [1, {"k": b"v"}]})
ODD_CALLS = {
    # name: (args, kwargs)
    "bytes": ((_FRAME,), {}),
    "with limits": ((_FRAME, Limits(max_str_len=3)), {}),
    "keywords": ((), {"frame": _FRAME, "limits": Limits(max_depth=1)}),
    "limits keyword": ((_FRAME,), {"limits": Limits(max_depth=1)}),
    "bytearray": ((bytearray(_FRAME),), {}),
    "memoryview": ((memoryview(_FRAME),), {}),
    "text": (("text",), {}),
    "None": ((None,), {}),
    "no arguments": ((), {}),
    "three arguments": ((_FRAME, codec.DEFAULT_LIMITS, 1), {}),
    "unknown keyword": ((_FRAME,), {"limit": codec.DEFAULT_LIMITS}),
    "limits subclass": ((_FRAME, _LimitsSubclass(max_depth=1)), {}),
    "limits not Limits": ((_FRAME, None), {}),
    "huge frame cap": ((_FRAME, Limits(max_frame_bytes=2**80)), {}),
    "negative frame cap": ((_FRAME, Limits(max_frame_bytes=-1)), {}),
    "text frame cap": ((_FRAME, Limits(max_frame_bytes="x")), {}),  # type: ignore[arg-type]
    "float depth": ((_FRAME, Limits(max_depth=2.5)), {}),  # type: ignore[arg-type]
    "text depth": ((_FRAME, Limits(max_depth="x")), {}),  # type: ignore[arg-type]
    "float str cap": ((_FRAME, Limits(max_str_len=2.0)), {}),  # type: ignore[arg-type]
    "frame over cap": ((_FRAME, Limits(max_frame_bytes=len(_FRAME) - 1)), {}),
    "frame at cap": ((_FRAME, Limits(max_frame_bytes=len(_FRAME))), {}),
    "empty": ((b"",), {}),
    "empty bytearray": ((bytearray(),), {}),
    "top-level timestamp": ((msgpack.packb(msgpack.Timestamp(1, 0)),), {}),
    "top-level scalar": ((msgpack.packb(3),), {}),
    "top-level array": ((codec._py_packb(np.arange(3)),), {}),
    "bytes subclass": ((type("B", (bytes,), {})(_FRAME),), {}),
}


@needs_accelerator
@pytest.mark.parametrize("name", list(ODD_CALLS))
def test_accelerated_unpackb_matches_python_on_odd_calls(name):
    args, kwargs = ODD_CALLS[name]
    for _ in range(2):  # the second time through the accelerator's limits cache
        (kind_a, a), (kind_b, b) = _both("unpackb", *args, **kwargs)
        assert kind_a == kind_b, (a, b)
        _assert_same(a, b)


def _raised(fn, *args):
    with pytest.raises(Exception) as info:  # noqa: PT011 -- any exception, compared below
        fn(*args)
    return info.value


@needs_accelerator
@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_accelerated_unpackb_raises_the_same_exception_as_python(name):
    frame, _ = BAD_FRAMES[name]
    exc_a = _raised(codec._speedups.unpackb, frame)
    exc_b = _raised(codec._py_unpackb, frame)
    assert (type(exc_a), str(exc_a)) == (type(exc_b), str(exc_b))
    # `raise ProtocolError(...) from None` inside the except clause: no cause shown,
    # and the msgpack exception kept as the context.
    for attribute in ("__cause__", "__context__"):
        a, b = getattr(exc_a, attribute), getattr(exc_b, attribute)
        assert (type(a), str(a)) == (type(b), str(b))
    assert exc_a.__suppress_context__ == exc_b.__suppress_context__


class _Boom(Exception):
    pass


@needs_accelerator
@pytest.mark.parametrize("error", [_Boom("boom"), ValueError("bad value"), ProtocolError("bad map"),
                                   RecursionError("deep"), KeyError("k")])
def test_accelerated_unpackb_maps_exceptions_from_hooks_like_python(monkeypatch, error):
    # Text keys send the map to the Python object hook, which reads fields with _field.
    def field(obj, name):
        raise error

    monkeypatch.setattr(codec, "_field", field)
    frame = msgpack.packb({"obs": {"__ndarray__": True, "data": b"\x00" * 4}})
    exc_a = _raised(codec._speedups.unpackb, frame)
    exc_b = _raised(codec._py_unpackb, frame)
    assert (type(exc_a), str(exc_a)) == (type(exc_b), str(exc_b))
    assert type(exc_a.__context__) is type(exc_b.__context__)
    assert exc_a.__suppress_context__ == exc_b.__suppress_context__
    if type(error) in (_Boom, ProtocolError, KeyError):  # not the malformed-frame kinds
        assert exc_a is error


@needs_accelerator
def test_accelerated_packb_matches_python_on_odd_calls():
    arr = np.arange(6, dtype=np.int32).reshape(2, 3)
    for args, kwargs in [((arr,), {}), ((), {"obj": arr}), ((), {}), ((arr, arr), {}),
                         ((), {"o": arr}), (({"x": object()},), {}), (({"a": arr.T, "b": np.float32(1)},), {})]:
        (kind_a, a), (kind_b, b) = _both("packb", *args, **kwargs)
        assert (kind_a, a) == (kind_b, b)


@needs_accelerator
def test_accelerated_packb_starts_each_frame_afresh_after_large_frames_and_errors():
    small = {"state": np.arange(39, dtype=np.float32), "task": "reach-v3", "n": np.int8(3)}
    sequence = [
        small,
        {"image": np.ones((224, 224, 3), np.uint8), "task": "large"},  # grows a packer's buffer
        small,
        {"a": np.zeros(3), "b": object()},  # fails halfway through
        small,
        {"a": np.zeros(3), "bad": np.zeros(2, np.complex64)},  # fails in the Python fallback
        small,
        "x" * 70_000,  # just over the size a packer is kept after
        small,
        {"nested": [[small] * 3] * 3},
    ]
    for obj in sequence * 3:
        (kind_a, a), (kind_b, b) = _both("packb", obj)
        assert (kind_a, a) == (kind_b, b)


@needs_accelerator
def test_accelerated_packb_is_safe_across_threads():
    # Python fallbacks (NumPy scalars, non-contiguous arrays) let other threads run in
    # the middle of a frame; each frame must still come out whole.
    objs = [{"i": i, "s": np.float32(i), "t": np.arange(12, dtype=np.int16).reshape(3, 4).T * i,
             "pad": "x" * (i * 997 % 5000)} for i in range(40)]
    expected = [codec._py_packb(obj) for obj in objs]
    failures = []

    def work():
        for _ in range(200):
            for obj, frame in zip(objs, expected, strict=True):
                if codec._speedups.packb(obj) != frame:
                    failures.append(obj["i"])

    threads = [threading.Thread(target=work) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert failures == []
