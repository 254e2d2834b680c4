"""Saving when the session ends: sign-out, shutdown, restart, an installer's Restart Manager.

Qt on Windows turns WM_QUERYENDSESSION into ``QGuiApplication.commitDataRequest``,
emitted on the UI thread while Windows waits for the answer (about 5 s before it offers
to end the app), and WM_ENDSESSION into ``aboutToQuit`` + ``quit()``, after which
Windows ends the process.  No window gets a ``closeEvent``, so the main window's own
pause-and-save-on-close never runs.  :class:`SessionEndSaver` answers
``commitDataRequest`` (connected directly: the work must happen inside the request)
with the same pause-and-save path as closing the window, ``bridge.shutdown()``, and
waits for the engine thread to report ``engine_stopped`` for at most
:data:`SESSION_END_WAIT_S`.  An answer in progress is thus saved as an exit checkpoint,
not only up to its last autosave; when the wait runs out, the last autosave is what
remains, as after a crash.

The engine is stopped for good, so the window then closes itself (posted, after the
request): if the session end is cancelled after all, the app has exited having saved,
and the next start lists the conversation as paused.  Session managers on Linux (XSMP)
and macOS reach the same signal when the session ends.

The signals and the worker's state are all this module uses: ``window.bridge`` (its
``shutdown()`` and ``engine_stopped``) and ``window.worker.alive`` / ``.generating``.
"""

from __future__ import annotations

import logging
import threading
import time

from PySide6.QtCore import QObject, Qt, QTimer, Slot
from PySide6.QtGui import QGuiApplication, QSessionManager

log = logging.getLogger("gui")

#: Windows allows ~5 s for WM_QUERYENDSESSION; half a second is left to answer it.
SESSION_END_WAIT_S = 4.5


class SessionEndSaver(QObject):
    """Pauses, saves and stops the engine when the session manager asks for the data.

    After :meth:`save_for_session_end`, :attr:`outcome` says what happened:
    ``"idle"`` (no engine running: nothing to do), ``"saved"`` or ``"timed out"``.
    """

    def __init__(self, window, *, wait_s: float = SESSION_END_WAIT_S,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._window = window
        self.wait_s = wait_s
        self._stopped = threading.Event()
        self.outcome: str | None = None
        self.waited_s: float | None = None
        # emitted on the engine thread; a direct connection sets the event there, since
        # the UI thread is busy waiting on it and would never run a queued slot
        window.bridge.engine_stopped.connect(self._on_bridge_engine_stopped,
                                             Qt.ConnectionType.DirectConnection)

    def connect_to(self, app: QGuiApplication) -> None:
        """Answer ``app``'s commitDataRequest (directly, as Qt's documentation asks)."""
        app.commitDataRequest.connect(self._on_app_commit_data_request,
                                      Qt.ConnectionType.DirectConnection)

    @Slot()
    def _on_bridge_engine_stopped(self) -> None:
        self._stopped.set()

    @Slot(QSessionManager)
    def _on_app_commit_data_request(self, _manager) -> None:
        self.save_for_session_end()

    def save_for_session_end(self) -> bool:
        """Pause a running answer, save, stop the engine; wait at most ``wait_s``.

        True when nothing was left unsaved (saved in time, or no engine running).
        """
        worker = self._window.worker
        if self._stopped.is_set() or not worker.alive:
            self.outcome = "idle"
            return True
        generating = worker.generating
        log.info("the session is ending: pausing%s and saving", " the answer" if generating else "")
        start = time.monotonic()
        self._window.bridge.shutdown()
        saved = self._stopped.wait(self.wait_s)
        self.waited_s = time.monotonic() - start
        self.outcome = "saved" if saved else "timed out"
        if saved:
            log.info("saved for the session end in %.2f s", self.waited_s)
        else:
            log.warning("the session is ending and the save did not finish within %.1f s; "
                        "the last autosave remains", self.wait_s)
        QTimer.singleShot(0, self._window.close)   # the engine is gone: so is the window
        return saved
