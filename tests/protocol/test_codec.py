"""Codec: round trips, openpi interoperability, and refusal of every malformed frame."""

from __future__ import annotations

import functools

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from openpi_client import msgpack_numpy as openpi_msgpack_numpy

from services.protocol import codec
from services.protocol.codec import Limits, ProtocolError

# openpi-client's own codec (PyPI, dev extra): frames cross between it and us in both directions.
openpi_packb, openpi_unpackb = openpi_msgpack_numpy.packb, openpi_msgpack_numpy.unpackb

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
    "nested ext": (msgpack.packb({"a": [1, {"b": msgpack.ExtType(7, b"x")}]}), "extension type 7"),
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


@pytest.mark.parametrize("arr", [
    np.arange(codec._ZERO_COPY_ENCODE_BYTES, dtype=np.float64).reshape(-1, 8),  # packed from its own memory
    np.ones((224, 224, 3), np.uint8),
    np.arange(24, dtype=np.int16).reshape(4, 6).T,  # not contiguous: copied
], ids=["large", "image", "transposed"])
def test_frames_are_byte_identical_to_openpis(arr):
    obj = {"a": arr, "s": np.float32(1.5), "task": "reach-v3"}
    assert codec.packb(obj) == openpi_packb(obj)


def test_arrays_count_as_leaves_of_the_depth_cap():
    arr = np.arange(3, dtype=np.float32)
    frame = codec.packb({"a": {"b": arr}})
    np.testing.assert_array_equal(codec.unpackb(frame, Limits(max_depth=2))["a"]["b"], arr)
    with pytest.raises(ProtocolError, match="deeper than 1 levels"):
        codec.unpackb(frame, Limits(max_depth=1))


def test_arrays_inside_lists_and_nested_maps_are_decoded():
    arr = np.arange(6, dtype=np.int16).reshape(2, 3)
    out = codec.unpackb(codec.packb({"xs": [arr, {"y": [arr.T]}], "s": np.uint8(3)}))
    np.testing.assert_array_equal(out["xs"][0], arr)
    np.testing.assert_array_equal(out["xs"][1]["y"][0], arr.T)
    assert type(out["s"]) is np.uint8
