"""Fast tests of the GUI's logic: layering, token batching, Markdown, listing speed."""

from __future__ import annotations

import re
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
IMPORT = re.compile(r"^\s*(?:from|import)\s+([\w.]+)", re.MULTILINE)


def _imports(folder: str) -> dict[str, set[str]]:
    out = {}
    for path in (ROOT / folder).rglob("*.py"):
        out[str(path.relative_to(ROOT))] = {m.split(".")[0] for m in IMPORT.findall(path.read_text("utf-8"))}
    return out


def test_engine_never_imports_qt():
    for path, mods in _imports("engine").items():
        assert not mods & {"PySide6", "qasync", "shiboken6"}, path


def test_gui_never_imports_native_or_llama_cpp():
    found = _imports("gui")
    assert "gui/main_window.py" in found
    for path, mods in found.items():
        assert not mods & {"native", "llama_cpp"}, path


def test_worker_imports_native_only_lazily():
    # module level of engine/worker.py must not pull in libllama (the UI thread imports it)
    text = (ROOT / "engine" / "worker.py").read_text("utf-8")
    top_level = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    assert not any(re.search(r"\b(native|llama_cpp|engine\.runtime|engine\.generation)\b", line)
                   for line in top_level), top_level


def test_bridge_batches_tokens_into_few_deliveries(qtbot):
    from engine.checkpoints.store import Store
    from engine.events import TextDelta
    from gui.bridge import EngineBridge
    bridge = EngineBridge(Store(Path("unused")))
    got = []
    bridge.tokens_generated.connect(lambda cid, text: got.append(text))
    cid = uuid.uuid4()
    listener = bridge.worker.listener
    for i in range(1000):              # as fast as an engine could ever produce them
        listener.emit(TextDelta(cid, f"{i} "))
    qtbot.waitUntil(lambda: "".join(got) == "".join(f"{i} " for i in range(1000)), timeout=2000)
    assert len(got) == 1               # one delivery, not a thousand


def test_markdown_renders_code_and_keeps_html_as_text(qapp):
    from PySide6.QtGui import QPalette, QTextCursor, QTextDocument

    from gui.markdown import DocWriter, Theme, parse
    doc = QTextDocument()
    writer = DocWriter(QTextCursor(doc), Theme.from_palette(QPalette()), lambda n: f"code:{n}")
    writer.write(parse("Hello **bold** <script>\n\n```python\nx = 1 < 2\n```\n- a\n- `b`"))
    text = doc.toPlainText()
    assert "Hello bold <script>" in text and "x = 1 < 2" in text and "`" not in text
    assert doc.find("bold").charFormat().fontWeight() >= 700
    assert writer.code == ["x = 1 < 2"]
    last = doc.lastBlock()                       # "- `b`": a list item in a monospace font
    assert last.text() == "b" and last.textList() is not None and last.textList().count() == 2
    assert last.begin().fragment().charFormat().fontFixedPitch()


def test_settings_round_trip(app_home):
    from gui.settings import AppSettings
    s = AppSettings()
    assert s.n_ctx == 4096 and s.seed == -1
    s.n_ctx, s.temperature = 1024, 0.3
    s.add_recent_model("/m/a.gguf")
    s.add_recent_model("/m/b.gguf")
    s.add_recent_model("/m/a.gguf")
    s.sync()
    again = AppSettings()
    assert again.n_ctx == 1024 and again.temperature == 0.3
    assert again.recent_models() == ["/m/a.gguf", "/m/b.gguf"]
    assert again.sampler().seed >= 0   # -1 means: a fresh random seed


def _tiny_checkpoint(path: Path, title: str) -> None:
    from engine.checkpoints.format import Header, write_sections
    h = Header(model_fingerprint=b"\x01" * 16, model_size=1, n_vocab=10, n_layer=1, n_head_kv=1,
               n_embd_head_k=8, n_embd_head_v=8, n_swa=0, n_ctx=64, type_k=1, type_v=1,
               flash_attn=False, kv_unified=True, n_seq_max=1, n_tokens=0, n_tokens_total=2,
               n_generated=0, created_unix_ns=time.time_ns(), conversation_id=uuid.uuid4(),
               library="test", title=title)
    with open(path, "wb") as f:
        write_sections(f, h, b"{}", np.array([1, 2], dtype=np.int32), None, b"")


def test_browser_lists_a_thousand_checkpoints_fast(tmp_path, qtbot):
    from engine.checkpoints.store import Store
    from gui.browser import CheckpointBrowser, list_rows
    store = Store(tmp_path)
    for i in range(1000):
        _tiny_checkpoint(tmp_path / f"c{i:04d}.kvckpt", f"conversation {i}")
    (tmp_path / "broken.kvckpt").write_bytes(b"\x89KVC\r\n\x1a\n" + b"\0" * 10)
    started = time.perf_counter()
    rows = list_rows(store, None)
    browser = CheckpointBrowser()
    qtbot.addWidget(browser)
    browser.set_rows(rows, None)
    elapsed = time.perf_counter() - started
    assert len(rows) == 1001 and elapsed < 1.0, elapsed
    assert sum(r.status == "corrupt" for r in rows) == 1
    browser.filter_edit.setText("conversation 99")
    assert browser.proxy.rowCount() == 11      # 99, 990..999


def test_pyside_keeps_singleton_refcounts(qapp):
    """PySide6 6.12.0 on Python 3.11 drops a reference to True on every Signal.emit() and
    to None on every processEvents(); after a few thousand the interpreter aborts
    ("bool_dealloc").  The app emits a signal per token batch, so such a build must not ship."""
    import sys

    from PySide6.QtCore import QObject, Signal

    class Emitter(QObject):
        fired = Signal(object, str, int)

    e = Emitter()
    e.fired.connect(lambda *a: None)
    before_true, before_none = sys.getrefcount(True), sys.getrefcount(None)
    for _ in range(200):
        e.fired.emit(None, "x", 1)
        qapp.processEvents()
    assert sys.getrefcount(True) - before_true > -50, "Signal.emit leaks references to True"
    assert sys.getrefcount(None) - before_none > -50, "processEvents leaks references to None"


def test_chat_view_appends_turns_without_losing_or_reordering_text(qtbot):
    from gui.chat_view import ChatView
    view = ChatView()
    qtbot.addWidget(view)
    view.set_transcript([])
    for turn in range(3):
        view.begin_answer(f"question {turn}")
        for piece in ("answer ", f"number {turn} ", "with `code`"):
            view.append_text(piece)
        view.finish_answer(complete=turn < 2, note="Paused · saved 1 MB" if turn == 2 else "")
    text = view.toPlainText()
    order = [text.index(s) for s in ("question 0", "answer number 0", "question 1",
                                     "answer number 1", "question 2", "answer number 2")]
    assert order == sorted(order)
    assert text.count("Copy") == 6 and "Paused · saved 1 MB" in text
    assert "`" not in text                      # Markdown applied once the answer stopped
    # the incremental document equals a full render of the same messages
    incremental = text
    view.render()
    assert view.toPlainText().split() == incremental.split()


def test_the_sampler_follows_the_model_unless_the_user_set_it(app_home):
    from engine.sampling import BUNDLED_MODEL_DEFAULTS, GENERIC_DEFAULTS
    from gui.settings import AppSettings
    s = AppSettings()
    assert s.temperature is None                                   # unset: the model's
    got = s.sampler(BUNDLED_MODEL_DEFAULTS)
    assert (got.temperature, got.top_p, got.repeat_penalty) == (0.7, 0.9, 1.1)
    s.temperature = 0.25
    got = s.sampler(GENERIC_DEFAULTS)
    assert got.temperature == 0.25 and got.top_p == GENERIC_DEFAULTS.top_p
    s.temperature = None                                           # "Use the model's defaults"
    assert AppSettings().sampler(GENERIC_DEFAULTS).temperature == GENERIC_DEFAULTS.temperature


def test_the_window_started_by_checkpoint_chat_writes_its_log_file(app_home):
    """`checkpoint-chat` with no command configured the console's logging, then handed over
    to the window, whose own configuration then did nothing: checkpoint-chat.log stayed empty
    (a user's Troubleshooting and the installer's checks read it)."""
    import logging

    import gui.app
    from engine import cli, paths
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level

    def window(_argv) -> int:
        gui.app._setup_logging()
        logging.getLogger("engine").info("the window started")
        return 0
    try:
        assert cli.main([], gui_main=window) == 0
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "the window started" in (paths.log_dir() / "checkpoint-chat.log").read_text(encoding="utf-8")


def test_an_answer_limit_of_0_is_none(qtbot, app_home):
    """"Answer limit" 0 gave empty answers (no word why): its lowest value shows "none" and
    is stored as no limit; a limit shows and is stored as itself."""
    from gui.settings import AppSettings
    from gui.settings_dialog import SettingsDialog
    s = AppSettings()
    assert s.n_predict == -1
    dialog = SettingsDialog(s, None)
    qtbot.addWidget(dialog)
    box = dialog.fields["n_predict"]
    assert box.value() == box.minimum() == 0 and box.text() == "none"
    dialog.accept()
    assert AppSettings().n_predict == -1
    s.n_predict = 64
    dialog = SettingsDialog(s, None)
    qtbot.addWidget(dialog)
    assert dialog.fields["n_predict"].value() == 64
    dialog.fields["n_predict"].setValue(0)
    dialog.accept()
    assert AppSettings().n_predict == -1
    s.qsettings.setValue("n_predict", 0)   # stored by the app before: read as none too
    assert AppSettings().n_predict == -1


def test_the_settings_fit_a_low_screen_and_scroll(qtbot, app_home):
    """Taller than a 900-pixel screen less its bars, the form was squeezed and its wrapped lines
    cut in half (under Xvfb): it scrolls instead, the buttons below it."""
    from PySide6.QtWidgets import QDialogButtonBox, QScrollArea

    from gui.settings import AppSettings
    from gui.settings_dialog import SettingsDialog
    dialog = SettingsDialog(AppSettings(), None)
    qtbot.addWidget(dialog)
    scroll = dialog.findChild(QScrollArea)
    assert scroll is not None and scroll.widget().isAncestorOf(dialog.fields["n_predict"])
    assert not scroll.isAncestorOf(dialog.findChild(QDialogButtonBox))
    assert dialog.sizeHint().height() <= dialog.screen().availableGeometry().height()


def test_the_window_opens_on_a_model_given_on_the_command_line(app_home, tmp_path):
    """`checkpoint-chat MODEL.gguf` and `checkpoint-chat gui -m MODEL.gguf` open the window on
    that model (there was no way: "invalid choice", "unrecognized arguments"), kept as File ›
    Open Model keeps it; a name that is no file is not kept (the window says why it did not
    load)."""
    import gui.app
    from engine import cli
    from gui.settings import AppSettings
    handed = []
    assert cli.main(["model.gguf"], gui_main=lambda argv: handed.append(argv) or 0) == 0
    assert cli.main(["gui", "-m", "other.gguf"], gui_main=lambda argv: handed.append(argv) or 0) == 0
    assert handed == [["model.gguf"], ["other.gguf"]]
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    assert gui.app.settings_opening(model).model_path == str(model)
    assert AppSettings().recent_models()[0] == str(model)
    assert gui.app.settings_opening(tmp_path / "gone.gguf").model_path == str(model)   # not kept
