"""The Windows paths run for real: Windows CPython, llama.dll, the Windows loader (Wine tier).

These tests run only on Windows; on Linux they are skipped.  ``installer/wine_tier.sh``
runs them under Wine with the embeddable CPython 3.11 and a llama.dll cross-built with
mingw-w64 from the pinned llama.cpp, and passes two folders in the environment:

- ``CHECKPOINT_CHAT_WINE_FIXTURES``: broken llama.dll folders (installer/wine_fixtures.py
  says what is wrong with each);
- ``CHECKPOINT_CHAT_WINE_XOS``: the Linux run of the same seed (full answer, the part
  before a pause, the resume of its checkpoint), a checkpoint the Windows CLI wrote and
  Linux's resume of it.  ``CHECKPOINT_CHAT_XOS_PROMPT`` / ``_ARGS`` are the run's prompt
  and flags.

Nothing here is faked: ``LoadLibraryExW``, ``os.add_dll_directory``, ``GetProcAddress``,
child processes, exit statuses, sharing violations and ``taskkill`` are Windows' (Wine's).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli

pytestmark = pytest.mark.skipif(sys.platform != "win32",
                                reason="Windows only: run by installer/wine_tier.sh under Wine")

FIXTURES = Path(os.environ.get("CHECKPOINT_CHAT_WINE_FIXTURES", "no-fixtures"))
XOS = Path(os.environ.get("CHECKPOINT_CHAT_WINE_XOS", "no-xos"))
PROMPT = os.environ.get("CHECKPOINT_CHAT_XOS_PROMPT", "Name three rivers.")
ARGS = os.environ.get("CHECKPOINT_CHAT_XOS_ARGS", "-n 24 -s 7 -t 1").split()


def needs(path: Path) -> Path:
    if not path.exists():
        pytest.skip(f"{path} is prepared by installer/wine_tier.sh")
    return path


def child(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Windows Python (a library is loaded once per process)."""
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, encoding="utf-8", errors="replace", timeout=timeout,
                          env=full, cwd=str(ROOT))


def bundled() -> Path:
    from native.library import bundled_library_dir
    folder = bundled_library_dir()
    assert folder is not None and (folder / "llama.dll").is_file(), folder
    return folder


def text(path: Path) -> str:
    """A CLI's stdout as saved, newlines as on Linux (Windows' text mode writes CRLF)."""
    return path.read_bytes().decode("utf-8").replace("\r\n", "\n")


# -- the native loader --------------------------------------------------------------------------

def test_the_bundled_library_loads_through_the_real_dll_search():
    done = child("""
        import json, os
        path_before = os.environ["PATH"]
        from native import library, dllsearch
        ll = library.bindings()
        lib = library.loaded_library()
        print(json.dumps({"path_kept": os.environ["PATH"] == path_before,
                          "kept": len(dllsearch._kept), "version": lib.version,
                          "devices": [[d.name, d.kind] for d in lib.devices]}))
    """)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["path_kept"], "llama_cpp's PATH edit leaked"
    assert report["kept"] >= 2          # the add_dll_directory handle and llama.dll itself
    assert "device registry unavailable" not in done.stderr, done.stderr


def test_devices_are_listed_on_windows():
    """ggml_backend_dev_name & co. live in ggml-base.dll: GetProcAddress on ggml.dll misses them."""
    from native.sysinfo import list_devices
    done = child("""
        import json
        from native import library
        library.bindings()
        print(json.dumps([[d.name, d.kind, d.memory_total] for d in library.loaded_library().devices]))
    """)
    assert done.returncode == 0, done.stderr
    devices = json.loads(done.stdout.strip().splitlines()[-1])
    assert [kind for _, kind, _ in devices] == ["CPU"], devices
    assert devices[0][0] == "CPU" and devices[0][2] > 0
    assert list_devices  # imported on Windows without loading anything


def test_the_probe_child_accepts_the_bundled_build_from_a_path_with_spaces_and_accents(tmp_path):
    folder = tmp_path / "Ünïcödé folder with spaces" / "llama bin"
    shutil.copytree(bundled(), folder)
    from native.probe import probe_library
    report = probe_library(folder)
    assert report.ok, report.reason
    assert report.stage == "devices"
    assert [d["kind"] for d in report.devices] == ["CPU"]


def test_a_32_bit_dll_is_refused_by_the_loader_and_named():
    from native.dllsearch import SAFE_WINMODE
    from native.libfile import explain_load_failure
    folder = needs(FIXTURES / "x86")
    with pytest.raises(OSError) as caught:
        ctypes.CDLL(str(folder / "llama.dll"), winmode=SAFE_WINMODE)
    assert caught.value.winerror == 193
    assert "not a 64-bit library for Windows" in explain_load_failure(folder, caught.value)


def test_a_32_bit_dll_is_refused_before_loading():
    from native.errors import LibraryError
    from native.library import preflight
    with pytest.raises(LibraryError, match="32-bit|x86"):
        preflight(needs(FIXTURES / "x86"), source="--llama-lib")


def test_a_dll_from_another_llama_cpp_is_refused_by_the_probe():
    from native.probe import probe_library
    report = probe_library(needs(FIXTURES / "foreign"))
    assert not report.ok
    assert report.stage == "symbols"
    assert "functions this app calls" in report.reason and "0c1e57098" in report.reason


def test_a_dll_of_another_abi_is_refused_by_the_probe():
    from native.probe import probe_library
    report = probe_library(needs(FIXTURES / "abi"))
    assert not report.ok, report
    assert report.stage == "abi"
    assert "does not match these bindings" in report.reason and "n_ctx reads 0" in report.reason


def test_a_dll_that_crashes_is_reported_with_the_stage_and_the_fault():
    """On Windows ctypes turns an access violation inside a call into OSError: the child
    exits 1 and its traceback's last line, not faulthandler's dump, is the detail."""
    from native.probe import probe_library
    report = probe_library(needs(FIXTURES / "crash"))
    assert not report.ok
    assert "while reading the default parameters back" in report.reason, report.reason
    assert "[OSError: exception: access violation writing 0x0000000000000000]" in report.reason


def test_a_dll_that_aborts_is_reported_with_its_last_message():
    from native.probe import probe_library
    report = probe_library(needs(FIXTURES / "abort"))
    assert not report.ok
    assert "while reading the default parameters back" in report.reason, report.reason
    assert "[GGML_ASSERT(n_ctx > 0) failed]" in report.reason, report.reason


def test_a_missing_dependency_is_named():
    from native.dllsearch import SAFE_WINMODE
    from native.libfile import explain_load_failure
    folder = needs(FIXTURES / "missingdep")
    with pytest.raises(OSError) as caught:
        ctypes.CDLL(str(folder / "llama.dll"), winmode=SAFE_WINMODE)
    assert "ggml-gone.dll" in explain_load_failure(folder, caught.value)


def test_a_cpu_backend_missing_libomp140_is_named(tmp_path):
    """llama.cpp's official CPU backends import libomp140.x86_64.dll (LLVM OpenMP)."""
    from native.libfile import missing_dependencies
    backend = needs(FIXTURES / "omp" / "ggml-cpu-haswell.dll")
    assert missing_dependencies(backend, [backend.parent]) == ["libomp140.x86_64.dll"]


RUNTIME12 = ("cudart64_12.dll", "cublasLt64_12.dll", "cublas64_12.dll")


def cuda_standin(tmp_path: Path) -> Path:
    """The real CPU build dressed as a CUDA 12 build: ggml-cuda.dll's import table names
    cudart and cublas (cublas needs cublasLt), and copies of a harmless DLL of the build
    play the three runtime DLLs, so Windows really loads them."""
    from pecraft import pe_image
    folder = tmp_path / "cuda build"
    shutil.copytree(bundled(), folder)
    (folder / "ggml-cuda.dll").write_bytes(pe_image(["KERNEL32.dll", "cudart64_12.dll", "cublas64_12.dll"]))
    for name in RUNTIME12:
        shutil.copy(folder / "libwinpthread-1.dll", folder / name)
    return folder


def test_every_cuda_runtime_dll_is_preloaded_dependencies_first(tmp_path):
    folder = cuda_standin(tmp_path)
    done = child(f"""
        import ctypes, json
        from pathlib import Path
        from native.dllsearch import prepare_windows_search
        done = prepare_windows_search(Path({str(folder / "llama.dll")!r}))
        k = ctypes.WinDLL("kernel32")
        k.GetModuleHandleW.argtypes, k.GetModuleHandleW.restype = [ctypes.c_wchar_p], ctypes.c_void_p
        print(json.dumps({{"preloaded": [p.name for p in done.preloaded],
                           "in_process": [bool(k.GetModuleHandleW(str(p))) for p in done.preloaded]}}))
    """)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["preloaded"] == list(RUNTIME12) and all(report["in_process"]), report


def test_a_cuda_build_on_a_driver_too_old_is_refused_with_the_fix(tmp_path):
    system32 = Path(os.environ.get("SystemRoot", r"C:\Windows")) / "System32"
    needs(system32 / "nvcuda.dll")            # the tier's stand-in driver: CUDA 11.8, no GPU
    from native.probe import probe_library
    report = probe_library(cuda_standin(tmp_path))
    assert not report.ok and report.stage == "devices", report
    assert "supports CUDA 11.8 but cudart64_12.dll needs CUDA 12 or newer" in report.reason, report.reason


def test_a_stale_cuda_path_does_not_break_loading(tmp_path):
    done = child("""
        from native import library
        library.bindings()
        print("loaded")
    """, env={"CUDA_PATH": str(tmp_path / "CUDA" / "v12.4-removed")})
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]


# -- files: atomic replace, sharing violations, non-ASCII folders --------------------------------

def test_a_replace_waits_for_a_reader_that_holds_the_file_open(tmp_path):
    """Python's open() shares read and write but not delete: os.replace fails until it closes."""
    from engine.checkpoints.atomic import atomic_write
    target = tmp_path / "Prüfung ü" / "held.kvckpt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        f = open({str(target)!r}, "rb")
        print("open", flush=True)
        time.sleep(1.0)
        f.close()
    """)], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "open"
    start = time.monotonic()
    with atomic_write(target) as f:
        f.write(b"new")
    waited = time.monotonic() - start
    reader.wait(timeout=30)
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["held.kvckpt"]   # no temp file left
    assert waited > 0.3, f"the replace did not meet the reader's handle ({waited:.2f} s)"


def test_a_replace_waits_for_a_scanner_holding_the_new_file_for_seconds(tmp_path):
    """What an antivirus scanner does: it opens the new (temp) file as soon as it is closed
    and reads it for seconds, without FILE_SHARE_DELETE; renaming it fails until then.
    Held for 4 s: longer than the old 3 s budget, well within REPLACE_RETRY_S."""
    from engine.checkpoints import atomic
    target = tmp_path / "Virenprüfung" / "scanned.kvckpt"
    target.parent.mkdir()
    target.write_bytes(b"old")
    scanner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, sys, time
        folder = pathlib.Path({str(target.parent)!r})
        for _ in range(600):
            temps = [p for p in folder.iterdir() if p.name.endswith(".tmp")]
            if temps:
                break
            time.sleep(0.01)
        f = open(temps[0], "rb")
        print("open", flush=True)
        time.sleep(4.0)
        f.close()
    """)], stdout=subprocess.PIPE, text=True)
    with atomic.atomic_write(target) as f:
        f.write(b"new")
        f.flush()
        assert scanner.stdout.readline().strip() == "open"    # the scanner holds the new file
        start = time.monotonic()
    waited = time.monotonic() - start
    scanner.wait(timeout=30)
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["scanned.kvckpt"]
    assert 3.0 < waited < atomic.REPLACE_RETRY_S, f"{waited:.2f} s"


def test_a_replace_blocked_too_long_keeps_the_old_file(tmp_path, monkeypatch):
    from engine.checkpoints import atomic
    monkeypatch.setattr(atomic, "REPLACE_RETRY_S", 0.3)
    target = tmp_path / "held.kvckpt"
    target.write_bytes(b"old")
    with open(target, "rb"):
        with pytest.raises(OSError) as caught:
            with atomic.atomic_write(target) as f:
                f.write(b"new")
    assert caught.value.winerror in atomic.TRANSIENT_WINERRORS
    assert "another program" in str(caught.value) and "over 0.3 s" in str(caught.value), caught.value
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["held.kvckpt"]


def test_the_rpc_cache_folder_reaches_the_ansi_api_as_itself(tmp_path):
    """ggml-rpc.cpp opens its cache through std::filesystem::path(const char *): with MSVC,
    the ANSI code page.  Whatever cache_dir_argument gives, the ANSI API must find the
    folder (tmp_path lies under 'Zoë Müller'; the second folder's letters are in no
    Western code page)."""
    from native.rpc import RpcError, _short_path_name, cache_dir_argument
    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
    # BOOL CreateDirectoryA(LPCSTR lpPathName, LPSECURITY_ATTRIBUTES lpSecurityAttributes)
    kernel32.CreateDirectoryA.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    kernel32.CreateDirectoryA.restype = ctypes.c_int
    for folder in (tmp_path / "rpc cache", tmp_path / "缓存 ü"):
        folder.mkdir()
        try:
            arg, note = cache_dir_argument(folder)
        except RpcError:
            assert not (_short_path_name(str(folder)) or "").isascii(), "an ASCII short name was there"
            continue
        assert arg.isascii() or arg == str(folder).encode("mbcs"), (arg, note)   # never plain UTF-8
        assert kernel32.CreateDirectoryA(arg + b"\\made by ggml", None), ctypes.get_last_error()
        assert (folder / "made by ggml").is_dir(), (arg, note)


# -- crash capture and liveness -----------------------------------------------------------------

def test_liveness_probe_does_not_signal_a_live_process():
    """os.kill(pid, 0) on Windows sends CTRL_C_EVENT: the probe must not."""
    from engine.crashlog import _alive
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _alive(sleeper.pid)
        time.sleep(0.5)
        assert sleeper.poll() is None, "the probe ended the process it looked at"
    finally:
        sleeper.kill()
        sleeper.wait()
    assert not _alive(sleeper.pid)


def test_taskkill_leaves_an_empty_trace_reported_as_killed(app_home):
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from engine import crashlog
        crashlog.install()
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, cwd=str(ROOT))
    assert proc.stdout.readline().strip() == "ready"
    subprocess.run(["taskkill", "/F", "/PID", str(proc.pid)], capture_output=True, check=True)
    proc.wait(timeout=30)
    from engine.crashlog import pending_crashes
    reports = pending_crashes()
    assert [r.killed for r in reports] == [True]


# -- the CLI: save, pause, resume; the same bytes as Linux ---------------------------------------

def cli(*args: str) -> str:
    done = run_cli(*args, check=True)
    return done.stdout.replace("\r\n", "\n")


def test_the_windows_run_is_the_linux_run():
    assert cli("run", "-p", PROMPT, *ARGS) == text(needs(XOS / "linux-full.txt"))


def test_pause_save_and_resume_in_a_new_process_match_linux(tmp_path):
    ckpt = tmp_path / "päuse ü" / "answer.kvckpt"
    ckpt.parent.mkdir()
    part = cli("run", "-p", PROMPT, *ARGS, "--stop-after", "10", "--checkpoint-save", str(ckpt))
    assert part == text(needs(XOS / "linux-part.txt"))
    assert cli("run", "--checkpoint-load", str(ckpt), "-n", "24", "-t", "1") == text(XOS / "linux-resume.txt")


def test_a_resume_saved_under_its_own_name(tmp_path):
    """``--checkpoint-load X --checkpoint-save X``: the restore maps X (Windows maps a
    restore's files) and lets it go once restored, so the end of the run can replace X; a
    mapping kept would make every try fail with a sharing error for 8 s, then the save."""
    ckpt = tmp_path / "answer.kvckpt"
    assert cli("run", "-p", PROMPT, *ARGS, "--stop-after", "10", "--checkpoint-save", str(ckpt)) == \
        text(needs(XOS / "linux-part.txt"))
    before = ckpt.stat()
    started = time.monotonic()
    assert cli("run", "--checkpoint-load", str(ckpt), "--checkpoint-save", str(ckpt), "-n", "24", "-t", "1") == \
        text(XOS / "linux-resume.txt")
    assert time.monotonic() - started < 8   # no save waited out a sharing violation
    from engine.checkpoints.format import read_checkpoint
    assert ckpt.stat().st_mtime_ns != before.st_mtime_ns and read_checkpoint(ckpt).header.n_tokens > 10


def test_a_restores_read_maps_the_file_and_release_lets_it_go(tmp_path):
    """What engine.checkpoints.mapped says of Windows, on Windows' own file semantics: a
    restore's read maps the state (a file on a fixed disk; a network share is read), the
    mapped file can be neither replaced nor deleted, and released it can at once; any other
    read copies and holds nothing."""
    path = tmp_path / "m.kvckpt"
    shutil.copyfile(needs(XOS / "linux.kvckpt"), path)
    (tmp_path / "other.kvckpt").write_bytes(path.read_bytes())
    done = child(f"""
        import json, os
        from engine.checkpoints.format import read_checkpoint
        path, other = {str(path)!r}, {str(tmp_path / "other.kvckpt")!r}
        def replace():
            try:
                os.replace(other, path)
                return "replaced"
            except OSError as exc:
                return exc.winerror
        from engine.checkpoints.mapped import on_a_fixed_disk
        disks = [on_a_fixed_disk(path), on_a_fixed_disk(r"\\\\nowhere\\share\\m.kvckpt")]
        copied = read_checkpoint(path)
        data = read_checkpoint(path, crc_later=True)
        mapped, state_len = data.mapping is not None, len(data.state)
        while_mapped = replace()
        data.settle()
        data.release()
        after = replace()
        os.unlink(path)
        print(json.dumps({{"disks": disks, "copied": copied.mapping is None, "mapped": mapped, "state_len": state_len,
                          "while_mapped": while_mapped, "after": after, "gone": not os.path.exists(path)}}))
    """)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"disks": [True, False], "copied": True, "mapped": True, "state_len": got["state_len"],
                   "while_mapped": 5,
                   "after": "replaced", "gone": True}, got
    assert got["state_len"] >= 128 << 10


def test_a_checkpoint_written_on_linux_resumes_on_windows():
    resumed = cli("run", "--checkpoint-load", str(needs(XOS / "linux.kvckpt")), "-n", "24", "-t", "1")
    assert resumed == text(XOS / "linux-resume.txt")


def test_a_checkpoint_written_on_windows_resumes_on_linux():
    assert needs(XOS / "windows.kvckpt").stat().st_size > 0
    assert text(needs(XOS / "linux-resumes-windows.txt")) == text(XOS / "linux-resume.txt")


def test_a_hybrid_goes_back_to_a_turn_end_its_linux_head_holds():
    """A Linux-written head of a hybrid's two turns (tests/tinymodels.py's qwen35) holds the
    first turn's end as a point, its recurrent state at the end of the file, which a restore
    on Windows leaves unread: ``--from-turn 2`` reads it only when it goes back there, reuses
    the first turn's tokens and answers as continuing that turn's own file does
    (installer/wine_tier.sh writes both)."""
    points = needs(XOS / "points")
    common = ["-m", str(points / "tiny-qwen35.gguf"), "-n", "8", "--temp", "0", "--seed", "3", "--ignore-eos",
              "-t", "1", "--json"]

    def run(*args: str) -> dict:
        return json.loads(cli("run", *common, *args).strip().splitlines()[-1])
    edited = run("--checkpoint-load", str(points / "head.kvckpt"), "--from-turn", "2", "-p", "Instead: a lake?")
    reference = run("--checkpoint-load", str(points / "turn1.kvckpt"), "-p", "Instead: a lake?")
    assert edited["n_reused_tokens"] == reference["n_reused_tokens"] > 0, (edited, reference)
    assert edited["text"] == reference["text"] and edited["n_prompt_tokens"] == reference["n_prompt_tokens"]


def test_a_turn_end_a_restore_left_in_its_file_is_read_when_the_conversation_goes_back(tmp_path):
    """A restore keeps the turn end it may go back to where the Linux-written head holds it
    (engine.checkpoints.file_bytes), holding no handle of the file: the head can be replaced
    (an identical copy) at once; going back there then reads that state from the file, and
    the sequence holds, byte for byte, what restoring that turn's own file gives."""
    points = needs(XOS / "points")
    for name in ("head.kvckpt", "turn1.kvckpt"):
        shutil.copyfile(points / name, tmp_path / name)
    done = child(f"""
        import json, os, shutil
        from types import SimpleNamespace
        import numpy as np
        from engine.checkpoints.chain import load_chain, restoring
        from engine.checkpoints.file_bytes import BytesInFile
        from engine.checkpoints.format import read_header
        from engine.cli.options import context_settings
        from engine.runtime import Runtime
        head, turn1 = {str(tmp_path / "head.kvckpt")!r}, {str(tmp_path / "turn1.kvckpt")!r}
        args = SimpleNamespace(ctx_size=None, batch_size=None, threads=1, flash_attn=None,
                               cache_type_k=None, cache_type_v=None)
        rt = Runtime({str(points / "tiny-qwen35.gguf")!r}, context_settings(args, read_header(head)))
        def state():
            size = rt.ctx.state_size(0)
            buf = np.empty(size, dtype=np.uint8)
            return bytes(buf[:rt.ctx.state_get_into(buf, size, 0)])
        def restored(path):
            chain = load_chain(path, crc_later=True)
            with restoring(chain):
                rt.restore_chain(chain)
        n1 = read_header(turn1).n_tokens
        restored(head)
        kept = rt._snapshots.at(rt.kv_tokens, n1)
        in_file = kept is not None and isinstance(kept.state, BytesInFile)
        shutil.copyfile(head, head + ".copy")
        os.replace(head + ".copy", head)
        went_back = rt.trim(n1)
        tokens, gone_back = list(rt.kv_tokens), state()
        rt.trim(0)
        restored(turn1)
        print(json.dumps({{"in_file": in_file, "went_back": went_back, "n1": n1,
                          "same_tokens": tokens == list(rt.kv_tokens), "same_state": gone_back == state()}}))
        rt.close()
    """)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"in_file": True, "went_back": got["n1"], "n1": got["n1"], "same_tokens": True,
                   "same_state": True}, (got, done.stderr[-2000:])
    assert got["n1"] > 0


def test_an_answers_autosaves_in_tiers_are_retired_and_a_crash_resumes_from_their_chain(tmp_path):
    """On Windows' file semantics: an answer's autosaves in tiers (LineWriter._tier_below)
    retire the ones each absorbs as it lands (deleted: no handle of them is held), so what
    a crash leaves in the store is exactly the newest autosave's chain, fewer files than
    autosaves; a new process resumes from it and the answer goes on as it would have."""
    store = tmp_path / "störe"
    done = child(f"""
        import json, os
        from engine.checkpoints.chain import load_chain
        from engine.checkpoints.store import Store
        from engine.conversation import Conversation
        from engine.generation import begin_answer, generate
        from engine.history import LineWriter
        from engine.models import default_model_path
        from engine.runtime import Runtime
        from engine.sampling import SamplerSettings
        from native.context import ContextSettings
        rt = Runtime(default_model_path(), ContextSettings(n_ctx=1024, n_threads=1))
        def conversation():
            conv = Conversation(sampler=SamplerSettings(temperature=0.0, seed=7, ignore_eos=True))
            begin_answer(conv, rt, {PROMPT!r}, n_predict=40)
            return conv
        reference = generate(rt, conversation()).text
        rt.trim(0)
        writer = LineWriter(rt, Store({str(store)!r}), "line")
        saved = []
        generate(rt, conversation(), autosave=lambda c: saved.append(writer.autosave(c)), autosave_every=4,
                 stop_after=28)
        writer.settle()
        chain = [d.path.name for d in load_chain(saved[-1].path)]
        files = sorted(p.name for p in os.scandir({str(store)!r}) if p.name.endswith(".kvckpt"))
        print(json.dumps({{"reference": reference, "autosaves": len(saved), "chain": chain,
                          "newest": str(saved[-1].path), "store": files}}), flush=True)
        os._exit(0)   # a crash: no head, nothing closed
    """)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["autosaves"] >= 6 and 2 <= len(got["chain"]) < got["autosaves"], got
    assert got["store"] == sorted(got["chain"]), got   # every absorbed autosave retired
    rest = json.loads(cli("run", "--checkpoint-load", got["newest"], "-t", "1", "--json").strip().splitlines()[-1])
    assert rest["text"] and got["reference"].endswith(rest["text"]), (rest, got["reference"])
    assert rest["n_reused_tokens"] >= rest["n_prompt_tokens"] - 1


def _tiny_qwen35_child(tmp_path, points) -> str:
    """The lines a child starts with that restores a tiny qwen35's chains (see child): its
    imports, ``folder`` (for its files), ``rt`` (a Runtime, its states mapped as a large
    model's are), ``conv`` (greedy, never ending early), and ``restored(chain)``: the chain
    restored into an emptied sequence as the app restores, then its state and logits."""
    return textwrap.indent(textwrap.dedent(f"""\
        import json, os, shutil
        import numpy as np
        from engine.checkpoints import mapped
        from engine.checkpoints.chain import load_chain, restoring
        from engine.checkpoints.format import KIND_AUTOSAVE, KIND_MANUAL, KIND_PAUSE, read_checkpoint
        from engine.conversation import Conversation
        from engine.generation import begin_answer, commit_answer, generate
        from engine.runtime import Runtime
        from engine.sampling import SamplerSettings
        from native.context import ContextSettings
        mapped.MAP_MIN_BYTES = 0   # a tiny model's states, mapped as a large one's are
        folder = {str(tmp_path)!r}
        rt = Runtime({str(points / "tiny-qwen35.gguf")!r}, ContextSettings(n_ctx=512, n_threads=1))
        conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
        def restored(chain):
            rt.trim(0)
            with restoring(chain):
                rt.restore_chain(chain)
            size = rt.ctx.state_size(0)
            buf = np.empty(size, dtype=np.uint8)
            return bytes(buf[:rt.ctx.state_get_into(buf, size, 0)]), np.asarray(rt.logits()).tobytes()"""),
                           " " * 8).lstrip()


def test_a_hybrids_earlier_recurrent_block_is_neither_read_nor_needed_and_checked_where_set(tmp_path):
    """On Windows (a restore maps its files and lets them go when done): a hybrid's chain
    (tests/tinymodels.py's qwen35: a prompt's file, an answer's on it) is restored without
    its first file's own recurrent block, which the last file's replaces: that block damaged,
    the restore gives exactly the undamaged chain's state, the first file's attention part
    set straight from its (copy-on-write) mapping, and both files can be replaced at once
    after; the first file restored as a chain's last (its block set), the damage is found
    and the sequence left empty."""
    points = needs(XOS / "points")
    done = child(f"""
        {_tiny_qwen35_child(tmp_path, points)}
        from engine.checkpoints.kvstate import check_state_for, recurrent_block_len
        from engine.errors import ChecksumMismatch
        begin_answer(conv, rt, "Hello there.", n_predict=12)
        rt.prefill(conv.tokens)
        prompt = rt.save(os.path.join(folder, "prompt.kvckpt"), conv, KIND_AUTOSAVE)
        generate(rt, conv)
        answer = rt.save(os.path.join(folder, "answer.kvckpt"), conv, KIND_PAUSE, parent=prompt)
        clean = restored(load_chain(answer.path, crc_later=True))
        data = read_checkpoint(prompt.path)
        block = recurrent_block_len(check_state_for(data.header, data.state))
        offset = data.header.state_offset + len(data.state) - block + 33   # a byte of its first row
        del data
        with open(prompt.path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))
        chain = load_chain(answer.path, crc_later=True)
        unread = chain[0].unread_recurrent is not None and chain[0].mapping is not None
        whole = np.frombuffer(chain[0].mapping, dtype=np.uint8)
        low, high = whole.ctypes.data, whole.ctypes.data + len(whole)
        del whole
        given = []
        real_set = rt.ctx.state_set_from
        def spy(buffer, size, seq, *flags):
            given.append(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)
            return real_set(buffer, size, seq, *flags)
        rt.ctx.state_set_from = spy
        same = restored(chain) == clean
        rt.ctx.state_set_from = real_set
        in_place = bool(given) and low <= given[0] < high
        for path in (prompt.path, answer.path):   # let go: replaceable at once
            shutil.copyfile(path, str(path) + ".copy")
            os.replace(str(path) + ".copy", path)
        chain = load_chain(answer.path, crc_later=True)
        try:
            restored(chain[:1])
            refused = False
        except ChecksumMismatch:
            refused = True
        print(json.dumps({{"unread": unread, "same": same, "in_place": in_place, "refused": refused,
                          "empty": rt.kv_tokens == []}}))
        rt.close()
    """)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"unread": True, "same": True, "in_place": True, "refused": True, "empty": True}, \
        (got, done.stderr[-2000:])


def test_an_earlier_files_logits_are_neither_read_nor_needed_and_checked_where_kept(tmp_path):
    """On Windows: a hybrid's chain of two turns (a prompt's file, the first answer's, the
    second's) is restored without reading the prompt file's logits (every file of a hybrid
    carries them): damaged, the restore gives exactly the undamaged chain's state and logits,
    and the files can be replaced at once after; restored as a chain's last file (the prompt
    alone), the damage is found; the first answer's logits, which the restore keeps in their
    file for Regenerate, damaged: the restore is not refused, going back there finds them
    damaged and keeps nothing of the snapshot."""
    points = needs(XOS / "points")
    done = child(f"""
        {_tiny_qwen35_child(tmp_path, points)}
        from engine.errors import BrokenChain, ChecksumMismatch
        begin_answer(conv, rt, "Name a river.", n_predict=6)
        rt.prefill(conv.tokens)
        prompt = rt.save(os.path.join(folder, "prompt.kvckpt"), conv, KIND_AUTOSAVE)
        generate(rt, conv)
        commit_answer(conv)
        first = rt.save(os.path.join(folder, "first.kvckpt"), conv, KIND_MANUAL, parent=prompt)
        begin_answer(conv, rt, "And another?", n_predict=6)
        generate(rt, conv)
        second = rt.save(os.path.join(folder, "second.kvckpt"), conv, KIND_PAUSE, parent=first)
        def spoil(path):
            h = read_checkpoint(path, load_state=False).header
            with open(path, "r+b") as f:
                f.seek(h.logits_offset + 4 * 17 + 2)
                byte = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([byte[0] ^ 0x01]))
        clean = restored(load_chain(second.path, crc_later=True))
        spoil(prompt.path)
        chain = load_chain(second.path, crc_later=True)
        unread = chain[0].logits is None and chain[0].unread_logits is not None
        same = restored(chain) == clean
        for path in (prompt.path, first.path, second.path):   # let go: replaceable at once
            shutil.copyfile(path, str(path) + ".copy")
            os.replace(str(path) + ".copy", path)
        refused = []
        for spoiled, upto, error in ((None, 1, ChecksumMismatch), (first.path, 3, BrokenChain)):
            if spoiled:
                spoil(spoiled)
            chain = load_chain(second.path, crc_later=True)
            try:
                restored(chain[:upto])
                refused.append("restored")
            except error as exc:
                refused.append(type(exc).__name__ + (" first" if "first.kvckpt" in str(exc) else ""))
        n = first.n_tokens
        kept = rt._snapshots.at(rt.kv_tokens, n) is not None
        went_back = rt.trim(n) < n and rt._snapshots.at(rt.kv_tokens, n) is None
        print(json.dumps({{"unread": unread, "same": same, "refused": refused, "kept": kept,
                          "went_back_without_it": went_back}}))
        rt.close()
    """)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"unread": True, "same": True, "refused": ["ChecksumMismatch", "restored"], "kept": True,
                   "went_back_without_it": True}, (got, done.stderr[-2000:])


def test_the_frozen_cli_saves_and_resumes_as_linux_does():
    """The PyInstaller build (installer/wine_tier.sh --frozen): pause + save, resume."""
    part = XOS / "frozen-part.txt"
    if not part.is_file():
        pytest.skip("the frozen app is built by installer/wine_tier.sh --frozen")
    assert text(part) == text(XOS / "linux-part.txt")
    assert text(XOS / "frozen-resume.txt") == text(XOS / "linux-resume.txt")


def version_resource(exe: Path) -> dict:
    """The exe's version resource as Windows reads it (version.dll)."""
    v = ctypes.WinDLL("version", use_last_error=True)
    # DWORD GetFileVersionInfoSizeW(LPCWSTR lptstrFilename, LPDWORD lpdwHandle)
    v.GetFileVersionInfoSizeW.argtypes = [ctypes.c_wchar_p, ctypes.c_void_p]
    v.GetFileVersionInfoSizeW.restype = ctypes.c_uint32
    # BOOL GetFileVersionInfoW(LPCWSTR lptstrFilename, DWORD dwHandle, DWORD dwLen, LPVOID lpData)
    v.GetFileVersionInfoW.argtypes = [ctypes.c_wchar_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p]
    # BOOL VerQueryValueW(LPCVOID pBlock, LPCWSTR lpSubBlock, LPVOID *lplpBuffer, PUINT puLen)
    v.VerQueryValueW.argtypes = [ctypes.c_void_p, ctypes.c_wchar_p, ctypes.POINTER(ctypes.c_void_p),
                                 ctypes.POINTER(ctypes.c_uint32)]
    size = v.GetFileVersionInfoSizeW(str(exe), None)
    assert size, f"{exe.name} has no version resource (error {ctypes.get_last_error()})"
    block = ctypes.create_string_buffer(size)
    assert v.GetFileVersionInfoW(str(exe), 0, size, block)

    def query(sub: str):
        ptr, n = ctypes.c_void_p(), ctypes.c_uint32()
        return (ptr.value, n.value) if v.VerQueryValueW(block, sub, ctypes.byref(ptr), ctypes.byref(n)) else (None, 0)
    ptr, _ = query("\\")
    fixed = (ctypes.c_uint32 * 13).from_address(ptr)   # VS_FIXEDFILEINFO
    found = {"file": (fixed[2] >> 16, fixed[2] & 0xFFFF, fixed[3] >> 16, fixed[3] & 0xFFFF),
             "product": (fixed[4] >> 16, fixed[4] & 0xFFFF, fixed[5] >> 16, fixed[5] & 0xFFFF)}
    for key in ("CompanyName", "FileDescription", "FileVersion", "ProductName", "ProductVersion",
                "OriginalFilename"):
        ptr, n = query(f"\\StringFileInfo\\040904B0\\{key}")
        found[key] = ctypes.wstring_at(ptr, n).rstrip("\0") if ptr else None
    return found


def test_the_frozen_executables_carry_the_app_version():
    """installer/checkpoint_chat.spec's version resources, read back from the built exes."""
    from engine import APP_VERSION
    folder = XOS / "exes"
    if not folder.is_dir():
        pytest.skip("the frozen app is built by installer/wine_tier.sh --frozen")
    numbers = tuple(int(n) for n in APP_VERSION.split(".")) + (0,) * (4 - len(APP_VERSION.split(".")))
    descriptions = set()
    for name in ("checkpoint-chat.exe", "CheckpointChat.exe"):
        found = version_resource(folder / name)
        assert found["file"] == found["product"] == numbers, found
        assert found["FileVersion"] == found["ProductVersion"] == APP_VERSION, found
        assert found["CompanyName"] == found["ProductName"] == "Checkpoint Chat", found
        assert found["OriginalFilename"] == name, found
        descriptions.add(found["FileDescription"])
    assert len(descriptions) == 2 and all(descriptions), descriptions


def installer_facts() -> dict:
    facts_file = XOS / "installer.txt"
    if not facts_file.is_file():
        pytest.skip("the installer is built and run by installer/wine_tier.sh --installer")
    return dict(line.split("=", 1) for line in facts_file.read_text("utf-8").splitlines() if "=" in line)


def test_the_installer_installs_associates_and_uninstalls_keeping_data():
    """Setup.exe from installer/checkpoint_chat.iss (installer/wine_tier.sh --installer):
    a silent all-users install, the .kvckpt association and Start menu entry, the
    installed CLI, then an uninstall that removes the program and keeps the user's store."""
    facts = installer_facts()
    assert int(facts["setup_bytes"]) > 10 << 20
    assert facts["installed_exe"] == "yes"
    assert facts["assoc"] == "CheckpointChat.Checkpoint"
    assert facts["open_command"].endswith('CheckpointChat.exe" "%1"'), facts["open_command"]
    assert facts["start_menu"].startswith("Checkpoint Chat")
    assert text(XOS / "installed-part.txt") == text(XOS / "linux-part.txt")
    assert int(facts["store_before"]) >= 1, "the installed CLI saved into the user's store"
    assert facts["uninstalled"] == "yes" and facts["assoc_after"] == ""
    assert facts["store_after"] == facts["store_before_uninstall"], "uninstalling kept the checkpoints"


def test_a_checkpoint_opened_through_the_association_reaches_the_installed_app():
    """`cmd /c start "" file.kvckpt` (ShellExecute, what Explorer's double-click does) reads
    the association Setup registered, starts the installed app with the file, and the app
    imports it into the user's store."""
    facts = installer_facts()
    assert facts["association_opened"] == "yes"


def test_installing_over_an_older_build_leaves_no_stale_files():
    """[InstallDelete]: a library the old build had and this one does not ship (planted in
    _internal and in the program folder) is gone after a second silent install; the
    program works and the user's checkpoints stay."""
    facts = installer_facts()
    assert facts["upgrade_stale"] == "0"
    assert facts["upgrade_exe"] == "yes" and facts["upgrade_store_kept"] == "yes"


# -- session end: real WM_QUERYENDSESSION / WM_ENDSESSION (Wine's user32, under Xvfb) ------------

WM_QUERYENDSESSION, WM_ENDSESSION, ENDSESSION_LOGOFF = 0x0011, 0x0016, 0x80000000


def user32():
    u = ctypes.WinDLL("user32", use_last_error=True)
    # HWND FindWindowW(LPCWSTR lpClassName, LPCWSTR lpWindowName)
    u.FindWindowW.argtypes, u.FindWindowW.restype = [ctypes.c_wchar_p, ctypes.c_wchar_p], ctypes.c_void_p
    # LRESULT SendMessageW(HWND hWnd, UINT Msg, WPARAM wParam, LPARAM lParam)
    u.SendMessageW.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t, ctypes.c_ssize_t]
    u.SendMessageW.restype = ctypes.c_ssize_t
    return u


def test_the_cli_saves_the_answer_when_windows_ends_the_session(tmp_path):
    """installer/README.md W2.3, automated: the hidden window gets the pair, the run saves."""
    from engine.shutdown import SessionEndWindow
    u = user32()
    ckpt = tmp_path / "session end.kvckpt"
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", "-p", "Write a long story about a dragon.",
                             "-n", "4000", "--ignore-eos", "-t", "1", "--checkpoint-save", str(ckpt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(ROOT))
    try:
        first = proc.stdout.read(8)                 # the answer is streaming
        assert first, proc.stderr.read().decode("utf-8", "replace")
        deadline = time.monotonic() + 30
        while not (hwnd := u.FindWindowW(SessionEndWindow.CLASS_NAME, None)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert hwnd, "the CLI's hidden session window was not created"
        assert u.SendMessageW(hwnd, WM_QUERYENDSESSION, 0, ENDSESSION_LOGOFF) == 1
        start = time.monotonic()
        u.SendMessageW(hwnd, WM_ENDSESSION, 1, ENDSESSION_LOGOFF)   # returns once saved
        waited = time.monotonic() - start
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + 1, err.decode("utf-8", "replace")
    assert ckpt.is_file() and waited < 10
    assert run_cli("validate", str(ckpt)).returncode == 0
    # the answer goes on (its text may be whitespace: the run's seed was random)
    resumed = json.loads(cli("run", "--checkpoint-load", str(ckpt), "-n", "4000", "--stop-after", "4",
                             "-t", "1", "--json").strip().splitlines()[-1])
    assert resumed["n_generated"] == 4 and resumed["finish_reason"] == "paused", resumed


def test_the_window_saves_the_answer_when_windows_ends_the_session(qtbot, make_window):
    """Qt's windows platform turns the real message into commitDataRequest: the answer in
    progress is saved as an exit checkpoint before WM_QUERYENDSESSION is answered.
    Last in this file: WM_ENDSESSION makes Qt emit aboutToQuit."""
    from PySide6.QtCore import Qt
    from PySide6.QtGui import QGuiApplication

    from engine.checkpoints.format import KIND_EXIT
    from gui.session_end import SessionEndSaver
    if QGuiApplication.platformName() != "windows":
        pytest.skip("needs Qt's windows platform (the tier runs it under Xvfb)")
    w = make_window(n_predict=400)
    saves = []
    w.bridge.checkpoint_saved.connect(lambda *args: saves.append(args))
    saver = SessionEndSaver(w, wait_s=60)
    saver.connect_to(QGuiApplication.instance())
    with qtbot.waitSignal(w.bridge.tokens_generated, timeout=60_000):
        w.prompt_edit.setFocus()
        qtbot.keyClicks(w.prompt_edit, "Write a long story about a dragon who guards a library.")
        qtbot.keyClick(w.prompt_edit, Qt.Key.Key_Return)
    hwnd, answers = int(w.winId()), {}

    def windows_ends_the_session():
        u = user32()
        answers["query"] = u.SendMessageW(hwnd, WM_QUERYENDSESSION, 0, ENDSESSION_LOGOFF)
        answers["end"] = u.SendMessageW(hwnd, WM_ENDSESSION, 1, ENDSESSION_LOGOFF)
    sender = threading.Thread(target=windows_ends_the_session, daemon=True)
    sender.start()
    qtbot.waitUntil(lambda: not sender.is_alive(), timeout=90_000)
    assert answers["query"] == 1
    assert saver.outcome == "saved"
    exit_saves = [args for args in saves if args[4] == KIND_EXIT]
    assert exit_saves and Path(exit_saves[0][1]).is_file()
    assert exit_saves[0][0].paused, "the answer was paused mid-way, not finished"
