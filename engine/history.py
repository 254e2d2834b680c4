"""Writing one line of a conversation's history into the store: autosaves and heads.

A :class:`LineWriter` belongs to the thread that owns the Runtime.  It knows the *live
chain*: the files on disk, base first, whose KV states are prefixes of what the cache
holds now.  Every save, autosave or head (pause, exit, a finished answer), goes on top
of it:

* a **delta**: an autosave on a file of the live chain that is still a prefix of the
  cache, so it costs the tokens since that file, not the whole context: the newest one,
  unless it absorbs the answer's newest autosaves, those that hold no more tokens of their
  own than it will (tiers: a crash leaves O(log n) of them, :meth:`LineWriter._tier_below`);
  a head on
  the last *anchor* (a head, the answer's prompt), folding the answer's autosaves into
  it, so every turn's end stays in the chain (see :meth:`LineWriter._parent_index`); a
  head that ends a turn absorbs the turns before it too, their ends recorded as points,
  so a conversation restores from one file up to 32 MiB, beyond that from files whose
  sizes double downwards (tiers: O(log n) files) (:meth:`LineWriter._absorbed_by_head`;
  a recurrent or hybrid memory's points carry their recurrent states; an attention
  memory's pause may merge its parent so instead, :meth:`LineWriter._merge_below`); when
  the cache was trimmed
  (Regenerate), the delta goes on the file before the trimmed part, and when nothing new
  was decoded (a pause before the first token, a rename) the delta holds no cells at all;
* a **full file** (a new chain) when nothing on disk is a prefix, when the chain holds
  :class:`ChainPolicy`'s number of files, or when the delta's parent disappeared
  meanwhile.

Each file gets the next sequence number of its line, so the file just written is the
line's newest node and so its head (engine.checkpoints.graph) whatever the clock says;
what that supersedes (a chain replaced by a compaction, the autosaves an autosave or a
head absorbed, the tail cut by a trim, a crash's leftovers of the same line) is retired
only after the new file is durable, so a
crash at any moment leaves a restorable head.

One writer per line: a writer holds its line's lease (``Store.lease_line``) while it
lives.  Continuing a chain whose line another writer holds — the window and a CLI run
on one conversation, two windows — or continuing a file that is not its line's head,
or a copy, starts a new line (a branch) instead, so no writer ever retires another's
newer history.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from engine.checkpoints import graph
from engine.checkpoints.atomic import Landing
from engine.checkpoints.chain import common_prefix, settle, tokens_digest
from engine.checkpoints.format import KIND_AUTOSAVE, LIMITS, CheckpointData, read_metadata
from engine.checkpoints.graph import Graph, line_of
from engine.checkpoints.points import Point, points_read_from
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import CheckpointError, SaveFailed
from engine.model_shape import ModelShape
from engine.runtime import SaveInfo
from engine.shared_prefix import shared_base, system_prompt_end
from engine.snapshots import PromptSnapshot, point_state
from native.context import ContextSettings

log = logging.getLogger("engine")

#: a cut (LineWriter._cut) must spare writing at least this many tokens' cells again
MIN_CUT_GAIN = 64


@dataclass(frozen=True)
class ChainPolicy:
    """The shape of a line's chain: milestones, autosaves between them, and its length."""
    #: files after the last milestone before the next autosave is folded onto it (with
    #: ``tier_autosaves`` the tail holds popcount(k) files after k autosaves: reached only
    #: past 65,535 autosaves)
    max_tail: int = 16
    #: files in one chain (each is read, verified and applied on restore); past this the
    #: next save is one full file (the turn ends before it are then gone)
    max_files: int = 128
    #: a head (pause, finished answer, exit) goes on the last anchor, folding the answer's
    #: autosaves into it (False: on the newest file, as before 2026-12-03; for benchmarks)
    fold_heads: bool = True
    #: a prefill of at least this many tokens is saved before the answer's first token
    #: (engine.generation: checkpoint_prompt): a crash keeps it, and a regenerated answer
    #: stores only its own cells on top of it
    prompt_checkpoint: int = 256
    #: a head that ends a turn absorbs the turns before it (LineWriter._absorbed_by_head), so
    #: a conversation restores from one file up to ``merge_max_bytes``, and from files of
    #: about that size beyond (False: a file per turn, as before 2026-12-04; for benchmarks)
    merge_turns: bool = True
    #: the most a head or a merge absorbs (LineWriter._absorbed): the save after an answer stays
    #: bounded, and a file this large costs its restore little beyond its copy
    merge_max_bytes: int = 32 << 20
    #: beyond ``merge_max_bytes`` a head that ends a turn still absorbs a file that holds no
    #: more tokens of its own than the head will above it (tiers: O(log n) files, each cell
    #: rewritten O(log n) times; an attention memory: a recurrent one's states are kept only
    #: within ``merge_max_bytes``, _let_go_of_states), rewriting at most this much, which bounds the slowest save
    #: after an answer; a file this large costs its restore ~1 ms beyond a ~25 ms copy.  A
    #: model whose turn is larger than ``merge_max_bytes`` (Llama-3-8B: 68 KiB a token)
    #: kept a file per turn without it
    tier_max_bytes: int = 256 << 20
    #: a memory with a recurrent part: an autosave goes on the last anchor while the
    #: autosaves since hold mostly dead recurrent states (LineWriter._tail_mostly_dead;
    #: False: on the newest autosave, as before 2026-12-05; for benchmarks)
    fold_dead_tails: bool = True
    #: an autosave absorbs the autosaves since the last anchor that hold no more tokens of
    #: their own than it will (LineWriter._tier_below: O(log n) files after n autosaves;
    #: False: on the newest autosave, as before 2026-12-06's twenty-second session; for
    #: benchmarks)
    tier_autosaves: bool = True


def saved_infos(chain: Sequence[CheckpointData]) -> list[SaveInfo]:
    """What a writer needs to know of the files of a chain it did not write (a restored
    one, base first): each one's depth is its place in the chain."""
    return [replace(SaveInfo.of_file(data), depth=i + 1) for i, data in enumerate(chain)]


def line_to_continue(store: Store, chain: Sequence[CheckpointData]) -> str | None:
    """The line a restored chain's history may continue on: its own when its newest
    file is that line's head in ``store``; None when it must branch (an older file, a
    copy, a file outside the store)."""
    last = chain[-1]
    if not store.contains(last.path):
        return None
    line = line_of(last.meta, last.header)
    head = Graph.scan(store).head_of_line.get(line)
    if head is None or head.path.name != last.path.name or head.payload_crc != last.payload_crc:
        return None
    return line

class SavingRuntime(Protocol):
    """What a LineWriter uses of the cache its conversation is in: an
    :class:`engine.runtime.Runtime`, or one sequence of a ParallelRuntime
    (:class:`engine.parallel.SequenceView`, which saves with Runtime's own ``save``)."""

    @property
    def kv_tokens(self) -> list[int]: ...

    @property
    def settings(self) -> ContextSettings: ...

    @property
    def shape(self) -> ModelShape: ...

    def save(self, path: str | os.PathLike, conv: Conversation, kind: int = ...,
             parent: SaveInfo | None = ..., *, line: str | None = ..., seq: int = ...,
             fresh: bool = ..., landing: Any = ..., upto: int | None = ...,
             cut: int | None = ..., points: Sequence[Point] = ...) -> SaveInfo: ...

    def recurrent_part(self) -> np.ndarray | None: ...

    def state_sizes(self) -> tuple[int, int]: ...

    def snapshot_at(self, n: int) -> PromptSnapshot | None: ...


def _is_anchor(conv: Conversation, info: SaveInfo) -> bool:
    """Whether a file that ends no turn ends where the answer's prompt or one of its marks
    ends: its prompt file (ChainPolicy.prompt_checkpoint) or a thinking model's mark file
    (engine.generation.mark_wants_file), which Regenerate and the next turn go back to."""
    answer = conv.answer
    return (answer is not None and info.turn_messages is None
            and info.n_tokens in (answer.n_prompt_tokens, *answer.marks))


def _own_tokens(info: SaveInfo) -> int:
    """The tokens whose cells a file holds itself (a delta's above its parent's)."""
    return info.n_tokens - (info.parent_n_tokens if info.delta else 0)


def _states_kept(info: SaveInfo) -> bool:
    """Whether a file of a memory with a recurrent part may be absorbed: its turn end's
    recurrent state and its own points' are at hand (LineWriter._point_state)."""
    return (info.turn_messages is None or info.point_state is not None) \
        and all(p.recurrent is not None for p in info.points)


class LineWriter:
    """Saves one line of a conversation from the Runtime that holds it."""

    def __init__(self, runtime: SavingRuntime, store: Store, line: str,
                 chain: Sequence[SaveInfo] = (), *, seq: int = 1, lease=None,
                 policy: ChainPolicy = ChainPolicy(), mode: str = "delta") -> None:
        if mode not in ("delta", "full"):
            raise ValueError(f"unknown save mode {mode!r}")
        self.runtime = runtime
        self.store = store
        self.line = line
        self.next_seq = seq
        self.policy = policy
        self.mode = mode
        self._chain: list[SaveInfo] = list(chain)
        self._lease = lease
        #: autosaves land (fsync, rename, retiring what they supersede) on a helper
        #: thread: an answer does not wait for them (engine.checkpoints.atomic.Landing)
        self._landing = Landing()
        #: the save still landing, and the live chain as it was before it: what the chain is
        #: again if that save fails to land (the autosaves it absorbed were not retired,
        #: _tier_below)
        self._landing_save: tuple[SaveInfo, list[SaveInfo]] | None = None
        self._land_now = False   # after a failed landing, the next save is synchronous
        self._after_landing: list = []   # when_landed's steps, for the owner's thread
        self.saves = 0
        self.bytes_written = 0
        self._written: set[str] = set()   # checkpoint ids of the files this writer wrote

    @classmethod
    def starting(cls, runtime: SavingRuntime, store: Store, line: str, chain: Sequence[SaveInfo] = (),
                 **kwargs) -> LineWriter:
        """A writer on ``line`` if its lease is free, else on a new line (a branch)."""
        lease = store.lease_line(line)
        if lease is None:
            line = uuid.uuid4().hex
            lease = store.lease_line(line)
        seq = Graph.scan(store).next_seq(line)
        return cls(runtime, store, line, chain, seq=seq, lease=lease, **kwargs)

    @classmethod
    def continuing(cls, runtime: SavingRuntime, store: Store, chain: Sequence[CheckpointData],
                   **kwargs) -> LineWriter:
        """A writer for a conversation restored from ``chain`` (files of ``store``, or not).

        Its files become parents of the next saves, so a chain read with ``crc_later``
        must have been settled: CheckpointError otherwise.  (The earlier files' own
        recurrent blocks a restore left unread stay unchecked: no save copies them, and
        whoever uses one later checks it then.)"""
        settle(chain)
        line = line_to_continue(store, chain) or uuid.uuid4().hex
        # a branch still builds on the files it came from, when they are in this store
        infos = saved_infos(chain) if chain and store.contains(chain[-1].path) else []
        return cls.starting(runtime, store, line, infos, **kwargs)

    def _branch_off(self) -> None:
        self.close()
        self.line = uuid.uuid4().hex
        self._lease = self.store.lease_line(self.line)
        self.next_seq = 1

    def close(self) -> None:
        """Let go of the line (another writer may continue it)."""
        self.settle()
        if self._lease is not None:
            self._lease.release()
            self._lease = None

    @property
    def chain(self) -> list[SaveInfo]:
        """The line's live files, oldest first (every one of them on disk)."""
        self.settle()
        return self._chain

    def newest_on_disk(self) -> SaveInfo | None:
        """The file of the line on disk now that holds the most of the conversation, without
        waiting for a save in flight (what a user who leaves at once can resume from): the
        files a save in flight supersedes are still there until it lands, and only its chain
        from before it knows them (a merge drops them from the live one)."""
        infos = list(self._chain)
        if self._landing.in_flight and self._landing_save is not None:
            infos += self._landing_save[1]
        there = [info for info in infos if info.path.is_file()]
        return max(there, key=lambda info: info.n_tokens, default=None)

    @property
    def head(self) -> SaveInfo | None:
        chain = self.chain
        return chain[-1] if chain else None

    @property
    def own_head(self) -> SaveInfo | None:
        """The newest file, when this writer wrote it (not a file it started from)."""
        head = self.head
        return head if head is not None and head.checkpoint_id in self._written else None

    @property
    def landing_path(self) -> Path | None:
        """The file of the save still landing, if any (its fsync and rename in flight, or
        done and not yet settled)."""
        save = self._landing_save if self._landing.in_flight else None
        return save[0].path if save is not None else None

    def when_landed(self, step, wake=None, failed=None) -> None:
        """Run ``step`` once the newest save is on disk (at once when it is), on the thread
        that settles this writer: its owner's, at its next save or :meth:`settle`.  So what
        a step does (an autosave's announcement) happens in the order of the saves, before
        the next save starts, and never after a later save retired the file.  If the save
        failed to land, ``failed(exc)`` runs there instead.  ``wake`` runs on the helper
        thread as soon as the save has landed, for an owner that would not settle soon
        otherwise (it queues a command), or has failed to."""
        if not self._landing.in_flight:
            step()
            return
        self._after_landing.append((step, failed))
        if wake is not None:
            self._landing.notify(wake)

    def settle(self) -> None:
        """Wait for the autosave still landing; if it failed, it is no file of the chain."""
        if not self._landing.in_flight:
            return
        failure = self._landing.settle()
        save, self._landing_save = self._landing_save, None
        steps, self._after_landing = self._after_landing, []
        if failure is not None:
            # e.g. its parent was deleted meanwhile: the next save, made in the foreground,
            # finds that out and writes a full checkpoint instead
            log.warning("an autosave could not be saved: %s", failure)
            self._land_now = True
            if save is not None and self._chain and self._chain[-1] is save[0]:
                self._chain = save[1]   # the autosaves it absorbed are still on disk, still live
        for step, failed in steps:
            try:
                if failure is None:
                    step()
                elif failed is not None:
                    failed(failure)
            except Exception:   # noqa: BLE001 - a step never undoes a landed save
                log.exception("a step after a checkpoint landed failed")

    # -- deciding -----------------------------------------------------------------------------
    def _head_holding_cache(self) -> SaveInfo | None:
        """The newest file, when it holds exactly what the cache holds; else None."""
        kv = self.runtime.kv_tokens
        tip = self.head
        if tip is not None and tip.holds(kv):
            return tip
        return None

    def _parent_index(self, tip: int | None, prompt_end: int = 0, *, head: bool = False) -> int | None:
        """Index in the live chain of the file the next delta goes on, or None (full).

        A chain is *anchors* — its base, each head (a finished answer, a pause, a rename),
        the files at or before the end of the answer's prompt (``prompt_end``: the prompt's
        own checkpoint and its marks, where Regenerate and Edit go back to) and the files
        this writer did not write (a restored autosave a user may name again) — with
        autosaves between them.  An autosave goes on the newest file the cache still starts
        with, so it costs only the tokens since then, unless that file holds no more tokens
        of its own than the autosave would: then it absorbs it, and so on down to the last
        anchor (:meth:`_tier_below`: tiers, a crash leaves O(log n) autosaves); when
        ``max_tail`` files follow the last anchor (without tiers) it goes on the anchor
        instead, folding them into one delta.
        A ``head`` always goes on the last anchor: the answer's autosaves are folded into it
        (and retired once it has landed), so a restore reads no file per autosave, and every
        turn's end stays in the chain, as a file or as a point of one (editing any turn
        restores its state exactly, see engine.branches; :meth:`_merge_below` may first write
        that anchor again, absorbing the turns below it).  A chain of ``max_files`` files
        gets a full file.  ``tip``: :meth:`_tip_index`.
        """
        if tip is None:
            return None

        def anchor(i: int) -> bool:   # (a file before the tip is a prefix of the cache; after
            # a cut, the delta is the chain's base: see _write)
            info = self.chain[i]
            return (bool(info.checkpoint_id) and info.n_tokens > 0
                    and (i == 0 or info.kind != KIND_AUTOSAVE or info.n_tokens <= prompt_end
                         or info.checkpoint_id not in self._written))

        last_anchor = max((i for i in range(tip + 1) if anchor(i)), default=tip)
        fold = head and self.policy.fold_heads
        parent = last_anchor if fold or tip - last_anchor >= self.policy.max_tail \
            or self._tail_mostly_dead(last_anchor, tip) else self._tier_below(last_anchor, tip)
        return None if self.chain[parent].depth + 1 > self.policy.max_files else parent

    def _tier_below(self, anchor: int, tip: int) -> int:
        """The file of the tail ``chain[anchor+1..tip]`` an autosave goes on: the newest one
        holding more tokens of its own than the autosave would above it, else the anchor.
        The tail's files then hold sizes that double downwards, like a binary counter's
        bits: after k autosaves of an answer a crash leaves popcount(k) of them (at most
        log2(k) + 1) where it left k (each costs a restore ~0.5 ms besides its bytes:
        benchmarks.restore_profile), and the autosaves write sum(lowbit(1..k)) / k times the
        cells they did (between log2(k + 1) / 2 and log2(k) / 2 + 1: 2.1 for k = 15,
        benchmarks.autosave_tiers).  A tail file another line builds on (a fork, a reused
        prefix) is absorbed too: its cells are then on disk twice while it stays for that
        line, where asking the graph for such files would cost every autosave a scan.
        (False ``tier_autosaves``: on the tip, as before 2026-12-06's twenty-second session.)"""
        if not self.policy.tier_autosaves:
            return tip
        n_now = len(self.runtime.kv_tokens)
        i = tip
        while i > anchor and _own_tokens(self.chain[i]) <= n_now - self.chain[i].n_tokens:
            i -= 1
        return i

    def _tail_mostly_dead(self, anchor: int, tip: int) -> bool:
        """Whether an autosave goes on the last anchor rather than on its tail (in tiers,
        :meth:`_tier_below`), retiring the autosaves after the anchor once it lands: a
        memory with a recurrent part, whose every file holds the whole recurrent state (and
        the logits after it), which the next autosave leaves dead — only the newest is ever
        resumed from, and Regenerate and Edit go back to anchors.  It does while the tail's
        attention cells, which the new file then holds again, weigh no more than the rest
        of the tail's bytes.  Measured here (a hybrid with Qwen3-Next's gated delta-net
        widths, 12.6 MB of recurrent state, 256 tokens with an autosave every 16): 16 files
        of 211 MB that a crash left and a restore read (53 ms), now one of 13 MB.  A model
        with little recurrent state and wide attention (LFM2: 98 KB against 8.7 KB a token)
        goes on its tail in tiers as an attention memory does (:meth:`_tier_below`); a pure
        recurrent one always folds (no cells)."""
        if not (self.policy.fold_dead_tails and self.runtime.shape.has_recurrent) or tip <= anchor:
            return False
        total, recurrent = self.runtime.state_sizes()
        n = len(self.runtime.kv_tokens)
        if not recurrent or not n:
            return False
        tail = self.chain[anchor + 1:tip + 1]
        cells = (total - recurrent) * (self.chain[tip].n_tokens - self.chain[anchor].n_tokens) / n
        return cells <= sum(info.size for info in tail) - cells

    def _tip_index(self) -> int | None:
        """Index of the newest file of the live chain the cache starts with (None: none, or
        no deltas); the files before it are its ancestors (a chain's links are prefixes),
        so one digest decides, not one per file."""
        if self.mode != "delta" or not self.runtime.settings.supports_deltas or not self.chain:
            return None
        kv = self.runtime.kv_tokens
        return next((i for i in range(len(self.chain) - 1, -1, -1)
                     if self.chain[i].checkpoint_id and 0 < self.chain[i].n_tokens <= len(kv)
                     and tokens_digest(kv[:self.chain[i].n_tokens]) == self.chain[i].tokens_digest), None)

    # -- saving -------------------------------------------------------------------------------
    def autosave(self, conv: Conversation) -> SaveInfo:
        """Save what the cache holds as an autosave (nothing when the newest file has it)."""
        held = self._head_holding_cache()
        if held is not None:
            return held
        return self._write(conv, KIND_AUTOSAVE)

    __call__ = autosave   # generate(autosave=writer) calls it with the conversation

    def save_head(self, conv: Conversation, kind: int) -> SaveInfo:
        """Write the line's new head (pause, exit, a finished answer, a rename)."""
        return self._write(conv, kind)

    def _write(self, conv: Conversation, kind: int) -> SaveInfo:
        tip = self._tip_index()
        prompt_end = conv.answer.n_prompt_tokens if conv.answer is not None else 0
        idx = self._parent_index(tip, prompt_end, head=kind != KIND_AUTOSAVE)
        if self.saves == 0 and self.chain and tip != len(self.chain) - 1:
            # the first save does not build on the file this writer started from (the
            # conversation was cut, or re-tokenised otherwise): go on as a branch, so that
            # file — one a user may have been handed — stays a head of its own
            self._branch_off()
        cut = self._cut(tip, idx)
        if cut is not None:
            idx = cut[0]
        elif idx is None and self.mode == "delta":
            idx = self._on_shared_prefix(conv)
        if cut is None and idx is not None:
            below = self._below_others_tips(idx, conv)
            if below != idx and self._may_cut(self.chain[idx]):
                # another conversation's tip, held whole (a fork at the last message): cut
                # one token short of it, so it stays a head, and hold that one cell again
                cut = (idx, self.chain[idx].n_tokens - 1)
            else:
                idx = below
        points = self._mark_points(conv, self.chain[idx].n_tokens if idx is not None else 0) \
            if kind == KIND_AUTOSAVE and cut is None else []
        if cut is None and idx is not None and kind != KIND_AUTOSAVE:
            if self._ends_turn_with_cells(conv, idx):
                idx, points = self._absorbed_by_head(idx, conv)
            else:
                idx = self._merge_below(idx, conv)
        if cut is None and tip != len(self.chain) - 1:   # (the cache leaves some file of the chain)
            points = self._turn_ends_left_behind(points, self.chain[idx].n_tokens if idx is not None else 0)
        superseding = idx is None or idx != len(self.chain) - 1 or self.saves == 0
        # an autosave lands (fsync, rename) on a helper thread, and what it supersedes is
        # retired there once it has landed: an answer never waits for an autosave's fsync.
        # A head (pause, exit, a finished answer) is durable before _write returns.
        landing = self._landing if kind == KIND_AUTOSAVE and not self._land_now else None
        try:
            self.store.ensure()
            info = self._save(conv, kind, self.chain[idx] if idx is not None else None, landing,
                              cut=cut[1] if cut else None, points=points)
        except SaveFailed:
            if idx is None:
                raise
            # the parent went away meanwhile (another process pruned or deleted it)
            log.info("delta parent %s is gone; writing a full checkpoint", self.chain[idx].path.name)
            idx, cut, superseding = None, None, True
            info = self._save(conv, kind, None, points=points)
        except OSError as exc:   # the folder itself: full disk, permissions, a lock timeout
            raise SaveFailed(f"could not save into {self.store.folder}: {exc.strerror or exc}") from exc
        if kind != KIND_AUTOSAVE and not conv.paused:   # a turn's end: a later head may absorb it
            info = replace(info, turn_messages=tuple(tuple(m) for m in conv.messages),
                           point_state=self._point_state(info))
        in_background = landing is not None and self._landing.in_flight
        if in_background:
            self._landing_save = (info, list(self._chain))
        else:
            self._land_now = False
        # after a cut, the file cut from holds more than the cache: the delta is the base
        self._chain = (self._chain[:idx + 1] if idx is not None and cut is None else []) + [info]
        if kind != KIND_AUTOSAVE:   # (an autosave above the head is never absorbed: not counted)
            self._let_go_of_states()
        self.saves += 1
        if superseding or kind != KIND_AUTOSAVE:
            if in_background:
                self._landing.then(self.retire)   # on the helper thread, once it has landed
            else:
                self.retire()   # a head: what the store shows after it is final
        return info

    def _cut(self, tip: int | None, idx: int | None) -> tuple[int, int] | None:
        """(index, tokens): a file of the live chain that the cache shares more of than the
        file the next delta would go on, to build on its first tokens (a *cut*,
        engine.checkpoints.chain.can_cut), or None.

        A conversation started from another's stored prefix that holds more than it
        shares (a document followed by another question: engine.prefix_reuse) then
        stores only its own tokens.  Only when it is worth it: the cut must save at least
        :data:`MIN_CUT_GAIN` tokens, and use at least half of the cut file's own cells,
        since the file stays in the store as long as the delta does — unless the file is
        its line's tip, which stays as that line's head anyway (engine.checkpoints.graph):
        an Edit, a Regenerate or a fork of a turn the head absorbed
        (:meth:`_absorbed_by_head`), or a document's next conversation."""
        if (self.mode != "delta" or not self.runtime.settings.supports_deltas
                or not self.runtime.shape.cells_by_position or tip == len(self.chain) - 1):
            return None
        kv = self.runtime.kv_tokens
        below = self.chain[idx].n_tokens if idx is not None else 0
        for i, info in enumerate(self.chain):
            if info.tokens is None or not info.checkpoint_id:
                continue
            shared = common_prefix(info.tokens, kv)
            if shared >= info.n_tokens:
                continue   # a prefix of the cache: the tip is at or after it
            own = self.chain[i - 1].n_tokens if i else 0   # where its own cells start
            if shared - below < MIN_CUT_GAIN or not self._may_cut(info):
                return None
            if shared - own < info.n_tokens - shared and not self._is_a_tip(info):
                return None
            return i, shared
        return None

    def _may_cut(self, info: SaveInfo) -> bool:
        """Whether a delta may be cut from ``info``'s file at all (engine.checkpoints.chain.can_cut)."""
        return (self.runtime.shape.cells_by_position and info.n_tokens > 1 and info.tokens is not None
                and bool(info.checkpoint_id) and info.depth + 1 <= self.policy.max_files)

    def _is_a_tip(self, info: SaveInfo) -> bool:
        """Whether ``info``'s file is its line's tip (newest restorable file)."""
        tip = Graph.scan(self.store).tip_of_line.get(info.line)
        return tip is not None and tip.name == info.path.name

    def _below_others_tips(self, idx: int, conv: Conversation) -> int | None:
        """``idx``, or the index of the newest file below it that is no other conversation's
        line tip (None: none, a full file).  A delta on such a tip whole would make that
        conversation's head part of this one's chain, and a tip another line's chain holds is
        no head (engine.checkpoints.graph): that conversation would vanish from the list (a
        Fork at the last message, a new conversation that starts with all of another's).
        The delta goes on the file below and holds those cells once more.  Files this
        writer wrote, and its own line's, are never another's tip."""
        tips = None
        for i in range(idx, -1, -1):
            info = self.chain[i]
            if info.checkpoint_id in self._written or info.line == self.line:
                return i
            tips = tips or Graph.scan(self.store).tip_of_line
            tip = tips.get(info.line)
            if tip is None or tip.name != info.path.name or tip.conversation_id == conv.id:
                return i
        return None

    def _ends_turn_with_cells(self, conv: Conversation, idx: int) -> bool:
        """Whether the head about to go on ``self.chain[idx]`` ends a turn (a finished answer,
        not a pause) with cells of its own (not a rename, nor a fork's metadata)."""
        return not conv.paused and len(self.runtime.kv_tokens) > self.chain[idx].n_tokens

    def _mark_points(self, conv: Conversation, parent_n: int) -> list[Point]:
        """For a thinking model's mark file (engine.generation.mark_wants_file: an autosave
        where the user's turn ends in the prompt, which the next turn parts from), the state
        where the user's message starts, the prompt's mark before it, as a *point* after the
        messages before it (engine.checkpoints.points): an Edit of that message, a fork or
        ``--from-turn`` there, in this process or a new one, restores the file and goes
        back to it (engine.branches.turn_end) instead of reading the conversation again —
        its template drops the answers' thinking, so no file ends at that history.  Only
        for a memory with a recurrent part whose prefill kept a snapshot there (it is
        exact: decoding cut at the marks gives the same state); [] otherwise, and where the
        mark before is the system prompt's end (engine.generation.system_mark: the message's
        start was no boundary of its tokens) while messages came before it."""
        answer, shape = conv.answer, self.runtime.shape
        n = len(self.runtime.kv_tokens)
        if (answer is None or len(answer.marks) < 2 or answer.marks[-1] != n or answer.n_generated
                or not (shape.has_recurrent and shape.holds_points)
                or not conv.messages or conv.messages[-1][0] != "user"):
            return []
        start, before = answer.marks[-2], len(conv.messages) - 1
        if start < parent_n or (before and start <= system_prompt_end(self.runtime, conv)):
            return []
        snapshot = self.runtime.snapshot_at(start)   # (its state read, where a restore left it in its file)
        return [] if snapshot is None else [Point(start, before, point_state(snapshot))]

    def _turn_ends_left_behind(self, points: list[Point], parent_n: int) -> list[Point]:
        """``points`` and the turn ends of the files this save leaves behind that lie within
        its own cells (after ``parent_n``) where the cache still holds the same tokens.

        A memory with a recurrent part cannot cut a file (its recurrent state exists only
        at the file's end), so a Regenerate, an Edit or a fork of a turn a head absorbed
        goes on the head's parent, or is a full file, and holds the cells up to there again
        (:meth:`_absorbed_by_head`); the head it leaves keeps the earlier turns' ends as its
        points, and the new branch had none: an Edit of any earlier turn in it read the
        whole conversation again (a new user's trial on a hybrid).  The new file keeps them
        too: the same tokens give the same state, so each point's recurrent state holds for
        it as for the file it came from (read from that file where this writer did not
        write it, each checked against its CRC)."""
        shape = self.runtime.shape
        if not (self.policy.merge_turns and shape.has_recurrent and shape.holds_points):
            return points
        kv = self.runtime.kv_tokens
        have = {p.n_tokens for p in points}
        kept = list(points)
        for info in self._chain:
            if info.tokens is None or not info.checkpoint_id:
                continue
            shared = common_prefix(info.tokens, kv)
            if shared >= info.n_tokens or shared <= parent_n:
                continue   # a prefix of the cache (the chain keeps it), or nothing of it lies here
            def wanted(n: int, shared: int = shared) -> bool:
                return parent_n < n <= shared and n < len(kv) and n not in have

            for point in self._points_with_states(info, wanted):
                if wanted(point.n_tokens) and len(kept) < LIMITS.max_points:
                    kept.append(point)
                    have.add(point.n_tokens)
        return sorted(kept, key=lambda p: p.n_tokens) if len(kept) > len(points) else points

    @staticmethod
    def _points_with_states(info: SaveInfo, wanted) -> list[Point]:
        """A file's points at the token counts ``wanted`` takes, with their recurrent states:
        as this writer wrote them, else read from the file, only those ([] where they cannot
        be had)."""
        if info.points and all(p.recurrent is not None for p in info.points):
            return [p for p in info.points if wanted(p.n_tokens)]
        try:
            header, meta = read_metadata(info.path)
        except (CheckpointError, OSError):
            return []
        return points_read_from(info.path, header, meta, wanted)

    def _point_state(self, info: SaveInfo) -> np.ndarray | None:
        """For a memory with a recurrent part, the recurrent part of the state at the end of
        the turn ``info``'s file just ended (the cache's end: a head is saved whole),
        which its point will carry when a later head absorbs it (engine.checkpoints.points)."""
        shape = self.runtime.shape
        if not (self.policy.merge_turns and shape.has_recurrent and shape.holds_points) \
                or info.n_tokens != len(self.runtime.kv_tokens) or info.size > self.policy.merge_max_bytes:
            return None   # (a file above the bound is never absorbed)
        return self.runtime.recurrent_part()

    def _let_go_of_states(self) -> None:
        """Drop the recurrent states kept for points (SaveInfo.point_state, points) of the
        files no later head can absorb: those below the newest files that together hold
        more than ``merge_max_bytes`` (a head absorbs from the top of the chain down; past
        that bound, in tiers, only an attention memory, which needs no states).  The memory
        they take stays bounded however long the conversation."""
        total = self._chain[-1].size if self._chain else 0   # (the newest stays as it is: its landing is
        for i in range(len(self._chain) - 2, -1, -1):       # known by identity)
            info = self._chain[i]
            total += info.size
            if total > self.policy.merge_max_bytes and (
                    info.point_state is not None or any(p.recurrent is not None for p in info.points)):
                self._chain[i] = replace(info, point_state=None,
                                         points=tuple(replace(p, recurrent=None) for p in info.points))

    def _absorbed_by_head(self, idx: int, conv: Conversation) -> tuple[int | None, list[Point]]:
        """``(parent, points)`` for a head that ends a turn, to go on ``self.chain[idx]``:
        the head absorbs that file and the files below it (:meth:`_absorbed`, their turn ends
        recorded as its *points*) and goes on the file below them (None: a full file), so a
        conversation restores from one file, or two on a shared prefix, up to
        ``merge_max_bytes``; ``(idx, [])`` where nothing may be absorbed.

        Each file costs a restore about as much as copying a few MB
        (benchmarks.restore_profile), so a turn's end is kept as a point of the head rather
        than as a file: an Edit of a turn, a Regenerate, a fork or ``--from-turn`` restores
        the head and trims it there (engine.branches.turn_end), exactly, since an attention
        memory without a sliding window holds the same cells before a position whatever
        follows; a memory with a recurrent part (recurrent, or a hybrid without a sliding
        window) holds its recurrent state only at its end, so each point carries the
        recurrent state at that turn's end, put back before the trim
        (``holds_points``, engine.checkpoints.points; a sliding window keeps a file per
        turn).  An attention memory's new line is cut from the head (:meth:`_cut`), which
        stays its own line's head (engine.checkpoints.graph); a recurrent one's goes on the
        head's parent and holds the cells from there again.  The files absorbed are retired
        once the head is durable (superseded); a crash before leaves them as they were."""
        if not (self.policy.merge_turns and self.runtime.shape.holds_points):
            return idx, []
        held = self._held_by_other_lines()
        j, points = self._absorbed(idx, conv, 0, held, tiers=True)
        return (j if j >= 0 else None), points

    def _merge_below(self, idx: int, conv: Conversation) -> int:
        """Before a head goes on ``self.chain[idx]``, the previous turn's end: write that
        state again as one file absorbing the files below it, and return its index (the
        new head's parent); or ``idx`` unchanged.

        A head on the line's previous head holds one turn; a conversation of n turns would
        restore from n files, and each file costs a restore about as much as copying a few
        MB (benchmarks.restore_profile).  So the previous turn's end is written once more on
        a lower file, or as a full one, holding the cells of the files between
        (:meth:`_absorbed`), with their turn ends as *points* (token and message counts,
        metadata ``points``): editing such a turn restores the file and trims it there
        (engine.branches.turn_end), exactly, since an attention memory without a sliding
        window holds the same cells before a position whatever follows
        (``cells_by_position``; only such a memory: the file is written from the cache
        up to the earlier turn's end, and a recurrent state exists only at the cache's end,
        a sliding window's cells depend on where it ends).  The files it replaces are retired
        once the head is durable (superseded: engine.checkpoints.graph); a crash between the
        two saves leaves the merged file as the line's head, the same state.

        Used for a pause (a head that ends no turn); a head that ends a turn absorbs its
        parent too (:meth:`_absorbed_by_head`).  A fork or edit of an older turn is cut from
        the merged file where it uses at least half of it (LineWriter._cut), and otherwise
        starts from the merged file's parent, or anew, and writes its cells again.
        """
        if not (self.policy.merge_turns and self.runtime.shape.cells_by_position) or idx < 1:
            return idx
        last = self.chain[idx]
        if last.turn_messages is None or not self._absorbable(last, self.chain[idx - 1], conv):
            return idx
        held = self._held_by_other_lines()
        if last.path.name in held:
            return idx
        j, points = self._absorbed(idx - 1, conv, last.size, held)
        if j == idx - 1:
            return idx
        then = self._conversation_at(last, conv)
        if then is None:
            return idx
        try:
            merged = self._save(then, last.kind, self.chain[j] if j >= 0 else None, upto=last.n_tokens,
                                points=[*points, *last.points])   # (attention only: no recurrent states)
        except (SaveFailed, OSError) as exc:   # the head still goes on the file it was going on
            log.warning("the turns before this one could not be merged: %s", exc)
            return idx
        self._chain = self._chain[:j + 1] + [replace(merged, turn_messages=last.turn_messages)]
        return j + 1

    def _absorbed(self, top: int, conv: Conversation, rewritten: int,
                  held: set[str], *, tiers: bool = False) -> tuple[int, list[Point]]:
        """``(j, points)``: the files ``chain[j+1..top]`` that a file written now absorbs (a
        head, _absorbed_by_head; a merged previous turn's end of ``rewritten`` bytes,
        _merge_below), and their turn ends; ``j`` is -1 where it absorbs the chain's base too
        (the file is a full one).  ``held``: names of files other lines build on.

        Files are absorbed, newest first, while what they hold stays within
        ``merge_max_bytes``: below that size a file costs a restore more than its bytes do
        (about 0.6 ms each, the copy of a few MB: benchmarks.restore_profile), so a
        conversation of up to that size restores from its head alone (and a shared prefix
        below it), and a longer one from files of about that size (a pause's merge) or in
        tiers (a head: ``tiers``, below).  Only a file this
        writer wrote on its own line (a delta on the whole file below it, or the line's
        own full base) that no other line's file builds on (a fork keeps what it was
        forked from; the previous turn's end itself included), and for a memory with a
        recurrent part, one whose turn end's recurrent state was taken (SaveInfo.point_state).
        For such a memory the answer's own anchors, its prompt file and a thinking model's
        mark file (:func:`_is_anchor`), are not absorbed, nor what lies below them: the
        prompt file's logits let Regenerate read nothing in a new process, and a thinking
        model's next turn parts from its mark (its template drops the thinking), so it goes
        on that file; a later head absorbs them once they lie below a turn's end.

        ``tiers`` (a head that ends a turn): past ``merge_max_bytes``, a file is still absorbed
        while it holds no more tokens of its own than the file being written will above it,
        within ``tier_max_bytes``: the files' sizes then double downwards, so a conversation
        restores from O(log n) files and each cell is written O(log n) times, where a model
        whose turn alone exceeds ``merge_max_bytes`` would keep a file per turn (measured at
        Llama-3-8B's widths, benchmarks.restore_profile --model llama-8b-kv)."""
        points: list[Point] = []
        below_a_turn_end = False
        n_now = len(self.runtime.kv_tokens)
        i = top
        while i >= 0:
            info, below = self.chain[i], self.chain[i - 1] if i else None
            size = rewritten + info.size
            tier = tiers and size <= self.policy.tier_max_bytes and _own_tokens(info) <= n_now - info.n_tokens
            if ((size > self.policy.merge_max_bytes and not tier) or info.path.name in held
                    or not self._absorbable(info, below, conv)):
                break
            ended = info.turn_messages
            if self.runtime.shape.has_recurrent and not _states_kept(info):
                break   # a point of it would not come back exactly
            if len(points) + len(info.points) + 1 > LIMITS.max_points:
                break
            if self.runtime.shape.has_recurrent and not below_a_turn_end and _is_anchor(conv, info):
                break   # the answer's own prompt or mark file stays one (see the docstring)
            own = [Point(info.n_tokens, len(ended), info.point_state)] if ended is not None else []
            points = [*info.points, *own, *points]
            below_a_turn_end = below_a_turn_end or ended is not None
            rewritten += info.size
            i -= 1
        return i, points

    def _absorbable(self, info: SaveInfo, below: SaveInfo | None, conv: Conversation) -> bool:
        """Whether a merged file may take ``info``'s place (see _absorbed), but for other lines:
        this writer's own file on its line, a delta on the whole of ``below`` (``below`` None:
        the chain's base, a full file), and, where it ends a turn, one whose messages the
        conversation still starts with (its point)."""
        whole = (not info.delta if below is None else
                 info.delta and bool(below.checkpoint_id) and info.parent_n_tokens == below.n_tokens)
        if info.checkpoint_id not in self._written or info.line != self.line or not whole:
            return False
        ended = info.turn_messages
        return ended is None or tuple(tuple(m) for m in conv.messages[:len(ended)]) == ended

    def _held_by_other_lines(self) -> set[str]:
        """Names of the files another line's file builds on (a fork, a branch)."""
        graph = Graph.scan(self.store)
        return {name for name, children in graph.children.items()
                if any(child.line != self.line for child in children)}

    def _conversation_at(self, info: SaveInfo, conv: Conversation) -> Conversation | None:
        """The conversation ``info``'s file holds (its metadata), on the cache's tokens up to
        its end; None where it cannot be read (the merge is skipped)."""
        try:
            meta = read_metadata(info.path)[1]
            then = Conversation.from_json(meta["conversation"], self.runtime.kv_tokens[:info.n_tokens])
        except (CheckpointError, OSError, KeyError, TypeError, ValueError, AttributeError) as exc:
            log.info("the previous turn's file could not be read again (%s): no merge", exc)
            return None
        then.id = conv.id
        return then

    def _on_shared_prefix(self, conv: Conversation) -> int | None:
        """Start the chain on the store's shared prefix of the conversation's system
        prompt, or of a document it shares with another (engine.shared_prefix); the index
        of the parent then (0), else None."""
        try:
            base = shared_base(self.runtime, self.store, conv)
        except (SaveFailed, OSError) as exc:   # the conversation's own full file still follows
            log.warning("the shared prefix could not be stored: %s", exc)
            return None
        if base is None:
            return None
        self._chain = [base]
        return 0

    def _save(self, conv: Conversation, kind: int, parent: SaveInfo | None, landing=None,
              cut: int | None = None, upto: int | None = None,
              points: Sequence[Point] = ()) -> SaveInfo:
        """Write a new file of this line (Runtime.save's arguments) and count it as this
        writer's: its line's next sequence number, a file a later merge may absorb."""
        path = (self.store.new_autosave_path(conv.id) if kind == KIND_AUTOSAVE
                else self.store.new_path(conv.title))
        info = self.runtime.save(path, conv, kind, parent, line=self.line, seq=self.next_seq,
                                 fresh=True, landing=landing, cut=cut, upto=upto, points=points)
        self.next_seq += 1
        self._written.add(info.checkpoint_id)
        self.bytes_written += info.size
        return info

    def retire(self) -> None:
        """Delete what this line's head supersedes (the head is durable)."""
        try:
            report = graph.retire(self.store, self.line)
        except OSError as exc:   # a lock timeout is an OSError too: the next save retires
            log.warning("could not retire superseded checkpoints: %s", exc)
            return
        if report.deleted:
            log.debug("retired %d superseded file(s) of line %s", len(report.deleted), self.line)
