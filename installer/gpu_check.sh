#!/usr/bin/env bash
# GPU check on a fresh Linux machine with an NVIDIA H200 (sm_90), offline.
#
# Builds llama-cpp-python==0.3.36 with CUDA for CMAKE_CUDA_ARCHITECTURES=90 only (short
# build) in a fresh venv, then runs installer/gpu_bench.py with every layer offloaded
# (-ngl 99): the determinism contract across processes at --temp 0.8 --seed 1, restore vs
# recompute time to first token at 8k and 32k tokens (Gemma 3 270M: 32k context), and
# the pause latency during prefill and during decode.
#
# The device machine reaches no network and receives at most 64 MiB per call, so the
# inputs are prepared HERE first, in .gpu/ (git-ignored through .git/info/exclude):
#
#   installer/gpu_check.sh prepare      # here: trimmed llama.cpp source, wheels, model parts
#
# then, on the device machine, back to back (it stays warm ~30 s between calls, and
# /tmp/ccgpu survives while it is warm):
#
#   call 1  carry [.gpu/src, .gpu/whl]  installer/gpu_check.sh build      (~4-6 min on 16 cores)
#   call 2+ carry [.gpu/parts/N]        installer/gpu_check.sh stage      (one model part each)
#   last    carry []                    installer/gpu_check.sh check      (~2-3 min)
#
# or, if the model is already on the machine, one call:  MODEL=/path.gguf gpu_check.sh all
# Results are printed and copied to $OUT/gpu_check.txt when $OUT is set.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
STATE=/tmp/ccgpu
VENV="$STATE/venv"
PY=${PYTHON:-python3}
CUDA_ARCH=${CUDA_ARCH:-90}
PIN="llama-cpp-python==0.3.36"
CMAKE_ARGS="-DGGML_CUDA=on -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DCMAKE_CUDA_ARCHITECTURES=$CUDA_ARCH -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAVA_BUILD=OFF"
PART_MB=56

log() { printf '[gpu_check %s] %s\n' "$(date +%T)" "$*"; }

prepare() {   # runs where pip can reach the package index
    grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
    rm -rf .gpu && mkdir -p .gpu/src .gpu/whl .gpu/parts
    local tmp; tmp="$(mktemp -d)"
    pip download --no-deps --no-binary :all: --no-build-isolation -d "$tmp" "$PIN" >/dev/null 2>&1 \
        || pip download --no-deps --no-binary :all: -d "$tmp" "$PIN"
    tar -xzf "$tmp"/llama_cpp_python-0.3.36.tar.gz -C "$tmp"
    local src="$tmp/llama_cpp_python-0.3.36" v="$tmp/llama_cpp_python-0.3.36/vendor/llama.cpp"
    # Drop what a CUDA build of libllama/libmtmd never reads: vocab test models, docs,
    # other backends; the sdist is 77 MB and a call carries 64 MiB.
    rm -rf "$v"/models "$v"/docs "$v"/media "$v"/tests "$v"/.github "$v"/examples/*/ \
           "$v"/gguf-py/tests "$src"/docs "$src"/examples
    for b in vulkan sycl opencl metal cann musa hip kompute webgpu zdnn rpc blas; do
        rm -rf "$v/ggml/src/ggml-$b"
    done
    mkdir -p "$v/examples" && : > "$v/examples/CMakeLists.txt"
    tar -C "$tmp" -czf .gpu/src/llama_cpp_python-0.3.36.tar.gz llama_cpp_python-0.3.36
    # pure-Python needs of the bindings and the app that the device image lacks
    pip download --no-deps --only-binary=:all: -d .gpu/whl diskcache platformdirs >/dev/null
    # the model, in parts small enough for one call each
    local model; model="$(python -c 'from engine.models import gemma_model_path as g; print(g())')"
    split -b "${PART_MB}M" -d "$model" .gpu/parts/gemma.gguf.
    sha256sum "$model" | cut -d' ' -f1 > .gpu/gemma.sha256
    for p in .gpu/parts/gemma.gguf.*; do mkdir -p ".gpu/parts/${p##*.}"; mv "$p" ".gpu/parts/${p##*.}/"; done
    cp .gpu/gemma.sha256 .gpu/parts/00/
    rm -rf "$tmp"
    du -sh .gpu/src .gpu/whl .gpu/parts/* | sed 's/^/  /'
    log "prepared; carry .gpu/src and .gpu/whl for 'build', then each .gpu/parts/NN for 'stage'"
}

build() {
    command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
    log "nvcc $(nvcc --version | tail -1); GPU: $(nvidia-smi --query-gpu=name,memory.free --format=csv,noheader)"
    mkdir -p "$STATE"
    cublas_fallback
    "$PY" -m venv --system-site-packages "$VENV"   # reuse the image's numpy, jinja2, scikit-build-core
    "$VENV/bin/pip" install -q --no-index --no-deps .gpu/whl/*.whl
    local t0=$SECONDS
    CMAKE_ARGS="$CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
        "$VENV/bin/pip" install --no-index --no-build-isolation --no-deps --no-cache-dir \
        .gpu/src/llama_cpp_python-0.3.36.tar.gz > "$STATE/build.log" 2>&1 \
        || { tail -40 "$STATE/build.log"; log "BUILD FAILED"; exit 1; }
    log "built in $((SECONDS - t0)) s"
    # llama_supports_gpu_offload() is true for any build with the RPC backend too: look for
    # the CUDA backend itself
    "$VENV/bin/python" -c "import llama_cpp, pathlib; lib = pathlib.Path(llama_cpp.__file__).parent / 'lib'; assert any(lib.glob('libggml-cuda*')), 'not a CUDA build (no libggml-cuda in ' + str(lib) + ')'; print('CUDA backend: yes')"
}

cublas_fallback() {
    # ggml-cuda links cuBLAS.  An image whose toolkit has nvcc but no cuBLAS (as this
    # project's CPU machines) may still hold it as the nvidia-cublas pip wheel: point
    # CMake's FindCUDAToolkit at that copy, and the loader too (LD_LIBRARY_PATH).
    local cuda_lib; cuda_lib="$(dirname "$(dirname "$(command -v nvcc)")")"
    if ls "$cuda_lib"/lib64/libcublas.so* "$cuda_lib"/targets/*/lib/libcublas.so* >/dev/null 2>&1; then
        return
    fi
    local wheel; wheel="$("$PY" -c 'import nvidia.cublas as c, os; print(list(c.__path__)[0])' 2>/dev/null || true)"
    [ -n "$wheel" ] || { log "no cuBLAS in the toolkit nor as a wheel: the build will fail"; return; }
    local lib="$STATE/cublas"; mkdir -p "$lib"
    for name in cublas cublasLt; do
        local real; real="$(ls "$wheel"/lib/lib$name.so.* | head -1)"
        ln -sf "$real" "$lib/lib$name.so"
        CMAKE_ARGS="$CMAKE_ARGS -DCUDA_${name}_LIBRARY=$lib/lib$name.so"
    done
    export CPATH="$wheel/include${CPATH:+:$CPATH}" LD_LIBRARY_PATH="$wheel/lib:$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "export LD_LIBRARY_PATH=$LD_LIBRARY_PATH" > "$STATE/env.sh"
    log "cuBLAS from the pip wheel at $wheel"
}

stage() {
    mkdir -p "$STATE/parts"
    for d in .gpu/parts/*/; do cp "$d"* "$STATE/parts/"; log "staged $(ls "$d" | tr '\n' ' ')"; done
    ls -la "$STATE/parts"
}

model() {
    if [ -n "${MODEL:-}" ]; then echo "$MODEL"; return; fi
    local out="$STATE/gemma-3-270m-Q4_K_M.gguf"
    if [ ! -s "$out" ]; then
        cat "$STATE"/parts/gemma.gguf.* > "$out"
        echo "$(cat "$STATE/parts/gemma.sha256")  $out" | sha256sum -c - >&2 || { rm -f "$out"; exit 1; }
    fi
    echo "$out"
}

check() {
    local m; m="$(model)"
    log "model $m"
    export PYTHONUNBUFFERED=1 CHECKPOINT_CHAT_HOME="$STATE/home"
    # shellcheck disable=SC1091
    [ -f "$STATE/env.sh" ] && . "$STATE/env.sh"
    # the app runs from this checkout with the venv's CUDA bindings
    PYTHONPATH="$ROOT" "$VENV/bin/python" installer/gpu_bench.py --model "$m" --ngl 99 \
        --sizes 8192,32768 --n 64 --k 24 2>&1 | grep -v '^llama_\|^load\|^print_info' | tee "$STATE/result.txt"
    local rc=${PIPESTATUS[0]}
    [ -n "${OUT:-}" ] && cp "$STATE/result.txt" "$OUT/gpu_check.txt" && cp "$STATE/build.log" "$OUT/" 2>/dev/null
    return "$rc"
}

case "${1:-all}" in
    prepare) prepare;;
    build) build;;
    stage) stage;;
    check) check;;
    all) build; [ -d .gpu/parts ] && stage || true; check;;
    *) echo "usage: $0 prepare|build|stage|check|all" >&2; exit 2;;
esac
