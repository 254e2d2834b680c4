"""A trace of native crashes, and telling the user about one at the next start.

A crash inside llama.dll kills the process before any Python ``except`` runs.
``faulthandler`` still writes the Python stack of every thread to a file, so each
process writes to its own ``faulthandler-<pid>-<start>.log`` in the log folder; a normal
exit deletes it (empty).  At the next start, a file of a process that is gone is an end
the user has not heard about: :func:`pending_crashes` finds it, the CLI and the window
tell the user and offer the newest autosave, and :func:`acknowledge` keeps a non-empty
one as ``crash-<time>.log`` (the last few are kept for bug reports).  An empty file
means the process was killed without a trace (SIGKILL, End task, power loss): no trace to
keep, but the answer it was writing is in an autosave all the same, so it is reported too.

Whether a file's process is gone is not asked by its number: a number is reused (Wine
gives each new server's first process the same one, Windows after a reboot), and a kill
went unreported when the next start, or another program, had the dead process's number
(the Windows build under Wine).  Each process holds an OS lock on its own
``faulthandler-<pid>-<start>.lock`` while it runs, taken before its trace file exists; the
operating system drops it with the process, so a file whose lock can be taken is a
process that is gone.  Files from before the locks (``faulthandler-<pid>.log``) are
still judged by their number.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from engine import paths

KEEP_REPORTS = 5
_handle = None
_lock: FileLock | None = None    # held while this process runs (see the module docstring)
_installed: Path | None = None   # this process's trace file, once install() opened it
_STARTED_NS = time.time_ns()     # (a process's files are named by its number and this)


@dataclass(frozen=True)
class CrashReport:
    log: Path
    when: float
    excerpt: str
    killed: bool = False      # no trace: killed, or the machine went down

    @property
    def what(self) -> str:
        """How the earlier run ended, for a sentence."""
        return ("was stopped without closing (killed, or the machine went down)" if self.killed
                else "crashed")


def trace_path(folder: Path | None = None) -> Path:
    """This process's trace file (also where a lost RPC worker is noted for the next start)."""
    if _installed is not None and folder is None:
        return _installed
    return (folder or paths.log_dir()) / f"faulthandler-{os.getpid()}-{_STARTED_NS}.log"


def _lock_of(trace: Path) -> Path:
    return trace.with_suffix(".lock")


def install(folder: Path | None = None) -> Path:
    """Write fatal-error tracebacks of this process to the log folder."""
    global _handle, _lock, _installed
    path = trace_path(folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(_lock_of(path)), timeout=0)
    lock.acquire()   # before the trace exists: a trace whose lock is free has no process
    try:
        handle = open(path, "w", encoding="utf-8")
    except OSError:
        lock.release()
        _unlink(_lock_of(path))
        raise
    _handle, _lock, _installed = handle, lock, path
    faulthandler.enable(_handle, all_threads=True)

    def clean_exit() -> None:
        faulthandler.disable()
        _handle.close()
        try:
            if path.stat().st_size == 0:
                path.unlink()
        except OSError:
            pass
        lock.release()
        _unlink(_lock_of(path))   # (Windows' filelock has deleted it already)

    atexit.register(clean_exit)
    return path


def _unlink(path: Path) -> None:
    """Delete ``path`` if it can be (Windows: another program may hold it open for a moment;
    the next start deletes it then)."""
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if sys.platform == "win32":
        return _alive_windows(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True   # exists, but not ours
    return True


# processthreadsapi.h / winnt.h
PROCESS_QUERY_LIMITED_INFORMATION = 0x1000
STILL_ACTIVE = 259
ERROR_ACCESS_DENIED = 5


def _alive_windows(pid: int, kernel32=None) -> bool:
    """Whether process ``pid`` is running, without touching it.

    ``os.kill(pid, 0)`` is no probe on Windows: 0 is ``CTRL_C_EVENT``, sent to every
    process sharing the console (a second command in the same terminal interrupted the
    first).  ``OpenProcess`` + ``GetExitCodeProcess`` only look.  A process that exists
    but refuses to be opened (another user's) counts as alive.
    """
    if sys.platform != "win32":      # said so that the type checker reads the rest as Windows code
        raise NotImplementedError("OpenProcess is Windows' own")
    import ctypes
    from ctypes import wintypes
    if kernel32 is None:
        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        # HANDLE OpenProcess(DWORD dwDesiredAccess, BOOL bInheritHandle, DWORD dwProcessId)
        kernel32.OpenProcess.argtypes = [wintypes.DWORD, wintypes.BOOL, wintypes.DWORD]
        kernel32.OpenProcess.restype = wintypes.HANDLE
        # BOOL GetExitCodeProcess(HANDLE hProcess, LPDWORD lpExitCode)
        kernel32.GetExitCodeProcess.argtypes = [wintypes.HANDLE, ctypes.POINTER(wintypes.DWORD)]
        kernel32.GetExitCodeProcess.restype = wintypes.BOOL
        # BOOL CloseHandle(HANDLE hObject)
        kernel32.CloseHandle.argtypes = [wintypes.HANDLE]
        kernel32.CloseHandle.restype = wintypes.BOOL
    handle = kernel32.OpenProcess(PROCESS_QUERY_LIMITED_INFORMATION, False, pid)
    if not handle:
        return ctypes.get_last_error() == ERROR_ACCESS_DENIED
    try:
        code = wintypes.DWORD(0)
        if not kernel32.GetExitCodeProcess(handle, ctypes.byref(code)):
            return True
        return code.value == STILL_ACTIVE
    finally:
        kernel32.CloseHandle(handle)


def pending_crashes(folder: Path | None = None) -> list[CrashReport]:
    """Crash traces left by processes that are gone, oldest first."""
    folder = folder or paths.log_dir()
    reports = []
    for path in sorted(folder.glob("faulthandler-*.log")) if folder.is_dir() else []:
        if not _gone(path):
            continue
        try:
            text = path.read_text("utf-8", "replace")
            when = path.stat().st_mtime
        except OSError:
            continue
        if not text.strip():   # killed without a trace (SIGKILL, End task, power loss)
            reports.append(CrashReport(path, when, "no trace", killed=True))
            continue
        # "Fatal Python error: Segmentation fault" (POSIX), "Windows fatal exception: access violation"
        first = next((line for line in text.splitlines() if line.startswith(("Fatal", "Windows fatal"))),
                     text.splitlines()[0])
        reports.append(CrashReport(path, when, first.strip()))
    return sorted(reports, key=lambda r: r.when)


def _gone(trace: Path) -> bool:
    """Whether the process that wrote ``trace`` has ended (see the module docstring)."""
    if trace == _installed:
        return False
    parts = trace.stem.split("-")
    if len(parts) == 2:   # faulthandler-<pid>.log: from before the locks, judged by the number
        try:
            pid = int(parts[1])
        except ValueError:
            return False
        return pid == os.getpid() or not _alive(pid)   # (this process writes no such name)
    if not _lock_of(trace).exists():
        return True   # its process let go of it at its exit (a note left in the trace), or died
    lock = FileLock(str(_lock_of(trace)), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        return False   # its process runs
    except OSError:
        return False   # (a lock file that cannot be opened: judged again at the next start)
    lock.release()
    return True


def acknowledge(reports: list[CrashReport]) -> list[Path]:
    """Keep reported traces as crash-<time>.log (the newest few); returns their paths."""
    kept = []
    for report in reports:
        _unlink(_lock_of(report.log))
        if report.killed:
            _unlink(report.log)
            continue
        target = report.log.with_name(time.strftime("crash-%Y%m%d-%H%M%S", time.localtime(report.when))
                                      + f"-{report.log.stem.split('-')[1]}.log")
        try:
            report.log.replace(target)
            kept.append(target)
        except OSError:
            pass
    if reports:
        old = sorted(reports[0].log.parent.glob("crash-*.log"))[:-KEEP_REPORTS]
        for path in old:
            _unlink(path)
    return kept


def newest_autosave(store) -> Path | None:
    """The newest head an autosave left (an answer a crash interrupted) in ``store``."""
    from engine.checkpoints.format import KIND_AUTOSAVE
    from engine.checkpoints.graph import Graph
    return next((h.path for h in Graph.scan(store).heads if h.header.kind == KIND_AUTOSAVE), None)
