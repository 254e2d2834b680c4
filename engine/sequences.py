"""Which conversation lives in which sequence of one unified KV cache.

A context made with several sequences (``n_seq_max``, one unified KV cache) holds up
to ``capacity`` conversations at once.  :class:`SequenceTable` is the bookkeeping of
that residency and nothing else: no thread, no queue, no native call, so every rule
here is tested without a model.  Its owner (engine.parallel, later the worker) does
what a placement asks of the cache: clear an evicted sequence, restore or prefill the
conversation placed.

A resident conversation is in one of three states:

=========  =======================================  ===================
state      meaning                                  may be evicted
=========  =======================================  ===================
running    an answer generates in it (it takes      never
           part in every decode step)
idle       its newest checkpoint is durable         yes, least recently
           (``finish(key)`` after its save)         used first
unsaved    idle, but the cache holds more than its  never
           files do (``finish(key, durable=False)``)
=========  =======================================  ===================

Evicting an idle conversation therefore writes nothing: what the cache held for it
is on disk already, and coming back to it is a restore.  Coming back to a resident
one costs nothing at all.  Recency is a counter, not a clock: the order of calls
decides, and tests replay it exactly.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from engine.errors import AppError


class SequencesFull(AppError):
    """Every sequence holds a running (or unsaved) conversation: none can be evicted."""


@dataclass(frozen=True)
class Placement:
    """Where :meth:`SequenceTable.activate` put a conversation."""
    key: Hashable
    seq: int
    resident: bool                       # it was there already: nothing to restore
    evicted: Hashable | None = None      # whose sequence this was (its cells must go)


@dataclass
class _Slot:
    seq: int
    used: int            # the table's counter at the last use
    running: bool = False
    durable: bool = True


class SequenceTable:
    """Residency of conversations in sequences ``first .. first + capacity - 1``."""

    def __init__(self, capacity: int, *, first: int = 0) -> None:
        if capacity <= 0:
            raise ValueError(f"a context holds at least one sequence, not {capacity}")
        self.capacity = capacity
        self.first = first
        self._slots: dict[Hashable, _Slot] = {}
        self._clock = 0
        #: activations that found the conversation resident / that needed a restore
        self.hits = 0
        self.misses = 0
        #: conversations evicted to make room
        self.evictions = 0

    # -- questions ----------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def seq_of(self, key: Hashable) -> int:
        """The sequence ``key`` is in (KeyError when it is not resident)."""
        return self._slots[key].seq

    def key_of(self, seq: int) -> Hashable | None:
        return next((k for k, s in self._slots.items() if s.seq == seq), None)

    def is_running(self, key: Hashable) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.running

    @property
    def running(self) -> list[Hashable]:
        """Running conversations, in the order they started running (by sequence)."""
        return [k for k, s in sorted(self._slots.items(), key=lambda kv: kv[1].seq) if s.running]

    def residents(self) -> list[Hashable]:
        """Resident conversations, most recently used first."""
        return [k for k, _ in sorted(self._slots.items(), key=lambda kv: -kv[1].used)]

    @property
    def free(self) -> int:
        return self.capacity - len(self._slots)

    def _free_seqs(self) -> Iterator[int]:
        taken = {s.seq for s in self._slots.values()}
        return (seq for seq in range(self.first, self.first + self.capacity) if seq not in taken)

    def victim(self, *, keep: Hashable | None = None) -> Hashable | None:
        """The conversation the next eviction takes: the least recently used idle,
        durable one other than ``keep`` (None when every resident one is running or
        unsaved)."""
        idle = [(s.used, k) for k, s in self._slots.items() if not s.running and s.durable and k != keep]
        return min(idle, key=lambda item: item[0])[1] if idle else None

    # -- changes ------------------------------------------------------------------------------
    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def activate(self, key: Hashable, *, running: bool = False) -> Placement:
        """Give ``key`` a sequence: its own when resident, else a free one, else the
        least recently used idle one's (that conversation is evicted).

        Raises :class:`SequencesFull` when no sequence is free and none may be evicted.
        ``running``: the conversation starts an answer at once (it cannot be evicted
        between this call and :meth:`start`).
        """
        slot = self._slots.get(key)
        if slot is not None:
            slot.used = self._tick()
            slot.running = slot.running or running
            self.hits += 1
            return Placement(key, slot.seq, resident=True)
        evicted = None
        seq = next(self._free_seqs(), None)
        if seq is None:
            evicted = self.victim()
            if evicted is None:
                raise SequencesFull(f"all {self.capacity} sequences hold running or unsaved "
                                    "conversations; pause or save one first")
            seq = self._slots.pop(evicted).seq
            self.evictions += 1
        self._slots[key] = _Slot(seq=seq, used=self._tick(), running=running)
        self.misses += 1
        return Placement(key, seq, resident=False, evicted=evicted)

    def start(self, key: Hashable) -> None:
        """An answer starts generating in ``key`` (resident): it is never evicted now."""
        slot = self._slots[key]
        slot.running, slot.used = True, self._tick()

    def finish(self, key: Hashable, *, durable: bool = True) -> None:
        """``key``'s answer stopped (paused or ended).  ``durable``: its save landed, so
        evicting it loses nothing; otherwise it stays until :meth:`saved`."""
        slot = self._slots[key]
        slot.running, slot.durable, slot.used = False, durable, self._tick()

    def saved(self, key: Hashable) -> None:
        """``key``'s newest state is on disk now (an idle one may be evicted)."""
        self._slots[key].durable = True

    def evict(self, key: Hashable) -> int | None:
        """Drop ``key`` (deleted, or its cells were lost); returns the sequence it had."""
        slot = self._slots.pop(key, None)
        return None if slot is None else slot.seq
