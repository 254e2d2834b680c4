"""Shared prefixes: a long system prompt is stored once, however many conversations use it.

Agents and document chats send the same long system prompt with every conversation.
Its KV cells are the same in each of them, so the store keeps them once: the first full
checkpoint of a conversation whose system prompt is at least :data:`MIN_TOKENS` tokens
long is written as two files — a **shared prefix** holding exactly the system prompt's
cells, and a delta on it holding the rest.  The next conversation with that system
prompt (another window conversation, a ``run``, a server request, a fork) finds the
prefix and writes only its delta.

A document sent again with another question (the same first message) is shared the same
way where a memory cannot build on another conversation's file inside it (a recurrent
part, a sliding window): the second such conversation's prefill is cut where its prompt
parts from the stored one (Answer.shared_end, engine.prefix_reuse.shareable_end), and its
first save stores that prefix; a plain attention memory builds on the first tokens of the
other's file instead (a cut delta, engine.history.LineWriter._cut).

Content-addressed.  A prefix file's line of history (engine.checkpoints.graph) is
``shared-`` followed by a digest of the model and context key and the prefix's tokens,
so equal prefixes find each other by name, without comparing files.  Then the bytes
decide: the prefix is only used when its KV state is byte for byte what this cache holds
at those positions (a conversation that decoded the system prompt in other batch
boundaries might differ in the last bits; it then writes a prefix of its own).  So a
conversation restored from its chain holds exactly the cells it had.

Where.  A plain attention memory (no sliding window, no recurrent part) can save and
restore a range of positions on its own (ModelShape.cells_by_position).  A recurrent
state exists only where it was taken: a recurrent or hybrid model's prefill is cut at
the system prompt's end (a mark: engine.generation.turn_marks), the snapshot kept there
is the prefix's recurrent part, and a hybrid's conversation is then a delta holding its
own attention cells and its whole recurrent state (small, a fixed size).  A new
conversation that starts from the prefix (``run --reuse-prefix``, a server request)
reads only its own tokens.  A sliding window (Gemma 3) shares its prefix where the
cache was decoded live up to the system prompt's end (a restored cache holds only the
window before each file's end: engine.snapshots.WindowCover); its cells before a
position are the same whatever follows.  The graph keeps a prefix as long as some
head's chain holds it, never shows it as a conversation, and deletes it with the last
conversation that used it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import uuid
from collections.abc import Sequence

import numpy as np

from engine import chat_template
from engine.checkpoints.chain import common_prefix, tokens_digest
from engine.checkpoints.format import KIND_MANUAL, read_checkpoint
from engine.checkpoints.graph import SHARED_LINE, Graph
from engine.checkpoints.store import Store
from engine.conversation import Conversation, title_from
from engine.errors import CheckpointError
from engine.runtime import SaveInfo, can_save_prefix

log = logging.getLogger("engine")

#: a system prompt shorter than this is stored with each conversation (a file of its own
#: costs a header, metadata and a restore step)
MIN_TOKENS = 256


def shared_line(target_key: str, tokens: Sequence[int]) -> str:
    """The line (content address) of the prefix ``tokens`` for a model and context."""
    h = hashlib.blake2b(target_key.encode("utf-8"), digest_size=16)
    h.update(np.asarray(tokens, dtype="<i4").tobytes())
    return SHARED_LINE + h.hexdigest()


def system_prompt_text(model, conv: Conversation) -> str:
    """The chat template's text for ``conv``'s system prompt, the part every conversation
    with it begins with ("" when it has none, or the template renders nothing to go by).

    The system message rendered alone, where a conversation's rendering begins with that
    text; else (Qwen3.5's template refuses messages without a user query, or renders the
    system prompt alone otherwise than before a user message) where the first user
    message starts, found as the text two renderings with different user messages share:
    the system prompt and the user's header, also the same in every such conversation."""
    if not conv.system_prompt:
        return ""
    system = [("system", conv.system_prompt)]
    x, y = (chat_template.render_quietly(model, system + [("user", word)], add_assistant=False, now=conv.created)
            for word in ("x", "y"))
    if not (x and y):
        return ""
    alone = chat_template.render_quietly(model, system, add_assistant=False, now=conv.created)
    return alone if alone and x.startswith(alone) else os.path.commonprefix([x, y])


def system_prompt_end(runtime, conv: Conversation) -> int:
    """How many of the cache's first tokens are the conversation's system prompt
    (:func:`system_prompt_text`; 0: none, or a template that renders nothing to go by)."""
    text = system_prompt_text(runtime.model, conv)
    if not text:
        return 0
    return common_prefix(runtime.model.tokenize_prompt(text), runtime.kv_tokens)


def shared_base(runtime, store: Store, conv: Conversation) -> SaveInfo | None:
    """The shared prefix a full checkpoint of ``conv`` should be a delta on: found in
    ``store`` (the same cells, byte for byte) or written now.  None when the conversation
    has no system prompt worth sharing or the memory cannot store a range of positions."""
    shape = runtime.shape
    if not (runtime.settings.supports_deltas
            and (shape.cells_by_position or shape.prefix_from_window or shape.prefix_from_snapshot)):
        return None
    # the system prompt's end, else where a document the prompt shares with another ends
    # (Answer.shared_end: also where the system prompt's snapshot is gone)
    ends = (system_prompt_end(runtime, conv), conv.answer.shared_end if conv.answer is not None else 0)
    n = next((n for n in ends if MIN_TOKENS <= n < len(runtime.kv_tokens) and can_save_prefix(runtime, n)), 0)
    if not n:
        return None
    tokens = list(runtime.kv_tokens[:n])
    line = shared_line(runtime.target.key, tokens)
    found = _stored(runtime, store, line, tokens)
    if found is not None:
        return found
    prefix = Conversation(id=uuid.uuid5(uuid.NAMESPACE_URL, line),
                          title=f"Shared: {title_from(conv.system_prompt or conv.title)}",
                          system_prompt=conv.system_prompt, tokens=tokens)
    info = runtime.save(store.new_path(prefix.title), prefix, KIND_MANUAL, line=line, fresh=True, upto=n)
    log.info("stored the shared prefix %s (%d tokens)", info.path.name, n)
    return info


def _stored(runtime, store: Store, line: str, tokens: list[int]) -> SaveInfo | None:
    """A file of ``line`` holding exactly this cache's cells of ``tokens``, or None."""
    digest = tokens_digest(tokens)
    candidates = [n for n in Graph.scan(store).lines.get(line, ())
                  if not n.is_delta and n.header.n_tokens == len(tokens) and n.tokens_digest == digest]
    if not candidates:
        return None
    mine = np.array(runtime.prefix_state(len(tokens)), copy=True)
    for node in candidates:
        try:
            data = read_checkpoint(node.path)
        except (CheckpointError, OSError) as exc:
            log.info("shared prefix %s skipped: %s", node.name, exc)
            continue
        if np.array_equal(data.state, mine):
            return SaveInfo.of_file(data)
    return None
