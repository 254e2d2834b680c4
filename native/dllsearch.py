"""How llama.dll and the DLLs it needs are found on Windows, without rewriting PATH.

llama-cpp-python 0.3.36's loader (``llama_cpp/_ctypes_extensions.py``) prepends the
library folder to PATH and loads llama.dll with ``winmode=0``: the legacy search order,
in which the folders of ``os.add_dll_directory`` are *not* searched and PATH is.  PATH
edits leak into every child process and let a stray ggml.dll elsewhere on PATH win.

What we do instead, before ``llama_cpp`` is imported:

1. ``os.add_dll_directory`` for the library folder and CUDA's bin folders; the handles
   are kept for the life of the process (closing one removes the folder again).  Both
   ``AddDllDirectory`` and ``LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR`` need absolute paths
   (a relative one fails with WinError 87), so every path is made absolute first.
2. Preload the CUDA runtime (cudart64_N, cublasLt64_N, cublas64_N: dependencies first)
   by full path, from the place :func:`native.libfile.locate_cuda_runtime` found it.
   ggml loads its plug-in backends (ggml-cuda.dll of an official release) with a plain
   ``LoadLibraryW``, whose search ignores the folders of step 1 and reads PATH, which
   step 4 restores before the plug-ins load: without this step a CUDA folder whose
   runtime sits beside llama.dll would load no CUDA backend and run on the CPU.  A
   module already loaded is matched by name, so the plug-in's imports resolve to these.
3. Load llama.dll ourselves with ``LOAD_LIBRARY_SEARCH_DEFAULT_DIRS |
   LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR`` (Python's own default for ctypes): its
   dependencies (ggml*.dll and, for a linked-in CUDA backend, the runtime) resolve from
   its own folder, the added folders and System32 only.
4. When ``llama_cpp`` then loads the same full path, Windows returns the module that is
   already loaded, so its legacy search never runs; the PATH it prepended is put back
   (:class:`PathGuard`) right after the import.

Every OS call is a parameter (``add_dll_directory``, ``loader``), so the whole sequence
runs on Linux in tests with fakes.  Only Windows can prove that step 2 makes the plug-in
find its runtime and step 4's "already loaded" behaviour: see installer/README.md.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from native.libfile import cuda_bin_dirs, locate_cuda_runtime

log = logging.getLogger("native")

# LoadLibraryExW flags (libloaderapi.h)
LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR = 0x00000100
LOAD_LIBRARY_SEARCH_DEFAULT_DIRS = 0x00001000
SAFE_WINMODE = LOAD_LIBRARY_SEARCH_DEFAULT_DIRS | LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR

Loader = Callable[..., Any]

_kept: list[Any] = []  # add_dll_directory handles and preloaded modules: never released


def dll_directories(folder: Path, environ: Mapping[str, str] | None = None,
                    platform: str = sys.platform) -> list[Path]:
    """Folders Windows must search for llama.dll's dependencies, existing ones only."""
    environ = os.environ if environ is None else environ
    dirs = [folder] + cuda_bin_dirs(environ, platform)
    seen: list[Path] = []
    for d in dirs:
        if d.is_dir() and d not in seen:
            seen.append(d)
    return seen


def default_loader(path: str, winmode: int | None = None):
    import ctypes
    if winmode is None:
        return ctypes.CDLL(path)
    return ctypes.CDLL(path, winmode=winmode)


@dataclass
class WindowsSearch:
    """What :func:`prepare_windows_search` did: folders added, files preloaded, llama.dll."""
    folders: list[Path] = field(default_factory=list)
    preloaded: list[Path] = field(default_factory=list)
    library: Any = None


def absolute(path: Path | str) -> Path:
    """``path`` made absolute against the current folder, ``..`` folded (WinError 87 otherwise)."""
    return Path(os.path.abspath(os.fspath(path)))


def prepare_windows_search(library: Path, *, environ: Mapping[str, str] | None = None,
                           platform: str = sys.platform,
                           add_dll_directory: Callable[[str], Any] | None = None,
                           loader: Loader = default_loader) -> WindowsSearch:
    """Steps 1 to 3 above; returns what was done.  Does nothing off Windows.

    Raises OSError from the loader unchanged: the caller explains it
    (:func:`native.libfile.explain_load_failure`).
    """
    if platform != "win32":
        return WindowsSearch()
    environ = os.environ if environ is None else environ
    # getattr: os has add_dll_directory only on Windows, and type checkers elsewhere say so
    add = add_dll_directory or getattr(os, "add_dll_directory")  # noqa: B009
    library = absolute(library)
    done = WindowsSearch(folders=dll_directories(library.parent, environ, platform))
    for d in done.folders:
        _kept.append(add(str(d)))
    runtime = locate_cuda_runtime(library.parent, platform, environ)
    for path in runtime.found if runtime else ():
        _kept.append(loader(str(path), winmode=SAFE_WINMODE))
        done.preloaded.append(path)
    done.library = loader(str(library), winmode=SAFE_WINMODE)
    _kept.append(done.library)
    log.info("DLL search folders: %s; preloaded: %s", ", ".join(map(str, done.folders)),
             ", ".join(map(str, done.preloaded)) or "nothing")
    return done


#: Roots llama-cpp-python's loader passes to ``os.add_dll_directory`` (``bin`` and ``lib``).
BINDINGS_DLL_ROOTS = ("CUDA_PATH", "HIP_PATH")


class PathGuard:
    """Puts PATH back as it was when the block exits (step 4 above).

    Only PATH is restored, and only if something changed it inside the block.  On Windows
    it also hides, inside the block, a ``CUDA_PATH`` / ``HIP_PATH`` whose ``bin`` or ``lib``
    folder is gone (a CUDA uninstalled, a stale variable): llama-cpp-python's loader calls
    ``os.add_dll_directory`` on both, which raises WinError 3 for a missing folder, and
    the app then failed to load a CPU library.  The folders that exist were already added
    by :func:`prepare_windows_search`.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None,
                 platform: str = sys.platform) -> None:
        self._environ = os.environ if environ is None else environ
        self._platform = platform
        self._before: str | None = None
        self._hidden: dict[str, str] = {}

    def __enter__(self) -> PathGuard:
        self._before = self._environ.get("PATH")
        if self._platform == "win32":
            for name in BINDINGS_DLL_ROOTS:
                root = self._environ.get(name)
                if root is not None and not all((Path(root) / sub).is_dir() for sub in ("bin", "lib")):
                    self._hidden[name] = self._environ.pop(name)
                    log.info("%s=%s lacks bin or lib: hidden from llama-cpp-python's loader", name, root)
        return self

    def __exit__(self, *exc) -> None:
        self._environ.update(self._hidden)
        self._hidden = {}
        now = self._environ.get("PATH")
        if now == self._before:
            return
        if self._before is None:
            self._environ.pop("PATH", None)
        else:
            self._environ["PATH"] = self._before
        log.debug("restored PATH after llama_cpp's loader prepended to it")
