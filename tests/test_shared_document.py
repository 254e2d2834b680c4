"""A document sent again with another question is stored once and read once, for every
memory kind (issue 25 point 1: "document chats send the same long document with every
conversation").

A plain attention memory builds a new conversation's first file on the first tokens of
another's (a cut: test_cut_delta.py).  A recurrent state exists only where it was taken,
and a sliding window's file holds only the window before its end, so for those memories
nothing was shared: every conversation on the document read it in full and stored it
again.  Now the second conversation's prefill is cut where its prompt parts from the
stored one (Answer.shared_end), its first save stores that prefix once
(engine.shared_prefix), and every conversation after it reads only its own question.
Tiny random-weight models (tests/tinymodels.py) and Gemma 3; exactness by the text of a
paused and resumed answer against the same answer uninterrupted (greedy and sampled).
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import run_cli
from tinymodels import ARCHS, KIND

from engine.checkpoints.graph import Graph, is_shared_line
from engine.conversation import Answer
from engine.shared_prefix import MIN_TOKENS

pytestmark = pytest.mark.slow

_rng = random.Random(7)
DOCUMENT = " ".join(_rng.choice("apple river stone cloud lantern market violin harbor meadow signal".split())
                    for _ in range(700))


def _prompt(question: str) -> str:
    return f"Read this document:\n{DOCUMENT}\n\nQuestion: {question}"


@pytest.mark.parametrize("arch", [*(a for a in ARCHS if KIND[a] != "attention"), "gemma"])
def test_a_document_is_read_and_stored_once_for_every_memory(arch, tiny_model_path, gemma_path, app_home, tmp_path):
    model = str(gemma_path if arch == "gemma" else tiny_model_path(arch))
    store = app_home / "data" / "checkpoints"
    common = ["-m", model, "-c", "2048", "-n", "8", "--seed", "3", "--temp", "0.8", "--ignore-eos",
              "--reuse-prefix", "--json"]

    def run(question: str, *args: str) -> dict:
        (tmp_path / "p.txt").write_text(_prompt(question), encoding="utf-8")
        done = run_cli("run", *common, "-f", str(tmp_path / "p.txt"), *args, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    def size() -> int:
        return sum(p.stat().st_size for p in store.glob("*.kvckpt"))

    first = run("What fruit is named?")
    alone = size()
    second = run("What place is named?")   # parts from the first inside the question's first words
    assert second["n_reused_tokens"] == 0
    shared = [n for n in Graph.scan(store).nodes.values() if is_shared_line(n.line)]
    assert len(shared) == 1, "the second conversation did not store the document once"
    n_shared = shared[0].header.n_tokens
    assert MIN_TOKENS <= n_shared < second["n_prompt_tokens"]
    before = size()
    third = run("How many stones are there?", "--stop-after", "3")
    assert third["n_reused_tokens"] == n_shared, "the third conversation read the document again"
    if KIND.get(arch) != "recurrent":   # (a recurrent state is whole in every file: no cells to share)
        own = before - alone - shared[0].size   # what the second stored besides the prefix
        assert size() - before < own + shared[0].size / 2, "the third conversation stored the document again"
    rest = run_cli("run", "--checkpoint-load", third["checkpoint"], "--json", check=True)
    resumed = third["text"] + json.loads(rest.stdout.strip().splitlines()[-1])["text"]
    # the same question uninterrupted, from the same stored prefix: the same text
    again = run("How many stones are there?")
    assert again["n_reused_tokens"] >= n_shared and again["text"] == resumed
    assert first["n_reused_tokens"] == 0


def test_the_shared_end_is_kept_with_the_answer():
    """A prefill paused before the shared prefix's end resumes in a new process with the
    same cut (Answer.shared_end travels in the metadata; an untrusted value is dropped)."""
    answer = Answer(n_prompt_tokens=900, marks=(12, 880), shared_end=700)
    again = Answer.from_json(json.loads(json.dumps(answer.to_json())))
    assert again.shared_end == 700 and again.cuts == (12, 700, 880)
    for bad in (900, 0, -3, "700", 700.0, True):
        assert Answer.from_json({**answer.to_json(), "shared_end": bad}).shared_end == 0
    assert Answer(n_prompt_tokens=9, marks=(3,)).cuts == (3,)


@pytest.mark.parametrize("arch", ["qwen35", "gemma"])
def test_the_windows_conversations_on_one_document_share_it(arch, tiny_model_path, gemma_path, tmp_path):
    """Through the window's engine thread (several conversations in one context, prefills
    batched, autosaves landing on a helper thread): the third conversation on a document
    reads only its question, from the prefix the second one stored."""
    from enginekit import Recorder

    from engine.checkpoints.store import Store
    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions

    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path))
    w.start()
    try:
        w.autosave_every = 4
        model = gemma_path if arch == "gemma" else tiny_model_path(arch)
        w.load_model(ModelOptions(model, n_ctx=2048, n_threads=2, sequences=2))
        rec.wait("loaded")
        done = []
        for i, q in enumerate(("What fruit is named?", "What place is named?", "How many stones are there?")):
            conv = w.new_conversation(sampler=SamplerSettings(seed=i, ignore_eos=True))
            w.send(conv, _prompt(q), n_predict=6)
            done.append(rec.finished_for(conv))
    finally:
        w.shutdown()
        assert w.join(60)
    shared = [n for n in Graph.scan(tmp_path).nodes.values() if is_shared_line(n.line)]
    assert len(shared) == 1, f"{len(shared)} stored prefixes"
    assert [d.n_reused_tokens for d in done[:2]] == [0, 0]
    assert done[2].n_reused_tokens >= shared[0].header.n_tokens >= MIN_TOKENS
