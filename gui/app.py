"""Desktop app entry point: ``checkpoint-chat-gui`` / ``checkpoint-chat gui``.

Sets up logging and faulthandler in the log folder (a crash inside llama.cpp leaves a
trace), creates the QApplication with qasync as the asyncio event loop, and shows the
main window, which starts loading the default model at once.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import sys

from engine import paths

log = logging.getLogger("gui")
_crash_file = None   # kept open for the life of the process, for faulthandler


def _setup_logging() -> None:
    global _crash_file
    folder = paths.log_dir()
    folder.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        handlers=[logging.FileHandler(folder / "checkpoint-chat.log", encoding="utf-8"),
                                  logging.StreamHandler()])
    logging.getLogger("native.llama").setLevel(logging.ERROR)
    crash_path = folder / "crash.log"
    if crash_path.is_file() and crash_path.stat().st_size:
        # keep the previous run's trace: opening crash.log for this run would erase it
        previous = folder / "crash-previous.log"
        crash_path.replace(previous)
        log.warning("the previous run crashed; its trace is in %s", previous)
    _crash_file = open(crash_path, "w", encoding="utf-8")
    faulthandler.enable(_crash_file)


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
    _warn_about_known_bad_qt()
    app = QApplication.instance() or QApplication([sys.argv[0], *(argv or [])])
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
    with loop:
        loop.run_until_complete(closed.wait())
    if _crash_file is not None:
        faulthandler.disable()
        _crash_file.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
