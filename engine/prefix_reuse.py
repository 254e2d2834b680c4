"""Start a prompt from the stored checkpoint that shares its longest beginning.

The index (engine.checkpoints.prefix_index) names the candidates; this module restores
the best one into a Runtime and trims what differs, so only the rest of the prompt is
decoded (``run --reuse-prefix``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoints.chain import common_prefix, load_chain, release
from engine.checkpoints.graph import default_line
from engine.checkpoints.points import nearest_point
from engine.checkpoints.prefix_index import PrefixIndex
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import CheckpointError
from engine.history import LineWriter, saved_infos
from engine.runtime import Runtime
from engine.shared_prefix import MIN_TOKENS

if TYPE_CHECKING:
    from engine.parallel import ConversationView

log = logging.getLogger("engine")
@dataclass(frozen=True)
class PrefixReuse:
    how: str                   # "restored", "restored-exact", "cache" or "recompute"
    n_tokens: int              # prompt tokens now in the cache, not to be decoded again
    source: Path | None = None
    chain: tuple = ()          # source's verified chain (CheckpointData), full file first
    #: where the prompt's longest prefix shared with a stored checkpoint ends, where the
    #: memory could not build on that file there (:func:`shareable_end`); 0: none
    shareable: int = 0

    def describe(self) -> str:
        return {"restored": f"reused {self.n_tokens} tokens from {self.source} (tail trimmed)",
                "restored-exact": f"reused {self.n_tokens} tokens from {self.source}",
                "cache": f"reused {self.n_tokens} tokens already in the cache",
                "recompute": "no stored checkpoint shares this prompt's beginning: full prefill",
                }[self.how]


def reuse_stored_prefix(runtime: Runtime | ConversationView, folder: str | Path, tokens: Sequence[int]) -> PrefixReuse:
    """Restore the stored checkpoint that shares the longest prefix with ``tokens``.

    The divergent tail is trimmed from the cache.  A memory that cannot drop a tail
    (``llama_memory_seq_rm`` fails: some sliding-window or recurrent models) only takes
    checkpoints that are entirely a prefix of the prompt; if none exists, the prompt is
    decoded in full; a recurrent or hybrid memory (which goes back only to its snapshots)
    looks at those alone, and at the points of a conversation's head that carry their
    recurrent states (its earlier turn ends: a request that sends another conversation's
    first turns again): a shared prefix (engine.shared_prefix) is one; a sliding window
    tries them first.  Compares against what the cache already holds first.
    """
    in_cache = common_prefix(runtime.kv_tokens, tokens)
    can_trim = not runtime.shape.has_recurrent
    index = PrefixIndex(folder)
    entries = index.refresh()   # (one look at the folder for every question below)
    for match in _candidates(runtime, index, entries, tokens):
        if match.n_common <= in_cache:
            continue
        if not (match.exact or match.at_point) and not can_trim:
            continue
        chain: list = []
        try:
            try:
                chain = load_chain(match.path, crc_later=True)   # settled by the restore
                runtime.restore_chain(chain)
            except (CheckpointError, OSError) as exc:   # (OSError: gone since the index found it, unreadable)
                log.info("prefix candidate %s skipped: %s", match.path.name, exc)
                # a state refused after llama.cpp took it (its checksum, or llama.cpp itself)
                # left the sequence empty
                in_cache = common_prefix(runtime.kv_tokens, tokens)
                continue
            # a point (another conversation's earlier turn end, with its recurrent state): the
            # memory goes back there (engine.checkpoints.points); nothing keeps its view of the
            # file past that
            kept = runtime.trim(match.n_common, nearest_point(chain, match.n_common) if match.at_point else None)
        finally:
            release(chain)   # the files stay replaceable (Windows maps a restore's files)
        if kept == match.n_common:
            return PrefixReuse("restored-exact" if match.exact else "restored", kept, match.path,
                               tuple(chain))
        can_trim = False  # the memory cannot drop a tail: only exact prefixes will do
        in_cache = common_prefix(runtime.kv_tokens, tokens)
    return PrefixReuse("cache" if in_cache else "recompute", in_cache,
                       shareable=shareable_end(runtime, index, entries, tokens, in_cache))


def shareable_end(runtime: Runtime | ConversationView, index: PrefixIndex, entries: dict,
                  tokens: Sequence[int], have: int) -> int:
    """Where the longest prefix ``tokens`` shares with a stored checkpoint ends, for a memory
    that cannot build on that checkpoint there (a recurrent part: its state exists only at
    the file's end and its points; a sliding window: a file holds only the window before
    its end), when at least MIN_TOKENS long and beyond the ``have`` tokens the cache holds;
    else 0.  A document sent again with another question (the same first message) is such a
    prefix: the prompt's prefill is cut there and its first save stores the prefix once
    (Answer.shared_end, engine.shared_prefix), so the conversations after it read only their
    own tokens.  A plain attention memory builds on the first tokens of another's file
    instead (a cut: engine.history.LineWriter._cut)."""
    shape = runtime.shape
    if shape.cells_by_position or not (shape.prefix_from_snapshot or shape.prefix_from_window):
        return 0
    best = index.matches(tokens, runtime.target.key, limit=1, entries=entries)
    n = best[0].n_common if best else 0
    below = max(have, MIN_TOKENS - 1)   # (an end must lie above it)
    if not below < n < len(tokens):
        return 0
    # back to where a line ends: two questions on a document share their first words, and a
    # third that parts sooner would share less than the prefix holds (so none of it)
    line = line_end_before(runtime.model, tokens, n)
    return line if line > below else n


#: how far back :func:`line_end_before` looks for a line's end
LINE_LOOKBACK = 256


def line_end_before(model, tokens: Sequence[int], n: int) -> int:
    """The largest ``k <= n`` whose ``tokens[k - 1]`` ends a line of text (within
    :data:`LINE_LOOKBACK` tokens), or 0."""
    for k in range(n, max(0, n - LINE_LOOKBACK), -1):
        if model.token_to_piece(tokens[k - 1]).endswith(b"\n"):
            return k
    return 0


def share_stored_prefix(conv: Conversation, reuse: PrefixReuse) -> None:
    """Cut ``conv``'s prefill where its prompt's shared prefix ends (reuse.shareable), so
    its first save stores that prefix once (Answer.shared_end)."""
    answer = conv.answer
    if reuse.shareable and answer is not None and not answer.n_generated \
            and reuse.shareable < answer.n_prompt_tokens:
        answer.shared_end = reuse.shareable


def _candidates(runtime: Runtime | ConversationView, index: PrefixIndex, entries: dict,
                tokens: Sequence[int]) -> list:
    """The stored checkpoints to try, best first (engine.checkpoints.prefix_index.Match)."""
    key = runtime.target.key
    if runtime.shape.has_recurrent:
        return index.matches(tokens, key, whole=True, entries=entries)
    if runtime.shape.prefix_from_window:
        # whole files first: a sliding window's bits depend on where a prefill was cut, and
        # a shared prefix ends at a cut that a prefill from nothing makes too (Answer.marks)
        whole = index.matches(tokens, key, whole=True, entries=entries)
        seen = {m.path for m in whole}
        return whole + [m for m in index.matches(tokens, key, entries=entries) if m.path not in seen]
    return index.matches(tokens, key, entries=entries)


def start_from_stored_prefix(runtime: Runtime | ConversationView, store: Store, conv: Conversation) -> LineWriter:
    """A new conversation's start: the cache holds as much of ``conv``'s prompt as the
    store's checkpoints give (:func:`reuse_stored_prefix`: a long system prompt's shared
    prefix, another conversation's turns), and its line writer builds its first save on
    the restored files where they are the store's own (a delta on the shared prefix).
    Used by the window's new conversations and the server's requests alike."""
    chain: tuple = ()          # the source's verified chain (CheckpointData), full file first
    try:
        reuse = reuse_stored_prefix(runtime, store.folder, conv.tokens)
        share_stored_prefix(conv, reuse)
        chain = reuse.chain if reuse.chain and store.contains(reuse.chain[-1].path) else ()
        log.info("%s: %s", conv.title, reuse.describe())
    except (CheckpointError, OSError) as exc:
        log.info("no stored prefix used (%s)", exc)
    return LineWriter.starting(runtime, store, default_line(conv.id), saved_infos(chain))
