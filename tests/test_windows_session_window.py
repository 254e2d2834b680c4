"""The CLI's save at sign-out, shutdown and Restart Manager requests (issue 15, item 6).

A console process that loaded user32/gdi32 gets no CTRL_LOGOFF/CTRL_SHUTDOWN events, so
engine/shutdown.py runs a hidden top-level window with its own message loop.  Here
user32 is :class:`winfakes.FakeUser32`: the window procedure the code registers is
called through C, on the window's own thread, and ``send`` waits for its answer as
Windows' SendMessage does.

What only Windows can prove (installer/README.md): that the broadcasts reach this
window in a real `checkpoint-chat run`, and that Windows lets WM_ENDSESSION wait.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
from winfakes import HWND, WS_VISIBLE, FakeKernel32, FakeUser32

from engine.shutdown import (
    _MSG,
    _WNDCLASSEXW,
    CTRL_CLOSE_EVENT,
    ENDSESSION_CLOSEAPP,
    ENDSESSION_LOGOFF,
    HWND_MESSAGE,
    WM_ENDSESSION,
    WM_QUERYENDSESSION,
    SessionEndWindow,
    ShutdownGuard,
)


class NoSignals:
    """Signals are not what these tests are about."""
    SIG_DFL = 0

    def signal(self, signum, handler):
        return self.SIG_DFL


@pytest.fixture
def guarded():
    made = []

    def make(callback=None, *, close_wait_s=30.0, user32=None):
        calls = []
        user32 = user32 or FakeUser32()
        guard = ShutdownGuard(callback or calls.append, platform="win32", kernel32=FakeKernel32(),
                              user32=user32, signals=NoSignals(), functype=ctypes.CFUNCTYPE,
                              close_wait_s=close_wait_s)
        guard.install()
        made.append(guard)
        return guard, user32, calls

    yield make
    for guard in made:
        guard.save_finished()
        guard.uninstall()


def test_the_window_is_hidden_and_top_level(guarded):
    guard, user32, _ = guarded()
    assert guard.session_window is not None and guard.session_window.hwnd == HWND
    created = user32.created[0]
    assert created["ex_style"] == 0 and not created["style"] & WS_VISIBLE, "hidden"
    assert created["parent"] is None and created["parent"] != HWND_MESSAGE, \
        "a message-only window gets no WM_QUERYENDSESSION broadcast"
    name, proc, size = user32.registered[0]
    assert name == created["cls"] == SessionEndWindow.CLASS_NAME
    assert proc == ctypes.cast(guard.session_window._proc, ctypes.c_void_p).value, \
        "the registered procedure is the one the window keeps referenced"
    assert size == ctypes.sizeof(_WNDCLASSEXW) == 80, "WNDCLASSEXW's size on 64-bit Windows"
    assert ctypes.sizeof(_MSG) == 48, "MSG's size on 64-bit Windows"


@pytest.mark.parametrize("lparam,reason", [(ENDSESSION_LOGOFF, "logoff"), (0, "shutdown"),
                                           (ENDSESSION_CLOSEAPP, "restart-manager")])
def test_query_end_session_requests_the_save_and_agrees(guarded, lparam, reason):
    guard, user32, calls = guarded()
    assert user32.send(WM_QUERYENDSESSION, 0, lparam) == 1, "TRUE: we never block the session"
    assert calls == [reason] and guard.exit_status == 129


def test_end_session_waits_for_the_save(guarded):
    guard, user32, calls = guarded()
    user32.send(WM_QUERYENDSESSION, 0, ENDSESSION_LOGOFF)
    answer = []
    sender = threading.Thread(target=lambda: answer.append(user32.send(WM_ENDSESSION, 1, ENDSESSION_LOGOFF)))
    sender.start()
    sender.join(0.5)
    assert sender.is_alive() and not answer, "returned before the save: Windows would end the process"
    guard.save_finished()                 # the generation loop saved at its token boundary
    sender.join(30)
    assert answer == [0]


def test_end_session_wait_is_bounded(guarded):
    guard, user32, _ = guarded(close_wait_s=0.3)
    user32.send(WM_QUERYENDSESSION, 0, 0)
    assert user32.send(WM_ENDSESSION, 1, 0, timeout=30) == 0, "gave up waiting; the autosave remains"
    assert guard.waited_s is not None


def test_cancelled_session_end_does_not_wait(guarded):
    guard, user32, calls = guarded(close_wait_s=600)
    user32.send(WM_QUERYENDSESSION, 0, 0)
    assert user32.send(WM_ENDSESSION, 0, 0, timeout=30) == 0   # wParam FALSE: the session goes on


def test_console_close_and_session_end_make_one_request(guarded):
    guard, user32, calls = guarded(close_wait_s=0.2)
    k32_routine = guard._routine
    threading.Thread(target=k32_routine, args=(CTRL_CLOSE_EVENT,)).start()
    assert user32.send(WM_QUERYENDSESSION, 0, ENDSESSION_LOGOFF) == 1
    # the console-close thread and the session-end message race: exactly one request
    # reaches the app, whichever came first
    assert len(calls) == 1 and calls[0] in ("console-close", "logoff"), calls


def test_a_failing_request_still_answers_windows(guarded):
    def boom(_reason):
        raise RuntimeError("engine gone")
    guard, user32, _ = guarded(boom)
    assert user32.send(WM_QUERYENDSESSION, 0, 0) == 1
    assert user32.send(WM_ENDSESSION, 1, 0) == 0, "nothing to wait for: the request failed"


def test_uninstall_destroys_the_window_and_ends_its_thread(guarded):
    guard, user32, _ = guarded()
    window = guard.session_window
    guard.uninstall()
    assert user32.destroyed == [HWND]
    assert user32.unregistered == [SessionEndWindow.CLASS_NAME]
    assert not window._thread.is_alive()
    assert guard.session_window is None


def test_no_window_is_survivable(guarded):
    guard, user32, _ = guarded(user32=FakeUser32(create_ok=False))
    assert guard.session_window is None
    assert user32.unregistered == [SessionEndWindow.CLASS_NAME]
    assert guard._routine is not None, "the console handler still works"


def test_no_window_off_windows():
    guard = ShutdownGuard(lambda r: None, platform="linux", signals=NoSignals())
    with guard:
        assert guard.session_window is None
