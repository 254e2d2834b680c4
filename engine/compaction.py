"""Merging a delta chain into one full checkpoint (``compact``, and Export in the window).

Only llama.cpp can merge KV states, so compaction restores the chain into a Runtime
(the loaded one when it fits, else one made for the chain's own model and context) and
saves the cache as one full file.  The result restores exactly as the chain does.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from engine.checkpoints.format import CheckpointData
from engine.conversation import Conversation
from engine.models import default_model_path
from engine.runtime import Runtime, SaveInfo


class Compacting(Protocol):
    """What compaction uses of a runtime: a Runtime, or a conversation of a
    ParallelRuntime (engine.parallel.ConversationView)."""

    def restore_chain(self, chain: Sequence[CheckpointData]) -> Conversation: ...

    def save(self, path: str | Path, conv: Conversation, kind: int = ..., *,
             line: str | None = ..., seq: int = ...) -> SaveInfo: ...


def compact_into(runtime: Compacting, chain: Sequence[CheckpointData], out: Path) -> SaveInfo:
    """Restore ``chain`` into ``runtime`` and save it as one full file at ``out``."""
    conv = runtime.restore_chain(chain)
    # a line of its own: a compacted copy placed in a store never competes with the
    # history it was made from (engine.checkpoints.graph)
    return runtime.save(out, conv, chain[-1].header.kind, line=uuid.uuid4().hex, seq=1)


def model_path_for(meta: dict, override: str | Path | None = None) -> Path:
    """The model a checkpoint names (when that file still exists), else the default."""
    if override:
        return Path(override)
    stored = (meta.get("model") or {}).get("path") if isinstance(meta.get("model"), dict) else None
    if isinstance(stored, str) and stored and Path(stored).is_file():
        return Path(stored)
    return default_model_path()


def runtime_for(chain: Sequence[CheckpointData], *, model: str | Path | None = None,
                n_threads: int = 0) -> Runtime:
    """A Runtime whose model and context the chain's checkpoints fit."""
    from native.context import ContextSettings
    h = chain[-1].header
    settings = ContextSettings(n_ctx=h.n_ctx, n_threads=n_threads, flash_attn=h.flash_attn,
                               type_k=h.type_k, type_v=h.type_v, n_seq_max=h.n_seq_max,
                               kv_unified=h.kv_unified)
    return Runtime(model_path_for(chain[-1].meta, model), settings)
