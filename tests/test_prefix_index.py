"""Prefix reuse across stored checkpoints: restore the longest shared prefix, decode the rest."""

from __future__ import annotations

import json

from conftest import run_cli

from engine.checkpoints.prefix_index import PrefixIndex, block_hashes
from engine.conversation import Conversation
from engine.generation import begin_answer
from engine.prefix_reuse import reuse_stored_prefix
from engine.sampling import SamplerSettings

SYSTEM = ("You are a meticulous assistant for a maritime museum. " * 24).strip()


def _json(done) -> dict:
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_new_conversation_starts_from_the_stored_prefix(smollm_path, app_home):
    store = app_home / "data" / "checkpoints"
    store.mkdir(parents=True)
    common = ["-m", str(smollm_path), "--system", SYSTEM, "--temp", "0.7", "--seed", "4",
              "--ctx-size", "1024", "-n", "16", "--json"]
    run_cli("run", *common, "-p", "Who built the first lighthouse?",
            "--checkpoint-save", str(store / "first.kvckpt"), check=True)
    reused = _json(run_cli("run", *common, "-p", "What is a sextant?", "--reuse-prefix", check=True))
    assert reused["prefix_reuse"] == "restored"
    assert reused["prefix_source"] == str(store / "first.kvckpt")
    assert reused["n_reused_tokens"] > 200, "the shared system prompt was decoded again"
    assert reused["n_reused_tokens"] < reused["n_prompt_tokens"]
    fresh = _json(run_cli("run", *common, "-p", "What is a sextant?", check=True))
    assert fresh["n_reused_tokens"] == 0
    assert reused["text"] == fresh["text"]


def test_memory_that_cannot_trim_falls_back_to_an_exact_prefix(smollm_runtime, app_home, monkeypatch):
    rt = smollm_runtime
    folder = app_home / "store"
    settings = SamplerSettings(temperature=0, seed=1)

    def conversation(question: str) -> Conversation:
        conv = Conversation(system_prompt=SYSTEM, sampler=settings)
        begin_answer(conv, rt, question, n_predict=4)
        return conv

    longer = conversation("Who built the first lighthouse?")
    rt.trim(0)
    rt.prefill(longer.tokens)
    rt.save(folder / "longer.kvckpt", longer)
    target = conversation("What is a sextant?")
    exact = Conversation(system_prompt=SYSTEM, sampler=settings, tokens=target.tokens[:200])
    rt.trim(0)
    rt.prefill(exact.tokens)
    rt.save(folder / "exact.kvckpt", exact)
    rt.trim(0)

    index = PrefixIndex(folder)
    best = index.matches(target.tokens, rt.target.key)
    assert [m.path.name for m in best][:1] == ["longer.kvckpt"] and not best[0].exact
    assert len(block_hashes(target.tokens)) >= 3

    monkeypatch.setattr(rt.ctx, "seq_rm", lambda *a: False)   # as a recurrent memory would
    result = reuse_stored_prefix(rt, folder, target.tokens)
    assert result.how == "restored-exact" and result.source.name == "exact.kvckpt"
    assert result.n_tokens == 200 and rt.kv_tokens == target.tokens[:200]

    rt.ctx.clear()
    rt.kv_tokens = []
    (folder / "exact.kvckpt").unlink()
    assert reuse_stored_prefix(rt, folder, target.tokens).how == "recompute"


def test_a_point_is_offered_only_before_the_prompts_end_and_bad_points_are_ignored():
    """A recurrent memory takes a file where its end or one of its points is a prefix of the
    prompt; a point carries no logits, so one at the prompt's very end is not offered (the
    last token would be decoded again, which a recurrent memory cannot do from there), and
    an index entry whose points are not a list of counts offers its end alone."""
    from engine.checkpoints.prefix_index import _ends
    entry = {"n_tokens": 150, "points": [50, 100, "x", -3, True]}
    assert sorted(_ends(entry, 100)) == [50]
    assert sorted(_ends(entry, 101)) == [50, 100]
    assert sorted(_ends(entry, 150)) == [50, 100, 150]
    assert _ends({"n_tokens": 150, "points": 7}, 200) == [150]
    assert _ends({"n_tokens": "150", "points": None}, 200) == []
