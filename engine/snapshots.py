"""A sequence's state at the end of its prompt, kept in memory where the cache cannot go back.

A recurrent memory (or a hybrid's recurrent part) holds one snapshot per sequence, after its
last token: it cannot drop a tail (``llama_memory_seq_rm`` refuses), so Regenerate — back to
the end of the prompt, a new answer from there — would have to read the whole conversation
again.  A :class:`PromptSnapshot` is taken when a prompt has been read (the state and the
next-token logits, a few hundred KB for a small hybrid: the attention cells plus the
recurrent rows) and put back instead.  Attention-only memories trim their tail and never
need one.  A hybrid without a sliding window keeps only its recurrent part (llama.cpp's
``PARTIAL_ONLY`` state: a fixed size, however long the conversation): putting it back
replaces the recurrent state, after which the attention cells past the prompt can be
dropped like any attention tail.  llama.cpp's own rollback (``n_rs_seq``) keeps per-token snapshots for a few
tokens only (speculative decoding): an answer is longer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.checkpoints.chain import tokens_digest
from native.context import STATE_RECURRENT_ONLY
from native.errors import StateError


@dataclass(frozen=True)
class PromptSnapshot:
    n_tokens: int
    digest: str            # of the tokens it holds (engine.checkpoints.chain.tokens_digest)
    state: np.ndarray      # llama_state_seq_get_data(_ext) of the sequence
    logits: np.ndarray     # the next-token logits after them
    recurrent_only: bool = False   # the state is a hybrid's recurrent part (STATE_RECURRENT_ONLY)

    @classmethod
    def take(cls, ctx, seq: int, tokens: Sequence[int], logits: np.ndarray, *,
             recurrent_only: bool = False) -> PromptSnapshot | None:
        """The snapshot of ``seq`` now; None when it cannot be had (no memory for the copy,
        llama.cpp refusing): a prompt that was read stays read, Regenerate reads it again."""
        flags = STATE_RECURRENT_ONLY if recurrent_only else 0
        try:
            size = ctx.state_size(seq, flags)
            buf = np.empty(size, dtype=np.uint8)
            written = ctx.state_get_into(buf, size, seq, flags)
        except (StateError, MemoryError):
            return None
        return cls(len(tokens), tokens_digest(tokens), buf[:written], np.array(logits, copy=True),
                   recurrent_only)

    def holds(self, tokens: Sequence[int], n: int) -> bool:
        """Whether this is the state after ``tokens[:n]``."""
        return n == self.n_tokens and len(tokens) >= n and tokens_digest(tokens[:n]) == self.digest

    def put_back(self, ctx, seq: int) -> bool:
        """Make ``seq`` hold the snapshot again; False (``seq`` emptied) if llama.cpp refuses."""
        try:
            if self.recurrent_only:
                # the recurrent state back at the prompt's end; then the answer's attention
                # cells are a tail like any other (the recurrent part has none left past it)
                ctx.state_set_from(self.state, len(self.state), seq, STATE_RECURRENT_ONLY)
                if not ctx.seq_rm(seq, self.n_tokens, -1):
                    raise StateError("the attention cells past the prompt could not be dropped")
            else:
                ctx.seq_rm(seq, -1, -1)
                ctx.state_set_from(self.state, len(self.state), seq)
        except StateError:
            ctx.seq_rm(seq, -1, -1)
            return False
        return True
