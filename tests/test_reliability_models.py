"""Issue 4, case 4: foreign and mismatched checkpoints, with real models.

A SmolLM2 checkpoint into Gemma 3 and back; SmolLM2 checkpoints into SmolLM2 contexts
with another n_ctx, K cache type or flash-attention setting.  Each is refused with the
reason, before llama.cpp sees the state, and the conversation that was open keeps
generating exactly what it would have generated without the attempt.
"""

from __future__ import annotations

import pytest

from engine.checkpoints import format as fmt
from engine.conversation import Conversation
from engine.errors import IncompatibleContext, IncompatibleModel
from engine.generation import begin_answer, generate
from engine.sampling import SamplerSettings
from native.context import KV_TYPES, ContextSettings

pytestmark = pytest.mark.slow


def _conversation(runtime, prompt: str) -> Conversation:
    conv = Conversation(sampler=SamplerSettings(seed=1234))
    begin_answer(conv, runtime, prompt, n_predict=6)
    return conv


def _checkpoint(runtime, tmp_path, name: str) -> fmt.CheckpointData:
    runtime.trim(0)
    conv = _conversation(runtime, "Name a fruit.")
    generate(runtime, conv, stop_after=2)
    path = tmp_path / f"{name}.kvckpt"
    runtime.save(path, conv)
    return fmt.read_checkpoint(path)


def _refused_then_keeps_working(runtime, foreign: fmt.CheckpointData, expected: type,
                                reason: str, monkeypatch) -> None:
    prompt = "Tell me about the sea."
    runtime.trim(0)
    reference = _conversation(runtime, prompt)
    generate(runtime, reference, stop_after=3)
    generate(runtime, reference)                      # the 3 + 3 tokens, undisturbed

    runtime.trim(0)
    conv = _conversation(runtime, prompt)
    generate(runtime, conv, stop_after=3)
    kv_before = list(runtime.kv_tokens)
    calls = []
    monkeypatch.setattr(runtime.ctx, "state_set_from", lambda *a, **k: calls.append(a))
    with pytest.raises(expected, match=reason):
        runtime.restore(foreign)
    monkeypatch.undo()
    assert calls == [] and runtime.kv_tokens == kv_before
    result = generate(runtime, conv)
    assert result.n_prefilled == 0                    # nothing was lost: no re-decode
    assert conv.answer.text == reference.answer.text and conv.tokens == reference.tokens
    assert reference.answer.n_generated == 6


@pytest.fixture(scope="module")
def gemma_runtime(gemma_path):
    from engine.runtime import Runtime
    rt = Runtime(gemma_path, ContextSettings(n_ctx=512, n_threads=2))
    yield rt
    rt.close()


def test_smollm_checkpoint_into_gemma_and_back(tmp_path, smollm_runtime, gemma_runtime, monkeypatch):
    smol = _checkpoint(smollm_runtime, tmp_path, "smol")
    gemma = _checkpoint(gemma_runtime, tmp_path, "gemma")
    _refused_then_keeps_working(gemma_runtime, smol, IncompatibleModel, "fingerprints differ",
                                monkeypatch)
    _refused_then_keeps_working(smollm_runtime, gemma, IncompatibleModel, "fingerprints differ",
                                monkeypatch)


@pytest.mark.parametrize("settings,reason", [
    (dict(n_ctx=1024), "context size 2048 tokens"),
    (dict(type_k=KV_TYPES["f16"]), "K cache type q8_0"),
    (dict(flash_attn=False, type_k=KV_TYPES["f16"], type_v=KV_TYPES["f16"]), "flash attention on"),
])
def test_same_model_other_context_settings(tmp_path, smollm_path, smollm_runtime, monkeypatch,
                                           settings, reason):
    from engine.runtime import Runtime
    other = Runtime(smollm_path, ContextSettings(**{"n_ctx": 2048, "n_threads": 2, **settings}))
    try:
        mine = _checkpoint(smollm_runtime, tmp_path, "main")
        _refused_then_keeps_working(other, mine, IncompatibleContext, reason, monkeypatch)
        theirs = _checkpoint(other, tmp_path, "other")
        _refused_then_keeps_working(smollm_runtime, theirs, IncompatibleContext, "the checkpoint needs",
                                    monkeypatch)
    finally:
        other.close()
