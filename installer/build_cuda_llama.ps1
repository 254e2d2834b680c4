<#
.SYNOPSIS
  Build the CUDA llama.dll for Checkpoint Chat on Windows 11 (VS 2022 Build Tools + CUDA 12.4+).

.DESCRIPTION
  Builds llama-cpp-python 0.3.36 from source with CUDA, so that the bindings and llama.dll
  come from the same llama.cpp commit (0c1e57098): the only llama.dll the app can safely
  call.  Installs it into the app's Python environment (-Venv) or builds a wheel (-WheelDir).

  Needs, installed beforehand:
    * Visual Studio 2022 Build Tools, workload "Desktop development with C++"
      (includes MSVC, the Windows SDK, CMake and Ninja).
    * CUDA Toolkit 12.4 or newer (sets CUDA_PATH).  Install it AFTER Visual Studio.
      Visual Studio 2022 17.10 and later (MSVC 14.40+) refuse older CUDA versions in their
      STL headers (error STL1002), so the script checks nvcc's version first.
    * Python 3.11+ (64-bit).

  The build runs in a Visual Studio developer shell with the Ninja generator, so the
  CUDA <-> Visual Studio integration is not needed.  CPU flags are portable (no
  -march=native), pip's cache is bypassed (it ignores CMAKE_ARGS).

  It is compiled with _DISABLE_CONSTEXPR_MUTEX_CONSTRUCTOR (C++ and CUDA host code): with
  MSVC 14.40+ a std::mutex otherwise needs the msvcp140.dll of that same toolset, and an
  older one loaded first by another part of the process (PySide6 ships its own) makes the
  DLL crash at its first lock.  The Qt-free library probe would not see that crash.

  Windows PowerShell 5.1 turns the first stderr line of a native program into a
  terminating error when $ErrorActionPreference is "Stop"; native programs therefore run
  through Invoke-Native / Invoke-Logged, where only their exit status decides.

.PARAMETER Venv
  The app's virtual environment.  Created if missing; the app and its dependencies are
  then installed into it (after the CUDA build, which satisfies the llama-cpp-python pin).
.PARAMETER WheelDir
  Build a wheel into this folder instead.
.PARAMETER Arch
  CMAKE_CUDA_ARCHITECTURES: 89 (RTX 40xx), 86 (RTX 30xx), 75 (RTX 20xx), 120 (RTX 50xx,
  needs CUDA 12.8+), "86;89" for several.  Default: native, resolved here to the compute
  capability nvidia-smi reports for the GPUs in this PC; without a GPU, name one.
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
$MinCuda = [version]"12.4"          # Visual Studio 2022 17.10+ (MSVC 14.40+) refuses older
$Repo = (Resolve-Path (Join-Path $PSScriptRoot "..")).Path

function Invoke-Native {
    # Runs a native program; its stderr lines are output like its stdout.  The preference
    # below is this function's own (PowerShell scopes it), not the script's "Stop".
    param([scriptblock]$Command)
    $ErrorActionPreference = "Continue"
    & $Command 2>&1 | ForEach-Object { "$_" }
}

function Invoke-Logged {
    # Runs $File with $Arguments (paths with spaces welcome), stdout and stderr into $Log;
    # returns the exit status.  Start-Process keeps stderr away from PowerShell.
    param([string]$File, [string[]]$Arguments, [string]$Log)
    $err = "$Log.stderr"
    # Start-Process joins its arguments with spaces: each one that holds a space is quoted here
    $quoted = @($Arguments | ForEach-Object { if ($_ -match '\s') { '"' + $_ + '"' } else { $_ } })
    $p = Start-Process -FilePath $File -ArgumentList $quoted -NoNewWindow -Wait -PassThru `
        -RedirectStandardOutput $Log -RedirectStandardError $err
    Get-Content $err | Add-Content $Log
    Remove-Item $err
    return $p.ExitCode
}

if (-not $Venv -and -not $WheelDir) { throw "Choose where the build goes: -Venv PATH or -WheelDir DIR" }
if (-not [Environment]::Is64BitOperatingSystem) { throw "A 64-bit Windows is needed" }

# -- CUDA first: its version decides whether this Visual Studio can compile it ----------------
if (-not $env:CUDA_PATH -or -not (Test-Path (Join-Path $env:CUDA_PATH "bin\nvcc.exe"))) {
    throw "CUDA Toolkit not found (CUDA_PATH is '$env:CUDA_PATH'). Install CUDA $MinCuda or newer from https://developer.nvidia.com/cuda-downloads after Visual Studio."
}
$nvcc = Join-Path $env:CUDA_PATH "bin\nvcc.exe"
$nvccText = (Invoke-Native { & $nvcc --version }) -join "`n"
if ($LASTEXITCODE -or $nvccText -notmatch "release (\d+)\.(\d+)") {
    throw "could not read the CUDA version from '$nvcc --version':`n$nvccText"
}
$cudaVersion = [version]"$($Matches[1]).$($Matches[2])"
Write-Host "CUDA: $env:CUDA_PATH ($cudaVersion)"
if ($cudaVersion -lt $MinCuda) {
    throw "CUDA $cudaVersion is too old: Visual Studio 2022 17.10 and later refuse it (STL1002). Install CUDA $MinCuda or newer (after Visual Studio), or open a new shell if you just did."
}
if (-not (Test-Path "$env:SystemRoot\System32\nvcuda.dll")) {
    Write-Warning "No NVIDIA driver found (nvcuda.dll): the build will work, running it will not."
}

# -- target GPU architectures ----------------------------------------------------------------
if ($Arch -eq "native") {
    # CMake's "native" asks the GPU at configure time and fails without one: resolve it here
    $caps = @()
    if (Get-Command nvidia-smi -ErrorAction SilentlyContinue) {
        $caps = @(Invoke-Native { & nvidia-smi --query-gpu=compute_cap --format=csv,noheader } |
                  Where-Object { $_ -match '^\s*\d+\.\d+\s*$' } | ForEach-Object { $_.Trim().Replace(".", "") })
    }
    if (-not $caps) {
        throw "-Arch native needs a visible NVIDIA GPU (nvidia-smi found none). Name the target instead: -Arch 89 (RTX 40xx), 86 (RTX 30xx), 75 (RTX 20xx), 120 (RTX 50xx), or '86;89' for several."
    }
    $Arch = ($caps | Sort-Object -Unique) -join ";"
    Write-Host "GPU architectures of this PC: $Arch"
}

# -- Visual Studio 2022 Build Tools --------------------------------------------------------
$vswhere = Join-Path ${env:ProgramFiles(x86)} "Microsoft Visual Studio\Installer\vswhere.exe"
if (-not (Test-Path $vswhere)) {
    throw "Visual Studio 2022 Build Tools not found. Install them with the workload 'Desktop development with C++': https://visualstudio.microsoft.com/downloads/#build-tools-for-visual-studio-2022"
}
$vs = Invoke-Native { & $vswhere -latest -version "[17.0,18.0)" -products * `
    -requires Microsoft.VisualStudio.Component.VC.Tools.x86.x64 -property installationPath } | Select-Object -First 1
if (-not $vs) { throw "Visual Studio 2022 has no C++ tools: add the workload 'Desktop development with C++'" }
Write-Host "Visual Studio: $vs"
& (Join-Path $vs "Common7\Tools\Launch-VsDevShell.ps1") -Arch amd64 -HostArch amd64 -SkipAutomaticLocation | Out-Null
Write-Host "MSVC toolset: $env:VCToolsVersion"
# cl.exe from the developer shell's PATH, whichever toolset folder (14.44.35207, ...) it is
foreach ($tool in @("cl", "cmake", "ninja")) {
    if (-not (Get-Command $tool -ErrorAction SilentlyContinue)) {
        throw "$tool not found in the developer shell: add 'C++ CMake tools for Windows' to the Build Tools"
    }
}

# -- build ----------------------------------------------------------------------------------
# pip builds in %TEMP%, under the user's profile: a user name with a space or accents
# then reaches nvcc, cudafe++ and the command lines CMake writes, which do not all
# cope.  The build gets a plain TEMP: the 8.3 short name, or a folder on the system drive.
function Test-PlainPath([string]$Path) { return $Path -match '^[\x21-\x7E]+$' }
if (-not (Test-PlainPath $env:TEMP)) {
    $plain = (New-Object -ComObject Scripting.FileSystemObject).GetFolder($env:TEMP).ShortPath
    if (-not (Test-PlainPath $plain)) {
        $plain = Join-Path $env:SystemDrive "llama-build-temp"
        New-Item -ItemType Directory -Force $plain | Out-Null
    }
    Write-Host "TEMP for the build: $plain (instead of '$env:TEMP')"
    $env:TEMP = $plain
    $env:TMP = $plain
}
$env:CMAKE_GENERATOR = "Ninja"
$env:CMAKE_BUILD_PARALLEL_LEVEL = "$Jobs"
# -DGGML_RPC=ON: remote workers (README, "More than one machine")
$env:CMAKE_ARGS = "-DGGML_CUDA=on -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_RPC=ON " +
                  "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_CUDA_ARCHITECTURES=$Arch"
# CMake adds these to its default flags on the first configure (pip builds in a fresh folder)
$env:CXXFLAGS = "/D_DISABLE_CONSTEXPR_MUTEX_CONSTRUCTOR"
$env:CUDAFLAGS = "-D_DISABLE_CONSTEXPR_MUTEX_CONSTRUCTOR"
Write-Host "CMAKE_ARGS=$env:CMAKE_ARGS (jobs: $Jobs); CXXFLAGS=$env:CXXFLAGS; CUDAFLAGS=$env:CUDAFLAGS"
$start = Get-Date

if ($Venv) {
    $python = Join-Path $Venv "Scripts\python.exe"
    $created = $false
    if (-not (Test-Path $python)) {
        Invoke-Native { py -3 -m venv $Venv }
        if ($LASTEXITCODE) { throw "could not create $Venv" }
        $created = $true
    }
    Invoke-Native { & $python -m pip install --upgrade --quiet pip }
    $log = Join-Path (Resolve-Path $Venv).Path "llama-cuda-build.log"
    $status = Invoke-Logged $python @("-m", "pip", "install", "--no-cache-dir", "--force-reinstall",
                                      "--no-deps", "--verbose", "llama-cpp-python==0.3.36") $log
    if ($status) {
        Get-Content $log -Tail 40
        throw "build failed; full log: $log"
    }
    Invoke-Native { & $python -m pip install --quiet "numpy>=1.24" "typing-extensions>=4.5" diskcache jinja2 }
    if ($created) {
        # a new venv has nothing of the app: install it (the pin on llama-cpp-python is
        # already met by the CUDA build, which pip keeps)
        Invoke-Native { & $python -m pip install --quiet -e $Repo }
        if ($LASTEXITCODE) { throw "could not install Checkpoint Chat into $Venv" }
    }
    $lib = Invoke-Native { & $python -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')" } | Select-Object -Last 1
    Get-ChildItem $lib | Format-Table Name, Length
    if (-not (Test-Path (Join-Path $lib "ggml-cuda.dll"))) { throw "no ggml-cuda.dll in ${lib}: not a CUDA build" }
    if (-not (Test-Path (Join-Path $lib "ggml-rpc.dll"))) { throw "no ggml-rpc.dll in ${lib}: built without -DGGML_RPC=ON" }
    # The app's own check: child-process probe, then device list (CUDA device name, free VRAM)
    Push-Location $Repo   # the repository, for `-m engine.cli`
    try {
        Invoke-Native { & $python -m engine.cli info --llama-lib $lib }
        if ($LASTEXITCODE) { throw "the app refused the new build (message above)" }
    } finally { Pop-Location }
} else {
    New-Item -ItemType Directory -Force $WheelDir | Out-Null
    $wheels = (Resolve-Path $WheelDir).Path
    $log = Join-Path $wheels "llama-cuda-build.log"
    $status = Invoke-Logged "py" @("-3", "-m", "pip", "wheel", "--no-cache-dir", "--no-deps", "-w",
                                   $wheels, "llama-cpp-python==0.3.36") $log
    if ($status) { Get-Content $log -Tail 40; throw "wheel build failed; full log: $log" }
    Get-ChildItem $WheelDir
}
Write-Host ("built in {0:N0} s" -f ((Get-Date) - $start).TotalSeconds)
