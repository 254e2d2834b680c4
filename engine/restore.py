"""Restoring a checkpoint chain into one sequence of a context: the one way it is done.

A chain is a full checkpoint followed by zero or more deltas on it (engine.checkpoints.chain).
:func:`restore_into` puts one into a sequence, for the single-sequence
:class:`engine.runtime.Runtime` (sequence 0, scratch sequence 1) and for every sequence
of an :class:`engine.parallel.ParallelRuntime` (its own scratch sequence) alike; each
supplies a :class:`SequenceSlot`: what the sequence holds and how to change that.

1. **Check** every file before llama.cpp sees a byte (:func:`_checked`): each
   file's compatibility with the target and its state's structure (an earlier file's
   recurrent block the read left unread: its head, and its length against the model's
   rows; its rows only where it is set after all, :func:`_walk_blocks_set`), the links
   between them, the last file's conversation, and the logits it keeps (the last file's, a
   snapshot's: an earlier file's were left unread).  A refused chain leaves the sequence as
   it was.
   (A large state's checksum may still be running then, on another core: see
   :func:`restore_into`.)
2. **Keep** the files the sequence holds already (:func:`files_in_cache`): switching
   between branches of one conversation applies only what differs.  The sequence is
   trimmed to the last of them; a memory that cannot drop a tail (sliding window,
   recurrent) is restored whole instead.
3. **Apply** the rest: the base into the sequence, each delta through the scratch
   sequence, which shares its cells (``seq_cp``) and is emptied after (a delta cut from
   a parent that holds more drops the parent's cells from its start first).  A base with
   fewer cells than the next file (a shared system prompt's) waits in the scratch
   sequence instead, and that file goes into the sequence directly (:func:`_parks_base`).
   A recurrent memory keeps a snapshot (engine.snapshots) after each file that is the
   nearest below a point its conversation goes back to (the answer's prompt end and its
   marks: Regenerate, Edit, a thinking model's next turn), so those read only from there;
   where that snapshot is the recurrent part alone (a recurrent memory, a hybrid without a
   sliding window) it stays in its file, read (and checked against its CRC) only when it is
   used (:func:`_snapshot_of_file`, engine.checkpoints.file_bytes), as do the turn ends a
   head absorbed (:func:`_keep_points`), not copied out of llama.cpp.  Only the last file's recurrent
   state survives, so an earlier file's is not set (unless a snapshot is taken out of
   llama.cpp after it): a recurrent memory's earlier files are skipped, a hybrid's give
   their attention cells alone, set from the file's own mapping with an empty recurrent
   block written over the start of theirs in its private pages, put back after
   (:func:`_without_a_replaced_recurrent_state`; a file read by copying, or from before
   its metadata gave the block's CRC, copies its attention part out where the recurrent
   state is the larger part, and is set whole otherwise).  Nor is such a block checked where its
   file's metadata gives its CRC (load_chain leaves the ancestors' unchecked: 50 MB each at
   Qwen3.5-4B's widths): it is checked where it is set after all, or read to go back to
   (engine.checkpoints.format, The file's own recurrent block).  Nor are an earlier file's
   logits read, unless a snapshot taken out of llama.cpp after it keeps them (one kept in its
   file keeps them there too: format, Logits an earlier file holds).
4. **Verify** that the sequence holds the promised positions; the logits saved with
   the last file become the sequence's (no re-decode).

If llama.cpp itself refuses a state that passed every check, the sequence is emptied
(:class:`~engine.errors.RestoreFailed`); its conversation then re-decodes its prompt
the next time it is used.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from engine.checkpoints.chain import can_cut, check_link, common_prefix, read_logits, settle
from engine.checkpoints.compat import Target
from engine.checkpoints.format import MEMORY_RECURRENT, STATE_LAYOUT, CheckpointData
from engine.checkpoints.kvstate import (
    StateLayout,
    check_recurrent_claim,
    check_state_for,
    emptied_block,
    recurrent_block_len,
    recurrent_part_in_file,
)
from engine.checkpoints.points import Point, nearest_point, nearest_point_in_file
from engine.conversation import Conversation
from engine.errors import BrokenChain, CheckpointError, CorruptMetadata, CorruptState, RestoreFailed
from engine.snapshots import PromptSnapshot
from native.errors import StateError

log = logging.getLogger("engine")


class StateContext(Protocol):
    """The calls on a context (:class:`native.context.Context`) a restore makes."""

    def pos_max(self, seq: int) -> int:
        """Highest position held for ``seq`` (-1 when empty)."""

    def seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Remove positions [p0, p1) of ``seq``."""

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Let ``dst`` share ``src``'s cells in positions [p0, p1)."""

    def state_set_from(self, buffer: np.ndarray, size: int, seq: int) -> int:
        """Load ``seq``'s state from ``buffer``; raises StateError when refused."""


class SequenceSlot(Protocol):
    """One sequence of a context, as :func:`restore_into` changes it."""
    seq: int             # the sequence restored into
    scratch: int         # a sequence free for applying deltas

    @property
    def ctx(self) -> StateContext:
        """The context the sequence lives in."""

    @property
    def tokens(self) -> Sequence[int]:
        """The tokens the sequence holds now."""

    def trim(self, n: int) -> int:
        """Keep the first ``n`` tokens; returns how many were kept (0: it was emptied)."""

    def make_room(self, n_tokens: int) -> None:
        """Raise RestoreFailed when the context cannot hold ``n_tokens`` in this sequence."""

    def empty(self) -> None:
        """Drop every cell of the sequence, and what it knew of them."""

    def forget_logits(self) -> None: ...

    def applied(self, first: int, end: int) -> None:
        """A file's state of positions ``first..end-1`` was set into the sequence (a sliding
        window holds only its cells before ``end``: engine.snapshots.WindowCover)."""

    def passed(self, tokens: list[int], logits: np.ndarray | None) -> None:
        """The sequence holds ``tokens`` now, a file of the chain applied (``logits`` after
        them, None: none saved): a recurrent memory keeps a snapshot (engine.snapshots)."""

    def restored(self, tokens: list[int], logits: np.ndarray | None) -> None:
        """The sequence holds ``tokens`` now, with ``logits`` after them (None: none saved)."""

    def keep(self, snapshot: PromptSnapshot) -> None:
        """Keep ``snapshot`` of the restored sequence to go back to (a point of its last file)."""


@dataclass(frozen=True)
class Restored:
    """What :func:`restore_into` did."""
    conv: Conversation
    n_tokens: int        # tokens the sequence holds now
    n_restored: int      # of those, put there by this restore (the rest were held already)


def restore_into(slot: SequenceSlot, chain: Sequence[CheckpointData], target: Target) -> Restored:
    """Restore ``chain`` into ``slot``'s sequence (see the module docstring).

    A chain read with ``crc_later`` (engine.checkpoints.chain.load_chain) is settled here:
    its large states' checksums are computed while llama.cpp copies them, on another core,
    which is what a restore would otherwise spend on top of the copy.  llama.cpp only ever
    sees states whose structure was walked (every length, position and sequence id checked);
    when a checksum then fails, the sequence is emptied before anything is decoded from it or
    kept of it, and the restore fails with the reason as it would have before the copy.
    """
    try:
        restored, later = _restore(slot, chain, target)
    except Exception:   # (an interrupt stays an interrupt)
        settle(chain)   # a damaged file is the reason, whatever else it made go wrong
        raise
    try:
        settle(chain)
    except CheckpointError:
        slot.empty()
        slot.forget_logits()
        raise
    for data, layout in later:
        try:
            slot.keep(_snapshot_of_file(data, layout, target))
        except (CorruptState, MemoryError) as exc:   # (a walked state has its recurrent part)
            log.warning("no snapshot of %s (%r): going back there reads it again", data.path.name, exc)
    _keep_points(slot, chain, restored.conv, target)
    return restored


def _keep_points(slot: SequenceSlot, chain: Sequence[CheckpointData], conv: Conversation,
                 target: Target) -> None:
    """Of the chain's points (earlier turn ends its files absorbed, with their recurrent states:
    engine.checkpoints.points), keep as snapshots the nearest at or before each position the
    restored conversation goes back to (its answer's prompt end: Regenerate; the prompt's
    marks: an Edit), as the files of a chain are kept (``_files_to_go_back_to``): a memory with
    a recurrent part then goes back there without reading the turns again.  Each stays in its
    file until it is used (engine.checkpoints.file_bytes), checked against its own CRC then;
    a file whose points give no CRC has it copied out now (checked, after the chain settled),
    and a point whose state does not walk is left."""
    if not any(data.header.has_point_states for data in chain):
        return
    tokens, n_layer, rows = slot.tokens, chain[-1].header.n_layer, target.recurrent_rows
    chosen: dict[int, PromptSnapshot | Point] = {}
    for goal in _go_back_positions(conv):
        if (found := nearest_point_in_file(chain, goal)) is not None:
            chosen[found[0]] = PromptSnapshot.in_file(tokens, found[0], found[1], None, n_layer, rows)
        elif (nearest := nearest_point(chain, goal)) is not None:
            chosen[nearest.n_tokens] = nearest
    for _n, kept in sorted(chosen.items()):
        try:
            slot.keep(kept if isinstance(kept, PromptSnapshot) else
                      PromptSnapshot.of_point(tokens, replace(kept, recurrent=np.array(kept.recurrent)), n_layer, rows))
        except CorruptState as exc:
            log.warning("a turn end's recurrent state in %s is damaged (%s): not kept", chain[-1].path.name, exc)


def _snapshot_of_file(data: CheckpointData, layout: StateLayout, target: Target) -> PromptSnapshot:
    """The snapshot to go back to after a file of a memory whose snapshots hold its recurrent
    part alone (Header.recurrent_part_suffices): that part, left in the file (settled:
    checked; read when used, engine.checkpoints.file_bytes), with the file's logits, left
    there too where the read left them (an earlier file's: read with the state)."""
    n = data.header.n_tokens
    logits = data.logits_in_file() or (None if data.logits is None else np.array(data.logits, copy=True))
    return PromptSnapshot.in_file(data.tokens, n, recurrent_part_in_file(data, layout), logits,
                                  data.header.n_layer, target.recurrent_rows)


def _restore(slot: SequenceSlot, chain: Sequence[CheckpointData],
             target: Target) -> tuple[Restored, list[tuple[CheckpointData, StateLayout]]]:
    """The restore up to its checksums (:func:`restore_into`); and the files after which a
    snapshot is to be kept from the file itself once they settled (:func:`_snapshot_of_file`)."""
    conv, layouts = _checked(chain, target)
    snapshots = _files_to_go_back_to(chain, conv)
    # where the snapshot is the file's recurrent part alone (Header.recurrent_part_suffices), it is
    # taken from the file: llama.cpp would copy that part in and the snapshot copy it out again
    # (12.6 MB each way at Qwen3-Next's widths), and it need not be set where a later file replaces it
    in_files = {i for i in snapshots if (layout := layouts[i]) is not None and layout.recurrent is not None
                and chain[i].header.recurrent_part_suffices}
    whole = _set_whole(chain, snapshots - in_files, layouts)
    _walk_blocks_set(chain, whole, layouts, target.recurrent_rows)
    last = chain[-1]
    n = last.header.n_tokens
    keep = files_in_cache(slot.tokens, chain)
    _read_logits_kept(chain, snapshots - in_files, keep)
    kept = used_end(chain, keep - 1) if keep else 0
    if keep and slot.trim(kept) != kept:
        keep, kept = 0, 0   # the memory cannot drop a tail (sliding window): restore it all
        _read_logits_kept(chain, snapshots - in_files, 0)
    slot.make_room(peak_tokens(chain, keep))
    if not keep:
        slot.empty()
    slot.forget_logits()
    _apply(slot, chain, keep, snapshots - in_files, whole, layouts)
    if n and slot.ctx.pos_max(slot.seq) != n - 1:
        slot.empty()
        raise RestoreFailed("the restored state does not hold the promised tokens")
    slot.restored(last.tokens[:n].tolist(), last.logits)
    return Restored(conv, n, n - kept), [(chain[i], layout) for i in sorted(in_files)
                                         if i >= keep and (layout := layouts[i]) is not None]


def _read_logits_kept(chain: Sequence[CheckpointData], snapshots: set[int], keep: int) -> None:
    """Read the logits the restore keeps where the read left them in their files (an earlier
    file's: engine.checkpoints.format, Logits an earlier file holds): the last file's (a chain
    restored up to an earlier file ends with one) and, for a memory with a recurrent part (the
    only one that keeps snapshots: Runtime.keep_snapshot), those of the files after which it
    takes one out of llama.cpp (``snapshots``), of the files it applies (``chain[keep:]``).  A
    snapshot kept in its file keeps its logits there too (:func:`_snapshot_of_file`)."""
    kept = snapshots if chain[-1].header.has_recurrent else set()
    for i in sorted({i for i in kept if i >= keep} | {len(chain) - 1}):
        read_logits(chain, i)


def _go_back_positions(conv: Conversation) -> tuple[int, ...]:
    """Where ``conv`` goes back to: its answer's prompt end (Regenerate) and the prompt's
    marks (Answer.marks: an Edit of the user's turn)."""
    answer = conv.answer
    return (answer.n_prompt_tokens, *answer.marks) if answer is not None else ()


def _files_to_go_back_to(chain: Sequence[CheckpointData], conv: Conversation) -> set[int]:
    """Indexes of the files of ``chain`` that are the last at or before each position
    ``conv`` goes back to (:func:`_go_back_positions`)."""
    found = set()
    for point in _go_back_positions(conv):
        below = [i for i, data in enumerate(chain) if 0 < data.header.n_tokens <= point]
        if below:
            found.add(below[-1])
    return found


def _apply(slot: SequenceSlot, chain: Sequence[CheckpointData], keep: int, snapshots: set[int],
           whole: set[int], layouts: Sequence[StateLayout | None]) -> None:
    """Set the states of ``chain[keep:]`` into the slot's sequence, those of ``whole`` as they
    are, the others without their recurrent state (:func:`_set_whole`); after each file of
    ``snapshots``, the slot keeps a snapshot (SequenceSlot.passed).  ``layouts``: each
    file's walk (:func:`_checked`)."""
    ctx, scratch_used = slot.ctx, False
    parked = _parks_base(chain, keep)
    direct = 1 if parked else 0   # the file set into the sequence itself; the others pass the scratch one
    try:
        for i, data in enumerate(chain):
            if i < keep:
                continue   # in the cache already
            if i and data.header.parent_n_tokens < chain[i - 1].header.n_tokens:
                # a cut (engine.checkpoints.chain.can_cut): the delta builds on the parent's
                # first tokens only; its cells from there on go (a parked base's, where it waits)
                ctx.seq_rm(slot.scratch if parked and i == 1 else slot.seq, data.header.parent_n_tokens, -1)
            try:
                state = data.state if i in whole else _without_a_replaced_recurrent_state(data, layouts[i])
                if not len(state):
                    continue   # no cells (empty, metadata only, or a recurrent state a later file replaces)
                if state is data.state:
                    data.check_recurrent_later()   # set with its recurrent block: checked (restore_into settles)
                scratch_used = scratch_used or i != direct
                ctx.state_set_from(state, len(state), slot.seq if i == direct else slot.scratch)
            finally:
                data.put_back_tail()   # (where the attention part was set in place)
            if i and (i != direct or parked):
                # the scratch sequence's cells (this delta's, or the parked base's) join the
                # sequence: it shares them (seq_cp) and lets go of them
                ctx.seq_cp(slot.scratch, slot.seq, -1, -1)
                ctx.seq_rm(slot.scratch, -1, -1)
            slot.applied(data.header.parent_n_tokens if i else 0, data.header.n_tokens)
            if i in snapshots:
                slot.passed(data.tokens[:data.header.n_tokens].tolist(), data.logits)
    except BaseException as exc:   # llama.cpp's refusal; a read error of a page written over; an interrupt
        slot.empty()
        # and the snapshots kept after the files before it: a large file's checksum may
        # still be running (restore_into), nothing of it may stay
        slot.forget_logits()
        if scratch_used:
            ctx.seq_rm(slot.scratch, -1, -1)
        # neither this frame nor the native call's, which the error's traceback keeps, may
        # hold a view of the file's mapping while the caller lets the file go (CheckpointData.release)
        state = data.state[:0]
        if not isinstance(exc, StateError):
            raise
        raise RestoreFailed(f"llama.cpp refused the checkpoint's state: {exc}") from exc.with_traceback(None)


#: where a hybrid file's attention part cannot be set in place (CheckpointData.state_with_tail:
#: a copying read, a file from before its metadata gave the block's CRC), it is copied out
#: to be set without its recurrent state only where that state is this many times larger:
#: the copy lands in fresh memory, whose page faults cost about three times the copy itself
#: (a 2-core VM: 9.5 ms against 2.3 ms for 17.7 MB), against llama.cpp's one copy of the
#: recurrent state it no longer makes
ATTENTION_COPY_FACTOR = 4


def _set_whole(chain: Sequence[CheckpointData], snapshots: set[int],
               layouts: Sequence[StateLayout | None]) -> set[int]:
    """The files whose state is set as it is, its recurrent block with it: the one whose
    recurrent state survives the chain (the last that has a state: a delta of metadata only
    may follow it, an import's head, a pause where an autosave had just been written), those
    after which a snapshot is taken from llama.cpp (``snapshots``), and any without a
    recurrent block to leave out (an attention memory's).  Any other recurrent state is
    replaced whole by the next file's, so a recurrent memory's file sets nothing, and a
    hybrid's its attention part alone (:func:`_without_a_replaced_recurrent_state`): in
    place, or, where it must be copied, only where the recurrent part is the larger (a gated
    delta-net's: 12.6 MB at Qwen3-Next's widths, against ~0.5 KB a token of attention cells)."""
    last = max((i for i, data in enumerate(chain) if len(data.state)), default=-1)
    whole = set()
    for i, (data, layout) in enumerate(zip(chain, layouts, strict=True)):
        if i == last or i in snapshots or layout is None or layout.recurrent is None:
            whole.add(i)
        elif data.header.memory != MEMORY_RECURRENT and not data.sets_tail_in_place():
            block = recurrent_block_len(layout)
            if ATTENTION_COPY_FACTOR * (len(data.state) - block) >= block:
                whole.add(i)
    return whole


def _without_a_replaced_recurrent_state(data: CheckpointData, layout: StateLayout | None) -> np.ndarray:
    """The bytes to set of a file that is not set whole (:func:`_set_whole`): none for a
    recurrent memory; a hybrid's attention part (kvstate.emptied_block), in place where it
    can be (the caller puts the file's bytes back: CheckpointData.put_back_tail), else a copy."""
    if data.header.memory == MEMORY_RECURRENT or layout is None:   # (None: a file of no cells)
        return data.state[:0]
    cut, empty = emptied_block(len(data.state), layout, data.header.n_layer)
    in_place = data.state_with_tail(cut, empty)
    return in_place if in_place is not None else np.concatenate((data.state[:cut], np.frombuffer(empty, np.uint8)))


def _walk_blocks_set(chain: Sequence[CheckpointData], whole: set[int],
                     layouts: list[StateLayout | None], rows: tuple[int, ...] | None) -> None:
    """Walk, before anything is set, the recurrent block of each file set whole whose walk
    left it unread (:func:`_walked`): llama.cpp sees no state whose structure is unchecked."""
    for i in whole:
        if (layout := layouts[i]) is not None and not layout.block_walked:
            layouts[i] = _walked(chain[i], rows, whole=True)


def _parks_base(chain: Sequence[CheckpointData], keep: int) -> bool:
    """Whether the chain's base waits in the scratch sequence while the next file, which holds
    more cells, goes into the empty sequence directly: each file after the first passes
    through the scratch sequence, and llama.cpp's ``seq_cp`` and ``seq_rm`` of it cost
    ~0.1 µs per cell (a conversation on a shared system prompt: the prompt's file is the
    smaller).  The cells land where they would otherwise (the base's below), so the cache
    is the same.  Only a plain attention memory without a sliding window, whose cells at
    each position are the same whatever order they are set in (can_cut)."""
    if keep or len(chain) < 2 or not len(chain[0].state) or not len(chain[1].state):
        return False
    base, nxt = chain[0].header, chain[1].header
    return can_cut(base) and can_cut(nxt) and nxt.n_tokens - nxt.parent_n_tokens > used_end(chain, 0)


def files_in_cache(cached: Sequence[int], chain: Sequence[CheckpointData]) -> int:
    """How many leading files of ``chain`` a cache holding ``cached`` holds already,
    token for token.

    Switching between branches of one conversation restores only what differs: the
    shared files stay in the cache and only the rest of the chain is applied.
    """
    last = chain[-1]
    shared = common_prefix(cached, last.tokens[:last.header.n_tokens])
    for k in range(len(chain), 0, -1):
        if 0 < used_end(chain, k - 1) <= shared:
            return k
    return 0


def peak_tokens(chain: Sequence[CheckpointData], keep: int = 0) -> int:
    """The most tokens the sequence holds while ``chain[keep:]`` is applied: the last
    file's, or a parent's that a cut (engine.checkpoints.chain.can_cut) drops a tail of."""
    return max((d.header.n_tokens for d in chain[keep:]), default=chain[-1].header.n_tokens)


def used_end(chain: Sequence[CheckpointData], i: int) -> int:
    """How many of ``chain[i]``'s tokens the chain's last file holds: all of them, or, when
    the next file is a cut (engine.checkpoints.chain.can_cut), as many as it builds on."""
    held = chain[i].header.n_tokens
    return min(held, chain[i + 1].header.parent_n_tokens) if i + 1 < len(chain) else held


def _checked(chain: Sequence[CheckpointData], target: Target) -> tuple[Conversation, list[StateLayout | None]]:
    """Check a chain (a full checkpoint, then deltas on it) before llama.cpp sees a byte:
    every file's compatibility with ``target`` and state structure (:func:`_walked`: an
    earlier file's unread recurrent block is walked whole only where it is set,
    :func:`_walk_blocks_set`), the links between them, the last file's conversation.
    Returns that conversation and each file's walk (None: a file of no tokens), or raises
    with the reason."""
    if not chain:
        raise BrokenChain("no checkpoint to restore")
    if chain[0].header.is_delta:
        raise BrokenChain("the chain does not start with a full checkpoint")
    if any(data.released for data in chain):   # a caller's mistake, not the file's
        raise ValueError("a checkpoint released after its restore is restored again: read it again")
    rows = target.recurrent_rows
    layouts: list[StateLayout | None] = []
    for data in chain:
        target.check(data.header, data.meta)
        layouts.append(_walked(data, rows) if data.header.n_tokens else None)
    for prev, data in zip(chain, chain[1:], strict=False):   # each link with the one before
        check_link(prev, data)
    return _conversation_of(chain[-1]), layouts


def _walked(data: CheckpointData, rows: tuple[int, ...] | None, whole: bool = False) -> StateLayout:
    """The walk of a file's state (kvstate.check_state_for).  Where the read left the file's
    recurrent block unchecked (CheckpointData.unread_recurrent), the walk reads its head alone
    where the model's rows give its length (an earlier file's block is not set: its rows are
    walked only where it is, ``whole``: :func:`_walk_blocks_set`); a refusal of a walk that
    read bytes of it has the block checked, so that damage is named as the reason
    (restore_into settles); and the block the metadata vouches for must be the one the state
    ends with, or bytes set into llama.cpp would have gone unchecked."""
    unread = data.unread_recurrent[1] if data.unread_recurrent is not None and not whole else 0
    try:
        layout = check_state_for(data.header, data.state, rows, unread)
    except CorruptState:
        data.check_recurrent_later()
        raise
    check_recurrent_claim(data.unread_recurrent, layout)
    return layout


def text_of_chain(chain: Sequence[CheckpointData], target: Target) -> Conversation:
    """The conversation of a chain whose states this llama.cpp cannot take (written in another
    llama.cpp state layout: IncompatibleState), to be read again from its tokens.

    Checked as :func:`checked_chain` checks, but for the state layout and the states' own
    structure: the states are not used.  Another model or context is still refused."""
    if not chain:
        raise BrokenChain("no checkpoint to restore")
    settle(chain)
    for data in chain:
        target.check(replace(data.header, state_layout=STATE_LAYOUT), data.meta)
    for prev, data in zip(chain, chain[1:], strict=False):
        check_link(prev, data)
    return _conversation_of(chain[-1])


def _conversation_of(last: CheckpointData) -> Conversation:
    conv_json = last.meta.get("conversation")
    try:
        conv = Conversation.from_json(conv_json if isinstance(conv_json, dict) else {},
                                      last.tokens.tolist())
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise CorruptMetadata(f"the conversation in the metadata block is malformed: {exc}") from None
    conv.id = last.header.conversation_id
    return conv
