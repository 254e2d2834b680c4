"""The one QObject through which the engine thread talks to the UI.

:class:`EngineBridge` owns an :class:`engine.worker.EngineWorker` and implements its
listener by emitting Qt signals.  The callbacks run on the engine thread; every signal
is connected with a queued connection, so the slots run on the UI thread.

Tokens are batched: the engine thread appends text to a buffer and posts a flush only
when none is pending, so however fast tokens come the UI receives at most one delivery
per event-loop turn, carrying everything generated since the last one.  The answer's
progress (tokens in the context, speed) rides on the same flush, latest value only.
"""

from __future__ import annotations

import threading
import uuid

from PySide6.QtCore import QObject, Qt, Signal, Slot

from engine import events as ev
from engine.events import GenerationSummary, ModelInfo, ModelOptions, WorkerListener
from engine.worker import EngineWorker


class _Listener(WorkerListener):
    """Runs on the engine thread: turns the engine's events into signal emissions."""

    def __init__(self, bridge: EngineBridge) -> None:
        self.b = bridge

    def on_model_loading(self, e: ev.ModelLoading) -> None:
        self.b.model_loading.emit(float(e.fraction))

    def on_model_loaded(self, e: ev.ModelLoaded) -> None:
        if e.left:
            self.b.conversations_left.emit(e.left)
        self.b.model_loaded.emit(e.info)

    def on_model_failed(self, e: ev.ModelFailed) -> None:
        self.b.model_failed.emit(e.message)

    def on_conversation_changed(self, e: ev.ConversationChanged) -> None:
        self.b.conversation_changed.emit(e.snap)

    def on_generation_started(self, e: ev.GenerationStarted) -> None:
        self.b.generation_started.emit(e.snap)

    def on_prefill_progress(self, e: ev.PrefillProgress) -> None:
        self.b.prefill_progressed.emit(e.conv_id, e.done, e.total)

    def on_text(self, e: ev.TextDelta) -> None:
        self.b._buffer_text(e.conv_id, e.delta)

    def on_progress(self, e: ev.Progress) -> None:
        self.b._buffer_progress(e.conv_id, e.n_tokens, e.n_generated, e.tokens_per_s)

    def on_generation_finished(self, e: GenerationSummary) -> None:
        self.b._finished_raw.emit(e)

    def on_checkpoint_saving(self, e: ev.CheckpointSaving) -> None:
        self.b.checkpoint_saving.emit(e.conv_id, e.kind)

    def on_checkpoint_saved(self, e: ev.CheckpointSaved) -> None:
        self.b.checkpoint_saved.emit(e.snap, str(e.path), int(e.size), float(e.seconds), int(e.kind))

    def on_conversation_deleted(self, e: ev.ConversationDeleted) -> None:
        self.b.conversation_deleted.emit(e.conv_id)

    def on_conversation_activated(self, e: ev.ConversationActivated) -> None:
        self.b.conversation_activated.emit(e.conv_id, bool(e.resident), int(e.n_restored), float(e.seconds))

    def on_notice(self, e: ev.Notice) -> None:
        self.b.notice_posted.emit(e.title, e.message)

    def on_context_full(self, e: ev.NoRoomToAnswer) -> None:
        self.b.context_full.emit(e.conv_id, e.text, e.message)

    def on_exported(self, e: ev.Exported) -> None:
        self.b.checkpoint_exported.emit(str(e.source), str(e.target))

    def on_error(self, e: ev.Failed) -> None:
        self.b.engine_failed.emit(e.action, e.message, e.conv_id)

    def on_stopped(self, e: ev.Stopped) -> None:
        self.b.engine_stopped.emit()


class EngineBridge(QObject):
    """Qt face of the engine thread.

    Signals:
        model_loading(float): fraction of the weights loaded.
        conversations_left(tuple[LeftConversation, ...]): just before model_loaded, the
            conversations the engine closed because the model loaded is another one (each
            stays in the store as a conversation of the model that made it).
        model_loaded(ModelInfo)
        model_failed(str)
        conversation_changed(ConversationSnapshot): opened, created, renamed.
        generation_started(ConversationSnapshot)
        prefill_progressed(UUID, int, int): prompt tokens decoded of the total.
        tokens_generated(UUID, str): a batch of new answer text.
        progress_updated(UUID, int, int, float): tokens in the context, tokens generated in
            this answer, tokens/s so far; after the batch of text it goes with.
        generation_finished(GenerationSummary): after the last tokens_generated.
        checkpoint_saving(UUID, int): a save of that kind began.
        checkpoint_saved(ConversationSnapshot, str, int, float, int): path, size, seconds, kind.
        conversation_deleted(UUID): its files are gone (all that no other head needs).
        conversation_activated(UUID, bool, int, float): a conversation switched to is ready
            in the cache: resident (nothing restored), else tokens restored and seconds.
        checkpoint_exported(str, str): a checkpoint was written as one file (source, target).
        notice_posted(str, str): something the user should know once (title, sentence).
        context_full(UUID, str, str): a message did not fit (its text, the explanation);
            nothing was generated: offer EngineWorker.send_in_new_branch.
        engine_failed(Action, str, UUID | None): what failed (engine.commands.Action: a front
            end tells failures apart by it), why, and the conversation it was about (None:
            not one conversation's).
        engine_stopped(): the engine thread saved what it had to and exited.
    """

    model_loading = Signal(float)
    conversations_left = Signal(object)
    model_loaded = Signal(object)
    model_failed = Signal(str)
    conversation_changed = Signal(object)
    generation_started = Signal(object)
    prefill_progressed = Signal(object, int, int)
    tokens_generated = Signal(object, str)
    progress_updated = Signal(object, int, int, float)
    generation_finished = Signal(object)
    checkpoint_saving = Signal(object, int)
    checkpoint_saved = Signal(object, str, int, float, int)
    conversation_deleted = Signal(object)
    conversation_activated = Signal(object, bool, int, float)
    checkpoint_exported = Signal(str, str)
    notice_posted = Signal(str, str)
    context_full = Signal(object, str, str)
    engine_failed = Signal(object, str, object)
    engine_stopped = Signal()

    _text_pending = Signal()
    _finished_raw = Signal(object)

    def __init__(self, store, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._lock = threading.Lock()
        self._pending: list[tuple[uuid.UUID, str]] = []
        self._progress: dict[uuid.UUID, tuple[int, int, float]] = {}
        self._flush_posted = False
        self.worker = EngineWorker(_Listener(self), store)
        # Explicitly queued: emitted on the engine thread, delivered on the UI thread.
        self._text_pending.connect(self._on_engine_text_pending, Qt.ConnectionType.QueuedConnection)
        self._finished_raw.connect(self._on_engine_finished, Qt.ConnectionType.QueuedConnection)
        self.model_info: ModelInfo | None = None
        self.model_loaded.connect(self._remember_model, Qt.ConnectionType.QueuedConnection)

    # -- token batching -----------------------------------------------------------------------
    def _buffer_text(self, conv_id: uuid.UUID, delta: str) -> None:
        with self._lock:
            self._pending.append((conv_id, delta))
            post = not self._flush_posted
            self._flush_posted = True
        if post:
            self._text_pending.emit()

    def _buffer_progress(self, conv_id: uuid.UUID, n_tokens: int, n_generated: int,
                         tokens_per_s: float) -> None:
        with self._lock:
            self._progress[conv_id] = (n_tokens, n_generated, tokens_per_s)
            post = not self._flush_posted
            self._flush_posted = True
        if post:
            self._text_pending.emit()

    @Slot()
    def _on_engine_text_pending(self) -> None:
        self.flush_text()

    def flush_text(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            progress, self._progress = self._progress, {}
            self._flush_posted = False
        merged: list[list] = []
        for conv_id, delta in pending:
            if merged and merged[-1][0] == conv_id:
                merged[-1][1] += delta
            else:
                merged.append([conv_id, delta])
        for conv_id, text in merged:
            self.tokens_generated.emit(conv_id, text)
        for conv_id, (n_tokens, n_generated, speed) in progress.items():
            self.progress_updated.emit(conv_id, n_tokens, n_generated, speed)

    @Slot(object)
    def _on_engine_finished(self, summary: GenerationSummary) -> None:
        self.flush_text()  # the answer's last text arrives before the finish
        self.generation_finished.emit(summary)

    @Slot(object)
    def _remember_model(self, info: ModelInfo) -> None:
        self.model_info = info

    # -- commands: thin, documented pass-throughs ----------------------------------------------
    def start(self) -> None:
        self.worker.start()

    def load_model(self, options: ModelOptions) -> None:
        self.worker.load_model(options)

    @property
    def generating(self) -> bool:
        return self.worker.generating

    def pause(self, conv_id: uuid.UUID | None = None) -> None:
        """Pause ``conv_id``'s answer (None: every answer)."""
        self.worker.pause(conv_id)

    def shutdown(self) -> None:
        self.worker.shutdown(save=True)
