"""A new user turn after a restored checkpoint decodes only the new tokens."""

from __future__ import annotations

import json

from conftest import run_cli

from engine.checkpoints.chain import common_prefix
from engine.checkpoints.format import read_checkpoint
from engine.conversation import Conversation
from engine.generation import begin_answer, generate
from engine.sampling import SamplerSettings


def test_follow_up_reuses_prefix_and_matches_full_recompute(smollm_runtime, tmp_path):
    rt = smollm_runtime
    conv = Conversation(system_prompt="You are terse.", sampler=SamplerSettings(temperature=0.7, seed=5))
    begin_answer(conv, rt, "What is the capital of Italy?", n_predict=24)
    generate(rt, conv)
    path = tmp_path / "turn1.kvckpt"
    rt.save(path, conv)

    # wipe the cache, then restore: the follow-up must decode only its own tokens
    rt.trim(0)
    restored = rt.restore(read_checkpoint(path))
    cached = list(rt.kv_tokens)
    begin_answer(restored, rt, "And of France?", n_predict=24)
    expected_reuse = common_prefix(cached, restored.tokens)
    follow = generate(rt, restored)
    assert follow.n_reused_tokens == expected_reuse
    assert follow.n_reused_tokens > len(cached) - 4, "most of the first turn should be reused"
    assert follow.n_prefilled == follow.n_prompt_tokens - follow.n_reused_tokens

    # the same conversation computed from scratch gives the same answer
    rt.trim(0)
    scratch = Conversation(system_prompt=restored.system_prompt, sampler=restored.sampler,
                           messages=list(restored.messages[:-1]))
    begin_answer(scratch, rt, "And of France?", n_predict=24)
    assert scratch.tokens[:follow.n_prompt_tokens] == restored.tokens[:follow.n_prompt_tokens]
    full = generate(rt, scratch)
    assert full.n_reused_tokens == 0
    assert full.text == follow.text


def test_cli_follow_up_reports_reused_tokens(smollm_path, tmp_path):
    path = tmp_path / "chat.kvckpt"
    first = json.loads(run_cli("run", "-m", str(smollm_path), "-p", "Say hello.", "-n", "16", "--temp", "0",
                               "--ctx-size", "1024", "--checkpoint-save", str(path), "--json",
                               check=True).stdout.strip().splitlines()[-1])
    assert first["checkpoint"] == str(path)
    second = json.loads(run_cli("run", "--checkpoint-load", str(path), "-p", "Now say goodbye.", "-n", "8",
                                "--json", check=True).stdout.strip().splitlines()[-1])
    assert second["n_reused_tokens"] >= first["n_prompt_tokens"]
    assert second["n_prompt_tokens"] > second["n_reused_tokens"]
