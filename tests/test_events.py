"""The engine's events: each kind is a frozen dataclass, and each reaches the listener method
that its class names, annotated with that class (so a listener's override is typed)."""

from __future__ import annotations

import dataclasses
import typing
import uuid

import pytest

from engine import events
from engine.events import Event, Failed, TextDelta, WorkerListener


def _event_classes() -> list[type[Event]]:
    found, todo = [], [Event]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.append(sub)
            todo.append(sub)
    return found


def test_every_event_kind_is_frozen_and_has_its_own_listener_method():
    kinds = _event_classes()
    assert len(kinds) >= 20
    handlers = [k.handler for k in kinds]
    assert len(set(handlers)) == len(handlers), "two kinds of event share one method"
    for kind in kinds:
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen, kind
        method = getattr(WorkerListener, kind.handler)
        hints = typing.get_type_hints(method, vars(events))
        assert hints.get("e") is kind, (kind, kind.handler, hints)


def test_on_event_calls_the_method_its_kind_names():
    heard = []

    class Listener(WorkerListener):
        def on_text(self, e: TextDelta) -> None:
            heard.append(e)

    conv = uuid.uuid4()
    listener = Listener()
    listener.on_event(TextDelta(conv, "hi"))
    listener.on_event(Failed(events.Action.SEND, "no"))   # a kind this listener ignores
    assert heard == [TextDelta(conv, "hi")]
    with pytest.raises(dataclasses.FrozenInstanceError):
        heard[0].delta = "changed"   # type: ignore[misc]
