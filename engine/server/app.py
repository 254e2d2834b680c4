"""The HTTP side: aiohttp routes, guards, and :class:`LocalServer`.

Routes: ``GET /health``, ``GET /v1/models`` (and ``/v1/models/{id}``),
``POST /v1/chat/completions`` and ``POST /v1/completions``, each answered in OpenAI's
shapes (engine.server.shapes), streamed as server-sent events when ``stream`` is true.
A thinking model's thinking (engine.reasoning) is a chat answer's ``reasoning_content``,
apart from its ``content``; a plain completion returns the text as the model wrote it.

Guards, in order: every error becomes OpenAI's error body with its status (never a
traceback); an API key, when set, is required as ``Authorization: Bearer KEY`` (all
but ``/health``); bodies are capped (413) before they are read; the JSON is validated
(engine.server.schema); the model must be the loaded one (404); at most
``max_queue`` requests wait (429).  The engine thread answers up to its context's
sequences at once (``--sequences``, engine.concurrent), the others wait in order.

A client that disconnects cancels its request (aiohttp cancels the handler, or a write
fails): a request not started yet is dropped, an answer in progress pauses and is
saved as a paused checkpoint, as the window's Pause button does.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from engine.events import GenerationSummary, RequestRefusal
from engine.reasoning import ANSWER, Splitter, split
from engine.requests import (
    CANCELLED,
    CONTEXT_LENGTH_EXCEEDED,
    INVALID,
    MODEL_NOT_FOUND,
    NOT_READY,
    SHUTTING_DOWN,
    CompletionRequest,
)
from engine.server import shapes
from engine.server.link import EngineLink, Job
from engine.server.schema import ApiError, Generation, parse_body, parse_chat, parse_completion

log = logging.getLogger("engine")

DEFAULT_PORT = 8080
DEFAULT_MAX_BODY = 1 << 20


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT           # 0: any free port (LocalServer.url says which)
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_queue: int = 64                # requests waiting or running at once; more get 429


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def binding_problem(options: ServerOptions) -> str | None:
    """Why the server must not start with these options (one sentence), or None."""
    if not is_loopback(options.host) and not options.api_key:
        return (f"listening on {options.host} lets other machines use the model and read every "
                "conversation sent to it; give an API key (--api-key KEY or CHECKPOINT_CHAT_API_KEY) "
                "to do that, or leave --host at 127.0.0.1")
    return None


def binding_warning(options: ServerOptions) -> str | None:
    if is_loopback(options.host):
        return None
    return (f"listening on {options.host}: any machine that can reach this port and knows the API key "
            "can use the model; the traffic (messages and answers) is not encrypted — use a firewall, "
            "or an SSH tunnel or TLS proxy in front of it")


def model_id(path: Path) -> str:
    """The id clients name the loaded model by: its GGUF file name without .gguf."""
    return Path(path).stem


REFUSAL_ERRORS = {
    CONTEXT_LENGTH_EXCEEDED: (400, "invalid_request_error", "messages"),
    INVALID: (400, "invalid_request_error", "messages"),
    MODEL_NOT_FOUND: (404, "invalid_request_error", "model"),
    NOT_READY: (503, "server_error", None),
    SHUTTING_DOWN: (503, "server_error", None),
    CANCELLED: (499, "invalid_request_error", None),
}


def refusal_error(refusal: RequestRefusal) -> ApiError:
    status, kind, param = REFUSAL_ERRORS.get(refusal.reason, (500, "server_error", None))
    return ApiError(status, refusal.message, type=kind, param=param, code=refusal.reason)


def _error_response(error: ApiError) -> web.Response:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return web.json_response(error.body(), status=error.status, headers=headers)


class _Routes:
    """The handlers, over one worker and its link."""

    def __init__(self, worker, link: EngineLink, options: ServerOptions) -> None:
        self.worker = worker
        self.link = link
        self.options = options

    # -- guards ---------------------------------------------------------------------------------
    @web.middleware
    async def errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return _error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _error_response(ApiError(exc.status, exc.reason or "request refused",
                                            type="invalid_request_error" if exc.status < 500 else "server_error"))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # noqa: BLE001 - a bug answers 500, the server (and the window) go on
            log.exception("the server failed on %s %s", request.method, request.path)
            return _error_response(ApiError(500, "The server failed on this request; its log has the details.",
                                            type="server_error"))

    @web.middleware
    async def auth(self, request: web.Request, handler):
        key = self.options.api_key
        if key and request.path != "/health":
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer KEY'.",
                               code="invalid_api_key")
        return await handler(request)

    async def _body(self, request: web.Request) -> dict:
        cap = self.options.max_body_bytes
        if request.content_length is not None and request.content_length > cap:
            raise ApiError(413, f"The request body is larger than the server accepts ({cap:,} bytes).",
                           code="request_too_large")
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"The request body is larger than the server accepts ({cap:,} bytes).",
                           code="request_too_large") from None
        return parse_body(raw)

    def _model(self, requested: str):
        info = self.worker.model_info
        if info is None:
            raise ApiError(503, "The model is still loading; try again in a moment.", type="server_error",
                           code="model_loading")
        known = {model_id(info.path).lower(), info.name.lower(), Path(info.path).name.lower()}
        if requested.lower() not in known:
            raise ApiError(404, f"The model '{requested}' does not exist here; this server has "
                                f"'{model_id(info.path)}' (GET /v1/models).", param="model", code="model_not_found")
        return info

    # -- routes ---------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        info = self.worker.model_info
        if info is None or not self.worker.alive:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ok", "model": model_id(info.path)})

    def _models(self) -> list[tuple[str, int]]:
        info = self.worker.model_info
        if info is None:
            return []
        try:
            created = int(os.stat(info.path).st_mtime)
        except OSError:
            created = 0
        return [(model_id(info.path), created)]

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(shapes.model_list(self._models()))

    async def model(self, request: web.Request) -> web.Response:
        self._model(request.match_info["name"])
        return web.json_response(shapes.model_list(self._models())["data"][0])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_chat(await self._body(request))
        info = self._model(parsed.model)
        return await self._serve(request, parsed.generation, model_id(info.path), chat=True,
                                 thinking=info.thinking, messages=parsed.messages, model_path=info.path)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        parsed = parse_completion(await self._body(request))
        info = self._model(parsed.model)
        return await self._serve(request, parsed.generation, model_id(info.path), chat=False,
                                 prompt=parsed.prompt, model_path=info.path)

    # -- serving one request ---------------------------------------------------------------------
    async def _serve(self, request: web.Request, gen: Generation, model: str, *, chat: bool,
                     thinking=None, **what) -> web.StreamResponse:
        if len(self.link.jobs()) >= self.options.max_queue:
            raise ApiError(429, f"{self.options.max_queue} requests are already waiting; try again later.",
                           type="rate_limit_error", code="too_many_requests")
        job = self.link.open()
        try:
            self.worker.complete(CompletionRequest(request_id=job.id, sampling=gen.sampling, seed=gen.seed,
                                                   n_predict=gen.max_tokens, stop=gen.stop, **what))
            kind, value = await job.next()
            if kind == "failed":
                raise refusal_error(value)
            reply = _Reply(model, chat, gen, value, thinking)
            if gen.stream:
                return await self._stream(request, job, reply)
            return await self._collect(job, reply)
        finally:
            if not job.ended:          # the client went away (the handler was cancelled)
                self.worker.cancel_request(job.id)
            self.link.forget(job)

    async def _collect(self, job: Job, reply: _Reply) -> web.Response:
        while True:
            kind, value = await job.next()
            if kind == "finished":
                reply.summary = value
            elif kind == "done" or (kind == "failed" and reply.summary is not None):
                if kind == "failed":
                    log.warning("an answer was generated but not saved: %s", value.message)
                reply.checkpoint = value if kind == "done" else None
                return web.json_response(reply.whole())
            elif kind == "failed":
                raise refusal_error(value)

    async def _stream(self, request: web.Request, job: Job, reply: _Reply) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await response.prepare(request)
        try:
            if reply.chat:
                await response.write(shapes.sse(reply.chunk({"role": "assistant", "content": ""})))
            while True:
                kind, value = await job.next()
                if kind == "text":
                    for delta in reply.deltas(value):
                        await response.write(shapes.sse(reply.chunk(delta)))
                elif kind == "finished":
                    reply.summary = value
                    for delta in reply.deltas(None):
                        await response.write(shapes.sse(reply.chunk(delta)))
                elif kind == "done" or (kind == "failed" and reply.summary is not None):
                    reply.checkpoint = value if kind == "done" else None
                    for chunk in reply.closing():
                        await response.write(shapes.sse(chunk))
                    await response.write(shapes.sse("[DONE]"))
                    break
                elif kind == "failed":
                    await response.write(shapes.sse(refusal_error(value).body()))
                    break
            await response.write_eof()
        except ConnectionResetError:
            log.info("a client went away during its answer; the answer is paused and saved")
        return response


class _Reply:
    """What one request's response says, as the engine's events fill it in."""

    def __init__(self, model: str, chat: bool, gen: Generation, snap, thinking=None) -> None:
        self.id = shapes.new_id("chatcmpl" if chat else "cmpl")
        #: the model's ThinkFormat (engine.reasoning) for a chat answer, None otherwise
        self.thinking = thinking if chat else None
        self.splitter = Splitter(self.thinking)
        self.created = shapes.now()
        self.model = model
        self.chat = chat
        self.gen = gen
        self.snap = snap
        self.summary: GenerationSummary | None = None
        self.checkpoint: Path | None = None

    def finished(self) -> GenerationSummary:
        """The answer's summary: the link posts "finished" before "done" (engine.server.link)."""
        if self.summary is None:
            raise RuntimeError("the answer's summary did not come before its end")
        return self.summary

    def usage(self) -> dict:
        s = self.finished()
        return shapes.usage(s.n_prompt_tokens, s.n_generated, s.n_reused_tokens, s.n_reasoning_tokens)

    def extension(self) -> dict:
        return shapes.extension(self.snap.id, self.snap.seed, self.checkpoint,
                                paused=self.finished().finish_reason == "paused")

    def deltas(self, text: str | None) -> list:
        """What streaming ``text`` sends (None: the answer ended, send what was held
        back): chat deltas, thinking and answer apart; a completion's text as it is."""
        if not self.chat:
            return [text] if text else []
        pieces = self.splitter.finish() if text is None else self.splitter.feed(text)
        return [{"content" if kind == ANSWER else "reasoning_content": piece} for kind, piece in pieces]

    def chunk(self, delta) -> dict:
        if self.chat:
            return shapes.chat_chunk(self.id, self.created, self.model, delta)
        return shapes.text_completion(self.id, self.created, self.model, delta, None)

    def closing(self) -> list[dict]:
        """The last chunk (finish reason), and the usage chunk when asked for."""
        reason = self.finished().finish_reason
        if self.chat:
            out = [shapes.chat_chunk(self.id, self.created, self.model, {}, reason, ext=self.extension())]
            if self.gen.include_usage:
                out.append(shapes.chat_chunk(self.id, self.created, self.model, None, use=self.usage()))
        else:
            out = [shapes.text_completion(self.id, self.created, self.model, "", reason, ext=self.extension())]
            if self.gen.include_usage:
                out.append(shapes.text_completion(self.id, self.created, self.model, None, None, use=self.usage()))
        return out

    def whole(self) -> dict:
        s = self.finished()
        if self.chat:
            parts = split(s.text, self.thinking)
            return shapes.chat_completion(self.id, self.created, self.model, parts.answer, s.finish_reason,
                                          self.usage(), self.extension(), parts.thinking or None)
        return shapes.text_completion(self.id, self.created, self.model, s.text, s.finish_reason,
                                      self.usage(), self.extension())


class LocalServer:
    """The server over one worker, on the running asyncio loop (plain, or the window's qasync).

    ``await start()`` binds and returns the URL; ``await stop()`` pauses answers in
    progress (saved as paused checkpoints), closes the port and detaches from the worker.
    """

    def __init__(self, worker, options: ServerOptions = ServerOptions()) -> None:
        self.worker = worker
        self.options = options
        self.link: EngineLink | None = None
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    @property
    def running(self) -> bool:
        return self._runner is not None

    async def start(self) -> str:
        problem = binding_problem(self.options)
        if problem:
            raise ValueError(problem)
        self.link = EngineLink(asyncio.get_running_loop())
        routes = _Routes(self.worker, self.link, self.options)
        app = web.Application(client_max_size=self.options.max_body_bytes,
                              middlewares=[routes.errors, routes.auth])
        app.router.add_get("/health", routes.health)
        app.router.add_get("/v1/models", routes.models)
        app.router.add_get("/v1/models/{name}", routes.model)
        app.router.add_post("/v1/chat/completions", routes.chat)
        app.router.add_post("/v1/completions", routes.completion)
        self.worker.add_listener(self.link)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.options.host, self.options.port).start()
        except BaseException:
            await runner.cleanup()
            self.worker.remove_listener(self.link)
            raise
        self._runner = runner
        host, port = runner.addresses[0][:2]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        return self.url

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is None:
            return
        assert self.link is not None   # start() made it before the runner
        for job in self.link.jobs():
            self.worker.cancel_request(job.id)   # answers in progress pause and are saved
        try:
            await runner.cleanup()
        finally:
            self.worker.remove_listener(self.link)
            self.url = None
