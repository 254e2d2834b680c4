"""gui.chat_state: the window's bookkeeping of answers, without Qt or a model."""

from __future__ import annotations

import uuid
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from gui.chat_state import ChatState


def snap(*, paused=False, last="assistant"):
    return SimpleNamespace(paused=paused, transcript=({"role": "user", "content": "hi"},
                                                      {"role": last, "content": "there"}))


def test_the_buttons_follow_the_shown_conversation_while_another_answers():
    a, b = uuid.uuid4(), uuid.uuid4()
    s = ChatState(current=a)
    s.asked(a)
    assert not s.can_send() and s.can_pause() and not s.idle
    s.current = b                              # switched while A answers
    assert s.can_send() and not s.can_pause()
    assert s.can_regenerate(snap()) and not s.can_resume(snap())
    s.asked(b)
    assert s.answering == {a, b} and s.can_pause()
    s.ended(a)
    assert s.answering == {b} and not s.idle
    s.ended(b)
    assert s.idle and s.can_send()


def test_switching_back_shows_what_the_answer_streamed_meanwhile():
    a, b = uuid.uuid4(), uuid.uuid4()
    s = ChatState(current=a)
    s.asked(a)
    assert s.streamed(a) is None                 # asked for, not started: nothing to show
    transcript = ({"role": "user", "content": "Tell me"},)
    s.started(a, transcript)
    s.text(a, "Once ")
    s.current = b
    s.text(a, "upon a time")
    s.text(b, "ignored: B has no answer")
    assert s.streamed(a) == (transcript, "Once upon a time")
    assert s.streamed(b) is None


def test_closing_and_unopened_conversations_send_nothing():
    a = uuid.uuid4()
    s = ChatState(current=a, unopened={a: "file"})
    assert not s.can_send()
    s.unopened = {}
    assert s.can_send()
    s.closing = True
    assert not s.can_send() and not s.can_resume(snap(paused=True))


EVENTS = st.lists(st.tuples(st.sampled_from(["asked", "started", "text", "ended", "show"]),
                            st.integers(0, 2)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(EVENTS)
def test_any_sequence_of_events_keeps_the_buttons_consistent(events):
    ids = [uuid.uuid4() for _ in range(3)]
    s = ChatState(current=ids[0])
    running: dict = {}          # the model: conversation -> started?
    for kind, k in events:
        conv = ids[k]
        if kind == "asked":
            s.asked(conv)
            running.setdefault(conv, False)
        elif kind == "started":
            s.started(conv, ())
            running[conv] = True
        elif kind == "text":
            s.text(conv, "x")
        elif kind == "ended":
            s.ended(conv)
            running.pop(conv, None)
        else:
            s.current = conv
        assert s.answering == set(running)
        assert s.can_pause() == (s.current in running)
        assert s.can_send() == (s.current not in running)
        assert (s.streamed(conv) is not None) == running.get(conv, False)
