"""A long system prompt is stored once, and checkpoints carry logits only where needed
(engine.shared_prefix, engine.runtime.logits_rule; issue 25).

Real model (SmolLM2), real files: the conversations that share a system prompt share one
prefix file, restore from it exactly, and the store's graph keeps it while any of them
needs it and deletes it with the last one.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import continue_in_fresh_runtime, run_cli

from engine.checkpoints import graph as store_graph
from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_EXIT, KIND_MANUAL, KIND_PAUSE, read_checkpoint
from engine.checkpoints.graph import Graph, is_shared_line
from engine.checkpoints.store import Store
from engine.checkpoints.transfer import import_files
from engine.conversation import Conversation
from engine.generation import begin_answer, generate
from engine.history import LineWriter
from engine.model_shape import ModelShape
from engine.runtime import Runtime, logits_rule
from engine.sampling import SamplerSettings
from engine.shared_prefix import MIN_TOKENS, shared_base
from native.context import ContextSettings

pytestmark = pytest.mark.slow

SYSTEM = "You are the careful assistant of a shipping company; answer briefly and politely. " * 24
QUESTIONS = ("Where is my parcel?", "How do I return an item?", "What does express delivery cost?")


def _answer(rt, store: Path, question: str, *, system: str = SYSTEM, stop_after: int | None = None):
    """One conversation, its autosaves and its head in ``store``; (conversation, writer)."""
    rt.trim(0)
    conv = Conversation(system_prompt=system, sampler=SamplerSettings(temperature=0.7, seed=5))
    begin_answer(conv, rt, question, n_predict=24)
    writer = LineWriter.starting(rt, Store(store), conv.id.hex)
    generate(rt, conv, autosave=writer, autosave_every=8, stop_after=stop_after)
    writer.save_head(conv, KIND_PAUSE if stop_after else KIND_MANUAL)
    writer.close()
    return conv, writer


def _shared(g: Graph):
    return [n for n in g.nodes.values() if is_shared_line(n.line)]


def test_conversations_with_one_system_prompt_store_it_once(smollm_runtime, tmp_path):
    for q in QUESTIONS:
        _answer(smollm_runtime, tmp_path, q)
    g = Graph.scan(tmp_path)
    shared = _shared(g)
    assert len(shared) == 1, "the system prompt was stored more than once"
    prefix = shared[0]
    assert prefix.header.n_tokens >= MIN_TOKENS and not prefix.header.has_logits
    assert len(g.heads) == len(QUESTIONS) and prefix not in g.heads, "a shared prefix is no conversation"
    for head in g.heads:
        assert g.chain(head)[0] is prefix
        own, shared_bytes = g.footprint(head)
        assert shared_bytes == prefix.size
        assert own < prefix.size / 3, f"{head.name} holds {own} bytes of its own"
    total = sum(n.size for n in g.nodes.values())
    floor = prefix.size + sum(g.footprint(h)[0] for h in g.heads)
    assert total == floor
    # the browser says what each conversation holds alone and what it shares
    from gui.browser import HEAD, list_rows
    heads = [r for r in list_rows(Store(tmp_path), smollm_runtime.target) if r.role == HEAD]
    assert len(heads) == len(QUESTIONS) and all(r.shared_size == prefix.size for r in heads)


def test_a_conversation_on_a_shared_prefix_resumes_exactly(smollm_path, smollm_runtime, tmp_path):
    rt = smollm_runtime
    _answer(rt, tmp_path, QUESTIONS[0])
    rt.trim(0)
    reference = Conversation(system_prompt=SYSTEM, sampler=SamplerSettings(temperature=0.7, seed=5))
    begin_answer(reference, rt, QUESTIONS[1], n_predict=24)
    whole = generate(rt, reference).text
    conv, writer = _answer(rt, tmp_path, QUESTIONS[1], stop_after=10)
    chain = load_chain(writer.head.path)
    assert is_shared_line(chain[0].meta["line"]) and len(chain) >= 2
    expected_state = np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True)
    rest = continue_in_fresh_runtime(smollm_path, chain, expected_state)
    assert conv.answer.text + rest == whole


def test_the_prefix_lives_as_long_as_a_conversation_needs_it(smollm_runtime, tmp_path):
    store = Store(tmp_path)
    first, _ = _answer(smollm_runtime, tmp_path, QUESTIONS[0])
    second, _ = _answer(smollm_runtime, tmp_path, QUESTIONS[1])
    store_graph.prune(store, budget_bytes=0)
    assert len(_shared(Graph.scan(store))) == 1, "pruning deleted a prefix two heads need"
    store_graph.delete_conversation(store, first.id)
    g = Graph.scan(store)
    assert len(_shared(g)) == 1 and [h.conversation_id for h in g.heads] == [second.id]
    store_graph.delete_conversation(store, second.id)
    assert store.files() == [], "the last user of a shared prefix left it behind"


def test_an_import_links_to_the_prefix_and_keeps_it_out_of_the_conversations(smollm_runtime, tmp_path):
    source, target = tmp_path / "a", tmp_path / "b"
    _, writer = _answer(smollm_runtime, source, QUESTIONS[0])
    files = [d.path for d in load_chain(writer.head.path)]
    assert all(r.ok for r in import_files(files, Store(target), smollm_runtime.target))
    g = Graph.scan(target)
    assert len(_shared(g)) == 1 and len(g.heads) == 1
    # the next conversation with that system prompt finds the imported prefix
    _answer(smollm_runtime, target, QUESTIONS[2])
    g = Graph.scan(target)
    assert len(_shared(g)) == 1 and len(g.heads) == 2


def test_short_prompts_and_other_memories_store_no_prefix(smollm_runtime, tmp_path, monkeypatch):
    _answer(smollm_runtime, tmp_path / "short", QUESTIONS[0], system="You are terse.")
    assert _shared(Graph.scan(tmp_path / "short")) == []
    rt = smollm_runtime
    rt.trim(0)
    conv = Conversation(system_prompt=SYSTEM)
    begin_answer(conv, rt, QUESTIONS[0], n_predict=4)
    generate(rt, conv)
    # a hybrid with a sliding window keeps whole snapshots only: no prefix of its own
    monkeypatch.setattr(rt, "shape", replace(rt.shape, n_swa=512, memory=2))
    assert shared_base(rt, Store(tmp_path / "swa"), conv) is None


@pytest.mark.parametrize("memory, n_swa, recomputable", [(0, 0, True), (0, 512, True), (1, 0, False),
                                                         (2, 0, False)])
def test_logits_rule(memory, n_swa, recomputable):
    shape = ModelShape(name="m", architecture="a", n_vocab=8, n_layer=1, n_head_kv=1, n_embd_head_k=4, n_embd_head_v=4,
                       n_swa=n_swa, memory=memory)
    assert shape.logits_recomputable == recomputable
    for kind in (KIND_PAUSE, KIND_EXIT):   # where generation resumes: always, to sample at once
        assert logits_rule(kind, True, True, True, shape)
    assert logits_rule(KIND_MANUAL, True, True, True, shape), "a paused answer saved by hand"
    for kind in (KIND_AUTOSAVE, KIND_MANUAL):   # an autosave mid-answer; a finished answer
        paused = kind == KIND_AUTOSAVE
        assert logits_rule(kind, paused, True, False, shape), "a batch-decoded last token cannot be redone"
        assert logits_rule(kind, paused, True, True, shape) == (not recomputable)
    assert not logits_rule(KIND_PAUSE, True, False, True, shape)


def test_cli_reuse_and_loading_a_file_from_elsewhere_write_only_new_cells(app_home, tmp_path):
    store = app_home / "data" / "checkpoints"

    def run(*args) -> dict:
        done = run_cli("run", "--system", SYSTEM, "-n", "8", "--temp", "0", "--json", *args, check=True)
        return json.loads(done.stdout)

    def size() -> int:
        return sum(p.stat().st_size for p in store.glob("*.kvckpt"))

    run("-p", QUESTIONS[0])
    one = size()
    second = run("-p", QUESTIONS[1], "--reuse-prefix")
    assert second["n_reused_tokens"] > MIN_TOKENS
    assert size() - one < one / 4, "the second conversation stored its own copy of the prefix"

    named = tmp_path / "x.kvckpt"
    run_cli("run", "--system", "You are terse.", "-p", "Hello", "-n", "8", "--temp", "0",
            "--checkpoint-save", str(named), check=True)
    named_id = read_checkpoint(named, load_state=False).meta["checkpoint_id"]

    for prompt in ("More", "Again"):
        run_cli("run", "--checkpoint-load", str(named), "-p", prompt, "-n", "8", "--temp", "0", check=True)
    copies = [p for p in store.glob("*.kvckpt")
              if read_checkpoint(p, load_state=False).meta["checkpoint_id"] == named_id]
    assert len(copies) == 1, "each run copied the loaded file into the store again"


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_an_autosave_without_logits_gives_them_back_bit_for_bit(model, request, tmp_path):
    """The autosave's last token was generated (decoded alone): decoding it again, alone,
    after a restore in a new runtime gives the logits the running one had."""
    path = request.getfixturevalue(f"{model}_path")
    settings = ContextSettings(n_ctx=2048, n_threads=2)
    rt = Runtime(path, settings)
    try:
        conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=3, ignore_eos=True))
        # longer than Gemma 3's 512-token window: the ring has wrapped when it is saved
        begin_answer(conv, rt, "Rivers and hills. " * 150, n_predict=40)
        generate(rt, conv, stop_after=12)
        info = rt.save(tmp_path / "a.kvckpt", conv, KIND_AUTOSAVE)
        expected = np.array(rt.logits(), copy=True)
    finally:
        rt.close()
    data = read_checkpoint(info.path)
    assert not data.header.has_logits
    fresh = Runtime(path, settings)
    try:
        restored = fresh.restore(data)
        report = fresh.prefill(restored.tokens)
        assert report.n_decoded == 1
        assert np.array_equal(fresh.logits(), expected)
    finally:
        fresh.close()


def test_export_of_a_conversation_on_a_shared_prefix_is_one_whole_file(smollm_runtime, tmp_path):
    from engine.compaction import compact_into
    rt = smollm_runtime
    _, writer = _answer(rt, tmp_path / "store", QUESTIONS[0])
    chain = load_chain(writer.head.path)
    assert len(chain) >= 2 and is_shared_line(chain[0].meta["line"])
    out = compact_into(rt, chain, tmp_path / "export.kvckpt")
    held = np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True)
    alone = read_checkpoint(out.path)
    assert not alone.header.is_delta and alone.header.n_tokens == chain[-1].header.n_tokens
    rt.trim(0)
    rt.restore(alone)
    assert np.array_equal(rt.prefix_state(len(rt.kv_tokens)), held)


def test_a_sliding_window_shares_its_system_prompt_and_resumes_exactly(gemma_path, tmp_path):
    """Gemma 3 (n_swa 512): the prefix is stored once from a live cache and each chain
    (prefix + delta) restores to the bytes and logits the conversation had; a cache
    restored from a file (its window holds only the end) writes no prefix."""
    rt = Runtime(gemma_path, ContextSettings(n_ctx=2048, n_threads=2))
    system = SYSTEM * 2   # past the 512-token window
    try:
        heads, states = [], []
        for q in QUESTIONS[:2]:
            conv, writer = _answer(rt, tmp_path / "store", q, system=system, stop_after=8)
            heads.append(writer.head.path)
            states.append((np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True), np.array(rt.logits(), copy=True)))
        g = Graph.scan(tmp_path / "store")
        shared = _shared(g)
        assert len(shared) == 1 and shared[0].header.n_tokens > 512
        assert all(g.chain(g.nodes[h.name])[0] is shared[0] for h in heads)
        for head, (state, logits) in zip(heads, states, strict=True):
            rt.trim(0)
            rt.restore_chain(load_chain(head))
            assert np.array_equal(rt.prefix_state(len(rt.kv_tokens)), state)
            assert np.array_equal(rt.logits(), logits)
        # restored from one whole file: the window before the system prompt's end is not held
        from engine.compaction import compact_into
        whole = compact_into(rt, load_chain(heads[0]), tmp_path / "whole.kvckpt")
        rt.trim(0)
        conv = rt.restore(read_checkpoint(whole.path))
        assert shared_base(rt, Store(tmp_path / "other"), conv) is None
        assert shared_base(rt, Store(tmp_path / "store"), conv) is None
    finally:
        rt.close()


def test_a_sliding_window_started_from_the_prefix_equals_reading_it_all(gemma_path, tmp_path):
    """A new conversation restores the stored prefix and reads on from the system prompt's
    end; one read from nothing is cut there too (Answer.marks), so both decode the same
    pieces and end with the same bytes and logits — its question long enough that the
    prompt crosses a batch boundary after the prefix (where the cut matters for a window)."""
    from engine.prefix_reuse import start_from_stored_prefix
    system = SYSTEM * 2
    question = "Tell me everything about parcels, labels and depots. " * 40
    settings = ContextSettings(n_ctx=2048, n_threads=2)
    rt = Runtime(gemma_path, settings)
    try:
        _answer(rt, tmp_path, QUESTIONS[0], system=system)
        rt.trim(0)
        conv = Conversation(system_prompt=system)
        begin_answer(conv, rt, question, n_predict=4)
        assert len(conv.answer.marks) == 1 and len(conv.tokens) > 1024 > conv.answer.marks[0] > 512
        rt.prefill(conv.tokens, marks=conv.answer.marks)
        expected = (np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True), np.array(rt.logits(), copy=True))
    finally:
        rt.close()
    fresh = Runtime(gemma_path, settings)
    try:
        conv = Conversation(system_prompt=system)
        begin_answer(conv, fresh, question, n_predict=4)
        start_from_stored_prefix(fresh, Store(tmp_path), conv)
        report = fresh.prefill(conv.tokens, marks=conv.answer.marks)
        assert report.n_reused == conv.answer.marks[0], "it did not start from the shared prefix"
        assert np.array_equal(fresh.prefix_state(len(fresh.kv_tokens)), expected[0])
        assert np.array_equal(fresh.logits(), expected[1])
    finally:
        fresh.close()
