"""The desktop app's save at sign-out, shutdown and upgrade (issue 15, item 1).

Qt delivers WM_QUERYENDSESSION as ``commitDataRequest`` on the UI thread and no
closeEvent follows.  Here the request is made as Qt makes it: the saver's slot is
called on the UI thread while the engine thread works, first with a stand-in engine
(an engine thread that saves, one that hangs, none at all), then with the real window,
the real model and an answer in progress.

What only Windows can prove (installer/README.md): that signing out with an answer
streaming really reaches this path and Windows waits the ~4.5 s.
"""

from __future__ import annotations

import threading

import pytest
from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QWidget

from gui.session_end import SESSION_END_WAIT_S, SessionEndSaver


class StandInBridge(QObject):
    """The two pieces of EngineBridge the saver uses; its 'engine' is a real thread."""
    engine_stopped = Signal()

    def __init__(self, worker, save_s: float | None) -> None:
        super().__init__()
        self.worker, self.save_s = worker, save_s
        self.shutdowns = 0
        self.release = threading.Event()

    def shutdown(self) -> None:
        self.shutdowns += 1

        def engine_thread():
            if self.save_s is None:
                self.release.wait(60)          # a save that hangs
                return
            self.worker.generating = False     # paused at a token boundary, saved
            self.worker.alive = False
            self.engine_stopped.emit()         # from this thread, as the real bridge does
        threading.Thread(target=engine_thread, daemon=True).start()


class StandInWorker:
    def __init__(self, alive=True, generating=True) -> None:
        self.alive, self.generating = alive, generating


class StandInWindow(QWidget):
    def __init__(self, *, alive=True, generating=True, save_s: float | None = 0.0) -> None:
        super().__init__()
        self.worker = StandInWorker(alive, generating)
        self.bridge = StandInBridge(self.worker, save_s)


def test_an_answer_in_progress_is_saved_before_the_request_returns(qtbot):
    window = StandInWindow()
    qtbot.addWidget(window)
    window.show()
    saver = SessionEndSaver(window)
    saver._on_app_commit_data_request(None)            # what Qt calls for WM_QUERYENDSESSION
    assert window.bridge.shutdowns == 1
    assert saver.outcome == "saved", "the engine thread's signal reached the waiting UI thread"
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=5000)   # the engine is gone: so is the window


def test_the_wait_is_bounded_when_the_save_hangs(qtbot):
    window = StandInWindow(save_s=None)
    qtbot.addWidget(window)
    saver = SessionEndSaver(window, wait_s=0.3)
    assert saver.save_for_session_end() is False
    assert saver.outcome == "timed out" and saver.waited_s >= 0.3
    window.bridge.release.set()


def test_no_engine_means_nothing_to_wait_for(qtbot):
    window = StandInWindow(alive=False, generating=False)
    qtbot.addWidget(window)
    saver = SessionEndSaver(window, wait_s=600)
    assert saver.save_for_session_end() is True
    assert saver.outcome == "idle" and window.bridge.shutdowns == 0


def test_an_engine_that_already_stopped_is_not_asked_again(qtbot):
    window = StandInWindow()
    qtbot.addWidget(window)
    saver = SessionEndSaver(window, wait_s=600)
    window.bridge.engine_stopped.emit()                 # e.g. the window was closing already
    assert saver.save_for_session_end() is True and window.bridge.shutdowns == 0


def test_the_saver_answers_the_applications_commit_data_request(qtbot, qapp):
    from PySide6.QtCore import SIGNAL
    signature = SIGNAL("commitDataRequest(QSessionManager&)")
    window = StandInWindow()
    qtbot.addWidget(window)
    before = qapp.receivers(signature)
    saver = SessionEndSaver(window, parent=window)
    saver.connect_to(qapp)
    assert qapp.receivers(signature) == before + 1
    assert isinstance(qapp, QGuiApplication)
    assert SESSION_END_WAIT_S < 5.0, "Windows gives WM_QUERYENDSESSION about 5 s"


def test_app_main_connects_the_saver():
    """gui.app.main builds the saver and connects it (read from its source: main runs a loop)."""
    import inspect

    import gui.app
    source = inspect.getsource(gui.app.main)
    assert "SessionEndSaver(window" in source and ".connect_to(app)" in source


# -- the real window, the real model ---------------------------------------------------------------

@pytest.fixture
def real_window(make_window):
    return make_window(n_predict=200)


def test_session_end_with_an_answer_streaming_saves_an_exit_checkpoint(qtbot, real_window):
    from pathlib import Path

    from engine.checkpoints.format import KIND_EXIT
    w = real_window
    saves = []
    w.bridge.checkpoint_saved.connect(lambda *args: saves.append(args))
    saver = SessionEndSaver(w, wait_s=60)   # generous here: the machine is shared
    with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
        w.prompt_edit.setFocus()
        qtbot.keyClicks(w.prompt_edit, "Write a long story about a dragon who guards a library.")
        qtbot.keyClick(w.prompt_edit, Qt.Key.Key_Return)
    assert w.worker.generating
    assert saver.save_for_session_end() is True, "saved and stopped before answering Windows"
    assert saver.outcome == "saved"
    assert w.worker.join(10), "the engine thread ends right after reporting"
    qtbot.waitUntil(lambda: any(args[4] == KIND_EXIT for args in saves), timeout=10_000)
    exit_save = next(args for args in saves if args[4] == KIND_EXIT)
    assert Path(exit_save[1]).is_file()
    assert exit_save[0].paused, "the answer was paused mid-way, not finished"
    qtbot.waitUntil(lambda: not w.isVisible(), timeout=10_000)
