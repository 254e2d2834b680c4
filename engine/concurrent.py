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
  own logits, exactly as ``engine.generation.generate`` would (same sampler chain, the
  seed of the token's absolute position, the same end, length and stop-string rules),
  and the chosen tokens are decoded together, one per sequence — in groups of at most
  the runtime's exact width (``ParallelRuntime.exact_width``, measured: 4 for SmolLM2,
  3 for Gemma 3 on this CPU build), so each answer stays bit-identical to its run
  alone; ``exact=False`` decodes them all at once.

Answers join at any time (:meth:`Batcher.add`); the ones running wait for one prefill
step.  Each answer has its own :class:`engine.generation.Control`: a pause stops that
answer alone at the next step, ``on_stopped`` is called with it at once (the caller
saves its sequence there) and the others go on.  ``should_stop`` stops them all.
``autosave`` is called with a job every ``job.autosave_every`` generated tokens, between
two decodes.  The seconds spent in these callbacks are not counted as generation time.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.conversation import Conversation
from engine.errors import GenerationError
from engine.generation import (FINISH_PAUSED, Control, GenerationResult, Listener, NullListener,
                               _probability, _stop_hold, _without_eog)
from engine.parallel import ParallelRuntime
from engine.runtime import PrefillReport
from engine.sampling import seed_for
from native.sampler import SamplerChain


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
    result: GenerationResult | None = None    # set when the answer stops


class _Answer:
    """One job's per-token state, as engine.generation.generate keeps it."""

    def __init__(self, prt: ParallelRuntime, job: Job, report: PrefillReport, requested_at: float) -> None:
        self.prt, self.job = prt, job
        conv = job.conv
        self.answer = conv.answer
        s = self.sampler = conv.sampler
        n_ctx = prt.ctx.n_ctx
        self.window = n_ctx if s.repeat_last_n < 0 else s.repeat_last_n
        self.chain = SamplerChain(n_vocab=prt.ctx.n_vocab, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                  temperature=s.temperature, repeat_penalty=s.repeat_penalty,
                                  repeat_last_n=self.window)
        self.chain.accept(conv.tokens[-self.window:] if self.window else [])
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.decoder.setstate((self.answer.pending, 0))
        self.stops = conv.stop_strings
        self.emitted_before = self.answer.emitted
        self.generated_here = 0
        self.requested_at = requested_at
        self.started = time.perf_counter()
        self.finish: str | None = None
        self.result = GenerationResult(text="", finish_reason=FINISH_PAUSED, n_prompt_tokens=len(conv.tokens),
                                       n_reused_tokens=report.n_reused, n_prefilled=report.n_decoded,
                                       prefill_s=report.seconds)

    def choose(self) -> int | None:
        """The next token, or None when the answer stops before it (``finish`` says why;
        None there: paused)."""
        job, a, prt = self.job, self.answer, self.prt
        if a.n_predict >= 0 and a.n_generated >= a.n_predict:
            self.finish = "length"
            return None
        if job.control.pause_requested or (job.stop_after is not None and self.generated_here >= job.stop_after):
            return None
        pos = len(prt.tokens(job.seq))
        if pos >= prt.ctx.n_ctx:
            self.finish = "context_full"
            return None
        logits = prt.logits(job.seq)
        if self.sampler.ignore_eos:
            logits = _without_eog(prt, logits)
        token = self.chain.sample(prt.candidates, logits, 0 if self.chain.greedy else seed_for(self.sampler.seed, pos))
        if job.confidence:
            top = float(logits[token]) if self.chain.greedy and not self.chain.has_penalty else None
            self.result.probabilities.append(_probability(logits, token, top))
        if self.result.ttft_s is None:
            self.result.ttft_s = time.perf_counter() - self.requested_at
        if prt.model.is_eog(token):
            self.finish = "stop"
            return None
        return token

    def accepted(self, token: int) -> bool:
        """``token`` is in the cache now; False when it ended the answer (a stop string)."""
        a, job = self.answer, self.job
        job.conv.tokens.append(token)
        self.chain.accept((token,))
        a.n_generated += 1
        self.generated_here += 1
        a.text += self.decoder.decode(self.prt.model.token_to_piece(token))
        stops = self.stops
        if stops:
            cut = min((i for i in (a.text.find(st, max(0, a.emitted - len(st))) for st in stops) if i >= 0),
                      default=-1)
            if cut >= 0:
                a.text = a.text[:cut]
                self.decoder.reset()
                self.finish = "stop_string"
                return False
        show_upto = len(a.text) - _stop_hold(a.text, stops)
        if show_upto > a.emitted:
            job.listener.on_text(a.text[a.emitted:show_upto])
            a.emitted = show_upto
        return True

    def sync_pending(self) -> None:
        """Store the bytes of an incomplete character, so a save now can resume it."""
        self.answer.pending = self.decoder.getstate()[0]

    def end(self) -> GenerationResult:
        a, result = self.answer, self.result
        self.chain.close()
        result.generation_s = time.perf_counter() - self.started
        result.n_generated = self.generated_here
        if self.finish is None:
            a.pending = self.decoder.getstate()[0]
        else:
            a.pending = b""
            a.finish_reason = self.finish
            if len(a.text) > a.emitted:
                self.job.listener.on_text(a.text[a.emitted:])
                a.emitted = len(a.text)
            result.finish_reason = self.finish
        result.text = a.text[self.emitted_before:a.emitted]
        return result


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
    return prt.model.shape.n_swa == 0 and prt.exact_width >= prt.sequences


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
        self._prefilling: dict[Job, tuple[PrefillReport, int, float]] = {}   # report, next pos, requested
        self._running: list[_Answer] = []
        self.done: list[Job] = []
        #: steps made, and tokens generated by them
        self.generated = 0
        #: seconds spent in generation steps (choosing, decoding, accepting; not on_stopped)
        self.generation_s = 0.0
        self._callback_s = 0.0

    @property
    def busy(self) -> bool:
        return bool(self._prefilling or self._running)

    def add(self, job: Job, *, requested_at: float | None = None) -> None:
        """Start ``job``'s answer (its conversation placed in ``job.seq`` already)."""
        answer = job.conv.answer
        if answer is None or answer.finished:
            raise GenerationError("there is no answer to continue")
        if any(j.seq == job.seq for j in self._jobs()):
            raise GenerationError(f"sequence {job.seq} already has an answer running")
        keep = self.prt.reuse(job.seq, job.conv.tokens)
        report = PrefillReport(n_prompt=len(job.conv.tokens), n_reused=keep)
        self._prefilling[job] = (report, keep, time.perf_counter() if requested_at is None else requested_at)
        if keep == len(job.conv.tokens):
            self._start(job)

    def _jobs(self):
        return list(self._prefilling) + [r.job for r in self._running]

    def run(self) -> list[Job]:
        """Step until every answer stopped; returns the jobs in the order they stopped."""
        while self.busy:
            self.step()
        return self.done

    def step(self) -> None:
        if self.should_stop():
            for job in list(self._prefilling):
                self._abort_prefill(job)
            for answer in list(self._running):
                self._stop(answer)
            return
        for job in [j for j in self._prefilling if j.control.pause_requested]:
            self._abort_prefill(job)
        if self._prefilling:
            self._prefill_step()
        elif self._running:
            self._generation_step()

    # -- prefill --------------------------------------------------------------------------
    def _prefill_step(self) -> None:
        started = time.perf_counter()
        step = self.prt.settings.n_batch
        chunks, room = [], self.prt.batch.capacity
        for job, (report, pos, _) in self._prefilling.items():
            tokens = job.conv.tokens
            end = min(len(tokens), (pos // step + 1) * step)
            if end - pos > room:
                continue
            room -= end - pos
            chunks.append((job, pos, end))
            if not self.joint_prefill:
                break
        self.prt.decode_chunks([(job.seq, job.conv.tokens[pos:end], end == len(job.conv.tokens))
                                for job, pos, end in chunks])
        elapsed = time.perf_counter() - started
        for job, pos, end in chunks:
            report, _, requested = self._prefilling[job]
            report.n_decoded += end - pos
            report.seconds += elapsed
            self._prefilling[job] = (report, end, requested)
            if end == len(job.conv.tokens):
                self._start(job)

    def _abort_prefill(self, job: Job) -> None:
        report, _, _ = self._prefilling.pop(job)
        report.aborted = True
        job.result = GenerationResult(text="", finish_reason=FINISH_PAUSED, n_prompt_tokens=report.n_prompt,
                                      n_reused_tokens=report.n_reused, n_prefilled=report.n_decoded,
                                      prefill_s=report.seconds)
        self._stopped(job)

    def _start(self, job: Job) -> None:
        report, _, requested = self._prefilling.pop(job)
        self._running.append(_Answer(self.prt, job, report, requested))

    # -- generation -----------------------------------------------------------------------
    def _generation_step(self) -> None:
        started, callbacks = time.perf_counter(), self._callback_s
        try:
            self._generate_one()
        finally:
            self.generation_s += time.perf_counter() - started - (self._callback_s - callbacks)

    def _generate_one(self) -> None:
        if not self.prt.make_room(len(self._running)):
            for answer in list(self._running):
                answer.finish = "context_full"
                self._stop(answer)
            return
        chosen: dict[int, int] = {}
        for answer in list(self._running):
            token = answer.choose()
            if token is None:
                self._stop(answer)
            else:
                chosen[answer.job.seq] = token
        if not chosen:
            return
        width = self.width
        items = list(chosen.items())
        for start in range(0, len(items), width):
            self.prt.decode_tokens(dict(items[start:start + width]))
        self.generated += len(chosen)
        for answer in list(self._running):
            token = chosen.get(answer.job.seq)
            if token is None:
                continue
            if not answer.accepted(token):
                self._stop(answer)
                continue
            every = answer.job.autosave_every
            if self.autosave is not None and every and answer.answer.n_generated % every == 0:
                answer.sync_pending()
                self._callback(self.autosave, answer.job)

    def _stop(self, answer: _Answer) -> None:
        self._running.remove(answer)
        answer.job.result = answer.end()
        self._stopped(answer.job)

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
