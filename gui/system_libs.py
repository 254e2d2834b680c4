"""The Linux window's system libraries: which ones Qt lacks, named before Qt fails.

Qt's X11 platform plugin (``plugins/platforms/libqxcb.so``) and Qt's own libraries link
about twenty system libraries (libxcb-cursor0, libxcb-icccm4, libxcb-keysyms1,
libxkbcommon-x11-0, libEGL, fontconfig, ...) that a server or a minimal install lacks.
When one is missing, Qt aborts the process with a message that names only the cursor
library, whatever was missing ("From 6.5.0, xcb-cursor0 or libxcb-cursor0 is needed to
load the Qt xcb platform plugin"), so a user who installs it meets the next failure.

:func:`missing_libraries` asks the dynamic loader itself: ``ldd`` on the plugin resolves
every shared object the plugin and the Qt libraries under it need, transitively, with the
loader's own search (RUNPATH, ``LD_LIBRARY_PATH``, ld.so.cache, the default folders), and
prints ``=> not found`` for each one it cannot find — all of them, not only the first.
:func:`problem` turns them into one message with the command that installs them
(:func:`debian_package`: Debian's rule for naming a library's package).  gui.app calls it
before it creates the QApplication, on Linux only and only when Qt will use xcb
(:func:`will_use_xcb`); a check that cannot run (no ``ldd``, no plugin) says nothing and
Qt starts as before.  The OS is a set of parameters (``platform``, ``environ``, ``ldd``,
``os_release``), so tests make every lookup fail without touching the machine.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

log = logging.getLogger("gui")

_NOT_FOUND = re.compile(r"^\s*(\S+)\s+=>\s+not found\s*$", re.MULTILINE)
_SONAME = re.compile(r"^(lib.+?)\.so\.([0-9.]+)$")
#: libraries whose Debian package does not follow the naming rule
_PACKAGE_EXCEPTIONS = {"libglib-2.0.so.0": "libglib2.0-0", "libgthread-2.0.so.0": "libglib2.0-0",
                       "libgobject-2.0.so.0": "libglib2.0-0", "libgmodule-2.0.so.0": "libglib2.0-0"}
_DEBIAN_FAMILY = {"debian", "ubuntu"}


def will_use_xcb(platform: str = sys.platform, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether Qt is about to load its xcb (X11) platform plugin.

    ``QT_QPA_PLATFORM`` decides when set: a list of names separated by ``;``, each one
    possibly followed by ``:options``, tried in order (xcb counts when it comes first; a
    later one is only a fallback).  Unset, Qt on Linux tries Wayland first in a Wayland
    session and xcb otherwise.
    """
    if not platform.startswith("linux"):
        return False
    requested = environ.get("QT_QPA_PLATFORM", "").strip()
    if requested:
        return requested.split(";", 1)[0].split(":", 1)[0].strip() == "xcb"
    return environ.get("XDG_SESSION_TYPE", "") != "wayland"


def xcb_plugin() -> Path | None:
    """Qt's xcb platform plugin of the PySide6 this process would import, or None.

    Found from the package's folder without importing Qt (libQt6Gui itself needs some of
    the libraries this module looks for); QLibraryInfo only when that layout differs."""
    import importlib.util
    spec = importlib.util.find_spec("PySide6")
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        plugin = Path(folder) / "Qt" / "plugins" / "platforms" / "libqxcb.so"
        if plugin.is_file():
            return plugin
    try:
        from PySide6.QtCore import QLibraryInfo
    except ImportError:
        return None
    plugin = Path(QLibraryInfo.path(QLibraryInfo.LibraryPath.PluginsPath)) / "platforms" / "libqxcb.so"
    return plugin if plugin.is_file() else None


def run_ldd(path: Path) -> str | None:
    """``ldd PATH``'s output, or None when it cannot run."""
    try:
        done = subprocess.run(["ldd", str(path)], capture_output=True, text=True, timeout=20,
                              env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError) as exc:
        log.info("cannot check the window's system libraries (ldd: %s)", exc)
        return None
    return done.stdout


def missing_libraries(plugin: Path, ldd: Callable[[Path], str | None] = run_ldd) -> list[str] | None:
    """The shared objects ``plugin`` needs that the loader cannot find, in ldd's order
    without repeats; None when the check could not run."""
    output = ldd(plugin)
    if output is None:
        return None
    return list(dict.fromkeys(_NOT_FOUND.findall(output)))


def debian_package(soname: str) -> str:
    """The Debian/Ubuntu package that ships ``soname``, by Debian's policy (8.1): the
    library's name, lower case, then its SONAME version, joined by a hyphen when the
    name ends in a digit (libxcb-icccm.so.4: libxcb-icccm4; libdbus-1.so.3: libdbus-1-3)."""
    if soname in _PACKAGE_EXCEPTIONS:
        return _PACKAGE_EXCEPTIONS[soname]
    match = _SONAME.match(soname)
    if match is None:
        return soname
    name, version = match.group(1).lower(), match.group(2)
    return f"{name}-{version}" if name[-1].isdigit() else f"{name}{version}"


def read_os_release(path: Path = Path("/etc/os-release")) -> dict[str, str]:
    """The KEY=value pairs of os-release(5); empty when it cannot be read."""
    try:
        text = path.read_text("utf-8", "replace")
    except OSError:
        return {}
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip().strip("\"'") for key, value in pairs}


def install_hint(sonames: list[str], os_release: Mapping[str, str]) -> str:
    """How to install ``sonames`` on this system, as a command where we know it."""
    family = {os_release.get("ID", ""), *os_release.get("ID_LIKE", "").split()}
    packages = " ".join(dict.fromkeys(debian_package(name) for name in sonames))
    if family & _DEBIAN_FAMILY:
        return f"Install them with:\n    sudo apt install {packages}"
    return ("Install the packages of your distribution that provide them "
            f"(on Debian or Ubuntu: sudo apt install {packages}).")


def problem(platform: str = sys.platform, environ: Mapping[str, str] = os.environ,
            plugin: Callable[[], Path | None] = xcb_plugin,
            ldd: Callable[[Path], str | None] = run_ldd,
            os_release: Callable[[], Mapping[str, str]] = read_os_release) -> str | None:
    """Why the window cannot start on this system, with what to do; None when nothing
    is missing (or the check does not apply, or cannot run)."""
    if not will_use_xcb(platform, environ):
        return None
    path = plugin()
    if path is None:
        return None
    missing = missing_libraries(path, ldd)
    if not missing:
        return None
    return (f"Checkpoint Chat's window cannot start: Qt's X11 (xcb) platform plugin needs "
            f"system libraries that are missing: {', '.join(missing)}.\n"
            f"{install_hint(missing, os_release())}\n"
            "(The command line works without them: checkpoint-chat run --help.)")
