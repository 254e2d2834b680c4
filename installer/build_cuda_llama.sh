#!/usr/bin/env bash
# Build the CUDA llama.cpp library for Checkpoint Chat on Linux (gcc + CUDA 12.x/13.x).
#
# It builds llama-cpp-python 0.3.36 from source with CUDA: the bindings and the library
# come from the same llama.cpp commit (0c1e57098), which is the only library the app
# can safely call.  Either install it into a virtual environment, or build a wheel.
#
#   installer/build_cuda_llama.sh --venv PATH/TO/VENV [--arch LIST] [--jobs N]
#   installer/build_cuda_llama.sh --wheel-dir DIR     [--arch LIST] [--jobs N]
#
#   --arch LIST   CMAKE_CUDA_ARCHITECTURES, e.g. 90 (H100/H200), 89 (RTX 40xx),
#                 86 (RTX 30xx), "86;89" (both).  Default: "native" when nvidia-smi sees a
#                 GPU (only that GPU: shortest build), else ggml's own list (slow: every arch).
#   --jobs N      parallel compile jobs (default: all cores).  nvcc needs ~2 GB per job.
#
# The CPU flags are portable (-DGGML_NATIVE=OFF + AVX2/FMA/F16C): a library built on one
# machine must run on another, and a native build can die with SIGILL (FIELD_NOTES).
# pip's wheel cache ignores CMAKE_ARGS, so the build always runs with --no-cache-dir.
set -euo pipefail

VENV="" WHEEL_DIR="" ARCH="" JOBS="$(nproc)"
while [ $# -gt 0 ]; do
    case "$1" in
        --venv) VENV="$2"; shift 2;;
        --wheel-dir) WHEEL_DIR="$2"; shift 2;;
        --arch) ARCH="$2"; shift 2;;
        --jobs) JOBS="$2"; shift 2;;
        -h|--help) sed -n '2,20p' "$0"; exit 0;;
        *) echo "unknown option: $1 (see --help)" >&2; exit 2;;
    esac
done
if [ -z "$VENV" ] && [ -z "$WHEEL_DIR" ]; then
    echo "choose where the build goes: --venv PATH or --wheel-dir DIR (see --help)" >&2
    exit 2
fi

need() { command -v "$1" >/dev/null || { echo "missing: $1 ($2)" >&2; exit 1; }; }
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
fi
need nvcc "install the CUDA toolkit 12.x, or put its bin folder on PATH"
need gcc "install gcc/g++ (build-essential)"
need cmake "install cmake >= 3.21 (pip install cmake works too)"
echo "nvcc: $(nvcc --version | tail -1)"

if [ -z "$ARCH" ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
        ARCH=native
    else
        ARCH=""
        echo "no GPU visible: building for ggml's default list of architectures (slow)"
    fi
fi

# -DGGML_RPC=ON: remote workers (README, "More than one machine"); a GPU machine is their usual host
CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_RPC=ON"
CMAKE_ARGS="$CMAKE_ARGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
[ -n "$ARCH" ] && CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_CUDA_ARCHITECTURES=$ARCH"
export CMAKE_ARGS CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
echo "CMAKE_ARGS=$CMAKE_ARGS (jobs: $JOBS)"

start=$(date +%s)
if [ -n "$VENV" ]; then
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --upgrade --quiet pip
    "$VENV/bin/python" -m pip install --no-cache-dir --force-reinstall --no-deps \
        --verbose llama-cpp-python==0.3.36 > "$VENV/llama-cuda-build.log" 2>&1 || {
        tail -40 "$VENV/llama-cuda-build.log"; echo "build failed; full log: $VENV/llama-cuda-build.log" >&2; exit 1; }
    # --no-deps above keeps the rest of the venv; make sure the bindings' own needs exist
    "$VENV/bin/python" -m pip install --quiet "numpy>=1.24" "typing-extensions>=4.5" diskcache jinja2
    LIB="$("$VENV/bin/python" -c 'import llama_cpp, pathlib; print(pathlib.Path(llama_cpp.__file__).parent / "lib")')"
    ls "$LIB"
    [ -e "$LIB/libggml-cuda.so" ] || { echo "FAIL: no libggml-cuda.so in $LIB: not a CUDA build" >&2; exit 1; }
    [ -e "$LIB/libggml-rpc.so" ] || { echo "FAIL: no libggml-rpc.so in $LIB: built without -DGGML_RPC=ON" >&2; exit 1; }
    "$VENV/bin/python" - <<'PY'
import llama_cpp.llama_cpp as ll
ok = ll.llama_supports_gpu_offload()
print("GPU offload:", "yes" if ok else "NO")
raise SystemExit(0 if ok else 1)
PY
else
    mkdir -p "$WHEEL_DIR"
    python3 -m pip wheel --no-cache-dir --no-deps -w "$WHEEL_DIR" llama-cpp-python==0.3.36
    ls -l "$WHEEL_DIR"
fi
echo "built in $(( $(date +%s) - start )) s"
echo "Point the app at it: checkpoint-chat info --llama-lib <folder with libllama.so>, or install"
echo "the wheel into the app's own environment."
