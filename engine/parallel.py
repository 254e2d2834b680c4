"""Several conversations in one context: each in its own sequence of a unified KV cache.

A :class:`ParallelRuntime` owns a model and one context of ``sequences + 1`` sequences
over one unified KV cache (``kv_unified``): sequences ``0 .. S-1`` hold conversations,
sequence ``S`` is scratch space for writing and applying delta checkpoints.  Which conversation is
in which sequence is :class:`engine.sequences.SequenceTable`'s business; this module
does what it decides to the cache, and knows, per sequence, exactly which tokens the
cache holds and for which length it holds the next-token logits (as
:class:`engine.runtime.Runtime` does for its single sequence).

Decoding is one ``llama_decode`` per call for every sequence involved
(:meth:`decode_chunks`: prompt chunks of several conversations; :meth:`decode_tokens`:
one generated token per running answer); the logits of each sequence's last position
are a row of that decode's output, kept as a view until the next decode and copied
only for a sequence that does not take part in it.

Files: :meth:`save` writes a sequence in the ordinary ``.kvckpt`` format, as a
single-sequence context would have (the state names sequence 0, the header the
single-sequence shape ``n_seq_max`` = :data:`FILE_SEQ_MAX`): with one unified cache a
sequence's state has the same bytes whatever ``n_seq_max`` is, so
``Runtime.restore_chain`` and ``checkpoint-chat run --checkpoint-load`` read the file
as one of their own.  The writing is ``Runtime.save`` itself, on a :class:`SequenceView`
(one sequence shaped like a single-sequence Runtime), so ``engine.history.LineWriter``
autosaves a running answer as deltas too.  :meth:`restore` reads such a chain (deltas
too) into any sequence.

Cell order: attention sums a sequence's cells in the order they lie in the cache (flash
attention's running softmax), so a sequence's bits are its bits alone only while its
cells lie in position order, other sequences' cells between them being skipped.
llama.cpp puts new cells at the first free cells from where it last freed some, so a
sequence that grows after another's cells below it were freed (an Edit, a Delete, an
eviction) writes its next cells below its first ones, and its logits change (0.60 on
SmolLM2).  So whatever frees cells while another sequence holds some marks the cache
fragmented, and before its next decode or restore every sequence's state is read out
and put back in order (:meth:`ParallelRuntime._repack`: bytes copied, nothing
recomputed).

Like every native owner it belongs to one thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from engine.checkpoints.chain import common_prefix
from engine.checkpoints.compat import ContextShape, Target
from engine.checkpoints.format import KIND_MANUAL, CheckpointData, Header
from engine.checkpoints.points import Point
from engine.conversation import Conversation
from engine.errors import GenerationError, RestoreFailed, SaveFailed
from engine.model_shape import MEMORY_ATTENTION, MEMORY_RECURRENT
from engine.restore import peak_tokens, restore_into
from engine.runtime import Runtime, SaveInfo, copy_prefix, logits_rule, relabel_as
from engine.sequences import Placement, SequenceTable
from engine.snapshots import PromptSnapshot, Shelf, WindowCover, point_or_nearest, recurrent_part, state_sizes
from native.batch import SeqBatch
from native.context import DECODE_ABORTED, ContextSettings
from native.errors import ModelLoadError, StateError

log = logging.getLogger("engine")

#: The sequence count a saved file declares: the single-sequence context's (its
#: sequence 1 is the scratch space for deltas), so that context restores it.
FILE_SEQ_MAX = ContextSettings.n_seq_max

#: Sequences a parallel context holds by default.
DEFAULT_SEQUENCES = 4


@dataclass
class _Held:
    """What the cache holds for one sequence (ParallelRuntime._nothing_held makes one)."""
    #: where a sliding window's tail can be dropped exactly (engine.snapshots)
    window: WindowCover
    tokens: list[int] = field(default_factory=list)
    logits_len: int = -1             # the token count the logits belong to (-1: none)
    logits: np.ndarray | None = None  # a copy; None while they are a row of the last decode
    row: int = -1                    # that row (live logits)
    #: the logits came from a decode of the last token alone (see Runtime.logits_worth_saving)
    logits_alone: bool = False
    #: a recurrent memory's states at the end of its last prompt and at its marks (engine.snapshots)
    snapshots: Shelf = field(default_factory=Shelf)


class ParallelRuntime:
    """A model, one context of several sequences, and what each sequence holds."""

    def __init__(self, model_path: str | os.PathLike, settings: ContextSettings = ContextSettings(),
                 *, sequences: int = DEFAULT_SEQUENCES, n_gpu_layers: int = 0, main_gpu: int = 0,
                 workers=None, progress=None, exact_width: int | None = None,
                 should_abort: Callable[[], bool] | None = None) -> None:
        if sequences < 1:
            raise GenerationError(f"a context holds at least one conversation, not {sequences}")
        # the Runtime is the model and context holder here; its own bookkeeping (sequence
        # 0's tokens) is never used: every sequence's is in self._held
        self._rt = Runtime(model_path, replace(settings, n_seq_max=sequences + 1, kv_unified=True),
                           n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, progress=progress,
                           workers=workers)
        self.model = self._rt.model
        self.shape = self._rt.shape
        self.ctx = self._rt.ctx
        self.settings = settings
        self.sequences = sequences
        self.scratch = sequences
        self.table = SequenceTable(sequences)
        self.batch = SeqBatch(max(settings.n_batch, sequences))
        self._held = [self._nothing_held() for _ in range(sequences)]
        #: cells were freed while other sequences held cells above them: the cache is
        #: packed again before anything else is put into it (see the module docstring)
        self.fragmented = False
        #: times the cache was packed again, and the seconds the last one took
        self.repacks = 0
        self.last_repack_s = 0.0
        #: the shape saved files declare, and that restored files must have
        self.file_settings = replace(settings, n_seq_max=FILE_SEQ_MAX, kv_unified=True)
        self.target = Target(self._rt.target.model, ContextShape.of(self.file_settings, self.ctx.n_ctx))
        #: decodes made (one per decode_chunks / decode_tokens call)
        self.decodes = 0
        #: seconds the last restore took (structure checks + setting the state)
        self.last_restore_s = 0.0
        #: chains restored, and the tokens they put into the cache (files the cache held
        #: already not counted): what switching among residents must leave alone
        self.restores = 0
        self.restored_tokens = 0
        self._views: dict[Hashable, ConversationView] = {}
        #: the most generated tokens one decode may hold with each sequence's logits
        #: bit-identical to its decode alone (0: not even one beside other sequences);
        #: measured on the empty cache unless given (see probe_exact_width)
        self.exact_width = 0   # while probing: every decode of several is in doubt
        try:
            self.exact_width = self.probe_exact_width(should_abort) if exact_width is None else exact_width
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.batch.close()
        self._rt.close()

    @property
    def fingerprint(self) -> bytes:
        return self._rt.fingerprint

    def state_buffer_for(self, size: int) -> np.ndarray:
        """The state buffer every save of this context reuses (Runtime.state_buffer_for)."""
        return self._rt.state_buffer_for(size)

    @property
    def candidates(self):
        return self._rt.candidates

    @property
    def eog_ids(self) -> np.ndarray:
        return self._rt.eog_ids

    def check_compatible(self, header: Header, meta: dict | None = None) -> None:
        """Raise IncompatibleModel / IncompatibleContext with the reason, or return
        (against self.target: the files' shape, as Runtime.check_compatible checks)."""
        self.target.check(header, meta)

    # -- residency ------------------------------------------------------------------------
    def view_of(self, key: Hashable) -> ConversationView:
        """Conversation ``key`` as a single-sequence Runtime (one object per key)."""
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = ConversationView(self, key)
        return view

    def forget(self, key: Hashable) -> None:
        """``key`` is gone (deleted): its sequence is emptied and its view dropped."""
        self.evict(key)
        self._views.pop(key, None)

    def place(self, key: Hashable, *, running: bool = False) -> Placement:
        """A sequence for conversation ``key`` (engine.sequences); an evicted one's cells go."""
        placement = self.table.activate(key, running=running)
        if placement.evicted is not None:
            self.drop(placement.seq)
        return placement

    def evict(self, key: Hashable) -> None:
        seq = self.table.evict(key)
        if seq is not None:
            self.drop(seq)

    def drop(self, seq: int) -> None:
        """Empty sequence ``seq`` (its conversation's files are untouched)."""
        self._freeing(seq)
        self.ctx.seq_rm(seq, -1, -1)
        self._held[seq] = self._nothing_held()

    def _freeing(self, seq: int) -> None:
        """Cells of ``seq`` are about to be freed: the cache is fragmented when any other
        sequence holds cells (they may lie above the freed ones; llama.cpp does not say)."""
        if self._held[seq].tokens and self.shape.memory != MEMORY_RECURRENT and any(
                held.tokens for other, held in enumerate(self._held) if other != seq):
            self.fragmented = True

    def _repack(self) -> None:
        """Put every sequence's cells back in position order, at the start of the cache
        (the module docstring says why).  Each state is read out, the cache emptied, and
        the states put back one after another: llama.cpp places a restored state's cells
        in the order they were read, from the first free cell on.  The logits of the last
        decode stay where they are (a sequence's state does not hold them).  A sliding
        window's state holds only the window before its end: that is what it holds after
        (WindowCover.restored), so a later cut never leaves the window with holes."""
        started = time.perf_counter()
        states = []
        for seq, held in enumerate(self._held):
            if held.tokens:
                size = self.ctx.state_size(seq)
                buf = np.empty(size, dtype=np.uint8)
                states.append((seq, buf[:self.ctx.state_get_into(buf, size, seq)]))
        self.ctx.clear(data=False)
        self.fragmented = False
        lost = []
        for seq, state in states:
            try:
                self.ctx.state_set_from(state, len(state), seq)
            except StateError:
                lost.append(seq)
                continue
            held = self._held[seq]
            held.window = WindowCover(self.shape.n_swa)
            held.window.restored(0, len(held.tokens))
        for seq in lost:   # not seen: the same cells fit again; its files hold it
            log.warning("sequence %d could not be put back after packing the cache: it is read again", seq)
            self.ctx.seq_rm(seq, -1, -1)
            self._held[seq] = self._nothing_held()
        self.repacks += 1
        self.last_repack_s = time.perf_counter() - started

    def _nothing_held(self) -> _Held:
        return _Held(window=WindowCover(self.shape.n_swa))

    def tokens(self, seq: int) -> list[int]:
        """The tokens sequence ``seq`` holds (do not modify)."""
        return self._held[seq].tokens

    def cells_used(self) -> int:
        return sum(len(h.tokens) for h in self._held)

    def make_room(self, n: int, *, keep: Hashable | None = None) -> bool:
        """Evict idle conversations (least recently used first, never ``keep``) until
        ``n`` more cells fit; False when they cannot."""
        while self.cells_used() + n > self.ctx.n_ctx:
            victim = self.table.victim(keep=keep)
            if victim is None:
                return False
            self.evict(victim)
        return True

    # -- logits ---------------------------------------------------------------------------
    def has_logits(self, seq: int) -> bool:
        held = self._held[seq]
        return held.logits_len == len(held.tokens) > 0

    def logits(self, seq: int) -> np.ndarray:
        """Next-token logits after ``tokens(seq)`` (a view valid until the next decode)."""
        held = self._held[seq]
        if not self.has_logits(seq):
            raise GenerationError("no logits for this sequence's current position")
        if held.logits is not None:
            return held.logits
        return self.batch.rows(self.ctx)[held.row]

    def _keep_logits(self, participants) -> None:
        """Copy the live logits of every sequence the next decode leaves out."""
        for seq, held in enumerate(self._held):
            if held.logits is None and held.logits_len >= 0 and seq not in participants:
                held.logits = np.array(self.batch.rows(self.ctx)[held.row], copy=True)
                held.row = -1

    def _forget_logits(self, seq: int) -> None:
        held = self._held[seq]
        held.logits_len, held.logits, held.row, held.logits_alone = -1, None, -1, False

    def logits_worth_saving(self, seq: int, kind: int, paused: bool) -> bool:
        """Whether a checkpoint of ``kind`` of ``seq`` carries its logits (engine.runtime.logits_rule)."""
        return logits_rule(kind, paused, self.has_logits(seq), self._held[seq].logits_alone, self.shape)

    # -- decoding -------------------------------------------------------------------------
    def can_keep(self, seq: int, n: int) -> int:
        """How many tokens :meth:`trim` ``(seq, n)`` would keep; nothing changes.  What a
        memory that cannot drop a tail holds of a shorter prompt is what it can go back
        to, not what it shares with it (the worker then restores a file instead)."""
        held = self._held[seq]
        if n >= len(held.tokens):
            return len(held.tokens)
        if self.shape.memory == MEMORY_ATTENTION and (cut := held.window.nearest_cut(n)) > 0:
            return cut
        snapshot = held.snapshots.nearest_had(held.tokens, n)   # (one whose file went: the next)
        return 0 if snapshot is None else snapshot.n_tokens

    def trim(self, seq: int, n: int, point: Point | None = None) -> int:
        """Keep only the first ``n`` tokens of ``seq``; returns how many were kept
        (a memory that cannot drop a tail, sliding window or recurrent, is emptied, unless
        it goes back to the nearest snapshot at or before ``n``: see engine.snapshots; or to
        ``point``, a point at ``n`` of the file just restored, as Runtime.trim)."""
        held = self._held[seq]
        if n >= len(held.tokens):
            return len(held.tokens)
        self._freeing(seq)
        cut = held.window.nearest_cut(n)   # a sliding window: where what stays is whole
        if cut > 0 and self.ctx.seq_rm(seq, cut, -1):
            del held.tokens[cut:]
            held.window.cut(cut)
            self._forget_logits(seq)
        elif (snapshot := point_or_nearest(held.snapshots, held.tokens, n, point, self.shape.n_layer,
                                           self.target.recurrent_rows)) is not None \
                and snapshot.put_back(self.ctx, seq):
            del held.tokens[snapshot.n_tokens:]
            held.window.cut(snapshot.n_tokens)
            self._forget_logits(seq)
            if (logits := snapshot.logits_now()) is not None:
                held.logits_len, held.logits, held.row = snapshot.n_tokens, logits, -1
        else:
            self.drop(seq)
        return len(self._held[seq].tokens)

    def reuse(self, seq: int, tokens: Sequence[int]) -> int:
        """Trim ``seq`` to what it shares with ``tokens``; returns the tokens kept.  When
        it holds all of them but no logits, the last one is given back to be decoded."""
        total = len(tokens)
        if total > self.ctx.n_ctx:
            raise GenerationError(f"the prompt has {total} tokens; the context holds {self.ctx.n_ctx}")
        keep = self.trim(seq, common_prefix(self._held[seq].tokens, tokens))
        if keep == total and total > 0 and not self.has_logits(seq):
            keep = self.trim(seq, total - 1)
        return keep

    def decode_chunks(self, chunks: Sequence[tuple[int, Sequence[int], bool]], *,
                      should_abort: Callable[[], bool] | None = None) -> bool:
        """One decode of several sequences' next tokens: ``(seq, tokens, logits_last)``,
        each run continuing what its sequence holds.

        ``should_abort`` makes the decode abortable: False is returned when it stopped
        early, each sequence then holding what its processed micro-batches put there
        (and no logits).  True when every token is in.
        """
        self.batch.clear()
        rows = []
        for seq, tokens, logits_last in chunks:
            held = self._held[seq]
            rows.append(self.batch.add_run(tokens, len(held.tokens), seq, logits_last))
        if self._decode({seq for seq, _, _ in chunks}, should_abort) == DECODE_ABORTED:
            for seq, tokens, _ in chunks:
                held = self._held[seq]
                done = self.ctx.pos_max(seq) + 1 - len(held.tokens)
                held.window.decoded(len(held.tokens), len(held.tokens) + max(0, done))
                held.tokens.extend(tokens[:max(0, done)])
                self._forget_logits(seq)
            return False
        for (seq, tokens, logits_last), row in zip(chunks, rows, strict=True):
            held = self._held[seq]
            held.window.decoded(len(held.tokens), len(held.tokens) + len(tokens))
            held.tokens.extend(tokens)
            if logits_last:
                held.logits_len, held.logits, held.row = len(held.tokens), None, row
                held.logits_alone = len(chunks) == 1 and len(tokens) == 1
                self.keep_snapshot(seq, logits=self.logits(seq))   # the end of a prompt
            else:
                self._forget_logits(seq)
        return True

    def keep_snapshot(self, seq: int, tokens: Sequence[int] | None = None,
                      logits: np.ndarray | None = None) -> None:
        """A recurrent memory keeps ``seq``'s state now, holding ``tokens`` (by default what
        it holds; with ``logits`` after them, if known), to go back to (engine.snapshots):
        a prompt's mark that a chunk ended at, a file of a restored chain."""
        held = self._held[seq]
        if self.shape.has_recurrent:
            tokens = held.tokens if tokens is None else tokens
            held.snapshots.add(PromptSnapshot.take(self.ctx, seq, tokens, logits,
                                                   recurrent_only=self.shape.snapshot_recurrent_only), tokens)

    def keep_step_snapshot(self, seq: int) -> None:
        """A recurrent memory keeps ``seq``'s state now, before the token an autosave will
        end with (engine.runtime.Runtime.keep_step_snapshot)."""
        held = self._held[seq]
        if self.shape.has_recurrent:
            held.snapshots.keep_step(PromptSnapshot.take(self.ctx, seq, held.tokens, None,
                                                         recurrent_only=self.shape.snapshot_recurrent_only))

    def decode_tokens(self, tokens: dict[int, int]) -> None:
        """One decode of one token per sequence (``{seq: token}``), each with its logits."""
        self.batch.clear()
        rows = {seq: self.batch.add(token, len(self._held[seq].tokens), seq, True)
                for seq, token in tokens.items()}
        self._decode(tokens.keys())
        for seq, token in tokens.items():
            held = self._held[seq]
            held.window.decoded(len(held.tokens), len(held.tokens) + 1)
            held.tokens.append(token)
            held.logits_len, held.logits, held.row = len(held.tokens), None, rows[seq]
            # several sequences in one decode give each the logits of its decode alone
            # up to the measured exact width (probe_exact_width)
            held.logits_alone = len(tokens) <= max(1, self.exact_width)

    def _decode(self, participants, should_abort: Callable[[], bool] | None = None) -> int:
        if any(len(self._held[s].tokens) >= self.ctx.n_ctx for s in participants):
            raise GenerationError("the context is full")
        if self.fragmented:
            self._repack()
        self._keep_logits(set(participants))
        rc = self.batch.decode(self.ctx, should_abort=should_abort)
        self.decodes += 1
        return rc

    def probe_exact_width(self, should_abort: Callable[[], bool] | None = None) -> int:
        """Measure :attr:`exact_width` on this model, cache type and backend (empty cache).

        Whether a sequence's logits depend on what else a decode holds is a property of
        the kernels, not of the tokens: CPU matrix kernels for repacked weight types
        (Q4_K here, Gemma 3) multiply 4 rows at once, whose sums round otherwise than one
        row's.  So each sequence's next-token logits and state are computed alone (nothing
        else in the cache), then with every sequence present and ``w`` of them in one
        decode, for ``w = S .. 1``: the first ``w`` whose logits and states all match bit
        for bit is the width.  The state too: a recurrent memory's batched kernels (mamba2,
        a gated delta-net, LFM2's convolutions) can round the state otherwise while this
        token's logits come out the same, and the next tokens' then differ (a user's test:
        ``run --parallel`` apart from the same prompt alone after one token).  About
        S * (S + 2) decodes of a few tokens, once per context (seconds for a large model on
        a CPU): ``should_abort`` true stops it at its next decode with ModelLoadError, as a
        cancelled load of the weights stops (the window closed while it loads).  Without
        flash attention the answer is 0 without measuring (see below).
        """
        if not self.settings.flash_attn:
            # attention then sums over the other sequences' (masked) cells too, as many as
            # the cache holds: a probe on a nearly empty cache cannot vouch for a full one
            # (SmolLM2, f16: 0.83 apart at one token per decode beside 3 x 128 tokens)
            return 0
        probe = self.model.tokenize("Checkpoint Chat measures its batches.", add_special=True)[:6]
        n = self.sequences
        nexts = [probe[(k + 1) % len(probe)] for k in range(n)]

        step = max(1, self.settings.n_batch)   # a decode takes at most n_batch tokens

        def go_on() -> None:   # before each decode
            if should_abort is not None and should_abort():
                raise ModelLoadError("the model's load was cancelled")

        def fill(seqs) -> None:
            for seq in seqs:
                self.drop(seq)
            for seq in seqs:
                tokens = probe[:len(probe) - 1 - seq % 2]
                for start in range(0, len(tokens), step):
                    go_on()
                    self.decode_chunks([(seq, tokens[start:start + step], False)])

        def decode_next(seqs) -> None:
            go_on()
            self.decode_tokens({seq: nexts[seq] for seq in seqs})

        def outcome(seq: int) -> tuple[np.ndarray, np.ndarray | None]:
            """The sequence's next-token logits and its state (None: llama.cpp gave none)."""
            snapshot = PromptSnapshot.take(self.ctx, seq, (), None)
            return np.array(self.logits(seq), copy=True), None if snapshot is None else snapshot.state_now()

        def same(a: tuple[np.ndarray, np.ndarray | None], b: tuple[np.ndarray, np.ndarray | None]) -> bool:
            return (np.array_equal(a[0], b[0]) and a[1] is not None and b[1] is not None
                    and np.array_equal(a[1], b[1]))

        alone = []
        for seq in range(n):
            fill([seq])
            decode_next([seq])
            alone.append(outcome(seq))
        width = 0
        for w in range(n, 0, -1):
            fill(range(n))
            decode_next(range(w))
            if all(same(outcome(seq), alone[seq]) for seq in range(w)):
                width = w
                break
        for seq in range(n):
            self.drop(seq)
        self.decodes = 0
        return width

    # -- checkpoints ----------------------------------------------------------------------
    def view(self, seq: int) -> SequenceView:
        """Sequence ``seq`` as the code that saves a Runtime sees one (LineWriter too)."""
        return SequenceView(self, seq)

    def save(self, path: str | os.PathLike, conv: Conversation, seq: int, kind: int = KIND_MANUAL,
             parent: SaveInfo | None = None, *, line: str | None = None, seq_no: int = 0,
             fresh: bool = False) -> SaveInfo:
        """Write ``conv``, held in sequence ``seq``, to ``path`` atomically: a checkpoint
        a single-sequence context restores (a delta on ``parent`` when given), exactly as
        ``Runtime.save`` writes one (see the module docstring)."""
        # misc: SequenceView borrows Runtime.save (see its docstring), whose self is typed Runtime
        return self.view(seq).save(path, conv, kind, parent, line=line,  # type: ignore[misc]
                                   seq=seq_no, fresh=fresh)

    def restore(self, chain: Sequence[CheckpointData], seq: int) -> Conversation:
        """Put a verified chain (a full file, then deltas on it) into sequence ``seq``
        (engine.restore: every file is checked before llama.cpp sees a byte, so a refused
        chain leaves the sequence as it was; if llama.cpp itself refuses a state, or a
        large state's checksum, computed while llama.cpp copied it, fails, the sequence is
        emptied)."""
        if self.fragmented:
            self._repack()
        started = time.perf_counter()
        try:   # what it frees, it frees through trim and drop (which mark the cache)
            done = restore_into(_Slot(self, seq), chain, self.target)
        finally:
            self.last_restore_s = time.perf_counter() - started
        self.restores += 1
        self.restored_tokens += done.n_restored
        return done.conv


class _Slot:
    """Sequence ``seq`` of a ParallelRuntime as engine.restore changes one."""

    def __init__(self, prt: ParallelRuntime, seq: int) -> None:
        self.prt, self.ctx = prt, prt.ctx
        self.seq, self.scratch = seq, prt.scratch

    @property
    def tokens(self) -> list[int]:
        return self.prt.tokens(self.seq)

    def trim(self, n: int) -> int:
        return self.prt.trim(self.seq, n)

    def make_room(self, n_tokens: int) -> None:
        prt = self.prt
        if prt.cells_used() - len(prt.tokens(self.seq)) + n_tokens > prt.ctx.n_ctx:
            raise RestoreFailed(f"the context has no room for {n_tokens} more tokens; "
                                "evict a conversation first")

    def empty(self) -> None:
        self.prt.drop(self.seq)

    def applied(self, first: int, end: int) -> None:
        self.prt._held[self.seq].window.restored(first, end)

    def forget_logits(self) -> None:
        self.prt._forget_logits(self.seq)

    def passed(self, tokens: list[int], logits: np.ndarray | None) -> None:
        self.prt.keep_snapshot(self.seq, tokens, logits)

    def keep(self, snapshot: PromptSnapshot) -> None:
        held = self.prt._held[self.seq]
        held.snapshots.add(snapshot, held.tokens)

    def restored(self, tokens: list[int], logits: np.ndarray | None) -> None:
        held = self.prt._held[self.seq]
        held.tokens = tokens
        if logits is not None:
            held.logits_len, held.logits = len(tokens), np.array(logits, copy=True)
            held.logits_alone = False


class SequenceView:
    """One sequence of a ParallelRuntime, shaped like the single-sequence Runtime that
    ``Runtime.save`` and ``engine.history.LineWriter`` work on.

    ``save``, ``header_for`` and ``metadata_for`` are Runtime's own functions, so a
    sequence's file is written by the same code, with the same checks, as any other;
    what differs is supplied here: the sequence's tokens and logits, the single-sequence
    settings the file declares, and its state, read from the sequence (through the
    scratch sequence for a delta) and relabelled as sequence 0's (1 for a delta).
    """

    save = Runtime.save
    prefix_state = Runtime.prefix_state
    header_for = Runtime.header_for
    metadata_for = Runtime.metadata_for
    _file_metadata = Runtime._file_metadata
    _walk_before_saving = Runtime._walk_before_saving

    def __init__(self, prt: ParallelRuntime, seq: int) -> None:
        self._bind(prt)
        self.seq = seq

    def _bind(self, prt: ParallelRuntime) -> None:
        self._prt = prt
        self.model = prt.model
        self.ctx = prt.ctx
        self.fingerprint = prt.fingerprint
        self.settings = prt.file_settings
        self.shape = prt.shape
        self.target = prt.target

    @property
    def kv_tokens(self) -> list[int]:
        return self._prt.tokens(self.seq)

    def has_logits(self) -> bool:
        return self._prt.has_logits(self.seq)

    def snapshot_at(self, n: int) -> PromptSnapshot | None:
        held = self._prt._held[self.seq]
        return held.snapshots.at_had(held.tokens, n)

    def window_whole_at(self, n: int) -> bool:
        return self._prt._held[self.seq].window.can_cut(n)

    def logits(self) -> np.ndarray:
        return self._prt.logits(self.seq)

    def logits_worth_saving(self, kind: int, paused: bool) -> bool:
        return self._prt.logits_worth_saving(self.seq, kind, paused)

    def logits_decoded_alone(self) -> bool:
        seq = self.seq
        return seq is not None and self._prt.has_logits(seq) and self._prt._held[seq].logits_alone

    def keep_step_snapshot(self) -> None:
        if self.seq is not None:
            self._prt.keep_step_snapshot(self.seq)

    def recurrent_part(self) -> np.ndarray | None:
        """As Runtime.recurrent_part, of this sequence."""
        seq = self.seq
        return recurrent_part(self.ctx, seq) if seq is not None and self.shape.has_recurrent else None

    def state_sizes(self) -> tuple[int, int]:
        """As Runtime.state_sizes, of this sequence."""
        seq = self.seq
        return state_sizes(self.ctx, seq, self.shape.has_recurrent) if seq is not None else (0, 0)

    def _state_bytes(self, p0: int, upto: int | None = None) -> np.ndarray:
        prt, ctx = self._prt, self._prt.ctx
        source = self.seq
        partial = bool(p0) or upto is not None
        if upto is not None:   # a prefix, or a delta written one token short
            copy_prefix(self, self.seq, prt.scratch, upto, p0)
            source = prt.scratch
        elif partial:   # shares the cells; copies nothing
            ctx.seq_cp(self.seq, prt.scratch, p0, -1)
            source = prt.scratch
        try:
            size = ctx.state_size(source)
            buf = prt.state_buffer_for(size)   # reused, as Runtime's own saves do
            try:
                state = buf[:ctx.state_get_into(buf, size, source)]
            except StateError as exc:
                raise SaveFailed(str(exc)) from exc
            relabel_as(state, self, n_tokens=len(self.kv_tokens) if upto is None else upto,
                       first_pos=p0, source=source, seq_id=1 if p0 else 0)
            return state
        finally:
            if partial:
                ctx.seq_rm(prt.scratch, -1, -1)


class ConversationView(SequenceView):
    """Conversation ``key`` of a ParallelRuntime, wherever the residency table puts it,
    with the single-sequence Runtime's interface: what the worker, the line writer,
    prefix reuse and compaction use, so each conversation's code reads as it did when
    the cache held one conversation.

    Reading (``kv_tokens``, ``has_logits``) places nothing: a conversation that is not
    resident holds no tokens.  Restoring (``restore_chain``) gives it a sequence first
    (engine.sequences: its own when resident, else a free one, else the least recently
    used idle one's) and evicts idle conversations while the cells
    are short, never this one.  Decoding into it is the Batcher's (engine.concurrent).
    """

    def check_compatible(self, header: Header, meta: dict | None = None) -> None:
        """As :meth:`ParallelRuntime.check_compatible` (the files' shape)."""
        self.target.check(header, meta)

    def __init__(self, prt: ParallelRuntime, key: Hashable) -> None:
        self._bind(prt)
        self.key = key
        self.target = prt.target

    # override: unlike a SequenceView's, a conversation's sequence comes and goes with its
    # residency (None: not resident); what it inherits runs only while it is resident
    @property
    def seq(self) -> int | None:  # type: ignore[override]
        table = self._prt.table
        return table.seq_of(self.key) if self.key in table else None

    @property
    def resident(self) -> bool:
        return self.key in self._prt.table

    @property
    def candidates(self):
        return self._prt.candidates

    @property
    def eog_ids(self) -> np.ndarray:
        return self._prt.eog_ids

    @property
    def last_restore_s(self) -> float:
        return self._prt.last_restore_s

    @last_restore_s.setter
    def last_restore_s(self, value: float) -> None:
        self._prt.last_restore_s = value

    @property
    def kv_tokens(self) -> list[int]:
        seq = self.seq
        return [] if seq is None else self._prt.tokens(seq)

    def has_logits(self) -> bool:
        seq = self.seq
        return seq is not None and self._prt.has_logits(seq)

    def logits(self) -> np.ndarray:
        seq = self.seq
        if seq is None:
            raise GenerationError("this conversation is not in the cache")
        return self._prt.logits(seq)

    def logits_worth_saving(self, kind: int, paused: bool) -> bool:
        seq = self.seq
        return seq is not None and self._prt.logits_worth_saving(seq, kind, paused)

    def place(self) -> Placement:
        """Give the conversation a sequence (see the class docstring)."""
        return self._prt.place(self.key)

    def trim(self, n: int, point: Point | None = None) -> int:
        seq = self.seq
        return 0 if seq is None else self._prt.trim(seq, n, point)

    def can_keep(self, n: int) -> int:
        seq = self.seq
        return 0 if seq is None else self._prt.can_keep(seq, n)

    def restore_chain(self, chain: Sequence[CheckpointData]) -> Conversation:
        seq = self.place().seq
        last = peak_tokens(chain)   # (a cut chain holds its parent whole for a moment)
        if not self._prt.make_room(max(0, last - len(self._prt.tokens(seq))), keep=self.key):
            raise RestoreFailed(f"the context has no room for {last:,} more tokens while other "
                                "conversations are answering")
        return self._prt.restore(chain, seq)
