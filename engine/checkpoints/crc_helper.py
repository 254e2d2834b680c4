"""The checksums a restore leaves for later, computed on one long-lived helper thread.

A chain read with ``crc_later`` (engine.checkpoints.chain.load_chain) hands its large
states' checksums to :func:`queue_crc`, so that llama.cpp copies a state while its CRC32
is computed on the other core (engine.restore settles them before anything is kept).
They all run on one thread of the process, started once
(:func:`start`, which a runtime calls when its model is loaded) and then idle between
restores:

* Starting a thread for each chain cost every restore 0.2–0.3 ms here (measured in place,
  a warm process, the wide hybrid's 2,000 tokens in two files: a restore of ~4 ms), as much
  as the checksum it took off the restoring thread, and a new thread can wait for a core.
* One thread, not one per state: three checksums at once beside the copy slowed llama.cpp's
  ``set_data`` from 10 to 15 ms (SmolLM2, 7,500 tokens in three files).

Jobs run in the order they were queued, whichever chain they belong to; restores run one
at a time per runtime, so a chain seldom waits behind another's.  The thread is a daemon: a
process that exits while a checksum runs does not wait for one nobody needs any more.
"""

from __future__ import annotations

import queue
import threading

from engine.checkpoints.crc import crc32


class QueuedCrc:
    """The CRC32 of one buffer, computed in turn on the helper thread."""

    def __init__(self, view: memoryview, initial: int) -> None:
        self._view = view
        self._initial = initial   # the CRC of the bytes before these (crc32's running value)
        self._done = threading.Event()
        self._value: int | None = None
        self._error: BaseException | None = None

    def compute(self) -> None:
        try:
            self._value = crc32(self._view, self._initial)
        except BaseException as exc:  # handed to the waiting thread by result()
            self._error = exc
        finally:
            self._view = memoryview(b"")   # the state's buffer is not held past its checksum
            self._done.set()

    def wait(self) -> None:
        """Wait until the buffer is no longer read (whatever the verdict)."""
        self._done.wait()

    def result(self) -> int:
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value


_jobs: queue.SimpleQueue[QueuedCrc] = queue.SimpleQueue()
_started = threading.Lock()
_thread: threading.Thread | None = None


def start() -> None:
    """Start the helper thread, if it is not running (a model's load calls this, so that a
    first restore does not pay for it)."""
    global _thread
    with _started:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="checkpoint-restore-crc", daemon=True)
            _thread.start()


def _run() -> None:
    while True:
        _jobs.get().compute()


def queue_crc(view: memoryview, initial: int) -> QueuedCrc:
    """Hand the CRC32 of ``view`` (going on from ``initial``) to the helper thread
    (read_checkpoint's ``crc_later``); the reader waits for it with :meth:`QueuedCrc.result`
    (CheckpointData.settle)."""
    job = QueuedCrc(view, initial)
    start()
    _jobs.put(job)
    return job
