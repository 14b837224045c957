"""KServe v2 datatypes: wire name <-> config enum <-> numpy dtype <-> element size.

Plus the BYTES codec: each element is a 4-byte little-endian length followed by its bytes.
"""
from __future__ import annotations

import struct
from collections.abc import Iterable

import numpy as np

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError

# name -> (numpy dtype or None for BYTES, element size in bytes or 0 for variable)
_TABLE: dict[str, tuple[np.dtype | None, int]] = {
    "BOOL": (np.dtype(np.bool_), 1),
    "UINT8": (np.dtype("<u1"), 1),
    "UINT16": (np.dtype("<u2"), 2),
    "UINT32": (np.dtype("<u4"), 4),
    "UINT64": (np.dtype("<u8"), 8),
    "INT8": (np.dtype("<i1"), 1),
    "INT16": (np.dtype("<i2"), 2),
    "INT32": (np.dtype("<i4"), 4),
    "INT64": (np.dtype("<i8"), 8),
    "FP16": (np.dtype("<f2"), 2),
    "FP32": (np.dtype("<f4"), 4),
    "FP64": (np.dtype("<f8"), 8),
    "BYTES": (None, 0),
    "BF16": (None, 2),  # no numpy dtype; passes through as raw bytes only
}
DATATYPES: tuple[str, ...] = tuple(_TABLE)

_CONFIG_TO_WIRE: dict[int, str] = {
    mc.TYPE_BOOL: "BOOL", mc.TYPE_UINT8: "UINT8", mc.TYPE_UINT16: "UINT16",
    mc.TYPE_UINT32: "UINT32", mc.TYPE_UINT64: "UINT64", mc.TYPE_INT8: "INT8",
    mc.TYPE_INT16: "INT16", mc.TYPE_INT32: "INT32", mc.TYPE_INT64: "INT64",
    mc.TYPE_FP16: "FP16", mc.TYPE_FP32: "FP32", mc.TYPE_FP64: "FP64",
    mc.TYPE_STRING: "BYTES", mc.TYPE_BF16: "BF16",
}
_WIRE_TO_CONFIG: dict[str, int] = {v: k for k, v in _CONFIG_TO_WIRE.items()}

_NUMPY_TO_WIRE: dict[np.dtype, str] = {
    dt: name for name, (dt, _) in _TABLE.items() if dt is not None
}


def is_valid(datatype: str) -> bool:
    return datatype in _TABLE


def element_size(datatype: str) -> int:
    """Bytes per element; 0 for BYTES (variable length)."""
    try:
        return _TABLE[datatype][1]
    except KeyError:
        raise InferError.invalid(f"unknown datatype '{datatype}'") from None


def numpy_dtype(datatype: str) -> np.dtype:
    """numpy dtype of a fixed-size datatype, or object for BYTES."""
    dt = _TABLE.get(datatype, (None, -1))[0]
    if datatype == "BYTES":
        return np.dtype(np.object_)
    if dt is None:
        raise InferError.invalid(f"datatype '{datatype}' has no numpy equivalent")
    return dt


def carrier_dtype(datatype: str) -> np.dtype:
    """The numpy dtype a service holds a fixed-size datatype's elements in: its own, or for BF16
    (no numpy type) little-endian uint16 holding the raw bfloat16 bits (the runtime adapters
    give them their type back: services/onnx/runtime.py)."""
    return _BF16_CARRIER if datatype == "BF16" else numpy_dtype(datatype)


_BF16_CARRIER = np.dtype("<u2")


def from_numpy(dtype: np.dtype) -> str:
    """Wire datatype of a numpy dtype (object / bytes / str arrays map to BYTES)."""
    dtype = np.dtype(dtype)
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    name = _NUMPY_TO_WIRE.get(dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype)
    if name is None:
        raise InferError.invalid(f"numpy dtype {dtype} has no v2 datatype")
    return name


def config_to_wire(data_type: int) -> str:
    """inference.DataType enum value -> wire datatype string (TYPE_STRING -> BYTES)."""
    try:
        return _CONFIG_TO_WIRE[data_type]
    except KeyError:
        raise InferError.invalid(f"config data_type {data_type} has no wire datatype") from None


def wire_to_config(datatype: str) -> int:
    try:
        return _WIRE_TO_CONFIG[datatype]
    except KeyError:
        raise InferError.invalid(f"unknown datatype '{datatype}'") from None


def element_count(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# --- BYTES codec -------------------------------------------------------------------------

_LEN = struct.Struct("<I")


def serialize_bytes(values: Iterable[object]) -> bytes:
    """Encode BYTES elements (bytes, str, or anything str() can render) length-prefixed."""
    parts: list[bytes] = []
    for v in values:
        b = v if isinstance(v, (bytes, bytearray, memoryview)) else str(v).encode("utf-8")
        b = bytes(b)
        parts.append(_LEN.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def deserialize_bytes(buf: bytes | memoryview, count: int | None = None) -> list[bytes]:
    """Decode a length-prefixed BYTES buffer; checks it holds exactly `count` elements."""
    mv = memoryview(buf)
    out: list[bytes] = []
    pos, end = 0, len(mv)
    while pos < end:
        if pos + 4 > end:
            raise InferError.invalid("BYTES tensor truncated: incomplete 4-byte length prefix")
        (n,) = _LEN.unpack_from(mv, pos)
        pos += 4
        if pos + n > end:
            raise InferError.invalid(
                f"BYTES tensor truncated: element of {n} bytes at offset {pos - 4} runs past the end")
        out.append(bytes(mv[pos:pos + n]))
        pos += n
    if count is not None and len(out) != count:
        raise InferError.invalid(f"BYTES tensor holds {len(out)} elements, shape needs {count}")
    return out


def check_bytes_framing(buf: bytes | memoryview, count: int, name: str, model: str) -> None:
    """A BYTES input's buffer holds exactly ``count`` length-prefixed elements (its shape's), walked
    without copying them and at most one past ``count``, as Triton walks it (core's
    infer_request.cc, ValidateBytesInputs): a buffer of millions of elements declared as one is
    refused at the second, where counting them all held a service's event loop 1.6 s for 16 MB
    (docs/security.md, "Session 23: BYTES framing"). The texts are Triton's (NVIDIA's
    L0_input_validation asserts two of them); one it does not check, an element that runs past the
    end of the buffer, is refused here."""
    mv = memoryview(buf)
    pos, end, n = 0, len(mv), 0
    where = f"inference input '{name}' for model '{model}'"
    while pos < end:
        if pos + 4 > end:
            raise InferError.invalid(
                f"incomplete string length indicator for {where}, expecting 4 bytes but only {end - pos} bytes "
                "available. Please make sure the string length indicator is in one buffer.")
        n += 1
        if n > count:
            raise InferError.invalid(f"unexpected number of string elements {n} for {where}, expecting {count}")
        (size,) = _LEN.unpack_from(mv, pos)
        pos += 4 + size
        if pos > end:
            raise InferError.invalid(f"string element {n} of {where} runs past the end of its data "
                                     f"({size} bytes, {end - pos + size} left)")
    if n != count:
        raise InferError.invalid(f"expected {count} string elements for {where}, got {n}")
