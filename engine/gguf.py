"""Reading a GGUF file's metadata in pure Python, without loading the model.

`validate --model` and the checkpoint browser need a model's name and KV shape; loading
it through llama.cpp costs seconds to minutes for a large model (and llama.cpp's
vocab-only mode leaves the shape unset).  GGUF's header is a simple key/value list:

    magic "GGUF", uint32 version, uint64 n_tensors, uint64 n_kv,
    n_kv x (string key, uint32 type, value)

with strings as uint64 length + UTF-8 bytes and arrays as uint32 item type + uint64
count + items.  Only scalars are kept; arrays are skipped (their length is recorded).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KV = 1 << 20
_MAX_STRING = 1 << 26


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
        for _ in range(count):
            f.seek(_read(f, "<Q"), os.SEEK_CUR)
    else:
        raise GGUFError(f"unsupported GGUF array type {item_type}")


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Scalar metadata of a GGUF file; arrays appear as ``("array", count)``."""
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
                _skip_array(f, item_type, count)
                out[key] = ("array", count)
            else:
                raise GGUFError(f"unknown GGUF value type {kind}")
    return out


@dataclass(frozen=True)
class GGUFShape:
    name: str
    architecture: str
    n_vocab: int
    n_layer: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int


def read_shape(path: str | os.PathLike) -> GGUFShape:
    """The KV-relevant shape of a model, as llama.cpp would derive it."""
    meta = read_metadata(path)
    arch = str(meta.get("general.architecture", ""))

    def num(key: str, default: int = 0) -> int:
        value = meta.get(f"{arch}.{key}", default)
        return int(value) if isinstance(value, (int, float)) else default

    n_embd = num("embedding_length")
    n_head = num("attention.head_count")
    head = n_embd // n_head if n_head else 0
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = tokens[1] if isinstance(tokens, tuple) else num("vocab_size")
    return GGUFShape(
        name=str(meta.get("general.name", os.path.basename(path))), architecture=arch,
        n_vocab=int(n_vocab), n_layer=num("block_count"),
        n_head_kv=num("attention.head_count_kv", n_head),
        n_embd_head_k=num("attention.key_length", head),
        n_embd_head_v=num("attention.value_length", head))
