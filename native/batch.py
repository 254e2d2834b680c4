"""A decode batch whose tokens belong to several sequences of one context.

:class:`native.context.Context` decodes sequence 0 with its own batch.  A
:class:`SeqBatch` is filled with tokens of any sequences (one generated token per
running answer, or prompt chunks of several conversations) and decoded in one
``llama_decode``; the logits of the positions that asked for them are then rows of one
array, in the order they were added.  Like the context it decodes into, it belongs to
one thread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import numpy as np

from native.context import DECODE_OK, Context
from native.errors import DecodeError
from native.library import bindings


class SeqBatch:
    """An owned ``llama_batch`` of up to ``capacity`` tokens, one sequence id each."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise DecodeError(f"a batch holds at least one token, not {capacity}")
        ll = self._ll = bindings()
        self.capacity = capacity
        # struct llama_batch llama_batch_init(int32_t n_tokens, int32_t embd, int32_t n_seq_max)
        b = self._batch = ll.llama_batch_init(capacity, 0, 1)
        self._owned = True
        self._token = np.ctypeslib.as_array(b.token, shape=(capacity,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(capacity,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(capacity,))
        self._logits = np.ctypeslib.as_array(b.logits, shape=(capacity,))
        self._seq = [b.seq_id[i] for i in range(capacity)]
        self._nseq[:] = 1
        self.n_tokens = 0
        self.n_outputs = 0
        self._decoded_outputs = 0   # outputs of the last decode (the batch may be refilled since)
        self._rows_address = 0
        self._rows: np.ndarray | None = None

    # -- filling --------------------------------------------------------------------------
    def clear(self) -> None:
        self.n_tokens = 0
        self.n_outputs = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token; returns its output row when ``logits`` (else -1)."""
        i = self.n_tokens
        if i >= self.capacity:
            raise DecodeError(f"the batch holds {self.capacity} tokens")
        self._token[i] = token
        self._pos[i] = pos
        self._seq[i][0] = seq
        self._logits[i] = 1 if logits else 0
        self.n_tokens = i + 1
        if logits:
            self.n_outputs += 1
            return self.n_outputs - 1
        return -1

    def add_run(self, tokens: Sequence[int], pos0: int, seq: int, logits_last: bool) -> int:
        """Append ``tokens`` at positions ``pos0...`` of ``seq``; returns the last one's
        output row when ``logits_last`` (else -1)."""
        n = len(tokens)
        i = self.n_tokens
        if n == 0 or i + n > self.capacity:
            raise DecodeError(f"cannot add {n} tokens to a batch with room for {self.capacity - i}")
        self._token[i:i + n] = tokens
        self._pos[i:i + n] = np.arange(pos0, pos0 + n, dtype=np.int32)
        self._logits[i:i + n] = 0
        for k in range(i, i + n):
            self._seq[k][0] = seq
        self.n_tokens = i + n
        if logits_last:
            self._logits[i + n - 1] = 1
            self.n_outputs += 1
            return self.n_outputs - 1
        return -1

    # -- decoding -------------------------------------------------------------------------
    def decode(self, ctx: Context, *, should_abort: Callable[[], bool] | None = None) -> int:
        """Decode every token added (the batch is then ready to be cleared and refilled).

        ``should_abort``: the decode may stop early when it turns true (or when
        ``ctx.request_abort`` is called): DECODE_ABORTED is returned, and each sequence
        keeps the tokens its processed micro-batches held (``ctx.pos_max(seq)``).
        """
        if self.n_tokens == 0:
            raise DecodeError("the batch is empty")
        self._batch.n_tokens = self.n_tokens
        self._decoded_outputs = 0
        rc = ctx.decode_batch(self._batch, abortable=should_abort is not None, should_abort=should_abort)
        if rc == DECODE_OK:
            self._decoded_outputs = self.n_outputs
        return rc

    def rows(self, ctx: Context) -> np.ndarray:
        """The logits of the last decode, one row per output in the order added: a view
        valid until the next decode on ``ctx`` (refilling the batch meanwhile is fine)."""
        n = self._decoded_outputs
        # float * llama_get_logits(struct llama_context * ctx): rows in batch order
        ptr = self._ll.llama_get_logits(ctx.ptr)
        if not ptr or n == 0:
            raise DecodeError("the last decode produced no logits")
        address = ctypes.addressof(ptr.contents)
        view = self._rows
        if address != self._rows_address or view is None or view.shape[0] != n:
            view = self._rows = np.ctypeslib.as_array(ptr, shape=(n, ctx.n_vocab))
            self._rows_address = address
        return view

    # -- ownership ------------------------------------------------------------------------
    def close(self) -> None:
        if getattr(self, "_owned", False):
            self._owned = False
            # void llama_batch_free(struct llama_batch batch)
            self._ll.llama_batch_free(self._batch)

    def __enter__(self) -> SeqBatch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
