"""Take the README screenshots: ``python -m gui.screenshot_tour OUTDIR``.

Run it under a real display server (Xvfb on a headless machine, see FIELD_NOTES):

    xvfb-run -s "-screen 0 1400x900x24" python -m gui.screenshot_tour resources/screenshots

It uses a temporary app home, the default model, and drives the window as a user
would: an answer with code, a paused answer, and the checkpoint browser showing a
valid, a damaged and another model's checkpoint.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QEventLoop


def _wait(app, predicate, timeout: float = 300) -> None:
    # processEvents(flags, maxtime) leaks a reference to None in PySide6 6.12 and crashes
    # the interpreter after enough calls ("none_dealloc"): use the one-argument form.
    deadline = time.perf_counter() + timeout
    while not predicate():
        if time.perf_counter() > deadline:
            raise TimeoutError("screenshot tour step timed out")
        app.processEvents(QEventLoop.ProcessEventsFlag.WaitForMoreEvents)


def _settle(app, seconds: float = 0.5) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents)
        time.sleep(0.01)


def _libraries_missing() -> bool:
    """Say what the window needs before Qt loads, as the app does (Qt would abort naming one)."""
    from gui import system_libs
    missing = system_libs.problem()
    if missing:
        print(missing, file=sys.stderr)
    return bool(missing)


def _application():
    """The Qt application with the app's event loop (after the environment is set)."""
    from PySide6.QtWidgets import QApplication

    from gui.tasks import ensure_event_loop
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("Checkpoint Chat")
    ensure_event_loop(app)
    return app


def main(argv: list[str] | None = None) -> int:
    if _libraries_missing():
        return 1
    out = Path((argv or sys.argv[1:] or ["resources/screenshots"])[0]).resolve()
    out.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="cc-shots-"))
    os.environ["CHECKPOINT_CHAT_HOME"] = str(home)
    from gui.main_window import MainWindow
    from gui.settings import AppSettings

    app = _application()
    s = AppSettings()
    s.n_ctx, s.n_threads, s.seed, s.temperature, s.n_predict = 2048, 2, 11, 0.3, 160
    w = MainWindow(s)
    w.resize(1180, 760)
    w.show()
    w.start()
    _wait(app, lambda: w.bridge.model_info is not None)
    saved = []
    w.bridge.checkpoint_saved.connect(lambda *a: saved.append(a))

    def ask(text: str) -> None:
        w.prompt_edit.setPlainText(text)
        w.send()

    ask("How do I reverse a list in Python? Show a short code example.")
    _wait(app, lambda: w.running is None and saved)
    _settle(app)
    w.grab().save(str(out / "main-window.png"))

    w.new_conversation()
    n = len(saved)
    first = []
    w.bridge.tokens_generated.connect(lambda *a: first.append(a))
    ask("Write a short story about a lighthouse keeper who finds a message in a bottle.")
    _wait(app, lambda: len("".join(a[1] for a in first)) > 220)
    w.pause()
    _wait(app, lambda: w.running is None and len(saved) > n)
    _settle(app)
    w.grab().save(str(out / "paused-answer.png"))

    # the browser with a valid, a damaged and a foreign checkpoint
    good = Path(saved[-1][1])
    damaged = w.store.folder / "damaged-copy.kvckpt"
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    truncated = w.store.folder / "truncated-copy.kvckpt"
    truncated.write_bytes(bytes(data[: len(data) // 3]))
    # a checkpoint of another model: the same bytes under another fingerprint and title
    from dataclasses import replace

    from engine.checkpoints import format as fmt
    header = fmt.unpack_header(bytes(data[:fmt.HEADER_LEN]))
    foreign = bytearray(good.read_bytes())
    foreign[:fmt.HEADER_LEN] = fmt.pack_header(replace(
        header, model_fingerprint=b"another-model-01", title="Notes from another model"))
    (w.store.folder / "gemma-notes.kvckpt").write_bytes(bytes(foreign))
    browser = w.show_browser()
    browser.resize(1200, 360)
    _wait(app, lambda: len(browser.model.rows) >= 5)
    results = []
    w.validation_finished.connect(results.append)
    w.validate_checkpoint(damaged)
    _wait(app, lambda: bool(results))
    browser.select_path(good)
    _settle(app)
    browser.grab().save(str(out / "checkpoint-browser.png"))

    w._close_done = True
    w.worker.shutdown()
    w.worker.join(60)
    w.close()
    shutil.rmtree(home, ignore_errors=True)
    print("\n".join(str(p) for p in sorted(out.glob("*.png"))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
