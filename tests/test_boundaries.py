"""The layering rules: engine/ never imports Qt, gui/ never calls native/ or llama_cpp;
the engine's core never imports its front ends (the command line, the server), no
module reads another module's private attributes across those boundaries, and no two
modules of engine/ and native/ import each other, however indirectly.

The engine's front ends are ``engine/cli`` and ``engine/server`` (and ``gui/``, a package
of its own); everything else in ``engine/`` is the core they share.  They reach the core
through its public face (engine.worker.EngineWorker, engine.commands, the listener).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FRONT_ENDS = ("engine/cli", "engine/server")


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


def _modules_imported(path: Path) -> set[str]:
    """Every module ``path`` imports, in full (``from engine import cli`` counts as
    ``engine.cli``), at the top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _core_files() -> list[Path]:
    return [p for p in (ROOT / "engine").rglob("*.py")
            if not any(p.relative_to(ROOT).as_posix().startswith(f + "/") for f in FRONT_ENDS)]


def _private_defined(path: Path) -> set[str]:
    """Private names ``path`` defines: functions, classes, class attributes, and
    attributes it assigns (``self._x = ...``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute):
                    names.add(target.attr)
                elif isinstance(target, ast.Name):
                    names.add(target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _root(node: ast.expr) -> str | None:
    """The name an attribute chain starts from (``a`` of ``a.b().c``)."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _private_reads(path: Path, *, with_self: bool = False) -> list[tuple[int, str]]:
    """``obj._name`` in ``path`` where ``obj`` is not ``self`` or ``cls`` (unless
    ``with_self``), nor reached from a module outside the project (``os._exit``: the
    standard library's business)."""
    tree = ast.parse(path.read_text("utf-8"))
    outside = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
               if isinstance(node, ast.Import) for alias in node.names
               if alias.name.split(".")[0] not in ("engine", "gui", "native")}
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and (with_self or not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")))
                and _root(node.value) not in outside):
            out.append((node.lineno, node.attr))
    return out


def _project_modules(*packages: str) -> dict[str, Path]:
    """Dotted name -> file, for every module of ``packages`` (a package is its __init__)."""
    out = {}
    for package in packages:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which of ``modules`` each one imports: at the top, inside a function, or under
    ``if TYPE_CHECKING`` alike (each is an arrow that a circle could hide behind).
    ``from a.b import c`` counts as ``a.b.c`` when that is a module, else ``a.b``."""
    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Import):
                wanted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                wanted = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            targets.update(t for t in map(known, wanted) if t and t != name)
        graph[name] = targets
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_in_engine_and_native():
    """Imports point one way: a piece two modules share lives in its one home below both,
    never reached by a function-level import to dodge the circle at load time."""
    assert _circles(_import_graph(_project_modules("engine", "native"))) == []


def test_the_circle_finder_sees_a_function_level_circle(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from pkg.b import x\n", "utf-8")
    b.write_text("def f():\n    from pkg import a\n", "utf-8")
    assert _circles(_import_graph({"pkg.a": a, "pkg.b": b})) == [["pkg.a", "pkg.b"]]


def test_engine_never_imports_qt():
    bad = {f: n & {"PySide6", "qasync", "gui"} for f, n in _imports("engine").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_gui_never_imports_native():
    bad = {f: n & {"native", "llama_cpp"} for f, n in _imports("gui").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_native_never_imports_upper_layers():
    bad = {f: n & {"engine", "gui", "PySide6"} for f, n in _imports("native").items()}
    assert not {f: n for f, n in bad.items() if n}


def test_the_engine_core_never_imports_its_front_ends():
    """The command line and the server build on the core, never the other way round."""
    front = tuple(f.replace("/", ".") for f in FRONT_ENDS)
    bad = {str(p.relative_to(ROOT)): sorted(m for m in _modules_imported(p)
                                            if any(m == f or m.startswith(f + ".") for f in front))
           for p in _core_files()}
    assert not {f: m for f, m in bad.items() if m}


def test_the_server_never_imports_the_command_line():
    bad = {str(p.relative_to(ROOT)): sorted(m for m in _modules_imported(p) if m.startswith("engine.cli"))
           for p in (ROOT / "engine" / "server").rglob("*.py")}
    assert not {f: m for f, m in bad.items() if m}


def test_the_engine_reads_no_private_attribute_of_another_module():
    """In engine/ (core and front ends alike), every ``obj._name`` — ``self._name`` too,
    so no mixin reads its host's state — names something the same file defines: a front
    end uses the worker's public face, and one core module the public face of another."""
    bad = {}
    for path in (ROOT / "engine").rglob("*.py"):
        own = _private_defined(path)
        reads = [f"line {line}: {name}" for line, name in _private_reads(path, with_self=True)
                 if name not in own]
        if reads:
            bad[str(path.relative_to(ROOT))] = reads
    assert not bad


def test_the_window_reads_no_private_attribute_of_the_engine():
    """gui/ uses the engine's public face: no private name the engine defines is read there."""
    engine_private = set().union(*(_private_defined(p) for p in (ROOT / "engine").rglob("*.py")))
    bad = {}
    for path in (ROOT / "gui").rglob("*.py"):
        own = _private_defined(path)
        reads = [f"line {line}: {name}" for line, name in _private_reads(path)
                 if name in engine_private and name not in own]
        if reads:
            bad[str(path.relative_to(ROOT))] = reads
    assert not bad


def test_importing_the_engine_worker_loads_no_native_layer():
    """The window imports the worker on the UI thread: the native layer (and libllama)
    is loaded on the engine thread only."""
    import subprocess
    import sys
    code = ("import sys, engine.worker, engine.events, engine.commands, engine.sessions, "
            "engine.requests, engine.checkpoint_policy; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('native', 'llama_cpp') "
            "or m in ('engine.runtime', 'engine.history', 'engine.parallel')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=str(ROOT), capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == "[]"
