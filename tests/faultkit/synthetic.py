"""Well-formed checkpoints without a model, for tests that need thousands of saves.

The files are written by the real writer (``write_sections`` inside ``atomic_write``)
and carry a KV state blob laid out exactly as llama.cpp writes it (see engine.checkpoints.kvstate),
so the real reader and the state walker check them as they would a model's file.  The
metadata records which conversation and which save (``seq``) a file is, so a test can
tell the previous version from the new one after a crash.
"""

from __future__ import annotations

import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.checkpoints import format as fmt
from engine.checkpoints.atomic import atomic_write
from engine.checkpoints.kvstate import STATE_MAGIC, check_state_for

N_LAYER, N_HEAD_KV, HEAD_DIM, N_VOCAB, N_CTX = 4, 2, 16, 512, 4096
F16 = 1


def state_blob(n_tokens: int, seed: int, *, flash_attn: bool = False) -> bytes:
    """A one-cache, one-stream sequence state of ``n_tokens`` cells with f16 K/V."""
    rng = np.random.default_rng(seed)
    cells = np.zeros((n_tokens, 3), dtype="<i4")
    cells[:, 0] = np.arange(n_tokens)
    cells[:, 1] = 1                                    # one seq id each: sequence 0
    row = 2 * N_HEAD_KV * HEAD_DIM                     # f16 bytes per cell and layer
    parts = [struct.pack("<IiII", STATE_MAGIC, 0, 1, n_tokens), cells.tobytes(),
             struct.pack("<II", 0 if flash_attn else 1, N_LAYER)]
    for _ in range(N_LAYER):
        parts += [struct.pack("<iQ", F16, row), rng.bytes(row * n_tokens)]
    for _ in range(N_LAYER):
        if flash_attn:
            parts += [struct.pack("<iQ", F16, row), rng.bytes(row * n_tokens)]
        else:
            parts += [struct.pack("<iII", F16, 2, N_HEAD_KV * HEAD_DIM), rng.bytes(row * n_tokens)]
    return b"".join(parts)


def header(conv_id: uuid.UUID, n_tokens: int, kind: int, title: str = "synthetic",
           n_generated: int = 0, flash_attn: bool = False) -> fmt.Header:
    return fmt.Header(
        model_fingerprint=b"synthetic-model!", model_size=123456, n_vocab=N_VOCAB,
        n_layer=N_LAYER, n_head_kv=N_HEAD_KV, n_embd_head_k=HEAD_DIM, n_embd_head_v=HEAD_DIM,
        n_swa=0, n_ctx=N_CTX, type_k=F16, type_v=F16, flash_attn=flash_attn, kv_unified=True,
        n_seq_max=1, n_tokens=n_tokens, n_tokens_total=n_tokens, n_generated=n_generated,
        created_unix_ns=time.time_ns(), conversation_id=conv_id, library="synthetic",
        title=title, kind=kind)


def fixed_path(store, conv_id: uuid.UUID) -> Path:
    """One file per conversation, rewritten in place by every save (as ``run
    --checkpoint-save P`` rewrites P): what the atomic-replacement tests hammer."""
    store._mark()
    return store.folder / f"autosave-{conv_id.hex[:12]}{fmt.EXTENSION}"


def write(path: Path, conv_id: uuid.UUID, seq: int, *, kind: int = fmt.KIND_AUTOSAVE,
          n_tokens: int | None = None, writer: int = 0, title: str = "synthetic",
          durable: bool = True, line: str | None = None) -> Path:
    """Atomically save save number ``seq`` of conversation ``conv_id`` to ``path``.

    ``line`` puts the file on a line of history of its own (engine.checkpoints.graph):
    by default it shares its conversation's line.
    """
    if n_tokens is None:   # vary the size so that kills land in every phase of a save
        n_tokens = 16 + (seq * 7919 + writer * 104729) % 1000
    h = header(conv_id, n_tokens, kind, title, n_generated=min(seq, n_tokens))
    fields = {"conversation": str(conv_id), "seq": seq, "writer": writer, "title": title}
    if line is not None:
        fields["line"] = line
    meta = fmt.encode_metadata(fields)
    tokens = (np.arange(n_tokens, dtype=np.int32) * 31 + seq) % N_VOCAB
    logits = np.linspace(-5, 5, N_VOCAB, dtype=np.float32)
    with atomic_write(path, durable=durable) as f:
        fmt.write_sections(f, h, meta, tokens, logits, state_blob(n_tokens, seed=seq * 1000 + writer))
    return path


def file_bytes(n_tokens: int = 8, seq: int = 1, conv_id: uuid.UUID | None = None) -> bytes:
    """One small checkpoint as bytes (for mutation tests that need thousands of them)."""
    import io
    conv_id = conv_id or uuid.UUID(int=42)
    h = header(conv_id, n_tokens, fmt.KIND_MANUAL)
    h = fmt.replace(h, created_unix_ns=1_700_000_000_000_000_000)
    meta = fmt.encode_metadata({"conversation": str(conv_id), "seq": seq, "title": "t"})
    out = io.BytesIO()
    fmt.write_sections(out, h, meta, np.arange(n_tokens, dtype=np.int32),
                       np.zeros(N_VOCAB, np.float32), state_blob(n_tokens, seed=seq))
    return out.getvalue()


@dataclass(frozen=True)
class Checked:
    header: fmt.Header
    meta: dict


def load_fully(path: str | os.PathLike) -> Checked:
    """Everything a restore checks before llama.cpp: header, lengths, CRC, state walk."""
    data = fmt.read_checkpoint(path)
    if data.header.n_tokens:
        check_state_for(data.header, data.state)
    return Checked(data.header, data.meta)


def delta_state_blob(p0: int, n_tokens: int, seed: int) -> bytes:
    """A delta's state: positions ``p0..n_tokens-1`` of scratch sequence 1 (f16, V transposed)."""
    rng = np.random.default_rng(seed)
    cells = np.zeros((n_tokens - p0, 3), dtype="<i4")
    cells[:, 0] = np.arange(p0, n_tokens)
    cells[:, 1] = 1
    cells[:, 2] = 1                                    # sequence 1
    n = n_tokens - p0
    row = 2 * N_HEAD_KV * HEAD_DIM
    parts = [struct.pack("<IiII", STATE_MAGIC, 1, 1, n), cells.tobytes(), struct.pack("<II", 1, N_LAYER)]
    for _ in range(N_LAYER):
        parts += [struct.pack("<iQ", F16, row), rng.bytes(row * n)]
    for _ in range(N_LAYER):
        parts += [struct.pack("<iII", F16, 2, N_HEAD_KV * HEAD_DIM), rng.bytes(row * n)]
    return b"".join(parts)


@dataclass(frozen=True)
class Written:
    """A synthetic node as a child needs to name it."""
    path: Path
    checkpoint_id: str
    payload_crc: int
    n_tokens: int


def write_node(path: Path, conv_id: uuid.UUID, n_tokens: int, *, parent: Written | None = None,
               kind: int = fmt.KIND_AUTOSAVE, line: str | None = None, title: str = "synthetic",
               created_ns: int | None = None, seq: int | None = None, cut_at: int | None = None) -> Written:
    """A full checkpoint, or a delta on ``parent`` (on its first ``cut_at`` tokens: a cut),
    laid out as the app writes them.

    The token ids depend only on the position, so any two nodes of a conversation share
    their prefixes, as a real history does.
    """
    h = header(conv_id, n_tokens, kind, title)
    if created_ns is not None:
        h = fmt.replace(h, created_unix_ns=created_ns)
    cid = uuid.uuid4().hex
    meta = {"conversation": str(conv_id), "title": title, "checkpoint_id": cid}
    if line is not None:
        meta["line"] = line
    if seq is not None:
        meta["seq"] = seq
    if parent is not None:
        start = parent.n_tokens if cut_at is None else cut_at
        h = fmt.replace(h, flags=fmt.FLAG_DELTA, parent_n_tokens=start)
        meta["parent"] = {"file": parent.path.name, "checkpoint_id": parent.checkpoint_id,
                          "payload_crc": parent.payload_crc, "n_tokens": parent.n_tokens}
        state = delta_state_blob(start, n_tokens, seed=n_tokens)
    else:
        state = state_blob(n_tokens, seed=n_tokens)
    tokens = np.arange(n_tokens, dtype=np.int32) % N_VOCAB
    with atomic_write(path) as f:
        _, crc = fmt.write_sections(f, h, fmt.encode_metadata(meta), tokens,
                                    np.zeros(N_VOCAB, np.float32), state)
    return Written(path, cid, crc, n_tokens)
