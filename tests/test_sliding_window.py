"""A sliding window restored from a file is cut only where what stays is what decoding gave
(engine.snapshots.WindowCover; real Gemma 3 270M, n_swa 512).

A saved state holds only the window before its end, while llama.cpp's ``seq_rm`` drops a
tail from a restored cache without complaint: the next tokens then saw a window with
holes, and their logits were off by about 1 (Edit, Regenerate, prefix reuse after a
restore), silently.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.checkpoints.format import KIND_MANUAL, read_checkpoint
from engine.conversation import Conversation
from engine.runtime import Runtime
from engine.snapshots import WindowCover
from native.context import ContextSettings

pytestmark = pytest.mark.slow

SETTINGS = ContextSettings(n_ctx=2048, n_threads=2)


def _logits_after(rt: Runtime, tokens: list[int]) -> tuple[np.ndarray, int]:
    report = rt.prefill(tokens)
    return np.array(rt.logits(), copy=True), report.n_reused


def _tokens(rt: Runtime, text: str) -> list[int]:
    return rt.model.tokenize_prompt(text)


def test_a_restored_window_is_read_again_rather_than_cut_with_holes(gemma_path, tmp_path):
    rt = Runtime(gemma_path, SETTINGS)
    try:
        story = _tokens(rt, "Rivers and hills, roads and towns, " * 100)
        assert len(story) > 700
        rt.prefill(story)
        info = rt.save(tmp_path / "a.kvckpt", Conversation(tokens=story), KIND_MANUAL)
        cut = len(story) - 6   # an edit of the last few tokens
        other = story[:cut] + _tokens(rt, " lakes")[1:]
        rt.trim(0)
        scratch, _ = _logits_after(rt, other)   # what reading it all gives
    finally:
        rt.close()
    fresh = Runtime(gemma_path, SETTINGS)
    try:
        fresh.restore(read_checkpoint(info.path))
        got, reused = _logits_after(fresh, other)
    finally:
        fresh.close()
    assert reused == 0, "the restored window was cut where it has holes"
    assert np.array_equal(got, scratch)


def test_a_restored_chain_is_cut_exactly_at_a_file_end(gemma_path, tmp_path):
    """A file's end keeps its whole window: Regenerate and a branch switch go back there
    without reading anything again."""
    from engine.checkpoints.chain import load_chain
    rt = Runtime(gemma_path, SETTINGS)
    try:
        story = _tokens(rt, "Rivers and hills, roads and towns, " * 100)
        first = len(story) - 40
        rt.prefill(story[:first])
        base = rt.save(tmp_path / "a.kvckpt", Conversation(tokens=story[:first]), KIND_MANUAL)
        rt.prefill(story)
        rt.save(tmp_path / "b.kvckpt", Conversation(tokens=story), KIND_MANUAL, parent=base)
        other = story[:first] + _tokens(rt, " lakes and seas")[1:]
        live, _ = _logits_after(rt, other)   # the live cache cuts exactly anywhere
    finally:
        rt.close()
    fresh = Runtime(gemma_path, SETTINGS)
    try:
        fresh.restore_chain(load_chain(tmp_path / "b.kvckpt"))
        got, reused = _logits_after(fresh, other)
    finally:
        fresh.close()
    assert reused == first
    assert np.array_equal(got, live)


def test_window_cover():
    w = WindowCover(4)   # the token at m sees m-3..m
    w.decoded(0, 10)
    assert [w.nearest_cut(n) for n in (0, 3, 10, 12)] == [0, 3, 10, 10]
    w.clear()
    w.restored(0, 10)   # a file of positions 0..9 sets the window 6..9
    assert w.nearest_cut(8) == 0 and w.nearest_cut(9) == 9 and w.nearest_cut(10) == 10
    w.restored(10, 12)  # a delta 10..11 on it
    assert w.nearest_cut(12) == 12 and w.nearest_cut(11) == 11
    w.decoded(12, 20)
    assert w.nearest_cut(19) == 19 and w.nearest_cut(15) == 15
    w.cut(11)
    assert w.nearest_cut(20) == 11
    w.clear()
    w.restored(0, 10)
    w.decoded(10, 12)   # read on after a restore
    assert w.nearest_cut(11) == 11 and w.nearest_cut(8) == 0
    assert WindowCover(0).nearest_cut(7) == 7
