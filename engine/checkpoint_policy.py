"""Which checkpoint to write, and when: one rule for the window, ``run``, ``run --parallel``
and ``serve``.

Every conversation's history is a line of files in the store (engine.history.LineWriter
writes it; engine.checkpoints.graph reads it).  What is written, and when:

==================================  ==========================  ====================================
moment                              kind                        what and where
==================================  ==========================  ====================================
every ``autosave_every`` generated  autosave                    a delta on the line's files the
tokens (0: never), and once after                               cache still starts with, in tiers
a prefill of at least                                           (engine.history); with a
``ChainPolicy.prompt_checkpoint``                               named file: on a line of its own
tokens (a line in the store only)                               in a hidden folder beside it
                                                                (:func:`beside_folder`)
the answer stops: finished          manual                      the line's new head (a delta), or
                                                                the named file, written whole; its
                                                                autosaves beside it then go
the answer stops: paused            pause                       the same
the answer stops because the        exit                        the same
program ends (Ctrl+C, close,
console closed, log-off)
leaving a conversation whose head   manual (exit at the end)    the line's new head, if the cache
lags the cache (another model,                                  holds more than it
another branch, exit)
==================================  ==========================  ====================================

A head's kind is truthful (:func:`head_kind`): a listing shows pause and exit as
"paused", so a paused conversation is never saved as manual and a finished one never as
a pause or an exit.  Compaction (an answer's autosaves folded into its head, a full file
once a chain is long) is ``engine.history.LineWriter``'s and ``ChainPolicy``'s.  Pruning
superseded files under a disk budget is the window's setting (the engine worker's
``autosave_budget``); a command-line run only retires what each save supersedes on its
own line.

:class:`Checkpoints` is this rule for one conversation of a command-line run (``run``,
``run --parallel``); the engine worker applies the same rule to each session (with
:func:`head_kind`, and a LineWriter per session).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from engine.checkpoints.format import KIND_EXIT, KIND_MANUAL, KIND_PAUSE
from engine.checkpoints.store import Store
from engine.conversation import Conversation

if TYPE_CHECKING:   # the engine worker imports this module on the UI thread: no native layer
    from engine.history import LineWriter
    from engine.runtime import SaveInfo

log = logging.getLogger("engine")


def head_kind(paused: bool, asked: int = KIND_MANUAL) -> int:
    """The kind a head is written with: the one ``asked`` (a pause, an exit, a manual
    save), made truthful for a conversation that is ``paused`` or not."""
    if paused and asked == KIND_MANUAL:
        return KIND_PAUSE
    if not paused and asked in (KIND_PAUSE, KIND_EXIT):
        return KIND_MANUAL
    return asked


def stop_kind(paused: bool, *, exiting: bool) -> int:
    """The kind of the head an answer's stop writes: exit when the program ends, else a
    pause when it was paused, else manual (:func:`head_kind`)."""
    return head_kind(paused, KIND_EXIT if exiting else KIND_PAUSE)


def beside_folder(path: Path) -> Path:
    """Where the autosaves of a run saving to ``path`` go: a hidden folder beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}.autosaves")


class Checkpoints:
    """One conversation's checkpoints in a command-line run (see the module docstring).

    ``named``: its head goes into this file, written whole, and its autosaves (when
    ``autosave_every``) onto a line of their own beside it, deleted once the file is
    written.  Otherwise ``store_line()`` makes the writer of its line in the store,
    which takes its autosaves and its head alike.
    """

    def __init__(self, runtime, *, named: Path | None = None, autosave_every: int = 0,
                 store_line: Callable[[], LineWriter] | None = None) -> None:
        self.runtime = runtime         # engine.runtime.Runtime, or one sequence's view
        self.named = Path(named) if named is not None else None
        self.autosave_every = max(0, autosave_every)
        self.writer: LineWriter | None = None
        self._beside = False           # the writer's line is the named file's autosaves
        self.saved_head: Path | None = None   # the named file, once save_head has written it
        if self.named is None:
            if store_line is None:
                raise ValueError("a conversation's checkpoints need a named file or a line in a store")
            self.writer = store_line()
        elif self.autosave_every:
            from engine.history import LineWriter
            self.writer = LineWriter.starting(runtime, Store(beside_folder(self.named)), uuid.uuid4().hex)
            self._beside = True

    @property
    def prompt_checkpoint(self) -> int:
        """Tokens of prefill worth an autosave before the first token (0: never): only a
        line in the store keeps one (a named file's autosaves go once it is written)."""
        return self.writer.policy.prompt_checkpoint if self.writer is not None and not self._beside else 0

    def autosave(self, conv: Conversation) -> SaveInfo | None:
        """An autosave of what the cache holds (nothing when no line takes autosaves)."""
        return self.writer.autosave(conv) if self.writer is not None else None

    def save_head(self, conv: Conversation, kind: int) -> SaveInfo:
        """The checkpoint an answer's stop writes (see :func:`stop_kind`)."""
        if self.named is None:
            assert self.writer is not None          # a line in the store: made in __init__
            return self.writer.save_head(conv, kind)
        info = self.runtime.save(self._writable_name(), conv, kind)
        self.saved_head = info.path
        self.drop_autosaves_beside()   # the file, whole and durable, holds all they held
        return info

    def _writable_name(self) -> Path:
        """The named file, unless writing over it now would break something (checked before
        the run too: engine.cli.run; since then another run may have built a delta on it, or
        put something else there), or that cannot be told (a folder that cannot be
        listed): then a fresh name beside it, so that the pause is not lost.  A name with
        nothing there is not looked into further (the save of a Ctrl+C is kept short)."""
        from engine.checkpoints.graph import overwrite_problem
        from engine.checkpoints.store import fresh_path
        assert self.named is not None
        if not os.path.lexists(self.named):
            return self.named
        try:
            problem = overwrite_problem(self.named)
        except OSError as exc:
            problem = f"whether {self.named.name} may be written over cannot be told ({exc.strerror or exc})"
        if problem is None:
            return self.named
        fresh = fresh_path(self.named.parent, self.named.stem)
        log.warning("%s: saved to %s instead", problem, fresh.name)
        return fresh

    def newest_on_disk(self) -> Path | None:
        """The newest file this conversation can be resumed from now, without waiting for a
        save in flight: the named file once written, else the newest of its line (an
        autosave, or in the store the checkpoint it continued); None: none."""
        if self.saved_head is not None:
            return self.saved_head
        newest = self.writer.newest_on_disk() if self.writer is not None else None
        return newest.path if newest is not None else None

    def drop_autosaves_beside(self) -> None:
        """The named file holds all this run's autosaves held: delete them, and their
        folder once empty.  Another run's files there (a crashed run's) stay."""
        if not self._beside or self.writer is None:
            return
        writer, self.writer = self.writer, None
        writer.close()
        for info in writer.chain:
            if info.line == writer.line:
                info.path.unlink(missing_ok=True)
        if not writer.store.files():
            shutil.rmtree(writer.store.folder, ignore_errors=True)

    def close(self) -> None:
        """Let go of the line (after a failure the autosaves beside stay: they hold the
        newest state)."""
        if self.writer is not None:
            self.writer.close()
