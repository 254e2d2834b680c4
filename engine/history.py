"""Writing one line of a conversation's history into the store: autosaves and heads.

A :class:`LineWriter` belongs to the thread that owns the Runtime.  It knows the *live
chain*: the files on disk, base first, whose KV states are prefixes of what the cache
holds now.  Every save, autosave or head (pause, exit, a finished answer), goes on top
of it:

* a **delta** on the deepest file of the live chain that is still a prefix of the
  cache, so a save costs the tokens since that file, not the whole context; when the
  cache was trimmed (Regenerate), the delta goes on the file before the trimmed part,
  and when nothing new was decoded (a pause before the first token, a rename) the delta
  holds no cells at all;
* a **compaction** (one full file, a new chain) when the chain's deltas would outweigh
  its base in bytes or the chain would pass :class:`ChainPolicy`'s file count, when
  nothing on disk is a prefix, or when the delta's parent disappeared meanwhile.

Each file gets the next sequence number of its line, so the file just written is the
line's newest node and so its head (engine.checkpoints.graph) whatever the clock says;
what that supersedes (a chain replaced by a compaction, the tail cut by a trim, a
crash's leftovers of the same line) is retired only after the new file is durable, so a
crash at any moment leaves a restorable head.

One writer per line: a writer holds its line's lease (``Store.lease_line``) while it
lives.  Continuing a chain whose line another writer holds — the window and a CLI run
on one conversation, two windows — or continuing a file that is not its line's head,
or a copy, starts a new line (a branch) instead, so no writer ever retires another's
newer history.
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
    #: files in one chain (each is read, verified and applied on restore)
    max_files: int = 64
    #: bytes of a chain's deltas relative to its base: past this, one full file is
    #: smaller to store and faster to restore than base plus deltas (a small base is
    #: soon compacted, cheaply; a large one carries many deltas)
    max_delta_ratio: float = 1.0


def saved_info(data: CheckpointData) -> SaveInfo:
    """What a writer needs to know of a file it did not write (a restored chain's)."""
    h = data.header
    cid = data.meta.get("checkpoint_id")
    return SaveInfo(path=data.path, size=h.file_len, seconds=0.0, n_tokens=h.n_tokens,
                    checkpoint_id=cid if isinstance(cid, str) else "",
                    payload_crc=data.payload_crc,
                    tokens_digest=tokens_digest(data.tokens[:h.n_tokens]), delta=h.is_delta,
                    line=line_of(data.meta, h))


def line_to_continue(store: Store, chain: Sequence[CheckpointData]) -> str | None:
    """The line a restored chain's history may continue on: its own when its newest
    file is that line's head in ``store``; None when it must branch (an older file, a
    copy, a file outside the store)."""
    last = chain[-1]
    if last.path is None or not store.contains(last.path):
        return None
    line = line_of(last.meta, last.header)
    head = Graph.scan(store).head_of_line.get(line)
    if head is None or head.path.name != last.path.name or head.payload_crc != last.payload_crc:
        return None
    return line


class LineWriter:
    """Saves one line of a conversation from the Runtime that holds it."""

    def __init__(self, runtime: Runtime, store: Store, line: str,
                 chain: Sequence[SaveInfo] = (), *, seq: int = 1, lease=None,
                 policy: ChainPolicy = ChainPolicy(), mode: str = "delta") -> None:
        if mode not in ("delta", "full"):
            raise ValueError(f"unknown save mode {mode!r}")
        self.runtime = runtime
        self.store = store
        self.line = line
        self.next_seq = seq
        self.policy = policy
        self.mode = mode
        self.chain: list[SaveInfo] = list(chain)
        self._lease = lease
        self.saves = 0
        self.bytes_written = 0

    @classmethod
    def starting(cls, runtime: Runtime, store: Store, line: str, chain: Sequence[SaveInfo] = (),
                 **kwargs) -> "LineWriter":
        """A writer on ``line`` if its lease is free, else on a new line (a branch)."""
        lease = store.lease_line(line)
        if lease is None:
            line = uuid.uuid4().hex
            lease = store.lease_line(line)
        seq = Graph.scan(store).next_seq(line)
        return cls(runtime, store, line, chain, seq=seq, lease=lease, **kwargs)

    @classmethod
    def continuing(cls, runtime: Runtime, store: Store, chain: Sequence[CheckpointData],
                   **kwargs) -> "LineWriter":
        """A writer for a conversation restored from ``chain`` (files of ``store``, or not)."""
        line = line_to_continue(store, chain) or uuid.uuid4().hex
        # a branch still builds on the files it came from, when they are in this store
        infos = [saved_info(d) for d in chain] if chain and store.contains(chain[-1].path) else []
        return cls.starting(runtime, store, line, infos, **kwargs)

    def close(self) -> None:
        """Let go of the line (another writer may continue it)."""
        if self._lease is not None:
            self._lease.release()
            self._lease = None

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
            if not info.checkpoint_id or not 0 < info.n_tokens <= len(kv) \
                    or tokens_digest(kv[:info.n_tokens]) != info.tokens_digest:
                continue
            too_long = i + 2 > self.policy.max_files
            too_big = sum(c.size for c in self.chain[1:i + 1]) > self.policy.max_delta_ratio * base.size
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
        superseding = idx is None or idx != len(self.chain) - 1 or self.saves == 0
        try:
            self.store.ensure()
            info = self._save(conv, kind, self.chain[idx] if idx is not None else None)
        except SaveFailed:
            if idx is None:
                raise
            # the parent went away meanwhile (another process pruned or deleted it)
            log.info("delta parent %s is gone; writing a full checkpoint", self.chain[idx].path.name)
            idx, superseding = None, True
            info = self._save(conv, kind, None)
        except OSError as exc:   # the folder itself: full disk, permissions, a lock timeout
            raise SaveFailed(f"could not save into {self.store.folder}: {exc.strerror or exc}") from exc
        self.chain = (self.chain[:idx + 1] if idx is not None else []) + [info]
        self.next_seq += 1
        self.saves += 1
        self.bytes_written += info.size
        if superseding or kind != KIND_AUTOSAVE:
            self.retire()
        return info

    def _save(self, conv: Conversation, kind: int, parent: SaveInfo | None) -> SaveInfo:
        path = (self.store.new_autosave_path(conv.id) if kind == KIND_AUTOSAVE
                else self.store.new_path(conv.title))
        return self.runtime.save(path, conv, kind, parent, line=self.line, seq=self.next_seq,
                                 fresh=True)

    def retire(self) -> None:
        """Delete what this line's head supersedes (the head is durable)."""
        try:
            report = graph.retire(self.store, self.line)
        except OSError as exc:   # a lock timeout is an OSError too: the next save retires
            log.warning("could not retire superseded checkpoints: %s", exc)
            return
        if report.deleted:
            log.debug("retired %d superseded file(s) of line %s", len(report.deleted), self.line)
