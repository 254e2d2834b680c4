"""The engine thread's side of a server request: continue, restore, generate, save.

:class:`RequestCommands` is a mixin of :class:`engine.worker.EngineWorker`; its public
methods are thread-safe like the worker's, the ``_do_`` ones run on the engine thread.
A request (:class:`CompletionRequest`) is served from its longest stored prefix:

1. **By transcript.**  A chat request carries the whole conversation.  When a
   conversation the worker knows (in memory, else a head in the store) holds exactly
   the request's messages before its last one, every answer finished, and fits the
   loaded model and context, the request continues it: the new message's tokens follow
   the tokens the model has already seen (engine.generation keeps a conversation's
   tokens a prefix of its next turn), so everything before is restored, not decoded.
2. **By tokens.**  Otherwise the request is a new conversation, started from the
   stored checkpoint that shares the longest token prefix with its prompt
   (engine.prefix_reuse); its first save builds on that checkpoint's files when they
   are a prefix of it.

Either way the answer is generated and saved by the worker's own ``_generate`` (the
window sees it like any other: a conversation in its list), and the listener hears
``on_request_started`` / ``on_request_finished`` / ``on_request_failed`` with the
request's id, and the answer's own callbacks with its conversation's id.

A request whose client went away (:meth:`RequestCommands.cancel_request`) is skipped
if it has not started, and paused like the Pause button if it has: the checkpoint is
kept.  Requests are answered concurrently, each in a sequence of the cache beside the
window's answers (engine.concurrent); while every sequence is busy they wait, in order.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.conversation import Answer, Conversation, title_from
from engine.errors import AppError, CheckpointError
from engine.sampling import SamplerSettings, random_seed

log = logging.getLogger("engine")

#: Why a request was not answered (RequestRefusal.reason).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
MODEL_NOT_FOUND = "model_not_found"
NOT_READY = "not_ready"
CANCELLED = "cancelled"
SHUTTING_DOWN = "shutting_down"
INVALID = "invalid_request"
FAILED = "failed"
#: the action an answer's failure is reported under (WorkerListener.on_error)
ANSWER_ACTION = "answer a request"


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


@dataclass(frozen=True)
class RequestRefusal:
    reason: str       # one of the constants above
    message: str      # one sentence for the client


class _Refused(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.refusal = RequestRefusal(reason, message)


class RequestCommands:
    """EngineWorker's commands for server requests (see the module docstring)."""

    #: How many conversations served to requests stay open (in memory, their line leased)
    #: besides the one in the cache; older ones are let go and reopened from the store
    #: when a request continues them.  None keeps every one open: the window's way, whose
    #: list refers to them; a server of its own (``serve``) sets a bound, or a long-running
    #: one would hold a file descriptor per conversation it ever served.
    request_conversations_kept: int | None = None

    def _init_requests(self) -> None:
        self._requests_pending: set[str] = set()      # submitted, not finished
        self._requests_cancelled: set[str] = set()    # of those, the ones whose client left
        #: requests whose answers run, and their conversations (under _busy_lock)
        self._request_convs: dict[str, uuid.UUID] = {}
        self._served: dict[uuid.UUID, None] = {}      # conversations requests used, oldest first

    # -- any thread -------------------------------------------------------------------------------
    def complete(self, request: CompletionRequest) -> None:
        """Answer ``request`` when its turn comes (the listener hears how it went)."""
        with self._busy_lock:
            self._requests_pending.add(request.request_id)
        self._submit(ANSWER_ACTION, self._do_complete, request, wait=self._request_wait)

    def cancel_request(self, request_id: str) -> None:
        """The client went away: skip the request, or pause its answer (saved as a pause).

        The pause is requested under the lock that ends the request, so it can never
        reach the command after it.
        """
        with self._busy_lock:
            if request_id not in self._requests_pending:
                return
            self._requests_cancelled.add(request_id)
            conv_id = self._request_convs.get(request_id)
            control = self._controls.get(conv_id) if conv_id is not None else None
        if control is not None:
            control.request_pause()

    def _request_cancelled(self, request_id: str | None) -> bool:
        """Whether ``request_id``'s client left (called with ``_busy_lock`` held)."""
        return request_id is not None and request_id in self._requests_cancelled

    # -- the engine thread ------------------------------------------------------------------------
    def _do_complete(self, request: CompletionRequest) -> None:
        rid = request.request_id
        with self._busy_lock:
            cancelled = rid in self._requests_cancelled
        answering = False
        try:
            if cancelled:
                raise _Refused(CANCELLED, "the client went away before its request was served")
            if self._stopping.is_set():
                raise _Refused(SHUTTING_DOWN, "the server is shutting down")
            rt = self.runtime
            if rt is None or self.model_info is None:
                raise _Refused(NOT_READY, "the model is still loading (or failed to load); try again")
            if request.model_path is not None and Path(request.model_path) != self.model_info.path:
                raise _Refused(MODEL_NOT_FOUND, f"the model was changed to {self.model_info.path.name} "
                                                "while the request waited")
            conv = self._request_conversation(request, rt)
            if self.request_conversations_kept is not None:   # only `serve` lets them go
                self._served.pop(conv.id, None)
                self._served[conv.id] = None
            self.listener.on_request_started(rid, self.snapshot(conv, branches=False))
            answering = True
            if not self._generate(conv, request_id=rid):
                raise _Refused(SHUTTING_DOWN, "the server is shutting down")
        except _Refused as exc:
            self._request_ended(rid, None, refusal=exc.refusal)
        except Exception as exc:  # noqa: BLE001 - one request must not stop the engine thread
            from native.errors import NativeError
            if isinstance(exc, (AppError, NativeError, OSError)):
                log.warning("could not answer request %s: %s", rid, exc)
            else:
                log.exception("unexpected failure while answering request %s", rid)
            self._request_ended(rid, None, str(exc) or type(exc).__name__)
            if answering:   # the other front ends saw the answer start: they hear how it ended
                self.listener.on_error(ANSWER_ACTION, str(exc) or type(exc).__name__)

    def _request_ended(self, rid: str, conv_id: uuid.UUID | None, failure: str | None = None, *,
                       refusal: RequestRefusal | None = None) -> None:
        """Tell the listener how request ``rid`` ended: answered by ``conv_id`` (its answer
        saved), or refused, or failed."""
        with self._busy_lock:
            self._request_convs.pop(rid, None)
            self._requests_pending.discard(rid)
            self._requests_cancelled.discard(rid)
        if refusal is not None:
            self.listener.on_request_failed(rid, refusal)
        elif conv_id is None:
            self.listener.on_request_failed(rid, RequestRefusal(FAILED, failure or "the answer failed"))
        else:
            self.listener.on_request_finished(rid, conv_id, self._paths.get(conv_id))
            self._let_go_of_served()

    def _let_go_of_served(self) -> None:
        """Close the oldest served conversations beyond ``request_conversations_kept``
        (saved already: their heads are in the store, where a request finds them again)."""
        keep = self.request_conversations_kept
        if keep is None:
            return
        for conv_id in list(self._served)[:max(0, len(self._served) - keep)]:
            if conv_id in self._answers:
                continue
            del self._served[conv_id]
            writer = self._writers.pop(conv_id, None)
            if writer is not None:
                writer.close()
            self._convs.pop(conv_id, None)
            self._paths.pop(conv_id, None)
            if self.runtime is not None:
                self.runtime.forget(conv_id)

    def _request_sampler(self, request: CompletionRequest) -> SamplerSettings:
        base = self.model_info.sampling_defaults if self.model_info is not None else SamplerSettings()
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
        history, text = [tuple(m) for m in request.messages[:-1]], request.messages[-1][1]
        self._notice_template_problem(rt)
        conv = self._continuable(history, rt)
        if conv is not None:
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
        from engine.checkpoints.graph import Graph
        if not any(role == "assistant" for role, _ in history):
            return None   # nothing answered yet: the token prefix does as well
        for conv in list(self._convs.values()):
            if conv.paused or conv.answer is None or not conv.tokens:
                continue
            if [tuple(m) for m in conv.chat_messages()] == history and self._fits_runtime(conv, rt):
                return conv
        graph = Graph.scan(self.store)
        for conv_id in dict.fromkeys(h.conversation_id for h in graph.heads):
            for branch in branches_of(self.store, conv_id, graph):
                node = graph.nodes.get(branch.head.name)
                if conv_id in self._answers:
                    break   # answering now (another request's): this one starts its own
                if branch.paused or list(branch.messages) != history or node is None \
                        or rt.target.problem(node.header) is not None:
                    continue
                try:
                    self._do_open_checkpoint(branch.head)
                except (CheckpointError, OSError) as exc:
                    log.info("cannot continue %s for a request (%s)", branch.head.name, exc)
                    continue
                conv = self._convs.get(conv_id)
                if conv is not None and [tuple(m) for m in conv.chat_messages()] == history:
                    return conv
        return None

    def _fits_runtime(self, conv: Conversation, rt) -> bool:
        """Whether ``conv``'s tokens were made by the loaded model and context."""
        from engine.checkpoints.format import read_header
        if conv.id in rt.table:
            return True
        path = self._paths.get(conv.id)
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
        from engine.checkpoints.graph import default_line
        from engine.history import LineWriter, saved_info
        from engine.prefix_reuse import reuse_stored_prefix
        view = rt.view_of(conv.id)
        chain = ()
        try:
            reuse = reuse_stored_prefix(view, self.store.folder, conv.tokens)
            chain = reuse.chain if reuse.chain and self.store.contains(reuse.chain[-1].path) else ()
            log.info("request: %s", reuse.describe())
        except (CheckpointError, OSError) as exc:
            log.info("no stored prefix used (%s)", exc)
        self._convs[conv.id] = conv
        # the restored chain (verified by the restore) is what the first save builds on
        self._writers[conv.id] = LineWriter.starting(view, self.store, default_line(conv.id),
                                                     [saved_info(d) for d in chain])
        self.listener.on_conversation_changed(self.snapshot(conv))


def new_request_id() -> str:
    return uuid.uuid4().hex
