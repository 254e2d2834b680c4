#!/usr/bin/env bash
# The engine's speed figures on two checkouts, interleaved in one run (issue 22: a refactor
# must not move them beyond noise).
#
#   benchmarks/before_after.sh BEFORE_DIR [AFTER_DIR] [ROUNDS]
#
# BEFORE_DIR: another checkout (e.g. `git worktree add --detach /tmp/before 99b52c9`);
# AFTER_DIR defaults to this one.  Each benchmark runs ROUNDS times (default 2) on each
# tree, alternating before/after so that the machine's drift hits both alike; every output
# is kept under $OUT (default /tmp/before-after) and its tables are printed at the end.
# Uses the active Python (a venv with the app's test extras); exits 0.
#   worker_speed  one answer through the engine thread vs generate() on a Runtime
#   save_speed    a save vs a raw write+fsync of the same bytes (SmolLM2, 2k and 4k tokens)
#   parallel b    switching to a resident conversation / restoring it / prefilling it
#   ui_stall      the UI thread's heartbeat gaps (worst, p99) per phase, in the window
set -uo pipefail
BEFORE="$(cd "$1" && pwd)"
AFTER="$(cd "${2:-$(dirname "$0")/..}" && pwd)"
ROUNDS="${3:-2}"
OUT="${OUT:-/tmp/before-after}"
mkdir -p "$OUT"
export QT_QPA_PLATFORM=offscreen
run() {   # run TREE NAME COMMAND...
    local tree="$1" name="$2"; shift 2
    local label; label=$([ "$tree" = "$BEFORE" ] && echo before || echo after)
    echo "== $name ($label, round $r)"
    (cd "$tree" && PYTHONPATH="$tree" "$@") > "$OUT/$name.$label.$r.txt" 2>&1
}
for r in $(seq 1 "$ROUNDS"); do
    for tree in "$BEFORE" "$AFTER"; do
        run "$tree" worker_speed python benchmarks/worker_speed.py --rounds 3 --tokens 200
        run "$tree" save_speed python -m benchmarks.save_speed --models smollm --sizes 2048,4096 --repeats 5
        run "$tree" parallel_b python -m benchmarks.parallel --tables b --switch-tokens 2000
        run "$tree" ui_stall python benchmarks/ui_stall.py --threads 2 --prompt-tokens 2000 \
            --phases prefill,generation,save,pause,two
    done
done
for f in "$OUT"/*.txt; do
    echo; echo "######## $(basename "$f")"
    grep -E '^\||x$|tok/s|worst stall|switch|resident' "$f" | head -40
done
exit 0
