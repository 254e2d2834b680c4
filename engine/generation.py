"""The generation loop: prefill, sample, decode, stream, stop or pause.

Runs on the thread that owns the :class:`~engine.runtime.Runtime`.  Other threads talk
to it only through :class:`Control` (pause) and receive text through the listener
callbacks, which run on the generating thread and must return quickly.
"""

from __future__ import annotations

import codecs
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine import chat_template
from engine.conversation import Answer, Conversation, title_from
from engine.errors import GenerationError
from engine.runtime import PrefillReport, Runtime
from engine.sampling import seed_for
from engine.shared_prefix import MIN_TOKENS as SHARED_MIN_TOKENS
from engine.shared_prefix import system_prompt_text
from native.model import Model
from native.sampler import SamplerChain

FINISH_PAUSED = "paused"


class Control:
    """A pause request that any thread may make; the generating thread honours it."""

    def __init__(self) -> None:
        self._pause = threading.Event()

    def request_pause(self) -> None:
        # a prefill chunk in progress sees it too: llama.cpp's abort callback reads it
        self._pause.set()

    @property
    def pause_requested(self) -> bool:
        return self._pause.is_set()

    def reset(self) -> None:
        self._pause.clear()


class Listener(Protocol):
    def on_prefill_progress(self, done: int, total: int) -> None: ...
    def on_text(self, delta: str) -> None: ...


class NullListener:
    def on_prefill_progress(self, done: int, total: int) -> None:
        pass

    def on_text(self, delta: str) -> None:
        pass


@dataclass
class GenerationResult:
    text: str                       # text shown during this run
    finish_reason: str              # "stop", "length", "stop_string", "context_full", "paused"
    n_prompt_tokens: int = 0
    n_reused_tokens: int = 0
    n_prefilled: int = 0
    n_generated: int = 0            # tokens generated during this run
    ttft_s: float | None = None     # from the request (see generate's requested_at) to the first token
    prefill_s: float = 0.0          # decoding the prompt tokens the cache lacked, nothing else
    generation_s: float = 0.0
    probabilities: list[float] = field(default_factory=list)   # only with confidence=True

    @property
    def paused(self) -> bool:
        return self.finish_reason == FINISH_PAUSED

    @property
    def tokens_per_s(self) -> float:
        # the first token's time belongs to the prefill (it comes from its logits)
        if self.n_generated == 0 or self.generation_s <= 0:
            return 0.0
        return self.n_generated / self.generation_s

    @property
    def confidence(self) -> dict[str, float] | None:
        if not self.probabilities:
            return None
        return {"mean": float(np.mean(self.probabilities)), "min": float(np.min(self.probabilities))}


class HasModel(Protocol):
    """A runtime as :func:`begin_answer` uses one: only its model (a Runtime, a
    ParallelRuntime, or one conversation of it)."""

    @property
    def model(self) -> Model: ...


#: a recurrent memory's prompt mark gets a file of its own (an autosave, with a line in the
#: store) only this many tokens into the prompt or more: before that, reading the prompt
#: again costs less than the file
MARK_FILE_MIN = 64


def mark_wants_file(conv: Conversation, model, pos: int) -> bool:
    """Whether a recurrent memory's prefill of ``conv``, at its mark ``pos``, autosaves (with
    a line in the store): only at the end of the user's turn of a thinking model, whose
    template drops the answer's thinking from the next turn's prompt, so that turn parts
    from this one there, in this process or the next.  (Elsewhere a file of the chain is
    close enough: an Edit after a restart goes back to the previous answer's file, a few
    tokens before the message; each file of a hybrid holds its whole recurrent state.)"""
    marks = conv.answer.marks if conv.answer is not None else ()
    return bool(marks) and pos == marks[-1] and pos >= MARK_FILE_MIN \
        and chat_template.think_format(model) is not None


def begin_answer(conv: Conversation, runtime: HasModel, user_text: str, *, n_predict: int = -1) -> None:
    """Add a user turn and make ``conv.tokens`` the prompt for the assistant's answer."""
    commit_answer(conv)
    if conv.paused:
        raise GenerationError("the previous answer is paused; resume or discard it first")
    if not conv.messages and conv.title in ("", "New conversation"):
        conv.title = title_from(user_text)
    previous = _state_text(conv, runtime)
    if previous is None:
        previous = cut_to_history(conv, runtime)
    conv.messages.append(("user", user_text))
    prompt = chat_template.render(runtime.model, conv.chat_messages(), add_assistant=True, now=conv.created)
    if previous is not None and not prompt.startswith(previous):
        previous = None
    n_kept = len(conv.tokens) if previous is not None else 0
    if previous is not None:
        # the tokens the model has seen stay as they were, the new turn follows them: the
        # conversation's state stays a prefix of the next one (no tail decoded again, a
        # delta checkpoint on the last one), whatever re-tokenising the answer would give
        conv.tokens = conv.tokens + runtime.model.tokenize(prompt[len(previous):], add_special=False)
    else:
        conv.tokens = runtime.model.tokenize_prompt(prompt)
    if runtime.model.memory_kind:
        marks = turn_marks(conv, runtime.model, prompt, previous, n_kept)
    elif runtime.model.shape.n_swa:
        marks = system_mark(conv, runtime.model, prompt, previous, n_kept)
    else:
        marks = ()
    conv.answer = Answer(n_prompt_tokens=len(conv.tokens), n_predict=n_predict, marks=marks)


def turn_marks(conv: Conversation, model, prompt: str, previous: str | None, n_kept: int) -> tuple[int, ...]:
    """Answer.marks of the prompt ``conv.tokens`` (rendered as ``prompt``): the token counts
    where the user's last message starts (an Edit parts from the prompt there) and where
    its turn ends, before the assistant's opening (a next turn whose template rewrites
    the answer, dropping its thinking, parts there).

    ``conv.tokens`` is either ``prompt`` tokenized whole (``previous`` None), or the
    ``n_kept`` tokens the model saw for the text ``previous`` followed by the rest
    tokenized; a mark is kept only where the tokens agree with a tokenization of the text
    before it, so it is a true boundary of the prompt (none is better than a wrong one).
    """
    messages = conv.chat_messages()
    if not messages or messages[-1][0] != "user":
        return ()
    # where the message starts: the template's text for it with other words in its place
    # parts from the prompt there
    probes = [chat_template.render_quietly(model, messages[:-1] + [("user", word)], add_assistant=False,
                                           now=conv.created) or ""
              for word in ("x", "y")]
    starts = os.path.commonprefix(probes) if all(probes) else ""
    turn = chat_template.render_quietly(model, messages, add_assistant=False, now=conv.created) or ""
    marks = {end for end in (_mark_at(cut, conv, model, prompt, previous, n_kept) for cut in (starts, turn)) if end}
    # its shared prefix's recurrent part (engine.shared_prefix) is the snapshot kept there
    marks.update(system_mark(conv, model, prompt, previous, n_kept))
    return tuple(sorted(marks))


def system_mark(conv: Conversation, model, prompt: str, previous: str | None, n_kept: int) -> tuple[int, ...]:
    """Where a long system prompt ends, in a first turn (a mark: turn_marks), or ().

    A conversation that starts from the system prompt's shared prefix (engine.shared_prefix)
    reads on from there: a prefill from nothing is cut there too, so both decode the same
    pieces (a sliding window's bits depend on them; a recurrent memory keeps its snapshot
    there)."""
    end = _mark_at(system_prompt_text(model, conv), conv, model, prompt, previous, n_kept)
    return (end,) if end >= SHARED_MIN_TOKENS else ()


def _mark_at(cut: str, conv: Conversation, model, prompt: str, previous: str | None, n_kept: int) -> int:
    """The token count where the prompt's text ``cut`` ends (turn_marks), or 0 where that
    is no boundary of its tokens."""
    if not cut or len(cut) >= len(prompt) or not prompt.startswith(cut):
        return 0
    if previous is None:
        base, part = 0, model.tokenize_prompt(cut)
    elif len(cut) >= len(previous):
        base, part = n_kept, model.tokenize(prompt[len(previous):len(cut)], add_special=False)
    else:
        return 0   # inside the tokens the model saw: their boundaries are not this text's
    end = base + len(part)
    return end if 0 < end < len(conv.tokens) and conv.tokens[base:end] == part else 0


def _state_text(conv: Conversation, runtime: HasModel) -> str | None:
    """The text that ``conv.tokens`` stands for, when it ends with a committed answer the
    model wrote token by token (not cut at a stop string, which the tokens still hold)."""
    a = conv.answer
    if not conv.tokens or a is None or a.finish_reason == "stop_string" or a.pending \
            or not (conv.messages and conv.messages[-1] == ("assistant", a.text)):
        return None
    if len(conv.tokens) != a.n_prompt_tokens + a.n_generated:
        return None
    before = chat_template.render(runtime.model, conv.chat_messages()[:-1], add_assistant=True, now=conv.created)
    return before + a.text


def cut_to_history(conv: Conversation, runtime: HasModel) -> str | None:
    """After an edit (the messages cut back to an answer, no answer object), the text of
    that history, with ``conv.tokens`` cut to the tokens the model saw for it.

    A fresh tokenisation of the history may end one token otherwise than the model's own
    tokens did (an answer's last token merged with the template's next text), and a
    sliding-window or recurrent memory depends on where each token was decoded: a new turn
    must follow the tokens the model saw, as a continuation of a checkpoint of that history
    does.  The tokens are matched by their text, special tokens rendered empty on both sides,
    decoded as an answer's text was (UTF-8, an invalid byte sequence a replacement
    character: engine.generation.AnswerStepper), so an answer whose bytes are no valid UTF-8
    — a small model's stray bytes, a character the token limit cut at the end of the last
    answer — still matches the tokens that wrote it (matched by their bytes, such a history
    was read again whole).  (A character cut at the end of an earlier answer still does not:
    that answer's text dropped its bytes, which the template's next text then follows.)
    """
    if conv.answer is not None or not conv.tokens or not conv.messages or conv.messages[-1][0] != "assistant":
        return None
    model = runtime.model
    text = chat_template.render(model, conv.chat_messages()[:-1], add_assistant=True,
                                now=conv.created) + conv.messages[-1][1]
    target = b"".join(model.token_to_piece(t) for t in model.tokenize_prompt(text)).decode("utf-8", "replace")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    seen = 0
    for n, token in enumerate(conv.tokens, 1):
        piece = decoder.decode(model.token_to_piece(token))
        if not target.startswith(piece, seen):
            return None
        seen += len(piece)
        if seen == len(target):
            conv.tokens = conv.tokens[:n]
            return text
    return None


def commit_answer(conv: Conversation) -> None:
    """Move a finished answer into the message list (idempotent)."""
    a = conv.answer
    if a is not None and a.finished and not (conv.messages and conv.messages[-1][0] == "assistant"):
        conv.messages.append(("assistant", a.text))


def discard_answer(conv: Conversation) -> None:
    """Forget the answer in progress (for Regenerate): the prompt stays."""
    if conv.answer is not None:
        if conv.messages and conv.messages[-1][0] == "assistant" and conv.answer.finished:
            conv.messages.pop()
        conv.tokens = conv.tokens[:conv.answer.n_prompt_tokens]
        conv.answer = Answer(n_prompt_tokens=len(conv.tokens), n_predict=conv.answer.n_predict,
                             marks=conv.answer.marks, shared_end=conv.answer.shared_end)


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing characters could still be the start of a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


class AnswerStepper:
    """One answer's per-token rules, shared by :func:`generate` and the concurrent
    ``engine.concurrent.Batcher``: the sampler chain, the seed of each token's absolute
    position, the length, end, context and stop-string rules, and the text streamed.

    The caller owns the cache: it asks :meth:`choose` for the next token (given the
    logits after the tokens the cache holds and their count), decodes it, and reports
    it with :meth:`accepted`; :meth:`end` closes the answer and returns its result.
    """

    def __init__(self, conv: Conversation, *, n_ctx: int, n_vocab: int, model, eog_ids: np.ndarray,
                 candidates, listener: Listener, control: Control, report: PrefillReport,
                 stop_after: int | None = None, confidence: bool = False,
                 skip_eog_once: bool = False, requested_at: float | None = None) -> None:
        answer = conv.answer
        if answer is None or answer.finished:
            raise GenerationError("there is no answer to continue")
        self.conv, self.answer, self.model = conv, answer, model
        self.n_ctx, self.eog_ids, self.candidates = n_ctx, eog_ids, candidates
        self.listener, self.control = listener, control
        self.stop_after, self.confidence, self.skip_eog_once = stop_after, confidence, skip_eog_once
        s = self.sampler = conv.sampler
        # llama.cpp's convention: repeat_last_n -1 means the whole context
        window = n_ctx if s.repeat_last_n < 0 else s.repeat_last_n
        self.chain = SamplerChain(n_vocab=n_vocab, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                                  temperature=s.temperature, repeat_penalty=s.repeat_penalty,
                                  repeat_last_n=window)
        self.chain.accept(conv.tokens[-window:] if window else [])
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.decoder.setstate((answer.pending, 0))
        self.stops = conv.stop_strings
        self.emitted_before = answer.emitted
        self.generated_here = 0
        self.requested_at = time.perf_counter() if requested_at is None else requested_at
        self.started = time.perf_counter()
        #: why the answer ended (None while it goes on, and for a pause)
        self.finish: str | None = None
        self.result = GenerationResult(text="", finish_reason=FINISH_PAUSED, n_prompt_tokens=len(conv.tokens),
                                       n_reused_tokens=report.n_reused, n_prefilled=report.n_decoded,
                                       prefill_s=report.seconds)

    def choose(self, logits_at, pos: int) -> int | None:
        """The next token at position ``pos`` (``logits_at()`` gives the logits there),
        or None when the answer stops before it (``finish`` says why; None: paused)."""
        a = self.answer
        if a.n_predict >= 0 and a.n_generated >= a.n_predict:
            self.finish = "length"
            return None
        if self.control.pause_requested or (self.stop_after is not None
                                            and self.generated_here >= self.stop_after):
            return None
        if pos >= self.n_ctx:
            self.finish = "context_full"
            return None
        logits = logits_at()
        if self.sampler.ignore_eos or (self.skip_eog_once and self.generated_here == 0):
            logits = _without_eog(self, logits)
        # greedy draws nothing at random: no per-position seed to derive
        chain = self.chain
        token = chain.sample(self.candidates, logits, 0 if chain.greedy else seed_for(self.sampler.seed, pos))
        if self.confidence:
            # plain greedy picked the argmax: its logit is the maximum the softmax needs
            top = float(logits[token]) if chain.greedy and not chain.has_penalty else None
            self.result.probabilities.append(_probability(logits, token, top))
        if self.result.ttft_s is None:
            self.result.ttft_s = time.perf_counter() - self.requested_at
        if self.model.is_eog(token):
            self.finish = "stop"
            return None
        return token

    def accepted(self, token: int) -> bool:
        """``token`` is in the cache now; False when it ended the answer (a stop string)."""
        a = self.answer
        self.conv.tokens.append(token)
        self.chain.accept((token,))
        a.n_generated += 1
        self.generated_here += 1
        a.text += self.decoder.decode(self.model.token_to_piece(token))
        stops = self.stops
        if stops:
            cut = min((i for i in (a.text.find(st, max(0, a.emitted - len(st))) for st in stops) if i >= 0),
                      default=-1)
            if cut >= 0:
                a.text = a.text[:cut]
                # (a stop string given only when resuming can begin in text shown before the
                # pause: the answer is cut there all the same, as a run with it throughout)
                a.emitted = min(a.emitted, cut)
                self.decoder.reset()  # bytes after the stop string are not part of the answer
                self.finish = "stop_string"
                return False
        show_upto = len(a.text) - _stop_hold(a.text, stops)
        if show_upto > a.emitted:
            self.listener.on_text(a.text[a.emitted:show_upto])
            a.emitted = show_upto
        return True

    def autosave_next(self, every: int) -> bool:
        """Whether the next token accepted makes an autosave due (autosave_due): a
        recurrent memory keeps its state before it (engine.runtime.saves_one_short)."""
        return bool(every) and (self.answer.n_generated + 1) % every == 0

    def autosave_due(self, every: int) -> bool:
        """Whether an autosave every ``every`` tokens falls now; if so, the bytes of an
        incomplete character are kept in the answer, so the save resumes it exactly."""
        if not every or self.answer.n_generated % every:
            return False
        self.answer.pending = self.decoder.getstate()[0]
        return True

    def end(self) -> GenerationResult:
        a, result = self.answer, self.result
        self.chain.close()
        result.generation_s = time.perf_counter() - self.started
        result.n_generated = self.generated_here
        if self.finish is None:
            a.pending = self.decoder.getstate()[0]
        else:
            # an answer that ends inside a multi-byte character drops the incomplete tail
            # rather than committing U+FFFD into the conversation
            a.pending = b""
            a.finish_reason = self.finish
            if len(a.text) > a.emitted:
                self.listener.on_text(a.text[a.emitted:])
                a.emitted = len(a.text)
            result.finish_reason = self.finish
        result.text = a.text[self.emitted_before:a.emitted]
        return result


def generate(runtime: Runtime, conv: Conversation, *, control: Control | None = None,
             listener: Listener | None = None, stop_after: int | None = None,
             autosave_every: int = 0,
             autosave: Callable[[Conversation], None] | None = None,
             confidence: bool = False, requested_at: float | None = None,
             skip_eog_once: bool = False, checkpoint_prompt: int = 0) -> GenerationResult:
    """Continue ``conv.answer`` until it ends, pauses, or ``stop_after`` tokens were made.

    ``conv.tokens`` is brought into the KV cache first, decoding only what is missing.
    ``confidence`` records the model's probability of every chosen token (a softmax
    over the whole vocabulary per token: only for callers that show it).
    ``skip_eog_once``: the first token may not end the answer (Continue on an answer the
    model had ended: the same position and seed would choose the end again).
    ``checkpoint_prompt``: when a prefill decoded at least this many tokens (0: never),
    ``autosave`` is called right after it, before the first token: the prompt is then a
    file of the chain, so a crash in the answer's first tokens keeps it, and a
    regenerated answer (a branch) stores only its own cells on top of it.  With it, a
    recurrent memory's prefill also autosaves where :func:`mark_wants_file` says.
    ``requested_at`` (a ``time.perf_counter()`` value) is when the user asked, so that
    ``ttft_s`` includes what the caller did before (reading and restoring a
    checkpoint); by default it counts from this call.
    """
    control = control or Control()
    listener = listener or NullListener()
    if conv.answer is None or conv.answer.finished:
        raise GenerationError("there is no answer to continue")
    requested_at = time.perf_counter() if requested_at is None else requested_at
    # a line in the store (checkpoint_prompt) gets a file at the marks that want one
    # (mark_wants_file): going back there in a new process reads nothing before it
    def on_mark(pos: int) -> None:
        if autosave is not None and checkpoint_prompt and mark_wants_file(conv, runtime.model, pos):
            autosave(conv)

    report = runtime.prefill(conv.tokens, should_stop=lambda: control.pause_requested,
                             on_progress=listener.on_prefill_progress, marks=conv.answer.cuts,
                             on_mark=on_mark)
    if not report.aborted and autosave and checkpoint_prompt and report.n_decoded >= checkpoint_prompt:
        autosave(conv)
    step = AnswerStepper(conv, n_ctx=runtime.ctx.n_ctx, n_vocab=runtime.ctx.n_vocab, model=runtime.model,
                         eog_ids=runtime.eog_ids, candidates=runtime.candidates, listener=listener,
                         control=control, report=report, stop_after=stop_after, confidence=confidence,
                         skip_eog_once=skip_eog_once, requested_at=requested_at)
    if report.aborted:
        step.chain.close()
        return step.result
    try:
        while True:
            token = step.choose(runtime.logits, len(runtime.kv_tokens))
            if token is None:
                break
            if autosave and step.autosave_next(autosave_every):
                runtime.keep_step_snapshot()
            runtime.decode_token(token)
            if not step.accepted(token):
                break
            if autosave and step.autosave_due(autosave_every):
                autosave(conv)
    except BaseException:
        step.chain.close()
        raise
    return step.end()


def _without_eog(owner, logits: np.ndarray) -> np.ndarray:
    """A copy of ``logits`` in which none of ``owner.eog_ids`` can be chosen."""
    masked = np.array(logits, copy=True)
    masked[owner.eog_ids] = -np.inf
    return masked


def _probability(logits: np.ndarray, token: int, top: float | None = None) -> float:
    """The model's own probability of ``token`` (softmax of the raw logits); ``top`` is
    the largest logit when the caller knows it already."""
    if top is None:
        top = float(logits.max())
    total = float(np.exp(logits - top, dtype=np.float32).sum())
    return float(np.exp(float(logits[token]) - top) / total) if total > 0 else 0.0
