"""The bridge between the engine thread and the server's asyncio loop.

:class:`EngineLink` is one more listener of the worker (``EngineWorker.add_listener``):
its callbacks run on the engine thread and only post events to the loop with
``call_soon_threadsafe``.  Each request the server submits has a :class:`Job`; the
request's own callbacks carry its id, and between ``on_request_started`` and its end
the answer's callbacks carry its conversation's id, which the link maps back to the
job (requests are answered concurrently, but each running answer has a conversation of
its own — a request never continues a conversation that is answering — so the mapping is
unambiguous; the window's own answers, with other ids, are ignored).

A job's events, in order: ``("started", ConversationSnapshot)``, any number of
``("text", str)``, ``("finished", GenerationSummary)``, then ``("done", Path | None)``
(the answer's checkpoint); or ``("failed", RequestRefusal)`` at any point.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid

from engine.events import (
    GenerationSummary,
    RequestFailed,
    RequestFinished,
    RequestRefusal,
    RequestStarted,
    Stopped,
    TextDelta,
    WorkerListener,
)
from engine.requests import SHUTTING_DOWN

log = logging.getLogger("engine")


class Job:
    """One request's events, posted by the engine thread, read by its handler."""

    def __init__(self, loop: asyncio.AbstractEventLoop, request_id: str) -> None:
        self.id = request_id
        self._loop = loop
        self._events: asyncio.Queue = asyncio.Queue()
        self.ended = False          # "done" or "failed" was read: nothing to cancel

    def post(self, *event) -> None:
        """Any thread: queue an event for the handler."""
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:        # the loop is closed: nobody is waiting any more
            pass

    async def next(self) -> tuple:
        event = await self._events.get()
        if event[0] in ("done", "failed"):
            self.ended = True
        return event


class EngineLink(WorkerListener):
    """A worker listener that delivers the server's requests' events to their jobs."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._jobs: dict[str, Job] = {}
        self._by_conv: dict[uuid.UUID, Job] = {}     # engine thread only

    # -- the loop's side ----------------------------------------------------------------------
    def open(self) -> Job:
        job = Job(self._loop, uuid.uuid4().hex)
        with self._lock:
            self._jobs[job.id] = job
        return job

    def forget(self, job: Job) -> None:
        with self._lock:
            self._jobs.pop(job.id, None)

    def jobs(self) -> list[Job]:
        with self._lock:
            return list(self._jobs.values())

    # -- the engine thread's side ----------------------------------------------------------------
    def _job(self, request_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(request_id)

    def on_request_started(self, e: RequestStarted) -> None:
        job = self._job(e.request_id)
        if job is not None:
            self._by_conv[e.snap.id] = job
            job.post("started", e.snap)

    def on_text(self, e: TextDelta) -> None:
        job = self._by_conv.get(e.conv_id)
        if job is not None:
            job.post("text", e.delta)

    def on_generation_finished(self, summary: GenerationSummary) -> None:
        job = self._by_conv.get(summary.conversation_id)
        if job is not None:
            job.post("finished", summary)

    def on_request_finished(self, e: RequestFinished) -> None:
        self._by_conv.pop(e.conv_id, None)
        job = self._job(e.request_id)
        if job is not None:
            job.post("done", e.checkpoint)

    def on_request_failed(self, e: RequestFailed) -> None:
        job = self._job(e.request_id)
        self._by_conv = {c: j for c, j in self._by_conv.items() if j is not job}
        if job is not None:
            job.post("failed", e.refusal)

    def on_stopped(self, e: Stopped) -> None:
        self._by_conv = {}
        for job in self.jobs():
            job.post("failed", RequestRefusal(SHUTTING_DOWN, "the engine stopped"))
