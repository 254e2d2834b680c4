"""Request validation: a JSON body into a typed request, or an OpenAI-style error.

Every field the server uses is checked for its type and range before anything reaches
the engine; a problem is an :class:`ApiError` naming the field (``param``), answered
with OpenAI's error body and status.  Fields the server does not use are ignored, as
OpenAI-compatible servers commonly do, except those whose meaning it cannot honour
(``n`` > 1, ``echo``, ``suffix``, tools), which are refused rather than silently
ignored.  Besides OpenAI's fields, ``top_k``, ``min_p``, ``repeat_penalty`` and
``ignore_eos`` are accepted (llama.cpp's server takes them too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

#: OpenAI's limit on stop sequences.
MAX_STOP = 4
MAX_MESSAGES = 10_000
MAX_TOKENS_LIMIT = 1 << 20


class ApiError(Exception):
    """A request the server refuses: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass(frozen=True)
class Generation:
    """How to generate, common to chat and plain completions."""
    max_tokens: int = -1                 # -1: until the model stops or the context is full
    sampling: tuple[tuple[str, Any], ...] = ()   # SamplerSettings fields set by the request
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False          # stream_options.include_usage


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[tuple[str, str], ...]
    generation: Generation


@dataclass(frozen=True)
class TextRequest:
    model: str
    prompt: str
    generation: Generation


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body, or a 400."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ApiError(400, "The request body is not UTF-8 text.") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"The request body is not valid JSON ({exc}).") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    try:   # JSON may escape half a UTF-16 pair ("\ud800"): a string no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "The request body holds a lone UTF-16 surrogate (a \\uD800-\\uDFFF escape "
                            "without its pair): that is not text.") from None
    return body


def _wrong(name: str, what: str, value: Any) -> ApiError:
    return ApiError(400, f"'{name}' must be {what}, not {json.dumps(value)[:60]}.", param=name,
                    code="invalid_type")


def _number(body: dict, name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _wrong(name, f"a number from {lo:g} to {hi:g}", value)
    return float(value)


def _integer(body: dict, name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise _wrong(name, f"an integer from {lo} to {hi}", value)
    return value


def _boolean(body: dict, name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _wrong(name, "true or false", value)
    return value


def _model(body: dict) -> str:
    value = body.get("model")
    if value is None:
        raise ApiError(400, "'model' is required (GET /v1/models lists it).", param="model",
                       code="missing_required_parameter")
    if not isinstance(value, str) or not value:
        raise _wrong("model", "a model id", value)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in items):
        raise _wrong("stop", f"a non-empty string or a list of at most {MAX_STOP} of them", value)
    return tuple(items)


def _generation(body: dict, *, chat: bool) -> Generation:
    n = _integer(body, "n", 1, 1 << 16)
    if n is not None and n != 1:
        raise ApiError(400, "Only one choice per request is supported ('n' must be 1).", param="n",
                       code="unsupported_value")
    max_tokens = _integer(body, "max_tokens", 1, MAX_TOKENS_LIMIT)
    if chat:
        newer = _integer(body, "max_completion_tokens", 1, MAX_TOKENS_LIMIT)
        max_tokens = newer if newer is not None else max_tokens
    sampling = {}
    for name, field, lo, hi in (("temperature", "temperature", 0.0, 2.0), ("top_p", "top_p", 0.0, 1.0),
                                ("min_p", "min_p", 0.0, 1.0), ("repeat_penalty", "repeat_penalty", 0.0, 10.0)):
        value = _number(body, name, lo, hi)
        if value is not None:
            sampling[field] = value
    top_k = _integer(body, "top_k", 0, 1 << 20)
    if top_k is not None:
        sampling["top_k"] = top_k
    ignore_eos = _boolean(body, "ignore_eos")
    if ignore_eos is not None:
        sampling["ignore_eos"] = ignore_eos
    for name in ("frequency_penalty", "presence_penalty"):   # accepted, not used
        _number(body, name, -2.0, 2.0)
    seed = _integer(body, "seed", -(1 << 63), (1 << 64) - 1)
    stream = bool(_boolean(body, "stream"))
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise _wrong("stream_options", "an object", options)
        include_usage = bool(_boolean(options, "include_usage"))
    for name in ("tools", "functions", "tool_choice", "function_call"):
        if body.get(name) not in (None, [], "none"):
            raise ApiError(400, f"'{name}' is not supported by this server.", param=name,
                           code="unsupported_parameter")
    return Generation(max_tokens=-1 if max_tokens is None else max_tokens,
                      sampling=tuple(sorted(sampling.items())), seed=seed, stop=_stop(body),
                      stream=stream, include_usage=include_usage)


def _content(index: int, value: Any) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    name = f"messages[{index}].content"
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"'{name}' may only hold text parts ({{\"type\": \"text\", \"text\": ...}}).",
                               param=name, code="unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise _wrong(name, "a string or a list of text parts", value)


def parse_chat(body: dict) -> ChatRequest:
    model = _model(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects.",
                       param="messages", code="invalid_type" if raw is not None else "missing_required_parameter")
    if len(raw) > MAX_MESSAGES:
        raise ApiError(400, f"At most {MAX_MESSAGES} messages are accepted.", param="messages")
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise _wrong(f"messages[{i}]", "an object", item)
        role = item.get("role")
        if role == "developer":
            role = "system"      # OpenAI's newer name for the system message
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, f"'messages[{i}].role' must be system, developer, user or assistant"
                                f"{'' if not isinstance(role, str) else f', not {role}'}.",
                           param=f"messages[{i}].role", code="unsupported_value")
        if item.get("tool_calls"):
            raise ApiError(400, "Tool calls are not supported by this server.",
                           param=f"messages[{i}].tool_calls", code="unsupported_parameter")
        content = item.get("content")
        messages.append((role, "" if content is None and role == "assistant" else _content(i, content)))
    if messages[0] == ("system", ""):
        messages.pop(0)          # an empty system prompt is no system prompt
    if not messages or messages[-1][0] != "user":
        raise ApiError(400, "The last message must be the user's: the answer is to it.",
                       param="messages", code="unsupported_value")
    return ChatRequest(model, tuple(messages), _generation(body, chat=True))


def parse_completion(body: dict) -> TextRequest:
    model = _model(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "'prompt' must be a non-empty string (one prompt per request).",
                       param="prompt", code="invalid_type" if prompt is not None else "missing_required_parameter")
    if body.get("echo"):
        raise ApiError(400, "'echo' is not supported by this server.", param="echo", code="unsupported_parameter")
    if body.get("suffix"):
        raise ApiError(400, "'suffix' is not supported by this server.", param="suffix",
                       code="unsupported_parameter")
    return TextRequest(model, prompt, _generation(body, chat=False))
