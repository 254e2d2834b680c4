"""A second start of the desktop app hands its files to the first (a named pipe on Windows,
a Unix socket here), so a double-clicked checkpoint never loads the model a second time.

The second start is a real second process; on Windows (the Wine tier) the pipe is real.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import ROOT

from gui.single_instance import InstanceServer, hand_over, server_name

SECOND_START = textwrap.dedent("""
    import sys
    from PySide6.QtCore import QCoreApplication
    app = QCoreApplication([])
    from gui.single_instance import hand_over
    sys.exit(0 if hand_over(sys.argv[1:]) else 3)
""")


def second_start(*files) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SECOND_START, *map(str, files)],
                            cwd=str(ROOT), env=dict(os.environ))


def test_a_second_start_hands_its_files_to_the_first(qtbot, tmp_path):
    server = InstanceServer()
    assert server.listen()
    try:
        checkpoint = tmp_path / "ä folder" / "the dragon ü.kvckpt"
        checkpoint.parent.mkdir()
        checkpoint.write_bytes(b"KVCK")
        with qtbot.waitSignal(server.files_received, timeout=60_000) as received:
            child = second_start(checkpoint)
        assert received.args == [[str(checkpoint.resolve())]]
        qtbot.waitUntil(lambda: child.poll() is not None, timeout=30_000)
        assert child.returncode == 0, "the second start exits once the first has the files"
        with qtbot.waitSignal(server.files_received, timeout=60_000) as received:
            child = second_start()                 # a plain second start: come to the front
        assert received.args == [[]]
        qtbot.waitUntil(lambda: child.poll() is not None, timeout=30_000)
        assert child.returncode == 0
    finally:
        server.close()


def test_without_a_running_instance_the_start_goes_on(qapp, tmp_path):
    assert not hand_over([tmp_path / "x.kvckpt"], timeout_ms=500)


def test_each_data_folder_has_its_own_instance(tmp_path, app_home):
    assert server_name(tmp_path / "a") != server_name(tmp_path / "b")
    assert server_name() == server_name(app_home / "data")
    assert len(server_name()) < 40       # Unix socket paths are short


def test_app_main_hands_over_before_loading_anything():
    """gui.app.main asks a running instance first (read from its source: main runs a loop)."""
    import inspect

    import gui.app
    source = inspect.getsource(gui.app.main)
    assert source.index("hand_over(opened)") < source.index("MainWindow(")
    assert "bring_forward(window" in source


def test_the_running_window_opens_the_files_and_comes_forward(tmp_path):
    from gui.single_instance import bring_forward

    class Window:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            return lambda *args: self.calls.append((name, *args))
    w = Window()
    bring_forward(w, [str(tmp_path / "a.kvckpt")])
    assert w.calls[0] == ("import_files", [tmp_path / "a.kvckpt"])
    assert [c[0] for c in w.calls[1:]] == ["showNormal", "raise_", "activateWindow"]
    w.calls.clear()
    bring_forward(w, [])
    assert [c[0] for c in w.calls] == ["showNormal", "raise_", "activateWindow"]
