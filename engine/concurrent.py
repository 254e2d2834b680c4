"""Concurrent answers: every running answer advances by one token per decode.

:class:`Batcher` drives several answers, each in its own sequence of a
:class:`engine.parallel.ParallelRuntime`.  Each call of :meth:`Batcher.step` makes one
``llama_decode``:

* while some answer still needs its prompt in the cache, a **prefill step**: the next
  chunk of every such prompt (chunks cut at absolute multiples of the batch size, as
  ``Runtime.prefill`` cuts them, so an answer's cache is built from the same pieces
  alone or together), as many as fit in one batch — or only one conversation's chunk
  for a sliding-window model, where a joint prefill is not exact
  (:func:`joint_prefill_exact`);
* otherwise a **generation step**: every running answer chooses its next token from its
  own logits with ``engine.generation.AnswerStepper`` — the very rules of
  ``engine.generation.generate`` (sampler chain, the seed of the token's absolute
  position, end, length and stop strings) — and the chosen tokens are decoded together,
  one per sequence — in groups of at most
  the runtime's exact width (``ParallelRuntime.exact_width``, measured: 4 for SmolLM2,
  3 for Gemma 3 on this CPU build), so each answer stays bit-identical to its run
  alone; ``exact=False`` decodes them all at once.

Answers join at any time (:meth:`Batcher.add`); while one prefills, prefill and
generation steps alternate, so the answers running keep streaming (one prompt chunk
between two tokens).  A prefill step can be cut short when every answer in it was
paused (llama.cpp's abort callback), so a pause during a long prompt is prompt too.
Each answer has its own :class:`engine.generation.Control`: a pause stops that
answer alone at the next step, ``on_stopped`` is called with it at once (the caller
saves its sequence there) and the others go on.  ``should_stop`` stops them all.
``autosave`` is called with a job every ``job.autosave_every`` generated tokens, between
two decodes, and once after a prefill that decoded at least ``job.checkpoint_prompt``
tokens.  The seconds spent in these callbacks are not counted as generation time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.conversation import Conversation
from engine.errors import GenerationError
from engine.generation import (
    FINISH_PAUSED,
    AnswerStepper,
    Control,
    GenerationResult,
    Listener,
    NullListener,
    mark_wants_file,
)
from engine.parallel import ParallelRuntime
from engine.runtime import PrefillReport, chunk_end


@dataclass(eq=False)
class Job:
    """One answer to generate: ``conv.answer`` continued in sequence ``seq``."""
    conv: Conversation
    seq: int
    control: Control = field(default_factory=Control)
    listener: Listener = field(default_factory=NullListener)
    stop_after: int | None = None
    confidence: bool = False
    autosave_every: int = 0                   # Batcher's autosave every N generated tokens (0: never)
    #: the Batcher's autosave right after a prefill that decoded at least this many
    #: tokens (0: never), as engine.generation.generate's ``checkpoint_prompt``
    checkpoint_prompt: int = 0
    skip_eog_once: bool = False               # the first token may not end the answer (Continue)
    result: GenerationResult | None = None    # set when the answer stops


def joint_prefill_exact(prt: ParallelRuntime) -> bool:
    """Whether prompts prefilled together give each conversation the cache it gets alone.

    Measured here (benchmarks/parallel.py, table c; tests/test_parallel.py): for
    SmolLM2 (Q4_1 weights, whose batch width changes nothing) a joint prefill is
    bit-exact; for Gemma 3 (repacked Q4_K weights, multiplied 4 rows at a time) it is
    exact when every prompt starts on a multiple of 4 rows of the batch (128-token
    prompts) and not otherwise (short prompts of any length): a prompt's rows are then
    grouped otherwise than alone.  So prompts share a decode only for a model whose
    generation batches are exact at full width, and, to be safe, without sliding window.
    """
    return prt.shape.n_swa == 0 and prt.exact_width >= prt.sequences


class Batcher:
    """Runs the answers of one ParallelRuntime, one decode per step (see the module)."""

    def __init__(self, prt: ParallelRuntime, *, on_stopped: Callable[[Job], None] | None = None,
                 autosave: Callable[[Job], None] | None = None,
                 should_stop: Callable[[], bool] = lambda: False, joint_prefill: bool | None = None,
                 exact: bool = True) -> None:
        self.prt = prt
        #: generated tokens per decode: at most the runtime's exact width when ``exact``
        #: (each answer then equals its run alone), else every running answer's at once
        self.width = max(1, prt.exact_width) if exact and prt.exact_width else max(prt.sequences, 1)
        #: prompt chunks of several conversations in one decode (None: where exact, see
        #: joint_prefill_exact)
        self.joint_prefill = joint_prefill_exact(prt) if joint_prefill is None else joint_prefill
        self.on_stopped = on_stopped
        self.autosave = autosave
        self.should_stop = should_stop
        self._prefilling: dict[Job, tuple[PrefillReport, float]] = {}   # report, requested at
        self._running: dict[Job, AnswerStepper] = {}
        self._prefilled_last = False
        self.done: list[Job] = []
        #: steps made, and tokens generated by them
        self.generated = 0
        #: seconds spent in generation steps (choosing, decoding, accepting; not on_stopped)
        self.generation_s = 0.0
        self._callback_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._prefilling or self._running)

    @property
    def jobs(self) -> list[Job]:
        """Every answer not stopped yet, prefilling or generating."""
        return list(self._prefilling) + list(self._running)

    def add(self, job: Job, *, requested_at: float | None = None) -> None:
        """Start ``job``'s answer (its conversation placed in ``job.seq`` already)."""
        answer = job.conv.answer
        if answer is None or answer.finished:
            raise GenerationError("there is no answer to continue")
        if any(j.seq == job.seq for j in self.jobs):
            raise GenerationError(f"sequence {job.seq} already has an answer running")
        keep = self.prt.reuse(job.seq, job.conv.tokens)
        report = PrefillReport(n_prompt=len(job.conv.tokens), n_reused=keep)
        self._prefilling[job] = (report, time.perf_counter() if requested_at is None else requested_at)
        if keep == len(job.conv.tokens):
            self._start(job)

    @property
    def pausing(self) -> bool:
        """An answer was asked to pause and has not stopped yet: its next step stops it
        (and its conversation is saved)."""
        return any(job.control.pause_requested for job in self.jobs)

    def run(self) -> list[Job]:
        """Step until every answer stopped; returns the jobs in the order they stopped."""
        while self.busy:
            self.step()
        return self.done

    def step(self) -> None:
        if self.should_stop():
            for job in list(self._prefilling):
                self._abort_prefill(job)
            for job in list(self._running):
                self._stop(job)
            return
        for job in [j for j in self._prefilling if j.control.pause_requested]:
            self._abort_prefill(job)
        if self._prefilling and not (self._running and self._prefilled_last):
            self._prefilled_last = True
            self._prefill_step()
        elif self._running:
            self._prefilled_last = False
            self._generation_step()

    # -- prefill --------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        started = time.perf_counter()
        prt = self.prt
        step = prt.settings.n_batch
        chunks, room = [], prt.batch.capacity
        for job in self._prefilling:
            tokens, pos = job.conv.tokens, len(prt.tokens(job.seq))
            end = chunk_end(pos, len(tokens), step, self._marks(job))
            if end - pos > room:
                continue
            room -= end - pos
            chunks.append((job, pos, end))
            if not self.joint_prefill:
                break
        if not prt.make_room(sum(end - pos for _, pos, end in chunks)):
            for job, _, _ in chunks:
                # no cells while the running answers hold them: paused before they start
                # (saved as such), to be resumed when the others are done
                self._abort_prefill(job)
            return
        jobs = [job for job, _, _ in chunks]
        complete = prt.decode_chunks(
            [(job.seq, job.conv.tokens[pos:end], end == len(job.conv.tokens)) for job, pos, end in chunks],
            should_abort=lambda: self.should_stop() or all(j.control.pause_requested for j in jobs))
        elapsed = time.perf_counter() - started
        for job, pos, end in chunks:
            report, _ = self._prefilling[job]
            reached = len(prt.tokens(job.seq))
            report.n_decoded += reached - pos
            report.seconds += elapsed
            if not complete:
                continue   # paused: the next step stops them (or goes on from where they are)
            job.listener.on_prefill_progress(end, len(job.conv.tokens))
            if end in self._marks(job) and end < len(job.conv.tokens):
                prt.keep_snapshot(job.seq)
                if self.autosave is not None and job.checkpoint_prompt and mark_wants_file(job.conv, prt.model, end):
                    self._callback(self.autosave, job)
            if end == len(job.conv.tokens):
                if self.autosave is not None and job.checkpoint_prompt and report.n_decoded >= job.checkpoint_prompt:
                    self._callback(self.autosave, job)
                self._start(job)

    def _marks(self, job: Job) -> tuple[int, ...]:
        """Where ``job``'s prompt is cut (Answer.cuts): a recurrent memory's snapshots, a
        sliding window's shared prefix's end (Runtime.prefill)."""
        answer = job.conv.answer
        shape = self.prt.shape
        return answer.cuts if answer is not None and (shape.has_recurrent or shape.prefix_from_window) else ()

    def _abort_prefill(self, job: Job) -> None:
        report, _ = self._prefilling.pop(job)
        report.aborted = True
        job.result = GenerationResult(text="", finish_reason=FINISH_PAUSED, n_prompt_tokens=report.n_prompt,
                                      n_reused_tokens=report.n_reused, n_prefilled=report.n_decoded,
                                      prefill_s=report.seconds)
        self._stopped(job)

    def _start(self, job: Job) -> None:
        report, requested = self._prefilling.pop(job)
        prt = self.prt
        self._running[job] = AnswerStepper(
            job.conv, n_ctx=prt.ctx.n_ctx, n_vocab=prt.ctx.n_vocab, model=prt.model, eog_ids=prt.eog_ids,
            candidates=prt.candidates, listener=job.listener, control=job.control, report=report,
            stop_after=job.stop_after, confidence=job.confidence, skip_eog_once=job.skip_eog_once,
            requested_at=requested)

    # -- generation -----------------------------------------------------------------------
    def _generation_step(self) -> None:
        started, callbacks = time.perf_counter(), self._callback_s
        try:
            self._generate_one()
        finally:
            self.generation_s += time.perf_counter() - started - (self._callback_s - callbacks)

    def _generate_one(self) -> None:
        prt = self.prt
        if not prt.make_room(len(self._running)):
            for job, stepper in list(self._running.items()):
                stepper.finish = "context_full"
                self._stop(job)
            return
        chosen: dict[int, int] = {}
        for job, stepper in list(self._running.items()):
            token = stepper.choose(lambda seq=job.seq: prt.logits(seq), len(prt.tokens(job.seq)))
            if token is None:
                self._stop(job)
            else:
                chosen[job.seq] = token
        if not chosen:
            return
        if self.autosave is not None:
            for job, stepper in self._running.items():
                if job.seq in chosen and stepper.autosave_next(job.autosave_every):
                    prt.keep_step_snapshot(job.seq)   # its autosave is written one token short
        width = self.width
        items = list(chosen.items())
        for start in range(0, len(items), width):
            prt.decode_tokens(dict(items[start:start + width]))
        self.generated += len(chosen)
        for job, stepper in list(self._running.items()):
            token = chosen.get(job.seq)
            if token is None:
                continue
            if not stepper.accepted(token):
                self._stop(job)
                continue
            if self.autosave is not None and stepper.autosave_due(job.autosave_every):
                self._callback(self.autosave, job)

    def _stop(self, job: Job) -> None:
        job.result = self._running.pop(job).end()
        self._stopped(job)

    def _stopped(self, job: Job) -> None:
        self.done.append(job)
        if self.on_stopped is not None:
            self._callback(self.on_stopped, job)

    def _callback(self, callback: Callable[[Job], None], job: Job) -> None:
        """The caller's code (a save): its time is not generation time."""
        started = time.perf_counter()
        try:
            callback(job)
        finally:
            self._callback_s += time.perf_counter() - started
