"""Which llama.cpp library to load, loading it, and refusing one we cannot safely call.

``llama_cpp`` (llama-cpp-python's ctypes bindings) loads libllama when it is first
imported and reads ``LLAMA_CPP_LIB_PATH`` at that moment, so the folder must be chosen
before anything imports it.  Everything in native/ reaches the bindings through
:func:`bindings`, which performs that choice exactly once per process.

A library built from another llama.cpp commit has other struct layouts: calling it
corrupts memory instead of failing.  A folder the user picked is therefore probed in a
child process first (:mod:`native.probe`), so a crash there costs nothing but an error
message; the bundled library, built together with the bindings, is only sanity-checked
in process.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from native.errors import LibraryError

log = logging.getLogger("native")

#: Environment variable the app reads (the CLI flag and Settings take precedence).
APP_ENV_VAR = "CHECKPOINT_CHAT_LLAMA_LIB"
#: Environment variable llama-cpp-python itself reads at import time.
BINDINGS_ENV_VAR = "LLAMA_CPP_LIB_PATH"

#: llama-cpp-python 0.3.36 vendors this llama.cpp commit (its CHANGELOG); a user's own
#: library is only safe to call when built from it.
REQUIRED_LLAMA_CPP_COMMIT = "0c1e57098"
BINDINGS_VERSION = "0.3.36"

#: Functions native/ calls.  A library lacking any of them is from another build.
REQUIRED_SYMBOLS = (
    "llama_backend_init",
    "llama_model_default_params",
    "llama_context_default_params",
    "llama_model_load_from_file",
    "llama_model_free",
    "llama_init_from_model",
    "llama_free",
    "llama_decode",
    "llama_get_logits_ith",
    "llama_get_memory",
    "llama_memory_clear",
    "llama_memory_seq_rm",
    "llama_memory_seq_cp",
    "llama_memory_seq_pos_max",
    "llama_state_seq_get_size",
    "llama_state_seq_get_data",
    "llama_state_seq_set_data",
    "llama_set_abort_callback",
    "llama_tokenize",
    "llama_token_to_piece",
    "llama_chat_apply_template",
    "llama_model_chat_template",
    "llama_sampler_chain_init",
    "llama_sampler_apply",
    "llama_log_set",
    "llama_print_system_info",
)


def library_filenames(platform: str = sys.platform) -> tuple[str, ...]:
    """The file names llama-cpp-python looks for in a folder, on ``platform``."""
    if platform == "win32":
        return ("llama.dll", "libllama.dll")
    if platform == "darwin":
        return ("libllama.dylib", "libllama.so")
    return ("libllama.so",)


def bundled_library_dir() -> Path | None:
    """The folder of the library llama-cpp-python built, without importing it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def choose_library_dir(cli_dir: str | os.PathLike | None = None,
                       settings_dir: str | os.PathLike | None = None,
                       environ: dict[str, str] | None = None) -> Path | None:
    """The user's library folder: the CLI flag, else Settings, else the environment.

    ``None`` means the bundled library.
    """
    environ = os.environ if environ is None else environ
    for candidate in (cli_dir, settings_dir, environ.get(APP_ENV_VAR)):
        if candidate:
            return Path(candidate).expanduser()
    return None


def find_library_file(folder: Path, platform: str = sys.platform) -> Path:
    """The library inside ``folder``; the error names every path it tried."""
    if not folder.is_dir():
        raise LibraryError(f"llama library folder not found: {folder}")
    tried = [folder / name for name in library_filenames(platform)]
    for path in tried:
        if path.is_file():
            return path
    raise LibraryError(
        "no llama library in " + str(folder) + " (looked for "
        + ", ".join(p.name for p in tried) + ")")


def dll_directories(folder: Path, environ: dict[str, str] | None = None) -> list[Path]:
    """Folders Windows must search for llama.dll's dependencies (ggml, CUDA runtime)."""
    environ = os.environ if environ is None else environ
    dirs = [folder]
    cuda = environ.get("CUDA_PATH")
    if cuda:
        dirs.append(Path(cuda) / "bin")
    return [d for d in dirs if d.is_dir()]


def explain_load_failure(folder: Path, error: BaseException,
                         environ: dict[str, str] | None = None) -> str:
    """Turn the loader's terse error into what the user should do about it."""
    text = str(error)
    if "%1 is not a valid Win32" in text or "wrong ELF class" in text or "mach-o" in text.lower():
        return (f"the llama library in {folder} is not a 64-bit library for this "
                f"{'Windows' if sys.platform == 'win32' else 'system'}; a 64-bit build is needed")
    cuda_libs = sorted(p.name for p in folder.glob("*ggml-cuda*")) if folder.is_dir() else []
    if cuda_libs:
        runtime = _find_cuda_runtime(folder, environ)
        if runtime is None:
            return (f"the llama library in {folder} was built with CUDA ({cuda_libs[0]}) but the "
                    "CUDA 12 runtime (cudart64_12.dll / libcudart.so.12) was not found; "
                    "install the CUDA 12 runtime or a recent NVIDIA driver")
    if isinstance(error, AttributeError):
        return (f"the llama library in {folder} lacks a function this app needs ({text}); "
                f"it comes from another llama.cpp build, commit {REQUIRED_LLAMA_CPP_COMMIT} "
                f"(llama-cpp-python {BINDINGS_VERSION}) is needed")
    return f"could not load the llama library from {folder}: {text}"


def _find_cuda_runtime(folder: Path, environ: dict[str, str] | None) -> Path | None:
    environ = os.environ if environ is None else environ
    names = ("cudart64_12.dll", "libcudart.so.12")
    places = [folder]
    if environ.get("CUDA_PATH"):
        places += [Path(environ["CUDA_PATH"]) / "bin", Path(environ["CUDA_PATH"]) / "lib64"]
    for place in places:
        for name in names:
            if (place / name).is_file():
                return place / name
    return None


@dataclass(frozen=True)
class LoadedLibrary:
    """What was loaded, for `info`, checkpoint headers and the GUI."""
    path: Path
    folder: Path
    bundled: bool
    version: str

    @property
    def identity(self) -> str:
        """Short identity written into checkpoint headers (at most 32 bytes)."""
        return f"llama.cpp {self.version}"[:32]


_lock = threading.Lock()
_loaded: LoadedLibrary | None = None
_bindings: ModuleType | None = None


def bindings(lib_dir: Path | None = None, *, probe: bool = True) -> ModuleType:
    """Import ``llama_cpp.llama_cpp`` with the chosen library and return it.

    The first call decides the library for the life of the process; a later call that
    asks for another folder fails rather than silently using the first one.
    """
    global _loaded, _bindings
    with _lock:
        if _bindings is not None:
            if lib_dir is not None and _loaded and Path(lib_dir).resolve() != _loaded.folder.resolve():
                raise LibraryError(
                    f"the llama library from {_loaded.folder} is already loaded; "
                    "restart the app to use another one")
            return _bindings
        folder = bundled_library_dir() if lib_dir is None else Path(lib_dir)
        if folder is None:
            raise LibraryError(
                f"llama-cpp-python is not installed; install llama-cpp-python=={BINDINGS_VERSION}")
        path = find_library_file(folder)
        if lib_dir is not None:
            if probe:
                from native.probe import probe_library
                report = probe_library(folder)
                if not report.ok:
                    raise LibraryError(report.reason)
            if sys.platform == "win32":
                for d in dll_directories(folder):
                    os.add_dll_directory(str(d))
            os.environ[BINDINGS_ENV_VAR] = str(folder)
        try:
            import llama_cpp.llama_cpp as ll
        except (OSError, RuntimeError, FileNotFoundError, AttributeError) as exc:
            raise LibraryError(explain_load_failure(folder, exc)) from exc
        check_abi(ll, path)
        from native.logs import install_log_router
        install_log_router(ll)
        ll.llama_backend_init()
        version = ll.llama_version().decode("utf-8", "replace") if hasattr(ll, "llama_version") else "unknown"
        _loaded = LoadedLibrary(path=path, folder=folder, bundled=lib_dir is None, version=version)
        _bindings = ll
        log.info("loaded %s (%s)", path, version)
        return ll


def loaded_library() -> LoadedLibrary:
    """The library in use, loading the bundled one if none was chosen yet."""
    bindings()
    assert _loaded is not None
    return _loaded


def check_abi(ll: ModuleType, path: Path) -> None:
    """Refuse a library whose defaults do not read back as this build's do.

    Reading the default parameter structs is the cheapest call that exercises the
    struct layouts: a library from another commit returns values shifted into other
    fields.  The expected values are llama.cpp's documented defaults.
    """
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise LibraryError("Checkpoint Chat needs a 64-bit Python")
    lib = ll._lib
    missing = [name for name in REQUIRED_SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise LibraryError(
            f"the llama library {path} lacks {', '.join(missing[:3])}: it was built from "
            f"another llama.cpp; commit {REQUIRED_LLAMA_CPP_COMMIT} is needed")
    problems = abi_problems(ll.llama_context_default_params(), ll.llama_model_default_params())
    if problems:
        raise LibraryError(
            f"the llama library {path} does not match these bindings ({'; '.join(problems)}); "
            f"it was built from another llama.cpp, commit {REQUIRED_LLAMA_CPP_COMMIT} is needed")


def abi_problems(cparams, mparams) -> list[str]:
    """Fields of the default parameter structs that do not read back plausibly."""
    expect = [
        ("n_ctx", cparams.n_ctx, 512),
        ("n_batch", cparams.n_batch, 2048),
        ("n_ubatch", cparams.n_ubatch, 512),
        ("n_seq_max", cparams.n_seq_max, 1),
        ("type_k", cparams.type_k, 1),
        ("type_v", cparams.type_v, 1),
        ("flash_attn_type", cparams.flash_attn_type, -1),
        ("yarn_ext_factor", cparams.yarn_ext_factor, -1.0),
        ("main_gpu", mparams.main_gpu, 0),
        ("vocab_only", bool(mparams.vocab_only), False),
        ("check_tensors", bool(mparams.check_tensors), False),
    ]
    return [f"{name} reads {got!r}, expected {want!r}" for name, got, want in expect if got != want]
