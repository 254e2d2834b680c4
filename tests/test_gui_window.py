"""The desktop app against the real model, offscreen (pytest-qt).

Small context (1024) and short answers keep this tier quick on two cores.  Every test
drives the window as a user would (typing, clicking, dropping files, closing) and
checks what the engine wrote to disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import QApplication

from engine.checkpoints.format import KIND_EXIT, KIND_PAUSE, read_header, verify_file
from gui.conversations import PAUSED_MARK

PROMPT = "Write a long story about a dragon who guards a library."


def type_and_send(qtbot, w, text: str) -> None:
    w.prompt_edit.setFocus()
    qtbot.keyClicks(w.prompt_edit, text)
    qtbot.keyClick(w.prompt_edit, Qt.Key.Key_Return)


def wait_saved(qtbot, w, timeout=60_000):
    """The next non-autosave checkpoint after the last one seen: (snapshot, path, size, seconds, kind).

    Saves are recorded from the window's creation on, so one delivered in the same event
    batch as the signal a test waited for before is not missed.
    """
    seen = w._test_seen_saves
    qtbot.waitUntil(lambda: len(w._test_saves) > seen, timeout=timeout)
    w._test_seen_saves = len(w._test_saves)
    return w._test_saves[-1]



def run_to_end(qtbot, w, text: str):
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as fin:
        type_and_send(qtbot, w, text)
    wait_saved(qtbot, w)
    return fin.args[0]


def test_type_send_stream_pause_resume_equals_uninterrupted(qtbot, make_window, app_home):
    w = make_window(n_predict=40)
    assert w.findChild(type(w.prompt_edit), "promptEdit") is w.prompt_edit
    for name in ("promptEdit", "sendButton", "pauseButton", "resumeButton", "chatView",
                 "conversationList", "modelStatus", "contextUsage"):
        assert w.findChild(object, name) is not None, name
    assert "Smol" in w.model_status.text() or "smol" in w.model_status.text().lower()

    batches = []
    w.bridge.tokens_generated.connect(lambda _id, text: batches.append(text))
    summary = run_to_end(qtbot, w, PROMPT)
    full = w.chat_view.answer_text()
    assert summary.finish_reason in ("length", "stop") and summary.n_generated > 5
    assert "".join(batches) == full and len(batches) >= 2     # streamed, not all at once
    assert full in w.chat_view.toPlainText().replace("\u2029", "\n")
    assert w.context_usage.value() > 0 and w.context_usage.maximum() == 1024

    # a second conversation, same prompt and seed: pause as soon as tokens flow
    qtbot.mouseClick(w.findChild(object, "newButton"), Qt.MouseButton.LeftButton)
    assert w.chat_view.answer_text() == ""
    with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
        type_and_send(qtbot, w, PROMPT)
    assert w.pause_button.isEnabled() and not w.send_button.isEnabled()
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=30_000) as fin:
        qtbot.mouseClick(w.pause_button, Qt.MouseButton.LeftButton)
    assert fin.args[0].finish_reason == "paused"
    snap, path, size, _secs, kind = wait_saved(qtbot, w)
    assert kind == KIND_PAUSE and snap.paused
    assert verify_file(path).kind == KIND_PAUSE            # a valid, complete checkpoint
    assert Path(path).parent == w.store.folder
    partial = w.chat_view.answer_text()
    assert len(partial) < len(full) and full.startswith(partial)
    qtbot.waitUntil(lambda: "saved" in w.chat_view.toPlainText(), timeout=5000)
    assert w.resume_button.isEnabled()

    # Resume continues in place; the result equals the uninterrupted run
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=60_000) as fin:
        qtbot.mouseClick(w.resume_button, Qt.MouseButton.LeftButton)
    assert fin.args[0].n_reused_tokens == fin.args[0].n_prompt_tokens   # nothing recomputed
    wait_saved(qtbot, w)
    assert w.chat_view.answer_text() == full


def _drop(widget, paths):
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    # as a drag does: enter (the widget accepts file URLs), then the drop itself
    enter = QDragEnterEvent(QPoint(10, 10), Qt.DropAction.CopyAction, mime,
                            Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, enter)
    assert enter.isAccepted()
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime,
                       Qt.MouseButton.LeftButton, Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, event)
    event._mime = mime   # the event does not own its mime data: keep it alive with the event
    return event


def _foreign_checkpoint(gemma_path: Path, target: Path) -> Path:
    """A real checkpoint made with Gemma 3 270M (another model, another architecture)."""
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.runtime import Runtime
    from native.context import ContextSettings
    rt = Runtime(gemma_path, ContextSettings(n_ctx=1024, n_threads=2))
    try:
        conv = Conversation()
        begin_answer(conv, rt, "Hello", n_predict=4)
        generate(rt, conv)
        rt.save(target, conv)
    finally:
        rt.close()
    return target


def test_drop_valid_corrupt_and_foreign_checkpoints(qtbot, make_window, tmp_path, gemma_path):
    w = make_window(n_predict=8)
    run_to_end(qtbot, w, "Say hello.")
    source = Path(w.snapshots[w.current].checkpoint)
    outside = tmp_path / "drops"
    outside.mkdir()
    valid = outside / "valid.kvckpt"
    shutil.copy2(source, valid)
    corrupt = outside / "corrupt.kvckpt"
    data = bytearray(valid.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    foreign = _foreign_checkpoint(gemma_path, outside / "gemma.kvckpt")
    text_file = outside / "notes.kvckpt"
    text_file.write_text("not a checkpoint")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    # the store no longer holds it (deleted by hand), so the valid file is really imported
    from engine.checkpoints import graph
    graph.delete_node(w.store, source)
    files_before = set(w.store.files())

    with qtbot.waitSignal(w.imports_finished, timeout=60_000) as done:
        event = _drop(w, [valid, corrupt, foreign, text_file])
    assert event.isAccepted()
    results = {Path(r.path).name: r for r in done.args[0]}
    assert results["valid.kvckpt"].imported is not None
    assert results["corrupt.kvckpt"].status == "corrupt" and "checksum" in results["corrupt.kvckpt"].reason
    assert results["gemma.kvckpt"].status == "incompatible"
    assert "model" in results["gemma.kvckpt"].reason
    assert results["notes.kvckpt"].status == "not a checkpoint"
    new_files = set(w.store.files()) - files_before
    assert new_files == {results["valid.kvckpt"].imported}            # nothing else imported
    assert results["valid.kvckpt"].imported.name == "valid.kvckpt"     # it keeps its name when free
    assert verify_file(results["valid.kvckpt"].imported)
    # the same file dropped again is recognised (checkpoint id and CRC): no second copy
    with qtbot.waitSignal(w.imports_finished, timeout=60_000) as again:
        _drop(w, [valid, valid])
    assert [r.already for r in again.args[0]] == [True, True]
    assert set(w.store.files()) - files_before == new_files
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before  # sources untouched
    assert w.resume_offer is not None                                  # the user is offered to resume
    assert w.resume_offer.text().startswith("The store already holds this checkpoint.")  # not "Imported 2"

    # the browser lists it, shows the status, and accepts drops as well
    browser = w.show_browser()
    qtbot.waitUntil(lambda: len(browser.model.rows) == len(w.store.files()), timeout=10_000)
    assert w.findChild(object, "checkpointBrowser") is browser.table
    assert all(r.status == "valid" for r in browser.model.rows)
    with qtbot.waitSignal(w.imports_finished, timeout=60_000) as done:
        _drop(browser.table.viewport(), [foreign])
    assert done.args[0][0].status == "incompatible"
    with qtbot.waitSignal(w.validation_finished, timeout=30_000) as checked:
        w.validate_checkpoint(results["valid.kvckpt"].imported)
    assert checked.args[0].ok

    # accepting the offer opens the imported checkpoint as a conversation
    imported = results["valid.kvckpt"].imported
    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=30_000) as opened:
        w.open_checkpoint(imported)
    assert opened.args[0].transcript[-1]["role"] == "assistant"


def test_close_during_generation_saves_and_restart_resumes(qtbot, make_window):
    w = make_window(n_predict=48)
    with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
        type_and_send(qtbot, w, PROMPT)
    conv_id = w.current
    with qtbot.waitSignal(w.bridge.engine_stopped, timeout=30_000):
        w.close()
        assert "Saving" in w.statusBar().currentMessage()
    qtbot.waitUntil(lambda: not w.isVisible(), timeout=5000)
    saved = [p for p in w.store.files() if read_header(p).conversation_id == conv_id]
    assert len(saved) == 1 and read_header(saved[0]).kind == KIND_EXIT
    assert verify_file(saved[0])
    partial = w.chat_view.answer_text()
    assert partial

    w2 = make_window(n_predict=48)
    # First, the reference: the same prompt and seed in one uninterrupted run, on a fresh
    # cache as the closed window had (a cache holding a longer sequence would be reused).
    reference_summary = run_to_end(qtbot, w2, PROMPT)
    reference = w2.chat_view.answer_text()
    assert reference_summary.n_reused_tokens == 0

    qtbot.waitUntil(lambda: w2.conversation_list.item_for(conv_id) is not None, timeout=10_000)
    assert w2.conversation_list.item_for(conv_id).text().startswith(PAUSED_MARK)
    with qtbot.waitSignal(w2.bridge.conversation_changed, timeout=30_000) as opened:
        w2.select_conversation(conv_id)
    assert opened.args[0].paused
    qtbot.waitUntil(lambda: w2.resume_button.isEnabled(), timeout=5000)
    assert w2.chat_view.answer_text() == partial
    with qtbot.waitSignal(w2.bridge.generation_finished, timeout=120_000) as fin:
        qtbot.mouseClick(w2.resume_button, Qt.MouseButton.LeftButton)
    summary = fin.args[0]
    assert summary.n_reused_tokens == summary.n_prompt_tokens and summary.n_generated > 0
    wait_saved(qtbot, w2)
    resumed = w2.chat_view.answer_text()
    assert resumed.startswith(partial) and len(resumed) > len(partial)

    assert resumed == reference


def test_pause_during_prefill_stops_at_once_and_resumes(qtbot, make_window):
    w = make_window(n_predict=6)
    long_prompt = "Summarise the following notes.\n\n" + "The shelves hold maps and ledgers. " * 90
    started = []
    w.bridge.generation_started.connect(started.append)
    with qtbot.waitSignal(w.bridge.generation_started, timeout=60_000):
        w.prompt_edit.setPlainText(long_prompt)
        qtbot.mouseClick(w.send_button, Qt.MouseButton.LeftButton)
    qtbot.wait(300)                                     # inside the first prefill chunk
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=30_000) as fin:
        qtbot.keyClick(w, Qt.Key.Key_Escape)            # Esc is Pause
    assert fin.args[0].finish_reason == "paused" and fin.args[0].n_generated == 0
    assert w.pause_latency_s < 2.0, w.pause_latency_s   # an aborted chunk, not a whole prefill
    _snap, path, _size, _secs, kind = wait_saved(qtbot, w)
    header = verify_file(path)
    assert kind == KIND_PAUSE and header.prefill_pending and header.n_tokens < header.n_tokens_total
    assert w.chat_view.answer_text() == ""
    qtbot.waitUntil(w.resume_button.isEnabled, timeout=5000)
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=120_000) as fin:
        qtbot.mouseClick(w.resume_button, Qt.MouseButton.LeftButton)
    assert fin.args[0].finish_reason in ("length", "stop") and fin.args[0].n_generated > 0
    assert fin.args[0].n_reused_tokens == header.n_tokens   # kept what the pause had decoded
    assert w.chat_view.answer_text()


def _files_of(store, conv_id) -> list[Path]:
    out = []
    for p in store.files():
        try:
            if read_header(p).conversation_id == conv_id:
                out.append(p)
        except FileNotFoundError:
            continue   # deleted between the listing and the read
    return out


def test_deleting_a_conversation_deletes_its_whole_history(qtbot, make_window):
    """Issue 9, case 3: a deleted conversation's chain files went nowhere, so it came back."""
    w = make_window(n_predict=24, autosave_every=4, temperature=0.0)
    run_to_end(qtbot, w, "Name five trees.")
    conv = w.current
    assert _files_of(w.store, conv)                      # the head (it absorbed its autosaves)
    # and an older autosave of it, as a crash leaves one behind
    from dataclasses import replace

    from engine.checkpoints import format as fmt
    raw = bytearray(Path(w.snapshots[conv].checkpoint).read_bytes())
    h = fmt.unpack_header(bytes(raw[:fmt.HEADER_LEN]), len(raw))
    raw[:fmt.HEADER_LEN] = fmt.pack_header(replace(h, kind=fmt.KIND_AUTOSAVE, created_unix_ns=1))
    (w.store.folder / f"autosave-{conv.hex[:12]}-00000000000000000001.kvckpt").write_bytes(bytes(raw))
    keep = w.conversation_list.count()
    w.new_conversation()
    run_to_end(qtbot, w, "Name two birds.")
    other = w.current
    w._delete(conv)                                      # what Delete… does after the question
    qtbot.waitUntil(lambda: _files_of(w.store, conv) == [], timeout=30_000)
    assert _files_of(w.store, other)                     # another conversation is untouched
    with qtbot.waitSignal(w.store_listed, timeout=30_000):
        w.refresh_store()
    ids = [w.conversation_list.item(i).data(Qt.ItemDataRole.UserRole)
           for i in range(w.conversation_list.count())]
    assert conv not in ids and other in ids and len(ids) == keep


def test_dropping_a_delta_without_its_parents_offers_its_chain(qtbot, make_window, tmp_path):
    """Issue 9, case 5, in the window: refused with the reason, then "Import its chain"."""
    from engine.checkpoints import graph
    w = make_window(n_predict=400, autosave_every=4, temperature=0.0)
    # a paused answer: its head is a delta on its first autosave (a finished answer's head
    # absorbs its chain)
    with qtbot.waitSignal(w.bridge.checkpoint_saved, timeout=60_000):
        type_and_send(qtbot, w, "Count to one hundred, one number per line.")
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=30_000):
        qtbot.mouseClick(w.pause_button, Qt.MouseButton.LeftButton)
    wait_saved(qtbot, w)
    head = Path(w.snapshots[w.current].checkpoint)
    chain = graph.Graph.scan(w.store)
    files = [n.path for n in chain.chain(chain.nodes[head.name])]
    assert len(files) >= 2 and read_header(head).is_delta
    elsewhere = tmp_path / "usb stick"
    elsewhere.mkdir()
    for p in files:
        shutil.copy2(p, elsewhere / p.name)
    w._delete(w.current)
    qtbot.waitUntil(lambda: w.store.files() == [], timeout=30_000)

    with qtbot.waitSignal(w.message_shown, timeout=60_000) as shown:
        _drop(w, [elsewhere / head.name])
    assert "parent" in shown.args[1] and "Import its chain" in [b.text() for b in w.chain_offer.buttons()]
    assert w.store.files() == []
    with qtbot.waitSignal(w.imports_finished, timeout=60_000) as done:
        w.chain_offer.buttons()[0].click()
    assert all(r.ok for r in done.args[0]) and len(done.args[0]) == len(files)
    assert sorted(p.name for p in w.store.files()) == sorted(p.name for p in files)
    assert graph.Graph.scan(w.store).heads[0].name == head.name


def test_dropping_a_backup_of_an_older_state_lists_it_and_resumes_it(qtbot, make_window, tmp_path):
    """A backed-up file the store still holds, but as no head (an older state: the
    conversation went on, and a paused answer's files build on it), dropped again: "already
    in the store", and a head of that state is written, which the resume offer opens
    (engine.checkpoints.transfer, step 5).  It was never listed, and went with the
    conversation when that was deleted."""
    from engine.checkpoints import graph
    w = make_window(n_predict=400, autosave_every=4, temperature=0.0)
    run_to_end(qtbot, w, "Say hello.")
    first = w.snapshots[w.current]
    turn_end = Path(first.checkpoint)
    backup = tmp_path / "backup"
    backup.mkdir()
    shutil.copy2(turn_end, backup / turn_end.name)
    # a second answer, paused: its autosaves build on the first turn's file
    with qtbot.waitSignal(w.bridge.checkpoint_saved, timeout=60_000):
        type_and_send(qtbot, w, "Count to one hundred, one number per line.")
    with qtbot.waitSignal(w.bridge.generation_finished, timeout=30_000):
        qtbot.mouseClick(w.pause_button, Qt.MouseButton.LeftButton)
    wait_saved(qtbot, w)
    g = graph.Graph.scan(w.store)
    assert turn_end.name in g.nodes and not g.is_head(g.nodes[turn_end.name])

    with qtbot.waitSignal(w.imports_finished, timeout=60_000) as done:
        _drop(w, [backup / turn_end.name])
    (result,) = done.args[0]
    assert result.ok and result.already and result.head is not None, result.message()
    g = graph.Graph.scan(w.store)
    assert g.is_head(g.nodes[result.head.name])
    assert [n.name for n in g.chain(g.nodes[result.head.name])][-2:] == [turn_end.name, result.head.name]
    # "Resume": the window shows the conversation as the backup held it, from that head
    assert w.resume_offer is not None and result.head.name in w.resume_offer.text()
    assert "already holds" in w.resume_offer.text()
    with qtbot.waitSignal(w.bridge.conversation_changed, timeout=30_000,
                          check_params_cb=lambda snap: snap.checkpoint == result.head):
        w.resume_offer.buttons()[0].click()
    shown = w.snapshots[first.id]
    assert shown.transcript == first.transcript and shown.n_tokens == first.n_tokens


def test_ctrl_c_in_the_terminal_closes_the_window_saving_the_answer(qtbot, make_window):
    import os
    import signal

    from gui.app import close_on_terminal_signals
    w = make_window(n_predict=200)
    before = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGINT", "SIGTERM")}
    try:
        close_on_terminal_signals(w)
        with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
            type_and_send(qtbot, w, PROMPT)
        conv_id = w.current
        with qtbot.waitSignal(w.bridge.engine_stopped, timeout=30_000):
            os.kill(os.getpid(), signal.SIGINT)
        assert w.state.closing
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
    saved = [p for p in w.store.files() if read_header(p).conversation_id == conv_id
             and read_header(p).kind == KIND_EXIT]
    assert saved and verify_file(saved[-1])


def test_failing_autosaves_are_said_once_then_in_the_status_line(qtbot, make_window):
    """A full or failing disk fails every autosave: one box says so, the status line
    says it after that (not a box per autosave interval)."""
    from engine.commands import Action
    w = make_window()
    shown = []
    w.message_shown.connect(lambda title, text: shown.append(title))
    for _ in range(3):
        w.bridge.engine_failed.emit(Action.AUTOSAVE, "could not save: No space left on device", w.current)
    assert shown == [f"Could not {Action.AUTOSAVE}"]
    assert w.checkpoint_label.text().startswith("Autosave failed")
    assert "No space left" in w.checkpoint_label.toolTip()


def test_a_background_conversations_failure_is_said_as_its_own(qtbot, make_window):
    """An autosave of a conversation answering in the background fails: the box names that
    conversation, the shown one's status line is left alone (until its own fail: no second
    box), and the failing one says it once it is shown again."""
    from engine.commands import Action
    w = make_window(n_predict=8)
    run_to_end(qtbot, w, "Name two birds.")
    first = w.current
    title = w.snapshots[first].title
    w.new_conversation()
    shown = []
    w.message_shown.connect(lambda title, text: shown.append(text))
    label = w.checkpoint_label.text()
    for _ in range(3):
        w.bridge.engine_failed.emit(Action.AUTOSAVE, "could not save: No space left on device", first)
    assert len(shown) == 1 and title in shown[0], shown
    assert w.checkpoint_label.text() == label
    w.bridge.engine_failed.emit(Action.AUTOSAVE, "could not save: Input/output error", w.current)
    assert len(shown) == 1                                # one full disk, one box
    assert w.checkpoint_label.text().startswith("Autosave failed")
    assert "Input/output" in w.checkpoint_label.toolTip()
    w.select_conversation(first)
    qtbot.waitUntil(lambda: w.checkpoint_label.text().startswith("Autosaves are failing"), timeout=30_000)
    assert "No space left" in w.checkpoint_label.toolTip()


def test_a_seed_set_in_the_settings_applies_to_the_empty_conversation_shown(qtbot, make_window, monkeypatch):
    """Settings › Seed 42, OK, then the first message in the blank conversation the window
    opened with: its answer used another seed (only new conversations took the settings)."""
    import gui.settings_dialog
    w = make_window(n_predict=4)

    class Dialog:
        model_changed = False

        def __init__(self, settings, _info, _parent) -> None:
            self.settings = settings

        def exec(self) -> bool:
            self.settings.seed = 42
            return True
    monkeypatch.setattr(gui.settings_dialog, "SettingsDialog", Dialog)
    w.open_settings()
    run_to_end(qtbot, w, "Hello")
    assert w.snapshots[w.current].seed == 42


def test_deleting_from_the_browser_asks_with_no_as_the_default(qtbot, make_window, monkeypatch):
    """Enter on the question deleted (Yes was its default): a deletion needs a click on Yes."""
    import gui.store_actions
    w = make_window(n_predict=4)
    run_to_end(qtbot, w, "Hello")
    (path,) = w.store.files()
    w.show_browser()
    asked = []

    def question(_parent, _title, text, _buttons, default):
        asked.append((text, default))
        return default
    monkeypatch.setattr(gui.store_actions.QMessageBox, "question", question)
    w._browser_delete(path)
    ((text, default),) = asked
    assert default == gui.store_actions.QMessageBox.StandardButton.No and path.name in text
    assert path.exists()


def test_new_conversation_again_keeps_one_empty_conversation(qtbot, make_window):
    """Each Ctrl+N added another empty "New conversation" to the list (under Wine)."""
    w = make_window(n_predict=4)
    new = w.findChild(object, "newButton")
    qtbot.mouseClick(new, Qt.MouseButton.LeftButton)
    first, count = w.current, w.conversation_list.count()
    qtbot.mouseClick(new, Qt.MouseButton.LeftButton)
    assert (w.current, w.conversation_list.count()) == (first, count)
    run_to_end(qtbot, w, "Hello")
    qtbot.mouseClick(new, Qt.MouseButton.LeftButton)
    assert w.current != first and w.conversation_list.count() == count + 1


def test_the_window_starts_on_the_model_it_is_given(qtbot, qapp, gemma_path):
    from enginekit import close_windows, record_saves, window_settings

    from gui.main_window import MainWindow
    from gui.tasks import ensure_event_loop
    ensure_event_loop(qapp)
    w = MainWindow(window_settings(n_predict=4))
    record_saves(w)
    try:
        w.show()
        with qtbot.waitSignal(w.bridge.model_loaded, timeout=60_000) as loaded:
            w.start(gemma_path)
        assert "gemma" in loaded.args[0].name.lower()
    finally:
        close_windows([w])
