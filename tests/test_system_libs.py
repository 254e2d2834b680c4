"""The Linux window's system libraries (gui.system_libs): every missing one named, with
the command that installs it, before Qt aborts naming only libxcb-cursor0.

Fast tests inject ldd's answer, the platform and os-release; the last tests ask the real
loader about the real libqxcb.so of the PySide6 installed here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gui import system_libs
from gui.system_libs import debian_package, install_hint, missing_libraries, problem, will_use_xcb

PLUGIN = Path("/opt/qt/plugins/platforms/libqxcb.so")

# ldd's output on a bare Debian 12 (abridged): two libraries missing, each listed once per
# library that needs it
LDD_BARE = """\
\tlinux-vdso.so.1 (0x00007ffd5c9f2000)
\tlibQt6XcbQpa.so.6 => /opt/qt/lib/libQt6XcbQpa.so.6 (0x00007f0b7a200000)
\tlibxcb-cursor.so.0 => /lib/x86_64-linux-gnu/libxcb-cursor.so.0 (0x00007f0b7a1f0000)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\tlibEGL.so.1 => /lib/x86_64-linux-gnu/libEGL.so.1 (0x00007f0b7a1e0000)
\tlibxcb-icccm.so.4 => not found
\tlibxcb-keysyms.so.1 => not found
\t/lib64/ld-linux-x86-64.so.2 (0x00007f0b7a900000)
"""
LDD_COMPLETE = "\n".join(line for line in LDD_BARE.splitlines() if "not found" not in line)
DEBIAN = {"ID": "debian", "VERSION_ID": "12"}


def _problem(ldd_output, *, environ=None, os_release=DEBIAN, platform="linux"):
    asked = []

    def ldd(path):
        asked.append(path)
        return ldd_output

    message = problem(platform=platform, environ={} if environ is None else environ,
                      plugin=lambda: PLUGIN, ldd=ldd, os_release=lambda: os_release)
    return message, asked


def test_every_missing_library_is_named_once_with_the_apt_command():
    message, asked = _problem(LDD_BARE)
    assert asked == [PLUGIN]
    assert "libxcb-icccm.so.4, libxcb-keysyms.so.1." in message
    assert "sudo apt install libxcb-icccm4 libxcb-keysyms1\n" in message
    assert "libxcb-cursor" not in message          # present: not blamed, unlike Qt's message


def test_nothing_missing_says_nothing():
    assert _problem(LDD_COMPLETE) == (None, [PLUGIN])


def test_a_check_that_cannot_run_lets_qt_start():
    assert _problem(None)[0] is None                                     # no ldd
    assert problem(platform="linux", environ={}, plugin=lambda: None,    # no plugin
                   ldd=lambda p: LDD_BARE, os_release=lambda: DEBIAN) is None


@pytest.mark.parametrize("platform, environ, expected", [
    ("linux", {}, True),
    ("linux", {"QT_QPA_PLATFORM": "xcb"}, True),
    ("linux", {"QT_QPA_PLATFORM": "xcb:no_glx;offscreen"}, True),
    ("linux", {"QT_QPA_PLATFORM": "offscreen"}, False),
    ("linux", {"QT_QPA_PLATFORM": "wayland;xcb"}, False),
    ("linux", {"XDG_SESSION_TYPE": "wayland"}, False),
    ("linux", {"XDG_SESSION_TYPE": "x11"}, True),
    ("linux", {"XDG_SESSION_TYPE": "wayland", "QT_QPA_PLATFORM": "xcb"}, True),
    ("win32", {}, False),
    ("darwin", {}, False),
])
def test_only_when_qt_will_use_xcb(platform, environ, expected):
    assert will_use_xcb(platform, environ) is expected
    assert (_problem(LDD_BARE, environ=environ, platform=platform)[1] == [PLUGIN]) is expected


@pytest.mark.parametrize("soname, package", [
    ("libxcb-cursor.so.0", "libxcb-cursor0"),
    ("libxcb-icccm.so.4", "libxcb-icccm4"),
    ("libxcb-keysyms.so.1", "libxcb-keysyms1"),
    ("libxcb-render-util.so.0", "libxcb-render-util0"),
    ("libxkbcommon-x11.so.0", "libxkbcommon-x11-0"),
    ("libdbus-1.so.3", "libdbus-1-3"),
    ("libEGL.so.1", "libegl1"),
    ("libGL.so.1", "libgl1"),
    ("libfontconfig.so.1", "libfontconfig1"),
    ("libX11-xcb.so.1", "libx11-xcb1"),
    ("libglib-2.0.so.0", "libglib2.0-0"),
])
def test_debian_package_names(soname, package):
    assert debian_package(soname) == package


def test_other_distributions_get_the_names_and_the_debian_command_as_an_example():
    hint = install_hint(["libxcb-icccm.so.4"], {"ID": "fedora"})
    assert "packages of your distribution" in hint and "sudo apt install libxcb-icccm4" in hint
    assert install_hint(["libxcb-icccm.so.4"], {"ID": "linuxmint", "ID_LIKE": "ubuntu debian"}) \
        .startswith("Install them with:\n    sudo apt install libxcb-icccm4")


def test_os_release_is_read(tmp_path):
    path = tmp_path / "os-release"
    path.write_text('PRETTY_NAME="Debian GNU/Linux 12 (bookworm)"\nID=debian\n# comment\n')
    assert system_libs.read_os_release(path)["ID"] == "debian"
    assert system_libs.read_os_release(tmp_path / "missing") == {}


def test_the_app_stops_before_qt_and_says_why(monkeypatch, caplog):
    import gui.app
    monkeypatch.setattr(system_libs, "problem", lambda: "the window cannot start: libxcb-icccm.so.4")
    started = []
    monkeypatch.setattr(gui.app, "_setup_logging", lambda: started.append("logging"))   # no global handlers
    monkeypatch.setattr(gui.app.crashlog, "install", lambda *a: started.append("crash trace"))
    with caplog.at_level("ERROR", logger="gui"):
        assert gui.app.main([]) == 1
    assert "libxcb-icccm.so.4" in caplog.text
    assert started == ["logging"]             # logged, and stopped before the crash trace and the window


def test_the_screenshot_tour_stops_before_qt_and_says_why(monkeypatch, capsys, tmp_path):
    """The developers' tour (python -m gui.screenshot_tour) checks as the app does: it once
    aborted inside Qt on a machine missing xcb libraries, naming one of five."""
    import gui.screenshot_tour
    monkeypatch.setattr(system_libs, "problem", lambda: "the window cannot start: libxcb-icccm.so.4")
    assert gui.screenshot_tour.main([str(tmp_path / "shots")]) == 1
    assert "libxcb-icccm.so.4" in capsys.readouterr().err
    assert not (tmp_path / "shots").exists()   # stopped before anything, the window included


# -- the real loader, the real plugin -------------------------------------------------------------

real = pytest.mark.skipif(not sys.platform.startswith("linux") or system_libs.xcb_plugin() is None,
                          reason="Linux with PySide6's xcb plugin")


@real
def test_the_real_plugin_loads_exactly_when_nothing_is_missing():
    """ldd's verdict agrees with the loader's: loading libqxcb.so in a fresh process fails
    exactly when something is missing, and then names one of the libraries we name."""
    plugin = system_libs.xcb_plugin()
    missing = missing_libraries(plugin)
    assert missing is not None, "ldd should run on Linux"
    load = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(plugin)!r})"],
                          capture_output=True, text=True, timeout=60)
    if missing:
        assert load.returncode != 0
        assert any(name in load.stderr for name in missing), (missing, load.stderr)
    else:
        assert load.returncode == 0, load.stderr


@real
def test_the_real_check_on_this_machine():
    message = problem(environ={})
    missing = missing_libraries(system_libs.xcb_plugin())
    if missing:
        assert all(name in message for name in missing)
        assert "apt install" in message
    else:
        assert message is None
