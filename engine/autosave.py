"""Autosave: a chain of delta checkpoints, so saving costs O(new tokens), not O(context).

Every ``N`` generated tokens the engine calls the :class:`Autosaver`.  The first call
for a conversation writes a full checkpoint; later calls write deltas holding only the
KV cells decoded since the previous file.  After ``max_chain`` deltas (or when the
cache no longer extends the chain, e.g. after Regenerate trimmed it) a full checkpoint
starts a new chain and the old chain's files are deleted — only once the new base is
durable, so a crash at any moment leaves a restorable chain.  ``mode="full"`` writes a
full checkpoint every time (the behaviour to compare against).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from engine.checkpoint_format import EXTENSION, KIND_AUTOSAVE
from engine.conversation import Conversation
from engine.errors import CheckpointError
from engine.runtime import Runtime, SaveInfo, tokens_digest

log = logging.getLogger("engine")


class Autosaver:
    def __init__(self, runtime: Runtime, folder: str | Path, *, mode: str = "delta",
                 max_chain: int = 32) -> None:
        if mode not in ("delta", "full"):
            raise ValueError(f"unknown autosave mode {mode!r}")
        self.runtime = runtime
        self.folder = Path(folder)
        self.mode = mode
        self.max_chain = max_chain
        self.chain: list[SaveInfo] = []
        self._conversation = None
        self.saves = 0
        self.bytes_written = 0

    @property
    def latest(self) -> Path | None:
        return self.chain[-1].path if self.chain else None

    def _path(self, conv: Conversation) -> Path:
        # unique in time, not per process: a resumed run must never overwrite the chain it
        # was loaded from (names sort chronologically, newest last)
        while True:
            path = self.folder / f"autosave-{conv.id.hex[:12]}-{time.time_ns():020d}{EXTENSION}"
            if not path.exists():
                return path

    def _extends_chain(self, conv: Conversation) -> bool:
        if self.mode != "delta" or not self.chain or self._conversation != conv.id:
            return False
        if not self.runtime.settings.supports_deltas:
            return False
        if len(self.chain) > self.max_chain:
            return False
        last = self.chain[-1]
        kv = self.runtime.kv_tokens
        return last.n_tokens < len(kv) and tokens_digest(kv[:last.n_tokens]) == last.tokens_digest

    def __call__(self, conv: Conversation) -> SaveInfo | None:
        delta = self._extends_chain(conv)
        if not delta and self.chain and self._conversation == conv.id \
                and self.chain[-1].n_tokens == len(self.runtime.kv_tokens) \
                and self.chain[-1].tokens_digest == tokens_digest(self.runtime.kv_tokens):
            return self.chain[-1]  # nothing new since the last autosave
        info = self.runtime.save(self._path(conv), conv, KIND_AUTOSAVE,
                                 parent=self.chain[-1] if delta else None)
        self.saves += 1
        self.bytes_written += info.size
        if delta:
            self.chain.append(info)
        else:
            old, self.chain = self.chain, [info]
            self._conversation = conv.id
            self._delete(old)  # the new base is durable: the old chain is no longer needed
        return info

    def discard(self) -> None:
        """Delete this autosaver's files (the conversation was saved another way)."""
        old, self.chain = self.chain, []
        self._delete(old)

    @staticmethod
    def _delete(infos: list[SaveInfo]) -> None:
        for info in reversed(infos):  # newest first: a partial cleanup never orphans a delta's base early
            try:
                info.path.unlink()
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("could not delete old autosave %s: %s", info.path, exc)
