"""Edge cases found in review: each was a real bug once."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import run_cli

from engine.conversation import Conversation
from engine.generation import Control, begin_answer, generate
from engine.sampling import SamplerSettings
from native.context import ContextSettings
from native.errors import ContextError


def test_stale_abort_request_does_not_cut_the_next_prefill(smollm_runtime):
    rt = smollm_runtime
    rt.trim(0)
    rt.ctx.request_abort()          # left over from an earlier pause that raced its end
    conv = Conversation(sampler=SamplerSettings(temperature=0, seed=1))
    begin_answer(conv, rt, "Say one word.", n_predict=3)
    result = generate(rt, conv, control=Control())
    assert result.finish_reason != "paused" and result.n_generated > 0


def test_trim_never_restores_logits_of_other_tokens(smollm_runtime):
    rt = smollm_runtime
    rt.trim(0)
    model = rt.model
    p = model.tokenize("alpha beta gamma " * 30, add_special=True)[:100]
    q = p[:20] + model.tokenize(" delta epsilon zeta" * 300, add_special=False)[:700]
    rt.prefill(p)
    chunks = []                     # decode Q's first chunk, then stop as a pause would
    rt.prefill(q, should_stop=lambda: bool(chunks), on_progress=lambda done, total: chunks.append(done))
    assert 100 < len(rt.kv_tokens) < len(q)
    rt.prefill(q[:100])
    stale = np.array(rt.logits(), copy=True)
    rt.trim(0)
    rt.prefill(q[:100])
    assert np.array_equal(stale, rt.logits()), "sampled from logits that follow other tokens"


def test_a_stop_string_given_at_the_resume_cuts_text_shown_before_the_pause(smollm_runtime):
    """The answer is cut where the stop string begins, as with it throughout, also when it
    begins before the pause; what was shown then is no longer counted as shown (it counted
    past the answer's end, and a Continue's first characters were then never streamed)."""
    rt = smollm_runtime

    def answer(stops=(), stop_after=None, conv=None):
        if conv is None:
            rt.trim(0)
            conv = Conversation(sampler=SamplerSettings(temperature=0, seed=1))
            begin_answer(conv, rt, "Count from one to twenty.", n_predict=12)
        conv.stop_strings = list(stops)
        generate(rt, conv, control=Control(), stop_after=stop_after)
        return conv

    whole = answer().answer.text
    paused = answer(stop_after=5)
    shown = len(paused.answer.text)
    assert 4 <= shown < len(whole) - 3
    stop = whole[shown - 3:shown + 3]   # straddles the pause
    expected = answer(stops=[stop]).answer.text
    assert expected == whole[:whole.find(stop)]
    resumed = answer(stops=[stop], conv=paused).answer
    assert resumed.text == expected and resumed.finish_reason == "stop_string"
    assert resumed.emitted == len(resumed.text)


@pytest.mark.parametrize("penalty", ["1.3"])
def test_repeat_penalty_is_deterministic_across_processes(smollm_path, tmp_path, penalty):
    common = ["-m", str(smollm_path), "-p", "List many fruits.", "--seed", "5", "--temp", "0.8",
              "--repeat-penalty", penalty, "-n", "30", "--ctx-size", "512", "--ignore-eos", "--json"]
    full = json.loads(run_cli("run", *common, check=True).stdout.strip().splitlines()[-1])
    ckpt = tmp_path / "p.kvckpt"
    first = json.loads(run_cli("run", *common, "--stop-after", "11", "--checkpoint-save", str(ckpt),
                               check=True).stdout.strip().splitlines()[-1])
    rest = json.loads(run_cli("run", "--checkpoint-load", str(ckpt), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    assert first["text"] + rest["text"] == full["text"]


def test_bad_numbers_are_one_line_errors(tmp_path):
    with pytest.raises(ContextError):
        ContextSettings(n_batch=0)
    for args in (["-b", "-1"], ["-c", "0"], ["--stop-after", "-2"]):
        done = run_cli("run", "-p", "hi", *args)
        assert done.returncode == 1, done.stderr   # as every user mistake (docs/cli.md)
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert "positive" in done.stderr or "0 or more" in done.stderr, done.stderr
    # a byte that is not UTF-8 in an argument (Python escapes it: a lone surrogate the
    # tokenizer cannot encode, a traceback before)
    for args in (["-p", "caf\udce9"], ["--system", "\udcff", "-p", "hi"], ["-p", "hi", "--stop", "\udcff"]):
        done = run_cli("run", *args)
        assert done.returncode == 1 and "is not text" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    done = run_cli("run", "-f", str(bad))
    assert done.returncode == 1 and "not UTF-8" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("progress", [False, True], ids=["stdout", "both-streams"])
def test_a_reader_that_goes_away_pauses_and_saves_the_answer(progress, smollm_path, app_home):
    """``run ... | head``: the answer's next write failed with a broken pipe, and the run
    ended without a checkpoint (a user's test found the same on Windows with a character
    the console's code page lacks).  It pauses and saves as Ctrl+C does, says so on stderr
    (status 1), and the saved answer continues exactly; also with ``--progress 2>&1``,
    where stderr is the same closed pipe (its progress lines are dropped, not fatal)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT

    from engine.checkpoints.format import read_metadata
    from engine.checkpoints.graph import Graph
    common = ["-m", str(smollm_path), "-p", "Tell me a long story about rivers.", "--seed", "5", "--temp", "0.8",
              "-n", "400", "--ctx-size", "1024", "--ignore-eos"]
    whole = json.loads(run_cli("run", *common, "--json", check=True).stdout.strip().splitlines()[-1])
    store = app_home / "data" / "checkpoints"
    before = {p.name for p in store.glob("*.kvckpt")}
    extra = ["--progress"] if progress else []
    reader = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", *common, *extra], cwd=str(ROOT),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT if progress else subprocess.PIPE,
                              env=dict(os.environ))
    assert reader.stdout is not None
    assert reader.stdout.read(8)   # the answer (or the progress) began; then the reader leaves
    reader.stdout.close()
    err = "" if progress else reader.stderr.read().decode("utf-8", "replace")   # type: ignore[union-attr]
    assert reader.wait(120) == 1 and "Traceback" not in err, err
    if not progress:
        assert "paused and saved" in err, err
    saved = [h.path for h in Graph.scan(store).heads if h.name not in before]
    assert len(saved) == 1, "the answer was not saved"
    part = read_metadata(saved[0])[1]["conversation"]["answer"]["text"]
    assert len(part) < len(whole["text"])
    rest = json.loads(run_cli("run", "--checkpoint-load", str(saved[0]), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    assert part + rest["text"] == whole["text"]
