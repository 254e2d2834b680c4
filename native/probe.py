"""Check a user-chosen llama library in a child process before this process loads it.

A library from another llama.cpp build may crash on its first call.  Run as
``python -m native.probe FOLDER``: the child goes through the stages below, printing
one JSON line ``{"stage": NAME}`` *before* each (flushed), and one final line
``{"ok": ..., "reason": ...}``.  When the child dies, the last stage it announced says
where, so the parent can report "crashed (SIGSEGV) while reading the default
parameters" instead of a bare exit code.

Stages: open the file with the OS loader; look up every function the bindings bind;
import the bindings; read the default parameter structs back (ABI); load plug-in
backends; ``llama_backend_init``; list devices.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

PROBE_TIMEOUT_S = 60.0
#: In a frozen (PyInstaller) app there is no ``python -m``: the console executable
#: runs the probe when its first argument is this (see installer/launch_cli.py).
FROZEN_PROBE_ARG = "--probe-llama-library"

STAGES = {
    "open": "opening the library",
    "symbols": "looking up its functions",
    "import": "importing llama-cpp-python's bindings",
    "abi": "reading the default parameters back (ABI check)",
    "backends": "loading ggml's backends",
    "backend_init": "llama_backend_init",
    "devices": "listing devices",
}


@dataclass(frozen=True)
class ProbeReport:
    ok: bool
    reason: str = ""
    version: str = ""
    system_info: str = ""
    stage: str = ""
    devices: list[dict] = field(default_factory=list)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def probe_library(folder: Path, timeout_s: float = PROBE_TIMEOUT_S,
                  command: Sequence[str] | None = None) -> ProbeReport:
    """Load ``folder``'s library in a child process and report whether it is safe.

    ``command`` replaces the child's command line (tests use it to run a child that
    misbehaves in a chosen way).
    """
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONFAULTHANDLER"] = "1"   # a crash leaves a Python traceback on stderr
    env["PYTHONIOENCODING"] = "utf-8"
    argv = list(command) if command else probe_command(folder)
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        stage = _last_stage((exc.stdout or b"").decode("utf-8", "replace"))
        return ProbeReport(False, f"the llama library in {folder} did not answer within "
                                  f"{timeout_s:.0f} s while {STAGES.get(stage, 'being checked')}",
                           stage=stage)
    return interpret(folder, done.returncode, done.stdout.decode("utf-8", "replace"),
                     done.stderr.decode("utf-8", "replace"))


def probe_command(folder: Path) -> list[str]:
    """The child's command line, from a source checkout or from a frozen app."""
    if not getattr(sys, "frozen", False):
        return [sys.executable, "-m", "native.probe", str(folder)]
    exe = Path(sys.executable)
    # the windowed CheckpointChat.exe has no stdout of its own: use the console twin
    console = exe.with_name("checkpoint-chat" + exe.suffix)
    return [str(console if console.is_file() else exe), FROZEN_PROBE_ARG, str(folder)]


def run_if_probe(argv: Sequence[str]) -> int | None:
    """The frozen executables' first step: run the probe and return its status, or None."""
    if len(argv) == 2 and argv[0] == FROZEN_PROBE_ARG:
        return _main(argv[1])
    return None


def _lines(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out


def _last_stage(stdout: str) -> str:
    stages = [d["stage"] for d in _lines(stdout) if "stage" in d]
    return stages[-1] if stages else ""


def interpret(folder: Path, returncode: int, stdout: str, stderr: str) -> ProbeReport:
    """The child's output and exit status, as a report (pure: tested without a child)."""
    lines = _lines(stdout)
    final = [d for d in lines if "ok" in d]
    stage = _last_stage(stdout)
    if final and returncode == 0:
        answer = final[-1]
        return ProbeReport(bool(answer.get("ok")), answer.get("reason", ""),
                           answer.get("version", ""), answer.get("system_info", ""),
                           stage=stage, devices=answer.get("devices", []))
    if returncode < 0:
        how = f"{_signal_name(-returncode)}"
    elif returncode in (0xC0000005, -1073741819):   # Windows access violation
        how = "access violation 0xC0000005"
    else:
        how = f"exit status {returncode}"
    where = STAGES.get(stage, "starting")
    detail = next((ln.strip() for ln in reversed(stderr.splitlines())
                   if ln.strip() and not ln.startswith(("  File", "Current thread", "Fatal Python"))), "")
    return ProbeReport(False, f"the llama library in {folder} crashed ({how}) while {where}"
                              + (f" [{detail[:200]}]" if detail else "")
                              + "; it is probably from another llama.cpp build, or its "
                                "dependencies do not match", stage=stage)


# -- the child ---------------------------------------------------------------------------------

def _say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _main(folder_arg: str) -> int:
    from native import library, sysinfo
    from native.dllsearch import SAFE_WINMODE, default_loader, prepare_windows_search
    from native.errors import LibraryError
    from native.libfile import explain_load_failure

    folder = Path(folder_arg)
    try:
        path = library.preflight(folder)
        _say(stage="open")
        try:
            if sys.platform == "win32":
                prepare_windows_search(path)
                handle = default_loader(str(path), winmode=SAFE_WINMODE)
            else:
                handle = default_loader(str(path))
        except OSError as exc:
            raise LibraryError(explain_load_failure(folder, exc)) from exc
        _say(stage="symbols")
        wanted = tuple(dict.fromkeys(library.REQUIRED_SYMBOLS + library.bound_symbols()))
        missing = library.missing_symbols(handle, wanted)
        if missing:
            raise LibraryError(library.symbols_refusal(path, missing, len(wanted)))
        _say(stage="import")
        # Each step bindings() takes, done one by one so a crash names its stage;
        # bindings() then repeats them cheaply (all loaded) and calls llama_backend_init.
        os.environ[library.BINDINGS_ENV_VAR] = str(folder)
        try:
            import llama_cpp.llama_cpp as ll
        except (OSError, RuntimeError, AttributeError) as exc:
            raise LibraryError(explain_load_failure(folder, exc)) from exc
        _say(stage="abi")
        library.check_abi(ll, path)
        _say(stage="backends")
        sysinfo.load_dynamic_backends(folder)
        _say(stage="backend_init")
        ll = library.bindings(library.LibraryChoice(folder, "probe"), probe=False)
        _say(stage="devices")
        devices = [d.__dict__ for d in sysinfo.list_devices(folder)]
        _say(ok=True, version=library.loaded_library().version, devices=devices,
             system_info=ll.llama_print_system_info().decode("utf-8", "replace"))
    except LibraryError as exc:
        _say(ok=False, reason=str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
