"""No function longer than 80 lines outside tests (issue 22).

Every function of the application's code — methods and nested functions too — is
measured from its ``def`` line to its last line, docstring included, decorators not
(``end_lineno - lineno + 1``).  None is longer today, so ALLOW is empty; it stays the
one place an exception would be written down, with its length, and a listed function
that grew, got short or went away fails, so the list stays true.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 80

#: qualified name ("path::Class.method") -> its length now.  Only ever remove entries
#: (split the function into well-named helpers); never add one or raise a number.
ALLOW: dict[str, int] = {}


def _sources() -> list[Path]:
    files: list[Path] = []
    for folder in ("engine", "native", "gui", "benchmarks"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files + sorted((ROOT / "installer").glob("*.py"))


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, length) of every function under ``tree``, nested ones included."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{child.name}" if prefix else child.name
            if not isinstance(child, ast.ClassDef):
                assert child.end_lineno is not None
                yield name, child.end_lineno - child.lineno + 1
            yield from _functions(child, name)
        else:
            yield from _functions(child, prefix)


def measured() -> dict[str, int]:
    """Every function of the application's code longer than LIMIT lines."""
    long: dict[str, int] = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for name, n in _functions(ast.parse(path.read_text("utf-8"), str(path))):
            if n > LIMIT:
                long[f"{rel}::{name}"] = n
    return long


def test_the_walk_finds_methods_and_nested_functions():
    source = "class A:\n    def m(self):\n        def inner():\n            pass\n\n\nasync def f():\n    pass\n"
    assert dict(_functions(ast.parse(source))) == {"A.m": 3, "A.m.inner": 2, "f": 2}


def test_no_function_is_longer_than_80_lines():
    long = measured()
    new = {name: n for name, n in long.items() if name not in ALLOW}
    grown = {name: (ALLOW[name], n) for name, n in long.items() if name in ALLOW and n > ALLOW[name]}
    assert not new, (f"functions longer than {LIMIT} lines (split them into well-named helpers): "
                     f"{new}")
    assert not grown, f"listed functions that grew (was, now): {grown}"


def test_the_allow_list_is_true():
    long = measured()
    gone = sorted(name for name in ALLOW if name not in long)
    shrunk = {name: (n, long[name]) for name, n in ALLOW.items() if name in long and long[name] < n}
    assert not gone, f"no longer over {LIMIT} lines (or gone): take them off ALLOW: {gone}"
    assert not shrunk, f"shorter now (listed, now): lower their numbers in ALLOW: {shrunk}"
