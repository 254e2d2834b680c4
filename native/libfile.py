"""Checks on a llama library's files that need no loading: names, bitness, CUDA runtime.

Everything here reads bytes or lists folders and never maps a library into the
process, so it is safe on any file and testable on any OS: the target platform and
the environment are parameters, and a "llama.dll" in a test is a few crafted bytes.

The point is to refuse with what was found and what is needed *before* the OS loader
turns the problem into "module not found" or "wrong ELF class".
"""

from __future__ import annotations

import os
import re
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from native.errors import LibraryError

#: llama-cpp-python 0.3.36 vendors this llama.cpp commit (its CHANGELOG); a user's own
#: library is only safe to call when built from it.
REQUIRED_LLAMA_CPP_COMMIT = "0c1e57098"
BINDINGS_VERSION = "0.3.36"


def library_filenames(platform: str = sys.platform) -> tuple[str, ...]:
    """The file names llama-cpp-python looks for in a folder, on ``platform``, in order."""
    if platform == "win32":
        return ("llama.dll", "libllama.dll")
    if platform == "darwin":
        return ("libllama.so", "libllama.dylib")
    return ("libllama.so",)


def ggml_filenames(platform: str = sys.platform) -> tuple[str, ...]:
    """ggml's core library (the device registry lives there), beside libllama."""
    if platform == "win32":
        return ("ggml.dll", "libggml.dll")
    if platform == "darwin":
        return ("libggml.dylib", "libggml.so")
    return ("libggml.so",)


def ggml_base_filenames(platform: str = sys.platform) -> tuple[str, ...]:
    """ggml's base library: on Windows the device registry's names and memory live here."""
    if platform == "win32":
        return ("ggml-base.dll", "libggml-base.dll")
    if platform == "darwin":
        return ("libggml-base.dylib", "libggml-base.so")
    return ("libggml-base.so",)


def find_library_file(folder: Path, platform: str = sys.platform, *, source: str = "") -> Path:
    """The library inside ``folder``; the error names every path it tried and why.

    ``source`` says where the folder came from ("--llama-lib", "Settings",
    "CHECKPOINT_CHAT_LLAMA_LIB") so the user knows which setting to fix.
    """
    where = f" (from {source})" if source else ""
    if not folder.exists():
        raise LibraryError(f"llama library folder not found: {folder}{where}")
    if not folder.is_dir():
        raise LibraryError(f"llama library folder is not a folder: {folder}{where}; "
                           f"choose the folder that contains {library_filenames(platform)[0]}")
    tried = [folder / name for name in library_filenames(platform)]
    for path in tried:
        if path.is_file():
            return path
    raise LibraryError(f"no llama library in {folder}{where}; looked for "
                       + ", ".join(str(p) for p in tried))


# -- binary format -------------------------------------------------------------------------

@dataclass(frozen=True)
class BinaryKind:
    """What a library file is, read from its first bytes."""
    format: str      # "ELF", "PE", "Mach-O" or "unknown"
    bits: int        # 32, 64, or 0 when unknown
    machine: str     # "x86_64", "x86", "arm64", ... or "unknown"

    def describe(self) -> str:
        if self.format == "unknown":
            return "not a shared library"
        return f"a {self.bits}-bit {self.machine} {self.format} library"


_ELF_MACHINES = {3: "x86", 62: "x86_64", 40: "arm", 183: "arm64"}
_PE_MACHINES = {0x14C: ("x86", 32), 0x8664: ("x86_64", 64), 0xAA64: ("arm64", 64),
                0x1C4: ("arm", 32)}
_MACHO = {b"\xcf\xfa\xed\xfe": 64, b"\xce\xfa\xed\xfe": 32, b"\xca\xfe\xba\xbe": 0}


def read_binary_kind(path: Path) -> BinaryKind:
    """Read the ELF / PE / Mach-O header of ``path`` (only its first 4 KiB)."""
    with open(path, "rb") as f:
        head = f.read(4096)
    if head[:4] == b"\x7fELF" and len(head) >= 20:
        bits = {1: 32, 2: 64}.get(head[4], 0)
        endian = "<" if head[5] == 1 else ">"
        (machine,) = struct.unpack_from(endian + "H", head, 18)
        return BinaryKind("ELF", bits, _ELF_MACHINES.get(machine, f"machine {machine}"))
    if head[:2] == b"MZ" and len(head) >= 0x40:
        (pe_offset,) = struct.unpack_from("<I", head, 0x3C)
        if pe_offset + 6 <= len(head) and head[pe_offset:pe_offset + 4] == b"PE\0\0":
            (machine,) = struct.unpack_from("<H", head, pe_offset + 4)
            name, bits = _PE_MACHINES.get(machine, (f"machine 0x{machine:x}", 0))
            return BinaryKind("PE", bits, name)
        return BinaryKind("PE", 0, "unknown")
    if head[:4] in _MACHO:
        return BinaryKind("Mach-O", _MACHO[head[:4]], "unknown")
    return BinaryKind("unknown", 0, "unknown")


def _expected_format(platform: str) -> str:
    return {"win32": "PE", "darwin": "Mach-O"}.get(platform, "ELF")


def host_machine() -> str:
    import platform as _platform
    m = _platform.machine().lower()
    return {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "arm64", "arm64": "arm64"}.get(m, m)


def check_binary(path: Path, platform: str = sys.platform, machine: str | None = None) -> BinaryKind:
    """Refuse a file this 64-bit process cannot load: wrong format, 32-bit, other CPU."""
    kind = read_binary_kind(path)
    want_format = _expected_format(platform)
    machine = machine or host_machine()
    system = {"win32": "Windows", "darwin": "macOS"}.get(platform, "Linux")
    need = f"a 64-bit {machine} {want_format} library for {system}"
    if kind.format == "unknown":
        raise LibraryError(f"{path} is {kind.describe()}; {need} is needed")
    if kind.format != want_format and not (want_format == "Mach-O" and kind.format == "ELF"):
        raise LibraryError(f"{path} is {kind.describe()}, built for another operating system; "
                           f"{need} is needed")
    if kind.bits == 32:
        raise LibraryError(f"{path} is {kind.describe()}; this app runs as a 64-bit process "
                           f"and cannot load it: {need} is needed")
    if kind.format != "Mach-O" and kind.machine != machine:
        raise LibraryError(f"{path} is {kind.describe()}, for another processor; {need} is needed")
    return kind


# -- PE import table -----------------------------------------------------------------------

#: Bounds on what the import-table reader accepts, checked before reading further: a
#: damaged or hostile file costs a few KiB of reads at most.
_MAX_SECTIONS = 96
_MAX_DESCRIPTORS = 4096
_MAX_NAME = 260
_IMPORT_DIR, _DELAY_IMPORT_DIR = 1, 13


def pe_imports(path: Path) -> list[str]:
    """The DLL names a PE file imports (import and delay-import tables), in file order.

    Reads only the headers, the section table, the descriptors and the name strings, a
    few KiB with seeks: a multi-architecture ggml-cuda.dll is hundreds of MB, and reading
    it whole on every start (and again in the probe child) was the old way.  Returns []
    for anything that is not a well-formed PE file.
    """
    try:
        with open(path, "rb") as f:
            return _read_pe_imports(f)
    except (OSError, ValueError, struct.error):
        return []


def _read_at(f, offset: int, size: int) -> bytes:
    f.seek(offset)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated")
    return data


def _read_pe_imports(f) -> list[str]:
    if _read_at(f, 0, 2) != b"MZ":
        raise ValueError("no MZ header")
    (pe,) = struct.unpack("<I", _read_at(f, 0x3C, 4))
    if _read_at(f, pe, 4) != b"PE\0\0":
        raise ValueError("no PE signature")
    _machine, n_sections, _t, _s, _n, opt_size, _c = struct.unpack("<HHIIIHH", _read_at(f, pe + 4, 20))
    if n_sections > _MAX_SECTIONS:
        raise ValueError("too many sections")
    opt = pe + 24
    (magic,) = struct.unpack("<H", _read_at(f, opt, 2))
    if magic not in (0x10B, 0x20B):             # PE32, PE32+
        raise ValueError("unknown optional header")
    count_at, dirs_at = (opt + 92, opt + 96) if magic == 0x10B else (opt + 108, opt + 112)
    (n_dirs,) = struct.unpack("<I", _read_at(f, count_at, 4))
    sections = [struct.unpack_from("<IIII", _read_at(f, opt + opt_size + 40 * i + 8, 16))
                for i in range(n_sections)]     # VirtualSize, VirtualAddress, SizeOfRawData, PointerToRawData

    def offset_of(rva: int) -> int:
        for vsize, va, raw_size, raw_ptr in sections:
            if va <= rva < va + max(vsize, raw_size):
                return rva - va + raw_ptr
        raise ValueError(f"RVA 0x{rva:x} outside every section")

    def name_at(rva: int) -> str:
        f.seek(offset_of(rva))
        raw = f.read(_MAX_NAME)
        end = raw.find(b"\0")
        if end <= 0:
            raise ValueError("bad name")
        return raw[:end].decode("ascii")

    names: list[str] = []
    # IMAGE_IMPORT_DESCRIPTOR (20 bytes, Name at 12); ImgDelayDescr (32 bytes: Attributes,
    # then DllNameRVA; Attributes bit 0 clear means the old VA-based form, not read here)
    for index, size, name_field in ((_IMPORT_DIR, 20, 12), (_DELAY_IMPORT_DIR, 32, 4)):
        if index >= n_dirs:
            continue
        rva, length = struct.unpack("<II", _read_at(f, dirs_at + 8 * index, 8))
        if not rva or not length:
            continue
        at = offset_of(rva)
        for i in range(_MAX_DESCRIPTORS):
            entry = _read_at(f, at + i * size, size)
            if not any(entry):
                break
            if index == _DELAY_IMPORT_DIR and not entry[0] & 1:
                break
            (name_rva,) = struct.unpack_from("<I", entry, name_field)
            if name_rva:
                names.append(name_at(name_rva))
    return names


# -- CUDA runtime --------------------------------------------------------------------------

_CUDA_BACKEND = {"win32": ("ggml-cuda.dll",), "darwin": ()}
_RUNTIME_NAME = re.compile(r"(?:cudart|cublas|cublasLt)64_\d+\.dll", re.I)
_DEFAULT_RUNTIME = {"win32": ("cudart64_12.dll", "cublasLt64_12.dll", "cublas64_12.dll"),
                    "linux": ("libcudart.so.12", "libcublasLt.so.12", "libcublas.so.12")}


def cuda_backend_file(folder: Path, platform: str = sys.platform) -> Path | None:
    """ggml's CUDA backend in ``folder``, when this library was built with CUDA."""
    names = _CUDA_BACKEND.get(platform, ("libggml-cuda.so",))
    for name in names:
        if (folder / name).is_file():
            return folder / name
    return None


def _load_order(name: str) -> tuple[int, str]:
    low = name.lower()
    rank = 0 if "cudart" in low else 1 if "cublaslt" in low else 2
    return rank, low


def cuda_runtime_names(backend: Path, platform: str = sys.platform) -> tuple[str, ...]:
    """The CUDA runtime libraries the backend needs, in the order they must be loaded.

    Read from the backend's PE import table (a CUDA 12 build names cudart64_12.dll, a
    CUDA 13 one cudart64_13.dll).  cublas64_N.dll in turn needs cublasLt64_N.dll, which
    the backend does not name itself: it is added, so a folder lacking only cublasLt is
    refused here instead of by the loader.  Falls back to CUDA 12's names off Windows or
    when the table cannot be read.
    """
    key = "win32" if platform == "win32" else "linux"
    imports = pe_imports(backend) if key == "win32" else []
    found = {n for n in imports if _RUNTIME_NAME.fullmatch(n)}
    for name in list(found):
        major = re.fullmatch(r"cublas64_(\d+)\.dll", name, re.I)
        if major:
            found.add(f"cublasLt64_{major.group(1)}.dll")
    return tuple(sorted(found, key=_load_order)) or _DEFAULT_RUNTIME[key]


def cuda_bin_dirs(environ: Mapping[str, str], platform: str = sys.platform) -> list[Path]:
    """Where the CUDA toolkit / runtime installer puts its DLLs, newest version first.

    The installer sets CUDA_PATH (the last installed) and CUDA_PATH_V12_4 style
    variables (one per version); CUDA 13 moved the DLLs into bin\\x64.
    """
    if platform != "win32":
        return []
    roots: list[str] = []
    if environ.get("CUDA_PATH"):
        roots.append(environ["CUDA_PATH"])
    versioned = sorted((k for k in environ if re.fullmatch(r"CUDA_PATH_V\d+_\d+", k)),
                       key=lambda k: tuple(int(x) for x in k[11:].split("_")), reverse=True)
    roots += [environ[k] for k in versioned if environ[k]]
    dirs: list[Path] = []
    for root in roots:
        for sub in ("bin", os.path.join("bin", "x64")):
            d = Path(root) / sub
            if d not in dirs:
                dirs.append(d)
    return dirs


@dataclass(frozen=True)
class CudaRuntime:
    """Where a CUDA build's runtime libraries are, for checking, preloading and bundling."""
    backend: Path
    places: tuple[Path, ...]     # searched in this order: the library folder first
    found: tuple[Path, ...]      # full paths, in load order
    missing: tuple[str, ...]


def locate_cuda_runtime(folder: Path, platform: str = sys.platform,
                        environ: Mapping[str, str] | None = None) -> CudaRuntime | None:
    """The CUDA runtime of the build in ``folder`` (None: not a CUDA build, or not Windows).

    Beside llama.dll first, then the CUDA bin folders: the same order
    :mod:`native.dllsearch` adds them in, so what is checked is what gets loaded.
    """
    if platform != "win32":
        return None
    environ = os.environ if environ is None else environ
    backend = cuda_backend_file(folder, platform)
    if backend is None:
        return None
    places = tuple([folder] + [d for d in cuda_bin_dirs(environ, platform) if d.is_dir()])
    found, missing = [], []
    for name in cuda_runtime_names(backend, platform):
        hit = next((p / name for p in places if (p / name).is_file()), None)
        if hit is None:
            missing.append(name)
        else:
            found.append(hit)
    return CudaRuntime(backend, places, tuple(found), tuple(missing))


def _runtime_refusal(folder: Path, runtime: CudaRuntime) -> str:
    missing = runtime.missing
    major = re.search(r"_(\d+)\.dll", missing[0])
    version = major.group(1) if major else "12"
    return (f"the llama library in {folder} was built with CUDA ({runtime.backend.name}) but "
            f"{', '.join(missing)} {'was' if len(missing) == 1 else 'were'} not found "
            f"(looked in {', '.join(str(p) for p in runtime.places)}); install the CUDA {version} "
            f"runtime: the CUDA Toolkit {version}.x, or unzip llama.cpp's matching "
            f"cudart-llama-bin-win-cuda-{version}.x-x64.zip into {folder}")


def missing_cuda_runtime(folder: Path, platform: str, environ: Mapping[str, str]) -> str | None:
    """Why a CUDA build in ``folder`` would fail to load, or None when it looks complete.

    Only Windows is checked ahead of time: there the runtime must sit beside llama.dll
    or in a CUDA bin folder.  On Linux the dynamic linker's own error is explained
    after the fact (see :func:`explain_load_failure`).
    """
    runtime = locate_cuda_runtime(folder, platform, environ)
    if runtime is None:
        return None
    if runtime.missing:
        return _runtime_refusal(folder, runtime)
    system32 = Path(environ.get("SystemRoot", r"C:\Windows")) / "System32"
    if system32.is_dir() and not (system32 / "nvcuda.dll").is_file():
        return (f"the llama library in {folder} was built with CUDA but no NVIDIA driver was "
                f"found (nvcuda.dll is not in {system32}); install a recent NVIDIA driver")
    return None


def cuda_runtime_to_bundle(folder: Path, platform: str = sys.platform,
                           environ: Mapping[str, str] | None = None) -> list[Path]:
    """The CUDA runtime files a frozen app must ship beside llama.dll (installer's spec).

    Raises LibraryError naming what is missing: a frozen CUDA build without its runtime
    would only work on machines that happen to have the toolkit on PATH.  [] for a CPU
    build, and off Windows (there the runtime comes with the CUDA or driver packages).
    """
    runtime = locate_cuda_runtime(folder, platform, environ)
    if runtime is None:
        return []
    if runtime.missing:
        raise LibraryError(_runtime_refusal(folder, runtime))
    return list(runtime.found)


def driver_cuda_version(platform: str = sys.platform,
                        environ: Mapping[str, str] | None = None) -> int | None:
    """The CUDA version the installed NVIDIA driver supports (12040 for 12.4), or None.

    ``cuDriverGetVersion`` of the driver library (System32\\nvcuda.dll, libcuda.so.1): it
    answers without a GPU and without initialising CUDA.
    """
    if platform != sys.platform:
        return None
    import ctypes
    environ = os.environ if environ is None else environ
    try:
        if platform == "win32":
            system32 = _system32(environ)
            if system32 is None or not (system32 / "nvcuda.dll").is_file():
                return None
            lib = ctypes.WinDLL(str(system32 / "nvcuda.dll"))  # type: ignore[attr-defined]
        elif platform == "linux":
            lib = ctypes.CDLL("libcuda.so.1")
        else:
            return None
        version = ctypes.c_int(0)
        # CUresult cuDriverGetVersion(int *driverVersion)
        lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cuDriverGetVersion.restype = ctypes.c_int
        if lib.cuDriverGetVersion(ctypes.byref(version)) != 0 or version.value <= 0:
            return None
        return version.value
    except (OSError, AttributeError):
        return None


def _runtime_major(backend: Path, platform: str) -> tuple[str, int] | None:
    """The CUDA runtime the backend imports and its major version ("cudart64_12.dll", 12)."""
    for name in cuda_runtime_names(backend, platform) if platform == "win32" else ():
        match = re.fullmatch(r"cudart64_(\d+)\.dll", name, re.I)
        if match:
            return name, int(match.group(1))
    return None


def cuda_device_problem(folder: Path, device_kinds: list[str], platform: str = sys.platform,
                        driver_version: Callable[[], int | None] | None = None) -> str | None:
    """Why a CUDA build would silently run on the CPU: its backend is there, no GPU came up.

    When the driver supports an older CUDA than the build's runtime needs (a driver too
    old for cudart64_12), that is said first: updating the driver is then the fix.
    """
    backend = cuda_backend_file(folder, platform)
    if backend is None or any(kind in ("GPU", "iGPU") for kind in device_kinds):
        return None
    driver = (driver_version or (lambda: driver_cuda_version(platform)))()
    runtime = _runtime_major(backend, platform)
    old_driver = ""
    if driver is not None and runtime is not None and driver < runtime[1] * 1000:
        old_driver = (f"; the NVIDIA driver here supports CUDA {driver // 1000}.{driver % 1000 // 10} "
                      f"but {runtime[0]} needs CUDA {runtime[1]} or newer: update the NVIDIA driver")
    return (f"the llama library in {folder} was built with CUDA ({backend.name}) but llama.cpp "
            f"found no CUDA device (devices: {', '.join(device_kinds) or 'none'}), so it would "
            f"run on the CPU only{old_driver}; check that the NVIDIA driver sees the GPU (nvidia-smi "
            "lists it), or choose a CPU build of llama.cpp (Settings, --llama-lib or "
            "CHECKPOINT_CHAT_LLAMA_LIB)")


# -- the loader's error, explained -------------------------------------------------------

def _system32(environ: Mapping[str, str]) -> Path | None:
    root = environ.get("SystemRoot") or environ.get("SYSTEMROOT") or environ.get("windir")
    return Path(root) / "System32" if root else None


def missing_dependencies(path: Path, places: list[Path], environ: Mapping[str, str] | None = None,
                         *, depth: int = 4) -> list[str]:
    """The DLLs ``path`` imports (directly, or through DLLs found in ``places``) that are
    in none of ``places`` nor System32: what Windows' WinError 126 does not name.

    API sets (``api-ms-win-*``, ``ext-ms-*``) are resolved by the loader, never files.
    Names compare without case, as Windows does.
    """
    environ = os.environ if environ is None else environ
    system32 = _system32(environ)
    where = [p for p in [*places, system32] if p is not None]
    listings: dict[Path, dict[str, Path]] = {}

    def find(name: str) -> Path | None:
        for folder in where:
            if folder not in listings:
                try:
                    listings[folder] = {c.name.lower(): c for c in folder.iterdir()}
                except OSError:
                    listings[folder] = {}
            hit = listings[folder].get(name.lower())
            if hit is not None:
                return hit
        return None

    missing: list[str] = []
    seen: set[str] = set()
    todo = [(path, 0)]
    while todo:
        current, level = todo.pop()
        for name in pe_imports(current):
            key = name.lower()
            if key in seen or key.startswith(("api-ms-win-", "ext-ms-")):
                continue
            seen.add(key)
            hit = find(name)
            if hit is None:
                missing.append(name)
            elif level + 1 < depth and system32 is not None and hit.parent != system32:
                todo.append((hit, level + 1))
    return missing


def _missing_named(folder: Path, platform: str, environ: Mapping[str, str]) -> str:
    """"; it needs X, which is not in …" for a library in ``folder``, or ""."""
    if platform != "win32":
        return ""
    try:
        path = find_library_file(folder, platform)
    except LibraryError:
        return ""
    places = [folder] + [d for d in cuda_bin_dirs(environ, platform) if d.is_dir()]
    missing = missing_dependencies(path, places, environ)
    if not missing:
        return ""
    return (f"; {path.name} needs {', '.join(missing)}, which "
            f"{'is' if len(missing) == 1 else 'are'} not in {folder}, the CUDA folders or System32")


def explain_load_failure(folder: Path, error: BaseException, platform: str = sys.platform,
                         environ: Mapping[str, str] | None = None) -> str:
    """Turn the OS loader's terse error into what was found and what is needed."""
    environ = os.environ if environ is None else environ
    text = str(error)
    system = {"win32": "Windows", "darwin": "macOS"}.get(platform, "Linux")
    if ("%1 is not a valid Win32" in text or "WinError 193" in text or "wrong ELF class" in text
            or "incompatible architecture" in text or "invalid ELF header" in text):
        return (f"the llama library in {folder} is not a 64-bit library for {system} "
                f"({text.strip()}); a 64-bit build is needed")
    cuda = missing_cuda_runtime(folder, platform, environ)
    if cuda:
        return cuda
    lib = re.search(r"(lib(?:cudart|cublas|cublasLt|cuda)\.so\.\d+): cannot open", text)
    if lib:
        return (f"the llama library in {folder} was built with CUDA but {lib.group(1)} was not "
                "found; install the CUDA runtime (and a recent NVIDIA driver) or add its "
                "folder to the linker's search path (ldconfig)")
    if isinstance(error, AttributeError) or "undefined symbol" in text or "procedure" in text:
        return (f"the llama library in {folder} lacks a function this app needs ({text.strip()}); "
                f"it comes from another llama.cpp build: commit {REQUIRED_LLAMA_CPP_COMMIT} "
                f"(llama-cpp-python {BINDINGS_VERSION}) is needed")
    if "WinError 126" in text or "could not be found" in text or "one of its dependencies" in text:
        return (f"Windows could not load the llama library in {folder} or one of the DLLs it "
                f"needs ({text.strip()}){_missing_named(folder, platform, environ)}; keep every "
                "DLL of the llama.cpp release together in that folder")
    return f"could not load the llama library from {folder}: {text.strip()}"
