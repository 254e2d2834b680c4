"""A sequence's state at the points a conversation returns to, kept in memory where the cache
cannot go back.

A recurrent memory (or a hybrid's recurrent part) holds one snapshot per sequence, after its
last token: it cannot drop a tail (``llama_memory_seq_rm`` refuses), so going back — to
the end of the prompt (Regenerate), or to where the next turn's prompt parts from this
one's — would mean reading the whole conversation again.  A :class:`PromptSnapshot` is the
state at one position (a few hundred KB for a small hybrid: the attention cells plus the
recurrent rows), and a :class:`Shelf` keeps a sequence's few latest ones: at the end of
each prompt (with its next-token logits) and at the prompt's marks
(``engine.conversation.Answer.marks``: where the user's turn starts and ends, so an Edit of
it, or a next turn whose template rewrites the answer — a thinking model's dropped thinking
— reads only from there).  Attention-only memories trim their tail and never need one.  A
hybrid without a sliding window keeps only its recurrent part (llama.cpp's
``PARTIAL_ONLY`` state: a fixed size, however long the conversation): putting it back
replaces the recurrent state, after which the attention cells past it can be dropped like
any attention tail.  llama.cpp's own rollback (``n_rs_seq``) keeps per-token snapshots for
a few tokens only (speculative decoding): an answer is longer.

Decoding in pieces cut at the marks gives the same state, bit for bit, as decoding in one
piece on the pinned llama.cpp's CPU kernels (measured for mamba2, rwkv7, lfm2, qwen35,
granitehybrid and falcon-h1 at batch 32 and 512), so a snapshot only saves work: reading
again from it gives what reading from the start would.

A restore's snapshots (engine.restore) are recurrent states its files hold; each stays in
its file until it is used (engine.checkpoints.file_bytes), then is read, checked against
its CRC, walked, and kept in memory.  Going back (Runtime.trim) or saving from a snapshot
(a prefix, an autosave one token short) reads it through :meth:`Shelf.nearest_had`: one
whose file no longer holds it leaves the shelf, and the next nearest is used.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.checkpoints.chain import tokens_digest
from engine.checkpoints.file_bytes import BytesInFile
from engine.checkpoints.format import logits_of_bytes
from engine.checkpoints.kvstate import check_recurrent_part
from engine.checkpoints.points import Point, check_point_crc
from engine.errors import CorruptMetadata, CorruptState
from native.context import STATE_RECURRENT_ONLY
from native.errors import StateError

log = logging.getLogger("engine")


@dataclass
class PromptSnapshot:
    n_tokens: int
    digest: str            # of the tokens it holds (engine.checkpoints.chain.tokens_digest)
    #: llama_state_seq_get_data(_ext) of the sequence; or, kept by a restore, where a file holds
    #: its recurrent part (read when used: :meth:`state_now`)
    state: np.ndarray | BytesInFile
    #: the next-token logits after them (None at a mark: decoding goes on); or, kept by a
    #: restore, where a file holds them (read with the state: :meth:`state_now`)
    logits: np.ndarray | BytesInFile | None
    recurrent_only: bool = False   # the state is a hybrid's recurrent part (STATE_RECURRENT_ONLY)
    #: a state left in its file: ``(n_layer, recurrent_rows)`` of the model, to walk it with once read
    walk_with: tuple[int, tuple[int, ...] | None] | None = field(default=None, repr=False)

    @classmethod
    def take(cls, ctx, seq: int, tokens: Sequence[int], logits: np.ndarray | None, *,
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
        return cls(len(tokens), tokens_digest(tokens), buf[:written],
                   None if logits is None else np.array(logits, copy=True), recurrent_only)

    @classmethod
    def in_file(cls, tokens: Sequence[int] | np.ndarray, n_tokens: int, stored: BytesInFile,
                logits: np.ndarray | BytesInFile | None, n_layer: int,
                recurrent_rows: tuple[int, ...] | None) -> PromptSnapshot:
        """The snapshot after ``tokens[:n_tokens]`` whose recurrent part (as a point carries
        it) a file holds, ``stored``: read, checked and walked when it is first used, with
        the logits where the file holds them too."""
        return cls(n_tokens, tokens_digest(tokens[:n_tokens]), stored, logits, recurrent_only=True,
                   walk_with=(n_layer, recurrent_rows))

    @classmethod
    def of_point(cls, tokens: Sequence[int], point: Point, n_layer: int,
                 recurrent_rows: tuple[int, ...] | None) -> PromptSnapshot:
        """A file's point (engine.checkpoints.points) as the snapshot to go back to in a
        sequence that holds ``tokens``, the file restored; its recurrent state checked against
        its own CRC (a restore does not read it) and walked first (CorruptState), as a file's
        state is before llama.cpp sees a byte."""
        if point.recurrent is None:
            raise CorruptState("the point carries no recurrent state")
        check_point_crc(point)
        check_recurrent_part(point.recurrent, point.n_tokens, n_layer, recurrent_rows)
        return cls(point.n_tokens, tokens_digest(tokens[:point.n_tokens]), point.recurrent, None,
                   recurrent_only=True)

    def holds(self, tokens: Sequence[int], n: int) -> bool:
        """Whether this is the state after ``tokens[:n]``."""
        return n == self.n_tokens and len(tokens) >= n and tokens_digest(tokens[:n]) == self.digest

    def state_now(self) -> np.ndarray:
        """The state's bytes: one a file holds is read now, checked against its CRC and
        walked (as a file's state is before llama.cpp sees a byte), then kept in memory, as
        are the logits a file holds (checked against their CRC, and for NaN and +inf).
        CorruptState where the file no longer holds them (engine.checkpoints.file_bytes: for
        good); OSError or MemoryError where they cannot be had now (a file another program
        holds open on Windows, no memory for the copy).  Either way the snapshot is as it was."""
        state, logits = self.state, self.logits
        if isinstance(state, BytesInFile):
            state = state.read()
            if self.walk_with is not None:
                check_recurrent_part(state, self.n_tokens, *self.walk_with)
        if isinstance(stored := logits, BytesInFile):
            try:
                logits = logits_of_bytes(stored.read())
            except CorruptMetadata as exc:
                raise CorruptState(f"{stored.path.name}: {exc}") from None
        self.state, self.logits = state, logits
        return state

    def logits_now(self) -> np.ndarray | None:
        """The logits, once :meth:`state_now` has had them (put_back, Shelf.nearest_had)."""
        assert not isinstance(self.logits, BytesInFile), "read with the state first"
        return self.logits

    def still_in_file(self) -> bool:
        """Whether the state is still where a restore left it, in its file (read when used)."""
        return isinstance(self.state, BytesInFile)

    def put_back(self, ctx, seq: int) -> bool:
        """Make ``seq`` hold the snapshot again; False if llama.cpp refuses (``seq`` emptied),
        or the state cannot be had (``seq`` as it was: :meth:`state_now`)."""
        try:
            state = self.state_now()
        except (CorruptState, OSError, MemoryError) as exc:
            log.warning("the state kept at token %d cannot be had (%s)", self.n_tokens, exc)
            return False
        try:
            if self.recurrent_only:
                # the recurrent state back at the prompt's end; then the answer's attention
                # cells are a tail like any other (the recurrent part has none left past it)
                ctx.state_set_from(state, len(state), seq, STATE_RECURRENT_ONLY)
                if not ctx.seq_rm(seq, self.n_tokens, -1):
                    raise StateError("the attention cells past the prompt could not be dropped")
            else:
                ctx.seq_rm(seq, -1, -1)
                ctx.state_set_from(state, len(state), seq)
        except StateError:
            ctx.seq_rm(seq, -1, -1)
            return False
        return True


def point_or_nearest(shelf: Shelf, tokens: Sequence[int], n: int, point: Point | None, n_layer: int,
                     recurrent_rows: tuple[int, ...] | None) -> PromptSnapshot | None:
    """What a sequence holding ``tokens`` goes back to, to keep ``n`` of them: ``point``, a
    point at ``n`` of the file just restored (its state walked first: one that does not walk
    is not used), else the shelf's nearest snapshot at or before ``n``."""
    if point is not None and point.n_tokens == n and point.recurrent is not None:
        try:
            return PromptSnapshot.of_point(tokens, point, n_layer, recurrent_rows)
        except CorruptState as exc:
            log.warning("a turn end's recurrent state is damaged (%s): its prompt is read again", exc)
    return shelf.nearest_had(tokens, n)


def recurrent_part(ctx, seq: int) -> np.ndarray | None:
    """The recurrent part of ``seq``'s state now, naming sequence 0 as a file holds it (a
    point's: engine.checkpoints.points); None when llama.cpp cannot give it."""
    snapshot = PromptSnapshot.take(ctx, seq, (), None, recurrent_only=True)
    return None if snapshot is None else point_state(snapshot)


def state_sizes(ctx, seq: int, has_recurrent: bool) -> tuple[int, int]:
    """Bytes of ``seq``'s state now, and of its recurrent part (0 without one): what a file
    of it holds (no copy is made: llama.cpp only counts)."""
    total = ctx.state_size(seq)
    return total, (ctx.state_size(seq, STATE_RECURRENT_ONLY) if has_recurrent else 0)


def point_state(snapshot: PromptSnapshot) -> np.ndarray:
    """A snapshot's recurrent part as a point carries it (engine.checkpoints.points): a copy
    naming sequence 0.  A hybrid's snapshot is that part already; a recurrent memory's whole
    state is the same bytes (llama.cpp's recurrent memory writes no other part)."""
    state = np.array(snapshot.state_now(), copy=True)
    state[4:8] = np.frombuffer((0).to_bytes(4, "little"), dtype=np.uint8)   # llama.cpp ignores it
    return state


class Shelf:
    """One sequence's latest snapshots (at most ``capacity``), the newest positions kept,
    and its *step*: the state one token before an autosave's end (:meth:`keep_step`)."""

    capacity = 4

    def __init__(self) -> None:
        self._items: list[PromptSnapshot] = []
        self._step: PromptSnapshot | None = None

    def __len__(self) -> int:
        return len(self._items)

    def add(self, snapshot: PromptSnapshot | None, tokens: Sequence[int]) -> None:
        """Keep ``snapshot`` (of ``tokens``, what the sequence holds now); those that are no
        longer a prefix of ``tokens`` go, then the oldest beyond the capacity."""
        if snapshot is None:
            return
        kept = [s for s in self._items if s.n_tokens != snapshot.n_tokens and s.holds(tokens, s.n_tokens)]
        kept.append(snapshot)
        kept.sort(key=lambda s: s.n_tokens)
        self._items = kept[-self.capacity:]

    def keep_step(self, snapshot: PromptSnapshot | None) -> None:
        """Keep ``snapshot`` apart from the others, replacing the last one so kept: the
        state before the token an autosave will end with, so that the autosave is written
        one token short and needs no logits (engine.runtime.saves_one_short).  It never
        pushes a prompt's snapshots off the shelf."""
        self._step = snapshot

    def _candidates(self, tokens: Sequence[int], n: int) -> Iterator[PromptSnapshot]:
        """The snapshots of prefixes of ``tokens[:n]``, the most tokens first; at one
        position a prompt's before the step, and one in memory before one still in its file
        (each prefix digested only when the ones before it did not hold)."""
        step = [self._step] if self._step is not None else []
        below = sorted((s for s in (*self._items, *step) if s.n_tokens <= n),
                       key=lambda s: (s.n_tokens, not s.still_in_file()), reverse=True)   # (stable: items first)
        return (s for s in below if s.holds(tokens, s.n_tokens))

    def nearest(self, tokens: Sequence[int], n: int) -> PromptSnapshot | None:
        """The snapshot of the most of ``tokens[:n]``, or None (its state may still be in its
        file: :meth:`nearest_had` reads it)."""
        return next(self._candidates(tokens, n), None)

    def nearest_had(self, tokens: Sequence[int], n: int, *, exactly: bool = False) -> PromptSnapshot | None:
        """:meth:`nearest` (``exactly``: at ``n`` only), its state in memory
        (PromptSnapshot.state_now): one whose file no longer holds it leaves the shelf, one
        that cannot be had now stays, each with a warning, and the next nearest is tried."""
        for found in self._candidates(tokens, n):
            if exactly and found.n_tokens != n:
                break
            try:
                found.state_now()
                return found
            except CorruptState as exc:
                log.warning("the state kept at token %d cannot be had (%s): an earlier one is used",
                            found.n_tokens, exc)
                self._items = [s for s in self._items if s is not found]
                if self._step is found:
                    self._step = None
            except (OSError, MemoryError) as exc:
                log.warning("the state kept at token %d cannot be had now (%r): an earlier one is used",
                            found.n_tokens, exc)
        return None

    def at(self, tokens: Sequence[int], n: int) -> PromptSnapshot | None:
        """The snapshot after exactly ``tokens[:n]``, or None (its state may still be in its file)."""
        found = self.nearest(tokens, n)
        return found if found is not None and found.n_tokens == n else None

    def at_had(self, tokens: Sequence[int], n: int) -> PromptSnapshot | None:
        """:meth:`at`, its state in memory (:meth:`nearest_had`)."""
        return self.nearest_had(tokens, n, exactly=True)

    def clear(self) -> None:
        self._items = []
        self._step = None


class WindowCover:
    """Which positions' sliding-window cells a sequence holds, so that a tail is dropped
    only where what stays is exactly what decoding gave.

    A sliding-window cache (Gemma 3: ``n_swa`` 512, llama.cpp's full-size window cache)
    keeps every cell it decoded, but a saved state holds only the window before its end:
    a file of positions ``first..end-1`` sets the window cells ``max(first, end - n_swa)
    ..end-1`` (measured on the pinned llama.cpp).  Dropping the tail at ``m`` is exact
    only when the ``n_swa - 1`` positions before ``m`` are all held (what the token at
    ``m`` sees); llama.cpp's
    ``seq_rm`` succeeds either way, and the next tokens would then see a window with
    holes (logits off by ~1, silently).  Without a window (``n_swa`` 0) every cut is exact.
    """

    def __init__(self, n_swa: int) -> None:
        self.n_swa = n_swa
        self._spans: list[tuple[int, int]] = []   # held positions [start, end), disjoint, sorted

    def decoded(self, start: int, end: int) -> None:
        """Positions ``start..end-1`` were decoded: every cell is held."""
        self._add(start, end)

    def restored(self, first: int, end: int) -> None:
        """A state of positions ``first..end-1`` was set: the window before ``end`` is held."""
        self._add(max(first, end - self.n_swa) if self.n_swa else first, end)

    def can_cut(self, m: int) -> bool:
        """Whether keeping only positions below ``m`` leaves a window that decoding gave."""
        return self.nearest_cut(m) == m

    def nearest_cut(self, n: int) -> int:
        """The most positions, at most ``n``, that can be kept exactly (0: none)."""
        if not self.n_swa:
            return n
        best = 0
        for start, end in self._spans:
            m = min(end, n)
            # the token at m sees positions m - n_swa + 1 .. m (llama.cpp's standard window;
            # a chunked one sees fewer)
            if start == 0 or m - self.n_swa + 1 >= start:
                best = max(best, m)
        return best

    def cut(self, m: int) -> None:
        self._spans = [(start, min(end, m)) for start, end in self._spans if start < m]

    def clear(self) -> None:
        self._spans = []

    def _add(self, start: int, end: int) -> None:
        if start >= end:
            return
        merged: list[tuple[int, int]] = []
        for s, e in sorted([*self._spans, (start, end)]):
            if merged and s <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], e))
            else:
                merged.append((s, e))
        self._spans = merged
