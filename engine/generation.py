"""The generation loop: prefill, sample, decode, stream, stop or pause.

Runs on the thread that owns the :class:`~engine.runtime.Runtime`.  Other threads talk
to it only through :class:`Control` (pause) and receive text through the listener
callbacks, which run on the generating thread and must return quickly.
"""

from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import numpy as np

from engine import chat_template
from engine.conversation import Answer, Conversation, title_from
from engine.errors import GenerationError
from engine.runtime import Runtime
from engine.sampling import seed_for
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


def begin_answer(conv: Conversation, runtime: Runtime, user_text: str, *, n_predict: int = -1) -> None:
    """Add a user turn and make ``conv.tokens`` the prompt for the assistant's answer."""
    commit_answer(conv)
    if conv.paused:
        raise GenerationError("the previous answer is paused; resume or discard it first")
    if not conv.messages and conv.title in ("", "New conversation"):
        conv.title = title_from(user_text)
    previous = _state_text(conv, runtime)
    conv.messages.append(("user", user_text))
    prompt = chat_template.render(runtime.model, conv.chat_messages(), add_assistant=True)
    if previous is not None and prompt.startswith(previous):
        # the tokens the model has seen stay as they were, the new turn follows them: the
        # conversation's state stays a prefix of the next one (no tail decoded again, a
        # delta checkpoint on the last one), whatever re-tokenising the answer would give
        conv.tokens = conv.tokens + runtime.model.tokenize(prompt[len(previous):], add_special=False)
    else:
        conv.tokens = runtime.model.tokenize_prompt(prompt)
    conv.answer = Answer(n_prompt_tokens=len(conv.tokens), n_predict=n_predict)


def _state_text(conv: Conversation, runtime: Runtime) -> str | None:
    """The text that ``conv.tokens`` stands for, when it ends with a committed answer the
    model wrote token by token (not cut at a stop string, which the tokens still hold)."""
    a = conv.answer
    if not conv.tokens or a is None or a.finish_reason == "stop_string" or a.pending \
            or not (conv.messages and conv.messages[-1] == ("assistant", a.text)):
        return None
    if len(conv.tokens) != a.n_prompt_tokens + a.n_generated:
        return None
    before = chat_template.render(runtime.model, conv.chat_messages()[:-1], add_assistant=True)
    return before + a.text


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
        conv.answer = Answer(n_prompt_tokens=len(conv.tokens), n_predict=conv.answer.n_predict)


def _stop_hold(text: str, stops: list[str]) -> int:
    """How many trailing characters could still be the start of a stop string."""
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                hold = max(hold, k)
                break
    return hold


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
    regenerated answer (a branch) stores only its own cells on top of it.
    ``requested_at`` (a ``time.perf_counter()`` value) is when the user asked, so that
    ``ttft_s`` includes what the caller did before (reading and restoring a
    checkpoint); by default it counts from this call.
    """
    control = control or Control()
    listener = listener or NullListener()
    answer = conv.answer
    if answer is None or answer.finished:
        raise GenerationError("there is no answer to continue")
    started = time.perf_counter() if requested_at is None else requested_at
    report = runtime.prefill(conv.tokens, should_stop=lambda: control.pause_requested,
                             on_progress=listener.on_prefill_progress)
    result = GenerationResult(text="", finish_reason=FINISH_PAUSED, n_prompt_tokens=len(conv.tokens),
                              n_reused_tokens=report.n_reused, n_prefilled=report.n_decoded,
                              prefill_s=report.seconds)
    if not report.aborted and autosave and checkpoint_prompt and report.n_decoded >= checkpoint_prompt:
        autosave(conv)
    if report.aborted:
        return result

    model = runtime.model
    s = conv.sampler
    # llama.cpp's convention: repeat_last_n -1 means the whole context
    window = runtime.ctx.n_ctx if s.repeat_last_n < 0 else s.repeat_last_n
    chain = SamplerChain(n_vocab=runtime.ctx.n_vocab, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p,
                         temperature=s.temperature, repeat_penalty=s.repeat_penalty,
                         repeat_last_n=window)
    chain.accept(conv.tokens[-window:] if window else [])
    candidates = runtime.candidates
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.setstate((answer.pending, 0))
    stops = conv.stop_strings
    emitted_before = answer.emitted
    generated_here = 0
    loop_started = time.perf_counter()
    finish = None
    try:
        while finish is None:
            if answer.n_predict >= 0 and answer.n_generated >= answer.n_predict:
                finish = "length"
                break
            if control.pause_requested or (stop_after is not None and generated_here >= stop_after):
                break
            pos = len(runtime.kv_tokens)
            if pos >= runtime.ctx.n_ctx:
                finish = "context_full"
                break
            logits = runtime.logits()
            if s.ignore_eos or (skip_eog_once and generated_here == 0):
                logits = _without_eog(runtime, logits)
            # greedy draws nothing at random: no per-position seed to derive
            token = chain.sample(candidates, logits, 0 if chain.greedy else seed_for(s.seed, pos))
            if confidence:
                # plain greedy picked the argmax: its logit is the maximum the softmax needs
                top = float(logits[token]) if chain.greedy and not chain.has_penalty else None
                result.probabilities.append(_probability(logits, token, top))
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - started
            if model.is_eog(token):
                finish = "stop"
                break
            runtime.decode_token(token)
            conv.tokens.append(token)
            chain.accept((token,))
            answer.n_generated += 1
            generated_here += 1
            answer.text += decoder.decode(model.token_to_piece(token))
            if stops:
                cut = min((i for i in (answer.text.find(st, max(0, answer.emitted - len(st)))
                                       for st in stops) if i >= 0), default=-1)
                if cut >= 0:
                    answer.text = answer.text[:cut]
                    decoder.reset()  # bytes after the stop string are not part of the answer
                    finish = "stop_string"
                    break
            show_upto = len(answer.text) - _stop_hold(answer.text, stops)
            if show_upto > answer.emitted:
                listener.on_text(answer.text[answer.emitted:show_upto])
                answer.emitted = show_upto
            if autosave and autosave_every and answer.n_generated % autosave_every == 0:
                answer.pending = decoder.getstate()[0]
                autosave(conv)
    finally:
        chain.close()
    result.generation_s = time.perf_counter() - loop_started
    result.n_generated = generated_here
    if finish is None:
        answer.pending = decoder.getstate()[0]
    else:
        # an answer that ends inside a multi-byte character drops the incomplete tail
        # rather than committing U+FFFD into the conversation
        answer.pending = b""
        answer.finish_reason = finish
        if len(answer.text) > answer.emitted:
            listener.on_text(answer.text[answer.emitted:])
            answer.emitted = len(answer.text)
        result.finish_reason = finish
    result.text = answer.text[emitted_before:answer.emitted]
    return result


def _without_eog(runtime: Runtime, logits: np.ndarray) -> np.ndarray:
    """A copy of ``logits`` in which no end-of-generation token can be chosen."""
    masked = np.array(logits, copy=True)
    masked[runtime.eog_ids] = -np.inf
    return masked


def _probability(logits: np.ndarray, token: int, top: float | None = None) -> float:
    """The model's own probability of ``token`` (softmax of the raw logits); ``top`` is
    the largest logit when the caller knows it already."""
    if top is None:
        top = float(logits.max())
    total = float(np.exp(logits - top, dtype=np.float32).sum())
    return float(np.exp(float(logits[token]) - top) / total) if total > 0 else 0.0
