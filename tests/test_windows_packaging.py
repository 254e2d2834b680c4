"""What ships to Windows users: the icon, the PyInstaller spec, Inno Setup, the CUDA build
script (issue 15, items 5, 7, 8).

The spec runs here for real, in a child process, with PyInstaller's four build classes
replaced by recorders and ``sys.platform`` set to "win32": it must list llama_cpp's
files without importing llama_cpp (a stand-in package that raises on import proves
it), bundle a CUDA build's runtime explicitly, stop when that runtime is missing, and
give both executables the icon.  Inno Setup and PowerShell do not run here: their
scripts are checked as text, and installer/README.md lists what to try on Windows.
"""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pecraft import pe_header, pe_image

ROOT = Path(__file__).resolve().parent.parent
INST = ROOT / "installer"
RES = ROOT / "resources"
sys.path.insert(0, str(RES))
import make_icons  # noqa: E402 - resources/make_icons.py is a script, not a package module

# -- the icon (item 8) -------------------------------------------------------------------------------

def read_ico(data: bytes) -> dict[int, bytes]:
    reserved, kind, count = struct.unpack_from("<HHH", data, 0)
    assert (reserved, kind) == (0, 1), "ICONDIR: reserved 0, type 1 (icon)"
    images = {}
    for i in range(count):
        w, h, colours, _r, planes, bits, size, offset = struct.unpack_from("<BBBBHHII", data, 6 + 16 * i)
        edge = w or 256
        assert w == h and planes == 1 and bits == 32
        assert offset + size <= len(data)
        images[edge] = data[offset:offset + size]
    return images


def check_ico(data: bytes) -> None:
    images = read_ico(data)
    assert sorted(images) == sorted(make_icons.ICO_SIZES)
    assert {16, 32, 48, 256} <= set(images), "the sizes Explorer, the taskbar and Alt+Tab use"
    for edge, image in images.items():
        if edge == 256:
            assert image[:8] == b"\x89PNG\r\n\x1a\n", "256 px stored as PNG"
            continue
        size, width, height, planes, bits = struct.unpack_from("<IiiHH", image, 0)
        assert (size, width, height, planes, bits) == (40, edge, 2 * edge, 1, 32)
        mask_row = ((edge + 31) // 32) * 4
        assert len(image) == 40 + 4 * edge * edge + mask_row * edge
        alpha = image[40 + 3:40 + 4 * edge * edge:4]
        assert max(alpha) == 255 and min(alpha) == 0, "opaque shape on a transparent ground"


def test_the_committed_icon_is_a_valid_multi_size_ico():
    check_ico((RES / "checkpoint-chat.ico").read_bytes())
    assert (RES / "checkpoint-chat.svg").is_file(), "the source it is made from"


def test_the_icon_script_regenerates_every_file(tmp_path, qapp):
    written = make_icons.make(tmp_path)
    check_ico((tmp_path / "checkpoint-chat.ico").read_bytes())
    for size in make_icons.PNG_SIZES:
        png = tmp_path / make_icons.png_name(size)
        assert png in written and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (RES / make_icons.png_name(size)).is_file(), f"committed {png.name}"
        width, height = struct.unpack(">II", png.read_bytes()[16:24])
        assert width == height == size


def test_the_window_gets_the_icon(qapp):
    from gui.app import app_icon, configure_application, icon_files
    assert [p.name for p in icon_files()] == [f"checkpoint-chat-{n}.png" for n in make_icons.PNG_SIZES]
    names = qapp.applicationName(), qapp.organizationName(), qapp.desktopFileName()
    try:
        configure_application(qapp)
        icon = qapp.windowIcon()
        assert not icon.isNull()
        sizes = {s.width() for s in icon.availableSizes()}
        assert {16, 32, 48, 256} <= sizes
        assert qapp.desktopFileName() == "checkpoint-chat", "matches the .desktop file's name"
    finally:
        qapp.setApplicationName(names[0]), qapp.setOrganizationName(names[1])
        qapp.setDesktopFileName(names[2])
    assert not app_icon().isNull()


def test_every_installer_uses_the_icon():
    spec = (INST / "checkpoint_chat.spec").read_text("utf-8")
    assert '"resources" / "checkpoint-chat.ico"' in spec and spec.count("icon=icon_arg") == 2
    iss = (INST / "checkpoint_chat.iss").read_text("utf-8")
    assert r"SetupIconFile=..\resources\checkpoint-chat.ico" in iss
    assert r'DefaultIcon"; ValueType: string; ValueName: ""; ValueData: "{app}\{#AppExe},0"' in iss, \
        "the .kvckpt type shows the executable's icon"
    desktop = (INST / "linux" / "checkpoint-chat.desktop").read_text("utf-8")
    assert "\nIcon=checkpoint-chat\n" in desktop
    install = (INST / "linux" / "install.sh").read_text("utf-8")
    assert "checkpoint-chat-$size.png" in install and "application-x-kvckpt" in install
    mime = (INST / "linux" / "checkpoint-chat-mime.xml").read_text("utf-8")
    assert '<icon name="application-x-kvckpt"/>' in mime
    import tomllib
    data = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["tool"]["setuptools"]["package-data"]
    assert "icons/*.png" in data["resources"] and "*.ico" in data["resources"]


# -- the PyInstaller spec, run with recorders (item 8) -----------------------------------------------

DRIVER = textwrap.dedent("""
    import json, sys, types
    fakes, root, target = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path[:0] = [fakes, root]
    hooks = types.ModuleType("PyInstaller.utils.hooks")
    hooks.collect_submodules = lambda name: [name]
    for name in ("PyInstaller", "PyInstaller.utils"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules["PyInstaller.utils.hooks"] = hooks
    seen = {"analysis": [], "exe": []}
    class Analysis:
        def __init__(self, scripts, **kw):
            seen["analysis"].append(kw["binaries"])
            self.pure, self.scripts, self.binaries, self.datas = [], scripts, kw["binaries"], kw["datas"]
    def EXE(*a, **kw):
        seen["exe"].append({"name": kw["name"], "icon": kw["icon"], "console": kw["console"],
                            "version": kw.get("version")})
    sys.platform = target
    spec = root + "/installer/checkpoint_chat.spec"
    code = compile(open(spec, encoding="utf-8").read(), spec, "exec")
    try:
        exec(code, {"SPECPATH": root + "/installer", "workpath": fakes + "/work", "Analysis": Analysis, "EXE": EXE,
                    "PYZ": lambda *a, **k: None, "COLLECT": lambda *a, **k: None,
                    "__name__": "__main__"})
    except SystemExit as exc:
        seen["exit"] = str(exc)
    seen["imported_llama_cpp"] = "llama_cpp" in sys.modules
    print(json.dumps(seen))
""")


def fake_site(tmp_path: Path, *, cuda: bool, runtime_beside: tuple[str, ...] = ()) -> tuple[Path, Path]:
    site = tmp_path / "site"
    pkg = site / "llama_cpp"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('llama_cpp imported at build time')\n")
    (pkg / "llama_cpp.py").write_text("# bindings\n")
    for name in ("llama.dll", "ggml.dll", "ggml-base.dll"):
        (pkg / "lib" / name).write_bytes(pe_header())
    (pkg / "lib" / "README.txt").write_text("not a library")
    if cuda:
        (pkg / "lib" / "ggml-cuda.dll").write_bytes(
            pe_image(["KERNEL32.dll", "ggml-base.dll", "cudart64_12.dll", "cublas64_12.dll"], ["nvcuda.dll"]))
    for name in runtime_beside:
        (pkg / "lib" / name).write_bytes(pe_header())
    return site, pkg / "lib"


def run_spec(site: Path, env_extra: dict[str, str] | None = None) -> dict:
    import os
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_PATH")}
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, "-c", DRIVER, str(site), str(ROOT), "win32"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_spec_lists_llama_cpp_without_importing_it_and_sets_the_icon(tmp_path):
    site, lib = fake_site(tmp_path, cuda=False)
    seen = run_spec(site)
    assert "exit" not in seen, seen.get("exit")
    assert seen["imported_llama_cpp"] is False, "importing llama_cpp loads llama.dll at build time"
    binaries = {Path(src).name: dest for src, dest in seen["analysis"][0]}
    assert binaries == {"ggml-base.dll": "llama_cpp/lib", "ggml.dll": "llama_cpp/lib",
                        "llama.dll": "llama_cpp/lib"}
    icons = {e["name"]: e["icon"] for e in seen["exe"]}
    assert icons == {"checkpoint-chat": [str(RES / "checkpoint-chat.ico")],
                     "CheckpointChat": [str(RES / "checkpoint-chat.ico")]}


def read_version_file(path: str) -> dict:
    """PyInstaller's version file, evaluated as PyInstaller does (eval), with recorders for
    its classes (PyInstaller.utils.win32.versioninfo's names and signatures)."""
    def record(kind):
        return lambda *args, **kw: {"kind": kind, "args": args, **kw}
    names = {n: record(n) for n in ("VSVersionInfo", "FixedFileInfo", "StringFileInfo", "StringTable",
                                     "StringStruct", "VarFileInfo", "VarStruct")}
    info = eval(Path(path).read_text("utf-8"), names)   # noqa: S307 - our own build file
    table = info["kids"][0]["args"][0][0]
    strings = {s["args"][0]: s["args"][1] for s in table["args"][1]}
    return {"ffi": info["ffi"], "table": table["args"][0], "strings": strings,
            "translation": info["kids"][1]["args"][0][0]["args"]}


def test_spec_gives_both_executables_a_version_resource(tmp_path):
    """Explorer's Details tab, Task Manager and support tools read it (the Wine tier reads
    the built exe's own resource with GetFileVersionInfoW)."""
    from engine import APP_VERSION
    site, _ = fake_site(tmp_path, cuda=False)
    seen = run_spec(site)
    numbers = tuple(int(n) for n in APP_VERSION.split(".")) + (0,) * (4 - len(APP_VERSION.split(".")))
    described = {}
    for exe in seen["exe"]:
        info = read_version_file(exe["version"])
        assert info["ffi"]["filevers"] == info["ffi"]["prodvers"] == numbers
        assert info["table"] == "040904B0" and info["translation"] == ("Translation", [1033, 1200])
        s = info["strings"]
        assert s["FileVersion"] == s["ProductVersion"] == APP_VERSION
        assert s["CompanyName"] == "Checkpoint Chat" and s["ProductName"] == "Checkpoint Chat"
        assert s["OriginalFilename"] == exe["name"] + ".exe"
        described[exe["name"]] = s["FileDescription"]
    assert set(described) == {"checkpoint-chat", "CheckpointChat"} and len(set(described.values())) == 2


def test_spec_bundles_the_cuda_runtime_explicitly(tmp_path):
    site, lib = fake_site(tmp_path, cuda=True, runtime_beside=("cudart64_12.dll",))
    cuda = tmp_path / "CUDA" / "v12.4"
    (cuda / "bin").mkdir(parents=True)
    for name in ("cublasLt64_12.dll", "cublas64_12.dll", "cufft64_11.dll"):
        (cuda / "bin" / name).write_bytes(pe_header())
    seen = run_spec(site, {"CUDA_PATH": str(cuda)})
    assert "exit" not in seen, seen.get("exit")
    binaries = [(Path(src), dest) for src, dest in seen["analysis"][0]]
    assert (lib / "cudart64_12.dll", "llama_cpp/lib") in binaries
    assert (cuda / "bin" / "cublasLt64_12.dll", "llama_cpp/lib") in binaries
    assert (cuda / "bin" / "cublas64_12.dll", "llama_cpp/lib") in binaries, "beside llama.dll, where the app looks"
    assert not any(src.name == "cufft64_11.dll" for src, _ in binaries), "only what ggml-cuda.dll needs"


def test_spec_stops_when_the_cuda_runtime_is_missing(tmp_path):
    site, lib = fake_site(tmp_path, cuda=True)
    seen = run_spec(site)
    assert "cannot build a CUDA app without its runtime" in seen["exit"]
    assert "cudart64_12.dll, cublasLt64_12.dll, cublas64_12.dll were not found" in seen["exit"]


# -- Inno Setup (item 7) -----------------------------------------------------------------------------------

def iss_text() -> str:
    return (INST / "checkpoint_chat.iss").read_text("utf-8")


def registry_entries() -> list[dict[str, str]]:
    section = iss_text().split("\n[Registry]\n", 1)[1].split("\n[", 1)[0]
    entries = []
    for line in section.splitlines():
        if line.startswith("Root:"):
            entries.append({k.strip(): v.strip().strip('"') for k, v in
                            (part.split(":", 1) for part in line.split("; "))})
    return entries


def test_uninstall_removes_every_value_and_key_it_wrote():
    entries = registry_entries()
    assert entries, "registry entries parsed"
    deleted_keys = [e["Subkey"] for e in entries if "uninsdeletekey" in e.get("Flags", "").split()]
    for e in entries:
        flags = e.get("Flags", "").split()
        covered = any(e["Subkey"] == k or e["Subkey"].startswith(k + "\\") for k in deleted_keys)
        assert covered or "uninsdeletevalue" in flags, f"{e['Subkey']} / {e['ValueName']!r} survives uninstall"
        if not covered:
            assert "uninsdeletekeyifempty" in flags, f"{e['Subkey']} stays behind, empty"
    assert r"Software\Classes\Applications\{#AppExe}" in deleted_keys
    content_type = next(e for e in entries if e["ValueName"] == "Content Type")
    assert "uninsdeletevalue" in content_type["Flags"]


def test_upgrades_replace_the_libraries_folder():
    text = iss_text()
    section = text.split("\n[InstallDelete]\n", 1)[1].split("\n[", 1)[0]
    assert 'Type: filesandordirs; Name: "{app}\\_internal"' in section
    for pattern in ("*.dll", "*.pyd"):       # an older layout's libraries beside the exes
        assert f'Type: files; Name: "{{app}}\\{pattern}"' in section
    entries = [line for line in section.splitlines() if line.startswith("Type:")]
    assert not any("unins" in e.lower() or '"{app}"' in e for e in entries)
    assert '"{app}"' not in section and "{app}\\*\"" not in section
    assert not re.search(r"\{(local|user|common)appdata\}", section, re.I)


def test_inno_setup_version_and_file_version_and_signing_hooks():
    text = iss_text()
    assert re.search(r"^#if VER < EncodeVer\(6,3,0\)\n\s*#error .*6\.3", text, re.M)
    assert "x64compatible" in text
    assert "VersionInfoVersion={#AppVersion}" in text
    sign = text.split("#ifdef Sign", 1)[1].split("#else", 1)[0]
    assert "SignTool=signtool" in sign and "SignedUninstaller=yes" in sign and '"signonce"' in sign
    files = text.split("\n[Files]\n", 1)[1].split("\n[", 1)[0]
    assert files.count("{#SignFlag}") == 2, "both executables signed when Sign is defined"
    assert 'Excludes: "\\{#AppExe},\\{#CliExe}"' in files, "the executables are not copied twice"


# -- build_cuda_llama.ps1 (item 5) ------------------------------------------------------------------------

def ps1() -> str:
    return (INST / "build_cuda_llama.ps1").read_text("utf-8")


def test_cuda_version_is_checked_before_visual_studio():
    text = ps1()
    assert '$MinCuda = [version]"12.4"' in text and "STL1002" in text
    assert text.index("$cudaVersion -lt $MinCuda") < text.index("Launch-VsDevShell.ps1")


def test_native_programs_cannot_trip_stop_on_stderr():
    text = ps1()
    body = text.split("function Invoke-Native", 1)[1].split("\n}", 1)[0]
    assert '$ErrorActionPreference = "Continue"' in body and "2>&1" in body
    code = [ln for ln in text.splitlines() if not ln.lstrip().startswith("#")]
    for line in code:
        stripped = line.strip()
        if re.match(r"^(\$\w+ = )?& \$(python|nvcc|vswhere)\b", stripped) or re.match(r"^py -3\b", stripped):
            pytest.fail(f"native program outside Invoke-Native: {stripped}")
        assert "*>" not in line, f"PowerShell redirection of a native program: {stripped}"


def test_mutex_workaround_and_app_dependencies_and_arch():
    text = ps1()
    assert '$env:CXXFLAGS = "/D_DISABLE_CONSTEXPR_MUTEX_CONSTRUCTOR"' in text
    assert '$env:CUDAFLAGS = "-D_DISABLE_CONSTEXPR_MUTEX_CONSTRUCTOR"' in text
    assert "pip install --quiet -e $Repo" in text and "if ($created)" in text
    native = text.split('if ($Arch -eq "native")', 1)[1].split("\n}", 1)[0]
    assert "nvidia-smi --query-gpu=compute_cap" in native and "throw" in native


def test_paths_with_spaces_and_any_msvc_toolset():
    """MSVC 14.44 (VS 17.14) and a %TEMP% under 'C:\\Users\\Zoë Müller': no toolset folder name
    is assumed (cl.exe comes from the developer shell's PATH), Invoke-Logged quotes every
    argument holding a space itself, and the build gets a plain TEMP before pip runs."""
    text = ps1()
    code = "\n".join(ln for ln in text.split("#>", 1)[1].splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r"MSVC\\14\.|14\.4\d\.\d{5}", code), "a toolset folder name"
    assert 'foreach ($tool in @("cl", "cmake", "ninja"))' in text
    logged = text.split("function Invoke-Logged", 1)[1].split("\n}", 1)[0]
    assert "-ArgumentList $quoted" in logged and """'"' + $_ + '"'""" in logged
    assert '"`"$' not in text, "quoted twice once Invoke-Logged quotes"
    temp = text.index("$env:TEMP = $plain")
    assert "ShortPath" in text and temp < text.index("pip\", \"install\", \"--no-cache-dir\"")
    assert '$env:TMP = $plain' in text
