"""The Windows-only paths of native/, run on Linux by injection (issue 15, items 2-4, 9, 10).

Crafted PE files stand in for ggml-cuda.dll and the CUDA runtime, a fake loader and a
fake ``add_dll_directory`` record what Windows would be asked to do, a fake
``subprocess.run`` shows how the probe child would be started, and the real bundled
library, copied beside a stand-in ``libggml-cuda.so``, shows the "CUDA build without a
GPU" refusal end to end in a real child process.

What only Windows can prove (installer/README.md lists the steps): that ggml's plain
``LoadLibraryW`` of ggml-cuda.dll then resolves cudart/cublas to the preloaded modules,
that ``CREATE_NO_WINDOW`` keeps a console from opening, and the real exit statuses.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pecraft import pe_header, pe_image

from native import libfile, library, probe, probe_child
from native.dllsearch import SAFE_WINMODE, prepare_windows_search
from native.errors import LibraryError
from native.libfile import (
    cuda_device_problem,
    cuda_runtime_names,
    cuda_runtime_to_bundle,
    locate_cuda_runtime,
    missing_cuda_runtime,
    pe_imports,
)
from native.probe import LOAD_STAGES

RUNTIME12 = ("cudart64_12.dll", "cublasLt64_12.dll", "cublas64_12.dll")


def cuda_folder(tmp_path: Path, imports=("cudart64_12.dll", "cublas64_12.dll"), *, tail=b"") -> Path:
    folder = tmp_path / "llama-bin-win-cuda-12.4-x64"
    folder.mkdir()
    (folder / "llama.dll").write_bytes(pe_header())
    (folder / "ggml.dll").write_bytes(pe_header())
    (folder / "ggml-cuda.dll").write_bytes(
        pe_image(["KERNEL32.dll", "ggml-base.dll", *imports], ["nvcuda.dll"], tail=tail))
    return folder


def driver(tmp_path: Path) -> dict[str, str]:
    system32 = tmp_path / "Windows" / "System32"
    system32.mkdir(parents=True)
    (system32 / "nvcuda.dll").write_bytes(pe_header())
    return {"SystemRoot": str(system32.parent)}


# -- item 10: the import table, not the whole file ------------------------------------------------

def test_pe_imports_reads_the_import_and_delay_import_tables(tmp_path):
    path = tmp_path / "x.dll"
    path.write_bytes(pe_image(["KERNEL32.dll", "cudart64_12.dll"], ["cublas64_12.dll"]))
    assert pe_imports(path) == ["KERNEL32.dll", "cudart64_12.dll", "cublas64_12.dll"]


@pytest.mark.parametrize("data", [b"", b"MZ", pe_header(), pe_image(["a.dll"])[:0x210],
                                  b"MZ" + b"\xff" * 4096])
def test_damaged_or_foreign_files_read_as_no_imports(tmp_path, data):
    path = tmp_path / "bad.dll"
    path.write_bytes(data)
    assert pe_imports(path) == []


def test_a_huge_cuda_backend_costs_a_few_kib_of_reads(tmp_path, monkeypatch):
    """A multi-arch ggml-cuda.dll is hundreds of MB; only its headers and tables are read."""
    folder = cuda_folder(tmp_path)
    with open(folder / "ggml-cuda.dll", "r+b") as f:
        f.truncate(768 << 20)                       # sparse: 768 MiB, no disk used
    read = []

    class Counting:
        def __init__(self, f):
            self._f = f

        def read(self, n=-1):
            data = self._f.read(n)
            read.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self._f.close()

    monkeypatch.setattr(libfile, "open", lambda *a, **k: Counting(builtins.open(*a, **k)),
                        raising=False)
    for name in RUNTIME12:
        (folder / name).write_bytes(pe_header())
    assert missing_cuda_runtime(folder, "win32", driver(tmp_path)) is None
    assert 0 < sum(read) < 16 << 10, f"read {sum(read)} bytes of a 768 MiB file"


def test_cublaslt_is_required_with_cublas(tmp_path):
    folder = cuda_folder(tmp_path)
    for name in ("cudart64_12.dll", "cublas64_12.dll"):
        (folder / name).write_bytes(pe_header())
    text = missing_cuda_runtime(folder, "win32", driver(tmp_path))
    assert "cublasLt64_12.dll was not found" in text, text
    assert cuda_runtime_names(folder / "ggml-cuda.dll", "win32") == RUNTIME12, "load order"


def test_an_unreadable_backend_falls_back_to_cuda_12_names(tmp_path):
    folder = cuda_folder(tmp_path)
    (folder / "ggml-cuda.dll").write_bytes(b"MZ not really")
    assert cuda_runtime_names(folder / "ggml-cuda.dll", "win32") == RUNTIME12


# -- item 2: the CUDA runtime preloaded by full path; no silent CPU fallback -----------------------

def test_cuda_runtime_is_preloaded_by_full_path_before_llama_dll(tmp_path):
    folder = cuda_folder(tmp_path)
    cuda = tmp_path / "CUDA" / "v12.4"
    (cuda / "bin").mkdir(parents=True)
    for name in ("cudart64_12.dll", "cublasLt64_12.dll"):
        (folder / name).write_bytes(pe_header())     # where our message tells users to put it
    (cuda / "bin" / "cublas64_12.dll").write_bytes(pe_header())
    env = {"CUDA_PATH": str(cuda), "PATH": r"C:\Windows"}
    before = dict(env)
    added, loaded = [], []
    done = prepare_windows_search(folder / "llama.dll", environ=env, platform="win32",
                                  add_dll_directory=added.append,
                                  loader=lambda path, winmode: loaded.append((path, winmode)) or path)
    assert loaded == [(str(folder / "cudart64_12.dll"), SAFE_WINMODE),
                      (str(folder / "cublasLt64_12.dll"), SAFE_WINMODE),
                      (str(cuda / "bin" / "cublas64_12.dll"), SAFE_WINMODE),
                      (str(folder / "llama.dll"), SAFE_WINMODE)], "dependencies first, llama.dll last"
    assert done.preloaded == [folder / "cudart64_12.dll", folder / "cublasLt64_12.dll",
                              cuda / "bin" / "cublas64_12.dll"]
    assert done.library == str(folder / "llama.dll")
    assert env == before, "PATH is never rewritten"


def test_what_is_checked_is_what_is_preloaded(tmp_path):
    folder = cuda_folder(tmp_path)
    for name in RUNTIME12:
        (folder / name).write_bytes(pe_header())
    runtime = locate_cuda_runtime(folder, "win32", {})
    assert runtime.found == tuple(folder / n for n in RUNTIME12) and runtime.missing == ()
    assert cuda_runtime_to_bundle(folder, "win32", {}) == [folder / n for n in RUNTIME12]
    assert locate_cuda_runtime(folder, "linux", {}) is None


def test_bundling_refuses_a_cuda_build_without_its_runtime(tmp_path):
    folder = cuda_folder(tmp_path)
    with pytest.raises(LibraryError, match="cudart64_12.dll, cublasLt64_12.dll, cublas64_12.dll were not found"):
        cuda_runtime_to_bundle(folder, "win32", {})
    assert cuda_runtime_to_bundle(tmp_path, "win32", {}) == [], "a CPU build needs nothing"


def test_cuda_build_without_a_gpu_device_is_said_so(tmp_path):
    folder = cuda_folder(tmp_path)
    text = cuda_device_problem(folder, ["CPU"], "win32")
    assert "built with CUDA (ggml-cuda.dll)" in text and "run on the CPU only" in text
    assert "devices: CPU" in text and "nvidia-smi" in text
    assert cuda_device_problem(folder, ["GPU", "CPU"], "win32") is None
    cpu_only = tmp_path / "cpu"
    cpu_only.mkdir()
    assert cuda_device_problem(cpu_only, ["CPU"], "win32") is None


def test_a_driver_too_old_for_the_runtime_is_named_first(tmp_path):
    folder = cuda_folder(tmp_path)                        # ggml-cuda.dll imports cudart64_12
    text = cuda_device_problem(folder, ["CPU"], "win32", driver_version=lambda: 11080)
    assert "supports CUDA 11.8 but cudart64_12.dll needs CUDA 12 or newer" in text
    assert "update the NVIDIA driver" in text and "CPU only" in text
    for current in (12040, None):                         # new enough, or no driver to ask
        text = cuda_device_problem(folder, ["CPU"], "win32", driver_version=lambda current=current: current)
        assert "found no CUDA device" in text and "update the NVIDIA driver" not in text


def test_probe_refuses_a_cuda_folder_that_comes_up_on_the_cpu(tmp_path):
    """End to end in a real child: the real (CPU) library beside a stand-in CUDA backend."""
    folder = tmp_path / "cuda-build"
    shutil.copytree(library.bundled_library_dir(), folder, symlinks=True)
    if sys.platform == "win32":
        system32 = Path(os.environ.get("SystemRoot", r"C:\Windows")) / "System32"
        if not (system32 / "nvcuda.dll").is_file():
            pytest.skip("needs an NVIDIA driver (nvcuda.dll): without one the folder is refused earlier")
        # (the Wine tier, whose prefix has a stand-in driver) the stand-in backend's import
        # table names the CUDA runtime, and copies of a harmless DLL of the build play
        # that runtime, so the real loader preloads them
        (folder / "ggml-cuda.dll").write_bytes(pe_image(["KERNEL32.dll", *RUNTIME12]))
        for name in RUNTIME12:
            shutil.copy(folder / "libwinpthread-1.dll", folder / name)
    else:
        (folder / "libggml-cuda.so").write_bytes(b"stand-in: its presence marks a CUDA build")
    report = probe.probe_library(folder, timeout_s=120)
    assert not report.ok and report.stage == "devices", report
    assert "found no CUDA device" in report.reason and "CPU only" in report.reason


def test_probe_child_loads_through_the_apps_own_function(monkeypatch, capsys, tmp_path):
    """The child announces the stages of library.bindings(), the function the app loads
    with, so what the probe accepted is loaded the same way in the app."""
    calls = []

    def fake_bindings(choice, *, probe, stage):
        calls.append((choice, probe))
        for name in LOAD_STAGES:
            stage(name)
        raise LibraryError("stopped by the test")

    monkeypatch.setattr(library, "bindings", fake_bindings)
    monkeypatch.chdir(tmp_path)
    assert probe_child.main("relative-folder") == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [d["stage"] for d in lines if "stage" in d] == list(LOAD_STAGES)
    assert lines[-1] == {"ok": False, "reason": "stopped by the test"}
    assert calls == [(library.LibraryChoice(tmp_path / "relative-folder", "probe"), False)]


def test_parent_and_child_run_the_same_stages_with_the_real_library():
    script = ("import json; from native import library; seen = []; "
              "library.bindings(stage=seen.append); print(json.dumps(seen))")
    parent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=str(Path(__file__).resolve().parent.parent))
    assert parent.returncode == 0, parent.stderr
    child = subprocess.run([sys.executable, "-m", "native.probe_child", str(library.bundled_library_dir())],
                           capture_output=True, text=True, timeout=120,
                           cwd=str(Path(__file__).resolve().parent.parent))
    child_stages = [d["stage"] for d in map(json.loads, child.stdout.splitlines()) if "stage" in d]
    assert json.loads(parent.stdout.splitlines()[-1]) == child_stages == list(LOAD_STAGES)


# -- item 3: relative folders ------------------------------------------------------------------------

def test_relative_library_folders_are_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert library.choose_library("llama-bin", None, {}).folder == tmp_path / "llama-bin"
    assert library.choose_library(None, None, {library.APP_ENV_VAR: r"..\x" if os.sep == "\\" else "../x"}) \
        .folder == tmp_path.parent / "x", "'..' folded: AddDllDirectory wants a plain absolute path"


def test_windows_search_gets_absolute_paths_from_a_relative_one(tmp_path, monkeypatch):
    folder = cuda_folder(tmp_path)
    for name in RUNTIME12:
        (folder / name).write_bytes(pe_header())
    monkeypatch.chdir(tmp_path)
    added, loaded = [], []
    prepare_windows_search(Path(folder.name) / "llama.dll", environ={}, platform="win32",
                           add_dll_directory=added.append,
                           loader=lambda path, winmode: loaded.append(path))
    assert added == [str(folder)]
    assert loaded[-1] == str(folder / "llama.dll")
    assert all(os.path.isabs(p) for p in added + loaded)


# -- item 4: no console window for the probe child ---------------------------------------------------

def _fake_run(record):
    def run(argv, **kwargs):
        record.append(kwargs)
        out = b'{"stage": "open"}\n{"ok": true, "version": "test"}\n'
        return subprocess.CompletedProcess(argv, 0, stdout=out, stderr=b"")
    return run


def test_probe_child_is_started_without_a_console_window_on_windows(tmp_path):
    record = []
    report = probe.probe_library(tmp_path, platform="win32", run=_fake_run(record))
    assert report.ok and report.version == "test"
    assert record[0]["creationflags"] == probe.CREATE_NO_WINDOW == 0x08000000
    assert record[0]["stdin"] is subprocess.DEVNULL


def test_probe_child_flags_are_windows_only(tmp_path):
    record = []
    probe.probe_library(tmp_path, platform="linux", run=_fake_run(record))
    assert "creationflags" not in record[0]


# -- item 9: Windows exit statuses named by their cause --------------------------------------------------

@pytest.mark.parametrize("status,words", [
    (0xC0000005, ["crashed (access violation 0xC0000005)", "another llama.cpp build"]),
    (0xC000001D, ["illegal instruction 0xC000001D", "AVX2", "this CPU lacks"]),
    (0xC0000409, ["0xC0000409", "GGML_ASSERT", "msvcp140.dll"]),
    (0xC0000135, ["a DLL was not found, 0xC0000135", "Visual C++ Redistributable"]),
    (0xC000013A, ["was interrupted", "console was closed", "not a fault of the library"]),
    (0xC0000374, ["crashed (exit status 0xC0000374)"]),
    (1, ["crashed (exit status 1)"]),
])
def test_windows_exit_statuses_name_their_cause_in_one_line(status, words):
    for code in {status, status - (1 << 32) if status >= 0x80000000 else status}:   # unsigned and signed
        report = probe.interpret(Path("C:/llama"), code, '{"stage": "abi"}\n', "GGML_ASSERT(x) failed\n")
        assert not report.ok and report.stage == "abi"
        assert "\n" not in report.reason
        assert "while reading the default parameters back" in report.reason
        for word in words:
            assert word in report.reason, (hex(status), report.reason)


def test_console_closed_is_not_called_a_crash():
    report = probe.interpret(Path("C:/llama"), 0xC000013A, '{"stage": "import"}\n', "")
    assert "crashed" not in report.reason
