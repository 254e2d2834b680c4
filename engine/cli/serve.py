"""``checkpoint-chat serve``: the OpenAI-compatible server on a plain asyncio loop.

One engine thread (engine.worker) owns the model, as in the window; the HTTP server
(engine.server.app) runs on this process's asyncio loop and hands each request to the
engine thread.  Every answer is saved in the store like any other conversation's, so
a conversation a client goes on with after a restart is restored, not recomputed.

Ctrl+C, SIGTERM (and on Windows closing the console) stop it: answers in progress are
paused and saved, the port is closed, the engine thread saves what it holds and exits;
the exit status is 0.  Binding to anything but loopback needs an API key and prints a
warning.  Every user mistake is one line on stderr and exit status 1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading

from engine.cli.output import EXIT_OK
from engine.commands import Action
from engine.errors import AppError
from engine.events import Failed, GenerationSummary, ModelFailed, ModelInfo, ModelLoaded, Notice, WorkerListener

API_KEY_ENV = "CHECKPOINT_CHAT_API_KEY"
#: conversations kept open besides the one in the cache (EngineWorker.request_conversations_kept)
SERVED_KEPT = 16


class _ServeListener(WorkerListener):
    """The command line's own listener: the model's load, and one line per answer."""

    def __init__(self) -> None:
        self.settled = threading.Event()
        self.info: ModelInfo | None = None
        self.failure: str | None = None

    def on_model_loaded(self, e: ModelLoaded) -> None:
        self.info = e.info
        self.settled.set()

    def on_model_failed(self, e: ModelFailed) -> None:
        self.failure = e.message
        self.settled.set()

    def on_generation_finished(self, summary: GenerationSummary) -> None:
        ttft = f", first token after {summary.ttft_s:.2f} s" if summary.ttft_s is not None else ""
        print(f"[ANSWER] {summary.n_prompt_tokens} prompt tokens ({summary.n_reused_tokens} restored), "
              f"{summary.n_generated} generated, {summary.finish_reason}{ttft}", file=sys.stderr, flush=True)

    def on_error(self, e: Failed) -> None:
        if e.action is not Action.LOAD_MODEL:   # that one ends the command, as its one error line
            print(f"warning: could not {e.action}: {e.message}", file=sys.stderr, flush=True)

    def on_notice(self, e: Notice) -> None:
        print(f"note: {e.message}", file=sys.stderr, flush=True)


def server_options(args):
    from engine.server.app import ServerOptions, binding_problem
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    options = ServerOptions(host=args.host.strip(), port=args.port, api_key=key or None,
                            max_body_bytes=args.max_request_kb * 1024)
    problem = binding_problem(options)
    if problem:
        raise AppError(problem)
    return options


def model_options(args):
    from engine.cli.options import context_settings, model_path
    from engine.events import ModelOptions
    settings = context_settings(args, None)
    return ModelOptions(path=model_path(args, None), n_ctx=settings.n_ctx, n_threads=settings.n_threads,
                        n_gpu_layers=args.n_gpu_layers, llama_lib=args.llama_lib, rpc_servers=args.rpc or "",
                        n_batch=settings.n_batch, flash_attn=settings.flash_attn, type_k=settings.type_k,
                        type_v=settings.type_v, main_gpu=args.main_gpu, rpc_timeout=args.rpc_timeout,
                        sequences=args.sequences)


def cmd_serve(args) -> int:
    from engine.server.app import binding_warning
    if not args.verbose:
        # what the engine logs as warnings reaches the user as this command's own lines (or
        # a client as its error); bugs (errors) still show
        logging.getLogger("engine").setLevel(logging.ERROR)
    options = server_options(args)
    model = model_options(args)
    warning = binding_warning(options)
    if warning:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return asyncio.run(_serve(args, options, model))


async def _serve(args, options, model) -> int:
    from engine.checkpoints.store import Store
    from engine.server.app import LocalServer, model_id
    from engine.shutdown import ShutdownGuard
    from engine.worker import EngineWorker

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    guard = ShutdownGuard(lambda reason: loop.call_soon_threadsafe(stop.set))
    listener = _ServeListener()
    store = Store()
    worker = EngineWorker(listener, store)
    worker.autosave_every = args.checkpoint_save_interval
    worker.request_conversations_kept = SERVED_KEPT
    server = LocalServer(worker, options)
    with guard:
        worker.start()
        try:
            worker.load_model(model)
            while not listener.settled.is_set() and not stop.is_set():
                await asyncio.sleep(0.05)
            if listener.failure is not None:
                raise AppError(listener.failure)
            if stop.is_set():
                return EXIT_OK
            try:
                url = await server.start()
            except OSError as exc:
                raise AppError(f"cannot listen on {options.host}:{options.port}: "
                               f"{exc.strerror or exc}") from None
            info = listener.info
            assert info is not None   # settled without a failure: on_model_loaded set it
            at_once = "one at a time" if info.sequences == 1 else f"up to {info.sequences} at once"
            print(f"Serving {model_id(info.path)} (context {info.n_ctx:,} tokens; checkpoints in "
                  f"{store.folder}); requests are answered {at_once}", file=sys.stderr, flush=True)
            print(f"Listening on {url}/v1 (OpenAI-compatible; Ctrl+C stops)", flush=True)
            await stop.wait()
            print("stopping: answers in progress are paused and saved", file=sys.stderr, flush=True)
        finally:
            await server.stop()
            worker.shutdown(save=True)
            await loop.run_in_executor(None, worker.join, 120)
            guard.save_finished()
    return EXIT_OK
