"""What the engine knows of each conversation: one :class:`Session` per conversation.

The engine thread (engine.worker) keeps every fact about a conversation in its
session, and every session in one :class:`SessionTable`: the conversation itself, the
newest file of its history (``head``), the writer of its line (engine.history), its
running answer, and the two facts other threads touch — the pause control of its
running answer and its pause target.  Adding a fact about a conversation is adding a
field here; ending a conversation (:meth:`SessionTable.end`) releases all of it in
one place.  Which sequence of the KV cache holds a conversation is the residency
table's (engine.sequences), asked through :meth:`Session.resident_in`.

A session begins when a conversation is first named to the engine (a command for it,
or the engine opening it) and may hold no conversation yet: an answer submitted for a
conversation the engine thread has not adopted yet carries its pause target here.

Threads: the engine thread owns every field but three, which are read and written
under the table's ``lock`` (also the worker's, so a pause and the start of an answer
are ordered):

===============  =====================================================
field            meaning
===============  =====================================================
``control``      the running answer's pause (engine.generation.Control)
``pause_upto``   answers of this conversation numbered up to this one
                 are paused before they start (see :meth:`pause`)
``request_id``   the request the running answer serves (engine.requests)
===============  =====================================================

Answers are numbered as they are submitted (:meth:`SessionTable.number_answer`); a
pause covers every answer submitted before it, started or not: every conversation's
(``pause()``) or one conversation's (``pause(conv_id)``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.conversation import Conversation


@dataclass
class RunningAnswer:
    """An answer the engine is generating (engine.concurrent.Batcher's job)."""
    job: Any                        # engine.concurrent.Job
    restore_s: float
    action: Any                     # the command's kind: a failure is reported under it
    request_id: str | None = None


@dataclass(eq=False)
class Session:
    """Everything the engine knows of one conversation."""
    id: uuid.UUID
    conv: Conversation | None = None
    #: the newest file of its history (the writer's head, or the file it was opened from)
    head: Path | None = None
    #: the writer of its line of history (engine.history.LineWriter), for the loaded model
    writer: Any = None
    #: its answer being generated (engine thread)
    answer: RunningAnswer | None = None
    #: the order in which requests last used it (engine.requests); 0: none did
    served: int = 0
    #: (fingerprint, name) of the model its tokens are of, while another one is loaded (its
    #: save before the switch failed: it answers nothing until that model is back); None
    tokens_model: tuple[bytes, str] | None = None
    # under the table's lock (see the module docstring)
    control: Any = None
    pause_upto: int = 0
    request_id: str | None = None

    @property
    def head_path(self) -> Path | None:
        """The newest file of its history: its writer's head, else the file last known."""
        writer = self.writer
        return writer.head.path if writer is not None and writer.head else self.head

    def resident_in(self, runtime) -> bool:
        """Whether ``runtime``'s cache (engine.parallel.ParallelRuntime) holds a sequence of it."""
        return runtime is not None and self.id in runtime.table

    def close_writer(self) -> None:
        """Let go of its line (its head stays known)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()
            # settled: an autosave that failed to land is no head, nor a file it started from
            if (own := writer.own_head) is not None:
                self.head = own.path


class SessionTable:
    """Every session of one engine, by conversation id (see the module docstring)."""

    def __init__(self, lock: threading.RLock | None = None) -> None:
        self.lock = lock if lock is not None else threading.RLock()
        self._sessions: dict[uuid.UUID, Session] = {}
        self._answers_submitted = 0
        self._pause_upto = 0      # answers numbered up to this one: every conversation's
        self._served_clock = 0

    # -- questions (engine thread) --------------------------------------------------------------
    def __contains__(self, conv_id: object) -> bool:
        return conv_id in self._sessions

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def get(self, conv_id: uuid.UUID) -> Session | None:
        return self._sessions.get(conv_id)

    def conversation(self, conv_id: uuid.UUID) -> Conversation | None:
        """The conversation of ``conv_id``, or None when the engine has not opened it."""
        session = self._sessions.get(conv_id)
        return session.conv if session is not None else None

    def open(self) -> list[Session]:
        """Sessions holding a conversation, in the order they began."""
        return [s for s in self._sessions.values() if s.conv is not None]

    def running(self) -> list[Session]:
        """Sessions whose answers are being generated."""
        return [s for s in self._sessions.values() if s.answer is not None]

    def is_answering(self, conv_id: uuid.UUID | None) -> bool:
        session = self._sessions.get(conv_id) if conv_id is not None else None
        return session is not None and session.answer is not None

    def served(self) -> list[Session]:
        """Sessions requests used, the least recently used first."""
        return sorted((s for s in self._sessions.values() if s.served), key=lambda s: s.served)

    # -- changes (engine thread) ----------------------------------------------------------------
    def named(self, conv_id: uuid.UUID) -> Session:
        """The session of ``conv_id``, begun now if there was none (any thread)."""
        with self.lock:
            session = self._sessions.get(conv_id)
            if session is None:
                session = self._sessions[conv_id] = Session(conv_id)
            return session

    def adopt(self, conv: Conversation) -> Session:
        """``conv`` is the conversation of its session from now on."""
        session = self.named(conv.id)
        session.conv = conv
        return session

    def set_writer(self, conv_id: uuid.UUID, writer) -> Any:
        """``writer`` writes ``conv_id``'s line from now on (the previous one lets go)."""
        session = self.named(conv_id)
        if session.writer is not writer:
            session.close_writer()
        session.writer = writer
        return writer

    def mark_served(self, session: Session) -> None:
        self._served_clock += 1
        session.served = self._served_clock

    def end(self, conv_id: uuid.UUID) -> Session | None:
        """Forget ``conv_id``: its writer lets go of its line, its session goes."""
        with self.lock:
            session = self._sessions.pop(conv_id, None)
        if session is not None:
            session.close_writer()
        return session

    def close_writers(self) -> None:
        """Every writer lets go (another model: they wrote from the previous cache)."""
        for session in self:
            session.close_writer()

    # -- answers and pauses (any thread) --------------------------------------------------------
    def number_answer(self, conv_id: uuid.UUID) -> int:
        """Number an answer submitted for ``conv_id`` (a pause after this covers it)."""
        with self.lock:
            self.named(conv_id)
            self._answers_submitted += 1
            return self._answers_submitted

    def pause(self, conv_id: uuid.UUID | None = None) -> list:
        """Cover every answer submitted so far (of ``conv_id``; None: of every
        conversation); returns the controls of the answers running now to pause."""
        with self.lock:
            if conv_id is None:
                self._pause_upto = self._answers_submitted
                return [s.control for s in self._sessions.values() if s.control is not None]
            session = self._sessions.get(conv_id)
            if session is None:
                return []   # nothing submitted for it, nothing running
            session.pause_upto = self._answers_submitted
            return [session.control] if session.control is not None else []

    def answering(self) -> set[uuid.UUID]:
        """Conversations whose answers are running (any thread)."""
        with self.lock:
            return {s.id for s in self._sessions.values() if s.control is not None}

    def control_of_request(self, request_id: str):
        """The pause control of the answer serving ``request_id`` (call with ``lock`` held)."""
        return next((s.control for s in self._sessions.values()
                     if s.request_id == request_id and s.control is not None), None)

    def begin_answer(self, session: Session, number: int, control, request_id: str | None,
                     cancelled: Callable[[], bool] = lambda: False) -> bool:
        """``session``'s answer number ``number`` starts with ``control``; returns whether a
        pause (or ``cancelled``, checked under the lock) reached it before it started."""
        with self.lock:
            pending = (0 < number <= self._pause_upto or 0 < number <= session.pause_upto
                       or cancelled())
            session.control, session.request_id = control, request_id
            return pending

    def end_answer(self, session: Session) -> RunningAnswer | None:
        """``session``'s answer ended; returns its record (None if none was recorded)."""
        running = session.answer
        with self.lock:
            session.answer = None
            session.control, session.request_id = None, None
        return running

    @property
    def any_running(self) -> bool:
        return any(s.answer is not None for s in self._sessions.values())
