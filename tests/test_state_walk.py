"""The structural walk of a state blob (engine.checkpoints.kvstate) on hand-built blobs:
the one-step check of uniform layers and the step-by-step walk agree on what they accept."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from engine.checkpoints.kvstate import STATE_MAGIC, check_state
from engine.errors import CorruptState

TYPE_Q8_0, TYPE_F16 = 8, 1
SHAPE = dict(n_ctx=64, type_k=TYPE_Q8_0, type_v=TYPE_Q8_0, flash_attn=True, n_head_kv=2,
             n_embd_head_k=64, n_embd_head_v=64)


def blob(cells: int, k_rows: list[int], v_rows: list[int], *, v_trans: int = 0) -> bytes:
    """One cache of ``cells`` cells (positions 0..cells-1 of sequence 0), a layer per row size."""
    out = struct.pack("<IiII", STATE_MAGIC, 0, 1, cells)
    out += b"".join(struct.pack("<iIi", pos, 1, 0) for pos in range(cells))
    out += struct.pack("<II", v_trans, len(k_rows))
    for row in k_rows:
        out += struct.pack("<iQ", TYPE_Q8_0, row) + bytes(row * cells)
    for row in v_rows:
        if v_trans:   # a row is (element size, width): llama.cpp's transposed V without flash attention
            out += struct.pack("<iII", TYPE_F16, 2, row // 2) + bytes(row * cells)
        else:
            out += struct.pack("<iQ", TYPE_Q8_0, row) + bytes(row * cells)
    return out


def walk(data: bytes, n_layer: int, cells: int = 5, **shape):
    return check_state(np.frombuffer(data, np.uint8), n_tokens=cells, n_layer=n_layer, **(SHAPE | shape))


def test_uniform_and_varied_layers_both_pass():
    assert walk(blob(5, [136] * 6, [136] * 6), 6).blocks == ((5, 6),)
    # layers whose heads differ (a model with a head count per layer): the step-by-step walk
    assert walk(blob(5, [136, 68, 136, 68], [68, 136, 136, 68]), 4).blocks == ((5, 4),)


def test_transposed_v_walks_alike():
    transposed = dict(flash_attn=False, type_v=TYPE_F16)
    assert walk(blob(5, [136] * 3, [128] * 3, v_trans=1), 3, **transposed).v_trans
    assert walk(blob(5, [136] * 3, [128, 64, 128], v_trans=1), 3, **transposed).blocks == ((5, 3),)
    data = bytearray(blob(5, [136] * 3, [128] * 3, v_trans=1))
    at = 16 + 12 * 5 + 8 + 3 * (12 + 136 * 5) + 2 * (12 + 128 * 5) + 4   # the third V's element size
    data[at:at + 4] = struct.pack("<I", 8)
    with pytest.raises(CorruptState, match="V rows have an impossible size"):
        walk(bytes(data), 3, **transposed)


@pytest.mark.parametrize("layer", [0, 1, 5])
@pytest.mark.parametrize("part, field, patch, reason", [
    ("K", 0, struct.pack("<i", 1), "K type differs"),
    ("K", 4, struct.pack("<Q", 1 << 40), "K rows have an impossible size"),
    ("K", 4, struct.pack("<Q", 0), "K rows have an impossible size"),
    ("V", 0, struct.pack("<i", 1), "V type differs"),
    ("V", 4, struct.pack("<Q", 1 << 40), "V rows have an impossible size"),
    ("K", 4, struct.pack("<Q", 135), "K type|V type|ends inside"),   # shifts everything after it
])
def test_a_changed_layer_header_is_refused_wherever_it_is(layer, part, field, patch, reason):
    cells, row, n = 5, 136, 6
    data = bytearray(blob(cells, [row] * n, [row] * n))
    start = 16 + 12 * cells + 8 + (n * (12 + row * cells) if part == "V" else 0)
    at = start + layer * (12 + row * cells) + field
    data[at:at + len(patch)] = patch
    with pytest.raises(CorruptState, match=reason):
        walk(bytes(data), n)


def test_a_blob_short_of_its_last_layer_is_refused():
    data = blob(5, [136] * 6, [136] * 6)
    with pytest.raises(CorruptState, match="ends inside its V data"):
        walk(data[:-1], 6)
    with pytest.raises(CorruptState):
        walk(data + b"\0" * 12, 6)   # a trailing layer header too many
