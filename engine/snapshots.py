"""A sequence's state at the end of its prompt, kept in memory where the cache cannot go back.

A recurrent memory (or a hybrid's recurrent part) holds one snapshot per sequence, after its
last token: it cannot drop a tail (``llama_memory_seq_rm`` refuses), so Regenerate — back to
the end of the prompt, a new answer from there — would have to read the whole conversation
again.  A :class:`PromptSnapshot` is taken when a prompt has been read (the state and the
next-token logits, a few hundred KB for a small hybrid: the attention cells plus the
recurrent rows) and put back instead.  Attention-only memories trim their tail and never
need one.  llama.cpp's own rollback (``n_rs_seq``) keeps per-token snapshots for a few
tokens only (speculative decoding): an answer is longer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from engine.checkpoints.chain import tokens_digest
from native.errors import StateError


@dataclass(frozen=True)
class PromptSnapshot:
    n_tokens: int
    digest: str            # of the tokens it holds (engine.checkpoints.chain.tokens_digest)
    state: np.ndarray      # llama_state_seq_get_data of the sequence
    logits: np.ndarray     # the next-token logits after them

    @classmethod
    def take(cls, ctx, seq: int, tokens: Sequence[int], logits: np.ndarray) -> "PromptSnapshot | None":
        """The snapshot of ``seq`` now; None when it cannot be had (no memory for the copy,
        llama.cpp refusing): a prompt that was read stays read, Regenerate reads it again."""
        try:
            size = ctx.state_size(seq)
            buf = np.empty(size, dtype=np.uint8)
            written = ctx.state_get_into(buf, size, seq)
        except (StateError, MemoryError):
            return None
        return cls(len(tokens), tokens_digest(tokens), buf[:written], np.array(logits, copy=True))

    def holds(self, tokens: Sequence[int], n: int) -> bool:
        """Whether this is the state after ``tokens[:n]``."""
        return n == self.n_tokens and len(tokens) >= n and tokens_digest(tokens[:n]) == self.digest

    def put_back(self, ctx, seq: int) -> bool:
        """Make ``seq`` hold the snapshot again; False (``seq`` emptied) if llama.cpp refuses."""
        ctx.seq_rm(seq, -1, -1)
        try:
            ctx.state_set_from(self.state, len(self.state), seq)
        except StateError:
            ctx.seq_rm(seq, -1, -1)
            return False
        return True
