"""What hardware llama.cpp sees: backends, devices and their free memory.

llama-cpp-python does not bind ggml's device registry, so this module binds the five
functions it needs from the ggml library that sits beside libllama.  Failure to do so
is not fatal: the report then says the device list is unavailable.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from native.library import bindings, loaded_library

log = logging.getLogger("native")

# enum ggml_backend_dev_type
_DEVICE_KINDS = {0: "CPU", 1: "GPU", 2: "iGPU", 3: "accelerator"}


@dataclass(frozen=True)
class Device:
    name: str
    description: str
    kind: str
    memory_free: int
    memory_total: int


@dataclass(frozen=True)
class SystemInfo:
    library_path: str
    library_version: str
    bundled: bool
    gpu_offload: bool
    features: str
    devices: list[Device] = field(default_factory=list)

    @property
    def backend_label(self) -> str:
        """"CPU", or the first GPU's name, for a status bar."""
        gpus = [d for d in self.devices if d.kind in ("GPU", "iGPU")]
        return f"{gpus[0].kind} {gpus[0].description or gpus[0].name}" if gpus else "CPU"


def _ggml_library(folder: Path) -> ctypes.CDLL | None:
    names = {"win32": ["ggml.dll"], "darwin": ["libggml.dylib", "libggml.so"]}.get(
        sys.platform, ["libggml.so"])
    for name in names:
        path = folder / name
        if path.is_file():
            try:
                return ctypes.CDLL(str(path))
            except OSError as exc:
                log.warning("cannot open %s: %s", path, exc)
    return None


def list_devices(folder: Path) -> list[Device]:
    lib = _ggml_library(folder)
    if lib is None:
        return []
    try:
        lib.ggml_backend_dev_count.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
            getattr(lib, fn).restype = ctypes.c_char_p
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.POINTER(ctypes.c_size_t)]
        lib.ggml_backend_dev_memory.restype = None
    except AttributeError as exc:
        log.warning("ggml device registry unavailable: %s", exc)
        return []
    devices = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        devices.append(Device(
            name=(lib.ggml_backend_dev_name(dev) or b"").decode("utf-8", "replace"),
            description=(lib.ggml_backend_dev_description(dev) or b"").decode("utf-8", "replace"),
            kind=_DEVICE_KINDS.get(lib.ggml_backend_dev_type(dev), "other"),
            memory_free=free.value, memory_total=total.value))
    return devices


def system_info() -> SystemInfo:
    ll = bindings()
    lib = loaded_library()
    return SystemInfo(
        library_path=str(lib.path),
        library_version=lib.version,
        bundled=lib.bundled,
        gpu_offload=bool(ll.llama_supports_gpu_offload()),
        features=ll.llama_print_system_info().decode("utf-8", "replace").strip(),
        devices=list_devices(lib.folder),
    )
