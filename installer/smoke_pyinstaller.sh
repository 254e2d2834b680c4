#!/usr/bin/env bash
# Smoke test of the one-folder build: build it with PyInstaller, then run the frozen
# app as a user would.  Too slow for every CI run (a few minutes on 2 cores); run it
# before a release and after touching installer/ or the packaging of llama_cpp / Qt.
#
#   installer/smoke_pyinstaller.sh [--keep]
#
# Uses the repository's .venv (pip-installs PyInstaller into it if missing).  Writes
# only under build/smoke/ (git-ignored).  Exit status 0 only if every step passed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# shellcheck disable=SC1091
. .venv/bin/activate
OUT="$ROOT/build/smoke"
APP="$OUT/dist/CheckpointChat"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export CHECKPOINT_CHAT_HOME="$WORK/home"   # never touch the real user folders
unset CHECKPOINT_CHAT_LLAMA_LIB LLAMA_CPP_LIB_PATH

step() { printf '\n== %s\n' "$*"; }
now() { date +%s.%N; }
elapsed() { python -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$1" "$(now)"; }

python -c "import PyInstaller" 2>/dev/null || pip install --quiet pyinstaller

step "build (PyInstaller, one folder, default model bundled)"
t=$(now)
CHECKPOINT_CHAT_BUNDLE_MODEL=1 pyinstaller --noconfirm --log-level WARN \
    --distpath "$OUT/dist" --workpath "$OUT/work" installer/checkpoint_chat.spec
BUILD_S=$(elapsed "$t")
du -sh "$APP" | sed 's/^/size: /'
for heavy in llm openai pydantic; do
    if [ -e "$APP/_internal/$heavy" ]; then echo "FAIL: $heavy was bundled"; exit 1; fi
done
test -x "$APP/checkpoint-chat" && test -x "$APP/CheckpointChat"
ls "$APP/_internal/llama_cpp/lib/" | tr '\n' ' '; echo

step "checkpoint-chat --version"
t=$(now)
"$APP/checkpoint-chat" --version | tee "$WORK/version.txt"
grep -q "^checkpoint-chat " "$WORK/version.txt"
VERSION_S=$(elapsed "$t")

step "checkpoint-chat run (pause after 4 tokens, save)"
t=$(now)
CKPT="$WORK/smoke.kvckpt"
"$APP/checkpoint-chat" run --prompt hi -n 8 --stop-after 4 --seed 1 --checkpoint-save "$CKPT"
test -s "$CKPT"
RUN_S=$(elapsed "$t")

step "checkpoint-chat validate"
t=$(now)
"$APP/checkpoint-chat" validate "$CKPT"
VALIDATE_S=$(elapsed "$t")

step "checkpoint-chat run --checkpoint-load (resume in a new frozen process)"
"$APP/checkpoint-chat" run --checkpoint-load "$CKPT" -n 8

step "checkpoint-chat info --llama-lib (the library probe as a frozen child process)"
t=$(now)
"$APP/checkpoint-chat" info --llama-lib "$APP/_internal/llama_cpp/lib"
INFO_S=$(elapsed "$t")
mkdir -p "$WORK/badlib" && printf 'not a library' > "$WORK/badlib/libllama.so"
if "$APP/checkpoint-chat" info --llama-lib "$WORK/badlib" 2> "$WORK/bad.txt"; then
    echo "FAIL: a fake library was accepted"; exit 1
fi
cat "$WORK/bad.txt"; grep -q "not a shared library" "$WORK/bad.txt"

step "GUI, offscreen, 8 seconds"
t=$(now)
set +e
QT_QPA_PLATFORM=offscreen timeout 8 "$APP/CheckpointChat" > "$WORK/gui.txt" 2>&1
GUI_RC=$?
set -e
GUI_S=$(elapsed "$t")
tail -5 "$WORK/gui.txt"
if grep -q "Traceback" "$WORK/gui.txt"; then echo "FAIL: the GUI raised"; exit 1; fi
case $GUI_RC in
    124) echo "GUI was still running after 8 s (started fine)";;
    0|2) echo "GUI exited cleanly with status $GUI_RC";;
    *)   echo "FAIL: the GUI exited with status $GUI_RC"; exit 1;;
esac

step "timings"
printf '%-22s %s\n' build "$BUILD_S" "--version" "$VERSION_S" "run (8 tok, save)" "$RUN_S" \
    validate "$VALIDATE_S" "info + probe" "$INFO_S" "GUI offscreen" "$GUI_S"
[ "${1:-}" = "--keep" ] || rm -rf "$OUT/work"
echo "SMOKE OK"
