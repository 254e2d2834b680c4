"""How llama.dll and the DLLs it needs are found on Windows, without rewriting PATH.

llama-cpp-python 0.3.36's loader (``llama_cpp/_ctypes_extensions.py``) prepends the
library folder to PATH and loads llama.dll with ``winmode=0``: the legacy search order,
in which the folders of ``os.add_dll_directory`` are *not* searched and PATH is.  PATH
edits leak into every child process and let a stray ggml.dll elsewhere on PATH win.

What we do instead, before ``llama_cpp`` is imported:

1. ``os.add_dll_directory`` for the library folder and CUDA's bin folders; the handles
   are kept for the life of the process (closing one removes the folder again).
2. Load llama.dll ourselves with ``LOAD_LIBRARY_SEARCH_DEFAULT_DIRS |
   LOAD_LIBRARY_SEARCH_DLL_LOAD_DIR`` (Python's own default for ctypes): its
   dependencies (ggml*.dll, cudart64_12.dll, cublas64_12.dll) resolve from its own
   folder, the added folders and System32 only.
3. When ``llama_cpp`` then loads the same full path, Windows returns the module that is
   already loaded, so its legacy search never runs; the PATH it prepended is put back
   (:class:`PathGuard`) right after the import.

Every OS call is a parameter (``add_dll_directory``, ``loader``), so the whole sequence
runs on Linux in tests with fakes.  Only Windows can prove step 3's "already loaded"
behaviour: see tests/test_library.py's docstring.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, MutableMapping

from native.libfile import cuda_bin_dirs

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


def prepare_windows_search(library: Path, *, environ: Mapping[str, str] | None = None,
                           platform: str = sys.platform,
                           add_dll_directory: Callable[[str], Any] | None = None,
                           loader: Loader = default_loader) -> list[Path]:
    """Steps 1 and 2 above; returns the folders added.  Does nothing off Windows.

    Raises OSError from the loader unchanged: the caller explains it
    (:func:`native.libfile.explain_load_failure`).
    """
    if platform != "win32":
        return []
    add = add_dll_directory or getattr(os, "add_dll_directory")
    dirs = dll_directories(library.parent, environ, platform)
    for d in dirs:
        _kept.append(add(str(d)))
    _kept.append(loader(str(library), winmode=SAFE_WINMODE))
    log.info("DLL search folders: %s", ", ".join(map(str, dirs)))
    return dirs


class PathGuard:
    """Puts PATH back as it was when the block exits (step 3 above).

    Only PATH is restored, and only if something changed it inside the block.
    """

    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        self._environ = os.environ if environ is None else environ
        self._before: str | None = None

    def __enter__(self) -> "PathGuard":
        self._before = self._environ.get("PATH")
        return self

    def __exit__(self, *exc) -> None:
        now = self._environ.get("PATH")
        if now == self._before:
            return
        if self._before is None:
            self._environ.pop("PATH", None)
        else:
            self._environ["PATH"] = self._before
        log.debug("restored PATH after llama_cpp's loader prepended to it")
