"""Damaging checkpoint bytes on purpose: truncation, bit flips, lying headers.

``with_header`` and ``with_payload_crc`` re-seal a mutated file (valid CRCs), which is
what a hostile file does: it gets past the checksums, and only the structural checks
(lengths, caps, the state walk) stand between it and llama.cpp.
"""

from __future__ import annotations

import struct
import tracemalloc
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engine.checkpoints import format as fmt
from engine.errors import CheckpointError
from faultkit import synthetic

FIELDS = ("magic version flags header_len fingerprint model_size n_vocab n_layer n_head_kv "
          "head_k head_v n_swa n_ctx type_k type_v flash_attn kv_unified kind reserved0 "
          "n_seq_max reserved1 n_tokens n_tokens_total n_generated created conv_id meta_len "
          "tokens_len logits_len state_len library title reserved2 crc").split()
#: struct format letter of each field, for drawing values over its whole range
FIELD_CODES = dict(zip(FIELDS, "8sHHI16sQIIIIIIIiiBBBBHHIIIq16sQQQQ32s64sII".replace(
    "8s", "s").replace("16s", "s").replace("32s", "s").replace("64s", "s"), strict=True))


def header_fields(data: bytes) -> dict:
    return dict(zip(FIELDS, fmt._HEADER.unpack(data[:fmt.HEADER_LEN]), strict=True))


def with_header(data: bytes, **changes) -> bytes:
    """``data`` with header fields changed and the header CRC made valid again."""
    fields = header_fields(data)
    fields.update(changes)
    raw = fmt._HEADER.pack(*(fields[name] for name in FIELDS))
    raw = raw[:-4] + struct.pack("<I", zlib.crc32(raw[:-4]))
    return raw + data[fmt.HEADER_LEN:]


def with_header_crc(data: bytes) -> bytes:
    return with_header(data)


def with_payload_crc(data: bytes) -> bytes:
    """``data`` with the trailer CRC recomputed over whatever payload it now holds."""
    payload = data[fmt.HEADER_LEN:-fmt.TRAILER_LEN]
    return data[:-fmt.TRAILER_LEN] + struct.pack("<I", zlib.crc32(payload)) + data[-4:]


def flip(data: bytes, flips) -> bytes:
    out = bytearray(data)
    for bit in flips:
        out[bit // 8 % len(out)] ^= 1 << (bit % 8)
    return bytes(out)


def verdict(data: bytes, path: Path) -> CheckpointError | None:
    """Write ``data`` to ``path`` and run every pre-llama check on it.

    Returns the refusal, or None when the file passed; any other exception escapes
    (a crash, which is what the tests look for).
    """
    path.write_bytes(data)
    try:
        synthetic.load_fully(path)
    except CheckpointError as exc:
        return exc
    return None


@contextmanager
def peak_memory() -> Iterator[list]:
    """Yields a list that holds the traced allocation peak (bytes) after the block."""
    result: list[int] = []
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        yield result
    finally:
        result.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()


def state_structure_offsets(header: fmt.Header) -> list[int]:
    """Byte offsets (in the file) of a one-cache state's structural fields.

    Magic, sequence id, stream and cell counts, the whole cell table, V layout, layer
    count, and each layer's K type and row size: a change to any of them changes the
    shape llama.cpp would read, so every one must be refused.
    """
    base = header.state_offset
    cells = header.n_tokens
    offsets = list(range(base, base + 16 + 12 * cells + 8))
    pos = base + 16 + 12 * cells + 8
    k_row = 2 * header.n_head_kv * header.n_embd_head_k if header.type_k == 1 else None
    if k_row is None:
        return offsets
    for _ in range(header.n_layer):
        offsets += range(pos, pos + 12)
        pos += 12 + k_row * cells
    return offsets
