"""What the window knows about its conversations' answers: plain Python, no Qt.

Several answers may generate at once (one per conversation; engine.concurrent), and
the user may switch to another conversation while they do.  :class:`ChatState` keeps
the bookkeeping the main window used to spread over flags (``running``, ``_closing``):

* which conversation is shown (``current``) and which ones have an answer asked for or
  running (``answering``) — the buttons follow from them (:meth:`can_send`,
  :meth:`can_pause`, ...), always for the shown conversation;
* what each running answer has streamed so far, so that switching back to a
  conversation that is answering shows its text up to now and goes on streaming
  (:meth:`streamed`); the engine's snapshots are not used for that, since text may
  reach the window before or after a snapshot asked for at the same moment;
* whether the window is closing (nothing new may start then).

The engine's answers are reported by conversation, so every event is applied to the
right conversation whether or not it is shown; :mod:`tests.test_chat_state` replays
sequences of them.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class _Answer:
    started: bool = False           # the engine said it started (else: asked for, queued)
    transcript: tuple = ()          # the transcript when it started (its open answer last)
    text: str = ""                  # streamed since it started


@dataclass
class ChatState:
    current: uuid.UUID | None = None
    closing: bool = False
    #: conversations shown from their files only: the engine does not have them open
    #: (any container: the window passes its dict of them)
    unopened: set | dict = field(default_factory=set)
    #: ``(conversation, file)`` the engine was asked to open and has not answered for yet
    #: (it may be loading a model first): nothing is sent in it until it is open
    opening: tuple[uuid.UUID, Path] | None = None
    #: another model is loading (File › Open Model): the engine then closes the conversations
    #: of the previous one (EngineWorker._leave_conversations_of), so nothing is sent until it
    #: is loaded (a message sent meanwhile was refused as "not open", its text gone)
    switching_model: bool = False
    _answers: dict[uuid.UUID, _Answer] = field(default_factory=dict)

    # -- questions ----------------------------------------------------------------------------
    @property
    def answering(self) -> set[uuid.UUID]:
        """Conversations with an answer asked for or running."""
        return set(self._answers)

    def is_answering(self, conv_id: uuid.UUID | None) -> bool:
        return conv_id in self._answers

    @property
    def shown_answering(self) -> bool:
        """The shown conversation has an answer asked for or running."""
        return self.current in self._answers

    @property
    def idle(self) -> bool:
        """No answer anywhere (what switching models needs)."""
        return not self._answers

    def can_send(self) -> bool:
        return (not self.closing and not self.shown_answering and self.current not in self.unopened
                and not self.shown_opening and not self.switching_model)

    @property
    def shown_opening(self) -> bool:
        """The shown conversation is being opened (:attr:`opening`)."""
        return self.opening is not None and self.opening[0] == self.current

    def can_pause(self) -> bool:
        return self.shown_answering

    def can_resume(self, snap) -> bool:
        return self.can_send() and snap is not None and snap.paused

    def can_regenerate(self, snap) -> bool:
        return (self.can_send() and snap is not None and bool(snap.transcript)
                and snap.transcript[-1]["role"] == "assistant")

    def streamed(self, conv_id: uuid.UUID) -> tuple[tuple, str] | None:
        """For a conversation whose answer runs: its transcript when the answer started,
        and the text streamed since (None when it has no running answer)."""
        answer = self._answers.get(conv_id)
        if answer is None or not answer.started:
            return None
        return answer.transcript, answer.text

    # -- events -------------------------------------------------------------------------------
    def asked(self, conv_id: uuid.UUID) -> None:
        """The window asked for an answer in ``conv_id`` (it may wait in the engine's queue)."""
        self._answers.setdefault(conv_id, _Answer())

    def started(self, conv_id: uuid.UUID, transcript: tuple) -> None:
        """The engine started an answer (the window's, or a local server client's)."""
        self._answers[conv_id] = _Answer(started=True, transcript=tuple(transcript))

    def text(self, conv_id: uuid.UUID, delta: str) -> None:
        answer = self._answers.get(conv_id)
        if answer is not None:
            answer.text += delta

    def ended(self, conv_id: uuid.UUID) -> None:
        """The answer stopped (finished, paused, refused or failed)."""
        self._answers.pop(conv_id, None)

    def ended_all(self) -> None:
        self._answers.clear()
