"""Desktop app entry point: ``checkpoint-chat-gui`` / ``checkpoint-chat gui``.

Sets up logging; on Linux, names the system libraries Qt's X11 plugin lacks and stops
before Qt would abort with a message naming only one of them (gui.system_libs); sets up
the crash trace (engine.crashlog: a crash inside llama.cpp leaves
a trace, and the next start tells the user and offers the newest autosave), creates the
QApplication with qasync as the asyncio event loop, gives it the app's icon (every
window inherits it), and shows the main window, which starts loading the default model
at once.  A session end (sign-out, shutdown, an installer's Restart Manager) pauses and
saves through gui.session_end, since no closeEvent runs then.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from engine import crashlog, paths
from gui import system_libs

log = logging.getLogger("gui")

#: resources/icons/checkpoint-chat-N.png, generated from resources/checkpoint-chat.svg
#: by resources/make_icons.py.
ICON_SIZES = (16, 24, 32, 48, 64, 128, 256)


def icon_files() -> list[Path]:
    """The icon's PNG files that exist, smallest first (a frozen app has them too)."""
    import resources
    folder = Path(resources.__file__).resolve().parent / "icons"
    return [p for p in (folder / f"checkpoint-chat-{n}.png" for n in ICON_SIZES) if p.is_file()]


def app_icon():
    """Checkpoint Chat's icon, every size, for the application and its windows."""
    from PySide6.QtGui import QIcon
    icon = QIcon()
    for path in icon_files():
        icon.addFile(str(path))
    if icon.isNull():
        log.warning("the app's icon files are missing; run resources/make_icons.py")
    return icon


def configure_application(app) -> None:
    """Names (settings, the Linux desktop entry) and the icon every window inherits."""
    app.setApplicationName("Checkpoint Chat")
    app.setOrganizationName("CheckpointChat")
    app.setDesktopFileName("checkpoint-chat")
    app.setWindowIcon(app_icon())


def _setup_logging() -> None:
    folder = paths.log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # force: `checkpoint-chat` (engine.cli) configured the console's logging before it handed
    # over to the window, and a second basicConfig did nothing: the log file stayed empty
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.FileHandler(folder / "checkpoint-chat.log", encoding="utf-8"),
                                  logging.StreamHandler()], force=True)
    # llama.cpp logs a paused prefill as errors; failures reach the user through our own messages
    logging.getLogger("native.llama").setLevel(logging.CRITICAL)


def _warn_about_known_bad_qt() -> None:
    """PySide6 6.12.0 under Python < 3.12 under-counts references to True/None on every
    Signal.emit() / processEvents(); a long chat would abort the process."""
    import PySide6
    if PySide6.__version__ == "6.12.0" and sys.version_info < (3, 12):
        log.error("PySide6 6.12.0 with Python %d.%d has a reference-count bug that crashes "
                  "long sessions; install PySide6-Essentials 6.11.3 or use Python 3.12+",
                  *sys.version_info[:2])


def settings_opening(model: Path | None):
    """The app's settings, ``model`` (given on the command line) kept as the model to load
    when it is a file, as File › Open Model keeps it."""
    from gui.settings import AppSettings
    settings = AppSettings()
    if model is not None and model.is_file():
        settings.model_path = str(model)
        settings.add_recent_model(str(model))
    return settings


def close_on_terminal_signals(window, signals=signal):
    """Ctrl+C (SIGINT) or SIGTERM sent to the process showing ``window`` closes it as its
    own close button does — every running answer paused and saved, "Saving…" shown — and
    a second one leaves at once.  Python runs a signal handler only between bytecodes and
    Qt's loop runs none while idle, so a 250 ms timer lets the handler in; the timer is
    returned (keep it).  ``signals``: the module, a parameter for tests."""
    from PySide6.QtCore import QTimer

    def handler(signum, _frame) -> None:
        if window.state.closing:
            os._exit(128 + signum)
        QTimer.singleShot(0, window.close)

    for name in ("SIGINT", "SIGTERM"):
        if hasattr(signals, name):
            signals.signal(getattr(signals, name), handler)
    wake = QTimer(window)
    wake.timeout.connect(lambda: None)
    wake.start(250)
    return wake


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    missing = system_libs.problem()        # before Qt loads: it would abort naming one library
    if missing:
        log.error("%s", missing)
        return 1

    import qasync
    from PySide6.QtWidgets import QApplication

    from gui import single_instance
    from gui.main_window import MainWindow
    from gui.session_end import SessionEndSaver

    crashes = crashlog.pending_crashes()   # before install(): our own trace file is not one
    crashlog.install()                     # a crash inside llama.cpp leaves a trace
    _warn_about_known_bad_qt()
    app = QApplication.instance() or QApplication([sys.argv[0]])
    configure_application(app)
    # a double-clicked .kvckpt arrives as an argument: import it and offer to resume; when
    # the app already runs, that instance does it (the model is not loaded twice)
    opened = [Path(a) for a in (argv or []) if a.lower().endswith(".kvckpt")]
    # a model given (`checkpoint-chat model.gguf`, `checkpoint-chat gui -m model.gguf`) is
    # opened as File › Open Model opens one: kept in the settings when it is a file
    models = [Path(a).resolve() for a in (argv or []) if a.lower().endswith(".gguf")]
    if single_instance.hand_over(opened):
        if models:
            log.warning("Checkpoint Chat is already running: open %s there (File › Open Model)", models[-1])
        return 0
    instance = single_instance.InstanceServer(parent=app)
    instance.listen()
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    closed = asyncio.Event()
    app.aboutToQuit.connect(closed.set)

    model = models[-1] if models else None
    window = MainWindow(settings_opening(model))
    session_end = SessionEndSaver(window, parent=window)     # sign-out, shutdown, upgrade
    session_end.connect_to(app)
    close_on_terminal_signals(window)                        # Ctrl+C in the terminal that started it
    instance.files_received.connect(lambda files: single_instance.bring_forward(window, files))
    window.show()
    window.start(model)   # (a model that is no file: the window says why it did not load)
    if opened:
        window.import_files(opened)
    if crashes:
        window.report_crash(crashes, crashlog.acknowledge(crashes), crashlog.newest_autosave(window.store))
    with loop:
        loop.run_until_complete(closed.wait())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
