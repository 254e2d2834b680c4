"""Merging a delta chain into one full checkpoint (``compact``, and Export in the window).

Only llama.cpp can merge KV states, so compaction restores the chain into a Runtime
(the loaded one when it fits, else one made for the chain's own model and context) and
saves the cache as one full file.  The result restores exactly as the chain does, and
goes back to the same earlier turn ends (:func:`chain_points`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.checkpoints.format import LIMITS, CheckpointData
from engine.checkpoints.kvstate import check_state_for, recurrent_part_of
from engine.checkpoints.points import Point, points_of
from engine.conversation import Conversation
from engine.errors import CorruptState
from engine.model_shape import ModelShape
from engine.models import model_for_checkpoint
from engine.restore import used_end
from engine.runtime import Runtime, SaveInfo

log = logging.getLogger("checkpoint")


class Compacting(Protocol):
    """What compaction uses of a runtime: a Runtime, or a conversation of a
    ParallelRuntime (engine.parallel.ConversationView)."""

    @property
    def shape(self) -> ModelShape: ...

    def restore_chain(self, chain: Sequence[CheckpointData]) -> Conversation: ...

    def save(self, path: str | Path, conv: Conversation, kind: int = ..., *,
             line: str | None = ..., seq: int = ..., points: Sequence[Point] = ...) -> SaveInfo: ...


def compact_into(runtime: Compacting, chain: Sequence[CheckpointData], out: Path) -> SaveInfo:
    """Restore ``chain`` into ``runtime`` and save it as one full file at ``out``, holding
    the chain's turn ends as points where the memory can hold them."""
    conv = runtime.restore_chain(chain)
    points = chain_points(chain) if runtime.shape.holds_points else []
    # a line of its own: a compacted copy placed in a store never competes with the
    # history it was made from (engine.checkpoints.graph)
    return runtime.save(out, conv, chain[-1].header.kind, line=uuid.uuid4().hex, seq=1, points=points)


def chain_points(chain: Sequence[CheckpointData]) -> list[Point]:
    """The earlier turn ends of a chain (a restored one: its files checked), as the points
    of one file holding its whole state (engine.checkpoints.points): the points its files
    carry, and each earlier file's own end where it ended a turn (its conversation's every
    answer finished, nothing left to read), with the recurrent part of its state for a
    memory with one.  Without them an Edit, a fork or ``--from-turn`` of an earlier turn
    of a compacted or exported conversation would read it again from the start
    (engine.branches.turn_end).  The newest ``LIMITS.max_points`` are kept."""
    end = chain[-1].header.n_tokens
    final = _conversation_of(chain[-1])
    if final is None:
        return []

    def ours(messages: list, upto: int, i: int) -> bool:
        """Whether the first ``upto`` tokens of ``chain[i]``, after ``messages``, are the last
        file's too: no later file was cut from below them (another conversation's file a
        conversation on its document builds on, say), and its messages begin with those."""
        return upto <= used_end(chain, i) and final.messages[:len(messages)] == messages

    found: dict[int, Point] = {}
    for i, data in enumerate(chain):
        saved = final if i == len(chain) - 1 else _conversation_of(data)
        if saved is None:
            continue
        for point in points_of(data):   # (copied: a mapped file's bytes are not kept)
            if len(saved.messages) >= point.n_messages and ours(saved.messages[:point.n_messages], point.n_tokens, i):
                found[point.n_tokens] = replace(point, recurrent=None if point.recurrent is None
                                                else np.array(point.recurrent))
        h = data.header
        if saved.paused or not saved.messages or not 0 < h.n_tokens < end or h.n_tokens != h.n_tokens_total \
                or not ours(saved.messages, h.n_tokens, i):
            continue   # (the last file's own end is no earlier turn end: n_tokens == end)
        recurrent = None
        if h.has_recurrent:
            # a turn end copied into the new file: never bytes a restore's read left unchecked
            assert not data.holds_unchecked_bytes(), "compaction reads its chain whole"
            try:
                recurrent = recurrent_part_of(data.state, check_state_for(h, data.state)) if len(data.state) else None
            except CorruptState as exc:   # (a restored chain walked: not expected)
                log.warning("%s: its turn end's recurrent state could not be taken (%s)", data.path.name, exc)
            if recurrent is None:
                continue
        found[h.n_tokens] = Point(h.n_tokens, len(saved.messages), recurrent)
    return [found[n] for n in sorted(found) if n < end][-LIMITS.max_points:]


def _conversation_of(data: CheckpointData) -> Conversation | None:
    raw = data.meta.get("conversation")
    try:
        return Conversation.from_json(raw, []) if isinstance(raw, dict) else None
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def runtime_for(chain: Sequence[CheckpointData], *, model: str | Path | None = None,
                n_threads: int = 0) -> Runtime:
    """A Runtime whose model and context the chain's checkpoints fit."""
    from native.context import ContextSettings
    h = chain[-1].header
    settings = ContextSettings(n_ctx=h.n_ctx, n_threads=n_threads, flash_attn=h.flash_attn,
                               type_k=h.type_k, type_v=h.type_v, n_seq_max=h.n_seq_max,
                               kv_unified=h.kv_unified)
    return Runtime(model_for_checkpoint(chain[-1].meta, model), settings)
