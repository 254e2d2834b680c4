"""A long system prompt is stored once for recurrent and hybrid models too, and a new
conversation on it reads only its own tokens (engine.shared_prefix; issues 23 and 25).

A recurrent state exists only where it was taken: the prefill is cut where the system
prompt ends (a mark), and the snapshot kept there is the prefix's recurrent part.  Tiny
random-weight models (tests/tinymodels.py) prove exactness by the state's bytes and the
last logits, not by text.
"""

from __future__ import annotations

import json
from pathlib import Path

import memkit
import pytest
from conftest import run_cli
from tinymodels import ARCHS, KIND

from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import KIND_MANUAL, KIND_PAUSE, read_checkpoint
from engine.checkpoints.graph import Graph, is_shared_line
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.generation import begin_answer, generate
from engine.history import LineWriter, saved_infos
from engine.prefix_reuse import reuse_stored_prefix
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from engine.shared_prefix import MIN_TOKENS, system_prompt_end

pytestmark = pytest.mark.slow

RECURRENT = [a for a in ARCHS if KIND[a] != "attention"]
SYSTEM = "You are the careful assistant of a shipping company; answer briefly and politely. " * 20
QUESTIONS = ("Where is my parcel?", "How do I return an item?", "What does express delivery cost?")
TEMPLATES = Path(__file__).parent / "templates"


def _conversation(rt: Runtime, question: str) -> Conversation:
    conv = Conversation(system_prompt=SYSTEM, sampler=SamplerSettings(temperature=0.7, seed=5, ignore_eos=True))
    begin_answer(conv, rt, question, n_predict=12)
    return conv


def _answer(rt: Runtime, store: Path, question: str, *, stop_after: int | None = None) -> LineWriter:
    """One conversation from an empty cache, autosaved every 4 tokens, its head saved."""
    rt.trim(0)
    conv = _conversation(rt, question)
    writer = LineWriter.starting(rt, Store(store), conv.id.hex)
    generate(rt, conv, autosave=writer, autosave_every=4, stop_after=stop_after)
    writer.save_head(conv, KIND_PAUSE if stop_after else KIND_MANUAL)
    writer.close()
    return writer


def _state(rt: Runtime) -> bytes:
    return memkit.state_bytes(rt)


def _shared(store: Path) -> list:
    return [n for n in Graph.scan(store).nodes.values() if is_shared_line(n.line)]


@pytest.mark.parametrize("arch", RECURRENT)
def test_the_system_prompt_is_stored_once_as_the_state_it_had(arch, tiny_model_path, tmp_path):
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        for q in QUESTIONS[:2]:
            _answer(rt, tmp_path, q)
        conv = _conversation(rt, QUESTIONS[0])
        n = system_prompt_end(rt, conv)
        # the prefix holds what a cache of exactly the system prompt holds, byte for byte
        rt.trim(0)
        rt.prefill(conv.tokens[:n])
        expected = _state(rt)
    finally:
        rt.close()
    shared = _shared(tmp_path)
    assert len(shared) == 1, "the system prompt was stored more than once"
    prefix = shared[0]
    assert prefix.header.n_tokens == n >= MIN_TOKENS
    assert bytes(read_checkpoint(prefix.path).state) == expected
    g = Graph.scan(tmp_path)
    assert len(g.heads) == 2
    for head in g.heads:
        assert g.chain(head)[0] is prefix
        assert g.footprint(head)[1] == prefix.size


@pytest.mark.parametrize("arch", RECURRENT)
def test_a_new_conversation_reads_only_its_question_and_resumes_exactly(arch, tiny_model_path, tmp_path):
    """The third conversation starts from the stored prefix (what ``run --reuse-prefix`` and
    the server do), is paused, and its chain (prefix + its own delta) continues in a new
    runtime exactly as an uninterrupted answer from an empty cache does."""
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        _answer(rt, tmp_path, QUESTIONS[0])
        rt.trim(0)
        whole = generate(rt, _conversation(rt, QUESTIONS[2]))
        reference = memkit.fingerprint(rt, whole.text)
    finally:
        rt.close()

    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = _conversation(rt, QUESTIONS[2])
        reuse = reuse_stored_prefix(rt, tmp_path, conv.tokens)
        assert reuse.how == "restored-exact" and reuse.n_tokens >= MIN_TOKENS, reuse.describe()
        writer = LineWriter.starting(rt, Store(tmp_path), conv.id.hex, saved_infos(reuse.chain))
        first = generate(rt, conv, autosave=writer, autosave_every=4, stop_after=6)
        assert first.n_prefilled == conv.answer.n_prompt_tokens - reuse.n_tokens, "the system prompt was read again"
        writer.save_head(conv, KIND_PAUSE)
        writer.close()
    finally:
        rt.close()
    chain = load_chain(writer.head.path)
    assert is_shared_line(chain[0].meta["line"]) and all(d.header.is_delta for d in chain[1:])
    assert len(_shared(tmp_path)) == 1

    rt = Runtime(path, memkit.SETTINGS)
    try:
        resumed = rt.restore_chain(chain)
        rest = generate(rt, resumed)
        assert rest.n_prefilled == 0, "the pause carries its state and logits"
        assert memkit.fingerprint(rt, first.text + rest.text) == reference
    finally:
        rt.close()


def test_a_template_that_renders_no_system_prompt_alone_still_shares_it(tiny_model_path, tmp_path):
    """Qwen3.5's template refuses messages without a user query: the prefix then ends where
    the first user message starts (the system prompt and the user's header)."""
    path = tiny_model_path("qwen35", chat_template=(TEMPLATES / "qwen3.5.jinja").read_text("utf-8"))
    rt = Runtime(path, memkit.SETTINGS)
    try:
        for q in QUESTIONS:
            _answer(rt, tmp_path, q)
        conv = _conversation(rt, QUESTIONS[0])
        n = system_prompt_end(rt, conv)
    finally:
        rt.close()
    assert n >= MIN_TOKENS
    shared = _shared(tmp_path)
    assert [p.header.n_tokens for p in shared] == [n]
    assert all(Graph.scan(tmp_path).chain(h)[0] is shared[0] for h in Graph.scan(tmp_path).heads)


def test_a_system_prompt_below_the_minimum_gets_no_mark(tiny_model_path):
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        long = _conversation(rt, QUESTIONS[0])
        short = Conversation(system_prompt="You are terse.")
        begin_answer(short, rt, QUESTIONS[0])
        rt.prefill(long.tokens)
        end = system_prompt_end(rt, long)
    finally:
        rt.close()
    assert len(long.answer.marks) == len(short.answer.marks) + 1, (long.answer.marks, short.answer.marks)
    assert long.answer.marks[0] == end >= MIN_TOKENS and short.answer.marks[0] < MIN_TOKENS


def test_cli_reuse_prefix_on_a_hybrid_reads_only_the_question(tiny_model_path, app_home):
    store = app_home / "data" / "checkpoints"
    model = str(tiny_model_path("lfm2"))

    def run(*args) -> dict:
        done = run_cli("run", "-m", model, "--system", SYSTEM, "-n", "8", "--temp", "0", "--json", *args,
                       check=True)
        return json.loads(done.stdout)

    def size() -> int:
        return sum(p.stat().st_size for p in store.glob("*.kvckpt"))

    first = run("-p", QUESTIONS[0])
    assert first["n_reused_tokens"] == 0
    one = size()
    second = run("-p", QUESTIONS[1], "--reuse-prefix")
    assert second["n_reused_tokens"] >= MIN_TOKENS
    shared = _shared(store)
    assert len(shared) == 1 and second["n_reused_tokens"] == shared[0].header.n_tokens
    own_first = one - shared[0].size
    assert size() - one < own_first + shared[0].size // 2, "the second conversation stored the prefix again"


@pytest.mark.parametrize("arch", ["llama", "lfm2"])
def test_the_windows_conversations_share_their_system_prompt(arch, tiny_model_path, tmp_path, monkeypatch):
    """Through the window's engine thread, autosaving as it does (each autosave lands on a
    helper thread, and the worker prunes right after): two conversations with one long
    system prompt both build on one stored prefix.  (The prune used to delete the prefix
    before the delta on it had landed, and nothing was shared.)"""
    import os
    import time

    from enginekit import Recorder

    from engine.checkpoints import atomic
    from engine.worker import EngineWorker, ModelOptions

    def slow_fsync(fd: int) -> None:   # a disk slower than the worker's prune after a save
        time.sleep(0.3)
        os.fsync(fd)
    monkeypatch.setattr(atomic, "fsync", slow_fsync)
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path))
    w.start()
    try:
        w.autosave_every = 4
        w.load_model(ModelOptions(tiny_model_path(arch), n_ctx=1024, n_threads=2, sequences=2))
        rec.wait("loaded")
        reused = []
        for i, q in enumerate(QUESTIONS[:2]):
            conv = w.new_conversation(system_prompt=SYSTEM, sampler=SamplerSettings(seed=i, ignore_eos=True))
            w.send(conv, q, n_predict=12)
            reused.append(rec.finished_for(conv).n_reused_tokens)
    finally:
        w.shutdown()
        assert w.join(60)
    shared = _shared(tmp_path)
    assert len(shared) == 1, f"{len(shared)} stored prefixes"
    # the second conversation started from what the store holds (a hybrid: the shared prefix;
    # attention: the first conversation's files, trimmed after the user's header)
    assert reused[0] == 0 and reused[1] >= shared[0].header.n_tokens
    g = Graph.scan(tmp_path)
    assert len(g.heads) == 2 and all(g.chain(h)[0] is shared[0] for h in g.heads)
