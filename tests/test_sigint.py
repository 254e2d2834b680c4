"""Ctrl+C means pause: finish the current token (or abort the prefill), save, exit 130."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

from conftest import ROOT, run_cli


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "run", *args, "--threads", "2"],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ))


def _wait_for(proc: subprocess.Popen, stream_name: str, pattern: bytes, timeout: float = 120) -> bytes:
    """Read ``stream_name`` until ``pattern`` appears; returns what was read."""
    stream = getattr(proc, stream_name)
    sel = selectors.DefaultSelector()
    sel.register(stream, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + timeout
    while pattern not in seen:
        assert time.monotonic() < deadline, f"timed out waiting for {pattern!r}; got {seen[-500:]!r}"
        if sel.select(timeout=1):
            chunk = os.read(stream.fileno(), 4096)
            assert chunk, f"the process ended before {pattern!r} appeared: {seen[-500:]!r}"
            seen += chunk
    return seen


def _saved_path(stderr: str) -> str:
    match = re.search(r"\[CHECKPOINT\] Saved to: (.+) \(size: [\d.]+ [KMG]?B\)", stderr)
    assert match, f"no checkpoint line on stderr:\n{stderr}"
    return match.group(1)


def _inspect(path: str) -> dict:
    return json.loads(run_cli("inspect", path, "--json", check=True).stdout)


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_sigint_during_generation_saves_and_resumes(smollm_path, tmp_path):
    ckpt = tmp_path / "interrupted.kvckpt"
    common = ["-m", str(smollm_path), "-p", "Tell a long story about a dragon.", "--seed", "9",
              "--temp", "0.8", "--ctx-size", "2048", "--ignore-eos"]
    proc = _start(*common, "-n", "1500", "--checkpoint-save", str(ckpt))
    _wait_for(proc, "stdout", b" ")           # tokens are streaming
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert _saved_path(err) == str(ckpt)

    info = _inspect(str(ckpt))
    header = info["header"]
    assert header["kind"] == "exit" and header["has_logits"] and not header["prefill_pending"]
    k = header["n_generated"]
    assert 0 < k < 1500
    first_text = info["transcript"][-1]["content"]
    assert run_cli("validate", str(ckpt), "--model", str(smollm_path)).returncode == 0

    second = _last_json(run_cli("run", "--checkpoint-load", str(ckpt), "-n", str(k + 12), "--json",
                                check=True).stdout)
    assert second["n_generated"] == 12
    assert second["n_reused_tokens"] == second["n_prompt_tokens"]
    full = _last_json(run_cli("run", *common, "-n", str(k + 12), "--json", check=True).stdout)
    assert first_text + second["text"] == full["text"]


def test_sigint_during_prefill_saves_partial_prefill(smollm_path, tmp_path):
    # a long prompt in small chunks: on 2 cores its prefill takes several seconds
    prompt = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(180))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt, "utf-8")
    ckpt = tmp_path / "prefill.kvckpt"
    common = ["-m", str(smollm_path), "-f", str(prompt_file), "--temp", "0", "--ctx-size", "4096",
              "--batch-size", "64", "-n", "8", "--ignore-eos", "--json"]
    proc = _start(*common, "--checkpoint-save", str(ckpt), "--progress")
    _wait_for(proc, "stderr", b"[PREFILL] 128/")   # two chunks are in the cache
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err.decode()
    first = _last_json(out.decode())
    assert first["n_generated"] == 0 and first["finish_reason"] == "paused"
    header = _inspect(_saved_path(err.decode()))["header"]
    assert header["prefill_pending"] and not header["has_logits"]
    assert 128 <= header["n_tokens"] < header["n_tokens_total"]
    assert run_cli("validate", str(ckpt)).returncode == 0

    resumed = _last_json(run_cli("run", "--checkpoint-load", str(ckpt), "--json", check=True).stdout)
    assert resumed["n_reused_tokens"] == header["n_tokens"], "decoded work was thrown away"
    assert resumed["n_generated"] == 8
    full = _last_json(run_cli("run", *common, check=True).stdout)
    assert resumed["text"] == full["text"]


def test_sigint_before_generation_is_a_clean_pause(smollm_path, tmp_path):
    """Ctrl+C while the model is still loading ends in a resumable checkpoint of the prompt.

    The CLI announces its stages (--progress): the signal is sent once it says it is
    loading the model, so the outcome is one, not a race.
    """
    ckpt = tmp_path / "early.kvckpt"
    common = ["-m", str(smollm_path), "-p", "Hi", "-n", "4", "--temp", "0", "--ctx-size", "512", "--json"]
    proc = _start(*common, "--checkpoint-save", str(ckpt), "--progress")
    _wait_for(proc, "stderr", b"[STAGE] loading")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "[STAGE] generating" not in err
    assert _last_json(out.decode())["finish_reason"] == "paused"
    header = _inspect(_saved_path(err))["header"]
    assert header["kind"] == "exit" and header["n_generated"] == 0 and header["prefill_pending"]
    resumed = _last_json(run_cli("run", "--checkpoint-load", str(ckpt), "--json", check=True).stdout)
    assert resumed["n_generated"] == 4
    full = _last_json(run_cli("run", *common, check=True).stdout)
    assert resumed["text"] == full["text"]
