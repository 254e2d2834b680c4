"""Check a user-chosen llama library in a child process before this process loads it.

A library from another llama.cpp build may crash on its first call.  The child,
``python -m native.probe_child FOLDER`` (:mod:`native.probe_child`), goes through the
stages below, printing one JSON line ``{"stage": NAME}`` *before* each (flushed), and
one final line ``{"ok": ..., "reason": ...}``.  When the child dies, the last stage it
announced says where, so the parent (this module) can report "crashed (SIGSEGV) while
reading the default parameters" instead of a bare exit code.

The stages (:data:`LOAD_STAGES`) are :func:`native.library.load_sequence`'s, run by the
very function the app loads with (:func:`native.library.bindings`): open the file with the OS loader (on
Windows: DLL folders added, the CUDA runtime preloaded); look up every function the
bindings bind; import the bindings; read the default parameter structs back (ABI);
load plug-in backends; ``llama_backend_init``; list devices (a CUDA build without a
GPU device is refused there).

On Windows the child is started with ``CREATE_NO_WINDOW``: from the windowed app a
console program would otherwise open a console window, and closing it killed the probe
(0xC000013A), which then refused the library as crashed.  A child that dies with a
Windows status is explained by :data:`NTSTATUS_CAUSES`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROBE_TIMEOUT_S = 60.0
#: winbase.h: the child gets no console (and so no console window).
CREATE_NO_WINDOW = 0x08000000
#: In a frozen (PyInstaller) app there is no ``python -m``: the console executable
#: runs the probe when its first argument is this (see installer/launch_cli.py).
FROZEN_PROBE_ARG = "--probe-llama-library"

#: The stages of :func:`native.library.load_sequence`, in order, and what each does: the
#: child announces each by name, and the parent's message says which one it died in.
LOAD_STAGES = {
    "open": "opening the library",
    "symbols": "looking up its functions",
    "import": "importing llama-cpp-python's bindings",
    "abi": "reading the default parameters back (ABI check)",
    "backends": "loading ggml's backends",
    "backend_init": "llama_backend_init",
    "devices": "listing devices",
}

#: Called with each stage's name before it runs (the child prints it).
Stage = Callable[[str], Any]


def no_stage(_name: str) -> None:
    return None

#: How a Windows child died (its exit status is the NTSTATUS), as (how, cause): the
#: cause ends the one-line message.
_MISMATCH = ("it is probably from another llama.cpp build, or its dependencies do not match")
NTSTATUS_CAUSES = {
    0xC0000005: ("crashed (access violation 0xC0000005)", _MISMATCH),
    0xC000001D: ("crashed (illegal instruction 0xC000001D)",
                 "it was built for processor features this CPU lacks (AVX2 or AVX-512, for "
                 "example): use a build for this CPU, such as llama.cpp's plain x64 CPU build "
                 "or one made with -DGGML_NATIVE=OFF"),
    0xC0000409: ("stopped itself (abort or fast fail 0xC0000409)",
                 "llama.cpp aborts on a failed check (GGML_ASSERT; its last message is shown "
                 "in brackets when there was one), and a DLL built with a newer Visual C++ "
                 "than the msvcp140.dll already loaded fails the same way: rebuild it with "
                 "installer/build_cuda_llama.ps1"),
    0xC0000135: ("could not start (a DLL was not found, 0xC0000135)",
                 "a DLL the library or the probe needs is missing: keep every DLL of the "
                 "llama.cpp release together, and install the Microsoft Visual C++ "
                 "Redistributable (x64)"),
    0xC000013A: ("was interrupted (its console was closed or Ctrl+C pressed, 0xC000013A)",
                 "this is not a fault of the library: try again"),
}

Runner = Callable[..., Any]


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
                  command: Sequence[str] | None = None, *, platform: str = sys.platform,
                  run: Runner = subprocess.run) -> ProbeReport:
    """Load ``folder``'s library in a child process and report whether it is safe.

    ``command`` replaces the child's command line (tests use it to run a child that
    misbehaves in a chosen way); ``platform`` and ``run`` let tests see how the child
    would be started on Windows.
    """
    env = dict(os.environ)
    env.pop("LLAMA_CPP_LIB_PATH", None)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if platform != "win32":
        # a crash leaves a Python traceback on stderr.  Not on Windows: there the exit
        # status names the cause, and faulthandler also reports exceptions that are then
        # handled (an access violation ctypes turns into OSError), burying the detail.
        env["PYTHONFAULTHANDLER"] = "1"
    else:
        env.pop("PYTHONFAULTHANDLER", None)
    env["PYTHONIOENCODING"] = "utf-8"
    argv = list(command) if command else probe_command(folder)
    extra = {"creationflags": CREATE_NO_WINDOW} if platform == "win32" else {}
    try:
        done = run(argv, capture_output=True, timeout=timeout_s, env=env,
                   stdin=subprocess.DEVNULL, **extra)
    except subprocess.TimeoutExpired as exc:
        stage = _last_stage((exc.stdout or b"").decode("utf-8", "replace"))
        return ProbeReport(False, f"the llama library in {folder} did not answer within "
                                  f"{timeout_s:.0f} s while {LOAD_STAGES.get(stage, 'being checked')}",
                           stage=stage)
    return interpret(folder, done.returncode, done.stdout.decode("utf-8", "replace"),
                     done.stderr.decode("utf-8", "replace"))


def probe_command(folder: Path) -> list[str]:
    """The child's command line, from a source checkout or from a frozen app."""
    if not getattr(sys, "frozen", False):
        return [sys.executable, "-m", "native.probe_child", str(folder)]
    exe = Path(sys.executable)
    # the windowed CheckpointChat.exe has no stdout of its own: use the console twin
    console = exe.with_name("checkpoint-chat" + exe.suffix)
    return [str(console if console.is_file() else exe), FROZEN_PROBE_ARG, str(folder)]


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


#: Lines that start faulthandler's dump (POSIX signal, Windows exception).
_DUMP_STARTS = ("Fatal Python error", "Windows fatal exception")


def _detail(stderr: str) -> str:
    """The child's last words: the line llama.cpp printed before dying (a GGML_ASSERT), else
    the first line of faulthandler's dump, else the last line of a Python traceback.

    faulthandler's dump (thread stacks, then "Extension modules: ...") comes after what
    the library printed: reading from the end would name a Python module instead.
    """
    lines = [ln.rstrip() for ln in stderr.splitlines()]
    dump = next((i for i, ln in enumerate(lines) if ln.startswith(_DUMP_STARTS)), None)
    before = lines if dump is None else lines[:dump]
    said = next((ln.strip() for ln in reversed(before)
                 if ln.strip() and not ln.startswith(("  File", "    ", "Traceback"))), "")
    return said or ("" if dump is None else lines[dump].strip())


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
    where = LOAD_STAGES.get(stage, "starting")
    detail = _detail(stderr)
    detail = f" [{detail[:200]}]" if detail else ""
    if -255 <= returncode < 0:                       # POSIX: killed by a signal
        how, cause = f"crashed ({_signal_name(-returncode)})", _MISMATCH
    else:
        status = returncode & 0xFFFFFFFF             # a signed NTSTATUS reads the same
        known = NTSTATUS_CAUSES.get(status)
        if known is None:
            shown = f"0x{status:08X}" if status >= 0xC0000000 else str(returncode)
            how, cause = f"crashed (exit status {shown})", _MISMATCH
        else:
            how, cause = known
    return ProbeReport(False, f"the llama library in {folder} {how} while {where}{detail}; {cause}",
                       stage=stage)

