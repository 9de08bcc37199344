"""MessagePack codec for the policy wire protocol, byte-compatible with openpi's.

NumPy arrays travel the way openpi's ``msgpack_numpy`` sends them: a map with the
binary keys ``__ndarray__`` (true), ``data`` (the raw bytes), ``dtype``
(``numpy.dtype.str``) and ``shape``; NumPy scalars as ``__npgeneric__``, ``data``
(the Python value) and ``dtype``. Maps with text keys of the same names are read
too, for clients in other languages.

Decoding treats every frame as hostile:

- the frame, every string, binary, array and map is capped (``Limits``), and so
  is nesting depth;
- extension types are refused, and pickle is never used;
- object, void (structured) and complex dtypes are refused, and so are
  zero-size item types;
- ``len(data)`` must equal ``prod(shape) * itemsize`` exactly, with the product
  taken in Python integers so a huge shape cannot overflow.

Anything wrong raises ``ProtocolError`` naming the problem. Decoded arrays are
read-only views over the buffer msgpack's C unpacker produced for the frame: no
per-array copy is made, as in openpi.

Pure Python over msgpack's C extension, nothing to compile. Decoding lets msgpack
build plain containers (no per-map ``object_hook`` call from C, no ``ext_hook``) and
then walks the tree once, converting array and scalar maps in place and checking
depth and extension types on the way; the common array (openpi's keys, a dtype seen
before) takes a short path. Encoding packs arrays through one ``default`` callback.
With all its checks it stays faster than openpi-client's own codec on the same
payloads (``bench/protocol_codec.py`` measures both; ``docs/benchmarks.md`` has the
figures).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from math import prod
from typing import Any

import msgpack
import numpy as np

__all__ = ["DEFAULT_LIMITS", "Limits", "ProtocolError", "packb", "unpackb"]


class ProtocolError(ValueError):
    """A frame or message that does not follow the wire protocol."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Caps applied while decoding one frame."""

    max_frame_bytes: int = 64 * 1024 * 1024
    max_depth: int = 32
    max_str_len: int = 1024 * 1024
    max_container_len: int = 65536


DEFAULT_LIMITS = Limits()

_REFUSED_DTYPE_KINDS = frozenset("OVc")
MAX_NDIM = 32
# Arrays at least this large are packed from their own memory rather than through
# tobytes(): below it, building the memoryview costs more than the copy.
_ZERO_COPY_ENCODE_BYTES = 16 * 1024
# Accepted dtype strings, parsed once. Bounded so a peer cannot grow it forever.
_DTYPE_CACHE: dict[str, np.dtype] = {}
_DTYPE_CACHE_MAX = 256
_ENCODE_DTYPE_STR: dict[np.dtype, str] = {}
_frombuffer, _ndarray = np.frombuffer, np.ndarray  # (module globals: one attribute lookup less per array)
_Timestamp, _ExtType = msgpack.Timestamp, msgpack.ExtType


def _field(obj: dict, name: str) -> Any:
    """Read ``name`` from an array map whose keys may be binary (openpi) or text."""
    value = obj.get(name.encode())
    if value is None:
        value = obj.get(name)
    if value is None:
        raise ProtocolError(f"array map is missing its '{name}' field")
    return value


def _dtype(spec: Any) -> np.dtype:
    dtype = _DTYPE_CACHE.get(spec) if type(spec) is str else None
    if dtype is not None:
        return dtype
    if not isinstance(spec, str):
        raise ProtocolError(f"array dtype must be a string like '<f4', got {type(spec).__name__}")
    try:
        dtype = np.dtype(spec)
    except (TypeError, ValueError, SyntaxError) as exc:
        raise ProtocolError(f"array dtype {spec[:40]!r} is not a NumPy dtype") from exc
    if dtype.kind in _REFUSED_DTYPE_KINDS or dtype.fields is not None or dtype.subdtype is not None:
        raise ProtocolError(f"array dtype {spec[:40]!r} is refused: object, void, structured and complex dtypes are not allowed")
    if dtype.itemsize == 0:
        raise ProtocolError(f"array dtype {spec[:40]!r} has a zero item size")
    if len(_DTYPE_CACHE) < _DTYPE_CACHE_MAX:
        _DTYPE_CACHE[spec] = dtype
    return dtype


def _shape(spec: Any) -> tuple[int, ...]:
    if not isinstance(spec, list | tuple):
        raise ProtocolError(f"array shape must be a list of integers, got {type(spec).__name__}")
    if len(spec) > MAX_NDIM:
        raise ProtocolError(f"array shape has {len(spec)} dimensions; the limit is {MAX_NDIM}")
    for dim in spec:
        if type(dim) is not int or dim < 0:
            raise ProtocolError(f"array shape {list(spec)[:8]} has an entry that is not a non-negative integer: {dim!r}")
    return tuple(spec)


def _decode_ndarray(obj: dict) -> np.ndarray:
    """An array map → a read-only array over its data; the checks of the module docstring.

    ``_decode_map`` takes the common case (openpi's keys, a dtype accepted before, a shape
    that fits the data) itself and hands everything else to this function.
    """
    data = obj.get(b"data")
    spec = obj.get(b"dtype")
    shape = obj.get(b"shape")
    if data is None:
        data = _field(obj, "data")
    if type(data) is not bytes:
        raise ProtocolError(f"array data must be binary, got {type(data).__name__}")
    dtype = _dtype(_field(obj, "dtype") if spec is None else spec)
    shape = _shape(_field(obj, "shape") if shape is None else shape)
    expected = prod(shape) * dtype.itemsize
    if expected != len(data):
        raise ProtocolError(
            f"array of shape {list(shape)} and dtype {dtype.str} needs {expected} bytes of data, the frame carries {len(data)}"
        )
    if len(shape) == 1:
        return np.frombuffer(data, dtype)
    return np.ndarray(shape, dtype, data)


def _decode_generic(obj: dict) -> np.generic:
    dtype = _dtype(_field(obj, "dtype"))
    value = _field(obj, "data")
    if not isinstance(value, bool | int | float | str | bytes):
        raise ProtocolError(f"NumPy scalar data must be a plain value, got {type(value).__name__}")
    try:
        return dtype.type(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"NumPy scalar {value!r} does not fit dtype {dtype.str}") from exc


def _encode_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        dtype = obj.dtype
        dtype_str = _ENCODE_DTYPE_STR.get(dtype)
        if dtype_str is None:
            if dtype.kind in _REFUSED_DTYPE_KINDS:
                raise TypeError(f"cannot send an array of dtype {dtype}: object, void and complex dtypes are refused")
            dtype_str = dtype.str
            if len(_ENCODE_DTYPE_STR) < _DTYPE_CACHE_MAX:
                _ENCODE_DTYPE_STR[dtype] = dtype_str
        if obj.nbytes >= _ZERO_COPY_ENCODE_BYTES and obj.flags.c_contiguous:
            data = memoryview(obj.reshape(-1).view(np.uint8))
        else:
            data = obj.tobytes()
        return {b"__ndarray__": True, b"data": data, b"dtype": dtype_str, b"shape": obj.shape}
    if isinstance(obj, np.generic):
        if obj.dtype.kind in _REFUSED_DTYPE_KINDS:
            raise TypeError(f"cannot send a scalar of dtype {obj.dtype}: object, void and complex dtypes are refused")
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot encode {type(obj).__name__} in a protocol frame")


def packb(obj: Any) -> bytes:
    """Encode ``obj`` (dicts, lists, scalars, strings, bytes, NumPy arrays and scalars)."""
    # A fresh packer per frame: a long-lived one keeps a frame-sized buffer whose
    # reuse defeats the allocator and made large round trips 10x slower. This is
    # msgpack.packb without its Python wrapper, which costs 0.2 µs a call.
    return msgpack.Packer(default=_encode_default, use_bin_type=True).pack(obj)


class _TooDeep(Exception):
    """Raised while decoding the tree; ``unpackb`` turns it into a ``ProtocolError`` naming the cap."""


def _refuse_leaf(value: Any) -> None:
    if type(value) is _Timestamp:
        raise ProtocolError("msgpack extension type -1 (timestamp) is not part of the protocol")
    raise ProtocolError(f"msgpack extension type {value.code} is not part of the protocol")


def _decode_map(obj: dict, levels: int) -> Any:
    """An array or scalar map → its NumPy value; any other map is checked and decoded in place.

    msgpack hands over plain containers (no ``object_hook``: a call from C per map costs more
    than this one walk), and this walk does what the hook and a depth check did: converts the
    array and scalar maps, refuses nesting deeper than ``levels`` and extension types (which
    come out as ``ExtType`` or ``Timestamp`` without an ``ext_hook``; msgpack's C unpacker
    decodes timestamps itself, so a hook would never see them). Arrays count as leaves.
    """
    if b"__ndarray__" in obj:
        # The common case (openpi's keys, a dtype accepted before, a shape that fits the
        # data) here; everything else, with its checks and errors, in _decode_ndarray.
        data = obj.get(b"data")
        spec = obj.get(b"dtype")
        shape = obj.get(b"shape")
        if type(data) is bytes and type(spec) is str and type(shape) is list:
            dtype = _DTYPE_CACHE.get(spec)
            if dtype is not None:
                ndim = len(shape)
                if ndim == 1:  # states and actions: no loop
                    n = shape[0]
                    if type(n) is int and n >= 0 and n * dtype.itemsize == len(data):
                        return _frombuffer(data, dtype)
                elif ndim <= MAX_NDIM:
                    size = dtype.itemsize
                    for dim in shape:
                        if type(dim) is not int or dim < 0:
                            break
                        size *= dim
                    else:
                        if size == len(data):
                            return _ndarray(shape, dtype, data)
        return _decode_ndarray(obj)
    if "__ndarray__" in obj:
        return _decode_ndarray(obj)
    if b"__npgeneric__" in obj or "__npgeneric__" in obj:
        return _decode_generic(obj)
    if levels < 1:
        raise _TooDeep
    for key, value in obj.items():
        kind = type(value)
        if kind is dict:
            obj[key] = _decode_map(value, levels - 1)  # replacing a value while iterating is allowed
        elif kind is list:
            _decode_list(value, levels - 1)
        elif kind is _ExtType or kind is _Timestamp:
            _refuse_leaf(value)
    return obj


def _decode_list(items: list, levels: int) -> None:
    """``_decode_map`` for a list, in place."""
    if levels < 1:
        raise _TooDeep
    for index, value in enumerate(items):
        kind = type(value)
        if kind is dict:
            items[index] = _decode_map(value, levels - 1)
        elif kind is list:
            _decode_list(value, levels - 1)
        elif kind is _ExtType or kind is _Timestamp:
            _refuse_leaf(value)


def unpackb(frame: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Any:
    """Decode one frame, or raise ``ProtocolError`` saying what is wrong with it."""
    # (The common bytes case skips isinstance on a union, which costs 0.1 µs.)
    if type(frame) is not bytes and not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError(f"a frame must be binary, got {type(frame).__name__} (text frames are not part of the protocol)")
    size = len(frame)
    if size > limits.max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes is over the {limits.max_frame_bytes}-byte cap")
    if size == 0:
        raise ProtocolError("empty frame")

    try:
        # msgpack caps every string, binary, array and map at the frame's length by default
        # (maps at half of it), its own defaults are raw=False and strict_map_key=True, and
        # each keyword costs time per call: the caps are spelled out only where they are
        # tighter than the frame's length.
        if size <= limits.max_str_len and size <= limits.max_container_len:
            value = msgpack.unpackb(frame)
        else:
            value = msgpack.unpackb(frame, max_str_len=limits.max_str_len, max_array_len=limits.max_container_len,
                                    max_map_len=limits.max_container_len)
    except msgpack.ExtraData as exc:
        raise ProtocolError(f"frame has {len(exc.extra)} bytes after its message") from None
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"malformed frame: {exc}") from None
    kind = type(value)
    try:
        if kind is dict:
            return _decode_map(value, limits.max_depth)
        if kind is list:
            _decode_list(value, limits.max_depth)
        elif kind is _ExtType or kind is _Timestamp:
            _refuse_leaf(value)
    except _TooDeep:
        raise ProtocolError(f"frame nests containers deeper than {limits.max_depth} levels") from None
    except RecursionError:
        raise ProtocolError(f"frame nests containers deeper than Python's recursion limit "
                            f"({sys.getrecursionlimit()}) allows") from None
    return value
