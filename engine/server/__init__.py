"""The local OpenAI-compatible server: a front end of the engine, like the window.

HTTP runs on an asyncio loop; answers run on the engine thread.  The server speaks to
the engine only through :class:`engine.worker.EngineWorker`'s public face (``complete``, ``model_info``,
``cancel_request``, ``add_listener`` and the ``Request*`` events of engine.events); what
the engine thread does for a request — find the conversation it continues or the stored
checkpoint sharing its longest prefix, restore, generate, save — is the core's
(:mod:`engine.requests`).  Nothing in the engine core imports this package (a test says so).

* :mod:`engine.server.schema` — request validation: JSON bodies into typed requests,
  every problem an :class:`~engine.server.schema.ApiError` with OpenAI's error shape.
* :mod:`engine.server.shapes` — OpenAI's response objects (completions, chunks, usage).
* :mod:`engine.server.link` — the bridge between the engine thread and the loop: a
  worker listener that posts each request's events to its waiting handler.
* :mod:`engine.server.app` — the aiohttp application, its routes and guards, and
  :class:`~engine.server.app.LocalServer`, which the CLI (``serve``) and the window
  start on their own loops.

Only ``app`` and ``link`` import aiohttp/asyncio.
"""
