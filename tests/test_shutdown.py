"""engine/shutdown.py: every end-of-process event reaches one pause-and-save request.

Windows' console handler is exercised with a fake kernel32 (tests/winfakes.py: it records
the routine that SetConsoleCtrlHandler received) and CFUNCTYPE standing in for WINFUNCTYPE; the
routine is then called through ctypes from a thread of its own, as Windows does.
What only Windows can prove: that the real CTRL_CLOSE_EVENT arrives on such a thread
and that the process lives until the routine returns (about 5 s).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from winfakes import FakeKernel32, FakeUser32

from engine.shutdown import (
    CTRL_BREAK_EVENT,
    CTRL_C_EVENT,
    CTRL_CLOSE_EVENT,
    CTRL_LOGOFF_EVENT,
    CTRL_SHUTDOWN_EVENT,
    ShutdownGuard,
)


class FakeSignals:
    """The parts of the signal module the guard uses, with Windows' SIGBREAK."""
    SIGINT, SIGTERM, SIGBREAK, SIG_DFL = 2, 15, 21, 0

    def __init__(self) -> None:
        self.handlers: dict[int, object] = {}

    def signal(self, signum, handler):
        previous = self.handlers.get(signum, self.SIG_DFL)
        self.handlers[signum] = handler
        return previous


def windows_guard(callback, **kw):
    k32, sigs = FakeKernel32(), FakeSignals()
    guard = ShutdownGuard(callback, platform="win32", kernel32=k32, user32=FakeUser32(),
                          signals=sigs, functype=ctypes.CFUNCTYPE, **kw)
    return guard, k32, sigs


def call_from_os_thread(routine, event: int) -> tuple[int, float]:
    """Call the HandlerRoutine as Windows does: through C, on a new thread."""
    result: list[int] = []
    start = time.monotonic()
    t = threading.Thread(target=lambda: result.append(routine(event)))
    t.start()
    t.join(20)
    return result[0], time.monotonic() - start


def test_all_signals_are_routed_and_restored():
    sigs = FakeSignals()
    calls = []
    guard = ShutdownGuard(calls.append, platform="linux", signals=sigs)
    with guard:
        assert set(sigs.handlers) == {2, 15, 21}
        sigs.handlers[15](15, None)
    assert calls == ["SIGTERM"]
    assert guard.exit_status == 143 and guard.reason == "SIGTERM"
    assert all(h == sigs.SIG_DFL for h in sigs.handlers.values()), "previous handlers restored"


def test_signal_handler_does_not_wait_for_the_save():
    # the CLI saves on the main thread, the one the signal handler runs on: waiting = deadlock
    guard = ShutdownGuard(lambda r: None, platform="linux", signals=FakeSignals(), close_wait_s=5)
    start = time.monotonic()
    guard._on_signal(2, None)
    assert time.monotonic() - start < 0.5
    assert guard.exit_status == 130


def test_second_ctrl_c_leaves_at_once():
    calls = []
    guard = ShutdownGuard(calls.append, platform="linux", signals=FakeSignals())
    guard._on_signal(2, None)
    with pytest.raises(KeyboardInterrupt):
        guard._on_signal(2, None)
    assert calls == ["SIGINT"], "the request is made once"


def test_console_handler_is_registered_and_kept_referenced():
    guard, k32, _ = windows_guard(lambda r: None)
    guard.install()
    routine, add = k32.calls[0]
    assert add == 1 and isinstance(routine, ctypes._CFuncPtr)
    assert guard._routine is routine, "ctypes frees an unreferenced callback: Windows would crash"
    guard.uninstall()
    assert k32.calls[-1] == (routine, 0)
    assert guard._routine is routine, "kept after removal: Windows may still be inside it"


@pytest.mark.parametrize("event,reason,status", [(CTRL_C_EVENT, "ctrl-c", 130),
                                                 (CTRL_BREAK_EVENT, "ctrl-break", 149)])
def test_ctrl_c_and_break_request_without_waiting(event, reason, status):
    calls = []
    guard, k32, _ = windows_guard(calls.append, close_wait_s=5)
    guard.install()
    handled, took = call_from_os_thread(k32.routine, event)
    assert handled == 1, "handled: Python's own handler must not also raise KeyboardInterrupt"
    assert calls == [reason] and guard.exit_status == status
    assert took < 1.0
    # a second Ctrl+C goes on to Python's handler (KeyboardInterrupt), to leave at once
    assert call_from_os_thread(k32.routine, event)[0] == 0


@pytest.mark.parametrize("event,reason", [(CTRL_CLOSE_EVENT, "console-close"),
                                          (CTRL_LOGOFF_EVENT, "logoff"),
                                          (CTRL_SHUTDOWN_EVENT, "shutdown")])
def test_close_logoff_shutdown_wait_for_the_save(event, reason):
    calls = []
    guard, k32, _ = windows_guard(calls.append, close_wait_s=10)

    def engine_saves(r):  # the engine thread saves for 0.3 s, then reports
        calls.append(r)
        threading.Timer(0.3, guard.save_finished).start()

    guard._request = engine_saves
    guard.install()
    handled, took = call_from_os_thread(k32.routine, event)
    assert handled == 1 and calls == [reason]
    assert 0.25 <= took < 5, "returned only after the save finished, well before the limit"


def test_close_wait_is_bounded_when_the_save_hangs():
    guard, k32, _ = windows_guard(lambda r: None, close_wait_s=0.4)
    guard.install()
    handled, took = call_from_os_thread(k32.routine, CTRL_CLOSE_EVENT)
    assert handled == 1
    assert 0.35 <= took < 2.0
    assert guard.waited_s is not None and guard.waited_s >= 0.35


def test_nothing_to_save_means_no_wait():
    guard, k32, _ = windows_guard(lambda r: False, close_wait_s=10)
    guard.install()
    _, took = call_from_os_thread(k32.routine, CTRL_CLOSE_EVENT)
    assert took < 1.0


def test_close_after_ctrl_c_still_waits_for_the_same_save():
    calls = []
    guard, k32, _ = windows_guard(calls.append, close_wait_s=10)
    guard.install()
    call_from_os_thread(k32.routine, CTRL_C_EVENT)
    threading.Timer(0.3, guard.save_finished).start()
    _, took = call_from_os_thread(k32.routine, CTRL_CLOSE_EVENT)
    assert calls == ["ctrl-c"], "one request"
    assert 0.25 <= took < 5


def test_unknown_console_event_is_passed_on():
    guard, k32, _ = windows_guard(lambda r: None)
    guard.install()
    assert call_from_os_thread(k32.routine, 99)[0] == 0
    assert not guard.requested


def test_failing_callback_does_not_kill_the_handler():
    def boom(_r):
        raise RuntimeError("engine gone")
    guard, k32, _ = windows_guard(boom, close_wait_s=10)
    guard.install()
    handled, took = call_from_os_thread(k32.routine, CTRL_CLOSE_EVENT)
    assert handled == 1 and took < 1.0


def test_failed_registration_is_survivable():
    k32 = FakeKernel32(ok=False)
    guard = ShutdownGuard(lambda r: None, platform="win32", kernel32=k32, user32=FakeUser32(),
                          signals=FakeSignals(), functype=ctypes.CFUNCTYPE)
    guard.install()
    assert guard._routine is None
    guard.uninstall()


def test_real_sigterm_in_a_child_process_saves_and_exits_143(tmp_path):
    """The real signal module on this OS: SIGTERM -> request -> 'save' -> exit status."""
    marker = tmp_path / "saved.txt"
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(os.getcwd())!r})
        from engine.shutdown import ShutdownGuard
        stop = []
        guard = ShutdownGuard(stop.append)
        with guard:
            print("ready", flush=True)
            while not stop:
                time.sleep(0.01)        # the generation loop, checking between tokens
            open({str(marker)!r}, "w").write(guard.reason)
            guard.save_finished()
        sys.exit(guard.exit_status)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(20) == 143
    assert marker.read_text() == "SIGTERM"


@pytest.mark.parametrize("saved", ["head", "autosave", "continued", "nothing", "not begun"])
def test_a_second_ctrl_c_says_what_can_be_resumed(saved, tmp_path, monkeypatch, capsys):
    """A second Ctrl+C while the pause saves leaves at once (documented); it said only
    "interrupted" (a user's test).  It now says the pause was not saved, and what remains:
    the newest checkpoint on disk (an autosave, or the file the run continued), or that
    nothing of this run was."""
    from engine.cli import main
    from engine.cli.run import RunSession
    newest = tmp_path / "autosave-1.kvckpt"

    class Checkpoints:
        saved_head = newest if saved == "head" else None   # the interrupt came after the file was written

        def newest_on_disk(self):
            return newest if saved in ("autosave", "head") else None

    def run(self):
        self.checkpoints = Checkpoints()
        self.requested_at = None if saved == "not begun" else 1.0
        raise KeyboardInterrupt   # as the second signal's handler raises it, mid-save

    monkeypatch.setattr(RunSession, "run", run)
    args = ["run", "-p", "Hi"] + (["--checkpoint-load", str(tmp_path / "x.kvckpt")] if saved == "continued" else [])
    assert main(args) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted"
    if saved == "head":
        assert f"[CHECKPOINT] Saved to: {newest}" in err and "without saving" not in err
    elif saved == "autosave":
        assert f"the newest checkpoint is: {newest}" in err
    elif saved == "continued":
        assert "nothing of this run was saved" in err and "x.kvckpt, which it continued, is as it was" in err
    elif saved == "nothing":
        assert "nothing of this run was saved" in err and "--checkpoint-save-interval" in err
    else:
        assert "[CHECKPOINT]" not in err


def test_a_runs_newest_file_on_disk_is_its_named_file_once_written(tmp_path):
    """What a second Ctrl+C names: the named file once save_head wrote it (it came after),
    else the newest of its line (none here: no autosaves)."""
    from types import SimpleNamespace

    from engine.checkpoint_policy import Checkpoints
    from engine.checkpoints.format import KIND_PAUSE
    named = tmp_path / "named.kvckpt"

    class Saving:
        def save(self, path, conv, kind):
            path.write_bytes(b"x")
            return SimpleNamespace(path=path)

    checkpoints = Checkpoints(Saving(), named=named)
    assert checkpoints.newest_on_disk() is None
    checkpoints.save_head(object(), KIND_PAUSE)
    assert checkpoints.newest_on_disk() == named == checkpoints.saved_head
