"""Background work for the UI thread under qasync: file I/O off the event loop.

Only pure-Python file work (listing, CRC, copying) goes through here; everything that
touches the model goes to the engine thread instead (gui.bridge).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging

import qasync

log = logging.getLogger("gui")

# Plain Python threads rather than qasync's default QThread executor: a QThread still
# running when the interpreter exits aborts the process, a Python pool is joined at exit.
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gui-io")


def ensure_event_loop(app) -> asyncio.AbstractEventLoop:
    """The qasync loop for ``app``; created (as already running) when a test's Qt loop drives it."""
    try:
        loop = asyncio.get_event_loop()
    except RuntimeError:
        loop = None
    if isinstance(loop, qasync.QEventLoop) and not loop.is_closed():
        return loop
    loop = qasync.QEventLoop(app, already_running=True)
    asyncio.set_event_loop(loop)
    return loop


def close_event_loop() -> None:
    """Close the qasync loop that :func:`ensure_event_loop` made, while Qt is still alive.

    A loop "already running" under a Qt loop that never quits (tests, an embedding host)
    is otherwise left to the interpreter's exit, which deletes its Qt objects (timer,
    socket notifiers) after the QApplication: "shared QObject was deleted directly", then
    heap corruption.  The app's own loop is closed by ``with loop:`` in gui.app.
    """
    loop = asyncio.get_event_loop_policy()._local._loop   # without creating one
    if not isinstance(loop, qasync.QEventLoop) or loop.is_closed():
        return
    loop.stop()                              # "already running": only marks it stopped
    asyncio.events._set_running_loop(None)
    loop.close()
    asyncio.set_event_loop(None)


async def in_thread(fn, *args, **kwargs):
    """Run ``fn`` on an executor thread and await its result."""
    loop = asyncio.get_event_loop()
    return await loop.run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))


def spawn(coro) -> asyncio.Future:
    """Start a coroutine on the qasync loop; failures are logged, never swallowed silently."""
    task = asyncio.ensure_future(coro)

    def done(t: asyncio.Future) -> None:
        if not t.cancelled() and t.exception() is not None:
            log.error("background task failed", exc_info=t.exception())
    task.add_done_callback(done)
    return task


def thread_safe(callback):
    """Wrap ``callback`` so a worker thread may call it; it runs on the loop's thread."""
    loop = asyncio.get_event_loop()

    def call(*args):
        loop.call_soon_threadsafe(callback, *args)
    return call
