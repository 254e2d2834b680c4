"""The layering rules: engine/ never imports Qt, gui/ never calls native/ or llama_cpp."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _imports(package: str) -> dict[str, set[str]]:
    found = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_engine_never_imports_qt():
    bad = {f: n & {"PySide6", "qasync", "gui"} for f, n in _imports("engine").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_gui_never_imports_native():
    bad = {f: n & {"native", "llama_cpp"} for f, n in _imports("gui").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_native_never_imports_upper_layers():
    bad = {f: n & {"engine", "gui", "PySide6"} for f, n in _imports("native").items()}
    assert not {f: n for f, n in bad.items() if n}
