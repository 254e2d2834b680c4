"""A chain whose base holds fewer cells than the next file (a conversation on a shared system
prompt) parks the base in the scratch sequence and sets the next file directly
(engine.restore._parks_base): fewer cells pass through ``seq_cp``.  The cache must be the
same cell for cell as the other order's, and as the live cache the files were saved from,
or a continuation would not be exact.

Real model (SmolLM2), real files; the cut variant's delta builds on the base's first
tokens only (engine.checkpoints.chain.can_cut).
"""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.common import prompt_tokens
from engine import restore
from engine.checkpoints.chain import load_chain
from engine.conversation import Conversation


@pytest.fixture
def rt(smollm_runtime):
    smollm_runtime.trim(0)
    yield smollm_runtime
    smollm_runtime.trim(0)


def _held(rt) -> Conversation:
    """A conversation of the tokens the cache holds (the files need one)."""
    return Conversation(tokens=list(rt.kv_tokens))


def _state(rt) -> bytes:
    return rt._state_bytes(0).tobytes()


def _next_logits(rt, token: int) -> np.ndarray:
    rt.decode_token(token)
    logits = np.array(rt.logits(), copy=True)
    rt.trim(len(rt.kv_tokens) - 1)
    return logits


@pytest.mark.parametrize("cut", [False, True], ids=["on-its-end", "cut"])
def test_a_parked_base_gives_the_cache_the_other_order_gives(rt, tmp_path, monkeypatch, cut):
    words = prompt_tokens(rt.model, 160)
    base_tokens, own = words[:40], words[40:150]
    rt.prefill(base_tokens)
    base = rt.save(tmp_path / "base.kvckpt", _held(rt))
    start = 30 if cut else len(base_tokens)
    rt.trim(start)
    rt.prefill(base_tokens[:start] + own)
    delta = rt.save(tmp_path / "delta.kvckpt", _held(rt), parent=base, cut=start if cut else None)
    live_state, live_next = _state(rt), _next_logits(rt, words[150])

    chain = load_chain(delta.path)
    assert chain[1].header.parent_n_tokens == start
    assert restore._parks_base(chain, 0), "the chain does not take the parked order"
    caches = {}
    for parked in (True, False):
        monkeypatch.setattr(restore, "_parks_base", lambda chain, keep, parked=parked: parked and keep == 0)
        rt.trim(0)
        rt.restore_chain(load_chain(delta.path))
        assert rt.ctx.pos_max(1) == -1, "the scratch sequence kept cells"
        caches[parked] = (_state(rt), _next_logits(rt, words[150]))
    assert caches[True][0] == caches[False][0] == live_state
    assert np.array_equal(caches[True][1], live_next) and np.array_equal(caches[False][1], live_next)


def test_a_larger_base_and_a_cache_holding_part_of_the_chain_are_not_parked(rt, tmp_path):
    words = prompt_tokens(rt.model, 120)
    rt.prefill(words[:100])
    base = rt.save(tmp_path / "base.kvckpt", _held(rt))
    rt.prefill(words[:110])
    delta = rt.save(tmp_path / "delta.kvckpt", _held(rt), parent=base)
    chain = load_chain(delta.path)
    assert not restore._parks_base(chain, 0)      # the base is the larger: it goes in directly
    assert not restore._parks_base(chain[:1], 0)  # nothing to park it for
    assert not restore._parks_base(chain, 1)      # the base is in the cache already
