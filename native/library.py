"""Which llama.cpp library to load, loading it, and refusing one we cannot safely call.

``llama_cpp`` (llama-cpp-python's ctypes bindings) loads libllama when it is first
imported and reads ``LLAMA_CPP_LIB_PATH`` at that moment, so the folder must be chosen
before anything imports it.  Everything in native/ reaches the bindings through
:func:`bindings`, which performs that choice exactly once per process.

Where the folder comes from, first match wins (:func:`choose_library`):
``--llama-lib DIR`` on the command line, the folder in Settings, the environment
variable ``CHECKPOINT_CHAT_LLAMA_LIB``, else the library llama-cpp-python built.

A library built from another llama.cpp commit has other struct layouts: calling it
corrupts memory instead of failing.  A folder the user picked is therefore checked
first without loading (:mod:`native.libfile`: file present, 64-bit, CUDA runtime
present), then probed in a child process (:mod:`native.probe`: symbols, default
parameters read back, backend init), so a crash there costs nothing but an error
message.  The bundled library, built together with the bindings, is only
sanity-checked in process.  On Windows the DLL search is set up by
:mod:`native.dllsearch` (``os.add_dll_directory``, never PATH).

Loading is one sequence of stages (:func:`load_sequence`, named in
:data:`native.probe.LOAD_STAGES`) that this process and the probe child
(:mod:`native.probe_child`) both run, the child announcing each stage: what the probe
accepts is what the app then loads, in the same order, with the same DLL search.
The last stage refuses a CUDA build that came up without a GPU device: never a silent
CPU fallback.
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from native.dllsearch import PathGuard, absolute, default_loader, dll_directories, prepare_windows_search  # noqa: F401
from native.errors import LibraryError
from native.libfile import (  # noqa: F401
    BINDINGS_VERSION,
    REQUIRED_LLAMA_CPP_COMMIT,
    check_binary,
    cuda_device_problem,
    explain_load_failure,
    find_library_file,
    library_filenames,
    missing_cuda_runtime,
)
from native.logs import install_log_router
from native.probe import Stage, no_stage, probe_library
from native.sysinfo import Device, ggml_library, list_backends, list_devices, list_devices_from, load_dynamic_backends

log = logging.getLogger("native")

#: Environment variable the app reads (the CLI flag and Settings take precedence).
APP_ENV_VAR = "CHECKPOINT_CHAT_LLAMA_LIB"
#: Environment variable llama-cpp-python itself reads at import time.
BINDINGS_ENV_VAR = "LLAMA_CPP_LIB_PATH"

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
    "llama_synchronize",
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
    "llama_supports_gpu_offload",
    "llama_model_is_recurrent",
    "llama_model_is_hybrid",
    "llama_model_rope_type",
)


def bundled_library_dir() -> Path | None:
    """The folder of the library llama-cpp-python built, without importing it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def bound_symbols() -> tuple[str, ...]:
    """Every function ``llama_cpp.llama_cpp`` binds at import time (read from its source).

    Importing the bindings fails on the first one a library lacks; listing them all up
    front lets the refusal name every missing function, not just the first.
    """
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return ()
    source = Path(list(spec.submodule_search_locations)[0]) / "llama_cpp.py"
    try:
        text = source.read_text("utf-8")
    except OSError:
        return ()
    names = re.findall(r'ctypes_function\(\s*"(\w+)"', text) + re.findall(r"_lib\.(\w+)\.", text)
    return tuple(dict.fromkeys(names))


# -- which folder ----------------------------------------------------------------------------

@dataclass(frozen=True)
class LibraryChoice:
    """A user-chosen library folder and the setting it came from (for error messages)."""
    folder: Path
    source: str


def choose_library(cli_dir: str | os.PathLike | None = None,
                   settings_dir: str | os.PathLike | None = None,
                   environ: Mapping[str, str] | None = None) -> LibraryChoice | None:
    """The CLI flag, else Settings, else the environment; None means the bundled one.

    The folder is made absolute here, against the current folder: Windows' DLL search
    calls refuse relative paths (WinError 87), and the probe child must see the same one.
    """
    environ = os.environ if environ is None else environ
    for candidate, source in ((cli_dir, "--llama-lib"), (settings_dir, "Settings"),
                              (environ.get(APP_ENV_VAR), APP_ENV_VAR)):
        if candidate is not None and str(candidate).strip():
            return LibraryChoice(absolute(Path(str(candidate).strip()).expanduser()), source)
    return None


def choose_library_dir(cli_dir: str | os.PathLike | None = None,
                       settings_dir: str | os.PathLike | None = None,
                       environ: Mapping[str, str] | None = None) -> Path | None:
    """:func:`choose_library`'s folder only, for callers that do not need the source."""
    choice = choose_library(cli_dir, settings_dir, environ)
    return choice.folder if choice else None


def preflight(folder: Path, *, source: str = "", platform: str = sys.platform,
              environ: Mapping[str, str] | None = None, machine: str | None = None) -> Path:
    """Every check that needs no loading; returns the library file or raises LibraryError."""
    environ = os.environ if environ is None else environ
    path = find_library_file(folder, platform, source=source)
    check_binary(path, platform, machine)
    cuda = missing_cuda_runtime(folder, platform, environ)
    if cuda:
        raise LibraryError(cuda)
    return path


# -- loading ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoadedLibrary:
    """What was loaded, for `info`, checkpoint headers and the GUI."""
    path: Path
    folder: Path
    bundled: bool
    version: str
    source: str = "bundled"
    devices: tuple[Device, ...] = ()          # as listed right after loading

    @property
    def identity(self) -> str:
        """Short identity written into checkpoint headers (at most 32 bytes)."""
        return f"llama.cpp {self.version}"[:32]


_lock = threading.Lock()
_loaded: LoadedLibrary | None = None
_bindings: ModuleType | None = None


def bindings(lib_dir: Path | LibraryChoice | None = None, *, probe: bool = True,
             stage: Stage = no_stage) -> ModuleType:
    """Import ``llama_cpp.llama_cpp`` with the chosen library and return it.

    The first call decides the library for the life of the process; a later call that
    asks for another folder fails rather than silently using the first one.  ``stage``
    is called before each stage of :func:`load_sequence` (the probe child prints them).
    """
    global _loaded, _bindings
    choice = lib_dir if isinstance(lib_dir, LibraryChoice) or lib_dir is None \
        else LibraryChoice(absolute(lib_dir), "the chosen folder")
    with _lock:
        if _bindings is not None:
            if choice is not None and _loaded and choice.folder.resolve() != _loaded.folder.resolve():
                raise LibraryError(
                    f"the llama library from {_loaded.folder} is already loaded; "
                    "restart the app to use another one")
            return _bindings
        folder = bundled_library_dir() if choice is None else absolute(choice.folder)
        if folder is None:
            raise LibraryError(
                f"llama-cpp-python is not installed; install llama-cpp-python=={BINDINGS_VERSION}")
        source = choice.source if choice else "bundled"
        path = preflight(folder, source=source) if choice else find_library_file(folder)
        if choice is not None and probe:
            report = probe_library(folder)
            if not report.ok:
                raise LibraryError(report.reason)
        ll, devices = load_sequence(folder, path, chosen=choice is not None, stage=stage)
        version = library_version(ll)
        _loaded = LoadedLibrary(path=path, folder=folder, bundled=choice is None,
                                version=version, source=source, devices=tuple(devices))
        _bindings = ll
        log.info("loaded %s (%s, from %s)", path, version, source)
        return ll


def load_sequence(folder: Path, path: Path, *, chosen: bool,
                  stage: Stage = no_stage) -> tuple[ModuleType, list[Device]]:
    """Load ``path`` into this process, stage by stage; returns the bindings and devices.

    The app and the probe child (``python -m native.probe_child``) both run exactly this,
    so a library the child accepted is loaded the same way, with the same DLL search, here.
    Its stages are :data:`native.probe.LOAD_STAGES`, in that order.
    """
    stage("open")
    try:
        search = prepare_windows_search(path)
        handle = search.library if search.library is not None else default_loader(str(path))
    except OSError as exc:
        raise LibraryError(explain_load_failure(folder, exc)) from exc
    stage("symbols")
    wanted = tuple(dict.fromkeys(REQUIRED_SYMBOLS + bound_symbols()))
    missing = missing_symbols(handle, wanted)
    if missing:
        raise LibraryError(symbols_refusal(path, missing, len(wanted)))
    stage("import")
    try:
        if chosen:
            os.environ[BINDINGS_ENV_VAR] = str(folder)
        with PathGuard():
            import llama_cpp.llama_cpp as ll
    except (OSError, RuntimeError, AttributeError) as exc:
        raise LibraryError(explain_load_failure(folder, exc)) from exc
    stage("abi")
    check_abi(ll, path)
    install_log_router(ll)
    stage("backends")
    load_dynamic_backends(folder)
    stage("backend_init")
    ll.llama_backend_init()
    stage("devices")
    devices = list_devices(folder)
    problem = cuda_device_problem(folder, [d.kind for d in devices])
    if problem:
        raise LibraryError(problem)
    return ll, devices


def library_version(ll: ModuleType) -> str:
    fn = getattr(ll, "llama_version", None)
    if fn is None:
        return f"llama-cpp-python {BINDINGS_VERSION}"
    return fn().decode("utf-8", "replace")


def loaded_library() -> LoadedLibrary:
    """The library in use, loading the bundled one if none was chosen yet."""
    bindings()
    assert _loaded is not None
    return _loaded


@dataclass(frozen=True)
class SystemInfo:
    """What the loaded library reports of itself and of the hardware it sees (``info``)."""
    library_path: str
    library_version: str
    bundled: bool
    gpu_offload: bool
    features: str
    devices: list[Device] = field(default_factory=list)
    backends: list[str] = field(default_factory=list)
    source: str = "bundled"

    @property
    def backend_label(self) -> str:
        """"CPU", or the first GPU's name, for a status bar."""
        gpus = [d for d in self.devices if d.kind in ("GPU", "iGPU")]
        return f"{gpus[0].kind} {gpus[0].description or gpus[0].name}" if gpus else "CPU"


def system_info() -> SystemInfo:
    ll = bindings()
    lib = loaded_library()
    ggml = ggml_library(lib.folder)
    return SystemInfo(
        library_path=str(lib.path),
        library_version=lib.version,
        bundled=lib.bundled,
        gpu_offload=bool(ll.llama_supports_gpu_offload()),
        features=ll.llama_print_system_info().decode("utf-8", "replace").strip(),
        devices=list_devices_from(ggml) if ggml is not None else [],
        backends=list_backends(ggml) if ggml is not None else [],
        source=lib.source,
    )


# -- ABI ----------------------------------------------------------------------------------------

def missing_symbols(lib, names=REQUIRED_SYMBOLS) -> list[str]:
    """The names ``lib`` (a ctypes.CDLL or anything with attributes) does not export."""
    missing = []
    for name in names:
        try:
            getattr(lib, name)
        except AttributeError:
            missing.append(name)
    return missing


def symbols_refusal(path: Path, missing: list[str], total: int) -> str:
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return (f"the llama library {path} lacks {len(missing)} of the {total} functions this app "
            f"calls ({shown}): it was built from another llama.cpp; commit "
            f"{REQUIRED_LLAMA_CPP_COMMIT} (llama-cpp-python {BINDINGS_VERSION}) is needed")


def check_abi(ll: ModuleType, path: Path) -> None:
    """Refuse a library whose defaults do not read back as this build's do.

    Reading the default parameter structs is the cheapest call that exercises the
    struct layouts: a library from another commit returns values shifted into other
    fields.  The expected values are llama.cpp's documented defaults.
    """
    if ctypes.sizeof(ctypes.c_void_p) != 8:
        raise LibraryError("Checkpoint Chat needs a 64-bit Python")
    missing = missing_symbols(ll._lib)
    if missing:
        raise LibraryError(symbols_refusal(path, missing, len(REQUIRED_SYMBOLS)))
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
        ("n_gpu_layers", mparams.n_gpu_layers, -1),
        ("main_gpu", mparams.main_gpu, 0),
        ("split_mode", mparams.split_mode, 1),
        ("vocab_only", bool(mparams.vocab_only), False),
        ("check_tensors", bool(mparams.check_tensors), False),
    ]
    return [f"{name} reads {got!r}, expected {want!r}" for name, got, want in expect if got != want]
