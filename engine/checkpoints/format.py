"""Checkpoint file format, version 2 (``.kvckpt``); version 1 files are read too.

A checkpoint holds one conversation's llama.cpp KV state together with everything
needed to decide, before a single byte reaches llama.cpp, whether that state can be
restored into the running model and context, and to continue generating exactly as an
uninterrupted run would have.

Layout
------
All integers are little-endian.  The file is five sections back to back, then an
8-byte trailer; the sizes must add up to the file length exactly::

    header     256 bytes (fixed; its own CRC32 in the last 4 bytes)
    metadata   meta_len bytes of UTF-8 JSON (an object)
    tokens     tokens_len bytes: n_tokens_total int32 token ids
    logits     logits_len bytes: 0, or n_vocab float32 logits of the last KV position
    state      state_len bytes: the output of llama_state_seq_get_data for sequence 0
               (with POINT_STATES, followed by the points' recurrent states: see Points)
    trailer    uint32 CRC32 of metadata+tokens+logits+state, then b"KVE1"

Header (offsets in bytes)::

      0  8  magic            b"\\x89KVC\\r\\n\\x1a\\n"  (PNG-style: catches text-mode copies)
      8  2  format_version   2 (1: files written before memory kinds, read as attention)
     10  2  flags            bit 0 HAS_LOGITS, bit 1 PREFILL_PENDING, bit 2 DELTA,
                             bit 3 CELL_EXT (version 2: the KV cells carry M-RoPE 2D
                             positions, see kvstate), bit 4 POINT_STATES (version 2, a
                             memory with a recurrent part and no sliding window: see
                             Points); other bits must be 0
     12  4  header_len       256
     16 16  model_fingerprint  see engine.checkpoints.fingerprint
     32  8  model_size       bytes of the GGUF file
     40  4  n_vocab
     44  4  n_layer
     48  4  n_head_kv        the largest KV head count of any layer (0: no attention layer)
     52  4  n_embd_head_k    0 when no layer has attention
     56  4  n_embd_head_v
     60  4  n_swa            sliding window (0: none)
     64  4  n_ctx            context size the state was made with
     68  4  type_k           ggml_type of the K cache (int32)
     72  4  type_v           ggml_type of the V cache (int32)
     76  1  flash_attn       1 when flash attention was on (V not transposed)
     77  1  kv_unified
     78  1  kind             0 manual, 1 pause, 2 autosave, 3 exit
     79  1  memory           0 attention (sliding-window when n_swa > 0), 1 recurrent,
                             2 hybrid (attention, then recurrent); version 1: 0
     80  2  n_seq_max
     82  2  state_layout     which llama.cpp sequence-state layout the state section has
                             (1: the pinned llama.cpp's, see kvstate); version 1: 0, read as 1
     84  4  n_tokens         tokens held in the KV state (positions 0..n_tokens-1)
     88  4  n_tokens_total   tokens in the token array (> n_tokens while prefill is pending)
     92  4  n_generated      tokens generated so far for the current answer
     96  8  created_unix_ns  int64
    104 16  conversation_id  UUID bytes
    120  8  meta_len
    128  8  tokens_len       == 4 * n_tokens_total
    136  8  logits_len       == 4 * n_vocab with HAS_LOGITS, else 0
    144  8  state_len
    152 32  library          llama.cpp identity, UTF-8, NUL-padded
    184 64  title            UTF-8, NUL-padded (truncated at a character boundary)
    248  4  parent_n_tokens  DELTA only: the parent's tokens it builds on, 1..n_tokens (0 otherwise)
    252  4  header_crc32     CRC32 of bytes 0..251

Memory kinds
------------
The state section is what ``llama_state_seq_get_data`` wrote; its structure per memory kind
is in engine.checkpoints.kvstate.  A recurrent memory (or a hybrid's recurrent part) holds
one fixed-size snapshot per sequence, never per token.  Per-layer facts the 256 bytes
cannot hold (which layers are recurrent, their row sizes) are in the state itself and are
checked against the model when restoring (engine.model_shape is the one reader of a
model's shape).  A header is checked with the reader's own rules before it is written,
and the state walked, so a file that could not be loaded is never written.

Delta checkpoints
-----------------
With the DELTA flag the state section holds only the KV cells of positions
``parent_n_tokens..n_tokens-1`` (and, for recurrent and hybrid memories, the whole
recurrent snapshot at ``n_tokens``: it is small and cannot be split by position), saved
from a scratch sequence (id 1) that shares those cells with sequence 0. The metadata's
``"parent"`` object names the parent: its file name (in the same folder), its
``checkpoint_id``, its payload CRC32 and the number of tokens it holds; the token array
is complete, so its first ``parent_n_tokens`` ids must equal the parent's.  Usually the
parent holds exactly ``parent_n_tokens`` tokens.  It may hold more — a *cut*: the delta
builds on the parent's first ``parent_n_tokens`` tokens, e.g. a conversation that starts
with another one's document — only for an attention memory without a sliding window
(``memory`` 0, ``n_swa`` 0), whose cells before a position are the same whatever follows;
restoring drops the parent's cells from ``parent_n_tokens`` on before the delta's are set
(engine.checkpoints.chain.can_cut; a reader from before cuts refuses the link). A delta may hold no cells at all
(``parent_n_tokens == n_tokens``, an empty state section): the same cache as its parent
with another conversation state, e.g. a pause before the first token or a rename,
written without copying the context again. Restoring applies the chain's base to
sequence 0 and each delta through sequence 1 (copy to 0, then drop 1), which gives
exactly the cache a full checkpoint would. Every file of a chain is verified, and linked
by id and CRC, before anything of it is used (a large state's CRC while llama.cpp copies
it: engine.restore).

Metadata keys the store relies on
---------------------------------
``checkpoint_id`` (32 hex digits, unique per file written) and the trailer's payload
CRC identify a file; ``parent`` (deltas) names the parent as above; ``line`` (optional,
at most 64 characters) is the line of history the file belongs to, by default its
conversation's id in hex (see engine.checkpoints.graph; ``shared-`` and a digest: a
shared prefix, engine.shared_prefix); ``origin_crc`` (optional) is the
payload CRC a file had before an import rewrote its parent reference.  ``logits_crc32``
(optional, files with logits) is the CRC32 of the logits section (see Logits an earlier
file holds).  ``points``
(optional) lists earlier turn ends a delta holds within its own cells, when a head absorbed
the files that ended those turns (engine.history.LineWriter._absorbed; every memory but a
sliding window, see Points below): each ``{"n_tokens": T, "n_messages": M}`` says that
the file's first T tokens are the state after the first M messages of its conversation,
every answer finished; ``parent_n_tokens <= T < n_tokens`` (engine.checkpoints.points).  ``conversation``
holds the chat itself (messages, the answer so far, sampler; a reader's transcript is
engine.conversation.transcript_of; files written before 2026-12-04 also hold the same
messages as ``transcript``), ``model`` names the model.  A reader treats
every key as untrusted: a missing or mistyped key is a refusal with the reason, never
an exception.

Points of a memory with a recurrent part
----------------------------------------
A recurrent memory, or a hybrid without a sliding window, holds its recurrent state only
after its last token, so a file's points carry the recurrent part of the state at each
point (llama.cpp's ``PARTIAL_ONLY`` state of the sequence: magic, sequence id 0, and the
recurrent block, see kvstate; engine.checkpoints.points).  Such a file has the
POINT_STATES flag, each of its metadata's points says ``"recurrent_len": L`` (L > 0, at
most ``LIMITS.max_points`` points), and its state section is llama.cpp's state followed
by those blobs, back to back in the points' order: llama.cpp's part is ``state_len`` minus
their sum.  A reader refuses a POINT_STATES file whose points do not say their lengths,
or whose lengths leave llama.cpp's part empty; the payload CRC covers the blobs as any
other state byte.  A reader from before the flag refuses the file (an unknown flag).

Each point also says ``"crc32": C``, the CRC32 of its blob (files written before
2026-12-06 do not: every byte of such a file is read and checksummed).  A restore sets no
point's state, and a point's blob is as large as a whole recurrent state (12.6 MB at
Qwen3-Next's widths, one per turn end), so a reader restoring a file whose points all say
it (``read_checkpoint``'s ``crc_later``) does not checksum the blobs, nor read them (a
mapping maps them in only where they are not in the page cache: engine.checkpoints.mapped;
a copying read leaves them in the file): the payload CRC is checked as the CRC of the
bytes before them combined with theirs (zlib's ``crc32_combine``), which the metadata,
under that CRC, vouches for; a blob is then checked against its own CRC when it is used
(engine.checkpoints.points.check_point_crc).

The file's own recurrent block
------------------------------
A file of a memory with a recurrent part (``memory`` 1 or 2, a state with cells) says in its
metadata ``"recurrent_block": {"len": L, "crc32": C}``: its llama.cpp state ends with a
recurrent block of L bytes (kvstate: one cell's R and S rows, 50 MB at Qwen3.5-4B's
widths) whose CRC32 is C (files written before 2026-12-07 do not say it: every byte of
such a file is checksummed).  A restore sets only the last file's recurrent state: an
earlier file of its chain gives its attention cells alone (engine.restore), so a reader
restoring such a file (``read_checkpoint``'s ``ancestor``, with a mapping) neither
checksums the block nor maps it in: the payload CRC is checked as the CRC of the bytes
before it combined with C (and with the points' blobs after it), and the block is checked
against C where it is used (set after all, or kept in its file to go back to:
:meth:`CheckpointData.check_recurrent_later`, :meth:`CheckpointData.crc_of_state_tail`).
A reader checks L against the state's walk before it trusts it (engine.restore).  Such a
file is mapped privately: the restore writes an empty recurrent block over the page or
two where the block starts, to set the attention part straight from the mapping
(:meth:`CheckpointData.state_with_tail`), and puts them back.

Logits an earlier file holds
----------------------------
A file with logits says ``"logits_crc32": C`` in its metadata, the CRC32 of its logits
section (files written before 2026-12-07 do not).  A restore samples from the last file's
logits alone; an earlier file of its chain gives its cells, and its logits only where the
restore keeps a snapshot after it (engine.restore: read when it goes back there, where the
snapshot stays in the file).  So a reader restoring such a file
(``read_checkpoint``'s ``ancestor``) neither reads nor checksums them (vocabulary x 4
bytes: 1 MB at Gemma 3's or Qwen3.5's, in every file of a memory whose logits cannot be
computed again): the payload CRC is checked through C (zlib's ``crc32_combine``, as for
the recurrent blocks above), and the logits are read, checked against C, where they are
used (:meth:`CheckpointData.read_logits`; a snapshot's, with its recurrent state:
:meth:`CheckpointData.logits_in_file`, engine.snapshots).

Why logits are stored: llama.cpp's state holds no logits, and re-decoding the last
token after a restore is bit-exact only when it was decoded alone the first time too
(with a sliding window or a batch-decoded prompt the result depends on batch
boundaries), and never possible for a recurrent state.  Sampling the next token from
the stored logits makes a resumed generation identical to an uninterrupted one.  Which
files carry them is engine.runtime.logits_rule's: pauses and exits always; other files
only when re-decoding their last token would not give them exactly.

Every length is capped (see ``LIMITS``) and checked against the file size before
anything is allocated; a reader never trusts a length it has not bounded.
"""

from __future__ import annotations

import io
import json
import logging
import mmap
import os
import re
import struct
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from engine.checkpoints import mapped
from engine.checkpoints.crc import FAST as CRC_FAST
from engine.checkpoints.crc import combine as crc_combine
from engine.checkpoints.crc import crc32
from engine.checkpoints.crc_helper import QueuedCrc, queue_crc
from engine.checkpoints.file_bytes import BytesInFile, read_at
from engine.checkpoints.points import recurrent_crcs, recurrent_lengths
from engine.errors import (
    ChecksumMismatch,
    CorruptHeader,
    CorruptMetadata,
    NotACheckpoint,
    TruncatedCheckpoint,
    UnsupportedVersion,
)

log = logging.getLogger(__name__)

MAGIC = b"\x89KVC\r\n\x1a\n"
TRAILER_MAGIC = b"KVE1"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
#: the sequence-state layout of the pinned llama.cpp (engine.checkpoints.kvstate);
#: a file recording another one is not loaded by this build's llama.cpp
STATE_LAYOUT = 1
HEADER_LEN = 256
TRAILER_LEN = 8
EXTENSION = ".kvckpt"

FLAG_HAS_LOGITS = 1 << 0
FLAG_PREFILL_PENDING = 1 << 1
FLAG_DELTA = 1 << 2
FLAG_CELL_EXT = 1 << 3
FLAG_POINT_STATES = 1 << 4
KNOWN_FLAGS = FLAG_HAS_LOGITS | FLAG_PREFILL_PENDING | FLAG_DELTA | FLAG_CELL_EXT | FLAG_POINT_STATES
#: flags a version 1 file never has
V2_FLAGS = FLAG_CELL_EXT | FLAG_POINT_STATES

KIND_MANUAL, KIND_PAUSE, KIND_AUTOSAVE, KIND_EXIT = 0, 1, 2, 3
KIND_NAMES = {KIND_MANUAL: "manual", KIND_PAUSE: "pause", KIND_AUTOSAVE: "autosave",
              KIND_EXIT: "exit"}

# memory kinds: the values of engine.model_shape (which the format cannot import)
MEMORY_ATTENTION, MEMORY_RECURRENT, MEMORY_HYBRID = 0, 1, 2
MEMORY_KINDS = (MEMORY_ATTENTION, MEMORY_RECURRENT, MEMORY_HYBRID)

_HEADER = struct.Struct("<8sHHI16sQIIIIIIIiiBBBBHHIIIq16sQQQQ32s64sII")
assert _HEADER.size == HEADER_LEN


@dataclass(frozen=True)
class Limits:
    """Upper bounds a reader enforces before allocating anything."""
    max_meta: int = 16 << 20          # 16 MiB of JSON
    max_json_depth: int = 32         # objects and lists inside each other
    # Parsed JSON costs far more memory than its text (an empty list is 2 bytes of text
    # and 56 of Python object), so the number of containers and values is capped too,
    # counted on the raw bytes before parsing.  A conversation needs about two
    # containers and a handful of values per message.
    max_json_containers: int = 1 << 16
    max_json_values: int = 1 << 18
    max_ctx: int = 1 << 22            # 4M tokens
    max_vocab: int = 1 << 21          # 2M entries
    max_layers: int = 1024
    max_heads: int = 4096
    max_head_dim: int = 4096
    #: bytes of one recurrent layer's R + S rows for one sequence (Mamba-2 7B: ~1 MB)
    max_recurrent_layer: int = 1 << 28
    #: turn ends one file holds before its own end (metadata ``points``)
    max_points: int = 1 << 12


LIMITS = Limits()


@dataclass(frozen=True)
class Header:
    """The fixed header, decoded.  Field meanings are in the module docstring."""
    model_fingerprint: bytes
    model_size: int
    n_vocab: int
    n_layer: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_swa: int
    n_ctx: int
    type_k: int
    type_v: int
    flash_attn: bool
    kv_unified: bool
    n_seq_max: int
    n_tokens: int
    n_tokens_total: int
    n_generated: int
    created_unix_ns: int
    conversation_id: uuid.UUID
    library: str
    title: str
    kind: int = KIND_MANUAL
    flags: int = 0
    meta_len: int = 0
    tokens_len: int = 0
    logits_len: int = 0
    state_len: int = 0
    parent_n_tokens: int = 0
    version: int = FORMAT_VERSION
    memory: int = MEMORY_ATTENTION
    state_layout: int = STATE_LAYOUT

    @property
    def has_recurrent(self) -> bool:
        """A recurrent part in the state: a fixed-size snapshot, which cannot drop a tail."""
        return self.memory in (MEMORY_RECURRENT, MEMORY_HYBRID)

    @property
    def recurrent_part_suffices(self) -> bool:
        """:func:`recurrent_part_suffices` for this file's memory."""
        return recurrent_part_suffices(self.memory, self.n_swa)

    @property
    def is_delta(self) -> bool:
        return bool(self.flags & FLAG_DELTA)

    @property
    def cell_ext(self) -> bool:
        """The KV cells carry llama.cpp's cell extension (M-RoPE positions, Qwen3.5/VL)."""
        return bool(self.flags & FLAG_CELL_EXT)

    @property
    def has_logits(self) -> bool:
        return bool(self.flags & FLAG_HAS_LOGITS)

    @property
    def has_point_states(self) -> bool:
        """The state section ends with the recurrent states of the metadata's points."""
        return bool(self.flags & FLAG_POINT_STATES)

    @property
    def prefill_pending(self) -> bool:
        return bool(self.flags & FLAG_PREFILL_PENDING)

    @property
    def payload_len(self) -> int:
        return self.meta_len + self.tokens_len + self.logits_len + self.state_len

    @property
    def file_len(self) -> int:
        return HEADER_LEN + self.payload_len + TRAILER_LEN

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, "unknown")

    @property
    def logits_offset(self) -> int:
        return HEADER_LEN + self.meta_len + self.tokens_len

    @property
    def state_offset(self) -> int:
        return self.logits_offset + self.logits_len


def recurrent_part_suffices(memory: int, n_swa: int) -> bool:
    """Whether the state after a prefix of a sequence is its recurrent part at that position
    with the attention cells past it dropped: a recurrent memory, or a hybrid without a
    sliding window (whose cells past a position drop exactly).  Such a memory's points carry
    their recurrent parts (Points), and its snapshots keep that part alone (engine.snapshots)."""
    return memory in (MEMORY_RECURRENT, MEMORY_HYBRID) and not n_swa


def _fixed_text(text: str, size: int) -> bytes:
    data = text.encode("utf-8")[:size]
    # never cut a multi-byte character in half
    return data.decode("utf-8", "ignore").encode("utf-8").ljust(size, b"\0")


def pack_header(h: Header) -> bytes:
    body = _HEADER.pack(
        MAGIC, h.version, h.flags, HEADER_LEN, h.model_fingerprint, h.model_size,
        h.n_vocab, h.n_layer, h.n_head_kv, h.n_embd_head_k, h.n_embd_head_v, h.n_swa, h.n_ctx,
        h.type_k, h.type_v, int(h.flash_attn), int(h.kv_unified), h.kind,
        h.memory if h.version >= 2 else 0, h.n_seq_max, h.state_layout if h.version >= 2 else 0,
        h.n_tokens, h.n_tokens_total, h.n_generated, h.created_unix_ns, h.conversation_id.bytes,
        h.meta_len, h.tokens_len, h.logits_len, h.state_len,
        _fixed_text(h.library, 32), _fixed_text(h.title, 64), h.parent_n_tokens, 0)
    return body[:-4] + struct.pack("<I", crc32(body[:-4]))


def max_state_len(h: Header) -> int:
    """The largest state llama.cpp could write for a KV cache of this shape.

    Generous (f32 elements, both K and V for every layer and cell, twice over for a
    sliding-window model's second cache) so that it only rejects absurd lengths.
    """
    per_cell = 16 + h.n_layer * h.n_head_kv * (h.n_embd_head_k + h.n_embd_head_v) * 4
    per_layer = 64
    caches = 2 if h.n_swa else 1
    attention = caches * (64 + h.n_layer * per_layer + h.n_ctx * per_cell)
    if not h.has_recurrent:
        return attention
    recurrent = 64 + h.n_layer * (per_layer + LIMITS.max_recurrent_layer)
    points = LIMITS.max_points if h.has_point_states else 0
    return attention + recurrent * (1 + points)


def unpack_header(raw: bytes, file_size: int | None = None, limits: Limits = LIMITS) -> Header:
    """Decode and validate a header; ``file_size`` adds the exact-length check."""
    _check_preamble(raw)
    raw = raw[:HEADER_LEN]
    (magic, version, flags, header_len, fingerprint, model_size, n_vocab, n_layer, n_head_kv,
     head_k, head_v, n_swa, n_ctx, type_k, type_v, flash_attn, kv_unified, kind, memory,
     n_seq_max, state_layout, n_tokens, n_tokens_total, n_generated, created, conv_id, meta_len,
     tokens_len, logits_len, state_len, library, title, parent_n_tokens, crc) = _HEADER.unpack(raw)
    if header_len != HEADER_LEN:
        raise CorruptHeader(f"header length {header_len} is not {HEADER_LEN}")
    if crc32(raw[:-4]) != crc:
        raise CorruptHeader("header checksum mismatch: the header is damaged")
    problems: list[str] = []
    if flags & ~KNOWN_FLAGS or (version == 1 and flags & V2_FLAGS):
        problems.append(f"unknown flags 0x{flags:04x}")
    elif flags & FLAG_POINT_STATES and not recurrent_part_suffices(memory, n_swa):
        problems.append("point states without a recurrent memory, or with a sliding window")
    if version == 1:
        if memory or state_layout:
            problems.append("reserved fields are not zero")
        state_layout = STATE_LAYOUT   # every version 1 file was written by the pinned layout
    elif memory not in MEMORY_KINDS:
        problems.append(f"unknown memory kind {memory}")
    elif state_layout == 0:
        problems.append("no state layout recorded")
    if flags & FLAG_DELTA:
        if not 0 < parent_n_tokens <= n_tokens:
            problems.append(f"a delta on {parent_n_tokens} parent tokens cannot hold {n_tokens}")
    elif parent_n_tokens:
        problems.append("parent token count without the delta flag")
    if kind not in KIND_NAMES:
        problems.append(f"unknown kind {kind}")
    if flash_attn > 1 or kv_unified > 1:
        problems.append("boolean fields hold other values than 0 and 1")
    if not 0 < n_vocab <= limits.max_vocab:
        problems.append(f"n_vocab {n_vocab} out of range")
    if not 0 < n_layer <= limits.max_layers:
        problems.append(f"n_layer {n_layer} out of range")
    if memory == MEMORY_RECURRENT:   # no attention layer: no KV heads
        if n_head_kv or head_k or head_v:
            problems.append("a recurrent memory with attention heads")
    else:
        if not 0 < n_head_kv <= limits.max_heads:
            problems.append(f"n_head_kv {n_head_kv} out of range")
        if not (0 < head_k <= limits.max_head_dim and 0 < head_v <= limits.max_head_dim):
            problems.append("head sizes out of range")
    if not 0 < n_ctx <= limits.max_ctx:
        problems.append(f"n_ctx {n_ctx} out of range")
    if not 0 < n_seq_max <= 256:
        problems.append(f"n_seq_max {n_seq_max} out of range")
    if not n_tokens <= n_tokens_total <= n_ctx:
        problems.append(f"token counts {n_tokens}/{n_tokens_total} do not fit n_ctx {n_ctx}")
    if n_generated > n_tokens_total:
        problems.append("more generated tokens than tokens")
    if meta_len > limits.max_meta:
        problems.append(f"metadata of {meta_len} bytes exceeds the {limits.max_meta} byte cap")
    if tokens_len != 4 * n_tokens_total:
        problems.append("token section length does not match n_tokens_total")
    has_logits = bool(flags & FLAG_HAS_LOGITS)
    if logits_len != (4 * n_vocab if has_logits else 0):
        problems.append("logits section length does not match n_vocab")
    if has_logits and n_tokens == 0:
        problems.append("logits without any token")
    if bool(flags & FLAG_PREFILL_PENDING) != (n_tokens < n_tokens_total):
        problems.append("prefill flag disagrees with the token counts")
    text_library, text_title = _text_fields(library, title, problems)
    if problems:
        raise CorruptHeader("impossible header: " + "; ".join(problems))
    header = Header(
        model_fingerprint=fingerprint, model_size=model_size, n_vocab=n_vocab, n_layer=n_layer,
        n_head_kv=n_head_kv, n_embd_head_k=head_k, n_embd_head_v=head_v, n_swa=n_swa,
        n_ctx=n_ctx, type_k=type_k, type_v=type_v, flash_attn=bool(flash_attn),
        kv_unified=bool(kv_unified), n_seq_max=n_seq_max, n_tokens=n_tokens,
        n_tokens_total=n_tokens_total, n_generated=n_generated, created_unix_ns=created,
        conversation_id=uuid.UUID(bytes=conv_id), library=text_library, title=text_title,
        kind=kind, flags=flags, meta_len=meta_len, tokens_len=tokens_len,
        logits_len=logits_len, state_len=state_len, parent_n_tokens=parent_n_tokens,
        version=version, memory=memory, state_layout=state_layout)
    _check_sizes(header, file_size)
    return header


def _check_preamble(raw: bytes) -> None:
    """The magic bytes, a readable version and the header's whole length, in that order
    (each error says what a file that stops early or is of another kind lacks)."""
    if len(raw) < 8 and MAGIC.startswith(raw):
        raise TruncatedCheckpoint(f"the file ends inside its magic bytes ({len(raw)} bytes long)")
    if raw[:8] != MAGIC:
        raise NotACheckpoint("not a Checkpoint Chat checkpoint (wrong magic bytes)")
    if len(raw) < 12:
        raise TruncatedCheckpoint("the file ends inside its header")
    version = struct.unpack_from("<H", raw, 8)[0]
    if version not in READABLE_VERSIONS:
        newer = " (written by a newer Checkpoint Chat)" if version > FORMAT_VERSION else ""
        raise UnsupportedVersion(f"checkpoint format version {version} is not supported{newer}; "
                                 f"this app reads versions {READABLE_VERSIONS[0]} to {FORMAT_VERSION}")
    if len(raw) < HEADER_LEN:
        raise TruncatedCheckpoint(f"the file ends inside its header ({len(raw)} of {HEADER_LEN} bytes)")


def _text_fields(library: bytes, title: bytes, problems: list[str]) -> tuple[str, str]:
    """The header's two text fields, NUL padding stripped ("" both, and a problem noted,
    when they are not UTF-8)."""
    try:
        return library.rstrip(b"\0").decode("utf-8"), title.rstrip(b"\0").decode("utf-8")
    except UnicodeDecodeError:
        problems.append("text fields are not UTF-8")
        return "", ""


def _check_sizes(header: Header, file_size: int | None) -> None:
    """The state's length against the header's shape and token counts; the file's length
    (when known) against the sections the header declares."""
    state_len = header.state_len
    if state_len > max_state_len(header):
        raise CorruptHeader(f"state length {state_len} is larger than any KV cache of this shape")
    new_cells = header.n_tokens - header.parent_n_tokens   # a full checkpoint: all of them
    if (new_cells > 0) != (state_len > 0):
        raise CorruptHeader("state length disagrees with n_tokens")
    if file_size is not None and file_size != header.file_len:
        if file_size < header.file_len:
            raise TruncatedCheckpoint(
                f"the file is truncated: {file_size} bytes, the header promises {header.file_len}")
        raise TruncatedCheckpoint(
            f"the file has {file_size - header.file_len} unexpected bytes after its end")


def read_header(path: str | os.PathLike) -> Header:
    """Read and validate only the header (what a listing needs)."""
    with open(path, "rb") as f:
        raw = f.read(HEADER_LEN)
        size = os.fstat(f.fileno()).st_size
    return unpack_header(raw, size)


# -- metadata ---------------------------------------------------------------------------

def encode_metadata(meta: dict[str, Any]) -> bytes:
    """JSON bytes for ``meta``; refuses what a reader would refuse (never write an
    unreadable checkpoint)."""
    data = json.dumps(meta, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(data) > LIMITS.max_meta:
        raise CorruptMetadata(f"metadata of {len(data)} bytes exceeds the {LIMITS.max_meta} byte cap")
    _check_json_shape(data, LIMITS)
    return data


_JSON_ESCAPE = re.compile(rb"\\.", re.S)
_JSON_STRING = re.compile(rb'"[^"]*"')


def _check_json_shape(data: bytes, limits: Limits) -> None:
    """Bound what ``json.loads`` would build, from the bytes alone, before parsing.

    Escapes are removed first (so a ``\\"`` cannot end a string), then strings, which
    cannot hold structure; both patterns are linear-time.  What remains is counted:
    ``{`` and ``[`` open containers, ``,`` and ``:`` separate values, and the brackets
    give the nesting depth (objects and lists inside each other).  Counting an invalid
    document wrongly only matters if it parses, and then the count is exact.
    """
    skeleton = _JSON_STRING.sub(b"", _JSON_ESCAPE.sub(b"", data) if b"\\" in data else data)
    containers = skeleton.count(b"{") + skeleton.count(b"[")
    if containers > limits.max_json_containers:
        raise CorruptMetadata(f"the metadata block holds {containers} objects and lists, more "
                              f"than the {limits.max_json_containers} allowed")
    values = containers + skeleton.count(b",") + skeleton.count(b":")
    if values > limits.max_json_values:
        raise CorruptMetadata(f"the metadata block holds {values} values, more than the "
                              f"{limits.max_json_values} allowed")
    if skeleton.count(b"}") + skeleton.count(b"]") != containers:
        raise CorruptMetadata("the metadata block is not valid JSON: its brackets do not pair up")
    # the nesting depth: a running count over the brackets alone (2 x containers), a slice
    # at a time so that hostile nesting costs little memory to refuse
    brackets = skeleton.translate(None, _NOT_A_BRACKET)
    if len(brackets) <= 2 * limits.max_json_depth:
        return   # too few to nest deeper
    if len(brackets) <= _FEW_BRACKETS:   # a conversation's: numpy's calls would cost more
        level = 0
        for bracket in brackets:
            level += 1 if bracket in _OPENERS else -1
            if level > limits.max_json_depth:
                raise CorruptMetadata("the metadata block is nested too deeply")
        return
    level = 0
    for start in range(0, len(brackets), 1 << 14):
        part = np.frombuffer(brackets[start:start + (1 << 14)], dtype=np.uint8)
        steps = ((part == ord("{")) | (part == ord("["))).view(np.int8) * np.int8(2) - np.int8(1)
        levels = np.cumsum(steps, dtype=np.int32) + level
        if int(levels.max()) > limits.max_json_depth:
            raise CorruptMetadata("the metadata block is nested too deeply")
        level = int(levels[-1])


_NOT_A_BRACKET = bytes(b for b in range(256) if b not in b"{}[]")
_OPENERS = frozenset(b"{[")
_FEW_BRACKETS = 4096


def decode_metadata(data: bytes | memoryview, limits: Limits = LIMITS) -> dict[str, Any]:
    data = bytes(data)
    if len(data) > limits.max_meta:
        raise CorruptMetadata(f"metadata of {len(data)} bytes exceeds the {limits.max_meta} byte cap")
    _check_json_shape(data, limits)
    try:
        meta = json.loads(data.decode("utf-8"))
    except RecursionError:
        raise CorruptMetadata("the metadata block is nested too deeply") from None
    except ValueError as exc:
        # JSONDecodeError and UnicodeDecodeError, and also the ValueError Python raises
        # for an integer of more than 4300 digits (sys.set_int_max_str_digits)
        raise CorruptMetadata(f"the metadata block is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CorruptMetadata("the metadata block is not a JSON object")
    return meta


# -- whole files --------------------------------------------------------------------------

@dataclass
class CheckpointData:
    """A checkpoint read into memory and verified against its checksums.

    Read with ``crc_later`` (read_checkpoint), a large state's checksum may still be being
    computed on a helper thread (``pending_crc``): everything else was checked, and the
    state's structure can be walked, but nothing may be kept from the file before
    :meth:`settle` has returned (engine.restore does, after llama.cpp has copied the state).
    Read with ``ancestor`` too, the recurrent block that ends the state stays
    unchecked after that (:meth:`holds_unchecked_bytes`) until it is used
    (:meth:`check_recurrent_later`), and the logits stay in the file (``logits`` None)
    until :meth:`read_logits` reads them.
    """
    header: Header
    meta: dict[str, Any]
    tokens: np.ndarray               # int32, n_tokens_total
    logits: np.ndarray | None        # float32, n_vocab
    state: np.ndarray                # uint8, llama.cpp's state: state_len bytes less the points'
    path: Path                       # the file it was read from
    payload_crc: int = 0             # the trailer's CRC32, which children of a delta chain name
    #: engine.checkpoints.chain.facts_of's answer, kept: a chain's links are checked twice.
    #: Typed loosely because the chain module sits above this one (imports point one way).
    link_facts: object = field(default=None, repr=False, compare=False)
    pending_crc: QueuedCrc | None = field(default=None, repr=False, compare=False)
    #: POINT_STATES: the recurrent states of the metadata's points, after ``state`` in the
    #: file (engine.checkpoints.points); empty otherwise, and when the state was not loaded
    point_states: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8), repr=False,
                                     compare=False)
    #: ``(crc32, length)`` of each point state the read did not checksum (see Points): the
    #: payload CRC is the CRC of the bytes before them combined with these
    unread_point_crcs: tuple[tuple[int, int], ...] = field(default=(), repr=False, compare=False)
    #: where in the file those point states begin when the read left them there (a copying
    #: read, macOS; a released mapping); 0 where they are in ``point_states`` (a mapping's),
    #: or none
    point_states_at: int = field(default=0, repr=False, compare=False)
    #: the file's mapping where ``state`` lies in it (engine.checkpoints.mapped), until
    #: :meth:`release`
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)
    #: :meth:`release` let the file go: ``state`` is gone, and restoring the file again is a
    #: caller's mistake (engine.restore refuses it)
    released: bool = field(default=False, repr=False, compare=False)
    #: the payload's running CRC32 before ``state``, and through its end where the checksum
    #: ended there and has been computed (None: not yet, or it went on over the point
    #: states): :meth:`crc_of_state_tail` derives a part's CRC from them
    crc_before_state: int = field(default=0, repr=False, compare=False)
    crc_through_state: int | None = field(default=None, repr=False, compare=False)
    #: ``(crc32, length)`` of the recurrent block that ends ``state``, as the metadata gives
    #: them, where the read left the block unchecked (``ancestor``: see The file's own
    #: recurrent block): its bytes are checked only once :meth:`check_recurrent_later` has
    #: queued their CRC (``recurrent_crc``) and :meth:`settle` has compared it
    unread_recurrent: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    recurrent_crc: QueuedCrc | None = field(default=None, repr=False, compare=False)
    #: ``(crc32, offset)`` of the logits section where the read left it in the file (an
    #: earlier file of a restore's chain: see Logits an earlier file holds); ``logits`` is
    #: None until :meth:`read_logits` has read and checked them
    unread_logits: tuple[int, int] | None = field(default=None, repr=False, compare=False)
    #: ``(offset in state, bytes)``: what :meth:`state_with_tail` wrote over in the mapping's
    #: private copy, until :meth:`put_back_tail` puts it back
    overwritten: tuple[int, bytes] | None = field(default=None, repr=False, compare=False)

    def read_logits(self) -> np.ndarray | None:
        """The file's logits (None: it holds none), read from the file where the read left
        them there, and checked then: ChecksumMismatch where they are not the bytes the
        metadata's CRC (under the payload CRC) vouches for, CorruptMetadata where they hold
        NaN or +inf, as a read of the whole file would have said.  OSError where the file
        cannot be read now (a copying read, which holds no mapping of the file)."""
        if self.unread_logits is None:
            return self.logits
        crc, offset = self.unread_logits
        out = np.empty(self.header.n_vocab, dtype="<f4")
        into = out.data.cast("B")
        if self.mapping is not None:   # the file as it was read, whatever replaced it since
            mapped.populate(self.mapping, offset, len(into))   # (a read error an error, not a fault)
            with memoryview(self.mapping) as view:
                into[:] = view[offset:offset + len(into)]
        elif read_at(self.path, offset, into) != len(into):
            raise TruncatedCheckpoint(f"{self.path.name} no longer holds its logits (replaced, or shortened)")
        if crc32(out) != crc:
            raise ChecksumMismatch(PAYLOAD_MISMATCH)
        self.logits, self.unread_logits = logits_of_bytes(out.view(np.uint8)), None
        self.logits.flags.writeable = False
        return self.logits

    def logits_in_file(self) -> BytesInFile | None:
        """Where the file holds the logits the read left there (:attr:`unread_logits`), with
        the metadata's CRC of them, to be read when used (:func:`logits_of_bytes`); None where
        they were read (or there are none)."""
        if self.unread_logits is None:
            return None
        crc, offset = self.unread_logits
        return BytesInFile(self.path, offset, self.header.n_vocab * 4, crc)

    def holds_point_states(self) -> bool:
        """Whether the points' recurrent states can be had (:meth:`point_state`)."""
        return bool(len(self.point_states) or self.point_states_at)

    def point_state(self, start: int, length: int) -> np.ndarray | None:
        """Bytes ``start..start+length`` of the points' recurrent states (within them: the
        metadata's lengths bound them): a view of ``point_states``, or, where the read left
        them in the file, read from it now, unchecked (a point's own CRC is checked when it is
        used: engine.checkpoints.points.check_point_crc); None where the file no longer holds
        them (gone, shorter)."""
        if len(self.point_states):
            return self.point_states[start:start + length]
        if not self.point_states_at:
            return None
        out = np.empty(length, dtype=np.uint8)
        try:
            done = read_at(self.path, self.point_states_at + start, out.data.cast("B"))
        except OSError:
            return None
        out.flags.writeable = False
        return out if done == length else None

    def point_states_offset(self) -> int | None:
        """Where in the file the points' recurrent states begin (:meth:`point_state`'s
        ``start`` counts from there); None where the read holds none of them."""
        if len(self.point_states):
            return self.header.state_offset + self.header.state_len - len(self.point_states)
        return self.point_states_at or None

    def release(self) -> None:
        """Let the file go, where the state lies in a mapping of it: on Windows a mapped
        file can be neither replaced nor deleted (engine.checkpoints.mapped), so a restore's
        reader releases its chain once it is done with the states
        (engine.checkpoints.chain.release).  Waits for a checksum still reading the mapping
        (its verdict stays :meth:`settle`'s).  The header, metadata, tokens and logits stay
        (logits the read left in the file: read from it by :meth:`read_logits`, checked);
        the state goes, and the points' recurrent states are read from the file when one is
        used (checked against its own CRC then), as a copying read leaves them, where every
        point gives a CRC; where they do not, the points are gone with the state.  Nothing
        to do for a read that copied."""
        mapping = self.mapping
        if mapping is None:
            return
        for job in (self.pending_crc, self.recurrent_crc):
            if job is not None:
                job.wait()
        if len(self.point_states) and recurrent_crcs(self.meta) is not None:
            self.point_states_at = self.point_states_offset() or 0
        self.state = self.point_states = np.empty(0, np.uint8)
        self.mapping, self.released, self.crc_through_state, self.overwritten = None, True, None, None
        try:
            mapping.close()
        except BufferError:   # a view of it is still held: unmapped when that goes
            log.warning("%s stays mapped: a view of its state is still held", self.path.name)

    def settle(self) -> None:
        """Wait for a checksum still being computed; ChecksumMismatch when the file was
        damaged (and again on every later call).  Returns at once for a checked file."""
        job = self.pending_crc
        if job is not None:
            through = job.result()
            if _with_unread(through, self._unread_parts()) != self.payload_crc:
                raise ChecksumMismatch(PAYLOAD_MISMATCH)
            self.pending_crc = None
            if self.unread_recurrent is None and (not self.header.has_point_states or self.unread_point_crcs):
                self.crc_through_state = through   # (it ended at the state's end)
        recurrent = self.recurrent_crc
        if recurrent is not None and self.unread_recurrent is not None \
                and recurrent.result() != self.unread_recurrent[0]:
            raise ChecksumMismatch(PAYLOAD_MISMATCH)

    def holds_unchecked_bytes(self) -> bool:
        """Whether the end of ``state`` (its recurrent block) has not been checked, even once
        settled: the read left it unread and nothing has used it since."""
        return self.unread_recurrent is not None and self.recurrent_crc is None

    def sets_tail_in_place(self) -> bool:
        """Whether :meth:`state_with_tail` can end the state with other bytes without a copy:
        the state lies in the file's mapping (private: engine.checkpoints.mapped) and ends with
        the recurrent block the read left unread, which nothing reads meanwhile (neither the
        payload's checksum, which went around it, nor a check queued since)."""
        return self.mapping is not None and self.holds_unchecked_bytes() and self.overwritten is None

    def state_with_tail(self, cut: int, tail: bytes) -> np.ndarray | None:
        """The first ``cut`` bytes of the state followed by ``tail``, which replaces bytes of
        the unread recurrent block (``cut`` at or after its start, ``tail`` within it), as
        one buffer and without copying the ``cut`` bytes: ``tail`` is written into the
        mapping, whose pages are this process's own copies once written (the file is never
        written), until :meth:`put_back_tail`.  A hybrid's attention part, set without its
        recurrent state, is a few hundred bytes away from its file's bytes (engine.restore);
        a copy of it lands in fresh memory, whose page faults cost more than llama.cpp's own
        copy.  None where this cannot be done (:meth:`sets_tail_in_place`): the caller copies."""
        if not self.sets_tail_in_place():
            return None
        assert self.unread_recurrent is not None and self.mapping is not None   # (sets_tail_in_place)
        if cut < len(self.state) - self.unread_recurrent[1] or cut + len(tail) > len(self.state):
            raise ValueError("the tail replaces bytes outside the unread recurrent block")
        start = self.header.state_offset + cut
        mapped.populate(self.mapping, start, len(tail))   # (a read error an error, not a fault)
        out = np.frombuffer(self.mapping, dtype=np.uint8, count=cut + len(tail), offset=self.header.state_offset)
        self.overwritten = (cut, out[cut:].tobytes())
        out[cut:] = np.frombuffer(tail, dtype=np.uint8)
        return out

    def put_back_tail(self) -> None:
        """Put back the bytes :meth:`state_with_tail` replaced: the state is the file's again."""
        if self.overwritten is None:
            return
        cut, was = self.overwritten
        assert self.mapping is not None
        np.frombuffer(self.mapping, dtype=np.uint8, count=len(was), offset=self.header.state_offset + cut)[:] = \
            np.frombuffer(was, dtype=np.uint8)
        self.overwritten = None

    def _unread_parts(self) -> tuple[tuple[int, int], ...]:
        """``(crc32, length)`` of each part at the end of the state section the read did not
        checksum, in the file's order: the recurrent block, the points' states."""
        own = () if self.unread_recurrent is None else (self.unread_recurrent,)
        return own + self.unread_point_crcs

    def check_recurrent_later(self) -> None:
        """Have the recurrent block the read left unchecked checksummed, on the helper thread
        (:meth:`settle` gives the verdict): the block is about to be used after all (a restore
        sets it).  Nothing to do where the read checked it."""
        if self.unread_recurrent is None or self.recurrent_crc is not None:
            return
        if self.released:
            raise ValueError(f"{self.path.name} was released: its state is gone")
        assert self.overwritten is None, "the block is checked as the file holds it"
        view = byte_view(self.state)
        self.recurrent_crc = queue_crc(view[len(view) - self.unread_recurrent[1]:], 0)

    def crc_of_state_tail(self, start: int) -> int:
        """The CRC32 of ``state[start:]`` (settled: checked), from the checksum the read
        computed where it ended at the state's end and the part before ``start`` is the
        shorter (a gated delta-net's recurrent block after ~1 MB of attention cells: that
        megabyte is read, not the 12.6 MB), else from the bytes themselves.  CRC32 is
        linear: crc(B) = crc(P+A+B) xor combine(crc(P+A), 0, len(B)).  The recurrent block
        the read left unchecked: the metadata's CRC of it (under the payload CRC), for its
        user to check the bytes against when it reads them."""
        if self.released:
            raise ValueError(f"{self.path.name} was released: its state is gone")
        view = byte_view(self.state)
        if self.unread_recurrent is not None:
            if start == len(view) - self.unread_recurrent[1]:
                return self.unread_recurrent[0]
            self.check_recurrent_later()   # other bytes with it: checked before their CRC is vouched for
            self.settle()
            return crc32(view[start:])
        through = self.crc_through_state
        if crc_combine is None or through is None or start > len(view) - start:
            return crc32(view[start:])
        return through ^ crc_combine(crc32(view[:start], self.crc_before_state), 0, len(view) - start)


def _with_unread(crc: int, unread: Sequence[tuple[int, int]]) -> int:
    """The CRC32 of the bytes ``crc`` is of followed by the unread parts whose CRCs and
    lengths ``unread`` gives (engine.checkpoints.crc.combine, which the reader had)."""
    for part_crc, length in unread:
        assert crc_combine is not None
        crc = crc_combine(crc, part_crc, length)
    return crc


#: Payloads at least this large have their CRC32 computed on a helper thread while the
#: bytes are written; below it the checksum is computed inline (starting a thread costs
#: more than checksumming a small delta).  With the fast CRC (engine.checkpoints.crc:
#: ~37 GB/s) the checksum always is inline.  Read at call time: benchmarks and tests set it.
CRC_THREAD_MIN_BYTES = 1 << 62 if CRC_FAST else 1 << 20


class _CrcThread:
    """The CRC32 of some buffers, computed on a helper thread while the caller writes them.

    zlib's ``crc32`` (the fallback of engine.checkpoints.crc) releases the GIL for
    buffers above a few kilobytes and so does a file write, so checksum and write run
    on two cores at once and the save takes about as long as the longer of the two
    instead of their sum.  The buffers must not change until :meth:`result` or
    :meth:`cancel` has returned.  Chunks as large as the writer's
    keep the GIL hand-offs as few as theirs (a busy UI thread makes each one wait).
    """

    def __init__(self, parts: tuple[memoryview, ...], chunk: int = 8 << 20, initial: int = 0) -> None:
        self._parts = parts
        self._chunk = chunk
        self._initial = initial   # the CRC of the bytes before these (crc32's running value)
        self._stop = threading.Event()
        self._value: int | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="checkpoint-crc", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        crc = self._initial
        try:
            for view in self._parts:
                for start in range(0, len(view), self._chunk):
                    if self._stop.is_set():
                        return
                    crc = crc32(view[start:start + self._chunk], crc)
            self._value = crc
        except BaseException as exc:  # handed to the writing thread by result()
            self._error = exc

    def result(self) -> int:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._value is None:
            raise RuntimeError("the checksum was cancelled")
        return self._value

    def cancel(self) -> None:
        """Stop early (a failed write) and wait, so the caller may reuse its buffers."""
        self._stop.set()
        self._thread.join()


#: What a state arrives as: llama.cpp's bytes, or a numpy array read from a file.
StateBytes = bytes | bytearray | memoryview | np.ndarray


def byte_view(data: StateBytes) -> memoryview:
    """``data`` as a flat view of its bytes (an array through its own buffer)."""
    return (data.data if isinstance(data, np.ndarray) else memoryview(data)).cast("B")


def write_sections(out: BinaryIO, header: Header, meta_bytes: bytes, tokens: np.ndarray,
                   logits: np.ndarray | None, state: StateBytes,
                   chunk: int = 2 << 20, point_states: Sequence[StateBytes] = (),
                   state_tail_crc: tuple[int, int] | None = None) -> tuple[Header, int]:
    """Write a whole checkpoint to ``out``; returns the header as written and the payload CRC.
    ``point_states``: the recurrent states of the metadata's points, after ``state``
    (POINT_STATES, see the module docstring).  ``state_tail_crc``: ``(crc32, length)`` of
    the last bytes of ``state``, computed already (the metadata's ``recurrent_block``): not
    computed again.

    The state is written in chunks straight from the caller's buffer (no second copy of
    it is made).  A payload of :data:`CRC_THREAD_MIN_BYTES` or more is checksummed on a
    helper thread while it is written; the file's bytes are the same either way.
    """
    tokens_bytes = np.ascontiguousarray(tokens, dtype="<i4").tobytes()
    logits_bytes = b"" if logits is None else np.ascontiguousarray(logits, dtype="<f4").tobytes()
    state_views = (byte_view(state), *(byte_view(p) for p in point_states if len(p)))
    flags = (FLAG_HAS_LOGITS if logits is not None else 0) | (
        FLAG_PREFILL_PENDING if header.n_tokens < header.n_tokens_total else 0) | (
        header.flags & (FLAG_DELTA | FLAG_CELL_EXT)) | (FLAG_POINT_STATES if len(state_views) > 1 else 0)
    header = replace(header, flags=flags, meta_len=len(meta_bytes), tokens_len=len(tokens_bytes),
                     logits_len=len(logits_bytes), state_len=sum(len(v) for v in state_views))
    parts = tuple(memoryview(p).cast("B") for p in (meta_bytes, tokens_bytes, logits_bytes)) + state_views
    packed = pack_header(header)
    # the reader's own checks, before a byte is written: never write what cannot be read
    unpack_header(packed, header.file_len)
    if _point_states_len(header, json.loads(meta_bytes) if header.has_point_states else {},
                         LIMITS) != header.state_len - len(state_views[0]):
        raise CorruptMetadata("the metadata's points do not say the lengths of their recurrent states")
    out.write(packed)
    if header.payload_len >= CRC_THREAD_MIN_BYTES:
        job = _CrcThread(parts, chunk)
        try:
            _write_parts(out, parts, chunk, len(packed))
            crc = job.result()
        finally:
            job.cancel()  # returns at once when finished; stops it after a failed write
    else:
        _write_parts(out, parts, chunk, len(packed))
        crc = 0
        tail_crc, tail_len = state_tail_crc if state_tail_crc and crc_combine is not None else (0, 0)
        for i, part in enumerate(parts):
            if i == 3 and tail_len:   # llama.cpp's state
                assert crc_combine is not None
                crc = crc_combine(crc32(part[:len(part) - tail_len], crc), tail_crc, tail_len)
            else:
                crc = crc32(part, crc)
    out.write(struct.pack("<I", crc) + TRAILER_MAGIC)
    return header, crc


def _write_parts(out: BinaryIO, parts: tuple[memoryview, ...], chunk: int, offset: int) -> None:
    """Write ``parts`` from file offset ``offset`` in writes of at most ``chunk`` bytes, none
    crossing a multiple of ``chunk`` in the file (a part's first and last may be shorter).

    Why aligned: a file system with large folios (ext4 from Linux 6.16, xfs) caches a
    write of 2 MiB at a 2 MiB boundary as one 2 MiB page, which a restore maps with one
    page-table entry instead of 512 (engine.checkpoints.mapped).  Measured here on a 24 MB
    state just written: populating its mapping 1.04 ms written unaligned, 0.16 ms aligned
    (benchmarks.page_cache).  The bytes are the same.
    """
    if chunk <= 0:
        raise ValueError(f"a write chunk must be positive, not {chunk}")
    for view in parts:
        start = 0
        while start < len(view):
            end = min(len(view), start + chunk - (offset + start) % chunk)
            out.write(view[start:end])
            start = end
        offset += len(view)


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise TruncatedCheckpoint(f"the file ends inside its {what}")
    return data


#: what a payload whose CRC32 differs from its trailer's is
PAYLOAD_MISMATCH = "payload checksum mismatch: the file was damaged after it was written"

#: with ``crc_later`` (engine.checkpoints.crc_helper), states at least this large are
#: queued to the helper thread; smaller ones cost less inline than the hand-over.  Measured
#: (benchmarks.restore_profile, a new process per restore, medians of 7, 2026-12-07), 1 MiB
#: against the 4 MiB this was with the fast CRC: 12 turn files of ~3 MB at Qwen3.5-4B's
#: widths 11.43 vs 13.59 ms (0.84), SmolLM2's 12 of ~2 MB 6.82 vs 7.80 ms (0.87), its other
#: layouts and single files unchanged (0.97-1.08, the noise); zlib's CRC, 8x slower, was
#: handed over from 1 MiB already.  (When each chain still started a thread of its own,
#: 2 MB files had cost more queued.)  Read at call time: benchmarks and tests set it.
CRC_LATER_MIN_BYTES = 1 << 20


def read_checkpoint(path: str | os.PathLike, *, load_state: bool = True, limits: Limits = LIMITS,
                    progress=None, crc_later: bool = False, ancestor: bool = False) -> CheckpointData:
    """Read a checkpoint and verify its header, lengths and payload CRC.

    Compatibility with a model is not checked here (see engine.checkpoints.compat); this only
    establishes that the file is intact and well-formed.  ``progress(done, total)`` is
    called while the state streams in.  The state is a read-only array: on Linux the
    file's own pages, mapped (engine.checkpoints.mapped); on Windows too for a restore's
    read (``crc_later``: whoever restores releases it, :meth:`CheckpointData.release`);
    elsewhere a copy.

    ``crc_later``: a state of :data:`CRC_LATER_MIN_BYTES` or more is checksummed on the
    process's helper thread (engine.checkpoints.crc_helper), so that llama.cpp can copy it meanwhile
    (engine.restore); the caller must :meth:`CheckpointData.settle` before it keeps
    anything of the file.  With ``crc_later``, the points' recurrent states of a file whose
    points give their own CRCs are not checksummed (see Points), and not copied: a copying
    read leaves them in the file (``CheckpointData.point_state``).  ``ancestor`` (with
    ``crc_later``): an earlier file of a restore's chain, its logits and, mapped, its own
    recurrent block left unread where the metadata vouches for them (see above).
    """
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = unpack_header(f.read(HEADER_LEN), size, limits)
        meta_bytes = _read_exact(f, header.meta_len, "metadata")
        crc = crc32(meta_bytes)
        meta = decode_metadata(meta_bytes, limits)
        tail = _point_states_len(header, meta, limits)
        unread = _unread_point_crcs(meta) if crc_later and load_state and tail else ()
        checked_len = header.state_len - (tail if unread else 0)   # what is checksummed now or later
        logits_left = logits_claim(meta, header) if crc_later and ancestor and load_state else None
        tokens_view, logits_view, crc = _read_arrays(f, header, crc, logits_left)
        before_state = crc
        # (where the unread bytes then end the section: the block, the points' states)
        claim = own_recurrent_crc(meta, checked_len) if crc_later and ancestor and (unread or not tail) else None
        mapping = _mapping_of(f, size, header, path, crc_later, claim is not None) if load_state else None
        own = claim if mapping is not None else None
        checked_len -= own[1] if own else 0
        later = crc_later and load_state and checked_len >= CRC_LATER_MIN_BYTES
        # later: crc stays the CRC of the bytes before the state, where the helper goes on from
        if mapping is not None:
            state, state_crc = _mapped_state(f.fileno(), mapping, header, None if later else crc, progress,
                                             checked_len)
            if state_crc is not None:   # None: left to the helper
                crc = state_crc
            f.seek(size - TRAILER_LEN)
        else:
            # np.empty, not bytearray(n): zero-filling a large state holds the GIL (~55 ms per
            # 88 MB) and would freeze the UI thread; readinto overwrites every byte anyway.
            # Point states left unread stay in the file: a copy costs what a mapping does not
            state = np.empty(checked_len if load_state else 0, dtype=np.uint8)
            if load_state:
                state_crc = _read_state_into(f, state, None if later else crc, progress)
                if state_crc is not None:   # None: left to the helper
                    crc = state_crc
                state.flags.writeable = False   # as a mapped state: nobody edits a checked state
                f.seek(size - TRAILER_LEN)
            else:
                crc = _crc_of_rest(f, header.state_len, crc, progress)
        stored_crc = _trailer_crc(_read_exact(f, TRAILER_LEN, "trailer"))
    # one call over the whole state: crc32 holds no GIL while it runs, and a thread that had
    # to take the GIL back between chunks would wait for the restoring thread's Python code
    job = queue_crc(byte_view(state[:checked_len]), crc) if later else None
    if job is None and stored_crc != _with_unread(crc, ((own,) if own else ()) + unread):
        raise ChecksumMismatch(PAYLOAD_MISMATCH)
    data = CheckpointData(header=header, meta=meta, tokens=np.empty(0, np.int32), logits=None, state=state,
                          path=path, payload_crc=stored_crc, pending_crc=job, unread_point_crcs=unread,
                          mapping=mapping, crc_before_state=before_state, unread_recurrent=own,
                          unread_logits=None if logits_left is None else (logits_left, header.logits_offset),
                          crc_through_state=crc if load_state and job is None and not own
                          and (unread or not tail) else None)
    if tail and load_state:
        _place_point_states(data, tail, checked_len + (own[1] if own else 0))
    try:
        data.tokens, data.logits = _token_arrays(header, tokens_view, logits_view)
    except CorruptMetadata:
        data.settle()   # damage is the reason, when the checksum says so
        raise
    return data


def _read_arrays(f: BinaryIO, header: Header, crc: int,
                 logits_left: int | None) -> tuple[memoryview, memoryview | None, int]:
    """The token array and the logits, read after the metadata, and the payload's running
    CRC32 ``crc`` through them.  ``logits_left``: the metadata's CRC of the logits, which the
    read leaves in the file (see Logits an earlier file holds: CheckpointData.read_logits):
    combined in, and None for their bytes."""
    if logits_left is None:
        # tokens and logits in one read: the header's checks bound them by the file's length
        arrays = memoryview(_read_exact(f, header.tokens_len + header.logits_len, "token array and logits"))
        return arrays[:header.tokens_len], arrays[header.tokens_len:], crc32(arrays, crc)
    assert crc_combine is not None
    tokens_view = memoryview(_read_exact(f, header.tokens_len, "token array"))
    f.seek(header.state_offset)
    return tokens_view, None, crc_combine(crc32(tokens_view, crc), logits_left, header.logits_len)


def _trailer_crc(trailer: bytes) -> int:
    """The payload CRC the trailer stores; ChecksumMismatch where its end marker is damaged."""
    stored_crc, end_magic = struct.unpack("<I4s", trailer)
    if end_magic != TRAILER_MAGIC:
        raise ChecksumMismatch("the trailer is damaged (end marker missing)")
    return stored_crc


def _place_point_states(data: CheckpointData, tail: int, checked_len: int) -> None:
    """Where a loaded file's ``tail`` bytes of point states are: split off the state read
    whole (after the checksum was given the whole section), or left in the file (a copying
    read that did not read them)."""
    h = data.header
    if len(data.state) == h.state_len:
        data.state, data.point_states = data.state[:h.state_len - tail], data.state[h.state_len - tail:]
    else:
        data.point_states_at = h.state_offset + checked_len


def _point_states_len(header: Header, meta: dict[str, Any], limits: Limits) -> int:
    """Bytes of the points' recurrent states at the end of the state section (0 without
    POINT_STATES); CorruptMetadata where the metadata does not account for them."""
    if not header.has_point_states:
        return 0
    lengths = recurrent_lengths(meta)
    if lengths is None or len(lengths) > limits.max_points:
        raise CorruptMetadata("the file says it holds its points' recurrent states, and its "
                              "metadata does not list their lengths")
    total = sum(lengths)
    if total >= header.state_len:
        raise CorruptMetadata("the points' recurrent states take the whole state section")
    return total


def _unread_point_crcs(meta: dict[str, Any]) -> tuple[tuple[int, int], ...]:
    """``(crc32, length)`` of each point state of a POINT_STATES file, which a restore's read
    leaves unread (see Points); () where a point gives no CRC or this build cannot combine
    CRCs (engine.checkpoints.crc.combine): every byte is checksummed then."""
    crcs, lengths = recurrent_crcs(meta), recurrent_lengths(meta)
    if crc_combine is None or crcs is None or lengths is None or len(crcs) != len(lengths):
        return ()
    return tuple(zip(crcs, lengths, strict=True))


def own_recurrent_crc(meta: dict[str, Any], state_len: int) -> tuple[int, int] | None:
    """``(crc32, length)`` of the recurrent block the metadata says ends the ``state_len``
    bytes of llama.cpp's state (see The file's own recurrent block); None where it says none
    that could be (missing, mistyped, longer than the state after its magic and sequence
    id) or this build cannot combine CRCs: every byte is checksummed then."""
    block = meta.get("recurrent_block")
    if crc_combine is None or not isinstance(block, dict):
        return None
    length, crc = block.get("len"), block.get("crc32")
    if type(length) is not int or type(crc) is not int or not 0 < length <= state_len - 8 \
            or not 0 <= crc <= 0xFFFFFFFF:
        return None
    return crc, length


def logits_claim(meta: dict[str, Any], header: Header) -> int | None:
    """The CRC32 the metadata gives a file's logits section (see Logits an earlier file
    holds); None where it gives none that could be (missing, mistyped), the file holds no
    logits, or this build cannot combine CRCs: they are read and checksummed then."""
    crc = meta.get("logits_crc32")
    if crc_combine is None or not header.has_logits or type(crc) is not int or not 0 <= crc <= 0xFFFFFFFF:
        return None
    return crc


def logits_crc(logits: np.ndarray) -> int:
    """The metadata ``logits_crc32`` of a file that holds ``logits`` (as write_sections writes them)."""
    return crc32(np.ascontiguousarray(logits, dtype="<f4"))


def check_logits_claim(data: CheckpointData) -> None:
    """CorruptMetadata unless the CRC32 the metadata gives the logits (where it gives one) is
    that of the logits a file read whole holds: a restore that reads the file as an earlier
    one of its chain trusts it (validation and import check it)."""
    claim = logits_claim(data.meta, data.header)
    if claim is not None and data.logits is not None and logits_crc(data.logits) != claim:
        raise CorruptMetadata("the checksum its metadata gives the logits is not theirs")


def recurrent_block_metadata(state: StateBytes, length: int) -> dict[str, int]:
    """The metadata ``recurrent_block`` of a file whose llama.cpp state ``state`` ends with a
    recurrent block of ``length`` bytes (kvstate.recurrent_block_len of its walk)."""
    view = byte_view(state)
    return {"len": length, "crc32": crc32(view[len(view) - length:])}


def _token_arrays(header: Header, tokens_view: memoryview,
                  logits_view: memoryview | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The token ids and the logits, checked: read-only arrays over the bytes read (copied
    only where the machine's byte order is not the file's); ``logits_view`` None: the read
    left them in the file (no logits yet)."""
    tokens = np.frombuffer(tokens_view, dtype="<i4").astype(np.int32, copy=False)
    if len(tokens) and (tokens.min() < 0 or tokens.max() >= header.n_vocab):
        raise CorruptMetadata("the token array holds ids outside the vocabulary")
    logits = None
    if header.has_logits and logits_view is not None:
        logits = _checked_logits(np.frombuffer(logits_view, dtype="<f4").astype(np.float32, copy=False))
    return tokens, logits


def logits_of_bytes(raw: np.ndarray) -> np.ndarray:
    """Logits as a file stores them (little-endian float32 bytes, their CRC checked:
    CheckpointData.logits_in_file) as float32, unless they hold NaN or +inf (CorruptMetadata)."""
    return _checked_logits(raw.view("<f4").astype(np.float32, copy=False))


def _checked_logits(logits: np.ndarray) -> np.ndarray:
    """``logits``, unless they hold NaN or +inf (CorruptMetadata)."""
    # -inf is a masked-out token (a grammar, a banned id); NaN and +inf are damage: the
    # largest is NaN where one is, +inf where one is (one pass, no mask to allocate)
    if len(logits) and not logits.max() < np.inf:
        raise CorruptMetadata("the stored logits hold NaN or infinite values")
    return logits


def _mapping_of(f: BinaryIO, size: int, header: Header, path: Path, crc_later: bool,
                leaves_block: bool) -> mmap.mmap | None:
    """The open file's mapping (engine.checkpoints.mapped.map_file), or None where it is read:
    a restore's read (``crc_later``) releases it when done (CheckpointData.release); private
    where the restore may write over the start of the recurrent block it leaves unread
    (``leaves_block``: CheckpointData.state_with_tail)."""
    return mapped.map_file(f.fileno(), size, header.state_len, crc_later, path, private=leaves_block)


def _mapped_state(fileno: int, mapping, header: Header, crc: int | None, progress,
                  checked_len: int) -> tuple[np.ndarray, int | None]:
    """:func:`_map_state` of an open file, its first ``checked_len`` bytes checksummed now
    (``crc`` None: left to the helper, which maps in a state by reading it, on another core,
    where no page of it needs the disk: engine.checkpoints.mapped).  The bytes after them,
    which the read leaves unchecked, are read only if they are used (the walk reads a
    recurrent block's row headers): mapped.ready_to_read_later."""
    populate = crc is not None or not mapped.in_page_cache(fileno, header.state_offset, checked_len)
    state, state_crc = _map_state(mapping, header, crc, progress, populate, checked_len)
    mapped.ready_to_read_later(mapping, fileno, header.state_offset + checked_len, header.state_len - checked_len)
    return state, state_crc


def _map_state(mapping, header: Header, crc: int | None, progress, populate: bool, checked_len: int,
               chunk: int = 8 << 20) -> tuple[np.ndarray, int | None]:
    """The state section of a mapped file, its first ``checked_len`` bytes (the rest: point
    states left unread, see Points) each chunk mapped in first (``populate``; never a fault to
    disk: see engine.checkpoints.mapped) and checksummed in turn (``crc`` None: not
    checksummed); the array holds the mapping, the whole section."""
    start = header.state_offset
    state = np.frombuffer(mapping, dtype=np.uint8, count=header.state_len, offset=start)
    state.flags.writeable = False   # (a private mapping is writable: nobody edits a checked state)
    total = checked_len
    view = memoryview(mapping)[start:start + total]
    try:
        done = 0
        while done < total:
            n = min(chunk, total - done)
            if populate:
                mapped.populate(mapping, start + done, n)
            if crc is not None:
                crc = crc32(view[done:done + n], crc)
            done += n
            if progress:
                progress(done, total)
    finally:
        view.release()
    return state, crc


def _read_state_into(f: io.BufferedIOBase, state: np.ndarray, crc: int | None, progress,
                     chunk: int = 8 << 20) -> int | None:
    """Read ``len(state)`` bytes of the state section into ``state``, checksummed (``crc``
    None: not)."""
    view = state.data.cast("B")
    done = 0
    total = len(state)
    while done < total:
        n = f.readinto(view[done:done + chunk])
        if not n:
            raise TruncatedCheckpoint("the file ends inside its KV state")
        if crc is not None:
            crc = crc32(view[done:done + n], crc)
        done += n
        if progress:
            progress(done, total)
    return crc


def _crc_of_rest(f: io.BufferedIOBase, length: int, crc: int, progress, chunk: int = 8 << 20) -> int:
    buf = bytearray(min(chunk, max(length, 1)))
    view = memoryview(buf)
    done = 0
    while done < length:
        n = f.readinto(view[:min(chunk, length - done)])
        if not n:
            raise TruncatedCheckpoint("the file ends inside its KV state")
        crc = crc32(view[:n], crc)
        done += n
        if progress:
            progress(done, length)
    return crc


def verify_file(path: str | os.PathLike, progress=None) -> Header:
    """Full integrity check (header, lengths, CRC) without keeping the state in memory."""
    return read_checkpoint(path, load_state=False, progress=progress).header


def read_metadata(path: str | os.PathLike) -> tuple[Header, dict[str, Any]]:
    """Header and metadata only; the state bytes are not read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = unpack_header(f.read(HEADER_LEN), size)
        meta = decode_metadata(_read_exact(f, header.meta_len, "metadata"))
    return header, meta


def read_tokens(path: str | os.PathLike) -> tuple[Header, np.ndarray]:
    """Header and token array only; no CRC check."""
    header, _meta, tokens = read_index_facts(path, metadata=False)
    return header, tokens


def read_index_facts(path: str | os.PathLike, *,
                     metadata: bool = True) -> tuple[Header, dict[str, Any] | None, np.ndarray]:
    """Header, metadata (``metadata``: for a file whose points carry states, which a prefix
    index lists; else None, not read) and token array, in one opening; no CRC check."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        header = unpack_header(f.read(HEADER_LEN), size)
        meta = None
        if metadata and header.has_point_states:
            meta = decode_metadata(_read_exact(f, header.meta_len, "metadata"))
        else:
            f.seek(HEADER_LEN + header.meta_len)
        data = _read_exact(f, header.tokens_len, "token array")
    return header, meta, np.frombuffer(data, dtype="<i4").astype(np.int32)


def stored_payload_crc(path: str | os.PathLike) -> int | None:
    """The payload CRC a file's trailer states (not verified), or None when it cannot be
    read: whether a file is still the version a writer linked to (a delta's parent)."""
    try:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < HEADER_LEN + TRAILER_LEN:
                return None
            f.seek(-TRAILER_LEN, os.SEEK_END)
            trailer = f.read(TRAILER_LEN)
    except OSError:
        return None
    return int.from_bytes(trailer[:4], "little") if trailer[4:] == TRAILER_MAGIC else None
