"""Desktop app entry point: ``checkpoint-chat-gui`` / ``checkpoint-chat gui``.

Sets up logging and the crash trace (engine.crashlog: a crash inside llama.cpp leaves
a trace, and the next start tells the user and offers the newest autosave), creates the QApplication with qasync as the asyncio event loop, and shows the
main window, which starts loading the default model at once.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from engine import crashlog, paths

log = logging.getLogger("gui")


def _setup_logging() -> None:
    folder = paths.log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.FileHandler(folder / "checkpoint-chat.log", encoding="utf-8"),
                                  logging.StreamHandler()])
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


def main(argv: list[str] | None = None) -> int:
    import qasync
    from PySide6.QtWidgets import QApplication

    from gui.main_window import MainWindow
    from gui.settings import AppSettings

    _setup_logging()
    crashes = crashlog.pending_crashes()   # before install(): our own trace file is not one
    crashlog.install()                     # a crash inside llama.cpp leaves a trace
    _warn_about_known_bad_qt()
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("Checkpoint Chat")
    app.setOrganizationName("CheckpointChat")
    app.setDesktopFileName("checkpoint-chat")
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    closed = asyncio.Event()
    app.aboutToQuit.connect(closed.set)

    window = MainWindow(AppSettings())
    window.show()
    window.start()
    # a double-clicked .kvckpt arrives as an argument: import it and offer to resume
    opened = [Path(a) for a in (argv or []) if a.lower().endswith(".kvckpt")]
    if opened:
        window.import_files(opened)
    if crashes:
        window.report_crash(crashes, crashlog.acknowledge(crashes), crashlog.newest_autosave(window.store))
    with loop:
        loop.run_until_complete(closed.wait())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
