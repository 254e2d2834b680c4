"""A checkpoint's metadata holds the conversation's messages once (issue 25, point 2: per-file
overhead): every reader's transcript is the conversation's (engine.conversation.transcript_of),
and files written before, which also hold a ``transcript`` key, read as they did."""

from __future__ import annotations

import json

import pytest

from engine.checkpoints import format as fmt
from engine.conversation import Answer, Conversation, transcript_of
from engine.generation import begin_answer, generate
from engine.sampling import SamplerSettings


def _conversations() -> dict[str, Conversation]:
    """A finished turn, a paused answer after it, and a system prompt."""
    finished = Conversation(system_prompt="Be brief.", messages=[("user", "Hi"), ("assistant", "Hello!")],
                            answer=Answer(text="Hello!", finish_reason="stop"))
    paused = Conversation(messages=[("user", "Hi"), ("assistant", "Hello!"), ("user", "A poem?")],
                          answer=Answer(text="Roses are", n_generated=3))
    return {"finished": finished, "paused": paused, "empty": Conversation()}


@pytest.mark.parametrize("name", ["finished", "paused", "empty"])
def test_the_transcript_is_the_conversations(name):
    conv = _conversations()[name]
    meta = json.loads(json.dumps({"conversation": conv.to_json()}))   # as a file holds it
    assert transcript_of(meta) == conv.transcript()


def test_a_file_written_before_reads_its_transcript_key_when_its_conversation_is_unreadable():
    written = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel", "complete": False}]
    both = {"conversation": _conversations()["finished"].to_json(), "transcript": written}
    assert transcript_of(both) == _conversations()["finished"].transcript()   # one rule when both are there
    assert transcript_of({"transcript": written}) == written
    broken = {"conversation": {"messages": 7, "answer": {"n_prompt_tokens": "x"}}, "transcript": written}
    assert transcript_of(broken) == written


def test_a_mistyped_setting_loses_no_message():
    """Fields a transcript does not show, mistyped, and an unreadable answer: the messages
    that can be read are still shown."""
    data = _conversations()["paused"].to_json()
    data.update(created="soon", sampler={"temperature": "hot"}, id=5, system_prompt={"a": 1})
    data["answer"]["n_generated"] = "x"
    data["messages"].append({"role": "robot", "content": "?"})
    assert transcript_of({"conversation": json.loads(json.dumps(data))}) == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "A poem?"}]


@pytest.mark.parametrize("meta", [{}, {"conversation": []}, {"transcript": "words"},
                                  {"transcript": [1, {"role": 2, "content": "x"}, {"role": "user"}]},
                                  {"conversation": {"messages": [{"role": "user", "content": 5}, "x"],
                                                    "created": "soon"}}])
def test_untrusted_metadata_gives_what_can_be_read_never_an_exception(meta):
    assert transcript_of(meta) == []


def test_a_saved_file_holds_each_message_once(smollm_runtime, tmp_path):
    """Real SmolLM2: the user's words and the answer so far appear once in the metadata
    bytes, there is no second copy under ``transcript``, and the transcript read back is
    the conversation's."""
    rt = smollm_runtime
    rt.trim(0)
    conv = Conversation(system_prompt="You answer in one line.",
                        sampler=SamplerSettings(temperature=0.7, seed=3, ignore_eos=True))
    words = "Name a river that flows through four countries, please."
    begin_answer(conv, rt, words, n_predict=12)
    generate(rt, conv, stop_after=6)
    saved = rt.save(tmp_path / "paused.kvckpt", conv)
    header, meta = fmt.read_metadata(saved.path)
    raw = saved.path.read_bytes()[fmt.HEADER_LEN:fmt.HEADER_LEN + header.meta_len].decode()
    assert "transcript" not in meta
    assert raw.count(json.dumps(words)[1:-1]) == 1
    assert conv.answer.text and raw.count(json.dumps(conv.answer.text)[1:-1]) == 1
    assert transcript_of(meta) == conv.transcript()
    assert transcript_of(meta)[-1] == {"role": "assistant", "content": conv.answer.text, "complete": False}
