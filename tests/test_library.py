"""Choosing, checking and loading the llama library (native/library.py, libfile.py,
dllsearch.py, probe.py, probe_child.py, sysinfo.py).

Windows paths run here by injection: ``platform="win32"``, folders holding crafted
PE headers named llama.dll / ggml-cuda.dll, a fake ``add_dll_directory`` and a fake
loader.  Real libraries run here too: fake libllama.so files compiled with gcc (one
lacking functions, one that crashes on its first call) are probed in a child process,
and the bundled library must pass the same probe.

Only Windows can prove (installer/README.md, W3-W6): that LoadLibraryExW with the safe flags finds
ggml*.dll / cudart64_12.dll through the added folders, that llama_cpp's later
``CDLL(path, winmode=0)`` returns the module already loaded, and that an official
release folder's plug-in backends load from ``ggml_backend_load_all_from_path``.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from pecraft import pe_header, pe_image

from native import library, probe
from native.dllsearch import SAFE_WINMODE, PathGuard, prepare_windows_search
from native.errors import LibraryError
from native.libfile import (
    check_binary,
    cuda_bin_dirs,
    explain_load_failure,
    find_library_file,
    missing_cuda_runtime,
    read_binary_kind,
)
from native.sysinfo import list_devices, list_devices_from, load_dynamic_backends

ROOT = Path(__file__).resolve().parent.parent
COMMIT = library.REQUIRED_LLAMA_CPP_COMMIT


# -- crafted binaries -----------------------------------------------------------------------------

def elf_header(bits: int = 64, machine: int = 62) -> bytes:
    ident = b"\x7fELF" + bytes([1 if bits == 32 else 2, 1, 1]) + bytes(9)
    return ident + struct.pack("<HHI", 3, machine, 1) + bytes(64 - 20)


CUDA12 = ("cudart64_12.dll", "cublas64_12.dll")
RUNTIME12 = ("cudart64_12.dll", "cublasLt64_12.dll", "cublas64_12.dll")   # load order


def windows_folder(tmp_path: Path, *, cuda_imports: tuple[str, ...] | None = CUDA12,
                   machine: int = 0x8664) -> Path:
    """An official-release-like folder: llama.dll, ggml.dll and (for CUDA) ggml-cuda.dll
    with a real import table naming ggml-base.dll, the CUDA runtime and the driver."""
    folder = tmp_path / "llama-b6000-bin-win-cuda-x64"
    folder.mkdir()
    (folder / "llama.dll").write_bytes(pe_header(machine))
    (folder / "ggml.dll").write_bytes(pe_header())
    if cuda_imports is not None:
        (folder / "ggml-cuda.dll").write_bytes(
            pe_image(["KERNEL32.dll", "ggml-base.dll", *cuda_imports], ["nvcuda.dll"]))
    return folder


def system_root(tmp_path: Path, driver: bool = True) -> Path:
    root = tmp_path / "Windows"
    (root / "System32").mkdir(parents=True)
    if driver:
        (root / "System32" / "nvcuda.dll").write_bytes(pe_header())
    return root


# -- precedence ---------------------------------------------------------------------------------------

def test_precedence_cli_then_settings_then_env_then_bundled(tmp_path):
    env = {library.APP_ENV_VAR: str(tmp_path / "env")}
    cli, settings = library.absolute("/cli"), library.absolute("/settings")   # C:\cli on Windows
    assert library.choose_library("/cli", "/settings", env) == library.LibraryChoice(cli, "--llama-lib")
    assert library.choose_library(None, "/settings", env) == library.LibraryChoice(settings, "Settings")
    assert library.choose_library(None, None, env) == library.LibraryChoice(tmp_path / "env", library.APP_ENV_VAR)
    assert library.choose_library(None, None, {}) is None
    assert library.choose_library("", "  ", {library.APP_ENV_VAR: ""}) is None, "blank means unset"
    assert library.choose_library_dir(None, "/settings", env) == settings


def test_llama_cpp_own_variable_is_not_a_user_setting():
    # LLAMA_CPP_LIB_PATH is how we hand the choice to llama_cpp, not a place users set it
    assert library.choose_library(None, None, {"LLAMA_CPP_LIB_PATH": "/x"}) is None


# -- finding the file ---------------------------------------------------------------------------------

def test_missing_folder_names_the_folder_and_the_setting(tmp_path):
    with pytest.raises(LibraryError, match=r"folder not found: .*nowhere \(from --llama-lib\)"):
        library.preflight(tmp_path / "nowhere", source="--llama-lib")


def test_a_file_instead_of_a_folder_is_explained(tmp_path):
    (tmp_path / "llama.dll").write_bytes(pe_header())
    with pytest.raises(LibraryError, match="not a folder.*choose the folder that contains llama.dll"):
        find_library_file(tmp_path / "llama.dll", "win32")


def test_missing_file_names_every_path_tried(tmp_path):
    with pytest.raises(LibraryError) as err:
        find_library_file(tmp_path, "win32", source="Settings")
    text = str(err.value)
    assert str(tmp_path / "llama.dll") in text and str(tmp_path / "libllama.dll") in text
    assert "(from Settings)" in text
    with pytest.raises(LibraryError, match=re.escape(str(tmp_path / "libllama.so"))):
        find_library_file(tmp_path, "linux")


def test_llama_dll_preferred_over_libllama_dll(tmp_path):
    (tmp_path / "libllama.dll").write_bytes(pe_header())
    (tmp_path / "llama.dll").write_bytes(pe_header())
    assert find_library_file(tmp_path, "win32").name == "llama.dll"


# -- bitness and format -------------------------------------------------------------------------------

def test_32_bit_windows_dll_is_refused_with_what_is_needed(tmp_path):
    folder = windows_folder(tmp_path, machine=0x14C, cuda_imports=None)
    with pytest.raises(LibraryError) as err:
        library.preflight(folder, platform="win32", environ={}, machine="x86_64")
    assert "32-bit x86 PE library" in str(err.value)
    assert "a 64-bit x86_64 PE library for Windows is needed" in str(err.value)


def test_linux_library_in_a_windows_folder_is_refused(tmp_path):
    (tmp_path / "llama.dll").write_bytes(elf_header())
    with pytest.raises(LibraryError, match="built for another operating system"):
        check_binary(tmp_path / "llama.dll", "win32", "x86_64")


def test_other_processor_and_garbage_are_refused(tmp_path):
    (tmp_path / "libllama.so").write_bytes(elf_header(machine=183))
    with pytest.raises(LibraryError, match="64-bit arm64 ELF library, for another processor"):
        check_binary(tmp_path / "libllama.so", "linux", "x86_64")
    (tmp_path / "libllama.so").write_bytes(b"<html>404</html>")
    with pytest.raises(LibraryError, match="not a shared library"):
        check_binary(tmp_path / "libllama.so", "linux", "x86_64")


def test_real_bundled_library_reads_as_64_bit():
    kind = read_binary_kind(library.find_library_file(library.bundled_library_dir()))
    assert (kind.format, kind.bits) == ("PE" if sys.platform == "win32" else "ELF", 64)


@pytest.mark.skipif(sys.platform != "linux", reason="the dynamic linker's own message")
def test_wrong_elf_class_from_the_real_loader_is_explained(tmp_path):
    path = tmp_path / "libllama.so"
    path.write_bytes(elf_header(bits=32, machine=3))
    with pytest.raises(OSError) as err:
        ctypes.CDLL(str(path))
    message = explain_load_failure(tmp_path, err.value, "linux", {})
    assert "not a 64-bit library for Linux" in message and "64-bit build is needed" in message


def test_windows_bad_image_error_is_explained(tmp_path):
    err = OSError(193, "[WinError 193] %1 is not a valid Win32 application")
    assert "not a 64-bit library for Windows" in explain_load_failure(tmp_path, err, "win32", {})


# -- CUDA runtime ----------------------------------------------------------------------------------

def test_cuda_runtime_missing_is_explained_before_loading(tmp_path):
    folder = windows_folder(tmp_path)
    cuda = tmp_path / "CUDA" / "v12.4"
    (cuda / "bin").mkdir(parents=True)
    env = {"CUDA_PATH": str(cuda), "SystemRoot": str(system_root(tmp_path))}
    with pytest.raises(LibraryError) as err:
        library.preflight(folder, platform="win32", environ=env, machine="x86_64")
    text = str(err.value)
    assert "built with CUDA (ggml-cuda.dll)" in text
    assert "cudart64_12.dll, cublasLt64_12.dll, cublas64_12.dll were not found" in text
    assert str(cuda / "bin") in text and str(folder) in text, "says where it looked"
    assert "install the CUDA 12 runtime" in text


def test_cuda_runtime_found_in_a_versioned_cuda_path(tmp_path):
    folder = windows_folder(tmp_path)
    cuda = tmp_path / "CUDA" / "v12.6"
    (cuda / "bin").mkdir(parents=True)
    for name in RUNTIME12:
        (cuda / "bin" / name).write_bytes(pe_header())
    env = {"CUDA_PATH": str(tmp_path / "CUDA" / "v13.0"), "CUDA_PATH_V12_6": str(cuda),
           "SystemRoot": str(system_root(tmp_path))}
    assert library.preflight(folder, platform="win32", environ=env, machine="x86_64") == folder / "llama.dll"


def test_cuda_runtime_beside_llama_dll_is_enough(tmp_path):
    folder = windows_folder(tmp_path)
    for name in RUNTIME12:
        (folder / name).write_bytes(pe_header())
    assert missing_cuda_runtime(folder, "win32", {"SystemRoot": str(system_root(tmp_path))}) is None


def test_cuda_13_build_asks_for_cuda_13(tmp_path):
    folder = windows_folder(tmp_path, cuda_imports=("cudart64_13.dll",))
    text = missing_cuda_runtime(folder, "win32", {})
    assert "cudart64_13.dll was not found" in text and "CUDA 13 runtime" in text


def test_missing_nvidia_driver_is_explained(tmp_path):
    folder = windows_folder(tmp_path)
    for name in RUNTIME12:
        (folder / name).write_bytes(pe_header())
    text = missing_cuda_runtime(folder, "win32", {"SystemRoot": str(system_root(tmp_path, driver=False))})
    assert "no NVIDIA driver" in text and "nvcuda.dll" in text


def test_cpu_only_folder_needs_no_cuda(tmp_path):
    folder = windows_folder(tmp_path, cuda_imports=None)
    assert missing_cuda_runtime(folder, "win32", {}) is None


def test_linux_missing_libcudart_is_explained(tmp_path):
    (tmp_path / "libggml-cuda.so").write_bytes(elf_header())
    err = OSError("libcudart.so.12: cannot open shared object file: No such file or directory")
    text = explain_load_failure(tmp_path, err, "linux", {})
    assert "built with CUDA but libcudart.so.12 was not found" in text


def test_cuda_bin_dirs_newest_version_first(tmp_path):
    env = {"CUDA_PATH": "/c/v12.4", "CUDA_PATH_V12_4": "/c/v12.4", "CUDA_PATH_V12_10": "/c/v12.10",
           "CUDA_PATH_V11_8": "/c/v11.8"}
    dirs = [str(d) for d in cuda_bin_dirs(env, "win32")]
    assert dirs[0] == str(Path("/c/v12.4/bin"))
    assert dirs.index(str(Path("/c/v12.10/bin"))) < dirs.index(str(Path("/c/v11.8/bin")))
    assert cuda_bin_dirs(env, "linux") == []


# -- Windows DLL search, by injection ------------------------------------------------------------------------

def test_windows_search_adds_folders_and_preloads_without_touching_path(tmp_path):
    folder = windows_folder(tmp_path)
    cuda = tmp_path / "CUDA"
    (cuda / "bin").mkdir(parents=True)
    added, loaded = [], []
    env = {"CUDA_PATH": str(cuda), "PATH": "C:\\Windows"}
    before = dict(env)
    done = prepare_windows_search(folder / "llama.dll", environ=env, platform="win32",
                                  add_dll_directory=added.append,
                                  loader=lambda path, winmode: loaded.append((path, winmode)))
    assert added == [str(folder), str(cuda / "bin")] == [str(d) for d in done.folders]
    assert loaded == [(str(folder / "llama.dll"), SAFE_WINMODE)], "no runtime found: nothing preloaded"
    assert SAFE_WINMODE == 0x1100
    assert env == before, "PATH is never rewritten"


def test_windows_search_is_a_no_op_elsewhere(tmp_path):
    calls = []
    done = prepare_windows_search(tmp_path / "libllama.so", platform="linux",
                                  add_dll_directory=calls.append, loader=calls.append)
    assert done.folders == [] and done.library is None
    assert calls == []


def test_path_guard_undoes_llama_cpp_prepending_path():
    env = {"PATH": r"C:\Windows;C:\Tools"}
    with PathGuard(env):
        env["PATH"] = r"C:\lib;" + env["PATH"]   # what llama_cpp's loader does on Windows
    assert env["PATH"] == r"C:\Windows;C:\Tools"
    env2: dict[str, str] = {}
    with PathGuard(env2):
        env2["PATH"] = "x"
    assert "PATH" not in env2


def test_path_guard_hides_a_stale_cuda_path_from_the_bindings_loader(tmp_path):
    """llama_cpp calls os.add_dll_directory(CUDA_PATH/bin and /lib): WinError 3 if gone."""
    whole = tmp_path / "v12.4"
    for sub in ("bin", "lib"):
        (whole / sub).mkdir(parents=True)
    env = {"PATH": "p", "CUDA_PATH": str(tmp_path / "v12.2-removed"), "HIP_PATH": str(whole)}
    with PathGuard(env, platform="win32"):
        seen = dict(env)
    assert "CUDA_PATH" not in seen and seen["HIP_PATH"] == str(whole)
    assert env["CUDA_PATH"] == str(tmp_path / "v12.2-removed")      # put back afterwards
    with PathGuard(env, platform="linux"):
        assert "CUDA_PATH" in env


def test_the_dll_a_library_misses_is_named_through_its_dependencies(tmp_path):
    from native.libfile import missing_dependencies
    system32 = tmp_path / "Windows" / "System32"
    system32.mkdir(parents=True)
    (system32 / "kernel32.dll").write_bytes(pe_header())
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "llama.dll").write_bytes(pe_image(["KERNEL32.dll", "ggml.dll", "api-ms-win-crt-heap-l1-1-0.dll"]))
    (folder / "GGML.DLL").write_bytes(pe_image(["kernel32.dll", "libomp140.x86_64.dll"]))
    env = {"SystemRoot": str(system32.parent)}
    assert missing_dependencies(folder / "llama.dll", [folder], env) == ["libomp140.x86_64.dll"]
    err = FileNotFoundError("Could not find module 'llama.dll' (or one of its dependencies).")
    assert "llama.dll needs libomp140.x86_64.dll" in explain_load_failure(folder, err, "win32", env)


def test_windows_load_failure_of_a_dependency_is_explained(tmp_path):
    folder = windows_folder(tmp_path, cuda_imports=None)
    err = FileNotFoundError("Could not find module 'llama.dll' (or one of its dependencies).")
    text = explain_load_failure(folder, err, "win32", {})
    assert "keep every DLL of the llama.cpp release together" in text


# -- ABI check with fake bindings --------------------------------------------------------------------------------

def _fake_bindings(**changes):
    import llama_cpp.llama_cpp as ll
    cparams, mparams = ll.llama_context_default_params(), ll.llama_model_default_params()
    for name, value in changes.items():
        setattr(cparams if hasattr(cparams, name) and name != "main_gpu" else mparams, name, value)
    lib = SimpleNamespace(**{name: object() for name in library.REQUIRED_SYMBOLS})
    return SimpleNamespace(_lib=lib, llama_context_default_params=lambda: cparams,
                           llama_model_default_params=lambda: mparams)


def test_abi_check_accepts_the_real_defaults():
    library.check_abi(_fake_bindings(), Path("llama.dll"))


def test_abi_check_refuses_shifted_defaults():
    with pytest.raises(LibraryError) as err:
        library.check_abi(_fake_bindings(n_batch=512, type_k=0), Path("llama.dll"))
    assert "n_batch reads 512, expected 2048" in str(err.value) and COMMIT in str(err.value)


def test_abi_check_names_missing_functions():
    fake = _fake_bindings()
    del fake._lib.llama_decode
    with pytest.raises(LibraryError, match=f"lacks 1 of .*llama_decode.*{COMMIT}"):
        library.check_abi(fake, Path("llama.dll"))


def test_bound_symbols_are_read_from_the_bindings():
    names = library.bound_symbols()
    assert len(names) > 200 and "llama_decode" in names and "llama_max_devices" in names
    assert set(library.REQUIRED_SYMBOLS) <= set(names)


# -- devices and plug-in backends, with a fake ggml ----------------------------------------------------------------

class FakeGgml:
    """ggml's registry functions; byref arguments are written through ``._obj``."""

    def __init__(self, registered: list[str], devices: list[tuple]) -> None:
        self.regs, self.devs, self.loaded_from = list(registered), devices, None
        self.plugins = ["CUDA", "CPU"]
        f = lambda fn: fn  # noqa: E731 - plain functions accept argtypes/restype attributes
        self.ggml_backend_reg_count = f(lambda: len(self.regs))
        self.ggml_backend_reg_get = f(lambda i: i)
        self.ggml_backend_reg_name = f(lambda i: self.regs[i].encode())
        self.ggml_backend_dev_count = f(lambda: len(self.devs))
        self.ggml_backend_dev_get = f(lambda i: i)
        self.ggml_backend_dev_name = f(lambda d: self.devs[d][0].encode())
        self.ggml_backend_dev_description = f(lambda d: self.devs[d][1].encode())
        self.ggml_backend_dev_type = f(lambda d: self.devs[d][2])

        def memory(d, free, total):
            free._obj.value, total._obj.value = self.devs[d][3], self.devs[d][4]
        self.ggml_backend_dev_memory = f(memory)

        def load_all(path):
            self.loaded_from = path
            self.regs = list(self.plugins)
        self.ggml_backend_load_all_from_path = f(load_all)


def test_cuda_device_name_and_free_vram_are_listed():
    ggml = FakeGgml(["CUDA", "CPU"], [("CUDA0", "NVIDIA GeForce RTX 4090", 1, 20 << 30, 24 << 30),
                                       ("CPU", "AMD Ryzen", 0, 60 << 30, 64 << 30)])
    from native.sysinfo import _declare
    _declare(ggml)
    devs = list_devices_from(ggml)
    assert devs[0].kind == "GPU" and devs[0].description == "NVIDIA GeForce RTX 4090"
    assert devs[0].memory_free == 20 << 30 and devs[0].memory_total == 24 << 30


def test_the_registry_is_read_from_ggml_and_ggml_base_together(tmp_path):
    """Windows: ggml.dll lacks ggml_backend_dev_name & co., ggml-base.dll has them."""
    full = FakeGgml(["CPU"], [("CPU", "AMD Ryzen", 0, 60 << 30, 64 << 30)])
    split = {"ggml_backend_dev_name", "ggml_backend_dev_description", "ggml_backend_dev_type",
             "ggml_backend_dev_memory", "ggml_backend_reg_name"}

    class Only:
        def __init__(self, names):
            for name in names:
                setattr(self, name, getattr(full, name))
    names = [n for n in vars(full) if n.startswith("ggml_")]
    libs = {"ggml.dll": Only([n for n in names if n not in split]), "ggml-base.dll": Only(split)}
    for name in libs:
        (tmp_path / name).write_bytes(pe_header())
    devices = list_devices(tmp_path, "win32", opener=lambda path: libs[Path(path).name])
    assert [(d.name, d.kind, d.memory_total) for d in devices] == [("CPU", "CPU", 64 << 30)]
    (tmp_path / "ggml-base.dll").unlink()      # without it: no list, and no crash
    assert list_devices(tmp_path, "win32", opener=lambda path: libs[Path(path).name]) == []


def test_plugin_backends_load_from_the_library_folder(tmp_path):
    (tmp_path / "ggml.dll").write_bytes(pe_header())
    ggml = FakeGgml([], [])
    names = load_dynamic_backends(tmp_path, "win32", opener=lambda path: ggml)
    assert ggml.loaded_from == str(tmp_path).encode("utf-8")
    assert names == ["CUDA", "CPU"]


def test_linked_in_backends_are_left_alone(tmp_path):
    (tmp_path / "libggml.so").write_bytes(elf_header())
    ggml = FakeGgml(["CPU"], [])
    assert load_dynamic_backends(tmp_path, "linux", opener=lambda path: ggml) == []
    assert ggml.loaded_from is None


# -- the probe: real child processes, fake and real libraries ----------------------------------------------------

def _gcc(tmp_path: Path, source: str, name: str = "libllama.so") -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build a fake libllama")
    folder = tmp_path / "fake"
    folder.mkdir(exist_ok=True)
    (tmp_path / "fake.c").write_text(source)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / name), str(tmp_path / "fake.c")],
                   check=True, capture_output=True)
    return folder


def test_probe_refuses_a_library_lacking_functions(tmp_path):
    folder = _gcc(tmp_path, textwrap.dedent("""
        void llama_backend_init(void) {}
        int llama_model_default_params(void) { return 0; }
        int llama_print_system_info(void) { return 0; }
    """))
    report = probe.probe_library(folder, timeout_s=60)
    assert not report.ok and report.stage == "symbols"
    assert re.search(r"lacks 2\d\d of the 2\d\d functions", report.reason), report.reason
    assert "llama_model_load_from_file" in report.reason, "the functions native/ calls come first"
    assert COMMIT in report.reason and str(folder / "libllama.so") in report.reason


def _all_symbols_source(crash_in: str) -> str:
    lines = ["#include <stddef.h>", "size_t llama_max_devices(void) { return 16; }"]
    for name in library.bound_symbols():
        if name == "llama_max_devices":
            continue
        if name == crash_in:
            lines.append(f"void {name}(void) {{ *(volatile int *)0 = 42; }}")
        else:
            lines.append(f"void {name}(void) {{}}")
    return "\n".join(lines)


def test_probe_reports_a_crash_and_the_parent_survives(tmp_path):
    folder = _gcc(tmp_path, _all_symbols_source(crash_in="llama_context_default_params"))
    report = probe.probe_library(folder, timeout_s=120)
    assert not report.ok
    assert report.stage == "abi"
    assert "crashed (SIGSEGV) while reading the default parameters back" in report.reason
    assert "another llama.cpp build" in report.reason


def test_probe_reports_a_crash_on_load(tmp_path):
    folder = _gcc(tmp_path, "__attribute__((constructor)) static void boom(void) "
                            "{ *(volatile int *)0 = 1; }\nvoid llama_backend_init(void) {}\n")
    report = probe.probe_library(folder, timeout_s=60)
    assert not report.ok and report.stage == "open"
    assert "crashed (SIGSEGV) while opening the library" in report.reason


def test_probe_reports_a_hang(tmp_path):
    report = probe.probe_library(tmp_path, timeout_s=2, command=[
        sys.executable, "-c", "import time; print('{\"stage\": \"backend_init\"}', flush=True); "
                              "time.sleep(30)"])
    assert not report.ok and "did not answer within 2 s while llama_backend_init" in report.reason


def test_the_detail_is_what_the_library_said_not_faulthandlers_dump():
    """faulthandler's dump ends with "Extension modules: ...": the detail is the line before it."""
    stderr = ("GGML_ASSERT(hparams.n_ctx > 0) failed\n"
              "Fatal Python error: Aborted\n\nCurrent thread 0x00007f (most recent call first):\n"
              '  File "native/library.py", line 300 in check_abi\n\n'
              "Extension modules: numpy.core._multiarray_umath, isal.isal_zlib (total: 2)\n")
    report = probe.interpret(Path("/x"), -6, '{"stage": "abi"}\n', stderr)
    assert "[GGML_ASSERT(hparams.n_ctx > 0) failed]" in report.reason, report.reason
    report = probe.interpret(Path("/x"), -11, '{"stage": "abi"}\n', stderr.split("\n", 1)[1])
    assert "[Fatal Python error: Aborted]" in report.reason
    traceback = ('Traceback (most recent call last):\n  File "x", line 1\n    f()\n'
                 "OSError: exception: access violation\n")
    assert "[OSError: exception: access violation]" in probe.interpret(Path("C:/x"), 1, "", traceback).reason


def test_the_probe_child_gets_faulthandler_off_windows_only(tmp_path):
    seen = {}

    def run(argv, **kwargs):
        seen[kwargs.get("creationflags", 0)] = kwargs["env"].get("PYTHONFAULTHANDLER")
        return subprocess.CompletedProcess(argv, 0, stdout=b'{"ok": true}\n', stderr=b"")
    probe.probe_library(tmp_path, platform="linux", run=run)
    probe.probe_library(tmp_path, platform="win32", run=run)
    assert seen == {0: "1", probe.CREATE_NO_WINDOW: None}


def test_interpret_windows_access_violation():
    report = probe.interpret(Path("C:/x"), 0xC0000005, '{"stage": "import"}\n', "")
    assert "access violation 0xC0000005" in report.reason and "importing" in report.reason


def test_probe_passes_the_real_bundled_library():
    report = probe.probe_library(library.bundled_library_dir(), timeout_s=120)
    assert report.ok, report.reason
    assert report.stage == "devices"
    assert any(d["kind"] == "CPU" for d in report.devices)
    assert "CPU" in report.system_info


def test_cli_refuses_a_bad_folder_in_one_line(tmp_path):
    folder = _gcc(tmp_path, "void llama_backend_init(void) {}\n")
    env = dict(os.environ, CHECKPOINT_CHAT_LLAMA_LIB=str(folder))
    done = subprocess.run([sys.executable, "-m", "engine.cli", "info"], capture_output=True,
                          text=True, timeout=120, cwd=str(ROOT), env=env)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "lacks" in lines[0], done.stderr


# -- GPU offload plumbing --------------------------------------------------------------------------------------------

def test_main_gpu_beyond_the_build_is_refused_before_loading(smollm_path):
    from native.errors import ModelLoadError
    from native.model import GPU_LAYERS_ALL, Model
    with pytest.raises(ModelLoadError, match="main GPU 99 does not exist"):
        Model(smollm_path, main_gpu=99)
    with Model(smollm_path, n_gpu_layers=GPU_LAYERS_ALL, main_gpu=0) as model:
        assert model.n_gpu_layers == -1 and model.main_gpu == 0   # CPU build: same as 0
