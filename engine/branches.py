"""A conversation's branches: its lines of history, and the alternatives at each message.

Every line of a conversation (engine.checkpoints.graph) ends in a head whose metadata
holds the line's transcript.  Editing a message, regenerating an answer or forking
starts a new line on the files of the old one, so the old line keeps its head and
nothing is lost.  This module reads those heads (header and metadata, cached by file
version) and answers what the window shows next to each message: "this is
alternative k of n here", and which head to open to show alternative j.

Two transcripts *share* message i when their messages before i are equal (role and
content); the *alternatives* at i are the distinct messages at i among the branches
sharing it.  Showing alternative j opens the newest branch that has it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engine.checkpoints.format import KIND_AUTOSAVE, KIND_EXIT, KIND_PAUSE, read_metadata
from engine.checkpoints.graph import Graph
from engine.checkpoints.points import Point, point_at, point_counts
from engine.checkpoints.store import Store
from engine.conversation import transcript_of
from engine.errors import CheckpointError

Message = tuple[str, str]          # (role, content)


@dataclass(frozen=True)
class Branch:
    """One line of a conversation: its head and the transcript it holds."""
    head: Path
    line: str
    messages: tuple[Message, ...]   # the transcript, an unfinished answer included
    n_tokens: int
    created_ns: int
    paused: bool


@dataclass(frozen=True)
class Alternatives:
    """At one message: which alternative is shown (1-based) of how many, and the head
    that shows each one (in the same order; None for the one shown when no file holds it
    yet, e.g. while it is being written)."""
    index: int
    count: int
    heads: tuple[Path | None, ...]


def _messages(meta: dict) -> tuple[Message, ...]:
    return tuple((item["role"], item["content"]) for item in transcript_of(meta))


_TRANSCRIPTS: dict[tuple[str, tuple[int, int, int]], tuple[Message, ...]] = {}


def branches_of(store: Store, conversation_id: uuid.UUID, graph: Graph | None = None) -> list[Branch]:
    """Every branch (line head) of a conversation, newest first."""
    graph = graph or Graph.scan(store)
    out = []
    for head in graph.heads_of(conversation_id):
        key = (str(head.path), head.identity)
        messages = _TRANSCRIPTS.get(key)
        if messages is None:
            try:
                messages = _messages(read_metadata(head.path)[1])
            except (CheckpointError, OSError):
                continue
            if len(_TRANSCRIPTS) > 4096:
                _TRANSCRIPTS.clear()
            _TRANSCRIPTS[key] = messages
        out.append(Branch(head.path, head.line, messages, head.header.n_tokens, head.created_ns,
                          head.header.kind in (KIND_PAUSE, KIND_EXIT, KIND_AUTOSAVE)))
    return out


def alternatives(current: Sequence[Message], branches: Sequence[Branch]) -> list[Alternatives | None]:
    """For each message of ``current``: its alternatives among ``branches`` (None where
    there is only the one shown).  Each alternative opens the newest branch that has it,
    but for a branch whose whole transcript another branch goes on from (an Edit that
    changed nothing and got the same answer back): that one opens instead, else the turns
    after it could be reached from no message.  A paused branch opens as itself."""
    current = tuple(current)
    within = {b.head for b in branches if not b.paused   # (a paused one holds work of its own)
              and any(len(c.messages) > len(b.messages) and c.messages[:len(b.messages)] == b.messages
                      for c in branches)}

    def preference(b: Branch) -> tuple[bool, int]:
        return b.head not in within, b.created_ns

    out: list[Alternatives | None] = []
    for i, message in enumerate(current):
        options: dict[Message, Branch | None] = {message: None}   # the shown one first... ordered below
        for b in sorted(branches, key=lambda b: b.created_ns):   # oldest first: stable numbering
            if len(b.messages) > i and b.messages[:i] == current[:i]:
                best = options.get(b.messages[i])
                if best is None or preference(b) > preference(best):
                    options[b.messages[i]] = b
        ordered = sorted(options, key=lambda m: _first_seen(m, i, current, branches))
        if len(ordered) < 2:
            out.append(None)
            continue
        heads = tuple(o.head if (o := options[m]) is not None else None for m in ordered)
        out.append(Alternatives(ordered.index(message) + 1, len(ordered), heads))
    return out


def _first_seen(message: Message, i: int, current: tuple, branches: Sequence[Branch]) -> int:
    """When an alternative first appeared: the oldest branch holding it (the shown one
    counts as now when no saved branch holds it yet)."""
    times = [b.created_ns for b in branches if len(b.messages) > i and b.messages[:i] == current[:i]
             and b.messages[i] == message]
    return min(times) if times else 1 << 62


def turn_end(chain: Sequence, messages: Sequence[Message]) -> tuple[int, int, Point | None]:
    """``(k, n, point)``: the first ``k`` files of ``chain`` (CheckpointData, base first),
    trimmed to their first ``n`` tokens, are the state that holds exactly ``messages``, every
    answer finished; ``(0, 0, None)``: none is (compacted away).  ``n`` is the k-th file's
    own token count, or fewer where that file absorbed the turn's end as a ``point``
    (metadata ``points``, engine.checkpoints.points: the restore trims to it, putting its
    recurrent state back first for a memory with a recurrent part; None: no point).

    Editing turn K restores that state (the end of turn K-1) and goes on from there as
    a continuation of it would, so the result is the same text as continuing a
    checkpoint of that history, for sliding-window models too.
    """
    from engine.conversation import Conversation
    wanted = [tuple(m) for m in messages]
    for k in range(len(chain), 0, -1):
        data = chain[k - 1]
        conv = data.meta.get("conversation")
        saved = Conversation.from_json(conv if isinstance(conv, dict) else {}, [])
        if saved.messages == wanted and not saved.paused:
            return k, data.header.n_tokens, None
        for n_tokens, n_messages in point_counts(data.header, data.meta):
            if n_messages == len(wanted) and saved.messages[:n_messages] == wanted \
                    and (point := point_at(data, n_tokens)) is not None:   # (its state read only now)
                return k, point.n_tokens, point
    return 0, 0, None


def user_turn_index(messages: Sequence[Message], turn: int) -> int:
    """The index in ``messages`` of user turn ``turn`` (1-based); ValueError if none."""
    seen = 0
    for i, (role, _content) in enumerate(messages):
        if role == "user":
            seen += 1
            if seen == turn:
                return i
    raise ValueError(f"the conversation has {seen} turn(s) of yours; there is no turn {turn}")
