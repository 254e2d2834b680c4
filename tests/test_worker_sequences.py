"""Issue 11 in the window's engine thread: several conversations resident in one cache,
answers generating at once, each with its own pause, autosaves and crash safety.

Real SmolLM2 through engine.worker.EngineWorker (no Qt).  "Alone" below is the same
conversation answered with nothing else running, which is also what
``checkpoint-chat run`` gives (tests/test_parallel.py compares the two paths).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from enginekit import Recorder

from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_PAUSE
from engine.checkpoints.graph import Graph
from engine.checkpoints.store import Store
from engine.generation import generate
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from engine.worker import EngineWorker, ModelOptions
from native.context import ContextSettings

PROMPTS = ("Tell me about the sea.", "Describe a mountain village.", "Explain how bread rises.")


def start_worker(smollm_path, store_dir, *, sequences: int = 4) -> tuple[EngineWorker, Recorder]:
    rec = Recorder()
    w = EngineWorker(rec, Store(store_dir))
    w.start()
    w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2, sequences=sequences))
    rec.wait("loaded")
    return w, rec


def stop(w: EngineWorker) -> None:
    w.shutdown()
    assert w.join(60)


def sampler(i: int, temperature: float) -> SamplerSettings:
    return SamplerSettings(seed=100 + i, temperature=temperature, ignore_eos=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_two_answers_at_once_one_paused_and_resumed_equal_their_runs_alone(smollm_path, tmp_path, temperature):
    w, rec = start_worker(smollm_path, tmp_path / "store")
    try:
        alone = []
        for i in range(2):
            conv = w.new_conversation(sampler=sampler(i, temperature))
            w.send(conv, PROMPTS[i], n_predict=48)
            alone.append(rec.finished_for(conv).text)

        a = w.new_conversation(sampler=sampler(0, temperature))
        b = w.new_conversation(sampler=sampler(1, temperature))
        w.send(a, PROMPTS[0], n_predict=48)
        w.send(b, PROMPTS[1], n_predict=48)
        deadline = time.monotonic() + 120
        while len(rec.text_of(a)) < 20 and time.monotonic() < deadline:
            time.sleep(0.005)
        w.pause(a)                                  # A alone: B goes on streaming
        first = rec.finished_for(a)
        assert first.finish_reason == "paused" and 0 < first.n_generated < 48
        # A's pause saved A's sequence while B was still answering
        def pause_saves():
            return [e for e in rec.of("saved") if e[1].id == a and e[3] == KIND_PAUSE]
        with rec.cond:
            assert rec.cond.wait_for(pause_saves, 60)
        b_done = rec.finished_for(b)
        assert rec.events.index(pause_saves()[0]) < rec.events.index(("finished", b_done))
        w.resume(a)
        second = rec.finished_for(a, 2)
        assert b_done.text == alone[1]
        assert first.text + second.text == alone[0]
        assert first.n_generated + second.n_generated == 48
        # both ran at once: B started before A's first part ended
        starts = [e[1].id for e in rec.of("started")]
        assert starts[2:4] == [a, b]
    finally:
        stop(w)


def answer_each(w: EngineWorker, rec: Recorder, temperature: float, n_predict: int) -> list:
    """One conversation per prompt, answered one after the other; their ids."""
    ids = []
    for i, prompt in enumerate(PROMPTS):
        conv = w.new_conversation(sampler=sampler(i, temperature))
        w.send(conv, prompt, n_predict=n_predict)
        rec.finished_for(conv)
        ids.append(conv)
    return ids


def test_switching_among_resident_conversations_restores_nothing(smollm_path, tmp_path):
    w, rec = start_worker(smollm_path, tmp_path / "store", sequences=3)
    try:
        convs = answer_each(w, rec, 0.0, 8)
        restores = w.runtime.restores
        for conv in convs + convs[::-1]:
            w.show(conv)
        rec.wait("activated", 6)
        assert [e[2] for e in rec.of("activated")] == [True] * 6          # resident: nothing restored
        assert [e[3] for e in rec.of("activated")] == [0] * 6
        assert w.runtime.restores == restores                             # counted by the runtime
        # and a next answer in any of them prefills only its new message
        w.send(convs[0], "And then?", n_predict=4)
        again = rec.finished_for(convs[0], 2)
        assert again.restore_s == 0.0 and again.n_reused_tokens >= 8
        assert w.runtime.restores == restores
    finally:
        stop(w)


def turn_two(smollm_path, store_dir, sequences: int) -> tuple[str, int]:
    """A answers, B and C answer after it, then A again: A's second answer and how many
    chains were restored for it."""
    w, rec = start_worker(smollm_path, store_dir, sequences=sequences)
    try:
        ids = answer_each(w, rec, 0.8, 12)
        restores = w.runtime.restores
        w.send(ids[0], "Say more about it.", n_predict=16)
        return rec.finished_for(ids[0], 2).text, w.runtime.restores - restores
    finally:
        stop(w)


def test_an_evicted_conversation_comes_back_exactly(smollm_path, tmp_path):
    # two sequences for three conversations: A, the least recently used, is evicted for C
    evicted, restored = turn_two(smollm_path, tmp_path / "two", sequences=2)
    resident, none = turn_two(smollm_path, tmp_path / "four", sequences=4)
    assert restored == 1 and none == 0
    assert evicted == resident


def test_requests_beyond_the_free_sequences_wait_and_the_rest_run_at_once(smollm_path, tmp_path):
    from engine.requests import CompletionRequest

    class Requests(Recorder):
        def on_request_started(self, e):
            self._add("req-started", e.request_id)

        def on_request_finished(self, e):
            self._add("req-done", e.request_id)

    rec = Requests()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2, sequences=2))
        rec.wait("loaded")
        for k, n in enumerate((8, 48, 8)):
            w.complete(CompletionRequest(request_id=f"r{k}", messages=(("user", PROMPTS[k]),),
                                         n_predict=n, seed=k))
        rec.wait("req-done", 3)
        order = [(e[0], e[1]) for e in rec.events if e[0] in ("req-started", "req-done")]
        # two at once; the third starts only when one of them is done
        assert order[:2] == [("req-started", "r0"), ("req-started", "r1")]
        assert order[2][0] == "req-done" and order[3] == ("req-started", "r2")
    finally:
        stop(w)


CHILD = textwrap.dedent("""
    import sys, time
    from engine.checkpoints.format import KIND_AUTOSAVE
    from engine.checkpoints.store import Store
    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions
    sys.path.insert(0, sys.argv[3])
    from enginekit import Recorder
    rec = Recorder()
    w = EngineWorker(rec, Store(sys.argv[2]))
    w.autosave_every = 4
    w.start()
    w.load_model(ModelOptions(sys.argv[1], n_ctx=1024, n_threads=2))
    rec.wait("loaded")
    ids = []
    for i, prompt in enumerate(("Tell me about the sea.", "Describe a mountain village.")):
        ids.append(w.new_conversation(sampler=SamplerSettings(seed=100 + i, temperature=0.8, ignore_eos=True)))
    for conv, prompt in zip(ids, ("Tell me about the sea.", "Describe a mountain village.")):
        w.send(conv, prompt, n_predict=int(sys.argv[4]))
    while not all(any(e[1].id == c and e[3] == KIND_AUTOSAVE for e in rec.of("saved")) for c in ids):
        time.sleep(0.01)
    print("autosaved", *ids, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("arch", ["smollm", "lfm2", "qwen35"])
def test_kill_9_with_two_answers_running_leaves_both_restorable(arch, smollm_path, tiny_model_path, tmp_path):
    """Two answers generated together (the Batcher), the process killed: each resumes from
    its last autosave in a new process exactly as the uninterrupted answer goes on (its
    text, and its last logits).  A hybrid's autosaves are written one token short
    (engine.runtime.saves_one_short): the state before their last token, no logits."""
    import numpy as np
    model = smollm_path if arch == "smollm" else tiny_model_path(arch)
    store = tmp_path / "store"
    # the tiny models answer ~10x faster: longer answers, killed at once, still in flight
    n_predict, settle = (400, 0.3) if arch == "smollm" else (900, 0.0)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(store),
                              os.path.dirname(__file__), str(n_predict)], stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().split()
        assert line and line[0] == "autosaved", line
        time.sleep(settle)                     # a few more tokens, maybe another autosave
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    heads = {h.conversation_id: h for h in Graph.scan(Store(store)).heads}
    assert {str(c) for c in heads} == set(line[1:3])
    rt = Runtime(model, ContextSettings(n_ctx=1024, n_threads=2))
    try:
        for i, conv_id in enumerate(sorted(heads, key=lambda c: line.index(str(c)))):
            head = heads[conv_id]
            assert head.header.kind == KIND_AUTOSAVE and not head.header.has_logits
            assert head.header.n_tokens == head.header.n_tokens_total - (arch != "smollm")
            conv = rt.restore_chain(load_chain(head.path))     # verified, restorable
            done = conv.answer.n_generated
            assert done >= 4 and conv.paused
            # it goes on exactly as the uninterrupted answer would have
            conv.answer.n_predict = done + 12
            generate(rt, conv)
            resumed = np.array(rt.logits(), copy=True)
            alone, alone_logits = alone_answer(rt, i, done + 12)
            assert conv.answer.text == alone
            assert np.array_equal(resumed, alone_logits)
            rt.trim(0)
    finally:
        rt.close()


def alone_answer(rt: Runtime, i: int, n: int):
    """Conversation ``i`` of the child answered alone, ``n`` tokens: its text and last logits."""
    import numpy as np

    from engine.conversation import Conversation
    from engine.generation import begin_answer
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(seed=100 + i, temperature=0.8, ignore_eos=True))
    begin_answer(conv, rt, PROMPTS[i], n_predict=n)
    generate(rt, conv)
    return conv.answer.text, np.array(rt.logits(), copy=True)


def test_closing_with_two_answers_running_saves_both_as_exit_checkpoints(smollm_path, tmp_path):
    from engine.checkpoints.format import KIND_EXIT
    w, rec = start_worker(smollm_path, tmp_path / "store")
    a = w.new_conversation(sampler=sampler(0, 0.8))
    b = w.new_conversation(sampler=sampler(1, 0.8))
    w.send(a, PROMPTS[0], n_predict=400)
    w.send(b, PROMPTS[1], n_predict=400)
    deadline = time.monotonic() + 120
    while not (rec.text_of(a) and rec.text_of(b)) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert w.answering == {a, b}
    stop(w)                                        # the window's close: pause all, save, exit
    exits = {e[1].id: e for e in rec.of("saved") if e[3] == KIND_EXIT}
    assert set(exits) == {a, b}
    for conv_id, (_, snap, path, _) in exits.items():
        assert snap.paused
        rt = Runtime(smollm_path, ContextSettings(n_ctx=1024, n_threads=2))
        try:
            conv = rt.restore_chain(load_chain(path))
            assert conv.id == conv_id and conv.answer.n_generated > 0
            assert rt.kv_tokens == conv.tokens       # nothing decoded is lost
        finally:
            rt.close()


def test_a_refused_answer_command_ends_only_its_conversations_answer(smollm_path, tmp_path):
    w, rec = start_worker(smollm_path, tmp_path / "store")
    try:
        a = w.new_conversation(sampler=sampler(0, 0.0))
        b = w.new_conversation(sampler=sampler(1, 0.0))
        w.send(b, PROMPTS[1], n_predict=32)
        w.resume(a)                          # nothing to resume: refused, B goes on
        refused = rec.finished_for(a)
        assert refused.finish_reason == "error" and refused.n_generated == 0
        assert rec.wait("error")[0][1] == "resume"
        assert rec.finished_for(b).n_generated == 32
    finally:
        stop(w)
