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
CTRL_LOGOFF_EVENT      console handler, own thread  ~5 s (only if user32/gdi32 never loaded)
CTRL_SHUTDOWN_EVENT    console handler, own thread  ~5 s (only if user32/gdi32 never loaded)
WM_QUERYENDSESSION     hidden window, own thread    ~5 s to answer; we agree and request
WM_ENDSESSION          hidden window, own thread    ended once every window has answered
=====================  ===========================  ==========================================

Signal handlers run on the main thread, which in the CLI is also the thread that
generates and saves, so they must *not* wait: they request the pause and return, and
the generation loop saves at its next token boundary.  The Windows console handler
(``SetConsoleCtrlHandler``) runs on a thread the system creates, and for the close,
logoff and shutdown events the process is terminated the moment it returns: it waits
(at most ``close_wait_s``) for :meth:`ShutdownGuard.save_finished`.  When the save does
not finish in time, the last autosave is what remains, which is why autosave exists.

Windows treats a console process that has loaded user32.dll or gdi32.dll (Python's
ctypes, Qt, a CUDA runtime: nearly always, for us) as a windowed one: its console
handler no longer gets CTRL_LOGOFF_EVENT / CTRL_SHUTDOWN_EVENT, and it learns about a
sign-out, shutdown or Restart Manager request (an installer replacing its files) only
through WM_QUERYENDSESSION / WM_ENDSESSION sent to its top-level windows.  So on Windows
the guard also runs :class:`SessionEndWindow`: a hidden top-level window (not a
message-only one, which gets no broadcasts) on a thread with its own message loop.
WM_QUERYENDSESSION requests the pause and answers TRUE at once; WM_ENDSESSION waits
(at most ``close_wait_s``) for the save, since the process ends when it returns.

The desktop app does the same through Qt (``commitDataRequest``), in gui/session_end.py.

Every OS object is a parameter (``signals``, ``kernel32``, ``user32``, ``functype``,
``platform``) so each path runs on Linux in tests with fakes.  Pure Python; no Qt.
"""

from __future__ import annotations

import ctypes
import logging
import signal as _signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

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

# winuser.h
WM_DESTROY = 0x0002
WM_CLOSE = 0x0010
WM_QUERYENDSESSION = 0x0011
WM_ENDSESSION = 0x0016
ENDSESSION_CLOSEAPP = 0x00000001      # Restart Manager: an installer needs our files
ENDSESSION_LOGOFF = 0x80000000
HWND_MESSAGE = -3                     # a message-only window's parent: gets no broadcasts

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
    On Windows, installing also registers the console handler and starts the hidden
    :class:`SessionEndWindow` (:attr:`session_window`, None if it could not be made).
    After the request, :attr:`reason` names what ended the process and
    :attr:`exit_status` is the conventional status (130 for Ctrl+C, 143 for SIGTERM,
    129 when the console or the session went away).
    """

    def __init__(self, request_pause_and_save: PauseAndSave, *,
                 close_wait_s: float = DEFAULT_CLOSE_WAIT_S,
                 platform: str = sys.platform,
                 signals: Any = _signal,
                 kernel32: Any = None,
                 user32: Any = None,
                 functype: Callable[..., Any] | None = None,
                 second_interrupt: Callable[[], None] | None = None) -> None:
        self._request = request_pause_and_save
        self.close_wait_s = close_wait_s
        self._platform = platform
        self._signals = signals
        self._kernel32 = kernel32
        self._user32 = user32
        self._functype = functype
        self._second = second_interrupt or _raise_keyboard_interrupt
        self._lock = threading.Lock()
        self._saved = threading.Event()
        self._previous: dict[int, Any] = {}
        self._routine = None          # HandlerRoutine: referenced while Windows may call it
        self.session_window: SessionEndWindow | None = None
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
    def install(self) -> ShutdownGuard:
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
            self._start_session_window()
        return self

    def _start_session_window(self) -> None:
        try:
            window = SessionEndWindow(self, user32=self._user32, kernel32=self._kernel32,
                                      functype=self._functype)
            if window.start():
                self.session_window = window
        except Exception:   # no window: console events and signals still work
            log.warning("no hidden window for sign-out/shutdown; those will not save",
                        exc_info=True)

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
        if self.session_window is not None:
            self.session_window.stop()
            self.session_window = None
        for signum, previous in self._previous.items():
            try:
                self._signals.signal(signum, previous if previous is not None else self._signals.SIG_DFL)
            except (OSError, ValueError, RuntimeError):
                pass
        self._previous.clear()
        if self._routine is not None:
            kernel32 = self._kernel32 or ctypes.WinDLL("kernel32", use_last_error=True)
            kernel32.SetConsoleCtrlHandler(self._routine, 0)
            # Keep the routine object: Windows may be calling it on another thread
            # right now; it is freed with the guard.

    def __enter__(self) -> ShutdownGuard:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


class _WNDCLASSEXW(ctypes.Structure):
    _fields_ = [("cbSize", ctypes.c_uint), ("style", ctypes.c_uint),
                ("lpfnWndProc", ctypes.c_void_p), ("cbClsExtra", ctypes.c_int),
                ("cbWndExtra", ctypes.c_int), ("hInstance", ctypes.c_void_p),
                ("hIcon", ctypes.c_void_p), ("hCursor", ctypes.c_void_p),
                ("hbrBackground", ctypes.c_void_p), ("lpszMenuName", ctypes.c_wchar_p),
                ("lpszClassName", ctypes.c_wchar_p), ("hIconSm", ctypes.c_void_p)]


class _MSG(ctypes.Structure):
    _fields_ = [("hwnd", ctypes.c_void_p), ("message", ctypes.c_uint),
                ("wParam", ctypes.c_size_t), ("lParam", ctypes.c_ssize_t),
                ("time", ctypes.c_uint32), ("pt_x", ctypes.c_int32), ("pt_y", ctypes.c_int32),
                ("lPrivate", ctypes.c_uint32)]


def _declare_user32(user32) -> None:
    """Argument types for the real user32 (64-bit handles and LPARAMs must not be cut)."""
    c = ctypes
    # ATOM RegisterClassExW(const WNDCLASSEXW *); BOOL UnregisterClassW(LPCWSTR, HINSTANCE)
    user32.RegisterClassExW.argtypes, user32.RegisterClassExW.restype = [c.c_void_p], c.c_ushort
    user32.UnregisterClassW.argtypes, user32.UnregisterClassW.restype = [c.c_wchar_p, c.c_void_p], c.c_int
    # HWND CreateWindowExW(DWORD, LPCWSTR, LPCWSTR, DWORD, int x, int y, int w, int h,
    #                      HWND parent, HMENU, HINSTANCE, LPVOID)
    user32.CreateWindowExW.argtypes = [c.c_uint32, c.c_wchar_p, c.c_wchar_p, c.c_uint32, c.c_int,
                                       c.c_int, c.c_int, c.c_int, c.c_void_p, c.c_void_p,
                                       c.c_void_p, c.c_void_p]
    user32.CreateWindowExW.restype = c.c_void_p
    # LRESULT DefWindowProcW(HWND, UINT, WPARAM, LPARAM)
    user32.DefWindowProcW.argtypes = [c.c_void_p, c.c_uint, c.c_size_t, c.c_ssize_t]
    user32.DefWindowProcW.restype = c.c_ssize_t
    # BOOL GetMessageW(LPMSG, HWND, UINT, UINT); TranslateMessage / DispatchMessageW(const MSG *)
    user32.GetMessageW.argtypes, user32.GetMessageW.restype = [c.c_void_p, c.c_void_p, c.c_uint, c.c_uint], c.c_int
    user32.TranslateMessage.argtypes = [c.c_void_p]
    user32.DispatchMessageW.argtypes, user32.DispatchMessageW.restype = [c.c_void_p], c.c_ssize_t
    # BOOL PostMessageW(HWND, UINT, WPARAM, LPARAM); BOOL DestroyWindow(HWND); void PostQuitMessage(int)
    user32.PostMessageW.argtypes, user32.PostMessageW.restype = [c.c_void_p, c.c_uint, c.c_size_t, c.c_ssize_t], c.c_int
    user32.DestroyWindow.argtypes, user32.DestroyWindow.restype = [c.c_void_p], c.c_int
    user32.PostQuitMessage.argtypes, user32.PostQuitMessage.restype = [c.c_int], None


class SessionEndWindow:
    """A hidden top-level window, on a thread of its own, that saves at session end.

    WM_QUERYENDSESSION: request the pause (the reason says logoff, shutdown or
    restart-manager) and answer TRUE at once, so the save starts while other windows
    are asked.  WM_ENDSESSION with wParam TRUE: wait for the save (the guard's bounded
    wait) and return, after which Windows ends the process; with FALSE the session goes
    on and nothing waits.  :meth:`stop` closes the window from any thread.
    """

    CLASS_NAME = "CheckpointChatSessionEnd"

    def __init__(self, guard: ShutdownGuard, *, user32: Any = None, kernel32: Any = None,
                 functype: Callable[..., Any] | None = None) -> None:
        self._guard = guard
        if user32 is None:
            user32 = ctypes.WinDLL("user32", use_last_error=True)  # type: ignore[attr-defined]
            _declare_user32(user32)
        if kernel32 is None:
            kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
            kernel32.GetModuleHandleW.argtypes = [ctypes.c_wchar_p]
            kernel32.GetModuleHandleW.restype = ctypes.c_void_p
        self._user32, self._kernel32 = user32, kernel32
        functype = functype or ctypes.WINFUNCTYPE  # type: ignore[attr-defined]
        # LRESULT CALLBACK WindowProc(HWND, UINT, WPARAM, LPARAM)
        proc_type = functype(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_uint,
                             ctypes.c_size_t, ctypes.c_ssize_t)
        self._proc = proc_type(self._window_proc)   # referenced while the window exists
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.hwnd: int | None = None
        self.error: str | None = None

    def start(self, timeout_s: float = 5.0) -> bool:
        """Create the window on its thread; True once it exists and its loop runs."""
        self._thread = threading.Thread(target=self._run, name="session-end-window", daemon=True)
        self._thread.start()
        self._ready.wait(timeout_s)
        if not self.hwnd:
            log.warning("hidden session window not created: %s", self.error or "timed out")
        return bool(self.hwnd)

    def stop(self, timeout_s: float = 2.0) -> None:
        if self.hwnd and self._thread is not None and self._thread.is_alive():
            self._user32.PostMessageW(self.hwnd, WM_CLOSE, 0, 0)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        u32 = self._user32
        try:
            instance = self._kernel32.GetModuleHandleW(None)
            wc = _WNDCLASSEXW(cbSize=ctypes.sizeof(_WNDCLASSEXW),
                              lpfnWndProc=ctypes.cast(self._proc, ctypes.c_void_p).value,
                              hInstance=instance, lpszClassName=self.CLASS_NAME)
            if not u32.RegisterClassExW(ctypes.byref(wc)):
                self.error = f"RegisterClassExW failed (error {_last_error()})"
                return
            # extended style 0 and no WS_VISIBLE: hidden; parent NULL, not HWND_MESSAGE:
            # top-level, so the end-session broadcasts reach it
            self.hwnd = u32.CreateWindowExW(0, self.CLASS_NAME, "Checkpoint Chat", 0, 0, 0, 0, 0,
                                            None, None, instance, None)
            if not self.hwnd:
                self.error = f"CreateWindowExW failed (error {_last_error()})"
                u32.UnregisterClassW(self.CLASS_NAME, instance)
                return
        except Exception as exc:  # reported by start(); the guard goes on without the window
            self.error = repr(exc)
            return
        finally:
            self._ready.set()
        msg = _MSG()
        while u32.GetMessageW(ctypes.byref(msg), None, 0, 0) > 0:
            u32.TranslateMessage(ctypes.byref(msg))
            u32.DispatchMessageW(ctypes.byref(msg))
        u32.UnregisterClassW(self.CLASS_NAME, instance)

    def _window_proc(self, hwnd, message, wparam, lparam) -> int:
        try:
            if message == WM_QUERYENDSESSION:
                self._guard.request(_session_end_reason(lparam), 128 + 1)
                return 1
            if message == WM_ENDSESSION:
                if wparam:
                    self._guard.wait_for_save()
                return 0
            if message == WM_CLOSE:
                self._user32.DestroyWindow(hwnd)
                return 0
            if message == WM_DESTROY:
                self._user32.PostQuitMessage(0)
                return 0
        except Exception:  # an exception must not cross into Windows' frames
            log.exception("session window: message 0x%04x failed", message)
            return 1 if message == WM_QUERYENDSESSION else 0
        return self._user32.DefWindowProcW(hwnd, message, wparam, lparam)


def _last_error() -> int:
    return getattr(ctypes, "get_last_error", lambda: 0)()   # Windows-only in ctypes


def _session_end_reason(lparam: int) -> str:
    flags = lparam & 0xFFFFFFFF
    if flags & ENDSESSION_CLOSEAPP:
        return "restart-manager"
    return "logoff" if flags & ENDSESSION_LOGOFF else "shutdown"


def _signal_name(signals: Any, signum: int) -> str:
    for name in SIGNAL_NAMES:
        if getattr(signals, name, None) == signum:
            return name
    return f"signal {signum}"


def _raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt
