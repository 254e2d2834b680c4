"""Build the broken llama.dll folders the Windows tier's tests load (run by wine_tier.sh).

    python3 installer/wine_fixtures.py OUT_DIR LLAMA_CPP_PY

Each folder under OUT_DIR holds one ``llama.dll`` compiled here with mingw-w64, each
wrong in one way a user's download can be (the tests in tests/test_windows_wine.py load
them with the real Windows loader and expect the named refusal):

- ``x86``: a 32-bit DLL (WinError 193 from the loader).
- ``foreign``: 64-bit, but exports only ``llama_backend_init`` (another llama.cpp).
- ``abi``: exports every function the bindings bind, but the default parameter structs
  read back as zeros (a build whose struct layouts differ).
- ``crash``: as ``abi``, but reading the context defaults writes through NULL: the probe
  child dies with 0xC0000005 while reading the default parameters.
- ``abort``: as ``crash``, but it prints a GGML_ASSERT line and calls abort(), as
  llama.cpp does on a failed check.
- ``missingdep``: imports ``ggml-gone.dll``, which is nowhere (WinError 126).
- ``driver``: ``nvcuda.dll``, a stand-in NVIDIA driver for the test prefix's System32
  only: ``cuDriverGetVersion`` says CUDA 11.8, ``cuInit`` finds no device.
- ``omp``: ``ggml-cpu-haswell.dll`` imports ``libomp140.x86_64.dll`` as llama.cpp's
  official CPU backends do; the file is absent, as on a machine without it.

The function list comes from the pinned bindings' source (``LLAMA_CPP_PY``), read with
the same patterns :func:`native.library.bound_symbols` uses.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CC64 = "x86_64-w64-mingw32-gcc-posix"
CC32 = "i686-w64-mingw32-gcc-posix"
DLLTOOL = "x86_64-w64-mingw32-dlltool"


def symbols(bindings_source: Path) -> list[str]:
    text = bindings_source.read_text("utf-8")
    names = re.findall(r'ctypes_function\(\s*"(\w+)"', text) + re.findall(r"_lib\.(\w+)\.", text)
    sys.path.insert(0, str(ROOT))
    from native.library import REQUIRED_SYMBOLS
    return list(dict.fromkeys(list(REQUIRED_SYMBOLS) + names))


def stub_source(names: list[str], *, crash: str = "") -> str:
    # A struct returned by value: on Windows x64 the caller passes the buffer in RCX and
    # expects it back in RAX.  Zero 16 bytes of it (every parameter struct is larger).
    special = {"llama_context_default_params", "llama_model_default_params"}
    lines = ["#include <stdio.h>", "#include <stdlib.h>", "#include <string.h>"]
    for name in names:
        if name in special:
            body = "memset(out, 0, 16); return out;"
            if crash == "segv" and name == "llama_context_default_params":
                body = "*(volatile int *)0 = 1; return out;"
            if crash == "abort" and name == "llama_context_default_params":
                body = 'fputs("GGML_ASSERT(n_ctx > 0) failed\\n", stderr); fflush(stderr); abort(); return out;'

            lines.append(f"__declspec(dllexport) void *{name}(void *out) {{ {body} }}")
        else:
            lines.append(f"__declspec(dllexport) void *{name}(void) {{ return 0; }}")
    return "\n".join(lines) + "\n"


def importing_source(function: str) -> str:
    return (f"__declspec(dllimport) int {function}(void);\n"
            f"__declspec(dllexport) int llama_backend_init(void) {{ return {function}(); }}\n")


#: An NVIDIA driver that supports CUDA 11.8 and sees no GPU (CUDA_ERROR_NO_DEVICE).
DRIVER_SOURCE = """\
__declspec(dllexport) int cuDriverGetVersion(int *version) { *version = 11080; return 0; }
__declspec(dllexport) int cuInit(unsigned int flags) { (void)flags; return 100; }
"""


def run(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def import_library(work: Path, dll: str, function: str) -> Path:
    """An import library for ``dll`` (which nobody ships) exporting ``function``."""
    definition = work / f"{function}.def"
    definition.write_text(f"LIBRARY {dll}\nEXPORTS\n    {function}\n")
    lib = work / f"lib{function}.a"
    run(DLLTOOL, "-d", str(definition), "-l", str(lib))
    return lib


def dll(cc: str, source: str, target: Path, work: Path, *libs: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    c = work / (target.parent.name + "-" + target.stem + ".c")
    c.write_text(source)
    run(cc, "-shared", "-O1", "-o", str(target), str(c), *map(str, libs))


def main(out: Path, bindings_source: Path) -> None:
    names = symbols(bindings_source)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dll(CC32, "__declspec(dllexport) int llama_backend_init(void) { return 0; }\n",
            out / "x86" / "llama.dll", work)
        dll(CC64, stub_source(["llama_backend_init"]), out / "foreign" / "llama.dll", work)
        dll(CC64, stub_source(names), out / "abi" / "llama.dll", work)
        dll(CC64, stub_source(names, crash="segv"), out / "crash" / "llama.dll", work)
        dll(CC64, stub_source(names, crash="abort"), out / "abort" / "llama.dll", work)
        dll(CC64, importing_source("ggml_gone_init"), out / "missingdep" / "llama.dll", work,
            import_library(work, "ggml-gone.dll", "ggml_gone_init"))
        dll(CC64, DRIVER_SOURCE, out / "driver" / "nvcuda.dll", work)
        dll(CC64, importing_source("omp_get_max_threads"), out / "omp" / "ggml-cpu-haswell.dll", work,
            import_library(work, "libomp140.x86_64.dll", "omp_get_max_threads"))
    print(f"fixtures: {', '.join(sorted(p.name for p in out.iterdir()))} ({len(names)} functions)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
