"""Remote workers in the desktop app: the Settings row, a refusal told in the window,
and the model bar saying where the layers are (a real worker; the window in a child
process, because llama.cpp ends the process that loses a worker)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import ROOT
from enginekit import close_windows
from PySide6.QtWidgets import QLineEdit
from test_rpc import free_port
from test_rpc_loopback import Worker


def test_settings_row_sets_the_workers_and_reloads_the_model(qtbot):
    from gui.settings import AppSettings
    from gui.settings_dialog import SettingsDialog
    s = AppSettings()
    assert s.rpc_servers == ""
    dialog = SettingsDialog(s, None)
    qtbot.addWidget(dialog)
    field = dialog.findChild(QLineEdit, "rpcServers")
    field.setText("10.0.0.2:50052, 10.0.0.3:50052")
    dialog.accept()
    assert dialog.model_changed
    assert AppSettings().rpc_servers == "10.0.0.2:50052, 10.0.0.3:50052"


@pytest.fixture
def window(qtbot, qapp):
    from gui.main_window import MainWindow
    from gui.settings import AppSettings
    from gui.tasks import ensure_event_loop
    ensure_event_loop(qapp)
    made = []

    def make(**settings):
        s = AppSettings()
        s.n_ctx, s.n_threads = 512, 2
        for key, value in settings.items():
            setattr(s, key, value)
        w = MainWindow(s)
        w.shown_errors = []
        w.show_error = lambda title, text: w.shown_errors.append((title, text))
        made.append(w)
        return w

    yield make
    close_windows(made)


@pytest.mark.parametrize("servers, says", [
    ("nonsense", "malformed worker address 'nonsense'"),
    ("127.0.0.1:{port}", "nothing listens on 127.0.0.1:{port}"),
])
def test_a_worker_that_cannot_be_used_is_a_message_in_the_window(window, qtbot, servers, says):
    port = free_port()
    w = window(rpc_servers=servers.format(port=port), n_gpu_layers=999)
    with qtbot.waitSignal(w.bridge.model_failed, timeout=60_000):
        w.start()
    qtbot.waitUntil(lambda: bool(w.shown_errors), timeout=10_000)
    title, text = w.shown_errors[-1]
    assert title == "Could not load the model" and says.format(port=port) in text
    assert "No model loaded" in w.model_status.text()


_WINDOW = r"""
import sys
from PySide6.QtWidgets import QApplication
from engine import crashlog
crashlog.install()                    # as gui.app does
app = QApplication([])
from gui.main_window import MainWindow
from gui.settings import AppSettings
from gui.tasks import ensure_event_loop
ensure_event_loop(app)
chat = sys.argv[2] == "chat"
s = AppSettings()
s.n_ctx, s.n_threads, s.n_gpu_layers, s.rpc_servers = 2048, 2, 999, sys.argv[1]
s.autosave_every, s.n_predict, s.temperature = 8, 1500, 0.8
w = MainWindow(s)

def loaded(info):
    print("BAR " + w.model_status.text(), flush=True)
    if not chat:
        app.quit()
        return
    w.prompt_edit.setPlainText("Tell a very long story about a lighthouse.")
    w.send()

seen = [0]
def tokens(*args):
    seen[0] += 1
    if seen[0] == 1:
        print("GENERATING", flush=True)

w.bridge.model_loaded.connect(loaded)
w.bridge.tokens_generated.connect(tokens)
w.bridge.model_failed.connect(lambda message: (print("FAILED " + message, flush=True), app.quit()))
w.show()
w.start()
app.exec()
w.worker.shutdown()
w.worker.join(60)
"""


def test_the_model_bar_says_where_the_layers_are(tmp_path):
    worker = Worker(tmp_path)
    try:
        done = subprocess.run([sys.executable, "-c", _WINDOW, worker.endpoint, "bar"], capture_output=True,
                              text=True, timeout=180, cwd=str(ROOT))
    finally:
        worker.close()
    bar = [line for line in done.stdout.splitlines() if line.startswith(("BAR ", "FAILED "))]
    assert bar and bar[0].startswith("BAR "), done.stdout + done.stderr
    assert f"layers: 31 on {worker.endpoint}" in bar[0]


def test_the_window_losing_its_worker_mid_answer_ends_and_the_next_start_offers_the_autosave(
        tmp_path, app_home):
    """What llama.cpp allows: the app ends with one sentence; nothing saved is lost; the
    next start names the worker and has an autosave of the answer to offer."""
    from engine import crashlog
    from engine.checkpoints.store import Store
    worker = Worker(tmp_path)
    app = subprocess.Popen([sys.executable, "-c", _WINDOW, worker.endpoint, "chat"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, cwd=str(ROOT))
    try:
        for line in app.stdout:
            if line.startswith(("GENERATING", "FAILED")):
                break
        assert line.startswith("GENERATING"), line
        deadline = time.monotonic() + 60     # an autosave (every 8 tokens) before the kill
        while not list(Store().folder.glob("autosave-*.kvckpt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        worker.kill()
        out, err = app.communicate(timeout=60)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
        worker.close()
    assert app.returncode == 1 and "Traceback" not in err, err
    said = [line for line in err.splitlines() if line.startswith("Checkpoint Chat: ")]
    assert len(said) == 1 and said[0].startswith(f"Checkpoint Chat: the remote worker {worker.endpoint} ")
    reports = crashlog.pending_crashes(app_home / "log")
    assert reports[-1].excerpt.startswith(f"Fatal: the remote worker {worker.endpoint}")
    autosave = crashlog.newest_autosave(Store())
    assert autosave is not None
    from engine.checkpoints.chain import load_chain
    assert load_chain(autosave)[-1].header.n_generated > 0
