<#
.SYNOPSIS
  Build the CUDA llama.dll for Checkpoint Chat on Windows 11 (VS 2022 Build Tools + CUDA 12.x).

.DESCRIPTION
  Builds llama-cpp-python 0.3.36 from source with CUDA, so that the bindings and llama.dll
  come from the same llama.cpp commit (0c1e57098): the only llama.dll the app can safely
  call.  Installs it into the app's Python environment (-Venv) or builds a wheel (-WheelDir).

  Needs, installed beforehand:
    * Visual Studio 2022 Build Tools, workload "Desktop development with C++"
      (includes MSVC, the Windows SDK, CMake and Ninja).
    * CUDA Toolkit 12.x (sets CUDA_PATH).  Install it AFTER Visual Studio.
    * Python 3.11+ (64-bit).

  The build runs in a Visual Studio developer shell with the Ninja generator, so the
  CUDA <-> Visual Studio integration is not needed.  CPU flags are portable (no
  -march=native), pip's cache is bypassed (it ignores CMAKE_ARGS).

.PARAMETER Venv
  The app's virtual environment (created if missing).
.PARAMETER WheelDir
  Build a wheel into this folder instead.
.PARAMETER Arch
  CMAKE_CUDA_ARCHITECTURES: 89 (RTX 40xx), 86 (RTX 30xx), 75 (RTX 20xx), 120 (RTX 50xx,
  needs CUDA 12.8+), "86;89" for several.  Default: native (the GPU in this PC).
.PARAMETER Jobs
  Parallel compile jobs (default: logical processors).  nvcc needs ~2 GB RAM per job.

.EXAMPLE
  powershell -ExecutionPolicy Bypass -File installer\build_cuda_llama.ps1 -Venv .venv -Arch 89
#>
param(
    [string]$Venv = "",
    [string]$WheelDir = "",
    [string]$Arch = "native",
    [int]$Jobs = [Environment]::ProcessorCount
)
$ErrorActionPreference = "Stop"

if (-not $Venv -and -not $WheelDir) { throw "Choose where the build goes: -Venv PATH or -WheelDir DIR" }
if (-not [Environment]::Is64BitOperatingSystem) { throw "A 64-bit Windows is needed" }

# -- Visual Studio 2022 Build Tools --------------------------------------------------------
$vswhere = Join-Path ${env:ProgramFiles(x86)} "Microsoft Visual Studio\Installer\vswhere.exe"
if (-not (Test-Path $vswhere)) {
    throw "Visual Studio 2022 Build Tools not found. Install them with the workload 'Desktop development with C++': https://visualstudio.microsoft.com/downloads/#build-tools-for-visual-studio-2022"
}
$vs = & $vswhere -latest -version "[17.0,18.0)" -products * `
    -requires Microsoft.VisualStudio.Component.VC.Tools.x86.x64 -property installationPath
if (-not $vs) { throw "Visual Studio 2022 has no C++ tools: add the workload 'Desktop development with C++'" }
Write-Host "Visual Studio: $vs"
& (Join-Path $vs "Common7\Tools\Launch-VsDevShell.ps1") -Arch amd64 -HostArch amd64 -SkipAutomaticLocation | Out-Null

# -- CUDA ---------------------------------------------------------------------------------
if (-not $env:CUDA_PATH -or -not (Test-Path (Join-Path $env:CUDA_PATH "bin\nvcc.exe"))) {
    throw "CUDA Toolkit not found (CUDA_PATH is '$env:CUDA_PATH'). Install CUDA 12.x from https://developer.nvidia.com/cuda-downloads after Visual Studio."
}
$nvccVersion = (& (Join-Path $env:CUDA_PATH "bin\nvcc.exe") --version | Select-Object -Last 1)
Write-Host "CUDA: $env:CUDA_PATH ($nvccVersion)"
if (-not (Test-Path "$env:SystemRoot\System32\nvcuda.dll")) {
    Write-Warning "No NVIDIA driver found (nvcuda.dll): the build will work, running it will not."
}
foreach ($tool in @("cmake", "ninja")) {
    if (-not (Get-Command $tool -ErrorAction SilentlyContinue)) {
        throw "$tool not found in the developer shell: add 'C++ CMake tools for Windows' to the Build Tools"
    }
}

# -- build ----------------------------------------------------------------------------------
$env:CMAKE_GENERATOR = "Ninja"
$env:CMAKE_BUILD_PARALLEL_LEVEL = "$Jobs"
$env:CMAKE_ARGS = "-DGGML_CUDA=on -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON " +
                  "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES=$Arch"
Write-Host "CMAKE_ARGS=$env:CMAKE_ARGS (jobs: $Jobs)"
$start = Get-Date

if ($Venv) {
    $python = Join-Path $Venv "Scripts\python.exe"
    if (-not (Test-Path $python)) { py -3 -m venv $Venv; if ($LASTEXITCODE) { throw "could not create $Venv" } }
    & $python -m pip install --upgrade --quiet pip
    & $python -m pip install --no-cache-dir --force-reinstall --no-deps --verbose "llama-cpp-python==0.3.36" *> (Join-Path $Venv "llama-cuda-build.log")
    if ($LASTEXITCODE) {
        Get-Content (Join-Path $Venv "llama-cuda-build.log") -Tail 40
        throw "build failed; full log: $(Join-Path $Venv 'llama-cuda-build.log')"
    }
    & $python -m pip install --quiet "numpy>=1.24" "typing-extensions>=4.5" diskcache jinja2
    $lib = & $python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')"
    Get-ChildItem $lib | Format-Table Name, Length
    if (-not (Test-Path (Join-Path $lib "ggml-cuda.dll"))) { throw "no ggml-cuda.dll in ${lib}: not a CUDA build" }
    # The app's own check: child-process probe, then device list (CUDA device name, free VRAM)
    Push-Location (Join-Path $PSScriptRoot "..")   # the repository, for `-m engine.cli`
    try {
        & $python -m engine.cli info --llama-lib $lib
        if ($LASTEXITCODE) { throw "the app refused the new build (message above)" }
    } finally { Pop-Location }
} else {
    New-Item -ItemType Directory -Force $WheelDir | Out-Null
    py -3 -m pip wheel --no-cache-dir --no-deps -w $WheelDir "llama-cpp-python==0.3.36"
    if ($LASTEXITCODE) { throw "wheel build failed" }
    Get-ChildItem $WheelDir
}
Write-Host ("built in {0:N0} s" -f ((Get-Date) - $start).TotalSeconds)
