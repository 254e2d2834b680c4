"""engine.sessions, engine.commands and engine.checkpoint_policy's rules, without a model."""

from __future__ import annotations

import uuid

from engine import commands as cmd
from engine.checkpoint_policy import head_kind, stop_kind
from engine.checkpoints.format import KIND_EXIT, KIND_MANUAL, KIND_PAUSE
from engine.conversation import Conversation
from engine.sessions import RunningAnswer, SessionTable


class _Control:
    def __init__(self) -> None:
        self.paused = False

    def request_pause(self) -> None:
        self.paused = True


class _Writer:
    def __init__(self) -> None:
        self.closed = False
        self.head = None
        self.own_head = None   # engine.history.LineWriter's: the newest file it wrote

    def close(self) -> None:
        self.closed = True


def test_a_pause_covers_the_answers_submitted_before_it_only():
    table = SessionTable()
    a, b = uuid.uuid4(), uuid.uuid4()
    first = table.number_answer(a)
    table.pause(a)                          # a's first answer, not started yet
    second = table.number_answer(a)
    other = table.number_answer(b)
    session = table.get(a)
    assert table.begin_answer(session, first, _Control(), None)
    table.end_answer(session)
    assert not table.begin_answer(session, second, _Control(), None)
    table.end_answer(session)
    assert not table.begin_answer(table.get(b), other, _Control(), None)
    table.end_answer(table.get(b))
    table.pause()                           # every conversation's, submitted so far
    assert table.begin_answer(table.get(b), other, _Control(), None)


def test_a_pause_reaches_the_running_answers_and_the_request_they_serve():
    table = SessionTable()
    conv = Conversation()
    session = table.adopt(conv)
    control = _Control()
    assert not table.begin_answer(session, table.number_answer(conv.id), control, "r1")
    session.answer = RunningAnswer(job=None, restore_s=0.0, action=cmd.Action.SEND, request_id="r1")
    assert table.answering() == {conv.id} and table.any_running
    with table.lock:
        assert table.control_of_request("r1") is control
    assert table.pause(conv.id) == [control]
    running = table.end_answer(session)
    assert running.request_id == "r1" and not table.any_running and table.answering() == set()
    assert table.pause() == []


def test_ending_a_session_releases_all_it_held():
    table = SessionTable()
    conv = Conversation()
    session = table.adopt(conv)
    old, new = _Writer(), _Writer()
    table.set_writer(conv.id, old)
    table.set_writer(conv.id, new)
    assert old.closed and not new.closed          # one writer per line
    session.head = "head.kvckpt"
    table.mark_served(session)
    assert table.conversation(conv.id) is conv and table.served() == [session]
    assert table.end(conv.id) is session
    assert new.closed and conv.id not in table and table.conversation(conv.id) is None
    assert table.served() == [] and table.end(conv.id) is None


def test_served_sessions_are_ordered_by_their_last_use():
    table = SessionTable()
    a, b = table.adopt(Conversation()), table.adopt(Conversation())
    table.mark_served(a)
    table.mark_served(b)
    table.mark_served(a)
    assert table.served() == [b, a]


def test_commands_wait_as_their_kind_says():
    conv_id = uuid.uuid4()
    assert cmd.LoadModel(None).wait() == cmd.IDLE
    assert cmd.Send(conv_id, "hi").wait() == cmd.Wait(conv_id, sequence=True)
    assert cmd.Rename(conv_id, "t").wait() == cmd.Wait(conv_id)
    assert cmd.OpenCheckpoint("x").wait() == cmd.Wait(sequence=True)
    assert cmd.Show(conv_id).wait() == cmd.NOW
    assert cmd.EditMessage(conv_id, 2, "new", 5).arguments() == [conv_id, 2, "new", 5]
    assert cmd.Fork.action is cmd.Action.FORK and cmd.Fork.action == "fork the conversation"


def test_a_head_kind_is_truthful():
    assert head_kind(True, KIND_MANUAL) == KIND_PAUSE
    assert head_kind(True, KIND_EXIT) == KIND_EXIT
    assert head_kind(False, KIND_PAUSE) == KIND_MANUAL
    assert head_kind(False, KIND_EXIT) == KIND_MANUAL
    assert stop_kind(True, exiting=True) == KIND_EXIT
    assert stop_kind(True, exiting=False) == KIND_PAUSE
    assert stop_kind(False, exiting=True) == KIND_MANUAL
