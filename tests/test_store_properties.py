"""The store under random compositions of what users do (hypothesis, real SmolLM2).

Each example runs the app's engine thread (engine.worker) on a fresh store through a
random sequence of: answer, autosave (every few tokens), pause, resume, regenerate,
switch conversation (any action on another conversation), prune with a random budget,
delete a conversation, export-delete-import a conversation's files, back a conversation's
files up and import them again later (whatever became of them meanwhile), export a head
(a chain compacted into one file) and import it as a branch, and a CLI child
continuing a conversation killed with SIGKILL mid-answer (faultkit.compositions).
After a clean exit:

* every head restores through its chain and continues byte-identically to the same
  tokens decoded from scratch (SmolLM2's kernels are batch-invariant, so a restored
  cache and a recomputed one give the same logits); a recurrent or hybrid memory's scan
  is not, so where its texts differ, its teacher-forced logits must agree within a
  tolerance far below what a wrong state moves them by;
* no file is unreachable from a head (nothing left behind), none is unreadable;
* every conversation the app still has keeps a head; deleted ones have none; what an
  import brings back is a head at once (before the app opens it).

``CHECKPOINT_CHAT_PROPERTY_EXAMPLES`` raises the number of examples for a soak; the
reliability benchmark (benchmarks/reliability.py) reports the same invariants, counted.
"""

from __future__ import annotations

import os

import pytest
from faultkit.compositions import ACTIONS, BUDGETS, run_sequence
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("CHECKPOINT_CHAT_PROPERTY_EXAMPLES", "10"))


def compositions(max_examples: int):
    """Hypothesis' settings of these tests: ``max_examples`` sequences of actions, the same
    ones every run (derandomized), with no deadline (a model answers in each)."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])

def keeps_every_head(label: str, model, home, actions, checker, **run_args):
    """Perform ``actions`` (faultkit.compositions.run_sequence), say what happened, and
    check the invariants: every head restores as it was, none is lost, nothing is left
    that no head needs.  Returns the driver."""
    driver, outcome = run_sequence(model, home, actions, checker, **run_args)
    print(f"{label + ': ' if label else ''}{len(actions)} actions, {driver.kills} kills, "
          f"{outcome.heads_checked} heads: {actions}")
    assert outcome.problems == []
    assert outcome.heads_lost == []
    assert outcome.orphans == [], "files no head needs were left behind"
    return driver


#: found by the backup and restore actions: see the examples below
BACKUP_OF_AN_OLDER_STATE = [("answer", 0, 6), ("backup", 0, 0), ("kill", 0, 2), ("restore", 0, 0)]

action = st.one_of(*[
    st.tuples(st.just(kind), st.integers(0, 2),
              st.sampled_from(BUDGETS) if kind == "prune" else st.integers(lo, hi))
    for kind, (lo, hi) in ACTIONS.items()])


@pytest.fixture(scope="module")
def checker(smollm_path):
    """A runtime shaped like the worker's (context 1024): every head must fit it."""
    from engine.runtime import Runtime
    from native.context import ContextSettings
    rt = Runtime(smollm_path, ContextSettings(n_ctx=1024, n_threads=2))
    yield rt
    rt.close()


@compositions(EXAMPLES)
@given(actions=st.lists(action, min_size=4, max_size=10))
# found by this test: conversation 1's next turn grew into the cells an Edit (or a Delete)
# of conversation 0 freed below its own, and its logits were not its own (engine.parallel)
@example(actions=[("answer", 0, 24), ("pause", 1, 2), ("edit", 0, 4), ("pause", 1, 5)])
@example(actions=[("answer", 0, 24), ("pause", 1, 2), ("delete", 0, 0), ("pause", 1, 5)])
# found by this test (a soak of 60): a fork cut from conversation 0's head, conversation 0
# deleted and its export imported again: the import found the head still in the store (kept
# for the fork) and the record of the deletion hid it (engine.checkpoints.graph.bring_back)
@example(actions=[("answer", 0, 7), ("fork", 0, 0), ("pause", 2, 2), ("reimport", 0, 0)])
# a backup of a head, a killed run's autosaves on it, the backup imported: the store held
# it as an older state, "already there", and it was no head (engine.checkpoints.transfer)
@example(actions=BACKUP_OF_AN_OLDER_STATE)
def test_every_head_restores_and_nothing_is_left_behind(actions, smollm_path, checker,
                                                        tmp_path_factory):
    keeps_every_head("", smollm_path, tmp_path_factory.mktemp("prop"), actions, checker)


#: found by a soak biased to long conversations: Regenerate and Edit after merged turns
#: (engine.history.LineWriter._merge_below), a killed run, a fork, then a delete
MERGED = [("answer", 0, 4), ("prune", 2, 10**9), ("regenerate", 0, 6), ("answer", 0, 8), ("answer", 0, 5),
          ("answer", 0, 10), ("kill", 0, 2), ("regenerate", 0, 6), ("edit", 0, 4), ("answer", 0, 4),
          ("fork", 0, 1), ("answer", 0, 6), ("delete", 0, 0), ("regenerate", 1, 9)]


def test_a_long_conversation_keeps_every_head_through_its_merges(smollm_path, checker, tmp_path,
                                                                 monkeypatch):
    """The composition above on one conversation of many turns: its heads absorb the turns
    before them (merges) between the Regenerates, Edits (cut from a head), the kill and the
    fork, and every head still restores and nothing is left behind."""
    from engine.history import LineWriter
    merges, absorbed_by_head = [], LineWriter._absorbed_by_head

    def counted(self, idx, conv):
        out = absorbed_by_head(self, idx, conv)
        merges.append(out[0] != idx)
        return out
    monkeypatch.setattr(LineWriter, "_absorbed_by_head", counted)
    driver, outcome = run_sequence(smollm_path, tmp_path, MERGED, checker)
    assert sum(merges) >= 2, "the sequence no longer merges: it tests nothing new"
    assert outcome.problems == [] and outcome.heads_lost == []
    assert outcome.orphans == [], "files no head needs were left behind"


#: about 280 tokens: long enough to be stored once for the conversations of slots 0 and 1
SHARED_SYSTEM = "You answer in one short sentence, plainly, and you never use lists or headings. " * 16


@compositions(max(2, EXAMPLES // 2))
@given(actions=st.lists(action, min_size=4, max_size=8))
def test_conversations_on_a_shared_system_prompt_keep_every_head(actions, smollm_path, checker,
                                                                 tmp_path_factory):
    """The same, two of the conversations on one long system prompt (engine.shared_prefix):
    its prefix file is kept while a head needs it, and goes with the last (no orphan)."""
    keeps_every_head("", smollm_path, tmp_path_factory.mktemp("shared"), actions, checker, system=SHARED_SYSTEM)


#: about 330 tokens at the start of every conversation's first message
DOCUMENT = "Log: " + " ".join(f"crate {i} went to bay {i % 5};" for i in range(40)) + "\n\n"


@compositions(max(2, EXAMPLES // 2))
@given(actions=st.lists(action, min_size=4, max_size=8))
@example(actions=[("answer", 0, 8), ("pause", 1, 3), ("delete", 0, 0), ("resume", 1, 4), ("answer", 2, 6)])
@example(actions=[("pause", 0, 3), ("answer", 1, 6), ("reimport", 0, 0), ("prune", 0, 0), ("delete", 1, 0)])
def test_conversations_on_one_document_keep_every_head(actions, smollm_path, checker, tmp_path_factory):
    """The same, every conversation's first message starting with one document: the later
    ones build on the first's file (a cut delta), which is kept while a head needs it."""
    keeps_every_head("", smollm_path, tmp_path_factory.mktemp("document"), actions, checker, document=DOCUMENT)


@pytest.fixture(scope="module")
def tiny_checkers(tiny_model_path):
    """One checking runtime per tiny model of another memory kind (tests/tinymodels.py)."""
    from engine.runtime import Runtime
    from native.context import ContextSettings
    made = {}

    def checker_for(arch: str):
        if arch not in made:
            made[arch] = Runtime(tiny_model_path(arch), ContextSettings(n_ctx=1024, n_threads=2))
        return made[arch]
    yield checker_for
    for rt in made.values():
        rt.close()


#: the same compositions on a recurrent model and two hybrids (fewer examples each: the
#: invariants are the same, the memory underneath is what differs)
TINY_EXAMPLES = max(1, EXAMPLES // 3)


@pytest.mark.parametrize("arch", ["mamba2", "lfm2", "qwen35"])
@compositions(TINY_EXAMPLES)
@given(actions=st.lists(action, min_size=4, max_size=10))
@example(actions=BACKUP_OF_AN_OLDER_STATE)
def test_every_memory_kind_keeps_every_head(arch, actions, tiny_model_path, tiny_checkers,
                                            tmp_path_factory):
    keeps_every_head(arch, tiny_model_path(arch), tmp_path_factory.mktemp(f"prop-{arch}"), actions,
                     tiny_checkers(arch))


@pytest.mark.parametrize("arch", ["falcon-h1", "mamba2"])
def test_the_check_tells_a_wrong_state_from_a_recompute_on_a_recurrent_memory(arch, tiny_checkers, tmp_path):
    """A recurrent scan's bits depend on its batch shapes, so the check compares a restore
    with a recompute by their teacher-forced logits (faultkit.compositions._forced_drift),
    not only by sampled text: a right head drifts within the tolerance, and a head whose
    file holds another answer's state of the same length (valid in every other way) does not."""
    from faultkit.compositions import FORCED_TOLERANCE, _forced_drift

    from engine.checkpoints.format import KIND_PAUSE, encode_metadata, read_checkpoint, write_sections
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.sampling import SamplerSettings
    rt = tiny_checkers(arch)
    heads = []
    for seed in (1, 2):
        rt.trim(0)
        conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=seed, ignore_eos=True))
        begin_answer(conv, rt, "Count to five.", n_predict=40)
        generate(rt, conv, stop_after=12)
        heads.append(rt.save(tmp_path / f"head{seed}.kvckpt", conv, KIND_PAUSE).path)
    mine, other = (read_checkpoint(p) for p in heads)
    assert list(mine.tokens) != list(other.tokens) and len(mine.state) == len(other.state)
    wrong = tmp_path / "wrong.kvckpt"
    with open(wrong, "wb") as out:
        write_sections(out, mine.header, encode_metadata(mine.meta), mine.tokens, mine.logits, other.state)
    forced = [11, 222, 3333, 444, 55]
    right_drift, wrong_drift = _forced_drift(rt, heads[0], forced), _forced_drift(rt, wrong, forced)
    print(f"{arch}: drift {right_drift:.3g}, another state {wrong_drift:.3g}")
    assert right_drift <= FORCED_TOLERANCE < wrong_drift, (right_drift, wrong_drift)


@pytest.fixture(scope="module")
def thinker_checker(tiny_model_path):
    """A tiny qwen35 carrying Qwen3.5's chat template (a thinking hybrid), and its checker."""
    from pathlib import Path

    from engine.runtime import Runtime
    from native.context import ContextSettings
    template = (Path(__file__).parent / "templates" / "qwen3.5.jinja").read_text(encoding="utf-8")
    model = tiny_model_path("qwen35", chat_template=template)
    rt = Runtime(model, ContextSettings(n_ctx=1024, n_threads=2))
    yield model, rt
    rt.close()


@compositions(TINY_EXAMPLES)
@given(actions=st.lists(action, min_size=4, max_size=10))
def test_a_thinking_hybrid_on_a_long_system_prompt_keeps_every_head(actions, thinker_checker, tmp_path_factory):
    """The same on a thinking hybrid whose template drops past thinking, with a system prompt
    long enough that each prefill autosaves where the user's turn ends (engine.generation
    .mark_wants_file) and restores keep snapshots at such files (engine.restore)."""
    model, checker = thinker_checker
    keeps_every_head("thinker", model, tmp_path_factory.mktemp("prop-thinker"), actions, checker,
                     system=SHARED_SYSTEM)


#: Gemma 3's prefill chunk here: on this CPU build its repacked Q4_K kernels multiply 4
#: rows at a time with other rounding than one row, so a token's bits depend on the batch
#: it was decoded in (docs/determinism.md), and a recompute from scratch is no reference
#: for a restored cache (a generated token was decoded alone, the recompute reads it in a
#: chunk).  Up to 3 rows per decode (the model's exact width, engine.parallel) every
#: decode gives the bits of decoding its tokens one by one: the app, its CLI and the
#: checker then all compute what a recompute does, and a head must continue exactly so.
GEMMA_BATCH = 3
#: per variant; a real 270M model in batches of 3 (about 7 s an example here, unloaded)
GEMMA_EXAMPLES = max(2, EXAMPLES // 4)


@pytest.fixture(scope="module")
def gemma_checker(gemma_path):
    """Gemma 3 270M (a sliding window: engine.snapshots.WindowCover) with prefill chunks of
    GEMMA_BATCH tokens, checked first to be batch-invariant (else the property says nothing)."""
    import numpy as np

    from engine.parallel import ParallelRuntime
    from engine.runtime import Runtime
    from native.context import ContextSettings
    settings = ContextSettings(n_ctx=1024, n_threads=2, n_batch=GEMMA_BATCH, n_ubatch=GEMMA_BATCH)
    # the worker's context must load with these batches: said here, once, rather than by
    # every example's worker (and hypothesis shrinking them all)
    ParallelRuntime(gemma_path, settings, sequences=4).close()
    rt = Runtime(gemma_path, settings)
    try:
        tokens = rt.model.tokenize_prompt("Rivers and hills, roads and towns. " * 4)
        rt.prefill(tokens)
        chunked = np.array(rt.logits(), copy=True)
        rt.trim(0)
        rt.prefill(tokens[:1])
        for token in tokens[1:]:
            rt.decode_token(token)
        assert np.array_equal(rt.logits(), chunked), \
            f"Gemma 3 in chunks of {GEMMA_BATCH} is not batch-invariant on this build"
        rt.trim(0)
        yield rt
    finally:
        rt.close()


@pytest.mark.parametrize("system", ["", SHARED_SYSTEM], ids=["plain", "shared-system"])
@compositions(GEMMA_EXAMPLES)
@given(actions=st.lists(action, min_size=4, max_size=10))
def test_a_sliding_window_keeps_every_head(system, actions, gemma_path, gemma_checker, tmp_path_factory):
    """The same on Gemma 3 (sliding-window layers: a restored file holds only the window
    before its end, and a cut must leave it whole), with batches it is invariant to; also
    with two conversations on a long system prompt, where a sliding window cuts its
    prefill and saves the prefix alone (engine.shared_prefix)."""
    keeps_every_head(f"gemma{' (shared system)' if system else ''}", gemma_path,
                     tmp_path_factory.mktemp("prop-gemma"), actions, gemma_checker, system=system,
                     n_batch=GEMMA_BATCH)


#: two conversations answered, a third started on their document: a shared prefix is stored
DOCUMENT_SHARED = [("answer", 0, 8), ("answer", 1, 6), ("pause", 2, 3), ("delete", 1, 0), ("resume", 2, 4)]


@pytest.mark.parametrize("arch", ["qwen35", "gemma"])
@compositions(TINY_EXAMPLES)
@given(actions=st.lists(action, min_size=4, max_size=8))
@example(actions=DOCUMENT_SHARED)
def test_one_document_on_a_memory_that_cannot_cut_keeps_every_head(arch, actions, tiny_model_path, tiny_checkers,
                                                                    request, tmp_path_factory):
    """Conversations whose first message starts with one document on a hybrid and on a
    sliding window: the second stores the document's prefix once and the later ones build
    on it (engine.prefix_reuse.shareable_end), a shared file kept while a head needs it."""
    if arch == "gemma":
        model, checker, n_batch = request.getfixturevalue("gemma_path"), request.getfixturevalue(
            "gemma_checker"), GEMMA_BATCH
    else:
        model, checker, n_batch = tiny_model_path(arch), tiny_checkers(arch), None
    driver = keeps_every_head(f"{arch} on a document", model, tmp_path_factory.mktemp(f"document-{arch}"),
                              actions, checker, n_batch=n_batch, document=DOCUMENT)
    # (the path under test was taken; Gemma 3's window of 512 still holds all of this short a
    # document, so a new conversation trims another's file instead)
    if actions == DOCUMENT_SHARED and arch != "gemma":
        from engine.checkpoints.graph import Graph, is_shared_line
        assert any(is_shared_line(n.line) for n in Graph.scan(driver.store).nodes.values())
