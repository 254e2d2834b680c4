"""engine.worker (the GUI's engine thread) with the real model, no Qt involved.

The bookkeeping behind "never recompute twice": autosaves and their disk budget,
switching conversations by restoring checkpoints instead of re-decoding prompts, and
refused checkpoints leaving the current conversation usable.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from enginekit import Recorder

from engine.checkpoints.format import KIND_AUTOSAVE, KIND_MANUAL, KIND_PAUSE, read_header
from engine.checkpoints.store import Store
from engine.sampling import SamplerSettings
from engine.worker import EngineWorker, ModelOptions, WorkerListener


@pytest.fixture
def worker(smollm_path, tmp_path):
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2))
    rec.wait("loaded")
    yield w, rec
    w.shutdown()
    assert w.join(60)


def test_autosaves_every_n_tokens_within_the_budget(worker):
    from engine.checkpoints.graph import Graph
    w, rec = worker
    w.autosave_every = 8
    a = w.new_conversation(sampler=SamplerSettings(seed=3))
    w.send(a, "Tell me about rivers.", n_predict=20)
    summary = rec.wait("finished")[0][1]
    rec.wait("saved", summary.n_generated // 8 + 1)
    kinds = [e[3] for e in rec.of("saved")]
    assert summary.n_generated >= 8
    assert kinds == [KIND_AUTOSAVE] * (summary.n_generated // 8) + [kinds[-1]]
    assert kinds[-1] != KIND_AUTOSAVE
    # the final save is the conversation's head: it absorbed the autosaves (a full file,
    # engine.history.LineWriter._absorbed_by_head), which are retired; nothing in the store
    # is outside its chain
    g = Graph.scan(w.store)
    (head,) = g.heads
    assert head.conversation_id == a and head.path == rec.of("saved")[-1][2]
    assert head.header.kind != KIND_AUTOSAVE and not head.is_delta
    assert {n.name for n in g.chain(head)} == set(g.nodes) == {head.name}

    # a tiny budget prunes what no head needs, oldest first: here a stale copy of A's
    # history; never A's chain, never B's live autosaves
    w.autosave_budget = 1
    b = w.new_conversation(sampler=SamplerSettings(seed=4))
    from dataclasses import replace

    from engine.checkpoints import format as fmt
    raw = bytearray(g.chain(head)[0].path.read_bytes())
    header = fmt.unpack_header(bytes(raw[:fmt.HEADER_LEN]), len(raw))
    raw[:fmt.HEADER_LEN] = fmt.pack_header(replace(header, created_unix_ns=1))
    stale = w.store.folder / "autosave-old-00001.kvckpt"
    stale.write_bytes(bytes(raw))
    assert not Graph.scan(w.store).reachable(Graph.scan(w.store).nodes[stale.name])
    w.send(b, "Tell me about lakes.", n_predict=10)
    rec.head_saved(b)
    assert not stale.exists()
    after = Graph.scan(w.store)
    assert {n.name for n in after.chain(after.nodes[head.name])} <= set(after.nodes)
    assert {h.conversation_id for h in after.heads} == {a, b}


def _answer_with_landings(smollm_path, tmp_path, monkeypatch, rec, on_the_helper):
    """A worker on SmolLM2 (autosave every 8 tokens) answers 20 tokens; every fsync on the
    landing helper thread (the autosaves') calls ``on_the_helper`` first.  The engine
    thread has stopped when this returns: (worker, conversation id, the answer's summary)."""
    from engine.checkpoints import atomic

    real_fsync = atomic.fsync

    def fsync(fd):
        if threading.current_thread().name.startswith("checkpoint-landing"):
            on_the_helper()
        real_fsync(fd)

    monkeypatch.setattr(atomic, "fsync", fsync)
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2))
        rec.wait("loaded")
        w.autosave_every = 8
        a = w.new_conversation(sampler=SamplerSettings(seed=3))
        w.send(a, "Tell me about rivers.", n_predict=20)
        summary = rec.wait("finished")[0][1]
        rec.head_saved(a)
    finally:
        w.shutdown()
        assert w.join(60)
    return w, a, summary


def test_saves_are_announced_in_the_order_made_once_they_can_be_loaded(smollm_path, tmp_path, monkeypatch):
    """An autosave lands on a helper thread.  On a slow disk the answer's head is written
    while the last autosave is still landing: that autosave is still announced before the
    head (not after, when the head has retired its file), and only once it is a file."""
    import time
    from pathlib import Path

    class Checking(Recorder):
        def on_checkpoint_saved(self, e):
            self._add("there", Path(e.path).exists())
            super().on_checkpoint_saved(e)

    rec = Checking()
    _, _, summary = _answer_with_landings(smollm_path, tmp_path, monkeypatch, rec, lambda: time.sleep(0.4))
    kinds = [e[3] for e in rec.of("saved")]
    assert summary.n_generated >= 16
    assert kinds == [KIND_AUTOSAVE] * (summary.n_generated // 8) + [KIND_MANUAL], kinds
    assert all(e[1] for e in rec.of("there"))


def test_an_autosave_that_fails_to_land_is_reported_and_never_announced(smollm_path, tmp_path, monkeypatch):
    """The fsync of every autosave landing on the helper thread fails: each is reported as
    a failed autosave and not announced (the one after a failure is written in the
    foreground, and lands), and the answer's head is saved whole."""
    from engine.checkpoints.chain import load_chain
    from engine.commands import Action

    def failing():
        raise OSError(5, "Input/output error")

    rec = Recorder()
    w, a, summary = _answer_with_landings(smollm_path, tmp_path, monkeypatch, rec, failing)
    failed = [e for e in rec.of("error") if e[1] is Action.AUTOSAVE]
    assert failed and all("Input/output error" in e[2] for e in failed), rec.of("error")
    assert all(e[3] == a for e in failed)   # said as that conversation's (it may be in the background)
    kinds = [e[3] for e in rec.of("saved")]
    assert kinds[-1] == KIND_MANUAL
    assert kinds.count(KIND_AUTOSAVE) + len(failed) == summary.n_generated // 8, (kinds, failed)
    assert load_chain(rec.of("saved")[-1][2])[-1].header.n_tokens > 0
    assert w.sessions.named(a).head_path == rec.of("saved")[-1][2]


def test_switching_conversations_restores_instead_of_prefilling(worker, gemma_path, tmp_path):
    w, rec = worker
    a = w.new_conversation(sampler=SamplerSettings(seed=5))
    w.send(a, "Name three colours.", n_predict=12)
    rec.wait("finished", 1)
    b = w.new_conversation(sampler=SamplerSettings(seed=6))
    w.send(b, "Name three animals.", n_predict=12)
    rec.wait("finished", 2)
    # back to A: its checkpoint is restored, only the new turn is decoded
    w.send(a, "And three more?", n_predict=8)
    summary = rec.wait("finished", 3)[-1][1]
    first_prompt = rec.of("finished")[0][1].n_prompt_tokens
    assert summary.n_reused_tokens >= first_prompt + 12 - 1, summary

    # a checkpoint of another model is refused and A stays usable
    errors_before = len(rec.of("error"))
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.runtime import Runtime
    from native.context import ContextSettings
    foreign = tmp_path / "gemma.kvckpt"
    rt = Runtime(gemma_path, ContextSettings(n_ctx=1024, n_threads=2))
    try:
        conv = Conversation()
        begin_answer(conv, rt, "Hi", n_predict=2)
        generate(rt, conv)
        rt.save(foreign, conv)
    finally:
        rt.close()
    w.open_checkpoint(foreign)
    err = rec.wait("error", errors_before + 1)[-1]
    assert "model" in err[2]
    w.send(a, "Thanks!", n_predict=4)
    summary = rec.wait("finished", 4)[-1][1]
    assert summary.n_reused_tokens > first_prompt          # the cache still held A


def test_another_model_never_decodes_the_conversations_of_the_one_before(worker, gemma_path, monkeypatch):
    """Loading another model closes the conversations the engine had open (each saved, and
    named in ModelLoaded.left), also after a load that failed between; one whose head cannot
    be read then stays open, and its next answer is refused instead of decoding SmolLM2's
    token ids with Gemma 3."""
    import engine.worker as worker_module
    w, rec = worker
    a = w.new_conversation(sampler=SamplerSettings(seed=7))
    w.send(a, "Name a colour.", n_predict=6)
    rec.finished_for(a)
    b = w.new_conversation(sampler=SamplerSettings(seed=8))
    w.send(b, "Name a tree.", n_predict=6)
    rec.finished_for(b)
    a_head, b_head = rec.head_saved(a)[2], rec.head_saved(b)[2]

    real_read_header = worker_module.read_header

    def read_header(path):
        if Path(path) == Path(b_head):
            raise OSError("held open by another program")
        return real_read_header(path)
    monkeypatch.setattr(worker_module, "read_header", read_header)
    started = len(rec.of("started"))
    # a load that fails first leaves no model: the conversations' tokens are still SmolLM2's
    w.load_model(ModelOptions(Path(b_head).parent / "missing.gguf", n_ctx=1024, n_threads=2))
    rec.wait("error", len(rec.of("error")) + 1)
    w.load_model(ModelOptions(gemma_path, n_ctx=1024, n_threads=2))
    _, info, left = rec.wait("loaded", 2)[-1]
    monkeypatch.undo()
    assert "gemma" in info.name.lower()
    assert [(c.id, Path(c.path)) for c in left] == [(a, Path(a_head))]
    assert left[0].header.conversation_id == a and "smol" in left[0].model_name.lower()
    assert w.sessions.conversation(a) is None and w.sessions.conversation(b) is not None

    errors = len(rec.of("error"))
    w.send(b, "And another?", n_predict=4)
    err = rec.wait("error", errors + 1)[-1]
    assert "load that model" in err[2].lower() and err[3] == b
    w.send(a, "And another?", n_predict=4)
    err = rec.wait("error", errors + 2)[-1]
    assert "not open" in err[2]
    assert len(rec.of("started")) == started   # nothing was decoded


def test_a_failure_on_the_engine_thread_keeps_the_answer(smollm_path, tmp_path):
    """An exception mid-answer is reported, the decoded tokens are saved, Resume continues."""
    from engine.checkpoints.format import KIND_EXIT

    class Failing(Recorder):
        deltas = 0

        def on_text(self, e):
            Failing.deltas += 1
            if Failing.deltas == 6:
                raise RuntimeError("a bug in a listener")

    rec = Failing()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2))
        rec.wait("loaded")
        conv = w.new_conversation(sampler=SamplerSettings(seed=8, ignore_eos=True))
        w.send(conv, "Describe a forest.", n_predict=24)
        action, message, failed_conv = rec.wait("error")[0][1:]
        assert "RuntimeError" in message and failed_conv == conv
        saved = rec.wait("saved")[-1]
        assert saved[3] == KIND_EXIT and saved[1].paused
        header = read_header(saved[2])
        assert header.n_generated >= 5 and header.has_logits
        # the front ends heard which answer the failure ended
        assert [e[1].finish_reason for e in rec.wait("finished")] == ["error"]
        w.resume(conv)
        summary = rec.wait("finished", 2)[-1][1]
        assert summary.n_reused_tokens == summary.n_prompt_tokens, "decoded tokens were lost"
        assert header.n_generated + summary.n_generated == 24
    finally:
        w.shutdown()
        assert w.join(60)


def test_a_pause_before_the_first_token_stops_the_answer_there(worker):
    """Pause is enabled as soon as Send is clicked: a pause while the answer is still
    queued stops it before its first token, saved, and Resume loses nothing."""
    w, rec = worker
    gate = threading.Event()

    class Hold(WorkerListener):   # the engine thread waits in the first callback it makes
        def on_conversation_changed(self, e):
            gate.wait()
    hold = Hold()
    w.add_listener(hold)
    w.new_conversation()                                 # held there: the answer below stays queued
    conv = w.new_conversation(sampler=SamplerSettings(seed=11, ignore_eos=True))
    w.send(conv, "Tell me about mountains.", n_predict=12)
    w.pause()
    gate.set()
    w.remove_listener(hold)
    summary = rec.wait("finished")[-1][1]
    assert summary.finish_reason == "paused" and summary.n_generated == 0
    saved = rec.wait("saved")[-1]
    assert saved[3] == KIND_PAUSE and saved[1].paused
    w.resume(conv)
    resumed = rec.wait("finished", 2)[-1][1]
    assert resumed.finish_reason == "length" and resumed.n_generated == 12, rec.events
    # an idle pause (nothing queued) does not stop the next answer
    w.pause()
    other = w.new_conversation(sampler=SamplerSettings(seed=11, ignore_eos=True))
    w.send(other, "Tell me about mountains.", n_predict=12)
    fresh = rec.wait("finished", 3)[-1][1]
    assert fresh.finish_reason == "length" and fresh.text == resumed.text


def test_a_rename_writes_a_delta_of_metadata_only(worker):
    """Nothing new in the cache: the new head holds no cells, only the new title."""
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.graph import Graph
    w, rec = worker
    conv = w.new_conversation(sampler=SamplerSettings(seed=5))
    w.send(conv, "Name three seas.", n_predict=16)
    rec.wait("finished")
    first = rec.wait("saved")[-1]
    w.rename(conv, "Seas 🌊")
    renamed = rec.wait("saved", len(rec.of("saved")) + 1)[-1]
    head = read_header(renamed[2])
    assert head.title == "Seas 🌊" and head.is_delta and head.parent_n_tokens == head.n_tokens
    assert head.state_len == 0 and renamed[2].stat().st_size < first[2].stat().st_size
    chain = load_chain(renamed[2])
    assert chain[-2].path == first[2]                 # on the head it renames, which stays
    g = Graph.scan(w.store)
    assert [h.path for h in g.heads] == [renamed[2]]
    # it restores like its parent, with the new title
    w.send(conv, "And two lakes?", n_predict=4)
    summary = rec.wait("finished", 2)[-1][1]
    assert summary.n_reused_tokens >= head.n_tokens


def test_closing_while_the_exact_width_probe_runs_stops_it(smollm_path, tmp_path, monkeypatch):
    """The window closed while the model loads: the weights' load is cancelled at once, but
    the exact-width probe after it (S * (S + 2) decodes: seconds for a large model on a CPU)
    ran on, and the close waited 15 s for an engine with nothing to save (seen with a 4B
    model's widths).  It stops at its next decode now."""
    import time

    from engine.parallel import ParallelRuntime
    probing = threading.Event()
    decode_chunks = ParallelRuntime.decode_chunks

    def slow(self, *args, **kwargs):   # a large model's probe: 0.5 s a decode, ~12 s in all
        probing.set()
        time.sleep(0.5)
        return decode_chunks(self, *args, **kwargs)

    monkeypatch.setattr(ParallelRuntime, "decode_chunks", slow)
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2))
    assert probing.wait(120)
    started = time.monotonic()
    w.shutdown()
    assert w.join(60)
    assert time.monotonic() - started < 3, "the probe ran on after the close"
    assert not rec.of("loaded")


def test_a_failed_open_is_reported_as_the_conversation_it_was_asked_for(worker, tmp_path):
    """The window may open several conversations before the engine answers (a model loading):
    a failure names the conversation the open was asked for, so the window knows which."""
    import uuid

    from engine.commands import Action
    w, rec = worker
    damaged = tmp_path / "damaged.kvckpt"
    damaged.write_bytes(b"not a checkpoint")
    expected = uuid.uuid4()
    w.open_checkpoint(damaged, expected)
    error = rec.wait("error")[-1]
    assert error[1] is Action.OPEN_CHECKPOINT and error[3] == expected
