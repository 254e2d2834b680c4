"""Branches in the window (issue 10), against the real model, offscreen.

The user's clicks go where a user clicks: the links in the chat view's message headings
(‹ k/n ›, Edit, Continue, Fork), the editor's Send, the buttons of the offer bar.  What
the engine does with them is tests/test_branches.py's; here: what the window shows, and
that it never waits for something that cannot come (another model's conversation, a
full context).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor
from test_gui_window import run_to_end, wait_saved

from engine.checkpoints.format import read_header

Messages = list[tuple[str, str]]


def shown(w) -> Messages:
    return [(m.role, m.text) for m in w.chat_view.messages]


def click_href(qtbot, view, href: str) -> None:
    """Click the link to ``href`` in the chat view where it is drawn, as a user would."""
    doc = view.document()
    block = doc.begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().isAnchor() and frag.charFormat().anchorHref() == href:
                start = QTextCursor(doc)
                start.setPosition(frag.position())
                end = QTextCursor(doc)
                end.setPosition(frag.position() + frag.length())
                view.setTextCursor(start)
                view.ensureCursorVisible()
                left, right = view.cursorRect(start), view.cursorRect(end)
                point = left.center()
                point.setX((left.left() + right.left()) // 2)
                qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=point)
                return
            it += 1
        block = block.next()
    raise AssertionError(f"no link to {href} in {view.toPlainText()!r}")


def send_text(qtbot, w, text: str) -> None:
    w.prompt_edit.setPlainText(text)
    qtbot.mouseClick(w.send_button, Qt.MouseButton.LeftButton)


def _anchors(view) -> list[tuple[str, str]]:
    out = []
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().isAnchor():
                out.append((frag.text(), frag.charFormat().anchorHref()))
            it += 1
        block = block.next()
    return out


def test_headings_follow_the_alternatives_and_the_last_answer(qtbot):
    """The heading links written piece by piece (switchers, Continue moving to the newest
    answer) equal a full render of the same messages."""
    from engine.branches import Alternatives
    from gui.chat_view import ChatView
    view = ChatView()
    qtbot.addWidget(view)
    view.set_transcript([{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
                        alternatives=(None, None, Alternatives(2, 3, (Path("a"), Path("b"), Path("c")))))
    assert ("Continue", "continue:2") in _anchors(view) and ("‹", "alt:2:1") in _anchors(view)
    assert "2/3" in view.toPlainText() and ("Edit", "edit:0") in _anchors(view)   # the system prompt
    view.begin_answer("And you?")
    view.append_text("Fine.")
    view.finish_answer(complete=True)
    assert [h for _, h in _anchors(view) if h.startswith("continue:")] == ["continue:4"]
    two = Alternatives(1, 2, (Path("x"), Path("y")))
    assert view.set_alternatives((None, None, view.messages[2].alternatives, None, two))
    assert ("›", "alt:4:2") in _anchors(view) and "1/2" in view.toPlainText()
    incremental = (_anchors(view), view.toPlainText().split())
    view.render()
    assert (_anchors(view), view.toPlainText().split()) == incremental
    assert not view.set_alternatives((None,))                  # not aligned: nothing changes
    view.set_transcript([{"role": "user", "content": "Hi"}], actions=False)
    assert [t for t, _ in _anchors(view)] == ["Copy"]          # read from a file: no actions


def test_regenerate_keeps_the_answer_and_switching_back_decodes_nothing(qtbot, make_window):
    w = make_window(n_predict=8)
    run_to_end(qtbot, w, "Name a colour.")
    first = w.chat_view.answer_text()
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000):
        qtbot.mouseClick(w.regenerate_button, Qt.MouseButton.LeftButton)
    wait_saved(qtbot, w)
    second = w.chat_view.answer_text()
    assert second and second != first                       # a new seed, a new answer
    alternatives = w.chat_view.messages[-1].alternatives
    assert (alternatives.index, alternatives.count) == (2, 2)
    assert "‹ 2/2 ›" in w.chat_view.toPlainText()

    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=60_000) as changed:
        click_href(qtbot, w.chat_view, "alt:1:1")            # ‹
    back = changed.args[0]
    assert back.transcript[-1]["content"] == first
    assert w.chat_view.answer_text() == first and "‹ 1/2 ›" in w.chat_view.toPlainText()
    # the next answer follows the alternative shown, and nothing of it is decoded again
    summary = run_to_end(qtbot, w, "Another one?")
    assert summary.n_reused_tokens >= back.n_tokens > 0
    assert shown(w)[:2] == [("user", "Name a colour."), ("assistant", first)]

    # the checkpoint browser: the conversation's two branches, each with its fork point
    # and last message; Resume on the conversation's row opens its newest branch
    browser = w.show_browser()
    qtbot.waitUntil(lambda: any(r.role == "conversation" for r in browser.model.top_rows), timeout=30_000)
    (group,) = [r for r in browser.model.top_rows if r.role == "conversation"]
    assert len(group.children) == 2
    assert all(b.fork.startswith("message 2 (the answer)") for b in group.children)
    latest = w.chat_view.answer_text()
    assert {b.last_message for b in group.children} == {f"Assistant: {' '.join(t.split())}"
                                                        for t in (latest, second)}
    browser.select_path(group.children[0].path)
    assert browser.buttons["Resume"].isEnabled()


def test_edit_a_message_branches_and_the_old_turns_stay_reachable(qtbot, make_window):
    w = make_window(n_predict=6, temperature=0.0)
    run_to_end(qtbot, w, "Name a fruit.")
    run_to_end(qtbot, w, "Name a vegetable.")
    before = shown(w)
    assert len(before) == 4

    click_href(qtbot, w.chat_view, "edit:2")
    editor = w.message_editor
    assert editor is not None and editor.isVisible() and editor.text() == "Name a vegetable."
    editor.edit.setPlainText("Name a tree.")
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000):
        qtbot.mouseClick(editor.send_button, Qt.MouseButton.LeftButton)
    wait_saved(qtbot, w)
    after = shown(w)
    assert after[:3] == before[:2] + [("user", "Name a tree.")] and len(after) == 4
    assert after[3][1] and w.chat_view.messages[3].complete
    edited = w.chat_view.messages[2].alternatives
    assert (edited.index, edited.count) == (2, 2)
    assert w.chat_view.messages[0].alternatives is None        # the first turn is shared

    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=60_000):
        click_href(qtbot, w.chat_view, "alt:2:1")
    assert shown(w) == before                                  # the old turns, as they were
    assert w.chat_view.messages[2].alternatives.index == 1


def test_continue_and_fork_into_a_new_selected_conversation(qtbot, make_window):
    w = make_window(n_predict=6, temperature=0.0)
    run_to_end(qtbot, w, "Count from one.")
    answer = w.chat_view.answer_text()
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as fin:
        click_href(qtbot, w.chat_view, "continue:1")
    assert fin.args[0].n_reused_tokens == fin.args[0].n_prompt_tokens   # nothing read again
    wait_saved(qtbot, w)
    longer = w.chat_view.answer_text()
    assert longer.startswith(answer) and len(longer) > len(answer) and len(w.chat_view.messages) == 2
    run_to_end(qtbot, w, "And backwards?")
    original = w.current
    kept = shown(w)[:2]

    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=60_000,
                          check_params_cb=lambda snap: snap.id != original) as changed:
        click_href(qtbot, w.chat_view, "fork:1")
    fork = changed.args[0]
    assert w.current == fork.id and fork.title.endswith("(fork)")
    assert w.conversation_list.current_id() == fork.id
    assert w.conversation_list.item(0).data(Qt.ItemDataRole.UserRole) == fork.id   # on top
    assert w.conversation_list.item_for(original) is not None
    assert shown(w) == kept
    summary = run_to_end(qtbot, w, "Is that all?")
    assert summary.conversation_id == fork.id and summary.n_reused_tokens >= fork.n_tokens > 0


def _gemma_checkpoints(gemma_path: Path, folder: Path, prompts: list[str]) -> list[Path]:
    """Real checkpoints made with Gemma 3 270M, one conversation per prompt."""
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.runtime import Runtime
    from native.context import ContextSettings
    rt = Runtime(gemma_path, ContextSettings(n_ctx=1024, n_threads=2))
    out = []
    try:
        for k, prompt in enumerate(prompts):
            conv = Conversation(title=prompt)
            begin_answer(conv, rt, prompt, n_predict=4)
            generate(rt, conv)
            out.append(rt.save(folder / f"gemma-{k}.kvckpt", conv).path)
    finally:
        rt.close()
    return out


def test_another_models_conversation_is_marked_and_offers_instead_of_hanging(qtbot, make_window, gemma_path):
    w = make_window(n_predict=4)
    ours = w.bridge.model_info.name
    to_continue, to_load = _gemma_checkpoints(gemma_path, w.store.folder, ["Hello", "Good morning"])
    ids: list[uuid.UUID] = [read_header(p).conversation_id for p in (to_continue, to_load)]
    w.refresh_store()
    # the window may be listing already (it does at start): wait for a listing that saw them
    qtbot.waitUntil(lambda: all(w.conversation_list.other_model(i) for i in ids), timeout=30_000)
    theirs = w.conversation_list.other_model(ids[0])
    assert theirs and "gemma" in theirs.lower() and w.conversation_list.other_model(ids[1]) == theirs

    opened = []
    real_open = w.worker.open_checkpoint
    w.worker.open_checkpoint = lambda path, conv_id=None: (opened.append(path), real_open(path, conv_id))
    with qtbot.waitSignal(w.message_shown, timeout=30_000):
        w.select_conversation(ids[0])
    assert opened == []                                        # it would only fail
    text = w.chat_view.toPlainText()
    assert "Hello" in text and "Opening the conversation" not in text
    assert w.offer_bar.isVisible() and theirs in w.offer_bar.text()
    assert [b.text() for b in w.offer_bar.buttons()] == [f"Load {theirs}", f"Continue with {ours}"]
    assert not w.send_button.isEnabled()                       # a message would go nowhere

    # opened by path all the same (as a crash offer or Resume would): the engine refuses,
    # and the window says why where the conversation is, instead of "Opening…" forever
    with qtbot.waitSignal(w.message_shown, timeout=30_000):
        w.open_checkpoint(to_continue)
    qtbot.waitUntil(lambda: opened == [to_continue], timeout=10_000)
    qtbot.waitUntil(lambda: "Hello" in w.chat_view.toPlainText(), timeout=10_000)
    assert "Opening the conversation" not in w.chat_view.toPlainText() and w.offer_bar.isVisible()

    # Continue with the loaded model: a new branch of it, with SmolLM2
    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=30_000,
                          check_params_cb=lambda snap: snap.id == ids[0]):
        next(b for b in w.offer_bar.buttons() if b.text().startswith("Continue")).click()
    assert not w.offer_bar.isVisible() and w.send_button.isEnabled()
    assert w.conversation_list.other_model(ids[0]) == ""
    summary = run_to_end(qtbot, w, "How are you?")
    assert summary.conversation_id == ids[0] and summary.n_generated > 0
    assert shown(w)[0] == ("user", "Hello") and shown(w)[-2] == ("user", "How are you?")

    # Load Gemma: the model that made it is loaded, then the conversation is restored
    with qtbot.waitSignal(w.message_shown, timeout=30_000):
        w.select_conversation(ids[1])
    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=120_000,
                          check_params_cb=lambda snap: snap.id == ids[1]) as restored:
        next(b for b in w.offer_bar.buttons() if b.text().startswith("Load")).click()
    assert w.bridge.model_info.name == theirs
    assert restored.args[0].n_tokens == read_header(to_load).n_tokens
    assert shown(w)[0] == ("user", "Good morning") and not w.offer_bar.isVisible()
    assert w.send_button.isEnabled()


def test_a_model_switch_leaves_the_open_conversations_to_the_model_that_made_them(qtbot, make_window,
                                                                                  gemma_path):
    """A conversation paused with SmolLM2, then Gemma 3 loaded (File › Open Model): Resume went
    on at once, Gemma decoding SmolLM2's token ids and writing on in the paused answer (a new
    user's trial, under Xvfb).  The open conversations are the previous model's stored
    conversations now: dimmed, the one shown offers to load its model or to go on with the
    loaded one, and the engine refuses to answer in them; loading SmolLM2 again resumes the
    paused answer exactly where it stopped."""
    from test_gui_window import PROMPT, type_and_send
    w = make_window(n_predict=40, temperature=0.0)
    smol = w.bridge.model_info.name
    finished = run_to_end(qtbot, w, "Name a colour.").conversation_id
    qtbot.mouseClick(w.findChild(object, "newButton"), Qt.MouseButton.LeftButton)
    with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
        type_and_send(qtbot, w, PROMPT)
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=30_000):
        qtbot.mouseClick(w.pause_button, Qt.MouseButton.LeftButton)
    wait_saved(qtbot, w)
    paused, partial = w.current, w.chat_view.answer_text()
    assert partial and w.resume_button.isEnabled()

    with qtbot.waitSignal(w.message_shown, timeout=120_000):   # the offer, once Gemma is loaded
        w.switch_model(gemma_path)
        # a message sent while it loads stays in the box (it went to a conversation the
        # engine then closed: "not open", the text gone)
        w.prompt_edit.setPlainText("Are you there?")
        w.send()
        assert w.prompt_edit.toPlainText() == "Are you there?" and not w.send_button.isEnabled()
    gemma = w.bridge.model_info.name
    assert "gemma" in gemma.lower() and w.current == paused
    for conv_id in (paused, finished):
        assert w.conversation_list.other_model(conv_id) == smol
        assert w.worker.sessions.conversation(conv_id) is None    # the engine has let go of it
    assert [b.text() for b in w.offer_bar.buttons()] == [f"Load {smol}", f"Continue with {gemma}"]
    assert not w.resume_button.isEnabled() and not w.send_button.isEnabled()
    assert partial in w.chat_view.toPlainText()

    # asked all the same (a command queued before the switch landed): refused, nothing decoded
    failures, started = [], []
    w.bridge.engine_failed.connect(lambda action, message, conv_id: failures.append(message))
    w.bridge.generation_started.connect(started.append)
    w.worker.resume(paused)
    qtbot.waitUntil(lambda: bool(failures), timeout=30_000)
    assert started == [] and w.worker.sessions.conversation(paused) is None

    # Load SmolLM2: the paused answer is restored and resumes where it stopped
    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=120_000,
                          check_params_cb=lambda snap: snap.id == paused) as restored:
        next(b for b in w.offer_bar.buttons() if b.text().startswith("Load")).click()
    assert w.bridge.model_info.name == smol and restored.args[0].paused
    qtbot.waitUntil(lambda: w.resume_button.isEnabled(), timeout=30_000)
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as fin:
        qtbot.mouseClick(w.resume_button, Qt.MouseButton.LeftButton)
    assert fin.args[0].n_reused_tokens == fin.args[0].n_prompt_tokens   # nothing read again
    assert w.chat_view.answer_text().startswith(partial) and len(w.chat_view.answer_text()) > len(partial)


def test_a_conversation_being_opened_shows_its_text_and_takes_no_message_until_open(qtbot, make_window,
                                                                                     smollm_path):
    """While the engine opens a stored conversation (after a model load at start: seconds),
    the window showed "Opening the conversation…" and nothing else, Send stayed on, and a
    message sent then showed alone, its text as the conversation's title (seen under Xvfb).
    Its transcript is shown from the file now, and Send waits for the open."""
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.runtime import Runtime
    from gui.main_window import Action
    from native.context import ContextSettings
    w = make_window(n_predict=4)
    rt = Runtime(smollm_path, ContextSettings(n_ctx=1024, n_threads=2))
    try:
        convs, files = [], []
        for k, prompt in enumerate(("Name a river.", "Name a lake.")):
            convs.append(Conversation(title=prompt))
            begin_answer(convs[-1], rt, prompt, n_predict=4)
            generate(rt, convs[-1])
            files.append(rt.save(w.store.folder / f"stored-{k}.kvckpt", convs[-1]).path)
    finally:
        rt.close()
    other, conv = convs
    stored = files[1]
    w.refresh_store()
    qtbot.waitUntil(lambda: all(w.conversation_list.item_for(c.id) is not None for c in convs), timeout=30_000)
    held = []
    real_open = w.worker.open_checkpoint
    w.worker.open_checkpoint = lambda path, conv_id=None: held.append(path)   # the engine busy (a model loading)
    w.select_conversation(other.id)
    w.select_conversation(conv.id)
    qtbot.waitUntil(lambda: "Name a lake." in w.chat_view.toPlainText(), timeout=10_000)
    assert held == files and not w.send_button.isEnabled()
    # the first open fails: that says nothing of the one being opened now
    w._on_bridge_engine_failed(Action.OPEN_CHECKPOINT, "damaged", other.id)
    assert not w.send_button.isEnabled() and w.state.opening == (conv.id, stored)
    w.prompt_edit.setPlainText("And a sea?")
    w.send()                                       # Enter: said, and the message kept
    assert "still opening" in w.statusBar().currentMessage() and w.prompt_edit.toPlainText() == "And a sea?"
    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=30_000,
                          check_params_cb=lambda snap: snap.id == conv.id):
        real_open(stored, conv.id)
    qtbot.waitUntil(w.send_button.isEnabled, timeout=10_000)
    assert "Name a lake." in w.chat_view.toPlainText()


def test_a_full_context_offers_a_new_branch(qtbot, make_window):
    w = make_window(n_predict=8, n_ctx=512, temperature=0.0)
    n_ctx = w.bridge.model_info.n_ctx
    notes = "The roses need water every morning. " * (n_ctx // 20)
    first, second = f"My garden notes: {notes}Summarise.", f"More notes: {notes}What now?"
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000):
        send_text(qtbot, w, first)
    wait_saved(qtbot, w)
    before = shown(w)

    with qtbot.waitSignal(w.bridge.context_full, timeout=60_000):
        send_text(qtbot, w, second)
    qtbot.waitUntil(w.offer_bar.isVisible, timeout=10_000)
    assert w.running is None and w.send_button.isEnabled() and not w.pause_button.isEnabled()
    assert shown(w) == before                                  # the unsent message is taken back
    assert w.prompt_edit.toPlainText() == second               # and kept for the user
    assert "too long" in w.offer_bar.text()
    (button,) = w.offer_bar.buttons()
    assert button.text() == "Continue in a new branch"

    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as fin:
        button.click()
    assert fin.args[0].finish_reason in ("length", "stop") and fin.args[0].n_generated > 0
    wait_saved(qtbot, w)
    after = shown(w)
    assert after[-2] == ("user", second) and after[-1][0] == "assistant" and after[-1][1]
    assert ("user", first) not in after                        # only what fits was kept
    assert w.prompt_edit.toPlainText() == "" and not w.offer_bar.isVisible()
    # the full conversation stays as it was, one ‹ › away
    kept_first = w.chat_view.messages[0].alternatives
    assert kept_first is not None and kept_first.count == 2


def test_the_browsers_summary_counts_each_file_once(qtbot, app_home):
    """Branches of one conversation whose chains share files (the file they were cut from,
    folded under each): the browser's summary said "9 files · 8.2 MB" of a store of 5 files,
    5.3 MB (each branch's folded chain counted again, under Wine)."""
    from gui.browser import CHAIN, CONVERSATION, HEAD, CheckpointBrowser, Row, file_size_text
    shared = Row(Path("shared.kvckpt"), 4_000_000, 1.0, None, "valid", role=CHAIN)
    branches = tuple(Row(Path(f"branch{k}.kvckpt"), 100_000, 2.0 + k, None, "valid", role=HEAD,
                         children=(shared,)) for k in range(3))
    browser = CheckpointBrowser()
    qtbot.addWidget(browser)
    browser.set_rows([Row(None, 0, 4.0, None, "valid", role=CONVERSATION, children=branches)], None)
    assert browser.summary.text() == f"3 resumable · 4 files · {file_size_text(4_300_000)}"
