"""Reading a GGUF file's metadata in pure Python, without loading the model.

`validate --model` and the checkpoint browser need a model's name and KV shape; loading
it through llama.cpp costs seconds to minutes for a large model (and llama.cpp's
vocab-only mode leaves the shape unset).  GGUF's header is a simple key/value list:

    magic "GGUF", uint32 version, uint64 n_tensors, uint64 n_kv,
    n_kv x (string key, uint32 type, value)

with strings as uint64 length + UTF-8 bytes and arrays as uint32 item type + uint64
count + items.  Scalars are kept; arrays are skipped (their length is recorded), except
numeric arrays of at most :data:`MAX_KEPT_ARRAY` items when asked for (per-layer values:
engine.model_shape).
"""

from __future__ import annotations

import os
import struct
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KV = 1 << 20
_MAX_STRING = 1 << 26
#: numeric arrays up to this length are kept by ``read_metadata(..., arrays=True)``
MAX_KEPT_ARRAY = 4096


class GGUFError(ValueError):
    pass


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise GGUFError("the GGUF header is truncated")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > _MAX_STRING:
        raise GGUFError("a GGUF string is implausibly long")
    data = f.read(n)
    if len(data) != n:
        raise GGUFError("the GGUF header is truncated")
    return data.decode("utf-8", "replace")


def _skip_array(f: BinaryIO, item_type: int, count: int) -> None:
    if item_type in _SCALARS:
        f.seek(struct.calcsize(_SCALARS[item_type]) * count, os.SEEK_CUR)
    elif item_type == _STRING:
        _skip_strings(f, count)
    else:
        raise GGUFError(f"unsupported GGUF array type {item_type}")


def _skip_strings(f: BinaryIO, count: int, chunk: int = 1 << 20) -> None:
    """Skip ``count`` length-prefixed strings (a vocabulary: 50k-260k of them) by walking
    a buffer rather than seeking once per string."""
    buf = b""
    offset = 0
    unpack = struct.Struct("<Q").unpack_from
    for _ in range(count):
        if offset + 8 > len(buf):
            if offset > len(buf):   # the last string ran past the buffer
                f.seek(offset - len(buf), os.SEEK_CUR)
                buf, offset = b"", 0
            buf = buf[offset:] + f.read(chunk)
            offset = 0
            if len(buf) < 8:
                raise GGUFError("the GGUF header is truncated")
        n = unpack(buf, offset)[0]
        if n > _MAX_STRING:
            raise GGUFError("a GGUF string is implausibly long")
        offset += 8 + n
    # give back what was read past the last string
    f.seek(offset - len(buf), os.SEEK_CUR)


def _numeric_array(f: BinaryIO, item_type: int, count: int) -> list:
    fmt = _SCALARS[item_type]
    size = struct.calcsize(fmt)
    data = f.read(size * count)
    if len(data) != size * count:
        raise GGUFError("the GGUF header is truncated")
    return list(struct.unpack(f"<{count}{fmt[1]}", data))


def read_metadata(path: str | os.PathLike, *, arrays: bool = False) -> dict[str, Any]:
    """Scalar metadata of a GGUF file; arrays appear as ``("array", count)``, or with
    ``arrays`` numeric ones of at most :data:`MAX_KEPT_ARRAY` items as lists."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"not a GGUF model file: {path}")
        version = _read(f, "<I")
        if version < 2:
            raise GGUFError(f"GGUF version {version} is too old")
        _read(f, "<Q")
        n_kv = _read(f, "<Q")
        if n_kv > _MAX_KV:
            raise GGUFError("the GGUF header holds an implausible number of keys")
        for _ in range(n_kv):
            key = _string(f)
            kind = _read(f, "<I")
            if kind in _SCALARS:
                out[key] = _read(f, _SCALARS[kind])
            elif kind == _STRING:
                out[key] = _string(f)
            elif kind == _ARRAY:
                item_type = _read(f, "<I")
                count = _read(f, "<Q")
                if arrays and item_type in _SCALARS and count <= MAX_KEPT_ARRAY:
                    out[key] = _numeric_array(f, item_type, count)
                else:
                    _skip_array(f, item_type, count)
                    out[key] = ("array", count)
            else:
                raise GGUFError(f"unknown GGUF value type {kind}")
    return out
