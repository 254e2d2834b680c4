"""Issue 13, timings a user can trust, in the window's engine thread (no Qt involved).

The summary of an answer says how long the user waited for its first token, counted
from the command, with the restore of the conversation's checkpoint included and
reported on its own (``restore_s``); ``prefill_s`` is decoding only.
"""

from __future__ import annotations

from test_gui_worker import Recorder

from engine.checkpoints.store import Store
from engine.sampling import SamplerSettings
from engine.worker import EngineWorker, ModelOptions


def switch_back(smollm_path, tmp_path, sequences: int):
    """A, then B, then A again: the summaries of A's first and second answers."""
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2, sequences=sequences))
        rec.wait("loaded")
        a = w.new_conversation(sampler=SamplerSettings(seed=5, temperature=0))
        w.send(a, "Name three colours. " * 20, n_predict=6)
        first = rec.wait("finished", 1)[-1][1]
        assert first.restore_s == 0.0                     # nothing to restore: a new conversation
        assert first.prefill_s > 0 and first.ttft_s >= first.prefill_s

        b = w.new_conversation(sampler=SamplerSettings(seed=6, temperature=0))
        w.send(b, "Name three animals.", n_predict=6)
        rec.wait("finished", 2)

        w.send(a, "And three more?", n_predict=4)
        back = rec.wait("finished", 3)[-1][1]
        assert back.n_reused_tokens >= first.n_prompt_tokens, back
        return first, back
    finally:
        w.shutdown()
        assert w.join(60)


def test_a_switch_back_counts_its_restore_in_the_time_to_first_token(smollm_path, tmp_path):
    # one sequence: the cache holds B, so A's checkpoint is read and restored first
    _, back = switch_back(smollm_path, tmp_path, sequences=1)
    assert back.restore_s > 0, back
    assert back.ttft_s >= back.restore_s + back.prefill_s * 0.999, back


def test_a_switch_back_to_a_resident_conversation_restores_nothing(smollm_path, tmp_path):
    # two sequences: A stayed in the cache beside B
    _, back = switch_back(smollm_path, tmp_path, sequences=2)
    assert back.restore_s == 0.0, back
    assert back.ttft_s >= back.prefill_s * 0.999, back
