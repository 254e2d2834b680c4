"""A model fingerprint: cheap to compute for a 10 GB GGUF, different for two fine-tunes.

Hashing a whole 10 GB file takes tens of seconds, so the fingerprint is a BLAKE2b-128
of a sample that still separates models that share an architecture:

* the file size;
* the first 4 MiB (the GGUF header, all metadata, and the first tensors);
* 64 blocks of 64 KiB at evenly spaced offsets through the tensor data;
* the last 1 MiB.

Two fine-tunes of one base model differ in nearly every weight, so the sampled blocks
differ; even a change confined to metadata (another tokenizer) changes the first
block.  About 9 MiB are read whatever the model size: well under a second from a cold
disk.  Results are cached by (path, size, mtime) beside the app's other caches, so a
model is sampled once until it changes.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from engine import paths
from engine.checkpoints.atomic import atomic_write

HEAD_BYTES = 4 << 20
TAIL_BYTES = 1 << 20
SAMPLES = 64
SAMPLE_BYTES = 64 << 10
_VERSION = b"checkpoint-chat fingerprint v1"
_memory_cache: dict[str, str] = {}


def compute_fingerprint(path: str | os.PathLike) -> bytes:
    """The 16-byte fingerprint of the file at ``path`` (no cache)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(_VERSION + struct.pack("<Q", size))
        h.update(f.read(HEAD_BYTES))
        if size > HEAD_BYTES + TAIL_BYTES:
            span = size - HEAD_BYTES - TAIL_BYTES
            for i in range(SAMPLES):
                f.seek(HEAD_BYTES + span * i // SAMPLES)
                h.update(f.read(SAMPLE_BYTES))
            f.seek(size - TAIL_BYTES)
            h.update(f.read(TAIL_BYTES))
    return h.digest()


def _cache_file() -> Path:
    return paths.cache_dir() / "fingerprints.json"


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def model_fingerprint(path: str | os.PathLike) -> bytes:
    """The fingerprint of ``path``, from the cache when the file has not changed."""
    path = Path(path)
    key = _key(path)
    if key in _memory_cache:
        return bytes.fromhex(_memory_cache[key])
    cache_file = _cache_file()
    try:
        stored = json.loads(cache_file.read_text("utf-8"))
        if not isinstance(stored, dict):
            stored = {}
    except (OSError, ValueError):
        stored = {}
    value = stored.get(key)
    if isinstance(value, str) and len(value) == 32:
        _memory_cache[key] = value
        return bytes.fromhex(value)
    digest = compute_fingerprint(path)
    _memory_cache[key] = digest.hex()
    stored = {k: v for k, v in stored.items() if not k.startswith(f"{path.resolve()}|")}
    stored[key] = digest.hex()
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(cache_file) as f:
            f.write(json.dumps(stored, indent=0).encode("utf-8"))
    except OSError:
        pass  # a cache that cannot be written only costs time next start
    return digest
