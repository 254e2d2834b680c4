"""Check a user-chosen llama library in a child process before this process loads it.

A library from another llama.cpp build may crash on its first call.  Run as
``python -m native.probe FOLDER``: the child loads the library, runs the ABI check and
prints one JSON line.  The parent turns a crash, a hang or a refusal into a reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProbeReport:
    ok: bool
    reason: str = ""
    version: str = ""
    system_info: str = ""


def probe_library(folder: Path, timeout_s: float = PROBE_TIMEOUT_S) -> ProbeReport:
    """Load ``folder``'s library in a child process and report whether it is safe."""
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    try:
        done = subprocess.run([sys.executable, "-m", "native.probe", str(folder)],
                              capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return ProbeReport(False, f"the llama library in {folder} did not answer within "
                                  f"{timeout_s:.0f} s while being checked")
    last = done.stdout.strip().splitlines()[-1:] or [""]
    try:
        answer = json.loads(last[0])
    except json.JSONDecodeError:
        how = (f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}")
        detail = done.stderr.strip().splitlines()[-1:] or [""]
        return ProbeReport(False, f"the llama library in {folder} crashed while being checked "
                                  f"({how}) {detail[0]}".strip()
                                  + "; it is probably from another llama.cpp build")
    return ProbeReport(bool(answer.get("ok")), answer.get("reason", ""),
                       answer.get("version", ""), answer.get("system_info", ""))


def _main(folder: str) -> int:
    from native.errors import LibraryError
    from native import library
    try:
        ll = library.bindings(Path(folder), probe=False)
        info = ll.llama_print_system_info().decode("utf-8", "replace")
        print(json.dumps({"ok": True, "version": library.loaded_library().version,
                          "system_info": info}))
    except LibraryError as exc:
        print(json.dumps({"ok": False, "reason": str(exc)}))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
