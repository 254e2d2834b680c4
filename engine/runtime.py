"""The loaded model and context, the KV cache's contents, and checkpoint save/restore.

A :class:`Runtime` belongs to one thread (the engine thread, or the CLI's main thread).
It knows exactly which tokens the KV cache holds (``kv_tokens``) and for which length
it holds the next-token logits, so that any conversation can be brought into the cache
by decoding only what is not there yet (prefix reuse), and so that a checkpoint can
carry the logits a resumed generation needs.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from engine import APP_VERSION
from engine.checkpoints.atomic import atomic_write
from engine.checkpoints.chain import ParentRef, common_prefix, prepare_to_load, tokens_digest
from engine.checkpoints.compat import ContextShape, ModelIdentity, Target
from engine.checkpoints.fingerprint import model_fingerprint
from engine.checkpoints.format import (
    FLAG_CELL_EXT,
    FLAG_DELTA,
    KIND_AUTOSAVE,
    KIND_EXIT,
    KIND_MANUAL,
    KIND_PAUSE,
    CheckpointData,
    Header,
    encode_metadata,
    logits_crc,
    recurrent_block_metadata,
    stored_payload_crc,
    write_sections,
)
from engine.checkpoints.graph import default_line, line_of
from engine.checkpoints.kvstate import (
    check_recurrent_part,
    check_state,
    check_state_for,
    recurrent_block_len,
    relabel_state,
)
from engine.checkpoints.points import Point, check_point_crc, metadata_of, recurrent_parts
from engine.conversation import Conversation
from engine.errors import CorruptState, GenerationError, SaveFailed
from engine.gguf import GGUFError
from engine.model_shape import ModelShape, read_model_shape
from engine.restore import restore_into
from engine.snapshots import PromptSnapshot, Shelf, WindowCover, point_or_nearest, recurrent_part, state_sizes
from native.context import DECODE_ABORTED, Context, ContextSettings
from native.errors import StateError
from native.library import loaded_library
from native.model import Model, ProgressCallback
from native.rpc import Workers
from native.sampler import Candidates

log = logging.getLogger("engine")


@dataclass
class PrefillReport:
    n_prompt: int = 0        # tokens the model must have seen before sampling
    n_reused: int = 0        # of those, already in the KV cache
    n_decoded: int = 0       # decoded now
    seconds: float = 0.0
    aborted: bool = False


@dataclass(frozen=True)
class SaveInfo:
    path: Path
    size: int
    seconds: float
    n_tokens: int
    checkpoint_id: str = ""
    payload_crc: int = 0
    tokens_digest: str = ""
    delta: bool = False
    line: str = ""
    kind: int = KIND_MANUAL
    #: files of its chain, itself included (what a restore reads: ChainPolicy.max_files)
    depth: int = 1
    #: its tokens, when at hand (a file written, or read back): what a cut on it is checked against
    tokens: np.ndarray | None = field(default=None, compare=False, repr=False)
    #: where a delta's cells start (its parent's end, or a cut); 0 for a full file
    parent_n_tokens: int = 0
    #: turn ends of files it absorbed (engine.history.LineWriter._absorbed), each the state
    #: after a first number of messages (engine.checkpoints.points)
    points: tuple[Point, ...] = field(default=(), compare=False, repr=False)
    #: its conversation's messages when it ends a turn (no answer paused), for the files
    #: this process wrote: what a later head that absorbs it checks and records as a point
    turn_messages: tuple | None = field(default=None, compare=False, repr=False)
    #: for a memory with a recurrent part, a file that ends a turn (``turn_messages``): the
    #: recurrent part of the state at its end, which its point carries when a later head
    #: absorbs it (engine.checkpoints.points)
    point_state: np.ndarray | None = field(default=None, compare=False, repr=False)

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether the file holds exactly ``tokens`` (a cache, a conversation): nothing to save."""
        return self.n_tokens == len(tokens) and self.tokens_digest == tokens_digest(tokens)

    @classmethod
    def of_file(cls, data: CheckpointData) -> SaveInfo:
        """What a writer needs to know of a file it did not write (a restored chain's)."""
        h = data.header
        cid = data.meta.get("checkpoint_id")
        held = data.tokens[:h.n_tokens]
        return cls(path=data.path, size=h.file_len, seconds=0.0, n_tokens=h.n_tokens,
                   checkpoint_id=cid if isinstance(cid, str) else "", payload_crc=data.payload_crc,
                   tokens_digest=tokens_digest(held), delta=h.is_delta,
                   line=line_of(data.meta, h), kind=h.kind, tokens=held,
                   parent_n_tokens=h.parent_n_tokens if h.is_delta else 0)


class Runtime:
    """A model, one context over it, and what that context's KV cache holds."""

    def __init__(self, model_path: str | os.PathLike, settings: ContextSettings = ContextSettings(),
                 *, n_gpu_layers: int = 0, main_gpu: int = 0,
                 progress: ProgressCallback | None = None, workers: Workers | None = None) -> None:
        # workers (native.rpc): layers, and so KV cells, on remote machines; the state and
        # checkpoints read the same whichever machine holds them
        self.model = Model(model_path, n_gpu_layers=n_gpu_layers, main_gpu=main_gpu, progress=progress,
                           workers=workers)
        try:
            self.fingerprint = model_fingerprint(self.model.path)
            self.shape = runtime_shape(self.model)
            self.ctx = Context(self.model, settings)
        except BaseException:
            self.model.close()
            raise
        self.settings = settings
        self.kv_tokens: list[int] = []
        self._logits_len = -1                     # KV length the logits belong to
        self._logits_copy: np.ndarray | None = None  # None: read them live from the context
        # the logits came from decoding the last token alone (a generated token): then a
        # plain attention memory gives them again by decoding it again (see save)
        self._logits_alone = False
        # logits at the end of the last prefill, with the digest of the tokens they follow:
        # Regenerate trims back to there and samples again without re-decoding
        self._prompt_logits: tuple[int, str, np.ndarray] | None = None
        # with a recurrent memory, the state there and at the prompts' marks too
        # (engine.snapshots): it cannot trim
        self._snapshots = Shelf()
        # where a sliding window's tail can be dropped exactly (engine.snapshots)
        self._window = WindowCover(self.shape.n_swa)
        self._state_buffer: np.ndarray | None = None  # reused by every save (_state_bytes)
        #: seconds the last restore_chain took (structure checks + setting the state)
        self.last_restore_s = 0.0
        prepare_to_load()

    def close(self) -> None:
        self._state_buffer = None
        self.ctx.close()
        self.model.close()

    @functools.cached_property
    def candidates(self) -> Candidates:
        """The sampler's candidate array over this model's vocabulary, reused every token."""
        return Candidates(self.ctx.n_vocab)

    @functools.cached_property
    def eog_ids(self) -> np.ndarray:
        """Ids of the end-of-generation tokens (scanned once: n_vocab native calls)."""
        return np.array([t for t in range(self.ctx.n_vocab) if self.model.is_eog(t)], dtype=np.int64)

    # -- logits bookkeeping ----------------------------------------------------------------
    def has_logits(self) -> bool:
        return self._logits_len == len(self.kv_tokens) and len(self.kv_tokens) > 0

    def logits(self) -> np.ndarray:
        """Next-token logits after ``kv_tokens`` (a view; valid until the next decode)."""
        if not self.has_logits():
            raise GenerationError("no logits for the current position")
        return self._logits_copy if self._logits_copy is not None else self.ctx.logits_last()

    def _set_live_logits(self, *, alone: bool) -> None:
        self._logits_len = len(self.kv_tokens)
        self._logits_copy = None
        self._logits_alone = alone

    def _forget_logits(self) -> None:
        self._logits_len = -1
        self._logits_copy = None
        self._logits_alone = False

    def logits_worth_saving(self, kind: int, paused: bool) -> bool:
        """Whether a checkpoint of ``kind`` must carry the cache's logits (logits_rule)."""
        return logits_rule(kind, paused, self.has_logits(), self._logits_alone, self.shape)

    # -- bringing tokens into the cache ----------------------------------------------------
    def trim(self, n: int, point: Point | None = None) -> int:
        """Keep only the first ``n`` cached tokens; returns how many were kept.

        A memory that cannot drop a tail (sliding window past its window, recurrent) is
        cleared, unless a recurrent memory has a snapshot at or before ``n`` (the end of the
        last prompt, or one of its marks: engine.snapshots): it goes back to the nearest one,
        and fewer than ``n`` tokens may be kept; or ``point``, a point at ``n`` of the file
        just restored, whose recurrent state is put back (engine.checkpoints.points).  A
        sliding window restored from a file holds only the window before the file's end: it
        is cut at most where the window before the cut is whole
        (engine.snapshots.WindowCover), which may be fewer than ``n``.
        """
        if n >= len(self.kv_tokens):
            return len(self.kv_tokens)
        cut = self._window.nearest_cut(n)   # a sliding window: where what stays is whole
        if cut > 0 and self.ctx.seq_rm(0, cut, -1):
            del self.kv_tokens[cut:]
            self._window.cut(cut)
        elif (snapshot := point_or_nearest(self._snapshots, self.kv_tokens, n, point, self.shape.n_layer,
                                           self.target.recurrent_rows)) is not None \
                and snapshot.put_back(self.ctx, 0):
            del self.kv_tokens[snapshot.n_tokens:]
            self._window.cut(snapshot.n_tokens)
            if (logits := snapshot.logits_now()) is not None:
                self._logits_len, self._logits_copy, self._logits_alone = snapshot.n_tokens, logits, False
                return snapshot.n_tokens
        else:
            self.ctx.clear()
            self.kv_tokens.clear()
            self._window.clear()
        saved = self._prompt_logits
        if saved and saved[0] == len(self.kv_tokens) and saved[1] == tokens_digest(self.kv_tokens):
            self._logits_len, self._logits_copy, self._logits_alone = saved[0], saved[2], False
        else:
            self._forget_logits()
        return len(self.kv_tokens)

    def recurrent_part(self) -> np.ndarray | None:
        """The recurrent part of the cache's state now, as a point carries it
        (engine.checkpoints.points); None where the memory has none or llama.cpp cannot give it."""
        return recurrent_part(self.ctx, 0) if self.shape.has_recurrent else None

    def state_sizes(self) -> tuple[int, int]:
        """Bytes of the cache's state now, and of its recurrent part (engine.snapshots.state_sizes)."""
        return state_sizes(self.ctx, 0, self.shape.has_recurrent)

    def prefill(self, tokens: Sequence[int], *, should_stop: Callable[[], bool] = lambda: False,
                on_progress: Callable[[int, int], None] | None = None, marks: Sequence[int] = (),
                on_mark: Callable[[int], None] | None = None) -> PrefillReport:
        """Make the cache hold exactly ``tokens`` with logits for the last one.

        Decodes only the part not already cached, in chunks aligned to absolute
        multiples of the batch size, so an interrupted prefill resumed later splits the
        work exactly as an uninterrupted one would.  Stops early (``aborted``) when
        ``should_stop`` turns true; the abort callback also interrupts a running chunk,
        except for recurrent and hybrid memories (Model.can_abort_mid_batch).  A recurrent
        memory (and a sliding window: a shared prefix's end) also cuts a chunk at each
        of ``marks``, the recurrent one keeping a snapshot there
        (engine.snapshots), then calls ``on_mark`` with the position (an autosave: the chain
        then has a file there, which a restore in a new process turns into a snapshot again).
        """
        started = time.perf_counter()
        total = len(tokens)
        if total > self.ctx.n_ctx:
            raise GenerationError(f"the prompt has {total} tokens; the context holds {self.ctx.n_ctx}")
        keep = self.trim(common_prefix(self.kv_tokens, tokens))
        if keep == total and not self.has_logits() and total > 0:
            keep = self.trim(total - 1)  # the last token must be decoded again for its logits
        report = PrefillReport(n_prompt=total, n_reused=keep)
        self.ctx.clear_abort()  # a stale request from an earlier run must not cut this one
        step = self.settings.n_batch
        marks = marks if self.shape.has_recurrent or self.shape.prefix_from_window else ()
        pos = keep
        chunk: Sequence[int] = ()
        while pos < total:
            if should_stop():
                report.aborted = True
                break
            end = chunk_end(pos, total, step, marks)
            chunk = tokens[pos:end]
            rc = self.ctx.decode(chunk, pos, logits_last=end == total, abortable=True,
                                 should_abort=should_stop)
            if rc == DECODE_ABORTED:
                done = self.ctx.pos_max() + 1
                self.kv_tokens.extend(tokens[pos:done])
                self._window.decoded(pos, done)
                self._forget_logits()
                report.aborted = True
                report.n_decoded += done - pos
                break
            self.kv_tokens.extend(chunk)
            self._window.decoded(pos, end)
            report.n_decoded += len(chunk)
            pos = end
            if end in marks and end < total:
                self.keep_snapshot(self.kv_tokens)
                if on_mark is not None:
                    on_mark(end)
            if on_progress:
                on_progress(pos, total)
        self.ctx.clear_abort()
        if not report.aborted and report.n_decoded:
            self._set_live_logits(alone=len(chunk) == 1)
            self._prompt_logits = (len(self.kv_tokens), tokens_digest(self.kv_tokens),
                                   self.ctx.logits_last().copy())
            self.keep_snapshot(self.kv_tokens, self._prompt_logits[2])
        report.seconds = time.perf_counter() - started
        return report

    def keep_snapshot(self, tokens: Sequence[int], logits: np.ndarray | None = None) -> None:
        """A recurrent memory keeps the cache's state now, holding ``tokens`` (with ``logits``
        after them, if known), to go back to (engine.snapshots); other memories trim."""
        if self.shape.has_recurrent:
            self._snapshots.add(PromptSnapshot.take(self.ctx, 0, tokens, logits,
                                                    recurrent_only=self.shape.snapshot_recurrent_only), tokens)

    def keep_step_snapshot(self) -> None:
        """A recurrent memory keeps its state now, before the token an autosave will end
        with (Shelf.keep_step): that autosave is then written one token short."""
        if self.shape.has_recurrent:
            self._snapshots.keep_step(PromptSnapshot.take(
                self.ctx, 0, self.kv_tokens, None, recurrent_only=self.shape.snapshot_recurrent_only))

    def logits_decoded_alone(self) -> bool:
        """Whether the current logits came from decoding the last token alone."""
        return self.has_logits() and self._logits_alone

    def decode_token(self, token: int) -> None:
        """Append one sampled token to the cache; its logits become current."""
        if len(self.kv_tokens) >= self.ctx.n_ctx:
            raise GenerationError("the context is full")
        self.ctx.decode((token,), len(self.kv_tokens), logits_last=True, abortable=False)
        self.kv_tokens.append(token)
        self._window.decoded(len(self.kv_tokens) - 1, len(self.kv_tokens))
        self._set_live_logits(alone=True)

    # -- compatibility ---------------------------------------------------------------------
    def header_for(self, conv: Conversation, kind: int, n_tokens: int | None = None) -> Header:
        shape = self.shape
        s = self.settings
        n_generated = conv.answer.n_generated if conv.answer else 0
        return Header(
            model_fingerprint=self.fingerprint, model_size=self.model.size_bytes,
            n_vocab=shape.n_vocab, n_layer=shape.n_layer, n_head_kv=shape.n_head_kv,
            n_embd_head_k=shape.n_embd_head_k, n_embd_head_v=shape.n_embd_head_v,
            n_swa=shape.n_swa, n_ctx=self.ctx.n_ctx, type_k=s.type_k, type_v=s.type_v,
            flash_attn=s.flash_attn, kv_unified=s.kv_unified, n_seq_max=s.n_seq_max,
            n_tokens=len(self.kv_tokens) if n_tokens is None else n_tokens, n_tokens_total=len(conv.tokens),
            n_generated=n_generated, created_unix_ns=time.time_ns(), conversation_id=conv.id,
            library=loaded_library().identity, title=conv.title, kind=kind, memory=shape.memory,
            flags=FLAG_CELL_EXT if shape.cell_ext else 0)

    @functools.cached_property
    def target(self) -> Target:
        """This model and context, as engine.checkpoints.compat compares checkpoints with."""
        return Target(ModelIdentity.of(self.model.name, self.fingerprint, self.shape),
                      ContextShape.of(self.settings, self.ctx.n_ctx))

    def check_compatible(self, header: Header, meta: dict | None = None) -> None:
        """Raise IncompatibleModel / IncompatibleContext with the reason, or return."""
        self.target.check(header, meta)

    # -- checkpoints -----------------------------------------------------------------------
    def metadata_for(self, conv: Conversation) -> dict:
        return {
            "format": "checkpoint-chat", "app_version": APP_VERSION,
            # the messages once: a reader's transcript is the conversation's (transcript_of)
            "title": conv.title, "conversation": conv.to_json(),
            # absolute: a later run from another folder finds it (engine.models.model_for_checkpoint)
            "model": {"name": self.model.name, "path": os.path.abspath(self.model.path),
                      "architecture": self.model.architecture,
                      "fingerprint": self.fingerprint.hex()},
            "n_ctx": self.ctx.n_ctx, "n_threads": self.ctx.n_threads,
        }

    def _file_metadata(self, conv: Conversation, checkpoint_id: str, line: str, seq: int,
                       points: Sequence[Point]) -> dict:
        """A new file's metadata: the conversation's, and the file's place in the store."""
        meta = self.metadata_for(conv)
        meta["checkpoint_id"] = checkpoint_id
        meta["line"] = line
        if seq:
            meta["seq"] = seq
        if points:
            meta["points"] = metadata_of(points)
        return meta

    def save(self, path: str | os.PathLike, conv: Conversation, kind: int = KIND_MANUAL,
             parent: SaveInfo | None = None, *, line: str | None = None, seq: int = 0,
             fresh: bool = False, landing=None, upto: int | None = None,
             cut: int | None = None, points: Sequence[Point] = ()) -> SaveInfo:
        """Write ``conv`` and the KV cache to ``path`` atomically.

        With ``parent`` (an earlier save of this conversation whose tokens are still a
        prefix of the cache, in the same folder) only the cells after the parent's end
        are written: a delta.  It lands only if the parent is still there at the moment
        of the rename (SaveFailed otherwise: write a full checkpoint instead); when the
        parent already holds every cell, the delta holds none (metadata only).  ``line``
        and ``seq`` place the file in its line of history (engine.checkpoints.graph; by
        default the conversation's first line).  ``fresh``: ``path`` is a new name, and
        the save fails rather than replace a file that appeared there meanwhile.
        ``landing`` (engine.checkpoints.atomic.Landing): the bytes are written now, the
        fsync and the rename into place happen on its helper thread (an autosave).
        ``upto``: the file holds only the cache's first ``upto`` tokens (no logits), and
        ``conv`` is the conversation of those tokens: a shared prefix (engine.shared_prefix).
        An autosave of a recurrent memory is written one token short where it can be
        (:func:`saves_one_short`).  ``cut``: the delta builds on only the parent's first
        ``cut`` tokens, which the cache shares with it (the parent's SaveInfo holds its
        tokens; a plain attention memory: engine.checkpoints.chain.can_cut).
        ``points``: earlier turn ends the file holds, with their recurrent states for a
        memory with a recurrent part (engine.checkpoints.points; engine.history.LineWriter).
        """
        started = time.perf_counter()
        path = Path(path)
        short = upto is None and saves_one_short(self, conv, kind)
        if short:
            upto = len(self.kv_tokens) - 1
        n, p0 = _saved_span(self, conv, parent, upto, pending=int(short), cut=cut)
        kv = np.asarray(self.kv_tokens[:n], dtype=np.int32)   # (kept: a later cut is checked against them)
        checkpoint_id = uuid.uuid4().hex
        header = self.header_for(conv, kind, n)
        try:   # (before the metadata lists them)
            points = points_to_write(self.shape, points, header.n_layer, self.target.recurrent_rows)
        except CorruptState as exc:
            raise SaveFailed(f"a turn end's recurrent state could not be walked ({exc}); nothing was saved") from exc
        if parent is not None:
            header = replace(header, flags=header.flags | FLAG_DELTA, parent_n_tokens=p0)
        line = line or default_line(conv.id)
        meta_json = self._file_metadata(conv, checkpoint_id, line, seq, points)
        checks = []
        if parent is not None:
            if parent.path.parent.resolve() != path.parent.resolve():
                raise SaveFailed("a delta's parent must lie in the same folder")
            meta_json["parent"] = ParentRef(parent.path.name, parent.checkpoint_id,
                                            parent.payload_crc, parent.n_tokens).to_json()
            checks.append(functools.partial(_parent_still_there, parent))
        if fresh:
            checks.append(functools.partial(_name_still_free, path))
        # logits only where decoding the last token again would not give them exactly
        logits = (np.array(self.logits(), copy=True)
                  if upto is None and self.logits_worth_saving(kind, conv.paused) else None)
        if logits is not None:   # (a restore that does not use them reads them not)
            meta_json["logits_crc32"] = logits_crc(logits)
        state = self._state_bytes(p0, upto) if n > p0 else np.empty(0, dtype=np.uint8)
        tail_crc = self._walk_before_saving(header, state, meta_json) if n else None
        meta = encode_metadata(meta_json)
        precondition = (lambda: [check() for check in checks]) if checks else None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with atomic_write(path, precondition=precondition, landing=landing) as f:
                _, crc = write_sections(f, header, meta, np.asarray(conv.tokens, dtype=np.int32),
                                        logits, state, point_states=recurrent_parts(points),
                                        state_tail_crc=tail_crc)
                size = f.tell()
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise SaveFailed(f"could not save the checkpoint to {path}: {reason}; "
                             "any earlier checkpoint there is untouched") from exc
        return SaveInfo(path=path, size=size,
                        seconds=time.perf_counter() - started, n_tokens=n,
                        checkpoint_id=checkpoint_id, payload_crc=crc,
                        tokens_digest=tokens_digest(kv), delta=parent is not None,
                        line=line, kind=kind, depth=parent.depth + 1 if parent is not None else 1,
                        tokens=kv,
                        parent_n_tokens=p0 if parent is not None else 0, points=tuple(points))

    def _walk_before_saving(self, header: Header, state: np.ndarray, meta_json: dict) -> tuple[int, int] | None:
        """Walk a state about to be saved as a restore will, before a byte is written: never
        save what cannot load (SaveFailed).  Where it ends with a recurrent block, the block's
        length and CRC32 go into the metadata (a restore that does not set it neither reads nor
        checks it: engine.checkpoints.format, The file's own recurrent block); returns them."""
        try:
            layout = check_state_for(header, state, self.target.recurrent_rows)
        except CorruptState as exc:
            raise SaveFailed(f"this model's memory ({self.shape.memory_name}) gave a state that "
                             f"could not be loaded again ({exc}); nothing was saved") from exc
        if layout.recurrent is None or not len(state):
            return None
        own = meta_json["recurrent_block"] = recurrent_block_metadata(state, recurrent_block_len(layout))
        return own["crc32"], own["len"]

    def _state_bytes(self, p0: int, upto: int | None = None) -> np.ndarray:
        """Sequence 0's state, or only its cells at positions p0..upto-1.

        The bytes live in the runtime's state buffer, reused by every save (full or
        delta) and overwritten by the next one: use them before saving again.  A partial
        state is read through scratch sequence 1, which shares those cells (``seq_cp``
        adds a sequence id to cells; nothing is copied) and is dropped after; a prefix
        (p0 == 0) is then relabelled as sequence 0's, as a full file's state is.
        """
        seq = 0
        if upto is not None:   # a prefix, or a delta written one token short
            copy_prefix(self, 0, 1, upto, p0)
            seq = 1
        elif p0:
            self.ctx.seq_cp(0, 1, p0, -1)
            seq = 1
        try:
            size = self.ctx.state_size(seq)
            buf = self.state_buffer_for(size)
            try:
                state = buf[:self.ctx.state_get_into(buf, size, seq)]
            except StateError as exc:
                raise SaveFailed(str(exc)) from exc
            if seq and not p0:   # a prefix, read through the scratch sequence
                relabel_as(state, self, n_tokens=upto or 0, first_pos=0, source=seq, seq_id=0)
            return state
        finally:
            if seq:
                self.ctx.seq_rm(1, -1, -1)

    def snapshot_at(self, n: int) -> PromptSnapshot | None:
        """The recurrent state after exactly the cache's first ``n`` tokens, if kept and it
        can be had (one a restore left in its file is read now: engine.snapshots)."""
        return self._snapshots.at_had(self.kv_tokens, n)

    def window_whole_at(self, n: int) -> bool:
        """Whether a sliding window's cells before position ``n`` are all held (WindowCover)."""
        return self._window.can_cut(n)

    def prefix_state(self, n: int) -> np.ndarray:
        """The state of the cache's first ``n`` cells, as a file of them holds it (a view
        of the save buffer: valid until the next save)."""
        return self._state_bytes(0, n)

    def state_buffer_for(self, size: int) -> np.ndarray:
        """The state buffer, grown when ``size`` no longer fits.

        Reusing it spares every save the page faults of fresh memory.  It grows with an
        eighth of headroom, so a conversation that keeps growing (autosaves) seldom
        reallocates; pages never written are not resident.  np.empty, not
        bytearray(size): zero-filling hundreds of MB holds the GIL (~55 ms per 88 MB
        here) and freezes the UI thread; llama.cpp overwrites what it uses.
        """
        buf = self._state_buffer
        if buf is None or len(buf) < size:
            self._state_buffer = None   # the old one is freed before the new one is touched
            buf = self._state_buffer = np.empty(size + size // 8, dtype=np.uint8)
        return buf

    def release_state_buffer(self) -> None:
        """Give the save buffer's memory back (the next save allocates a new one)."""
        self._state_buffer = None

    def restore(self, data: CheckpointData) -> Conversation:
        """Put a verified checkpoint's state into the cache; returns its conversation."""
        return self.restore_chain([data])

    def restore_chain(self, chain: Sequence[CheckpointData]) -> Conversation:
        """Restore a full checkpoint followed by zero or more deltas on it.

        Files whose tokens the cache already holds are not applied again (the cache is
        trimmed to the last of them, where the memory can trim).  Everything is checked
        before llama.cpp sees a byte — every file's compatibility and state structure,
        and the links between them — so a refused file leaves the cache (and the
        conversation it belongs to) as it was.  Only if llama.cpp itself refuses a state
        that passed every check, or a large state's checksum, computed while llama.cpp
        copied it (load_chain's ``crc_later``), fails, is the cache emptied; the previous
        conversation then re-decodes its prompt the next time it is used.
        """
        started = time.perf_counter()
        try:
            return restore_into(_Slot(self), chain, self.target).conv
        finally:
            self.last_restore_s = time.perf_counter() - started


class _Slot:
    """A Runtime's sequence 0 as engine.restore changes one (scratch: sequence 1)."""
    seq, scratch = 0, 1

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.ctx = rt.ctx

    @property
    def tokens(self) -> list[int]:
        return self.rt.kv_tokens

    def trim(self, n: int) -> int:
        return self.rt.trim(n)

    def make_room(self, n_tokens: int) -> None:
        pass   # its own context: n_ctx was checked with the chain's compatibility

    def empty(self) -> None:
        self.ctx.clear(data=False)   # the cells are freed; what a restore sets, it overwrites
        self.rt.kv_tokens = []
        self.rt._window.clear()

    def applied(self, first: int, end: int) -> None:
        self.rt._window.restored(first, end)

    def forget_logits(self) -> None:
        self.rt._forget_logits()
        self.rt._prompt_logits = None
        self.rt._snapshots.clear()

    def passed(self, tokens: list[int], logits: np.ndarray | None) -> None:
        self.rt.keep_snapshot(tokens, logits)

    def keep(self, snapshot: PromptSnapshot) -> None:
        self.rt._snapshots.add(snapshot, self.rt.kv_tokens)

    def restored(self, tokens: list[int], logits: np.ndarray | None) -> None:
        self.rt.kv_tokens = tokens
        if logits is not None:
            self.rt._logits_len, self.rt._logits_copy, self.rt._logits_alone = len(tokens), logits, False


def runtime_shape(model: Model) -> ModelShape:
    """The loaded model's shape, read the one way (engine.model_shape) with llama.cpp's own
    answer for the memory kind."""
    try:
        shape = read_model_shape(model.path, memory=model.memory_kind, cell_ext=model.has_cell_ext)
    except (GGUFError, OSError) as exc:
        raise GenerationError(f"could not read the model's shape from {model.path}: {exc}") from exc
    if shape.n_vocab != model.shape.n_vocab or shape.n_layer != model.shape.n_layer:
        log.warning("the GGUF metadata of %s says %d tokens / %d layers, llama.cpp %d / %d",
                    model.path, shape.n_vocab, shape.n_layer, model.shape.n_vocab, model.shape.n_layer)
        shape = replace(shape, n_vocab=model.shape.n_vocab, n_layer=model.shape.n_layer)
    return shape


def _saved_span(rt, conv: Conversation, parent: SaveInfo | None, upto: int | None,
                pending: int = 0, cut: int | None = None) -> tuple[int, int]:
    """The positions a save of ``rt``'s cache writes, ``p0..n-1`` (p0: the parent's end, or
    the ``cut``; 0 for a full file), after checking that they belong to ``conv`` and build
    on ``parent`` (``pending``: tokens of ``conv`` after ``upto`` that the file leaves to be
    decoded)."""
    n = len(rt.kv_tokens)
    if upto is not None:
        if not 0 < upto <= n or len(conv.tokens) != upto + pending or not can_save_prefix(rt, upto):
            raise SaveFailed("a prefix of the cache is saved alone only where its state is held "
                             "whole (can_save_prefix), with the conversation of exactly those tokens")
        n = upto
    if list(conv.tokens[:n]) != rt.kv_tokens[:n]:
        raise SaveFailed("the KV cache does not hold this conversation; nothing was saved")
    if parent is None:
        return n, 0
    if cut is not None:
        p0 = cut
        if not (0 < p0 < parent.n_tokens and p0 <= n and rt.shape.cells_by_position
                and parent.tokens is not None
                and common_prefix(parent.tokens[:p0], rt.kv_tokens[:p0]) == p0):
            raise SaveFailed("the cache does not start with the first tokens of the parent it is cut from")
    else:
        p0 = parent.n_tokens
        if not 0 < p0 <= n or parent.tokens_digest != tokens_digest(rt.kv_tokens[:p0]):
            raise SaveFailed("the parent checkpoint is not a prefix of the cache")
    if not rt.settings.supports_deltas:
        raise SaveFailed("delta checkpoints need a unified KV cache with a scratch sequence "
                         "(n_seq_max >= 2, kv_unified)")
    return n, p0


def saves_one_short(rt, conv: Conversation, kind: int) -> bool:
    """Whether an autosave of ``rt`` is written one token short: its state before the
    cache's last token, that token in the file's token list still to be decoded, and no
    logits.

    A recurrent memory cannot decode its last token again, so its files carry the
    next-token logits (vocabulary x 4 bytes: 196 KB for a 49k vocabulary, 1 MB for
    Qwen3.5's 248k), which only resuming from the file would use.  Where that token was
    decoded alone (a generated one) and the state before it was kept
    (Runtime.keep_step_snapshot, just before it was decoded), resuming decodes it alone
    again: the same state and the same logits, bit for bit.  Only an autosave of an answer
    in progress: a pause or an exit is resumed from at once, a finished answer's logits
    serve a Continue."""
    n = len(rt.kv_tokens)
    return (kind == KIND_AUTOSAVE and rt.shape.has_recurrent and n >= 2
            and len(conv.tokens) == n and rt.logits_decoded_alone() and rt.snapshot_at(n - 1) is not None)


def can_save_prefix(rt, n: int) -> bool:
    """Whether ``rt``'s first ``n`` cache positions can be saved alone (a shared prefix):
    any range of a plain attention memory; a sliding window where the window before ``n``
    is whole (ModelShape.prefix_from_window); a recurrent or hybrid one only where a
    snapshot was kept (ModelShape.prefix_from_snapshot)."""
    shape = rt.shape
    if shape.cells_by_position or n == len(rt.kv_tokens):
        return True
    if shape.prefix_from_window:
        return rt.window_whole_at(n)
    return shape.prefix_from_snapshot and rt.snapshot_at(n) is not None


def copy_prefix(rt, source: int, scratch: int, n: int, p0: int = 0) -> None:
    """Make the empty ``scratch`` sequence hold ``source``'s state after its first ``n``
    tokens (its cells from position ``p0`` on: a delta).  The attention cells are shared
    (``seq_cp`` adds a sequence id; nothing is copied); a recurrent part exists only as
    it is now, so where ``n`` is not the end, the snapshot taken at ``n`` is put back into
    the scratch sequence (SaveFailed when there is none)."""
    rt.ctx.seq_cp(source, scratch, p0, n)
    if not rt.shape.has_recurrent or n == len(rt.kv_tokens):
        return
    snapshot = rt.snapshot_at(n) if rt.shape.prefix_from_snapshot else None
    if snapshot is None or not snapshot.put_back(rt.ctx, scratch):
        rt.ctx.seq_rm(scratch, -1, -1)
        raise SaveFailed(f"this model's memory keeps no state at position {n}; "
                         "the prefix was not saved alone")


def relabel_as(state: np.ndarray, rt, *, n_tokens: int, first_pos: int, source: int, seq_id: int) -> None:
    """Check a state read from sequence ``source`` of ``rt``'s context (positions
    ``first_pos..n_tokens-1``) and make it name sequence ``seq_id``, in place: what a file
    holds (0 for a full file or a prefix, 1 for a delta) whichever sequence it came from."""
    shape, s = rt.shape, rt.settings
    try:
        layout = check_state(state, n_tokens=n_tokens, n_ctx=rt.ctx.n_ctx, n_layer=shape.n_layer,
                             type_k=s.type_k, type_v=s.type_v, flash_attn=s.flash_attn,
                             n_head_kv=shape.n_head_kv, n_embd_head_k=shape.n_embd_head_k,
                             n_embd_head_v=shape.n_embd_head_v, first_pos=first_pos, seq_id=source,
                             memory=shape.memory, n_swa=shape.n_swa, cell_ext=shape.cell_ext,
                             recurrent_rows=rt.target.recurrent_rows)
    except CorruptState as exc:
        raise SaveFailed(f"llama.cpp wrote an unexpected state for sequence {source}: {exc}") from exc
    relabel_state(state, layout, seq_id)


def points_to_write(shape: ModelShape, points: Sequence[Point], n_layer: int,
                    recurrent_rows: tuple[int, ...] | None) -> list[Point]:
    """The points a file of this memory holds, their recurrent states checked against the CRC
    they came with (a file's: it is written again) and walked (CorruptState): a memory with a
    recurrent part reaches a point only through its recurrent state (one without is left
    out), an attention memory's points carry none (engine.checkpoints.points)."""
    if not shape.has_recurrent:
        return [replace(p, recurrent=None) for p in points]
    kept = []
    for point in points:
        if point.recurrent is not None:
            check_point_crc(point)
            check_recurrent_part(point.recurrent, point.n_tokens, n_layer, recurrent_rows)
            kept.append(point)
    return kept


def logits_rule(kind: int, paused: bool, has_logits: bool, alone: bool, shape: ModelShape) -> bool:
    """Whether a checkpoint carries the next-token logits: the one rule.

    A file generation resumes from — a pause, an exit, any save of a paused answer but
    an autosave — carries them, and resuming samples at once (nothing is decoded again).
    Any other file — an autosave (resumed from only after a crash), a finished answer
    (the next turn decodes new tokens after it) — carries none when decoding its last
    token again gives them bit for bit: the token was decoded alone (a generated one)
    and the memory is attention (ModelShape.logits_recomputable); whoever samples right
    after it decodes that one token.  Logits are vocabulary x 4 bytes (196 KB for
    SmolLM2, 1 MB for Gemma 3 or Qwen3.5), often more than a file's own cells.
    """
    if not has_logits:
        return False
    if not (alone and shape.logits_recomputable):
        return True
    return kind in (KIND_PAUSE, KIND_EXIT) or (paused and kind != KIND_AUTOSAVE)


def chunk_end(pos: int, total: int, step: int, marks: Sequence[int] = ()) -> int:
    """Where the prompt chunk that starts at ``pos`` ends: at the next absolute multiple
    of the batch size ``step``, or at the next of ``marks`` (a recurrent memory's
    snapshots), or at ``total``.  Every prefill cuts its chunks so, alone or beside other
    sequences, interrupted or not: a prompt's cache is then built from the same pieces
    whichever way it was decoded."""
    return min([total, (pos // step + 1) * step] + [m for m in marks if m > pos])


def _name_still_free(path: Path) -> None:
    """Cancel a rename onto a fresh name that another writer took meanwhile."""
    if path.exists():
        raise SaveFailed(f"{path.name} was written by another process meanwhile; nothing was saved")


def _parent_still_there(parent: SaveInfo) -> None:
    """Cancel a delta's rename when its parent was deleted or replaced meanwhile."""
    if stored_payload_crc(parent.path) != parent.payload_crc:
        raise SaveFailed(f"the parent checkpoint {parent.path.name} is gone; nothing was saved")
