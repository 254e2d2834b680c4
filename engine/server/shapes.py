"""OpenAI's response objects, built from what the engine reports.

Shapes follow OpenAI's API reference for ``chat.completion``, ``chat.completion.chunk``,
``text_completion`` and ``list`` of ``model``.  ``usage.prompt_tokens_details.cached_tokens``
is the number of prompt tokens restored (from the cache or a checkpoint) instead of
decoded.  Each response also carries ``checkpoint_chat``: the conversation the answer
belongs to, its seed, and the checkpoint file it was saved to, so a client can find
it in the store.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from engine import APP_VERSION

SYSTEM_FINGERPRINT = f"checkpoint-chat-{APP_VERSION}"

#: engine finish reasons -> OpenAI's; a pause (the window's Pause button, or the server
#: stopping) ends an answer early, as a length limit does: OpenAI has no value of its own
#: for it, so ``checkpoint_chat.paused`` (:func:`extension`) tells the two apart
FINISH_REASONS = {"stop": "stop", "stop_string": "stop", "length": "length",
                  "context_full": "length", "paused": "length"}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def finish_reason(engine_reason: str) -> str:
    return FINISH_REASONS.get(engine_reason, "stop")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int,
          reasoning_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def extension(conversation: uuid.UUID | None, seed: int | None, checkpoint: Path | None,
              paused: bool = False) -> dict[str, Any]:
    """A response's ``checkpoint_chat``: the conversation, the seed, the checkpoint saved, and
    whether the answer was paused (the server stopping, the window's Pause): cut short, its
    ``finish_reason`` is "length" though ``max_tokens`` was not reached."""
    return {"conversation": str(conversation) if conversation else None, "seed": seed,
            "checkpoint": str(checkpoint) if checkpoint else None, "paused": paused}


def chat_completion(rid: str, created: int, model: str, text: str, reason: str,
                    use: dict[str, Any], ext: dict[str, Any], reasoning: str | None = None) -> dict[str, Any]:
    """A ``chat.completion``; a thinking model's thinking is the message's
    ``reasoning_content`` (as llama-server and DeepSeek's API return it), apart from
    ``content``; the key is there only when the answer has thinking."""
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if reasoning:
        message["reasoning_content"] = reasoning
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [{"index": 0, "message": message,
                         "logprobs": None, "finish_reason": finish_reason(reason)}],
            "usage": use, "checkpoint_chat": ext}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any] | None,
               reason: str | None = None, use: dict[str, Any] | None = None,
               ext: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chunk: a delta, the final one (``reason``), or the usage one (no choices).
    A thinking model's thinking streams as ``{"reasoning_content": ...}`` deltas, its
    answer as ``{"content": ...}`` deltas."""
    chunk: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                             "model": model, "system_fingerprint": SYSTEM_FINGERPRINT}
    if delta is None:
        chunk["choices"] = []
    else:
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish_reason(reason) if reason else None}]
    if use is not None:
        chunk["usage"] = use
    if ext is not None:
        chunk["checkpoint_chat"] = ext
    return chunk


def text_completion(rid: str, created: int, model: str, text: str | None, reason: str | None,
                    use: dict[str, Any] | None = None, ext: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``text_completion``; streamed ones have the same shape, one piece of text each
    (``text`` None: the usage chunk, no choices)."""
    out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                           "system_fingerprint": SYSTEM_FINGERPRINT,
                           "choices": [] if text is None else [{
                               "text": text, "index": 0, "logprobs": None,
                               "finish_reason": finish_reason(reason) if reason else None}]}
    if use is not None:
        out["usage"] = use
    if ext is not None:
        out["checkpoint_chat"] = ext
    return out


def model_list(models: list[tuple[str, int]]) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                        "owned_by": "checkpoint-chat"} for name, created in models]}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying ``payload`` (JSON, or a literal like "[DONE]")."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def now() -> int:
    return int(time.time())
