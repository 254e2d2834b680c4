"""Ctrl+C means pause: finish the current token (or abort the prefill), save, exit 130."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

from conftest import ROOT, run_cli


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine.cli", "run", *args, "--json",
                             "--threads", "2"], cwd=str(ROOT), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))


def _saved_path(stderr: str) -> str:
    match = re.search(r"\[CHECKPOINT\] Saved to: (.+) \(size: [\d.]+ [KMG]?B\)", stderr)
    assert match, f"no checkpoint line on stderr:\n{stderr}"
    return match.group(1)


def _inspect(path: str) -> dict:
    return json.loads(run_cli("inspect", path, "--json", check=True).stdout)


def _interrupt_after(proc: subprocess.Popen, seconds: float) -> tuple[str, str]:
    time.sleep(seconds)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    return out, err


def test_sigint_during_generation_saves_and_resumes(smollm_path, tmp_path):
    ckpt = tmp_path / "interrupted.kvckpt"
    common = ["-m", str(smollm_path), "-p", "Tell a long story about a dragon.", "--seed", "9",
              "--temp", "0.8", "--ctx-size", "2048", "--ignore-eos"]
    proc = _start(*common, "-n", "1500", "--checkpoint-save", str(ckpt))
    out, err = _interrupt_after(proc, 3.0)
    assert proc.returncode == 130, err
    assert _saved_path(err) == str(ckpt)
    first = json.loads(out.strip().splitlines()[-1])
    assert first["finish_reason"] == "paused"
    k = first["n_generated"]
    assert 0 < k < 1500

    header = _inspect(str(ckpt))["header"]
    assert header["kind"] == "exit" and header["has_logits"] and not header["prefill_pending"]
    assert run_cli("validate", str(ckpt), "--model", str(smollm_path)).returncode == 0

    second = json.loads(run_cli("run", "--checkpoint-load", str(ckpt), "-n", str(k + 12), "--json",
                                check=True).stdout.strip().splitlines()[-1])
    assert second["n_generated"] == 12
    full = json.loads(run_cli("run", *common, "-n", str(k + 12), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    assert first["text"] + second["text"] == full["text"]


def test_sigint_during_prefill_saves_partial_prefill(smollm_path, tmp_path):
    # a long prompt in small chunks: on 2 cores its prefill takes several seconds
    prompt = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(180))
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompt, "utf-8")
    ckpt = tmp_path / "prefill.kvckpt"
    common = ["-m", str(smollm_path), "-f", str(prompt_file), "--temp", "0", "--ctx-size", "4096",
              "--batch-size", "128", "-n", "8", "--ignore-eos"]
    proc = _start(*common, "--checkpoint-save", str(ckpt))
    out, err = _interrupt_after(proc, 2.0)
    assert proc.returncode == 130, err
    first = json.loads(out.strip().splitlines()[-1])
    assert first["n_generated"] == 0
    header = _inspect(_saved_path(err))["header"]
    assert header["prefill_pending"] and not header["has_logits"]
    assert header["n_tokens"] < header["n_tokens_total"]
    assert run_cli("validate", str(ckpt)).returncode == 0

    resumed = json.loads(run_cli("run", "--checkpoint-load", str(ckpt), "--json",
                                 check=True).stdout.strip().splitlines()[-1])
    assert resumed["n_reused_tokens"] == header["n_tokens"], "decoded work was thrown away"
    assert resumed["n_generated"] == 8
    full = json.loads(run_cli("run", *common, "--json", check=True).stdout.strip().splitlines()[-1])
    assert resumed["text"] == full["text"]
