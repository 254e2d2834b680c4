"""Windows' rules for a mapped file, on Linux: for tests that compose many actions in-process.

On Windows a restore maps its files (engine.checkpoints.mapped, ``PINS_FILES``), and while
a mapping lasts the file can be neither replaced (WinError 5) nor deleted (WinError 32).
The Wine tier proves that on Windows' own file semantics, one flow at a time; this puts
the same refusals on Linux so that random sequences of user actions (faultkit.compositions)
show a mapping that outlives its restore as what it would be on Windows: a save that fails
after its retries, a file that pruning cannot delete.

:func:`install` (given pytest's monkeypatch) makes every state mapped as on Windows and
returns the :class:`Pins` that follow the mappings; it replaces ``atomic.replace``,
``os.unlink`` and ``os.remove`` in this process (CLI children are not affected).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

from engine.checkpoints import atomic, mapped


class Pins:
    """The files mapped now, and what was refused because of them."""

    def __init__(self) -> None:
        self._maps: list[tuple[str, weakref.ref]] = []
        self.refused: list[tuple[str, str]] = []   # (what, file name)

    def add(self, fileno: int, mapping) -> None:
        self._maps.append((os.path.realpath(f"/proc/self/fd/{fileno}"), weakref.ref(mapping)))

    def live(self) -> set[str]:
        """Paths of the files with a mapping still open."""
        alive = [(p, r) for p, r in self._maps if (m := r()) is not None and not m.closed]
        self._maps = alive
        return {p for p, _r in alive}

    def check(self, what: str, path, winerror: int) -> None:
        target = os.path.realpath(path)
        if target in self.live():
            self.refused.append((what, Path(target).name))
            exc = PermissionError(13, f"[WinError {winerror}] the file is mapped (emulated)", str(path))
            exc.winerror = winerror  # type: ignore[attr-defined]
            raise exc


def install(monkeypatch) -> Pins:
    pins = Pins()
    monkeypatch.setattr(mapped, "PINS_FILES", True)
    real_map, real_replace, real_unlink = mapped.map_file, atomic.replace, os.unlink

    def map_file(fileno, size, state_len, releasable):
        mapping = real_map(fileno, size, state_len, releasable)
        if mapping is not None:
            pins.add(fileno, mapping)
        return mapping

    def replace(src, dst):
        pins.check("replace", dst, 5)
        return real_replace(src, dst)

    def unlink(path, *args, **kwargs):
        pins.check("delete", path, 32)
        return real_unlink(path, *args, **kwargs)
    monkeypatch.setattr(mapped, "map_file", map_file)
    monkeypatch.setattr(atomic, "replace", replace)
    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "remove", unlink)
    return pins
