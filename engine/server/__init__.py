"""The local OpenAI-compatible server: HTTP on an asyncio loop, answers on the engine thread.

* :mod:`engine.server.engine_commands` — what the engine thread does for a request
  (a mixin of :class:`engine.worker.EngineWorker`): find the conversation the request
  continues, or the stored checkpoint sharing its longest prefix, restore it, generate,
  save the answer as a head.  No HTTP, no asyncio.
* :mod:`engine.server.schema` — request validation: JSON bodies into typed requests,
  every problem an :class:`~engine.server.schema.ApiError` with OpenAI's error shape.
* :mod:`engine.server.shapes` — OpenAI's response objects (completions, chunks, usage).
* :mod:`engine.server.link` — the bridge between the engine thread and the loop: a
  worker listener that posts each request's events to its waiting handler.
* :mod:`engine.server.app` — the aiohttp application, its routes and guards, and
  :class:`~engine.server.app.LocalServer`, which the CLI (``serve``) and the window
  start on their own loops.

Only ``app`` and ``link`` import aiohttp/asyncio; ``engine_commands`` is imported by the
worker and so by the window at start-up, and must stay light.
"""
