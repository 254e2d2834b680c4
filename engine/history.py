"""Writing one line of a conversation's history into the store: autosaves and heads.

A :class:`LineWriter` belongs to the thread that owns the Runtime.  It knows the *live
chain*: the files on disk, base first, whose KV states are prefixes of what the cache
holds now.  Every save, autosave or head (pause, exit, a finished answer), goes on top
of it:

* a **delta** on the deepest file of the live chain that is still a prefix of the
  cache, so a save costs the tokens since that file, not the whole context; when the
  cache was trimmed (Regenerate), the delta goes on the file before the trimmed part;
* a **compaction** (one full file, a new chain) when the chain would grow past
  :class:`ChainPolicy`'s limits, when nothing on disk is a prefix, or when the delta's
  parent disappeared meanwhile.

The file just written is the line's newest node and so its head (see
engine.checkpoints.graph); whatever that supersedes (a chain replaced by a compaction,
the tail cut by a trim, a crash's leftovers of the same line) is retired only after the
new file is durable, so a crash at any moment leaves a restorable head.

Heads and autosaves differ only in their kind and their name (``autosave-…`` vs the
title); the next autosave goes on top of a head as readily as on an autosave.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Sequence

from engine.checkpoints import graph
from engine.checkpoints.chain import tokens_digest
from engine.checkpoints.format import KIND_AUTOSAVE, CheckpointData
from engine.checkpoints.graph import Graph, line_of
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import SaveFailed
from engine.runtime import Runtime, SaveInfo

log = logging.getLogger("engine")


@dataclass(frozen=True)
class ChainPolicy:
    """When a save starts a new chain instead of adding a delta."""
    #: files in one chain (each is read and applied on restore)
    max_files: int = 16
    #: tokens held by the deltas of a chain, relative to its base: past this, one full
    #: file is smaller to store and faster to restore than base plus deltas
    max_delta_ratio: float = 1.0
    #: a base this small is cheaper to rewrite than to extend
    min_base_tokens: int = 256


def saved_info(data: CheckpointData) -> SaveInfo:
    """What a writer needs to know of a file it did not write (a restored chain's)."""
    h = data.header
    cid = data.meta.get("checkpoint_id")
    return SaveInfo(path=data.path, size=h.file_len, seconds=0.0, n_tokens=h.n_tokens,
                    checkpoint_id=cid if isinstance(cid, str) else "",
                    payload_crc=data.payload_crc,
                    tokens_digest=tokens_digest(data.tokens[:h.n_tokens]), delta=h.is_delta,
                    line=line_of(data.meta, h))


def line_to_continue(store: Store, chain: Sequence[CheckpointData]) -> str:
    """The line a restored chain's history continues on.

    Its own line when its newest file is that line's head in ``store``; otherwise a new
    line (a branch), so that continuing from an older file or from a copy never retires
    the newer history of the line it came from.
    """
    last = chain[-1]
    line = line_of(last.meta, last.header)
    if last.path is None or not store.contains(last.path):
        return uuid.uuid4().hex
    head = Graph.scan(store).head_of_line.get(line)
    if head is None or head.path.name != last.path.name or head.payload_crc != last.payload_crc:
        return uuid.uuid4().hex
    return line


class LineWriter:
    """Saves one line of a conversation from the Runtime that holds it."""

    def __init__(self, runtime: Runtime, store: Store, line: str,
                 chain: Sequence[SaveInfo] = (), *, policy: ChainPolicy = ChainPolicy(),
                 mode: str = "delta") -> None:
        if mode not in ("delta", "full"):
            raise ValueError(f"unknown save mode {mode!r}")
        self.runtime = runtime
        self.store = store
        self.line = line
        self.policy = policy
        self.mode = mode
        self.chain: list[SaveInfo] = list(chain)
        self.saves = 0
        self.bytes_written = 0

    @classmethod
    def continuing(cls, runtime: Runtime, store: Store, chain: Sequence[CheckpointData],
                   **kwargs) -> "LineWriter":
        """A writer for a conversation restored from ``chain`` (files of ``store``)."""
        line = line_to_continue(store, chain)
        # a branch (a new line) still builds on the files it came from
        infos = [saved_info(d) for d in chain] if chain and store.contains(chain[-1].path) else []
        return cls(runtime, store, line, infos, **kwargs)

    @property
    def head(self) -> SaveInfo | None:
        return self.chain[-1] if self.chain else None

    # -- deciding -----------------------------------------------------------------------------
    def _holds_cache(self) -> bool:
        """The newest file holds exactly what the cache holds."""
        kv = self.runtime.kv_tokens
        tip = self.head
        return tip is not None and tip.n_tokens == len(kv) and tip.tokens_digest == tokens_digest(kv)

    def _parent_index(self) -> int | None:
        """Index in the live chain of the file the next delta goes on, or None (full)."""
        if self.mode != "delta" or not self.runtime.settings.supports_deltas or not self.chain:
            return None
        kv = self.runtime.kv_tokens
        base = self.chain[0]
        for i in range(len(self.chain) - 1, -1, -1):
            info = self.chain[i]
            if not info.checkpoint_id or not 0 < info.n_tokens < len(kv) \
                    or tokens_digest(kv[:info.n_tokens]) != info.tokens_digest:
                continue
            too_long = i + 2 > self.policy.max_files
            too_big = len(kv) - base.n_tokens > self.policy.max_delta_ratio * max(
                base.n_tokens, self.policy.min_base_tokens)
            return None if too_long or too_big else i
        return None

    # -- saving -------------------------------------------------------------------------------
    def autosave(self, conv: Conversation) -> SaveInfo:
        """Save what the cache holds as an autosave (nothing when the newest file has it)."""
        if self._holds_cache():
            return self.head
        return self._write(conv, KIND_AUTOSAVE)

    __call__ = autosave   # generate(autosave=writer) calls it with the conversation

    def save_head(self, conv: Conversation, kind: int) -> SaveInfo:
        """Write the line's new head (pause, exit, a finished answer, a rename)."""
        return self._write(conv, kind)

    def _write(self, conv: Conversation, kind: int) -> SaveInfo:
        idx = self._parent_index()
        parent = self.chain[idx] if idx is not None else None
        superseding = parent is None or idx != len(self.chain) - 1 or self.saves == 0
        path = (self.store.new_autosave_path(conv.id) if kind == KIND_AUTOSAVE
                else self.store.new_path(conv.title))
        self.store.ensure()
        try:
            info = self.runtime.save(path, conv, kind, parent, line=self.line)
        except SaveFailed:
            if parent is None:
                raise
            # the parent went away meanwhile (another process pruned or deleted it)
            log.info("delta parent %s is gone; writing a full checkpoint", parent.path.name)
            parent, idx, superseding = None, None, True
            info = self.runtime.save(path, conv, kind, None, line=self.line)
        self.chain = (self.chain[:idx + 1] if idx is not None else []) + [info]
        self.saves += 1
        self.bytes_written += info.size
        if superseding or kind != KIND_AUTOSAVE:
            self.retire()
        return info

    def retire(self) -> None:
        """Delete what this line's head supersedes (the head is durable)."""
        try:
            report = graph.retire(self.store, self.line)
        except OSError as exc:
            log.warning("could not retire superseded checkpoints: %s", exc)
            return
        if report.deleted:
            log.debug("retired %d superseded file(s) of line %s", len(report.deleted), self.line)

    def forget(self) -> None:
        """Stop extending the chain (its files stay: they are the line's history)."""
        self.chain = []
