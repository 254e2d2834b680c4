"""Structural check of a llama.cpp sequence-state blob, before llama.cpp sees it.

The blob that ``llama_state_seq_get_data`` writes (llama.cpp commit 0c1e57098,
``llama_context::state_seq_get_data`` and ``llama_kv_cache::state_write``) is::

    uint32 magic 0xaf143cd8, int32 seq_id
    then one block per KV cache (two for sliding-window models: full, then SWA):
      uint32 n_stream
      per stream: uint32 cell_count; if cell_count > 0:
        cell_count x (int32 pos, uint32 n_seq_id, [ext], n_seq_id x int32 seq_id)
        (ext: int32 x, int32 y, int32 token, when the model's rope is M-RoPE: the
        header's CELL_EXT flag)
        uint32 v_trans, uint32 n_layer
        n_layer x (int32 type_k, uint64 k_row_size, cell_count * k_row_size bytes)
        if not v_trans: n_layer x (int32 type_v, uint64 v_row_size, cell_count * v_row_size bytes)
        else:           n_layer x (int32 type_v, uint32 el_size, uint32 n_embd_v_gqa,
                                   n_embd_v_gqa * cell_count * el_size bytes)

A recurrent memory (``llama_memory_recurrent::state_write``) writes one block without a
stream count; for one sequence it holds one cell, the snapshot after its last token::

    uint32 cell_count (1); cell_count x (int32 pos, uint32 n_seq_id = 0)
    uint32 s_trans (0), uint32 n_layer (all of the model's layers)
    per recurrent layer: int32 type_r, uint64 r_row_size, cell_count * r_row_size bytes
    per recurrent layer: int32 type_s, uint64 s_row_size, cell_count * s_row_size bytes

A hybrid memory writes its attention block(s) (two with a sliding window), then the
recurrent block.  The number of recurrent layers is not written: the R and S entries
run to the end of the blob, half of them each, every R row of one size and every S row
of another (llama.cpp sizes them per model, not per layer).

:func:`check_state` walks that structure with bounds checks at every step and compares
it with what the header promises (types, V layout, positions, layer count), so a blob
crafted to pass the CRC still cannot smuggle in another shape.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from engine.checkpoints.file_bytes import BytesInFile
from engine.checkpoints.format import (
    LIMITS,
    MEMORY_ATTENTION,
    MEMORY_HYBRID,
    MEMORY_RECURRENT,
    StateBytes,
    byte_view,
    check_logits_claim,
    own_recurrent_crc,
    recurrent_block_metadata,
)
from engine.checkpoints.points import check_point_crc, points_of
from engine.errors import CorruptState

STATE_MAGIC = 0xAF143CD8
#: what a sequence's recurrent part (a point's state, recurrent_part_of) starts with: the
#: magic and sequence id 0; the recurrent block follows
RECURRENT_PART_HEAD = struct.pack("<Ii", STATE_MAGIC, 0)
GGML_TYPE_F32 = 0


@dataclass(frozen=True)
class StateLayout:
    """What the walk found: per cache block, its cell count and layer count."""
    blocks: tuple[tuple[int, int], ...]   # (cell_count, n_layer)
    v_trans: bool
    #: byte offset of each non-empty block's cell table (see relabel_state)
    cell_tables: tuple[int, ...] = ()
    #: the recurrent block: (recurrent layers, R row bytes, S row bytes), or None
    recurrent: tuple[int, int, int] | None = None
    #: int32 words per cell in the cell tables (3, or 6 with the M-RoPE extension)
    cell_words: int = 3
    #: False: the walk left the recurrent block's rows unread (check_state's
    #: ``recurrent_unread``): the block must be walked before it is set
    block_walked: bool = True


_U32, _I32, _U64 = struct.Struct("<I"), struct.Struct("<i"), struct.Struct("<Q")


#: a layer's rows: int32 type, uint64 row size
_ROWS = struct.Struct("<iQ")
#: a layer's transposed V: int32 type, uint32 element size, uint32 width
_V_TRANSPOSED = struct.Struct("<iII")


class _Reader:
    """Reads a blob front to back; every read is bounded by its end."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.pos = 0

    def _at(self, n: int, what: str) -> int:
        """Where ``n`` bytes start, the reader moved past them."""
        at = self.pos
        if n < 0 or at + n > len(self.data):
            raise CorruptState(f"the KV state ends inside its {what}")
        self.pos = at + n
        return at

    def take(self, n: int, what: str) -> memoryview:
        at = self._at(n, what)
        return self.data[at:at + n]

    def skip(self, n: int, what: str) -> None:
        self._at(n, what)

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.data, self._at(4, what))[0]

    def i32(self, what: str) -> int:
        return _I32.unpack_from(self.data, self._at(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.data, self._at(8, what))[0]

    def layers(self, count: int, cells: int, entry: struct.Struct,
               cell_bytes: Callable[[tuple[int, ...]], int], what: str) -> None:
        """Walk ``count`` per-layer entries: a header ``entry``, then ``cells`` times
        ``cell_bytes(header)`` bytes (``cell_bytes`` checks the header: CorruptState).

        Most models give every layer of a cache the same header: then the first is checked
        and the others' bytes are compared with its bytes in one numpy operation, each at
        its place in the blob (a strided view), instead of one Python step per layer.  Any
        difference, or a blob too short for that many, takes the step-by-step walk, which
        names the fault."""
        at, size = self.pos, entry.size
        if count > 1 and at + size <= len(self.data):
            stride = size + cell_bytes(entry.unpack_from(self.data, at)) * cells
            if at + count * stride <= len(self.data):
                headers = np.ndarray((count, size), np.uint8, buffer=self.data, offset=at, strides=(stride, 1))
                if (headers == headers[0]).all():
                    self.pos = at + count * stride
                    return
        for _ in range(count):
            header = entry.unpack_from(self.data, self._at(size, f"{what} row header"))
            self.skip(cell_bytes(header) * cells, f"{what} data")


def check_state(state: StateBytes, *, n_tokens: int, n_ctx: int,
                n_layer: int, type_k: int, type_v: int, flash_attn: bool,
                n_head_kv: int, n_embd_head_k: int, n_embd_head_v: int,
                first_pos: int = 0, seq_id: int = 0, memory: int = MEMORY_ATTENTION,
                n_swa: int = 0, recurrent_rows: tuple[int, ...] | None = None,
                cell_ext: bool = False, recurrent_unread: int = 0) -> StateLayout:
    """Walk ``state`` and raise :class:`CorruptState` at the first inconsistency.

    A delta state holds positions ``first_pos..n_tokens-1`` of sequence ``seq_id`` (1).
    ``memory`` is the header's memory kind; ``recurrent_rows`` (R and S row bytes and the
    recurrent layer count, 0 where unknown) the model's, which the recurrent block must match.
    ``recurrent_unread``: the length of the recurrent block that ends the state, where the
    reader left it unread (a restore's earlier file, which gives its attention cells alone:
    engine.restore): its head is checked, and its length against the model's rows, but its
    rows (a header per layer, spread over 50 MB at Qwen3.5-4B's widths) are not read
    (``StateLayout.block_walked``); where the rows are unknown or give another length, the
    block is walked.
    """
    r = _Reader(byte_view(state))
    if r.u32("magic") != STATE_MAGIC:
        raise CorruptState("the KV state does not start with llama.cpp's state magic")
    if r.i32("sequence id") != seq_id:
        raise CorruptState(f"the KV state is not for sequence {seq_id}")
    if memory == MEMORY_ATTENTION:
        return _attention_blocks(r, None, n_tokens, n_ctx, n_layer, type_k, type_v, flash_attn,
                                 n_head_kv, n_embd_head_k, n_embd_head_v, first_pos, seq_id, cell_ext)
    if memory not in (MEMORY_RECURRENT, MEMORY_HYBRID):
        raise CorruptState(f"unknown memory kind {memory}")
    attention = StateLayout(blocks=(), v_trans=not flash_attn)
    if memory == MEMORY_HYBRID:
        attention = _attention_blocks(r, 2 if n_swa else 1, n_tokens, n_ctx, n_layer, type_k, type_v,
                                      flash_attn, n_head_kv, n_embd_head_k, n_embd_head_v, first_pos,
                                      seq_id, cell_ext)
    start = r.pos
    cells = _recurrent_head(r, n_tokens, n_layer)
    rec = _unread_recurrent_layers(r, start, n_layer, recurrent_rows, recurrent_unread)
    return StateLayout(blocks=attention.blocks, v_trans=attention.v_trans,
                       cell_tables=attention.cell_tables, cell_words=attention.cell_words,
                       recurrent=rec or _recurrent_layers(r, n_layer, cells, recurrent_rows),
                       block_walked=rec is None)


def _recurrent_block(r: _Reader, n_tokens: int, n_layer: int,
                     rows: tuple[int, ...] | None) -> tuple[int, int, int]:
    """Walk a recurrent block to the end of the blob: (layers, R row bytes, S row bytes)."""
    return _recurrent_layers(r, n_layer, _recurrent_head(r, n_tokens, n_layer), rows)


def _unread_recurrent_layers(r: _Reader, start: int, n_layer: int, rows: tuple[int, ...] | None,
                             unread: int) -> tuple[int, int, int] | None:
    """(layers, R row bytes, S row bytes) of a recurrent block from ``start`` to the end of
    the blob that the reader left unread (``unread`` bytes: check_state's
    ``recurrent_unread``), from the model's rows where they give exactly that length, the
    reader moved to the end without reading them; None otherwise (the reader where it was)."""
    if not unread or len(r.data) - start != unread or not _rows_known(rows, n_layer):
        return None
    assert rows is not None
    r_row, s_row, half = rows[:3]
    if _block_len(half, r_row, s_row) != unread:
        return None
    r.pos = len(r.data)
    return half, r_row, s_row


def _rows_known(rows: tuple[int, ...] | None, n_layer: int) -> bool:
    """Whether the model's recurrent rows (R and S row bytes, recurrent layers) are known and
    could be a state's (S rows may be empty: LFM2's short convolutions keep none)."""
    return rows is not None and len(rows) >= 3 and rows[0] > 0 and rows[2] > 0 and rows[2] <= n_layer \
        and max(rows[:2]) <= LIMITS.max_recurrent_layer


def _block_len(layers: int, r_row: int, s_row: int) -> int:
    """Bytes of a recurrent block of one cell: its head (cell count, the cell's position and
    sequence count, the layout flag, the layer count), then each layer's R rows, then S rows,
    each with its type and row size."""
    return 4 + 8 + 4 + 4 + layers * (_ROWS.size + r_row) + layers * (_ROWS.size + s_row)


def _recurrent_head(r: _Reader, n_tokens: int, n_layer: int) -> int:
    """Check a recurrent block's head (see :func:`_block_len`); its cell count."""
    cells = r.u32("recurrent cell count")
    if cells != 1:
        raise CorruptState(f"the recurrent state holds {cells} snapshots; a sequence has one")
    pos, n_seq = struct.unpack("<iI", r.take(8, "recurrent cell"))
    if n_seq != 0:
        raise CorruptState("the recurrent state's cell names other sequences")
    if pos != n_tokens - 1:
        raise CorruptState(f"the recurrent state is at position {pos}, the header says {n_tokens - 1}")
    if r.u32("recurrent state layout") != 0:
        raise CorruptState("the recurrent state's layout flag is invalid")
    if r.u32("recurrent layer count") != n_layer:
        raise CorruptState("the recurrent state's layer count differs from its header")
    return cells


def _recurrent_layers(r: _Reader, n_layer: int, cells: int, rows: tuple[int, ...] | None) -> tuple[int, int, int]:
    """Walk a recurrent block's rows, after its head, to the end of the blob: (layers, R row
    bytes, S row bytes)."""
    if (known := _known_recurrent_layers(r, n_layer, cells, rows)) is not None:
        return known
    sizes: list[int] = []
    while r.pos < len(r.data):
        if len(sizes) >= 2 * n_layer:
            raise CorruptState("the recurrent state has more layers than the model")
        if r.i32("recurrent type") != GGML_TYPE_F32:
            raise CorruptState("the recurrent state's rows are not float32")
        row = r.u64("recurrent row size")
        if row > LIMITS.max_recurrent_layer:   # one row can be no more than its layer's R + S
            raise CorruptState("the recurrent state's rows have an impossible size")
        r.skip(row * cells, "recurrent data")
        sizes.append(row)
    half = len(sizes) // 2
    if not sizes or len(sizes) % 2:
        raise CorruptState("the recurrent state's R and S parts do not pair up")
    r_rows, s_rows = set(sizes[:half]), set(sizes[half:])
    if len(r_rows) != 1 or len(s_rows) != 1:
        raise CorruptState("the recurrent state's layers have rows of different sizes")
    r_row, s_row = r_rows.pop(), s_rows.pop()
    if rows is not None:
        for name, found, expected in (("R", r_row, rows[0]), ("S", s_row, rows[1])):
            if expected and found != expected:
                raise CorruptState(f"the recurrent state's {name} rows hold {found} bytes; "
                                   f"this model's hold {expected}")
        if len(rows) > 2 and rows[2] and half != rows[2]:
            raise CorruptState(f"the recurrent state has {half} recurrent layers; this model has {rows[2]}")
    return half, r_row, s_row


def _known_recurrent_layers(r: _Reader, n_layer: int, cells: int,
                            rows: tuple[int, ...] | None) -> tuple[int, int, int] | None:
    """The recurrent layers of a model whose row sizes and layer count are known, walked as
    two runs of equal rows (_Reader.layers: one numpy comparison each, not two Python steps
    per layer: 24 layers at Qwen3.5-4B's depth, in every file of a chain): (layers, R row
    bytes, S row bytes) where the rest of the blob is exactly that, else None with the reader
    where it was (the step-by-step walk then names the fault)."""
    if not _rows_known(rows, n_layer):
        return None
    assert rows is not None
    start, (r_row, s_row, half) = r.pos, rows[:3]
    try:
        r.layers(half, cells, _ROWS, partial(_float_rows_of, r_row), "recurrent")
        r.layers(half, cells, _ROWS, partial(_float_rows_of, s_row), "recurrent")
        if r.pos == len(r.data):
            return half, r_row, s_row
    except CorruptState:
        pass
    r.pos = start
    return None


def _float_rows_of(row: int, header: tuple[int, ...]) -> int:
    """``row``, where a recurrent layer's ``header`` says float32 rows of that size."""
    if header != (GGML_TYPE_F32, row):
        raise CorruptState("another row")
    return row


def _check_cell_table(r: _Reader, cells: int, n_tokens: int, first_pos: int, seq_id: int,
                      cell_ext: bool) -> None:
    """One cache's cell table: every cell of sequence ``seq_id`` alone, each position of
    ``first_pos..n_tokens-1`` at most once."""
    words = 6 if cell_ext else 3
    meta = np.frombuffer(r.take(4 * words * cells, "cell table"), dtype="<i4").reshape(cells, words)
    if not (meta[:, 1] == 1).all() or not (meta[:, -1] == seq_id).all():
        raise CorruptState("the KV state's cells belong to other sequences")
    pos = meta[:, 0]
    # cells are written in slot order, not position order: a sliding-window cache is
    # a ring, and a trimmed cache refills freed slots, so only uniqueness is required
    if pos.min() < first_pos or pos.max() >= n_tokens:
        raise CorruptState("the KV state's positions are out of range")
    # a presence map, not np.unique: linear, and np.unique's first call imports
    # numpy.ma (~20 ms, most of a whole restore's time)
    seen = np.zeros(n_tokens - first_pos, dtype=np.bool_)
    seen[pos - first_pos] = True
    if int(np.count_nonzero(seen)) != cells:
        raise CorruptState("the KV state holds a position twice")


def _row_bytes(part: str, type_: int, max_row: int, entry: tuple[int, ...]) -> int:
    """A layer's K or V rows (type, row size), checked: bytes per cell."""
    if entry[0] != type_:
        raise CorruptState(f"the KV state's {part} type differs from its header")
    if entry[1] == 0 or entry[1] > max_row:
        raise CorruptState(f"the KV state's {part} rows have an impossible size")
    return entry[1]


def _v_column_bytes(type_v: int, max_width: int, entry: tuple[int, ...]) -> int:
    """A layer's transposed V (type, element size, width), checked: bytes per cell."""
    if entry[0] != type_v:
        raise CorruptState("the KV state's V type differs from its header")
    el, width = entry[1], entry[2]
    if el == 0 or el > 4 or width == 0 or width > max_width:
        raise CorruptState("the KV state's V rows have an impossible size")
    return el * width


def _attention_blocks(r: _Reader, count: int | None, n_tokens: int, n_ctx: int, n_layer: int,
                      type_k: int, type_v: int, flash_attn: bool, n_head_kv: int,
                      n_embd_head_k: int, n_embd_head_v: int, first_pos: int,
                      seq_id: int, cell_ext: bool) -> StateLayout:
    """Walk KV-cache blocks: ``count`` of them, or (None) up to two, to the end of the blob."""
    n_new = n_tokens - first_pos
    max_row_k = 4 * n_head_kv * n_embd_head_k + 64
    max_row_v = 4 * n_head_kv * n_embd_head_v + 64
    blocks: list[tuple[int, int]] = []
    tables: list[int] = []
    v_trans_seen: bool | None = None
    while (r.pos < len(r.data)) if count is None else (len(blocks) < count):
        if len(blocks) >= 2:
            raise CorruptState("the KV state holds more caches than a model can have")
        n_stream = r.u32("stream count")
        if n_stream != 1:
            raise CorruptState(f"the KV state has {n_stream} streams; checkpoints hold one")
        cells = r.u32("cell count")
        if cells > n_ctx or cells > n_new:
            raise CorruptState(f"the KV state holds {cells} cells for {n_tokens} tokens")
        if cells == 0:
            blocks.append((0, 0))
            continue
        tables.append(r.pos)
        _check_cell_table(r, cells, n_tokens, first_pos, seq_id, cell_ext)
        if not blocks and cells != n_new:
            raise CorruptState(f"the KV state holds {cells} positions, the header says {n_new}")
        v_trans = r.u32("V layout")
        if v_trans > 1:
            raise CorruptState("the KV state's V layout flag is invalid")
        if v_trans != (0 if flash_attn else 1):
            raise CorruptState("the KV state's V layout does not match its flash-attention setting")
        if v_trans_seen is not None and bool(v_trans) != v_trans_seen:
            raise CorruptState("the KV state's caches disagree on the V layout")
        v_trans_seen = bool(v_trans)
        layers = r.u32("layer count")
        # a hybrid whose attention layers all slide keeps an empty full cache (LFM2 with a
        # window): cells, no layers
        if (layers == 0 and count is None) or layers > n_layer:
            raise CorruptState(f"the KV state has {layers} layers, the model {n_layer}")

        r.layers(layers, cells, _ROWS, partial(_row_bytes, "K", type_k, max_row_k), "K")
        if v_trans:
            r.layers(layers, cells, _V_TRANSPOSED, partial(_v_column_bytes, type_v, n_head_kv * n_embd_head_v), "V")
        else:
            r.layers(layers, cells, _ROWS, partial(_row_bytes, "V", type_v, max_row_v), "V")
        blocks.append((cells, layers))
    if not blocks:
        raise CorruptState("the KV state holds no cache")
    if sum(layers for _, layers in blocks) > n_layer:
        raise CorruptState("the KV state has more layers than the model")
    return StateLayout(blocks=tuple(blocks), v_trans=bool(v_trans_seen), cell_tables=tuple(tables),
                       cell_words=6 if cell_ext else 3)


def relabel_state(state: np.ndarray, layout: StateLayout, seq_id: int) -> None:
    """Make a checked state blob name sequence ``seq_id``, in place.

    ``llama_state_seq_get_data`` writes the id of the sequence it read (after the magic,
    and in every cell); llama.cpp ignores both when setting a state (the destination is
    the caller's choice), but a checkpoint's state names sequence 0 (1 for a delta).  A
    state read from sequence k of a multi-sequence context becomes the bytes sequence 0
    of a single-sequence one would have written.  ``layout`` is :func:`check_state`'s
    result for ``state`` (a writable uint8 array), whose cells each name one sequence.
    """
    state[4:8] = np.frombuffer(struct.pack("<i", seq_id), dtype=np.uint8)
    words = layout.cell_words
    for (cells, _layers), offset in zip((b for b in layout.blocks if b[0]), layout.cell_tables, strict=True):
        table = state[offset:offset + 4 * words * cells].view("<i4").reshape(cells, words)
        table[:, -1] = seq_id


def check_state_for(header, state: StateBytes, recurrent_rows: tuple[int, ...] | None = None,
                    recurrent_unread: int = 0) -> StateLayout:
    """:func:`check_state` with the shape taken from a checkpoint header (and the model's
    recurrent row sizes, when known; ``recurrent_unread``: check_state's).

    A delta that holds no cells (``parent_n_tokens == n_tokens``) has no state at all.
    """
    if header.is_delta and header.parent_n_tokens == header.n_tokens:
        if len(state):
            raise CorruptState("a delta without new cells carries a KV state")
        return StateLayout(blocks=(), v_trans=not header.flash_attn)
    return check_state(state, n_tokens=header.n_tokens, n_ctx=header.n_ctx,
                       n_layer=header.n_layer, type_k=header.type_k, type_v=header.type_v,
                       flash_attn=header.flash_attn, n_head_kv=header.n_head_kv,
                       n_embd_head_k=header.n_embd_head_k, n_embd_head_v=header.n_embd_head_v,
                       first_pos=header.parent_n_tokens, seq_id=1 if header.is_delta else 0,
                       memory=header.memory, n_swa=header.n_swa, recurrent_rows=recurrent_rows,
                       cell_ext=header.cell_ext, recurrent_unread=recurrent_unread)


def check_recurrent_part(state: StateBytes, n_tokens: int, n_layer: int,
                         recurrent_rows: tuple[int, ...] | None = None) -> None:
    """Walk the recurrent part of a sequence's state after its first ``n_tokens`` tokens (a
    point's, engine.checkpoints.points: llama.cpp's ``PARTIAL_ONLY`` state, magic and
    sequence id 0, then the recurrent block of a model of ``n_layer`` layers)."""
    r = _Reader(byte_view(state))
    if r.u32("magic") != STATE_MAGIC:
        raise CorruptState("a point's recurrent state does not start with llama.cpp's state magic")
    if r.i32("sequence id") != 0:
        raise CorruptState("a point's recurrent state is not for sequence 0")
    _recurrent_block(r, n_tokens, n_layer, recurrent_rows)


def check_file_states(data, recurrent_rows: tuple[int, ...] | None = None) -> None:
    """Walk every state a file read whole holds (CheckpointData: validation, import): llama.cpp's
    part, what the metadata says of the recurrent block it ends with (a restore trusts its
    length and CRC to leave the block unread: they must be the walk's and the bytes'), and
    the points' recurrent states (:func:`check_point_states`); and what it says of the
    logits (engine.checkpoints.format.check_logits_claim: a restore leaves an earlier file's
    unread too)."""
    check_logits_claim(data)
    if not data.header.n_tokens:
        return
    layout = check_state_for(data.header, data.state, recurrent_rows)
    check_recurrent_claim(own_recurrent_crc(data.meta, len(data.state)), layout, data.state)
    check_point_states(data, recurrent_rows)


def check_recurrent_claim(claim: tuple[int, int] | None, layout: StateLayout, state: StateBytes | None = None) -> None:
    """CorruptState unless ``claim``, the ``(crc32, length)`` a file's metadata gives its own
    recurrent block (engine.checkpoints.format.own_recurrent_crc; None: none), is that of the
    block its walked state ends with (``layout``): its length, and with ``state`` its CRC too
    (what a save writes, format.recurrent_block_metadata).  A restore checks the length before
    it sets anything of a file whose block it left unread; validation and import check both."""
    if claim is None:
        return
    crc, length = claim
    if layout.recurrent is None or length != recurrent_block_len(layout) \
            or (state is not None and recurrent_block_metadata(state, length)["crc32"] != crc):
        raise CorruptState("the recurrent block its metadata gives the length and checksum of is not "
                           "the one its state ends with")


def check_point_states(data, recurrent_rows: tuple[int, ...] | None = None) -> None:
    """Check and walk every recurrent state a file's points carry (CheckpointData: validation
    and import read them as they read llama.cpp's part; a restore checks one before it is put
    back): each against its own CRC where the metadata gives one, then its structure."""
    for point in points_of(data):
        if point.recurrent is not None:
            check_point_crc(point)
            check_recurrent_part(point.recurrent, point.n_tokens, data.header.n_layer, recurrent_rows)


def recurrent_part_of(state: StateBytes, layout: StateLayout) -> np.ndarray:
    """The recurrent part of a checked state (``layout``: :func:`check_state`'s result for a
    recurrent memory, or a hybrid's), as a point carries it (engine.checkpoints.points):
    llama.cpp's ``PARTIAL_ONLY`` state of the sequence, the magic, sequence id 0 and the
    recurrent block, which ends every such state (one cell: its header, then each layer's
    R and S rows with their type and size).  A copy; :func:`check_recurrent_part` walks it."""
    block = recurrent_block_len(layout)
    data = byte_view(state)
    if len(data) < 8 + block:
        raise CorruptState("the state is shorter than its recurrent part")
    part = np.empty(8 + block, dtype=np.uint8)
    part[:8] = np.frombuffer(RECURRENT_PART_HEAD, dtype=np.uint8)
    part[8:] = np.frombuffer(data[len(data) - block:], dtype=np.uint8)
    return part


def recurrent_part_in_file(data, layout: StateLayout) -> BytesInFile:
    """Where the file of ``data`` (CheckpointData, its checksum settled) holds the recurrent
    part of its state (``layout``: its walk), as :func:`recurrent_part_of` gives it, with
    the CRC32 of those bytes: to be read when used (engine.checkpoints.file_bytes).  The
    block ends llama.cpp's part of the state section (the points' states follow it)."""
    block = recurrent_block_len(layout)
    if len(data.state) < 8 + block:
        raise CorruptState("the state is shorter than its recurrent part")
    start = len(data.state) - block
    return BytesInFile(data.path, data.header.state_offset + start, block, data.crc_of_state_tail(start),
                       RECURRENT_PART_HEAD)


def recurrent_block_len(layout: StateLayout) -> int:
    """Bytes of the recurrent block that ends a checked state of one cell (``layout``:
    :func:`check_state`'s result for a recurrent memory, or a hybrid's)."""
    if layout.recurrent is None:
        raise CorruptState("the state holds no recurrent part")
    return _block_len(*layout.recurrent)


def emptied_block(state_len: int, layout: StateLayout, n_layer: int) -> tuple[int, bytes]:
    """How a hybrid's checked state of ``state_len`` bytes becomes its attention part alone:
    where its recurrent block starts, and the recurrent block of no cell that replaces it
    there (its count 0, the layout flag and layer count, each layer's type and row size
    without rows: what llama.cpp writes for a sequence without a recurrent state).  Setting
    the result sets the attention cells and leaves the sequence without a recurrent state,
    which a later file of the chain sets (engine.restore: only the last file's recurrent
    state survives a chain)."""
    block = recurrent_block_len(layout)   # CorruptState without a recurrent part
    layers, r_row, s_row = layout.recurrent or (0, 0, 0)
    if state_len < 8 + block:
        raise CorruptState("the state is shorter than its recurrent part")
    empty = (struct.pack("<III", 0, 0, n_layer) + _ROWS.pack(GGML_TYPE_F32, r_row) * layers
             + _ROWS.pack(GGML_TYPE_F32, s_row) * layers)
    return state_len - block, empty
