"""The engine thread's side of a server request: continue, restore, generate, save.

:class:`RequestDesk` belongs to an :class:`engine.worker.EngineWorker` (its
``requests``): the worker's public ``complete`` and ``cancel_request`` reach it from any
thread, and the worker's ``Complete`` command (engine.commands) runs :meth:`RequestDesk.serve`
on the engine thread.  It sees the worker through its public face (``sessions``,
``runtime``, ``model_info``, ``store``, ``listener``, ``snapshot``, ``stopping``) and the
few engine-thread operations the worker hands it (:class:`EngineHooks`).  The HTTP side
(engine.server) only builds :class:`CompletionRequest` values and reads the listener's
``on_request_*`` callbacks: this module is the core's, and imports no front end.
A request (:class:`CompletionRequest`) is served from its longest stored prefix:

1. **By transcript.**  A chat request carries the whole conversation.  When a
   conversation the worker knows (in memory, else a head in the store) holds exactly
   the request's messages before its last one, every answer finished, and fits the
   loaded model and context, the request continues it: the new message's tokens follow
   the tokens the model has already seen (engine.generation keeps a conversation's
   tokens a prefix of its next turn), so everything before is restored, not decoded.
   A thinking model's answers are compared by their final text (engine.reasoning):
   clients send an answer back as its ``content``, without the thinking.
2. **By tokens.**  Otherwise the request is a new conversation, started from the
   stored checkpoint that shares the longest token prefix with its prompt
   (engine.prefix_reuse); its first save builds on that checkpoint's files when they
   are a prefix of it.

Either way the answer is generated and saved as every answer is (the window sees it
like any other: a conversation in its list), and the listener hears
``on_request_started`` / ``on_request_finished`` / ``on_request_failed`` with the
request's id, and the answer's own callbacks with its conversation's id.

A request whose client went away (:meth:`RequestDesk.cancel`) is skipped
if it has not started, and paused like the Pause button if it has: the checkpoint is
kept.  Requests are answered concurrently, each in a sequence of the cache beside the
window's answers (engine.concurrent); while every sequence is busy they wait, in order.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.commands import Action
from engine.conversation import Answer, Conversation, title_from
from engine.errors import AppError, CheckpointError
from engine.events import ConversationChanged, Failed, RequestFailed, RequestFinished, RequestRefusal, RequestStarted
from engine.sampling import SamplerSettings, random_seed

log = logging.getLogger("engine")

#: Why a request was not answered (engine.events.RequestRefusal.reason).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MODEL_NOT_FOUND = "model_not_found"
NOT_READY = "not_ready"
CANCELLED = "cancelled"
SHUTTING_DOWN = "shutting_down"
INVALID = "invalid_request"
FAILED = "failed"
#: the action an answer's failure is reported under (WorkerListener.on_error)
ANSWER_ACTION = Action.ANSWER_REQUEST


@dataclass(frozen=True)
class CompletionRequest:
    """One request, as the engine thread serves it (validated by engine.server.schema)."""
    request_id: str
    #: the model the request was checked against; refused if another one is loaded by then
    model_path: Path | None = None
    #: a chat: the whole conversation, (role, content), the user's message last
    messages: tuple[tuple[str, str], ...] = ()
    #: a plain completion instead: this text, without the chat template
    prompt: str | None = None
    #: SamplerSettings fields set by the request, over the model's own defaults
    sampling: tuple[tuple[str, Any], ...] = ()
    seed: int | None = None          # None: a random one (reported in on_request_started)
    n_predict: int = -1
    stop: tuple[str, ...] = ()


def _history_key(messages, think, *, sent: bool = False) -> list[tuple[str, str]]:
    """``messages`` as a request's history is matched: a thinking model's answers by
    their final text (``think``: its engine.reasoning.ThinkFormat, or None).  A stored
    answer is what the model wrote; one ``sent`` by a client is its final text already,
    unless the client sent the closing tag back too."""
    from engine.reasoning import split

    def final(role: str, text: str) -> str:
        if think is None or role != "assistant" or (sent and think.close_tag not in text):
            return text
        return split(text, think).answer
    return [(role, final(role, text)) for role, text in messages]


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.refusal = RequestRefusal(reason, message)


@dataclass(frozen=True)
class EngineHooks:
    """The engine-thread operations a request needs of its worker, handed over by it."""
    #: start ``conv``'s answer for request ``request_id``; False when the engine stops
    start_answer: Callable[..., bool]
    #: restore a checkpoint's chain and make its conversation known (OpenCheckpoint)
    open_checkpoint: Callable[[Path], None]
    #: tell the user once when the loaded model's chat template could not be used
    notice_template_problem: Callable[[Any], None]
    #: forget a conversation: its session and its sequence (its files stay)
    end_session: Callable[[uuid.UUID], None]


class RequestDesk:
    """The requests of one worker (see the module docstring)."""

    def __init__(self, engine, hooks: EngineHooks) -> None:
        self.engine = engine               # engine.worker.EngineWorker, its public face
        self.hooks = hooks
        self.sessions = engine.sessions
        self._lock = engine.sessions.lock   # the lock that starts and ends answers
        self._pending: set[str] = set()     # submitted, not finished
        self._cancelled: set[str] = set()   # of those, the ones whose client left

    # -- any thread -------------------------------------------------------------------------------
    def submitted(self, request_id: str) -> None:
        """``request_id`` is on its way to the engine thread."""
        with self._lock:
            self._pending.add(request_id)

    def cancel(self, request_id: str) -> None:
        """The client went away: skip the request, or pause its answer (saved as a pause).

        The pause is requested under the lock that ends the request, so it can never
        reach the command after it.
        """
        with self._lock:
            if request_id not in self._pending:
                return
            self._cancelled.add(request_id)
            control = self.sessions.control_of_request(request_id)
        if control is not None:
            control.request_pause()

    def cancelled(self, request_id: str | None) -> bool:
        """Whether ``request_id``'s client left (called with the sessions' lock held)."""
        return request_id is not None and request_id in self._cancelled

    # -- the engine thread ------------------------------------------------------------------------
    def serve(self, request: CompletionRequest) -> None:
        """Answer ``request`` (the engine thread's ``Complete`` command)."""
        rid, engine = request.request_id, self.engine
        with self._lock:
            cancelled = rid in self._cancelled
        answering = False
        try:
            if cancelled:
                raise _Refused(CANCELLED, "the client went away before its request was served")
            rt = self._ready(request)
            conv = self._request_conversation(request, rt)
            if engine.request_conversations_kept is not None:   # only `serve` lets them go
                self.sessions.mark_served(self.sessions.named(conv.id))
            engine.listener.emit(RequestStarted(rid, engine.snapshot(conv, branches=False)))
            answering = True
            if not self.hooks.start_answer(conv, request_id=rid):
                raise _Refused(SHUTTING_DOWN, "the server is shutting down")
        except _Refused as exc:
            self.ended(rid, None, refusal=exc.refusal)
        except Exception as exc:  # noqa: BLE001 - one request must not stop the engine thread
            from native.errors import NativeError
            if isinstance(exc, (AppError, NativeError, OSError)):
                log.warning("could not answer request %s: %s", rid, exc)
            else:
                log.exception("unexpected failure while answering request %s", rid)
            self.ended(rid, None, str(exc) or type(exc).__name__)
            if answering:   # the other front ends saw the answer start: they hear how it ended
                engine.listener.emit(Failed(ANSWER_ACTION, str(exc) or type(exc).__name__, conv.id))

    def _ready(self, request: CompletionRequest):
        """The runtime to answer ``request`` with; refused when there is none to use."""
        engine = self.engine
        if engine.stopping:
            raise _Refused(SHUTTING_DOWN, "the server is shutting down")
        rt, info = engine.runtime, engine.model_info
        if rt is None or info is None:
            raise _Refused(NOT_READY, "the model is still loading (or failed to load); try again")
        if request.model_path is not None and Path(request.model_path) != info.path:
            raise _Refused(MODEL_NOT_FOUND, f"the model was changed to {info.path.name} "
                                            "while the request waited")
        return rt

    def ended(self, rid: str, conv_id: uuid.UUID | None, failure: str | None = None, *,
              refusal: RequestRefusal | None = None) -> None:
        """Tell the listener how request ``rid`` ended: answered by ``conv_id`` (its answer
        saved), or refused, or failed."""
        listener = self.engine.listener
        with self._lock:
            self._pending.discard(rid)
            self._cancelled.discard(rid)
        if refusal is not None:
            listener.emit(RequestFailed(rid, refusal))
        elif conv_id is None:
            listener.emit(RequestFailed(rid, RequestRefusal(FAILED, failure or "the answer failed")))
        else:
            session = self.sessions.get(conv_id)
            listener.emit(RequestFinished(rid, conv_id, session.head if session is not None else None))
            self._let_go_of_served()

    def _let_go_of_served(self) -> None:
        """Close the oldest served conversations beyond ``request_conversations_kept``
        (saved already: their heads are in the store, where a request finds them again)."""
        keep = self.engine.request_conversations_kept
        if keep is None:
            return
        served = self.sessions.served()
        for session in served[:max(0, len(served) - keep)]:
            if session.answer is None:
                self.hooks.end_session(session.id)

    def _request_sampler(self, request: CompletionRequest) -> SamplerSettings:
        info = self.engine.model_info
        base = info.sampling_defaults if info is not None else SamplerSettings()
        seed = random_seed() if request.seed is None else request.seed
        return replace(base, **dict(request.sampling), seed=seed)

    def _request_conversation(self, request: CompletionRequest, rt) -> Conversation:
        """The conversation that answers ``request``, its prompt in ``tokens``, as much of
        it in the cache as stored states allow; refused when the prompt cannot fit."""
        from engine.generation import begin_answer
        sampler = self._request_sampler(request)
        if request.prompt is not None:
            # a plain completion: the text is the prompt, token for token (it is only in the
            # title and the tokens; its transcript is the answer)
            conv = Conversation(title=f"Completion: {title_from(request.prompt, 36)}", sampler=sampler,
                                stop_strings=list(request.stop))
            conv.tokens = rt.model.tokenize_prompt(request.prompt)
            conv.answer = Answer(n_prompt_tokens=len(conv.tokens), n_predict=request.n_predict)
            self._check_fits(conv, rt)
            self._start_from_stored_prefix(conv, rt)
            return conv
        if not request.messages or request.messages[-1][0] != "user":
            raise _Refused(INVALID, "the last message must be the user's")
        history, text = [(m[0], m[1]) for m in request.messages[:-1]], request.messages[-1][1]
        self.hooks.notice_template_problem(rt)
        found = self._continuable(history, rt)
        if found is not None:
            conv = found
            before = (list(conv.messages), conv.answer, list(conv.tokens), conv.sampler, list(conv.stop_strings))
            conv.sampler, conv.stop_strings = sampler, list(request.stop)
            begin_answer(conv, rt, text, n_predict=request.n_predict)
            try:
                self._check_fits(conv, rt)
            except _Refused:
                conv.messages, conv.answer, conv.tokens, conv.sampler, conv.stop_strings = before
                raise
            return conv
        system = history[0][1] if history and history[0][0] == "system" else ""
        rest = history[1:] if history and history[0][0] == "system" else history
        first = next((c for r, c in list(rest) + [("user", text)] if r == "user"), text)
        conv = Conversation(title=title_from(first), system_prompt=system, messages=list(rest),
                            sampler=sampler, stop_strings=list(request.stop))
        begin_answer(conv, rt, text, n_predict=request.n_predict)
        self._check_fits(conv, rt)
        self._start_from_stored_prefix(conv, rt)
        return conv

    @staticmethod
    def _check_fits(conv: Conversation, rt) -> None:
        """OpenAI's rule: the prompt and ``max_tokens`` (when given) must fit the context;
        without ``max_tokens`` the answer may use what the prompt leaves."""
        n_ctx, n_prompt = rt.ctx.n_ctx, len(conv.tokens)
        n_answer = conv.answer.n_predict if conv.answer is not None else -1
        if n_prompt >= n_ctx:
            raise _Refused(CONTEXT_LENGTH_EXCEEDED,
                           f"This model's maximum context length is {n_ctx} tokens; the prompt has "
                           f"{n_prompt} tokens and must leave room for the answer. Shorten the "
                           "messages or restart the server with a larger --ctx-size.")
        if n_answer > 0 and n_prompt + n_answer > n_ctx:
            raise _Refused(CONTEXT_LENGTH_EXCEEDED,
                           f"This model's maximum context length is {n_ctx} tokens. However, you "
                           f"requested {n_prompt + n_answer} tokens ({n_prompt} in the messages, "
                           f"{n_answer} in the completion). Reduce the length of the messages or "
                           "of the completion.")

    def _continuable(self, history: list[tuple[str, str]], rt) -> Conversation | None:
        """The conversation holding exactly ``history``, every answer finished, whose
        tokens fit this model and context: in memory first (the cache may hold it), then
        the store's heads, newest first (restored here, files verified).  None if none."""
        from engine.branches import branches_of
        from engine.chat_template import think_format
        from engine.checkpoints.graph import Graph
        if not any(role == "assistant" for role, _ in history):
            return None   # nothing answered yet: the token prefix does as well
        think = think_format(rt.model)
        wanted = _history_key(history, think, sent=True)
        for conv in [s.conv for s in self.sessions.open()]:
            if conv.paused or conv.answer is None or not conv.tokens:
                continue
            if _history_key(conv.chat_messages(), think) == wanted and self._fits_runtime(conv, rt):
                return conv
        store = self.engine.store
        graph = Graph.scan(store)
        for conv_id in dict.fromkeys(h.conversation_id for h in graph.heads):
            for branch in branches_of(store, conv_id, graph):
                node = graph.nodes.get(branch.head.name)
                if self.sessions.is_answering(conv_id):
                    break   # answering now (another request's): this one starts its own
                if branch.paused or _history_key(branch.messages, think) != wanted or node is None \
                        or rt.target.problem(node.header) is not None:
                    continue
                try:
                    self.hooks.open_checkpoint(branch.head)
                except (CheckpointError, OSError) as exc:
                    log.info("cannot continue %s for a request (%s)", branch.head.name, exc)
                    continue
                conv = self.sessions.conversation(conv_id)
                if conv is not None and _history_key(conv.chat_messages(), think) == wanted:
                    return conv
        return None

    def _fits_runtime(self, conv: Conversation, rt) -> bool:
        """Whether ``conv``'s tokens were made by the loaded model and context."""
        from engine.checkpoints.format import read_header
        if conv.id in rt.table:
            return True
        session = self.sessions.get(conv.id)
        path = session.head if session is not None else None
        if path is None:
            return False
        try:
            return rt.target.problem(read_header(path)) is None
        except (CheckpointError, OSError):
            return False

    def _start_from_stored_prefix(self, conv: Conversation, rt) -> None:
        """Make ``conv`` the conversation in the cache, starting from the stored checkpoint
        that shares the longest prefix with its tokens; the first save builds on that
        checkpoint's files where they are a prefix of it."""
        from engine.prefix_reuse import start_from_stored_prefix
        writer = start_from_stored_prefix(rt.view_of(conv.id), self.engine.store, conv)
        self.sessions.adopt(conv)
        self.sessions.set_writer(conv.id, writer)
        self.engine.listener.emit(ConversationChanged(self.engine.snapshot(conv)))


def new_request_id() -> str:
    return uuid.uuid4().hex
