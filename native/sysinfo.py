"""What hardware llama.cpp sees: backends, devices and their free memory.

llama-cpp-python does not bind ggml's backend registry, so this module binds the few
functions it needs from the ggml library that sits beside libllama.  Failure to do so
is not fatal: the report then says the device list is unavailable.

It also loads *dynamic* backends.  Official llama.cpp Windows releases are built with
``GGML_BACKEND_DL=ON``: ggml-cuda.dll and the ggml-cpu-*.dll variants are plug-ins that
the release's own programs load with ``ggml_backend_load_all()``, which searches the
*executable's* folder (python.exe's, for us).  libllama does not do it itself, so a
release folder would come up with no device at all; :func:`load_dynamic_backends`
loads them from the library's folder when the registry is empty.

On Windows the registry is split over two DLLs: ``ggml.dll`` exports
``ggml_backend_dev_count/get``, ``ggml_backend_reg_count/get`` and the plug-in loader,
``ggml-base.dll`` the rest (``ggml_backend_dev_name/description/type/memory``,
``ggml_backend_reg_name``).  ``GetProcAddress`` finds only a DLL's own exports, unlike
``dlsym``, which also searches libggml.so's dependencies: :class:`GgmlRegistry` looks each
function up in both.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from native.errors import LibraryError
from native.libfile import ggml_base_filenames, ggml_filenames, missing_dependencies

log = logging.getLogger("native")

# enum ggml_backend_dev_type
_DEVICE_KINDS = {0: "CPU", 1: "GPU", 2: "iGPU", 3: "accelerator"}

#: Opens a library file (tests pass a fake returning an object with ggml's functions).
Opener = Callable[[str], Any]


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


def _open(path: str):
    return ctypes.CDLL(path)


class GgmlRegistry:
    """ggml's registry functions, each from the first of its libraries that exports it."""

    def __init__(self, libs: list[tuple[Path, Any]]) -> None:
        self._libs = libs

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        for _path, lib in self._libs:
            try:
                fn = getattr(lib, name)
            except AttributeError:
                continue
            setattr(self, name, fn)    # found once, then a plain attribute
            return fn
        raise AttributeError(f"function {name!r} not found in "
                             f"{' or '.join(p.name for p, _ in self._libs)}")


def _first_file(folder: Path, names: tuple[str, ...]) -> Path | None:
    return next((folder / n for n in names if (folder / n).is_file()), None)


def ggml_library(folder: Path, platform: str = sys.platform, opener: Opener = _open):
    """ggml's registry in ``folder`` (ggml and ggml-base together), typed, or None."""
    libs = []
    for path in (_first_file(folder, ggml_filenames(platform)),
                 _first_file(folder, ggml_base_filenames(platform))):
        if path is None:
            continue
        try:
            libs.append((path, opener(str(path))))
        except OSError as exc:
            log.warning("cannot open %s: %s", path, exc)
            return None
    if not libs:
        return None
    registry = GgmlRegistry(libs)
    try:
        _declare(registry)
    except AttributeError as exc:
        log.warning("ggml device registry unavailable in %s: %s", folder, exc)
        return None
    return registry


def _declare(lib) -> None:
    # size_t ggml_backend_dev_count(void); ggml_backend_dev_t ggml_backend_dev_get(size_t index)
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    # const char * ggml_backend_dev_name(ggml_backend_dev_t device) (and _description)
    for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
        getattr(lib, fn).restype = ctypes.c_char_p
    # enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device)
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    # void ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total)
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    # size_t ggml_backend_reg_count(void); ggml_backend_reg_t ggml_backend_reg_get(size_t index)
    lib.ggml_backend_reg_count.restype = ctypes.c_size_t
    lib.ggml_backend_reg_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_reg_get.restype = ctypes.c_void_p
    # const char * ggml_backend_reg_name(ggml_backend_reg_t reg)
    lib.ggml_backend_reg_name.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_reg_name.restype = ctypes.c_char_p


def _text(raw) -> str:
    return (raw or b"").decode("utf-8", "replace")


def list_backends(lib) -> list[str]:
    return [_text(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)))
            for i in range(lib.ggml_backend_reg_count())]


def list_devices_from(lib) -> list[Device]:
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(Device(
            name=_text(lib.ggml_backend_dev_name(dev)),
            description=_text(lib.ggml_backend_dev_description(dev)),
            kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
            memory_free=free.value, memory_total=total.value))
    return devices


def list_devices(folder: Path, platform: str = sys.platform, opener: Opener = _open) -> list[Device]:
    lib = ggml_library(folder, platform, opener)
    return list_devices_from(lib) if lib is not None else []


def load_dynamic_backends(folder: Path, platform: str = sys.platform,
                          opener: Opener = _open) -> list[str]:
    """Load plug-in backends from ``folder`` when none is registered; the names loaded.

    A library with backends linked in (llama-cpp-python's builds) already has them
    registered, and is left alone.
    """
    lib = ggml_library(folder, platform, opener)
    if lib is None or lib.ggml_backend_reg_count() > 0:
        return []
    load = getattr(lib, "ggml_backend_load_all_from_path", None)
    if load is None:
        log.warning("no ggml backend registered and %s cannot load plug-ins", folder)
        return []
    # void ggml_backend_load_all_from_path(const char * dir_path)
    load.argtypes = [ctypes.c_char_p]
    load.restype = None
    load(os.fsencode(str(folder)) if platform != "win32" else str(folder).encode("utf-8"))
    names = list_backends(lib)
    log.info("loaded ggml backends from %s: %s", folder, ", ".join(names) or "none")
    if "CPU" not in names:
        problem = cpu_backend_problem(folder, platform)
        if problem:
            raise LibraryError(problem)
    return names


def cpu_backend_problem(folder: Path, platform: str = sys.platform,
                        environ: Mapping[str, str] | None = None) -> str | None:
    """Why the CPU plug-ins in ``folder`` did not load, when a DLL they need is missing.

    ggml's loader skips a plug-in that fails to load without saying why.  The official
    release's CPU backends (ggml-cpu-haswell.dll, ...) import LLVM's OpenMP runtime
    ``libomp140.x86_64.dll``, which ships in the release zip, not with Windows.
    """
    if platform != "win32":
        return None
    plugins = sorted(folder.glob("ggml-cpu*.dll"))
    missing = sorted({name for p in plugins for name in missing_dependencies(p, [folder], environ)})
    if not plugins or not missing:
        return None
    hint = (" (LLVM's OpenMP runtime: it comes in llama.cpp's release zip; copy it beside "
            "llama.dll)" if any(n.lower().startswith("libomp") for n in missing) else "")
    return (f"llama.cpp's CPU backend in {folder} ({', '.join(p.name for p in plugins)}) could not "
            f"be loaded: it needs {', '.join(missing)}, which is not in that folder or in "
            f"System32{hint}")
