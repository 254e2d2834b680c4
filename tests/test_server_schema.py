"""The local server's logic without a model: request validation, response shapes, the
binding rule, and several listeners on one worker."""

from __future__ import annotations

import json
import uuid

import pytest

from engine.server import shapes
from engine.server.app import ServerOptions, binding_problem, binding_warning, is_loopback
from engine.server.schema import ApiError, parse_body, parse_chat, parse_completion

MODEL = "SmolLM2-135M-Instruct.Q4_1"


def chat(**fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return parse_chat(body)


def refused(fn, *args, **kwargs) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args, **kwargs)
    error = info.value
    assert set(error.body()["error"]) == {"message", "type", "param", "code"}
    return error


def test_a_chat_request_is_typed_and_normalised():
    r = parse_chat({"model": MODEL, "max_tokens": 16, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                    "stop": "END", "stream": True, "stream_options": {"include_usage": True},
                    "user": "anything", "frequency_penalty": 0,
                    "messages": [{"role": "developer", "content": "Be brief."},
                                 {"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                                 {"role": "assistant", "content": "c"},
                                 {"role": "user", "content": "d"}]})
    assert r.messages == (("system", "Be brief."), ("user", "ab"), ("assistant", "c"), ("user", "d"))
    g = r.generation
    assert (g.max_tokens, g.seed, g.stop, g.stream, g.include_usage) == (16, 7, ("END",), True, True)
    assert dict(g.sampling) == {"temperature": 0.5, "top_p": 0.9}
    assert chat(max_completion_tokens=5, max_tokens=9).generation.max_tokens == 5
    assert chat().generation.max_tokens == -1 and chat().generation.seed is None
    empty_system = parse_chat({"model": MODEL, "messages": [{"role": "system", "content": ""},
                                                            {"role": "user", "content": "x"}]})
    assert empty_system.messages == (("user", "x"),)


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "ten"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"), ({"top_p": -0.1}, "top_p"), ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"), ({"stop": [""]}, "stop"),
    ({"stream": "yes"}, "stream"), ({"stream_options": []}, "stream_options"), ({"n": 2}, "n"),
    ({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "messages"),
    ({"messages": ["hi"]}, "messages[0]"), ({"model": 3}, "model"), ({"model": None}, "model"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_every_wrong_field_is_a_400_naming_it(fields, param):
    error = refused(chat, **fields)
    assert error.status == 400 and error.param == param and error.type == "invalid_request_error"


def test_bodies_that_are_not_json_objects_are_400s():
    for raw in (b"{bad", b"[1, 2]", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b""):
        assert refused(parse_body, raw).status == 400
    assert parse_body(b'{"a": 1}') == {"a": 1}


@pytest.mark.parametrize("raw", [b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
                                 b'{"prompt": "\\udfff"}', b'{"stop": ["\\uDC00"], "prompt": "hi"}'])
def test_half_a_surrogate_pair_is_a_400_not_a_server_error(raw):
    """JSON may escape one half of a UTF-16 pair: a string the tokenizer cannot encode (a 500
    with a codec message before, found by a user's test).  A whole pair is text."""
    assert "surrogate" in refused(parse_body, raw).message
    assert parse_body(b'{"prompt": "\\ud83d\\ude00"}') == {"prompt": "\U0001F600"}


def test_a_completion_request():
    r = parse_completion({"model": MODEL, "prompt": ["Once upon"], "max_tokens": 3})
    assert r.prompt == "Once upon" and r.generation.max_tokens == 3
    for fields in ({"prompt": 3}, {"prompt": ["a", "b"]}, {"prompt": ""}, {"echo": True}, {"suffix": "x"}):
        assert refused(parse_completion, {"model": MODEL, "prompt": "x", **fields}).status == 400


def test_only_loopback_goes_without_a_key():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("example.org")
    assert binding_problem(ServerOptions()) is None and binding_warning(ServerOptions()) is None
    assert "--api-key" in binding_problem(ServerOptions(host="0.0.0.0"))
    keyed = ServerOptions(host="0.0.0.0", api_key="k")
    assert binding_problem(keyed) is None and "not encrypted" in binding_warning(keyed)


def test_response_shapes():
    use = shapes.usage(10, 4, 7)
    assert use == {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
                   "prompt_tokens_details": {"cached_tokens": 7},
                   "completion_tokens_details": {"reasoning_tokens": 0}}
    whole = shapes.chat_completion("chatcmpl-1", 1, MODEL, "hello", "stop_string", use,
                                   shapes.extension(uuid.uuid4(), 3, None))
    assert whole["object"] == "chat.completion" and whole["choices"][0]["finish_reason"] == "stop"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hello", "refusal": None}
    last = shapes.chat_chunk("chatcmpl-1", 1, MODEL, {}, "context_full")
    assert last["object"] == "chat.completion.chunk" and last["choices"][0]["finish_reason"] == "length"
    assert shapes.chat_chunk("chatcmpl-1", 1, MODEL, None, use=use)["choices"] == []
    assert shapes.text_completion("cmpl-1", 1, MODEL, "x", "length")["object"] == "text_completion"
    event = shapes.sse({"a": "é"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:].decode()) == {"a": "é"} and shapes.sse("[DONE]") == b"data: [DONE]\n\n"


def test_listeners_share_one_worker_and_an_added_ones_failure_stays_its_own():
    from engine.checkpoints.store import Store
    from engine.events import RequestFailed, RequestRefusal, TextDelta
    from engine.worker import EngineWorker, WorkerListener

    class Recording(WorkerListener):
        def __init__(self, fail: bool = False) -> None:
            self.texts, self.fail = [], fail

        def on_text(self, e):
            self.texts.append(e.delta)
            if self.fail:
                raise RuntimeError("listener bug")

    first, failing, third = Recording(), Recording(fail=True), Recording()
    worker = EngineWorker(first, Store("unused"))
    worker.add_listener(failing)
    worker.add_listener(failing)          # once is enough
    worker.add_listener(third)
    cid = uuid.uuid4()
    worker.listener.emit(TextDelta(cid, "a"))     # the added listener's bug is logged, not raised
    worker.remove_listener(failing)
    worker.listener.emit(TextDelta(cid, "b"))
    worker.listener.emit(RequestFailed("r", RequestRefusal("failed", "x")))   # an event not every listener hears
    assert first.texts == ["a", "b"] and failing.texts == ["a"] and third.texts == ["a", "b"]
    primary = Recording(fail=True)
    worker.listener = primary             # assigning replaces the first listener only
    assert worker.listener.members == (primary, third)
    with pytest.raises(RuntimeError):     # the first listener's failure reaches the engine, as before
        worker.listener.emit(TextDelta(cid, "c"))
    assert third.texts == ["a", "b", "c"]
