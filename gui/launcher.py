"""The ``checkpoint-chat`` command: the CLI's subcommands, or the desktop app without one.

Lives in gui/ because it may start the window; it imports no Qt itself (a ``run`` never
pays for loading Qt), and engine/ never imports gui/.
"""

from __future__ import annotations

import sys


def _start_gui(argv: list[str]) -> int:
    from gui.app import main
    return main(argv)


def main(argv: list[str] | None = None) -> int:
    from engine.cli import main as cli_main
    argv = sys.argv[1:] if argv is None else list(argv)
    return cli_main(argv, gui_main=_start_gui)


if __name__ == "__main__":
    sys.exit(main())
