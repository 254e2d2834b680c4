"""Pause and save when the user, the console or the session ends the process.

Everything that may end a Checkpoint Chat process calls one function,
``request_pause_and_save(reason)``, and then gives the save a bounded time to finish:

=====================  ===========================  ==========================================
event                  how it arrives               what the OS allows
=====================  ===========================  ==========================================
Ctrl+C / SIGINT        signal handler, main thread  unlimited; a 2nd Ctrl+C leaves at once
SIGTERM                signal handler, main thread  until the sender's patience (systemd: 90 s)
Ctrl+Break / SIGBREAK  console handler or signal    unlimited
CTRL_CLOSE_EVENT       console handler, own thread  ~5 s, then Windows kills the process
CTRL_LOGOFF_EVENT      console handler, own thread  ~5 s (console processes only)
CTRL_SHUTDOWN_EVENT    console handler, own thread  ~5 s (console processes only)
=====================  ===========================  ==========================================

Signal handlers run on the main thread, which in the CLI is also the thread that
generates and saves, so they must *not* wait: they request the pause and return, and
the generation loop saves at its next token boundary.  The Windows console handler
(``SetConsoleCtrlHandler``) runs on a thread the system creates, and for the close,
logoff and shutdown events the process is terminated the moment it returns: it waits
(at most ``close_wait_s``) for :meth:`ShutdownGuard.save_finished`.  When the save does
not finish in time, the last autosave is what remains, which is why autosave exists.

A GUI process (one that loaded user32) gets no logoff/shutdown console events; Qt's
``commitDataRequest`` / ``aboutToQuit`` cover those in gui/, calling the same function.

Every OS object is a parameter (``signals``, ``kernel32``, ``functype``, ``platform``)
so each path runs on Linux in tests with fakes.  Pure Python; no Qt.
"""

from __future__ import annotations

import ctypes
import logging
import signal as _signal
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger("engine")

# wincon.h
CTRL_C_EVENT = 0
CTRL_BREAK_EVENT = 1
CTRL_CLOSE_EVENT = 2
CTRL_LOGOFF_EVENT = 5
CTRL_SHUTDOWN_EVENT = 6

CONSOLE_EVENTS = {CTRL_C_EVENT: "ctrl-c", CTRL_BREAK_EVENT: "ctrl-break",
                  CTRL_CLOSE_EVENT: "console-close", CTRL_LOGOFF_EVENT: "logoff",
                  CTRL_SHUTDOWN_EVENT: "shutdown"}
#: Events after which Windows ends the process as soon as the handler returns.
TERMINAL_EVENTS = frozenset({CTRL_CLOSE_EVENT, CTRL_LOGOFF_EVENT, CTRL_SHUTDOWN_EVENT})

#: Windows allows ~5 s (HungAppTimeout / WaitToKillAppTimeout defaults) after
#: CTRL_CLOSE; leave half a second for the process to unwind.
DEFAULT_CLOSE_WAIT_S = 4.5

SIGNAL_NAMES = ("SIGINT", "SIGTERM", "SIGBREAK")

#: ``request_pause_and_save(reason)``; may be called from any thread.  Return False
#: when there is nothing to save (no wait follows); anything else means a save is on
#: its way and :meth:`ShutdownGuard.save_finished` will be called.
PauseAndSave = Callable[[str], Any]


class ShutdownGuard:
    """Routes every end-of-process event to one pause-and-save request.

    Use as a context manager around the work (or :meth:`install` / :meth:`uninstall`).
    After the request, :attr:`reason` names what ended the process and
    :attr:`exit_status` is the conventional status (130 for Ctrl+C, 143 for SIGTERM).
    """

    def __init__(self, request_pause_and_save: PauseAndSave, *,
                 close_wait_s: float = DEFAULT_CLOSE_WAIT_S,
                 platform: str = sys.platform,
                 signals: Any = _signal,
                 kernel32: Any = None,
                 functype: Callable[..., Any] | None = None,
                 second_interrupt: Callable[[], None] | None = None) -> None:
        self._request = request_pause_and_save
        self.close_wait_s = close_wait_s
        self._platform = platform
        self._signals = signals
        self._kernel32 = kernel32
        self._functype = functype
        self._second = second_interrupt or _raise_keyboard_interrupt
        self._lock = threading.Lock()
        self._saved = threading.Event()
        self._previous: dict[int, Any] = {}
        self._routine = None          # HandlerRoutine: referenced while Windows may call it
        self.reason: str | None = None
        self.exit_status = 0
        self.waited_s: float | None = None

    # -- the one request ----------------------------------------------------------------------
    def request(self, reason: str, exit_status: int) -> bool:
        """Ask once for a pause and save; True if this call made the request.

        Returns whether a save is expected (False: the callback said nothing to save).
        """
        with self._lock:
            first = self.reason is None
            if first:
                self.reason, self.exit_status = reason, exit_status
        if not first:
            return not self._saved.is_set()
        log.info("%s: pausing and saving", reason)
        try:
            expect_save = self._request(reason) is not False
        except Exception:  # the handler must survive a failing callback, and so must we
            log.exception("pause-and-save request failed")
            expect_save = False
        if not expect_save:
            self._saved.set()
        return expect_save

    def save_finished(self) -> None:
        """The engine calls this when the save is written (or has failed for good)."""
        self._saved.set()

    def wait_for_save(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`save_finished` or the timeout; True if the save finished."""
        start = time.monotonic()
        done = self._saved.wait(self.close_wait_s if timeout_s is None else timeout_s)
        self.waited_s = time.monotonic() - start
        if not done:
            log.warning("%s: the save did not finish within %.1f s; the last autosave remains",
                        self.reason, self.waited_s)
        return done

    @property
    def requested(self) -> bool:
        return self.reason is not None

    # -- POSIX-style signals (main thread) -------------------------------------------------------
    def _on_signal(self, signum: int, _frame) -> None:
        name = _signal_name(self._signals, signum)
        if self.requested and signum != getattr(self._signals, "SIGTERM", None):
            self._second()  # a second Ctrl+C while saving: leave now, the autosave remains
            return
        self.request(name, 128 + signum)

    # -- Windows console events (a thread of their own) -----------------------------------------------
    def _on_console_event(self, event: int) -> int:
        reason = CONSOLE_EVENTS.get(event)
        if reason is None:
            return 0  # not ours: let the next handler (Python's own) see it
        if event in (CTRL_C_EVENT, CTRL_BREAK_EVENT):
            if self.requested:
                # second Ctrl+C: hand it to Python's default handler (KeyboardInterrupt)
                return 0
            self.request(reason, 130 if event == CTRL_C_EVENT else 149)
            return 1
        self.request(reason, 128 + 1)  # SIGHUP's status: the terminal went away
        self.wait_for_save()
        return 1

    # -- install / uninstall -------------------------------------------------------------------
    def install(self) -> "ShutdownGuard":
        if threading.current_thread() is threading.main_thread():
            for name in SIGNAL_NAMES:
                signum = getattr(self._signals, name, None)
                if signum is None:
                    continue  # SIGBREAK exists on Windows only
                try:
                    self._previous[signum] = self._signals.signal(signum, self._on_signal)
                except (OSError, ValueError, RuntimeError) as exc:
                    log.debug("cannot handle %s: %s", name, exc)
        else:
            log.warning("shutdown guard installed off the main thread: signals not handled")
        if self._platform == "win32":
            self._install_console_handler()
        return self

    def _install_console_handler(self) -> None:
        kernel32 = self._kernel32 or ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
        functype = self._functype or ctypes.WINFUNCTYPE  # type: ignore[attr-defined]
        # BOOL WINAPI HandlerRoutine(DWORD dwCtrlType)
        routine_type = functype(ctypes.c_int, ctypes.c_uint32)
        self._routine = routine_type(self._on_console_event)
        # BOOL WINAPI SetConsoleCtrlHandler(PHANDLER_ROUTINE HandlerRoutine, BOOL Add)
        if not kernel32.SetConsoleCtrlHandler(self._routine, 1):
            log.warning("SetConsoleCtrlHandler failed; console close will not save")
            self._routine = None

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            try:
                self._signals.signal(signum, previous if previous is not None else self._signals.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass
        self._previous.clear()
        if self._routine is not None:
            kernel32 = self._kernel32 or ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
            kernel32.SetConsoleCtrlHandler(self._routine, 0)
            # Keep the routine object: Windows may be calling it on another thread
            # right now; it is freed with the guard.

    def __enter__(self) -> "ShutdownGuard":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


def _signal_name(signals: Any, signum: int) -> str:
    for name in SIGNAL_NAMES:
        if getattr(signals, name, None) == signum:
            return name
    return f"signal {signum}"


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt
