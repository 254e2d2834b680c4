"""Reasoning models: an answer's thinking apart from its text, everywhere a user sees it.

The chat templates under tests/templates/ are the ``tokenizer.chat_template`` of real
thinking models, byte for byte: Qwen3 (llama.cpp's ``models/templates/Qwen-Qwen3-0.6B.jinja``),
Qwen3.5 (Qwen3.5-35B-A3B's, sha256 a4aee8af…f715 as published) and DeepSeek-R1-Distill
(llama.cpp's ``models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja``) and
gpt-oss (llama.cpp's ``models/templates/openai-gpt-oss-120b.jinja``: channels, the harmony
format).

Fast tests: the splitter (whole and piece by piece, tags cut anywhere), what each template
renders for a conversation with thinking, the server's shapes (a fake engine behind the
real HTTP side), the window's toggle.  Through llama.cpp: a tiny qwen35 model whose GGUF
carries Qwen3.5's template — the format read from its metadata, the prompt of a second
turn with the first turn's thinking dropped, the same tokens and logits whether the turn
follows in the process or after a restore, and ``run --json``.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import uuid
from pathlib import Path

import pytest

from engine import chat_template
from engine.reasoning import (
    ANSWER,
    HARMONY,
    THINKING,
    Splitter,
    ThinkFormat,
    format_of,
    split,
    thinking_tokens,
)

TEMPLATES = Path(__file__).resolve().parent / "templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text("utf-8")
QWEN35 = (TEMPLATES / "qwen3.5.jinja").read_text("utf-8")
DEEPSEEK_R1 = (TEMPLATES / "deepseek-r1-distill.jinja").read_text("utf-8")
GPT_OSS = (TEMPLATES / "gpt-oss.jinja").read_text("utf-8")

TAGGED = ThinkFormat()                               # Qwen3: the model opens the block
OPENED = ThinkFormat(opened_by_prompt=True)          # Qwen3.5, DeepSeek-R1: the prompt does


class TemplateModel:
    """What chat_template.render needs of a model: its GGUF template, no native rendering."""

    def __init__(self, template: str | None) -> None:
        self.chat_template = template

    def apply_chat_template_native(self, messages, add_assistant):
        return "native rendering must not be used for a thinking model"


# -- the splitter ------------------------------------------------------------------------------

def pieces_of(text: str, fmt, cuts) -> tuple[str, str]:
    splitter = Splitter(fmt)
    out = []
    start = 0
    for cut in sorted(cuts) + [len(text)]:
        given = splitter.feed(text[start:cut])
        assert all(piece for _, piece in given) and len(given) <= 2     # no empty pieces
        out += given
        start = cut
    out += splitter.finish()
    return ("".join(p for k, p in out if k == THINKING), "".join(p for k, p in out if k == ANSWER))


@pytest.mark.parametrize("fmt, text, thinking, answer", [
    (TAGGED, "<think>\nI add 2 and 2.\n</think>\n\nIt is **4**.", "I add 2 and 2.", "It is **4**."),
    (TAGGED, "  <think>a\n\nb  </think>4\n", "a\n\nb", "4\n"),
    (TAGGED, "<think>\n\n</think>\n\nNo thinking.", "", "No thinking."),
    (TAGGED, "Plain answer that mentions <think> and </think>.", "",
     "Plain answer that mentions <think> and </think>."),
    (OPENED, "I add 2 and 2.\n</think>\n\nIt is 4.", "I add 2 and 2.", "It is 4."),
    (OPENED, "Still thinking when the length limit came", "Still thinking when the length limit came", ""),
    (TAGGED, "<think>\nunclosed", "unclosed", ""),
    (None, "<think>\nkept as written\n</think>\n\nall of it", "",
     "<think>\nkept as written\n</think>\n\nall of it"),
    # gpt-oss: <|end|> is a control token, rendered empty in the answer's text
    (HARMONY, "<|channel|>analysis<|message|>Two plus two.<|start|>assistant<|channel|>final<|message|>Four.",
     "Two plus two.", "Four."),
    (HARMONY, "<|channel|>final<|message|>Four, without thinking.", "", "Four, without thinking."),
    (HARMONY, "<|channel|>analysis<|message|>Still weighing it", "Still weighing it", ""),
    (HARMONY, "A plain answer.", "", "A plain answer."),
])
def test_the_parts_are_the_same_whole_or_in_any_pieces(fmt, text, thinking, answer):
    parts = split(text, fmt)
    assert (parts.thinking, parts.answer) == (thinking, answer)
    assert pieces_of(text, fmt, range(1, len(text))) == (thinking, answer)   # one character at a time
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = rng.sample(range(1, len(text)), k=rng.randint(0, min(6, len(text) - 1)))
        assert pieces_of(text, fmt, cuts) == (thinking, answer)


@pytest.mark.parametrize(("fmt", "pieces", "expected"), [
    (OPENED, [b"Two", b" plus", b" two.\n</", b"think", b">\n\n", b"Four."], 5),   # the closing tag ends in 5
    (TAGGED, [b"<think>", b"hm", b"</think>", b"Four."], 3),
    (OPENED, [b"Still", b" thinking"], 2),                     # the block never closed: all of it
    (TAGGED, [b"Four", b"."], 0),                               # no block
    (None, [b"<think>", b"x", b"</think>"], 0),                 # a model that does not think
    (HARMONY, [b"<|channel|>", b"analysis", b"<|message|>", b"Hm", b".", b"", b"<|start|>", b"assistant",
               b"<|channel|>", b"final", b"<|message|>", b"Four"], 11),
    (HARMONY, [b"<|channel|>", b"final", b"<|message|>", b"Four"], 0),
])
def test_the_thinking_tokens_are_those_up_to_the_closing_tag(fmt, pieces, expected):
    assert thinking_tokens(pieces, fmt) == expected


def test_a_tag_cut_across_tokens_is_held_back_until_the_next_piece_decides():
    s = Splitter(TAGGED)
    assert s.feed("<th") == [] and s.state == "starting"
    assert s.feed("ink>\nLet me") == [(THINKING, "Let me")] and s.state == "thinking"
    assert s.feed(" see.\n</") == [(THINKING, " see.")]      # the newline and "</" wait
    assert s.feed("thi") == []
    assert s.feed("nk>\n\nHel") == [(ANSWER, "Hel")] and s.state == "answering"
    assert s.feed("lo") == [(ANSWER, "lo")]
    assert s.finish() == []
    # a "<" that turns out not to be a tag is given out as soon as that is known
    s = Splitter(OPENED)
    assert s.feed("a <") == [(THINKING, "a")]
    assert s.feed("b") == [(THINKING, " <b")]


def test_an_unclosed_block_while_streaming_is_still_thinking():
    parts = split("<think>\nweighing it", TAGGED, final=False)
    assert parts.thinking_open and parts.block and parts.thinking == "weighing it" and parts.answer == ""
    parts = split("<thi", TAGGED, final=False)
    assert parts.thinking_open and not parts.block and parts.answer == ""
    assert not split("<think>x</think>y", TAGGED, final=False).thinking_open
    assert split("", OPENED, final=False).thinking_open
    # a resumed answer: what came before decides where the new text begins
    assert split(" more.\n</think>\n\nDone", OPENED, before="Thinking") == \
        split(" more.\n</think>\n\nDone", OPENED, before="Thinking", final=True)
    resumed = split(" more.\n</think>\n\nDone", OPENED, before="Thinking")
    assert (resumed.thinking, resumed.answer) == (" more.", "Done")


# -- the templates -------------------------------------------------------------------------------

def test_whether_a_model_thinks_is_read_from_its_template():
    from engine.models import default_model_path
    from native.library import bindings
    from native.model import Model
    assert format_of(QWEN3, chat_template.render_jinja(QWEN3, [("user", "Hi")], True)) == TAGGED
    assert format_of(QWEN35, chat_template.render_jinja(QWEN35, [("user", "Hi")], True)) == OPENED
    assert format_of(DEEPSEEK_R1, chat_template.render_jinja(DEEPSEEK_R1, [("user", "Hi")], True)) == OPENED
    assert format_of(GPT_OSS, chat_template.render_jinja(GPT_OSS, [("user", "Hi")], True)) == HARMONY
    for template in (QWEN3, QWEN35, DEEPSEEK_R1, GPT_OSS):
        assert chat_template.think_format(TemplateModel(template)) is not None
    # thinking switched off by the prompt (an empty block) is not a block opened
    assert format_of(QWEN35, "<|im_start|>assistant\n<think>\n\n</think>\n\n") == TAGGED
    bindings()
    with Model(default_model_path()) as smollm:      # SmolLM2 does not think
        assert smollm.chat_template and chat_template.think_format(smollm) is None
    assert chat_template.think_format(TemplateModel(None)) is None


SYSTEM, Q1, Q2 = "Be brief.", "What is 2+2?", "And 3+3?"


def two_turns(raw_answer: str) -> list[tuple[str, str]]:
    return [("system", SYSTEM), ("user", Q1), ("assistant", raw_answer), ("user", Q2)]


def test_qwen3_drops_past_thinking_and_keeps_the_last_answers():
    model = TemplateModel(QWEN3)
    raw = "<think>\nTwo plus two.\n</think>\n\nFour."
    assert chat_template.render(model, two_turns(raw), add_assistant=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n")
    # an answer after the last user message (the one a Continue goes on from) keeps its thinking
    assert chat_template.render(model, two_turns(raw)[:3], add_assistant=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo plus two.\n</think>\n\nFour.<|im_end|>\n")


def test_qwen35_opens_the_block_in_the_prompt_and_drops_past_thinking():
    model = TemplateModel(QWEN35)
    raw = "Two plus two.\n</think>\n\nFour."       # the prompt wrote "<think>\n"
    assert chat_template.render(model, two_turns(raw)[:2], add_assistant=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")
    assert chat_template.render(model, two_turns(raw), add_assistant=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\nFour.<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n")


def test_deepseek_r1_drops_past_thinking():
    model = TemplateModel(DEEPSEEK_R1)
    raw = "Two plus two.\n</think>\n\nFour."
    assert chat_template.render(model, two_turns(raw), add_assistant=True) == (
        "Be brief.<｜User｜>What is 2+2?<｜Assistant｜>Four.<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜><think>\n")


def test_gpt_oss_drops_past_analysis_and_dates_the_prompt_by_the_conversations_start():
    """gpt-oss's template refused an answer's channels in its content, and wrote today's
    date (``strftime_now``, which the Jinja environment lacked: the template could not be
    used at all): a conversation continued the next day would read its prompt again."""
    import time
    model = TemplateModel(GPT_OSS)
    began = time.mktime((2026, 1, 15, 12, 0, 0, 0, 0, -1))
    raw = "<|channel|>analysis<|message|>Two plus two.<|start|>assistant<|channel|>final<|message|>Four."
    prompt = chat_template.render(model, two_turns(raw), add_assistant=True, now=began)
    assert chat_template.template_problem(model) is None
    assert "Current date: 2026-01-15\n" in prompt
    assert "<|start|>developer<|message|># Instructions\n\nBe brief." in prompt
    assert prompt.endswith("<|start|>user<|message|>What is 2+2?<|end|>"
                           "<|start|>assistant<|channel|>final<|message|>Four.<|end|>"
                           "<|start|>user<|message|>And 3+3?<|end|><|start|>assistant")
    assert "Two plus two." not in prompt                   # past analysis is dropped
    assert chat_template.render(model, two_turns(raw), add_assistant=True, now=began + 86400) != prompt
    # the answer a Continue goes on from keeps its analysis
    assert chat_template.render(model, two_turns(raw)[:3], add_assistant=False, now=began).endswith(
        "<|start|>assistant<|channel|>analysis<|message|>Two plus two.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>Four.<|return|>")
    # an answer without analysis goes back as its final text, not its channel header
    plain = two_turns("<|channel|>final<|message|>Four.")
    assert "<|start|>assistant<|channel|>final<|message|>Four.<|end|>" in \
        chat_template.render(model, plain, add_assistant=True, now=began)


def test_a_conversation_renders_the_date_it_began(tiny_model_path):
    """Through the real generation path: the prompt of a conversation begun on another
    day carries that day, and its next turn continues the tokens the model saw."""
    import time

    from engine.conversation import Conversation
    from engine.generation import begin_answer, commit_answer
    from native.model import Model
    began = time.mktime((2025, 3, 4, 12, 0, 0, 0, 0, -1))
    with Model(tiny_model_path("llama", chat_template=GPT_OSS)) as model:
        class Holder:
            pass
        holder = Holder()
        holder.model = model
        conv = Conversation(created=began)
        begin_answer(conv, holder, "Hi")
        assert "Current date: 2025-03-04" in model.detokenize(conv.tokens)
        first = list(conv.tokens)
        conv.answer.text = "<|channel|>final<|message|>Hello."
        reply = model.tokenize("<|channel|>final<|message|>Hello.", add_special=False)
        conv.tokens += reply
        conv.answer.n_generated = len(reply)
        conv.answer.finish_reason = "stop"
        commit_answer(conv)
        begin_answer(conv, holder, "Bye")
        assert conv.tokens[:len(first)] == first


# -- the server's shapes, a fake engine behind the real HTTP side ----------------------------------

class FakeWorker:
    """The worker's public face as the server uses it; each answer streams ``pieces``."""

    def __init__(self, pieces: list[str], thinking: ThinkFormat | None) -> None:
        from engine.events import ModelInfo
        self.pieces = pieces
        self.model_info = ModelInfo(name="thinker", path=Path("/models/thinker.gguf"), architecture="qwen35",
                                    size=1, n_ctx=512, backend="CPU", library_path="", library_version="",
                                    thinking=thinking)
        self.alive = True
        self.links = []

    def add_listener(self, link) -> None:
        self.links.append(link)

    def remove_listener(self, link) -> None:
        self.links.remove(link)

    def cancel_request(self, request_id: str) -> None:
        pass

    def complete(self, request) -> None:
        from engine.events import ConversationSnapshot, GenerationSummary, RequestFinished, RequestStarted, TextDelta
        link, conv = self.links[0], uuid.uuid4()
        snap = ConversationSnapshot(id=conv, title="t", transcript=(), paused=False, n_tokens=0, n_ctx=512,
                                    seed=1, checkpoint=None)
        loop = asyncio.get_running_loop()

        def run() -> None:   # as the engine thread would: events in order
            link.on_event(RequestStarted(request.request_id, snap))
            for piece in self.pieces:
                link.on_event(TextDelta(conv, piece))
            link.on_event(GenerationSummary(conv, "stop", len(self.pieces), 5, 0, 1.0, "".join(self.pieces)))
            link.on_event(RequestFinished(request.request_id, conv, None))
        loop.call_soon(run)


PIECES = ["Two", " plus", " two.\n</", "think", ">\n\n", "Fo", "ur."]   # after "<think>\n"


async def ask_server(worker, body: dict) -> tuple[dict | None, list[dict]]:
    import aiohttp

    from engine.server.app import LocalServer, ServerOptions
    server = LocalServer(worker, ServerOptions(port=0))
    url = await server.start()
    try:
        async with aiohttp.ClientSession() as session, \
                session.post(f"{url}/v1/chat/completions", json=body) as response:
            assert response.status == 200
            if not body.get("stream"):
                return await response.json(), []
            events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return None, [json.loads(e) for e in events[:-1]]
    finally:
        await server.stop()


def _run_apart(coro):
    """asyncio.run on a thread of its own: a window test earlier in the session leaves a
    qasync loop running on this one."""
    out: dict = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as exc:   # handed back to the test's thread
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(120)
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_the_server_returns_reasoning_content_apart_whole_and_streamed():
    pytest.importorskip("aiohttp")
    worker = FakeWorker(PIECES, OPENED)
    body = {"model": "thinker", "messages": [{"role": "user", "content": "What is 2+2?"}]}
    whole, _ = _run_apart(ask_server(worker, body))
    message = whole["choices"][0]["message"]
    assert message["content"] == "Four." and message["reasoning_content"] == "Two plus two."

    _, chunks = _run_apart(ask_server(worker, dict(body, stream=True)))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    thinking = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (thinking, content) == ("Two plus two.", "Four.")
    assert not any("</" in d.get("reasoning_content", "") + d.get("content", "") for d in deltas)
    # the thinking streams before the answer, each delta one or the other
    kinds = [next(iter(d)) for d in deltas[1:] if d]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content") and len(kinds) >= 3

    plain = FakeWorker(["Four", "."], None)       # a model that does not think: no key at all
    whole, _ = _run_apart(ask_server(plain, body))
    assert whole["choices"][0]["message"]["content"] == "Four."
    assert "reasoning_content" not in whole["choices"][0]["message"]


def test_a_request_continues_a_thinking_models_conversation_sent_back_without_thinking():
    from engine.requests import _history_key
    stored = [("user", "What is 2+2?"), ("assistant", "Two plus two.\n</think>\n\nFour.")]
    sent = [("user", "What is 2+2?"), ("assistant", "Four.")]
    assert _history_key(stored, OPENED) == _history_key(sent, OPENED, sent=True)
    assert _history_key(stored, OPENED) == _history_key(stored, OPENED, sent=True)   # sent back whole
    assert _history_key(stored, None) != _history_key(sent, None, sent=True)


# -- the window ------------------------------------------------------------------------------------

def test_the_window_shows_the_thinking_collapsed_live_and_expands_it(qtbot):
    from gui.chat_view import THINKING_LINK, ChatView
    view = ChatView()
    qtbot.addWidget(view)
    view.show()
    view.set_thinking_format(OPENED)
    view.set_transcript([{"role": "user", "content": "What is 2+2?"}])
    view.begin_answer()
    assert "Thinking… (0 words)" in view.toPlainText()
    view.append_text("Two plus")
    assert "Thinking… (2 words)" in view.toPlainText() and "Two plus" not in view.toPlainText()
    view.append_text(" two.\n</thi")
    assert "Thinking… (3 words)" in view.toPlainText()
    view.append_text("nk>\n\nFo")
    text = view.toPlainText()
    assert "Show thinking (3 words)" in text and text.rstrip().endswith("Fo") and "</" not in text
    view.append_text("ur.")
    view.finish_answer(complete=True)
    text = view.toPlainText()
    assert text.rstrip().endswith("Four.") and "Two plus two." not in text
    assert view.answer_text() == "Two plus two.\n</think>\n\nFour."       # what the model wrote
    assert view.thinking_of(len(view.messages) - 1) == "Two plus two."

    # a click on the toggle shows the thinking between it and the answer, another hides it
    index = len(view.messages) - 1
    view.anchorClicked.emit(f"{THINKING_LINK}{index}")
    text = view.toPlainText()
    assert "Hide thinking (3 words)" in text and text.index("Two plus two.") < text.index("Four.")
    view.anchorClicked.emit(f"{THINKING_LINK}{index}")
    assert "Two plus two." not in view.toPlainText()

    # shown while it streams: the thinking grows in place
    view.begin_answer("And 3+3?")
    view.anchorClicked.emit(f"{THINKING_LINK}{len(view.messages) - 1}")
    view.append_text("Three and")
    view.append_text(" three")
    assert "▾ Thinking… (3 words)" in view.toPlainText() and "Three and three" in view.toPlainText()


def test_a_model_that_does_not_think_shows_its_answer_as_written(qtbot):
    from gui.chat_view import ChatView
    view = ChatView()
    qtbot.addWidget(view)
    view.set_transcript([{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "<think>x</think> y"}])
    assert "thinking" not in view.toPlainText().lower().replace("<think>", "")


# -- through llama.cpp -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def thinker(tiny_model_path):
    """A tiny random-weight qwen35 (hybrid) model whose GGUF carries Qwen3.5's chat template."""
    return tiny_model_path("qwen35", chat_template=QWEN35)


def test_a_thinking_models_next_turn_is_the_same_in_process_and_after_a_restore(thinker, tmp_path):
    import memkit

    from engine.checkpoints.chain import load_chain
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.runtime import Runtime
    from engine.sampling import SamplerSettings

    rt = Runtime(thinker, memkit.SETTINGS)
    try:
        assert chat_template.think_format(rt.model) == OPENED     # from the GGUF's metadata
        conv = Conversation(system_prompt=SYSTEM, sampler=SamplerSettings(temperature=0.0, seed=7, ignore_eos=True))
        begin_answer(conv, rt, Q1, n_predict=10)
        first_prompt = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                        "<|im_start|>assistant\n<think>\n")
        assert conv.tokens == rt.model.tokenize_prompt(first_prompt)
        streamed = []

        class Listener:
            def on_prefill_progress(self, done, total):
                pass

            def on_text(self, delta):
                streamed.append(delta)

        generate(rt, conv, listener=Listener())
        raw = conv.answer.text
        parts = split(raw, OPENED)
        assert pieces_of("".join(streamed), OPENED, []) == (parts.thinking, parts.answer)
        rt.save(tmp_path / "first.kvckpt", conv)

        begin_answer(conv, rt, Q2, n_predict=10)
        second_prompt = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
                         f"<|im_start|>assistant\n{parts.answer}<|im_end|>\n"
                         "<|im_start|>user\nAnd 3+3?<|im_end|>\n<|im_start|>assistant\n<think>\n")
        assert conv.tokens == rt.model.tokenize_prompt(second_prompt)    # the first thinking dropped
        # the first turn kept a snapshot where the user's message ended (Answer.marks): the
        # second is read from there, not from the start (the answer's text and the new turn)
        first_turn = rt.model.tokenize_prompt(first_prompt[:-len("<|im_start|>assistant\n<think>\n")])
        assert first_turn == conv.tokens[:len(first_turn)]
        in_process = generate(rt, conv)
        assert in_process.n_reused_tokens == len(first_turn) > 0
        expected = memkit.fingerprint(rt, in_process.text), list(conv.tokens)
    finally:
        rt.close()

    rt = Runtime(thinker, memkit.SETTINGS)
    try:
        restored = rt.restore_chain(load_chain(tmp_path / "first.kvckpt"))
        assert restored.answer.text == raw             # the thinking kept, as the model wrote it
        begin_answer(restored, rt, Q2, n_predict=10)
        after_restore = generate(rt, restored)
        assert after_restore.n_reused_tokens == 0     # no snapshot in a new process: read whole
        assert (memkit.fingerprint(rt, after_restore.text), list(restored.tokens)) == expected
    finally:
        rt.close()


def test_the_window_folds_a_real_thinking_models_thinking(thinker, make_window, qtbot):
    w = make_window(n_predict=8, model_path=str(thinker), temperature=0.0)
    assert w.bridge.model_info.thinking == OPENED and w.chat_view.thinking == OPENED
    live = []
    w.bridge.tokens_generated.connect(lambda conv, text: live.append(w.chat_view.toPlainText()))
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as finished:
        w.prompt_edit.setPlainText(Q1)
        w.send()
    raw = finished.args[0].text
    parts = split(raw, OPENED)
    assert live and "Thinking… (" in live[0]          # live while it streams
    shown = w.chat_view.toPlainText()
    assert f"Show thinking ({len(parts.thinking.split())} word" in shown
    assert not parts.thinking.strip() or parts.thinking not in shown
    assert w.chat_view.answer_text() == raw


def test_run_json_gives_the_thinking_apart(thinker, tmp_path):
    from conftest import run_cli

    from engine.checkpoints.chain import load_chain
    from engine.conversation import transcript_of
    done = run_cli("run", "-m", str(thinker), "-c", "512", "-t", "2", "--temp", "0", "--seed", "7",
                   "-p", Q1, "-n", "8", "--json", "--checkpoint-save", str(tmp_path / "a.kvckpt"), check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    raw = transcript_of(load_chain(tmp_path / "a.kvckpt")[-1].meta)[-1]["content"]
    parts = split(raw, OPENED)
    assert out["n_generated"] == 8 and raw.strip()
    assert (out["reasoning_content"], out["text"]) == (parts.thinking or None, parts.answer)
    assert out["reasoning_content"]     # the prompt opened the block: the model began thinking


def test_the_window_engine_reads_a_thinking_hybrids_next_turn_and_an_edit_from_the_turns_snapshots(
        thinker, tmp_path):
    """The window's engine on a hybrid whose template drops past thinking: the next turn is
    read from where the user's first message ended, and an edit of the second message from
    where it started (the snapshots of Answer.marks), not from the start; each gives what
    reading the whole prompt in a fresh cache gives, bit for bit."""
    import memkit
    from enginekit import Recorder

    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.runtime import Runtime
    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions
    from native.model import Model

    vocab = Model(thinker, vocab_only=True)
    try:
        turn_1 = len(vocab.tokenize_prompt("<|im_start|>system\nBe brief.<|im_end|>\n"
                                           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"))
        header = len(vocab.tokenize("<|im_start|>assistant\n", add_special=False))
    finally:
        vocab.close()
    sampler = SamplerSettings(temperature=0.0, seed=7, ignore_eos=True)
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(thinker, n_ctx=1024, n_threads=2, sequences=2))
        rec.wait("loaded")
        a = w.new_conversation(system_prompt=SYSTEM, sampler=sampler)
        w.send(a, Q1, n_predict=10)
        rec.wait("finished")
        w.send(a, Q2, n_predict=10)
        second = rec.wait("finished", 2)[-1][1]
        assert second.n_reused_tokens == turn_1
        # usage's reasoning_tokens: a random model seldom closes its block, so most are thinking
        assert 0 < second.n_reasoning_tokens <= second.n_generated == 10
        w.edit_message(a, 2, "And 4+4?", n_predict=10)
        edited = rec.wait("finished", 3)[-1][1]
        assert not rec.of("error"), rec.of("error")
    finally:
        w.shutdown()
        assert w.join(60)
    # the edit's prompt parts from the second turn's after the first answer and its header
    assert turn_1 + header < edited.n_reused_tokens < second.n_prompt_tokens
    rt = Runtime(thinker, memkit.SETTINGS)   # the same prompt read whole in a fresh cache
    try:
        conv = Conversation(system_prompt=SYSTEM, sampler=sampler)
        begin_answer(conv, rt, Q1, n_predict=10)
        generate(rt, conv)
        rt.trim(0)
        begin_answer(conv, rt, "And 4+4?", n_predict=10)
        alone = generate(rt, conv)
        assert alone.n_reused_tokens == 0
        assert (alone.text, alone.n_prompt_tokens) == (edited.text, edited.n_prompt_tokens)
    finally:
        rt.close()


def test_a_thinking_hybrids_next_turn_in_a_new_process_reads_from_its_turns_file(thinker, app_home):
    """`run` in the store: the first turn's prefill autosaves where the user's message
    ended (a mark of a recurrent memory's prompt), so the next turn, in a new process, is
    read from that file's snapshot, not from the start (its template drops the thinking)."""
    from conftest import run_cli

    from engine.checkpoints.chain import load_chain
    from engine.generation import MARK_FILE_MIN
    from native.model import Model
    system = ("Answer briefly, exactly, and in plain words; say so when unsure. " * 4).strip()
    vocab = Model(thinker, vocab_only=True)
    try:
        turn_1 = len(vocab.tokenize_prompt(f"<|im_start|>system\n{system}<|im_end|>\n"
                                           "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"))
    finally:
        vocab.close()
    assert turn_1 >= MARK_FILE_MIN      # a mark this far in is worth a file
    common = ["-m", str(thinker), "-c", "512", "-t", "2", "--temp", "0", "--seed", "7", "-n", "8", "--json"]

    def run(*args: str) -> dict:
        return json.loads(run_cli("run", *common, *args, check=True).stdout.strip().splitlines()[-1])
    first = run("--system", system, "-p", Q1)
    chain = load_chain(Path(first["checkpoint"]))
    # the file at the turn's end mark (the head absorbs no anchor of its own answer), none
    # where the message began (68 tokens in)
    assert [data.header.n_tokens for data in chain] == [turn_1, first["n_prompt_tokens"] + 8]
    second = run("--checkpoint-load", first["checkpoint"], "-p", Q2)
    assert (second["n_reused_tokens"], second["n_generated"]) == (turn_1, 8)


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_a_thinking_hybrids_turns_in_the_window_edit_exactly(arch, tiny_model_path, tmp_path):
    """The window's engine on a thinking hybrid: four turns (each next turn parts from the
    mark where the user's message ended, its template dropping the thinking), then an Edit
    of turn 2 answers what a conversation that said the same from the start answers, and
    reads only the new message: turn 2's mark file carries the state where its message
    started as a point (LineWriter._mark_points; no file ends at that history), where it
    read the conversation again from the start before.  The conversation is one full file
    and deltas (a head that absorbed a thinking answer's mark would leave the next turn no
    file to build on: a full file a turn).  The same on a recurrent memory (mamba2 with
    Qwen3.5's template), whose snapshots are its whole state."""
    from enginekit import Recorder

    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions
    rec = Recorder()
    store = Store(tmp_path / "store")
    w = EngineWorker(rec, store)
    w.start()
    try:
        w.load_model(ModelOptions(tiny_model_path(arch, chat_template=QWEN35), n_ctx=2048, n_threads=2,
                                  sequences=2))
        rec.wait("loaded")
        sampler = SamplerSettings(seed=3, temperature=0.0, ignore_eos=True)
        a = w.new_conversation(sampler=sampler, system_prompt=("Answer briefly and exactly. " * 6).strip())
        questions = ("What is 2+2?", "And 3+3?", "And 4+4?", "And 5+5?")
        for i, text in enumerate(questions):
            w.send(a, text, n_predict=8)
            rec.wait("finished", i + 1)
        full_files = [n for n in Graph.scan(store.folder).nodes.values()
                      if n.conversation_id == a and not n.header.is_delta]
        assert len(full_files) <= 1, [n.header.n_tokens for n in full_files]   # one base, then deltas
        w.edit_message(a, 2, "And 7+7?", n_predict=8)
        edited = rec.wait("finished", 5)[-1][1]
        b = w.new_conversation(sampler=sampler, system_prompt=("Answer briefly and exactly. " * 6).strip())
        w.send(b, questions[0], n_predict=8)
        rec.wait("finished", 6)
        w.send(b, "And 7+7?", n_predict=8)
        reference = rec.wait("finished", 7)[-1][1]
        assert not rec.of("error"), rec.of("error")
        assert edited.text == reference.text and edited.n_prompt_tokens == reference.n_prompt_tokens
        # the reference read turn 1's answer again (its thinking dropped); the edit reads less
        read, reference_read = (s.n_prompt_tokens - s.n_reused_tokens for s in (edited, reference))
        assert 0 < read < reference_read, (edited.n_reused_tokens, reference.n_reused_tokens)
    finally:
        w.shutdown()
        assert w.join(60)
