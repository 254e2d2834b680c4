"""``checkpoint-chat run -p A -p B --parallel``, as a user runs it (fresh processes)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from conftest import ROOT, run_cli

PROMPTS = ["Write a few lines about lighthouses.", "List three fruits and their colours.",
           "Tell me about the moon."]
COMMON = ["--seed", "7", "--temp", "0.8", "--ignore-eos", "--threads", "2", "--ctx-size", "1024"]


def _json_lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.strip().splitlines()]


def test_parallel_answers_equal_their_runs_alone_and_their_files_continue(smollm_path, tmp_path):
    folder = tmp_path / "saved"
    done = run_cli("run", "-m", str(smollm_path), *[a for p in PROMPTS for a in ("-p", p)], "--parallel",
                   "-n", "20", "--stop-after", "12", "--json", "--checkpoint-save", str(folder), *COMMON,
                   check=True)
    *outcomes, summary = _json_lines(done.stdout)
    assert summary["summary"] is True and summary["conversations"] == 3
    assert summary["n_generated"] == 36 and summary["aggregate_tokens_per_s"] > 0
    assert [o["conversation"] for o in outcomes] == [1, 2, 3]
    assert len({o["sequence"] for o in outcomes}) == 3
    usual = set(json.loads(run_cli("run", "-m", str(smollm_path), "-p", PROMPTS[0], "-n", "20", "--json",
                                   *COMMON, check=True).stdout.strip().splitlines()[-1]))
    for k, (prompt, outcome) in enumerate(zip(PROMPTS, outcomes, strict=True)):
        assert usual <= outcome.keys()
        assert outcome["finish_reason"] == "paused" and outcome["n_generated"] == 12
        assert Path(outcome["checkpoint"]).parent == folder
        alone = json.loads(run_cli("run", "-m", str(smollm_path), "-p", prompt, "-n", "20", "--json",
                                   *COMMON, check=True).stdout.strip().splitlines()[-1])
        # each file is an ordinary checkpoint: a single-sequence run continues it exactly
        rest = json.loads(run_cli("run", "--checkpoint-load", outcome["checkpoint"], "-m", str(smollm_path),
                                  "--json", "--threads", "2", check=True).stdout.strip().splitlines()[-1])
        assert rest["n_reused_tokens"] == rest["n_prompt_tokens"], "the file's state was not used"
        assert outcome["text"] + rest["text"] == alone["text"], f"conversation {k + 1} differs"


def test_parallel_with_one_prompt_is_an_ordinary_run(smollm_path, tmp_path):
    target = tmp_path / "one.kvckpt"
    args = ["-m", str(smollm_path), "-p", PROMPTS[1], "-n", "8", "--json", *COMMON]
    together = run_cli("run", *args, "--parallel", "--checkpoint-save", str(target), check=True)
    lines = _json_lines(together.stdout)
    assert len(lines) == 1 and "summary" not in lines[0]
    assert lines[0]["checkpoint"] == str(target) and target.is_file()
    assert lines[0]["text"] == _json_lines(run_cli("run", *args, check=True).stdout)[-1]["text"]


def test_more_prompts_than_sequences_is_one_line_and_exit_1():
    done = run_cli("run", "-p", "a", "-p", "b", "-p", "c", "--parallel", "--sequences", "2", timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["error: 3 prompts need 3 sequences; the context holds 2 "
                                                "(--sequences)"]
    done = run_cli("run", "-p", "a", "-p", "b", timeout=60)
    assert done.returncode == 1 and done.stderr.strip() == "error: several prompts (-p) need --parallel"


def test_ctrl_c_pauses_and_saves_every_answer(smollm_path, tmp_path):
    folder = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", "-m", str(smollm_path),
                             "-p", PROMPTS[0], "-p", PROMPTS[1], "--parallel", "-n", "3000", "--json",
                             "--progress", "--checkpoint-save", str(folder), *COMMON],
                            cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if line.startswith("[STAGE] generating"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    *outcomes, summary = _json_lines(out)
    assert len(outcomes) == 2 and summary["summary"]
    for outcome in outcomes:
        assert outcome["finish_reason"] == "paused" and 0 < outcome["n_generated"] < 3000
        info = json.loads(run_cli("inspect", outcome["checkpoint"], "--json", check=True).stdout)
        assert info["header"]["kind"] == "exit"
        assert info["header"]["n_generated"] == outcome["n_generated"]
        assert run_cli("validate", outcome["checkpoint"], "--model", str(smollm_path)).returncode == 0


def test_kill_9_with_two_answers_running_leaves_both_restorable(smollm_path, tmp_path):
    """Autosaves (--checkpoint-save-interval) cover every running answer: after kill -9
    each conversation's newest autosave continues exactly as its uninterrupted run."""
    import time

    from engine.checkpoints.graph import Graph
    folder = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", "-m", str(smollm_path),
                             "-p", PROMPTS[0], "-p", PROMPTS[1], "--parallel", "-n", "3000", "--progress",
                             "--checkpoint-save", str(folder), "--checkpoint-save-interval", "8", *COMMON],
                            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    try:
        while True:
            sides = sorted(folder.glob(".*.autosaves"))
            if len(sides) == 2 and all(len(list(side.glob("*.kvckpt"))) >= 3 for side in sides):
                break
            assert time.monotonic() < deadline and proc.poll() is None, "no autosaves appeared"
            time.sleep(0.2)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert not list(folder.glob("*.kvckpt")), "the run ended before it was killed"
    for side in sides:
        head = Graph.scan(side).heads[0].path
        info = json.loads(run_cli("inspect", str(head), "--json", check=True).stdout)
        g = info["header"]["n_generated"]
        assert g > 0 and g % 8 == 0
        prompt = PROMPTS[int(side.name[1]) - 1]
        before = info["transcript"][-1]["content"]
        rest = _json_lines(run_cli("run", "--checkpoint-load", str(head), "-m", str(smollm_path), "-n",
                                   str(g + 8), "--json", "--threads", "2", check=True).stdout)[-1]
        # an autosave: its last token, a generated one, is decoded again (engine.runtime.logits_rule)
        assert rest["n_generated"] == 8 and rest["n_reused_tokens"] == rest["n_prompt_tokens"] - 1
        alone = _json_lines(run_cli("run", "-m", str(smollm_path), "-p", prompt, "-n", str(g + 8), "--json",
                                    *COMMON, check=True).stdout)[-1]
        assert before + rest["text"] == alone["text"]
