"""Atomic file replacement: readers see the old file or the new one, never a mix.

The recipe (as python-atomicwrites and pip's ``adjacent_tmp_file``): write a temp file
in the destination folder, flush and fsync it, ``os.replace`` it over the destination,
then fsync the folder on POSIX so the rename itself is durable.  On any failure the
temp file is removed and the destination is untouched.

On Windows ``os.replace`` fails with ERROR_ACCESS_DENIED / SHARING_VIOLATION /
LOCK_VIOLATION (winerror 5 / 32 / 33) while another program holds the destination or the
new file open: an antivirus scanner opens every file the moment it is closed, and reads a
large one for seconds; the search indexer, backup and sync tools do the same.  Those
errors are retried with a growing pause (10 ms, doubling, at most 1 s) for
:data:`REPLACE_RETRY_S` seconds in all, never longer; the error that ends it says how many
tries over how long, and that another program kept the file open.

A process killed mid-write (SIGKILL, power loss) leaves its temp file behind.  On POSIX
the writer holds an ``flock`` on its temp file, which the kernel drops when the process
dies, so :func:`is_stale_temp` can tell a dead writer's leftovers from a live write.  On
Windows an open file cannot be deleted at all, which gives the same protection.

When the destination folder is a checkpoint store (it holds :data:`STORE_MARKER`), the
final rename happens under the store's cross-process lock, so that pruning (which
checks a file and then deletes it) can never delete a version that was renamed into
place between its check and its delete.

A save whose fsync the caller waits for asks the OS, every :data:`WRITEBACK_STEP` bytes,
to start writing out what it has so far (``start_writeback``: Linux's
``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait): the disk works while
the rest of the file is still being produced, and the final fsync has less left to do.
It is only a hint; durability still comes from the fsync.  Elsewhere it is None (macOS
has no such call; Windows' FlushFileBuffers is a full, waiting flush).

The module-level ``open_file``, ``fsync``, ``replace``, ``start_writeback``, ``clock`` and
``sleep`` names are the seams tests use to inject failures (ENOSPC, EIO, sharing
violations), count calls, or run the retry's schedule without waiting.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import BinaryIO, cast

from filelock import FileLock

if sys.platform == "win32":
    fcntl = None
else:
    import fcntl

log = logging.getLogger("checkpoint")

#: Windows errors caused by another process holding the file for a moment.
TRANSIENT_WINERRORS = frozenset({5, 32, 33})
#: How long a replace is retried, in all: long enough for a scanner reading a new file of
#: some GB, short enough that a file held for good is reported while the user waits.
REPLACE_RETRY_S = 8.0
REPLACE_FIRST_PAUSE_S = 0.01
REPLACE_MAX_PAUSE_S = 1.0
TEMP_SUFFIX = ".tmp"
#: An empty file that marks a folder as a checkpoint store (see engine.checkpoints.store).
STORE_MARKER = ".kvstore"
STORE_LOCK_NAME = ".kvstore.lock"
#: How long a save waits for the store lock, which is only ever held for a rename or a
#: delete; a longer wait means something is badly wrong and the save reports it.
STORE_LOCK_TIMEOUT_S = 30.0

#: bytes written between two writeback hints (measured: benchmarks/save_speed.py)
WRITEBACK_STEP = 4 << 20
_SYNC_FILE_RANGE_WRITE = 2   # <linux/fs.h>: start writing dirty pages, do not wait


def _linux_start_writeback() -> Callable[[int], None] | None:
    """``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` through libc, or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    call.restype = ctypes.c_int

    def start_writeback(fd: int) -> None:
        call(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)   # a failure is harmless: the fsync follows
    return start_writeback


#: give a file being replaced a second name and free it on the helper thread (see
#: _set_aside); benchmarks turn it off to measure the way before.  Not on Windows: while a
#: reader holds the file open without FILE_SHARE_DELETE (any Python open(), a scanner),
#: the second name cannot be deleted either, and a failed replace left it behind (seen
#: under the Wine tier).
SET_ASIDE_REPLACED = sys.platform != "win32"

open_file = open
fsync = os.fsync
replace = os.replace
start_writeback = _linux_start_writeback()
clock = time.monotonic
sleep = time.sleep


def temp_path_for(path: Path) -> Path:
    """A hidden sibling of ``path`` that listings (``*.kvckpt``) never match."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


def store_lock(folder: Path, timeout: float | None = None) -> FileLock:
    """The cross-process lock of the store in ``folder``."""
    timeout = STORE_LOCK_TIMEOUT_S if timeout is None else timeout   # read at call time
    return FileLock(str(folder / STORE_LOCK_NAME), timeout=timeout)


def _lock_for(folder: Path) -> AbstractContextManager:
    if (folder / STORE_MARKER).exists():
        return store_lock(folder)
    return contextlib.nullcontext()


def replace_with_retry(src: Path, dst: Path, budget_s: float | None = None) -> None:
    """``replace(src, dst)``, retrying transient Windows sharing errors for ``budget_s``.

    The pauses grow from REPLACE_FIRST_PAUSE_S to REPLACE_MAX_PAUSE_S; the last one is cut
    to end at the deadline, so a file held for good costs ``budget_s`` and no more.  The
    error that ends the retries is the last one, its message extended with the tries.
    """
    # read at call time so that tests (and a future setting) can shorten the budget
    budget_s = REPLACE_RETRY_S if budget_s is None else budget_s
    started = clock()
    deadline = started + budget_s
    pause = REPLACE_FIRST_PAUSE_S
    tries = 0
    while True:
        tries += 1
        try:
            replace(src, dst)
            return
        except OSError as exc:
            if getattr(exc, "winerror", None) not in TRANSIENT_WINERRORS:
                raise
            left = deadline - clock()
            if left <= 0:
                exc.strerror = (f"{exc.strerror} (another program, such as an antivirus scanner or "
                                f"the search indexer, kept the file open: tried {tries} times "
                                f"over {clock() - started:.1f} s)")
                raise
            sleep(min(pause, left))
            pause = min(pause * 2, REPLACE_MAX_PAUSE_S)


def fsync_dir(folder: Path) -> None:
    if sys.platform == "win32":
        return  # NTFS journals the rename; folders cannot be opened for fsync
    fd = os.open(folder, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def _mark_live(f: BinaryIO) -> None:
    """Hold an flock on the temp file for as long as this process writes it."""
    if fcntl is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def is_stale_temp(path: Path, min_age_s: float) -> bool:
    """True when ``path`` is a temp file whose writer is gone.

    A temp file younger than ``min_age_s`` is never stale: that covers the instant
    between a writer creating its file and taking the lock.  On Windows the caller's
    delete simply fails while the writer still has the file open.
    """
    try:
        st = path.stat()
    except OSError:
        return False
    if time.time() - st.st_mtime < min_age_s:
        return False
    if fcntl is None:
        return True
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # a live writer holds it
    finally:
        os.close(fd)


class _WritebackFile:
    """A file being written that hints the OS to write it out every WRITEBACK_STEP bytes;
    everything else is the file's own."""

    def __init__(self, f: BinaryIO, hint: Callable[[int], None]) -> None:
        self._f = f
        self._hint = hint
        self._unhinted = 0

    def write(self, data) -> int:
        n = self._f.write(data)
        self._unhinted += memoryview(data).nbytes
        if self._unhinted >= WRITEBACK_STEP:
            self._unhinted = 0
            self._f.flush()
            self._hint(self._f.fileno())
        return n

    def __getattr__(self, name: str):
        return getattr(self._f, name)


_helper = None   # one helper thread for every writer of the process, made when needed
_helper_made = threading.Lock()


def _helper_thread():
    global _helper
    with _helper_made:
        if _helper is None:
            from concurrent.futures import ThreadPoolExecutor
            _helper = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-landing")
    return _helper


def wait_for_helper(timeout: float | None = None) -> None:
    """Wait until the helper thread has done all it was given (landings, steps after
    them, freeing replaced files): for tests and benchmarks that look at the disk."""
    _helper_thread().submit(lambda: None).result(timeout)


class Landing:
    """The last steps of saves — fsync, the rename into place, the folder's fsync — run on
    a helper thread, one save after another (:func:`atomic_write` with ``landing``).

    For a save that nothing waits for: an autosave in the middle of an answer, whose
    fsync would otherwise stall generation (under disk load, tens of milliseconds each).
    Until it has landed the file is a temp file: a crash then keeps the previous autosave,
    which is all an autosave promises.  :meth:`settle` waits for the save in flight and
    returns its failure, if any (the caller must then not build on that file).
    """

    def __init__(self) -> None:
        self._pending = None

    def submit(self, finish: Callable[[], None]) -> None:
        self.settle()
        self._pending = _helper_thread().submit(finish)

    def then(self, step: Callable[[], None]) -> None:
        """Run ``step`` on the helper thread after the save in flight has landed (not at
        all if it failed), or at once there when none is in flight.  A failure of ``step``
        is logged, not reported by :meth:`settle`: the save itself did land."""
        pending = self._pending

        def after_landing() -> None:
            if pending is not None:
                pending.result()   # the landing's failure: settle's to report, step skipped
            _run_logged(step)

        self._pending = _helper_thread().submit(after_landing)

    def notify(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the save in flight and its steps are done, landed or
        failed: on the helper thread, or at once when nothing is in flight."""
        pending = self._pending
        if pending is None:
            _run_logged(callback)
        else:
            pending.add_done_callback(lambda _done: _run_logged(callback))

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def settle(self) -> BaseException | None:
        pending, self._pending = self._pending, None
        return pending.exception() if pending is not None else None


def _run_logged(step: Callable[[], None]) -> None:
    try:
        step()
    except Exception:   # noqa: BLE001 - a follow-up step never undoes a landed save
        log.exception("a step after a checkpoint landed failed")


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, durable: bool = True,
                 lock: AbstractContextManager | None = None,
                 precondition: Callable[[], object] | None = None,
                 landing: Landing | None = None) -> Iterator[BinaryIO]:
    """Yield a binary file; on normal exit it atomically becomes ``path``.

    ``lock`` is held around the rename; by default the store lock when ``path`` lies
    in a checkpoint store, else nothing.  ``precondition`` runs under that lock just
    before the rename and may raise to cancel it (a delta checks that its parent is
    still there: the store's pruner deletes under the same lock).  With ``landing`` the
    bytes are written here and the fsync, rename and folder fsync happen on its helper
    thread (see :class:`Landing`).
    """
    path = Path(path)
    tmp = temp_path_for(path)
    f = open_file(tmp, "xb")
    hint = start_writeback   # read at call time: the seam
    try:
        _mark_live(f)
        # only where this thread waits for the fsync: a landing's runs on a helper thread
        # a _WritebackFile is the file by delegation (__getattr__), with write hinted
        yield cast(BinaryIO, _WritebackFile(f, hint)) if durable and landing is None and hint is not None else f
        f.flush()
    except BaseException:
        _discard(f, tmp)
        raise
    if landing is not None:
        landing.submit(lambda: _land(f, tmp, path, durable, lock, precondition))
    else:
        _land(f, tmp, path, durable, lock, precondition)


def _land(f: BinaryIO, tmp: Path, path: Path, durable: bool, lock, precondition) -> None:
    """A written temp file's last steps: fsync, the rename into place under the lock (after
    the precondition), the folder's fsync.  On atomic_write's thread, or Landing's."""
    renamed = False
    old = None
    try:
        if durable:
            fsync(f.fileno())
        f.close()
        with lock if lock is not None else _lock_for(path.parent):
            if precondition is not None:
                precondition()
            old = _set_aside(path)
            try:
                replace_with_retry(tmp, path)
            except BaseException:
                if old is not None:
                    _unlink_quietly(old)
                raise
            renamed = True
    except BaseException:
        if not renamed:
            _discard(f, tmp)
        raise
    _sync_folder(path, durable)
    if old is not None:
        _helper_thread().submit(_unlink_quietly, old)


def _set_aside(path: Path) -> Path | None:
    """A second name (a hidden temp name) for the file at ``path``, if there is one.

    Replacing a file frees its blocks in the rename itself, which costs as much as a
    write: ~6 ms for 8.6 MB here (ext4 mounted with ``discard``).  With a second name the
    rename only drops a link, and the helper thread frees the old file afterwards.  No
    file there, or no hard links (FAT, some network shares): None, and the rename frees
    it as before.  A crash in between leaves a stale temp file, which the store's sweep
    removes (:func:`is_stale_temp`).
    """
    if not SET_ASIDE_REPLACED:
        return None
    aside = temp_path_for(path)
    try:
        os.link(path, aside)
    except OSError:
        return None
    return aside


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _discard(f: BinaryIO, tmp: Path) -> None:
    # close() flushes what is buffered, which fails again on a full disk: the temp file
    # must go away whatever close() says, and the first error is the one to report
    with contextlib.suppress(OSError):
        f.close()
    _unlink_quietly(tmp)


def _sync_folder(path: Path, durable: bool) -> None:
    if durable:
        try:
            fsync_dir(path.parent)
        except OSError as exc:
            # The new file is complete and in place; only the durability of the rename is
            # in doubt, and after a power loss the folder holds the old file or the new
            # one, both whole.  Reporting "save failed" would be false.
            log.warning("could not fsync folder %s after saving %s: %s", path.parent, path.name, exc)
