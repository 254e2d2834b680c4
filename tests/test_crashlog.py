"""A native crash leaves a trace; the next start says so and offers the last autosave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, run_cli

from engine import crashlog


def _crashed(returncode: int) -> bool:
    """Died of the access violation: a signal on POSIX, the NTSTATUS on Windows."""
    return returncode & 0xFFFFFFFF == 0xC0000005 if sys.platform == "win32" else returncode < 0


#: A fault in a native thread, as llama.cpp's compute threads would have it.  On Windows
#: ctypes turns an access violation inside a foreign call into OSError (no crash), and
#: faulthandler._sigsegv() raises SIGSEGV, which the C runtime ends with status 3: a thread
#: that starts at address 16 is the real thing there.
_CRASH = {"win32": ("import ctypes; k = ctypes.windll.kernel32; k.CreateThread.restype = ctypes.c_void_p; "
                    "k.CreateThread.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, "
                    "ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]; "
                    "k.WaitForSingleObject(ctypes.c_void_p(k.CreateThread(None, 0, 16, None, 0, None)), 30000)")}


def _crash_in_child(env=None) -> int:
    code = ("from engine import crashlog; crashlog.install(); "
            + _CRASH.get(sys.platform, "import faulthandler; faulthandler._sigsegv()"))
    return subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), env=env or dict(os.environ),
                          capture_output=True).returncode


def test_crash_trace_is_reported_once(app_home):
    assert _crashed(_crash_in_child())
    reports = crashlog.pending_crashes()
    assert len(reports) == 1
    assert reports[0].excerpt.startswith(("Fatal Python error", "Windows fatal exception")), reports[0].excerpt
    kept = crashlog.acknowledge(reports)
    assert kept and kept[0].name.startswith("crash-") and 'File "<string>", line 1' in kept[0].read_text()
    assert crashlog.pending_crashes() == []


def test_normal_exit_leaves_nothing(app_home):
    done = subprocess.run([sys.executable, "-c", "from engine import crashlog; crashlog.install()"],
                          cwd=str(ROOT), env=dict(os.environ))
    assert done.returncode == 0
    assert list((app_home / "log").glob("*.log")) == []


def test_cli_tells_about_the_crash_and_the_autosave(smollm_path, app_home):
    # an autosave exists in the store (from an interrupted autosaving run)
    run_cli("run", "-m", str(smollm_path), "-p", "Hi", "-n", "40", "--ignore-eos", "--temp", "0",
            "--ctx-size", "512", "--checkpoint-save-interval", "8", "--stop-after", "20", check=True)
    store = app_home / "data" / "checkpoints"
    # a crash leaves an autosave as the newest file of its line: copy the pause head's
    # bytes as a newer autosave (same parent, so its chain is whole)
    listing = json.loads(run_cli("list", "--json", check=True).stdout)
    (head,) = [e for e in listing if e["head"]]
    assert head["header"]["kind"] == "pause"
    paused = Path(head["path"])
    autosave = store / "autosave-crashed-00001.kvckpt"
    from dataclasses import replace

    import engine.checkpoints.format as fmt
    raw = bytearray(paused.read_bytes())
    header = fmt.unpack_header(bytes(raw[:fmt.HEADER_LEN]), len(raw))
    raw[:fmt.HEADER_LEN] = fmt.pack_header(replace(header, kind=fmt.KIND_AUTOSAVE,
                                                   created_unix_ns=header.created_unix_ns + 1))
    autosave.write_bytes(bytes(raw))
    assert _crashed(_crash_in_child())
    done = run_cli("run", "-m", str(smollm_path), "-p", "Hello", "-n", "2", "--ctx-size", "512")
    assert done.returncode == 0, done.stderr
    assert "crashed in an earlier run" in done.stderr
    assert f"--checkpoint-load {autosave}" in done.stderr
    again = run_cli("run", "-m", str(smollm_path), "-p", "Hello", "-n", "2", "--ctx-size", "512")
    assert "crashed" not in again.stderr


def test_a_kill_without_trace_is_reported_as_such(app_home):
    # Windows has no SIGKILL: os.kill with another number is TerminateProcess (End task)
    kill = "SIGKILL" if sys.platform != "win32" else "SIGTERM"
    code = ("from engine import crashlog; crashlog.install(); import os, signal; "
            f"os.kill(os.getpid(), signal.{kill})")
    rc = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT)).returncode
    assert rc == 15 if sys.platform == "win32" else rc < 0
    (report,) = crashlog.pending_crashes()
    assert report.killed and "without closing" in report.what
    assert crashlog.acknowledge([report]) == [] and not report.log.exists()
    assert crashlog.pending_crashes() == []


def test_a_kill_is_reported_whatever_process_has_its_number_now(app_home):
    """A kill went unreported when the next start had the dead process's number (Wine gives
    each new server's first process the same one; Windows reuses numbers after a reboot),
    or when another running program had it: a process is judged by the lock it holds on its
    trace while it runs, never by its number.  Here the dead processes' files carry this
    test's own number, which is alive."""
    folder = app_home / "log"
    folder.mkdir(parents=True, exist_ok=True)
    stale = folder / f"faulthandler-{os.getpid()}-1.log"          # its lock left behind, free
    stale.write_text("")
    stale.with_suffix(".lock").write_text("")
    noted = folder / f"faulthandler-{os.getpid()}-2.log"          # a note left at a clean exit
    noted.write_text("Fatal Python error: a lost worker\n")
    legacy = folder / f"faulthandler-{os.getpid()}.log"           # written before the locks
    legacy.write_text("")
    reports = crashlog.pending_crashes()
    assert sorted(r.log.name for r in reports) == sorted(p.name for p in (stale, noted, legacy))
    crashlog.acknowledge(reports)
    assert crashlog.pending_crashes() == [] and not stale.with_suffix(".lock").exists()


def test_a_running_process_is_no_crash_until_it_is_killed(app_home):
    code = "from engine import crashlog; crashlog.install(); import sys; print('up', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=str(ROOT), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        assert crashlog.pending_crashes() == []        # its lock is held: it runs
    finally:
        child.kill()
        child.wait(30)
    (report,) = crashlog.pending_crashes()
    assert report.killed and f"faulthandler-{child.pid}-" in report.log.name
