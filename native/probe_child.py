"""The probe's child: ``python -m native.probe_child FOLDER`` loads the library in FOLDER.

It runs :func:`native.library.bindings`, the very function the app loads with, printing
one JSON line ``{"stage": NAME}`` before each stage (flushed) and one final line
``{"ok": ..., "reason": ...}``; :mod:`native.probe` starts it and reads what it said.
In a frozen app there is no ``python -m``: the executables call :func:`run_if_probe`
first (installer/launch_cli.py, installer/launch_gui.py).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from native import library
from native.errors import LibraryError
from native.probe import FROZEN_PROBE_ARG


def _say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(folder_arg: str) -> int:
    """Load ``folder_arg``'s library, announcing each stage; 0 whatever the answer."""
    try:
        choice = library.LibraryChoice(library.absolute(Path(folder_arg)), "probe")
        ll = library.bindings(choice, probe=False, stage=lambda name: _say(stage=name))
        loaded = library.loaded_library()
        _say(ok=True, version=loaded.version, devices=[d.__dict__ for d in loaded.devices],
             system_info=ll.llama_print_system_info().decode("utf-8", "replace"))
    except LibraryError as exc:
        _say(ok=False, reason=str(exc))
    return 0


def run_if_probe(argv: Sequence[str]) -> int | None:
    """The frozen executables' first step: run the probe and return its status, or None."""
    if len(argv) == 2 and argv[0] == FROZEN_PROBE_ARG:
        return main(argv[1])
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
