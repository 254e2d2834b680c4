"""Issue 13, timings a user can trust, and the confidence figure computed only when asked.

A resumed run's time to first token counts from the request (the model loaded) and
includes reading, verifying and restoring the checkpoint (``restore_s``); ``prefill_s``
is decoding only.  No assertion here depends on how fast the machine is: only on how
the figures relate to each other.
"""

from __future__ import annotations

import json
import time

import numpy as np
from conftest import run_cli

from engine.conversation import Conversation
from engine.generation import _probability, begin_answer, generate
from engine.sampling import SamplerSettings


def _run(*args: str) -> dict:
    done = run_cli("run", *args, "--json", "--threads", "2", check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cli_resumed_run_counts_the_restore_in_its_ttft(smollm_path, tmp_path):
    ckpt = tmp_path / "paused.kvckpt"
    common = ["-m", str(smollm_path), "--seed", "3", "--temp", "0", "--ctx-size", "1024"]
    first = _run(*common, "-p", "Write about the sea. " * 30, "-n", "40", "--stop-after", "6",
                 "--checkpoint-save", str(ckpt), "--ignore-eos")
    assert first["restore_s"] == 0.0                      # nothing was restored
    assert first["prefill_s"] > 0 and first["ttft_s"] >= first["prefill_s"]

    resumed = _run(*common, "--checkpoint-load", str(ckpt))
    assert resumed["n_reused_tokens"] == resumed["n_prompt_tokens"]
    assert resumed["restore_s"] > 0
    assert resumed["ttft_s"] >= resumed["restore_s"], resumed
    assert resumed["confidence"] is not None and 0 < resumed["confidence"]["min"] <= 1

    # a new message on the restored conversation: restore, then decode the new turn
    follow = _run(*common, "--checkpoint-load", str(ckpt), "-p", "And about rivers?", "-n", "3")
    assert follow["restore_s"] > 0 and follow["prefill_s"] > 0
    assert follow["ttft_s"] >= follow["restore_s"] + follow["prefill_s"] * 0.999, follow


def _greedy(rt, text: str) -> Conversation:
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0, seed=1, ignore_eos=True))
    begin_answer(conv, rt, text)
    return conv


def test_confidence_is_none_unless_asked(smollm_runtime):
    rt = smollm_runtime
    plain = generate(rt, _greedy(rt, "Count to five."), stop_after=5)
    assert plain.n_generated == 5
    assert plain.confidence is None and plain.probabilities == []
    asked = generate(rt, _greedy(rt, "Count to five."), stop_after=5, confidence=True)
    assert len(asked.probabilities) == 5
    assert 0 < asked.confidence["min"] <= asked.confidence["mean"] <= 1
    assert asked.text == plain.text, "asking for confidence changed the answer"


def test_confidence_with_sampling_and_penalty(smollm_runtime):
    rt = smollm_runtime
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=9, repeat_penalty=1.3,
                                                ignore_eos=True))
    begin_answer(conv, rt, "List fruits.")
    result = generate(rt, conv, stop_after=6, confidence=True)
    assert len(result.probabilities) == 6
    assert all(0 < p <= 1 for p in result.probabilities)


def test_the_reused_argmax_gives_the_full_softmax():
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal(50_000) * 4).astype(np.float32)
    token = int(np.argmax(logits))
    assert _probability(logits, token, float(logits[token])) == _probability(logits, token)
    logits[7] = -np.inf                                   # a masked end-of-generation token
    assert _probability(logits, token, float(logits[token])) == _probability(logits, token)


def test_ttft_counts_from_the_request(smollm_runtime):
    rt = smollm_runtime
    conv = _greedy(rt, "Say hello.")
    requested = time.perf_counter() - 2.0                 # the caller spent 2 s before this call
    result = generate(rt, conv, stop_after=2, requested_at=requested)
    assert result.ttft_s >= 2.0
    assert result.ttft_s >= result.prefill_s


def test_no_ttft_when_paused_before_the_first_token(smollm_runtime):
    from engine.generation import Control
    rt = smollm_runtime
    control = Control()
    control.request_pause()
    result = generate(rt, _greedy(rt, "Say hello."), control=control)
    assert result.paused and result.ttft_s is None and result.confidence is None
