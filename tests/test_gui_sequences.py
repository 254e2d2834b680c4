"""Issue 11 in the window: two answers at once, each with its own Pause and Resume,
switching between them while they stream, and switches that restore nothing.

Real SmolLM2, offscreen; the reference is the same prompt and seed answered alone.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from test_gui_window import run_to_end, type_and_send, wait_saved

from gui.conversations import ANSWERING_MARK
from gui.main_window import about_text

FIRST = "Write a long story about a dragon who guards a library."
SECOND = "Describe a harbour town at dawn."


def test_two_answers_stream_at_once_and_each_pauses_alone(qtbot, make_window):
    w = make_window(n_predict=64)
    reference = {}
    for prompt in (FIRST, SECOND):             # each answered alone first
        qtbot.mouseClick(w.findChild(object, "newButton"), Qt.MouseButton.LeftButton)
        run_to_end(qtbot, w, prompt)
        reference[prompt] = w.chat_view.answer_text()

    streamed: dict = {}
    w.bridge.tokens_generated.connect(lambda conv, text: streamed.__setitem__(conv, streamed.get(conv, "") + text))
    qtbot.mouseClick(w.findChild(object, "newButton"), Qt.MouseButton.LeftButton)
    a = w.current
    with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
        type_and_send(qtbot, w, FIRST)
    # a second conversation while the first one answers: the list stays usable
    assert w.conversation_list.isEnabled()
    qtbot.mouseClick(w.findChild(object, "newButton"), Qt.MouseButton.LeftButton)
    b = w.current
    assert b != a and w.send_button.isEnabled() and not w.pause_button.isEnabled()
    type_and_send(qtbot, w, SECOND)
    qtbot.waitUntil(lambda: b in streamed and a in streamed, timeout=60_000)
    assert w.state.answering == {a, b}
    for conv in (a, b):
        assert w.conversation_list.item_for(conv).text().startswith(ANSWERING_MARK)

    # back to A while both stream: what A said so far, then the rest as it comes
    w.select_conversation(a)
    assert w.current == a and w.pause_button.isEnabled()
    shown = w.chat_view.answer_text()
    assert shown and streamed[a].startswith(shown)
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=60_000,
                          check_params_cb=lambda s: s.conversation_id == a) as paused:
        qtbot.mouseClick(w.pause_button, Qt.MouseButton.LeftButton)
    assert paused.args[0].finish_reason == "paused"
    assert w.state.is_answering(b)             # B goes on
    assert not w.conversation_list.item_for(a).text().startswith(ANSWERING_MARK)
    qtbot.waitUntil(lambda: not w.state.answering, timeout=120_000)
    wait_saved(qtbot, w)
    qtbot.waitUntil(w.resume_button.isEnabled, timeout=10_000)
    assert w.chat_view.answer_text() == streamed[a]
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000):
        qtbot.mouseClick(w.resume_button, Qt.MouseButton.LeftButton)
    wait_saved(qtbot, w)
    assert w.chat_view.answer_text() == reference[FIRST]

    # B ran to its end beside A's pause and resume, exactly as alone; switching to it
    # restores nothing: it is resident
    with qtbot.waitSignal(w.bridge.conversation_activated, timeout=30_000) as activated:
        w.select_conversation(b)
    assert activated.args[1] is True and activated.args[2] == 0
    assert "Resident" in w.statusBar().currentMessage()
    qtbot.waitUntil(lambda: w.chat_view.answer_text() == reference[SECOND], timeout=10_000)
    assert streamed[b] == reference[SECOND]

    text = about_text(w.bridge.model_info)
    assert "4 conversation(s) resident" in text and "identical to their run alone" in text
