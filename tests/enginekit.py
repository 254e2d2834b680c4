"""What tests of the engine thread and of the window share: a recording listener, and
windows made and closed the same way everywhere (real model, offscreen)."""

from __future__ import annotations

import threading

from engine.worker import WorkerListener

#: Settings of every test window: a small context, two threads, a fixed seed.
WINDOW_SEED = 1234


class Recorder(WorkerListener):
    """Records the engine thread's events as ("kind", ...) tuples; waits for them."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.cond = threading.Condition()

    def _add(self, *event) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def on_model_loaded(self, e):
        self._add("loaded", e.info, e.left)

    def on_generation_started(self, e):
        self._add("started", e.snap)

    def on_generation_finished(self, summary):
        self._add("finished", summary)

    def on_conversation_activated(self, e):
        self._add("activated", e.conv_id, e.resident, e.n_restored)

    def on_checkpoint_saved(self, e):
        self._add("saved", e.snap, e.path, e.kind)

    def on_conversation_changed(self, e):
        self._add("changed", e.snap)

    def on_text(self, e):
        self._add("text", e.conv_id, e.delta)

    def on_error(self, e):
        self._add("error", e.action, e.message, e.conv_id)

    def on_stopped(self, e):
        self._add("stopped")

    def wait(self, kind: str, count: int = 1, timeout: float = 300) -> list[tuple]:
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.of(kind)) >= count, timeout)
        assert ok, f"no {kind!r} event: {self.events}"
        return self.of(kind)

    def next(self, kind: str, timeout: float = 300) -> tuple:
        """The next event of ``kind`` after those already recorded."""
        return self.wait(kind, len(self.of(kind)) + 1, timeout)[-1]

    def of(self, kind: str) -> list[tuple]:
        with self.cond:
            return [e for e in self.events if e[0] == kind]

    def finished_for(self, conv_id, count: int = 1, timeout: float = 300):
        """The ``count``-th summary of ``conv_id``'s answers (waits for it)."""
        def mine():
            return [e[1] for e in self.of("finished") if e[1].conversation_id == conv_id]
        with self.cond:
            ok = self.cond.wait_for(lambda: len(mine()) >= count, timeout)
        assert ok, f"no finished answer #{count} of {conv_id}: {self.events}"
        return mine()[count - 1]

    def head_saved(self, conv_id, count: int = 1, timeout: float = 300) -> tuple:
        """The ``count``-th head (a save that is no autosave) of ``conv_id``: an answer's
        head is written after its "finished" event, so a test reading the store waits
        for this instead."""
        from engine.checkpoints.format import KIND_AUTOSAVE

        def mine():
            return [e for e in self.of("saved") if e[1].id == conv_id and e[3] != KIND_AUTOSAVE]
        with self.cond:
            ok = self.cond.wait_for(lambda: len(mine()) >= count, timeout)
        assert ok, f"no head #{count} of {conv_id} was saved: {self.events}"
        return mine()[count - 1]

    def text_of(self, conv_id) -> str:
        return "".join(e[2] for e in self.of("text") if e[1] == conv_id)


def window_settings(**overrides):
    """AppSettings for a test window (overrides by attribute name)."""
    from gui.settings import AppSettings
    s = AppSettings()
    s.n_ctx, s.n_threads, s.seed = 1024, 2, WINDOW_SEED
    s.temperature, s.autosave_every = 0.8, 0
    for key, value in overrides.items():
        setattr(s, key, value)
    return s


def close_windows(windows) -> None:
    """Stop each window's engine thread and close it without the save-on-close wait."""
    for w in windows:
        if w.worker.alive:
            w.worker.shutdown()
            w.worker.join(60)
        w._close_done = True
        w.close()
        w.deleteLater()


def record_saves(w) -> None:
    """Keep every non-autosave checkpoint the window is told about (see wait_saved)."""
    w._test_saves, w._test_seen_saves = [], 0
    w.bridge.checkpoint_saved.connect(lambda *args: args[4] != 2 and w._test_saves.append(args))
