"""A conversation that starts with another one's document stores only its own cells: a
delta *cut* from the other conversation's file (engine.checkpoints.chain.can_cut; issue 25).

Real model (SmolLM2), real files: the second conversation's first file builds on the first
tokens of the first conversation's file, restores exactly in a new Runtime, and the store
keeps the file it is cut from while it is needed.  The link rule is checked on its own.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from conftest import continue_in_fresh_runtime, run_cli

from engine.checkpoints import graph as store_graph
from engine.checkpoints.chain import LinkFacts, ParentRef, link_problem, load_chain, tokens_digest
from engine.checkpoints.format import KIND_MANUAL, KIND_PAUSE, read_header
from engine.checkpoints.graph import Graph
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import SaveFailed
from engine.generation import begin_answer, generate
from engine.prefix_reuse import reuse_stored_prefix, start_from_stored_prefix
from engine.sampling import SamplerSettings

DOCUMENT = "Here is the log of the harbour office:\n" + " ".join(
    f"ship {i} left pier {i % 7} with {i * 13 % 101} crates;" for i in range(120))
QUESTIONS = ("Which pier did ship 40 leave from?", "How many crates did ship 7 carry?")


def _conversation(question: str) -> Conversation:
    return Conversation(system_prompt="", sampler=SamplerSettings(temperature=0.7, seed=3))


def _ask(rt, store: Store, question: str, *, stop_after: int | None = None, n_predict: int = 16):
    """A new conversation on the document, started as the window starts one in a sequence
    of its own (from the store's longest stored prefix); (conversation, writer)."""
    rt.trim(0)
    conv = _conversation(question)
    begin_answer(conv, rt, DOCUMENT + "\n\n" + question, n_predict=n_predict)
    writer = start_from_stored_prefix(rt, store, conv)
    generate(rt, conv, autosave=writer, autosave_every=8, stop_after=stop_after)
    writer.save_head(conv, KIND_PAUSE if stop_after else KIND_MANUAL)
    writer.close()
    return conv, writer


@pytest.mark.slow
def test_a_second_conversation_on_a_document_stores_only_its_own_cells(smollm_runtime, tmp_path):
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    first, _ = _ask(rt, store, QUESTIONS[0])
    size_first = sum(p.stat().st_size for p in store.files())
    second, writer = _ask(rt, store, QUESTIONS[1])
    chain = load_chain(writer.head.path)
    cut = next(i for i in range(1, len(chain))
               if chain[i].header.parent_n_tokens < chain[i - 1].header.n_tokens)
    assert chain[cut - 1].header.conversation_id == first.id, "the cut is not from the first conversation"
    assert all(d.header.conversation_id == second.id for d in chain[cut:])
    grown = sum(p.stat().st_size for p in store.files()) - size_first
    assert grown < size_first / 5, f"the second conversation wrote {grown} bytes on a {size_first}-byte first"
    g = Graph.scan(store)
    own, shared = g.footprint(g.nodes[writer.head.path.name])
    assert own == grown and shared >= size_first * 0.9


@pytest.mark.slow
def test_a_conversation_cut_from_another_resumes_exactly(smollm_path, smollm_runtime, tmp_path):
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    _ask(rt, store, QUESTIONS[0])
    # the answer uninterrupted, from the same stored beginning
    reference = _conversation(QUESTIONS[1])
    rt.trim(0)
    begin_answer(reference, rt, DOCUMENT + "\n\n" + QUESTIONS[1], n_predict=16)
    assert reuse_stored_prefix(rt, store.folder, reference.tokens).how == "restored"
    whole = generate(rt, reference).text
    conv, writer = _ask(rt, store, QUESTIONS[1], stop_after=6)
    expected_state = np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True)
    chain = load_chain(writer.head.path)
    assert any(chain[i].header.parent_n_tokens < chain[i - 1].header.n_tokens for i in range(1, len(chain)))
    rest = continue_in_fresh_runtime(smollm_path, chain, expected_state)
    assert conv.answer.text + rest == whole
    # switching back to it in a cache that holds the first conversation keeps the document
    rt.trim(0)
    _ask(rt, store, QUESTIONS[0])
    held = len(rt.kv_tokens)
    rt.restore_chain(chain)
    assert np.array_equal(rt.prefix_state(len(rt.kv_tokens)), expected_state)
    assert held > chain[-1].header.n_tokens - 64


@pytest.mark.slow
def test_the_file_cut_from_lives_as_long_as_a_conversation_needs_it(smollm_runtime, tmp_path):
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    first, _ = _ask(rt, store, QUESTIONS[0])
    second, writer = _ask(rt, store, QUESTIONS[1])
    store_graph.prune(store, budget_bytes=0)
    store_graph.delete_conversation(store, first.id)
    g = Graph.scan(store)
    assert [h.conversation_id for h in g.heads] == [second.id]
    rt.trim(0)
    rt.restore_chain(load_chain(writer.head.path))   # still whole
    store_graph.delete_conversation(store, second.id)
    assert store.files() == [], "the last user of the file cut from left it behind"


def test_a_read_error_on_the_file_cut_from_deletes_nothing_a_conversation_needs(smollm_runtime, tmp_path,
                                                                                 monkeypatch):
    """The store checks a cut link by reading the parent's tokens again; while that read
    fails (a network share's hiccup, a lock), the link counts as made: deleting the other
    conversation and pruning keep every file the cut conversation needs."""
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    first, _ = _ask(rt, store, QUESTIONS[0])
    second, writer = _ask(rt, store, QUESTIONS[1])

    def unreadable(path, *args, **kwargs):
        raise OSError(5, "Input/output error", str(path))

    store_graph._CUT_DIGESTS.clear()
    with monkeypatch.context() as m:
        m.setattr(store_graph, "read_tokens", unreadable)
        store_graph.delete_conversation(store, first.id)
        store_graph.prune(store, budget_bytes=0)
        assert [h.conversation_id for h in Graph.scan(store).heads] == [second.id]
    rt.trim(0)
    rt.restore_chain(load_chain(writer.head.path))   # still whole


def test_a_cut_counts_the_files_below_it_towards_the_chain_limit(smollm_runtime, tmp_path):
    """A restore reads every file of a chain: ChainPolicy.max_files bounds it, counting
    the files a cut delta builds on, for the cut and for every save after it."""
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    _ask(rt, store, QUESTIONS[0])
    rt.trim(0)
    conv = _conversation(QUESTIONS[1])
    begin_answer(conv, rt, DOCUMENT + "\n\n" + QUESTIONS[1], n_predict=16)
    writer = start_from_stored_prefix(rt, store, conv)
    writer.policy = replace(writer.policy, max_files=2)
    chains = []   # the chain of every file written, as it is written: (files, holds a cut)

    def written(path):
        chain = load_chain(path)
        chains.append((len(chain), any(d.header.parent_n_tokens < p.header.n_tokens
                                       for p, d in zip(chain, chain[1:], strict=False))))

    def autosave(c):
        info = writer.autosave(c)
        writer.settle()
        written(info.path)
        return info

    generate(rt, conv, autosave=autosave, autosave_every=4)
    head = writer.save_head(conv, KIND_MANUAL)
    writer.close()
    written(head.path)
    assert any(cut for _, cut in chains), f"no cut was made: {chains}"
    assert all(n <= 2 for n, _ in chains), chains
    rt.trim(0)
    rt.restore_chain(load_chain(head.path))


@pytest.mark.slow
def test_the_cli_reuses_a_document_without_a_second_copy(app_home, tmp_path):
    prompt = tmp_path / "prompt.txt"
    sizes = []
    folder = app_home / "data" / "checkpoints"
    for question in QUESTIONS:
        prompt.write_text(DOCUMENT + "\n\n" + question)
        done = run_cli("run", "-f", str(prompt), "-n", "4", "--seed", "1", "--reuse-prefix")
        assert done.returncode == 0, done.stderr
        sizes.append(sum(p.stat().st_size for p in folder.glob("*.kvckpt")))
    assert "reused" in done.stderr
    assert sizes[1] - sizes[0] < sizes[0] / 5, sizes
    heads = [p for p in folder.glob("*.kvckpt") if not p.name.startswith("autosave-")]
    shown = []
    for head in heads:
        checked = run_cli("validate", str(head))
        whole = "Chain OK" in checked.stdout or not read_header(head).is_delta   # (a full file: no chain)
        assert checked.returncode == 0 and whole, checked.stdout + checked.stderr
        shown.append(run_cli("inspect", str(head), check=True).stdout)
    # inspect says where a chain is cut
    assert sum("used)" in out for out in shown) == 1, shown


# -- the link rule --------------------------------------------------------------------------
def _facts(tokens, *, parent=None, start=0, cuttable=True, name="f"):
    tokens = np.asarray(tokens, dtype=np.int32)
    return LinkFacts(name, f"id-{name}", 7, len(tokens), None, tokens_digest(tokens), parent, start,
                     tokens_digest(tokens[:start]) if parent else "", cuttable,
                     lambda k: tokens_digest(tokens[:k]))


def test_the_link_rule_allows_a_cut_only_where_the_memory_can_drop_a_tail():
    parent = _facts(range(100), name="p")
    ref = ParentRef("p", "id-p", 7, 100)
    child_tokens = list(range(60)) + [999] * 20
    assert link_problem(parent, _facts(child_tokens, parent=ref, start=60, name="c")) is None
    assert "plain attention" in link_problem(
        parent, _facts(child_tokens, parent=ref, start=60, cuttable=False, name="c"))
    # its tokens must be the parent's up to the cut
    assert "do not continue" in link_problem(
        parent, _facts([5] + child_tokens[1:], parent=ref, start=60, name="c"))
    # beyond what the parent holds, or a reference to another token count
    assert "holds 100" in link_problem(parent, _facts(list(range(100)) + [1] * 5, parent=ref, start=101, name="c"))
    assert "not the parent" in link_problem(
        parent, _facts(child_tokens, parent=replace(ref, n_tokens=60), start=60, name="c"))
    # a whole-parent delta still links as before
    assert link_problem(parent, _facts(list(range(100)) + [1] * 5, parent=ref, start=100, name="c")) is None


def test_a_save_cut_from_a_file_the_cache_does_not_start_with_is_refused(smollm_runtime, tmp_path):
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    _, writer = _ask(rt, store, QUESTIONS[0])
    parent = writer.head
    other = _conversation(QUESTIONS[1])
    rt.trim(0)
    begin_answer(other, rt, "Something else entirely. " * 40, n_predict=4)
    generate(rt, other)
    from engine.checkpoints.format import read_checkpoint
    from engine.runtime import SaveInfo
    info = SaveInfo.of_file(read_checkpoint(parent.path))
    with pytest.raises(SaveFailed, match="first tokens"):
        rt.save(tmp_path / "x.kvckpt", other, KIND_MANUAL, info, cut=100)


@pytest.mark.slow
def test_export_of_a_cut_conversation_is_one_whole_file_and_an_import_links_it(smollm_runtime, tmp_path):
    from engine.checkpoints.format import read_checkpoint
    from engine.checkpoints.transfer import import_files
    from engine.compaction import compact_into
    rt, store = smollm_runtime, Store(tmp_path / "store")
    _ask(rt, store, QUESTIONS[0])
    _, writer = _ask(rt, store, QUESTIONS[1])
    chain = load_chain(writer.head.path)
    rt.trim(0)
    rt.restore_chain(chain)
    expected = np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True)
    out = compact_into(rt, chain, tmp_path / "export.kvckpt")
    alone = read_checkpoint(out.path)
    assert not alone.header.is_delta and alone.header.n_tokens == chain[-1].header.n_tokens
    rt.trim(0)
    rt.restore(alone)
    assert np.array_equal(rt.prefix_state(len(rt.kv_tokens)), expected)
    # the chain's files imported into another store link up again, the cut included
    other = Store(tmp_path / "other")
    results = import_files([d.path for d in chain], other, rt.target)
    assert all(r.ok for r in results), [r.message for r in results]
    g = Graph.scan(other)
    # (the file it is cut from came along: the first conversation's head, a head there too)
    (head,) = [h for h in g.heads if h.conversation_id == chain[-1].header.conversation_id]
    assert len(g.chain(head)) == len(chain)
    rt.trim(0)
    rt.restore_chain(load_chain(head.path))
    assert np.array_equal(rt.prefix_state(len(rt.kv_tokens)), expected)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["conversation", "checkpoint"])
def test_a_cut_from_a_line_s_tip_keeps_that_conversation_until_it_is_deleted(smollm_runtime, tmp_path, how):
    """A first conversation whose only file is its head (a prompt too short for a prompt
    checkpoint): the next one on its text is cut from that head, which stays the first
    conversation's head (a tip another chain holds only the first tokens of).  Deleting the
    first conversation, or that head alone in the browser (delete_node), keeps the file for
    the second, and the first stays gone from the list; deleting the second then frees it."""
    rt, store = smollm_runtime, Store(tmp_path)
    text = " ".join(f"item {i} costs {i * 3} euros;" for i in range(18))   # ~150 tokens
    convs = []
    for question in QUESTIONS:
        rt.trim(0)
        conv = _conversation(question)
        begin_answer(conv, rt, text + "\n\n" + question, n_predict=8)
        writer = start_from_stored_prefix(rt, store, conv)
        generate(rt, conv, autosave=writer, autosave_every=0)
        writer.save_head(conv, KIND_MANUAL)
        writer.close()
        convs.append(conv.id)
    g = Graph.scan(store)
    assert {h.conversation_id for h in g.heads} == set(convs)
    (second,) = g.heads_of(convs[1])
    first_head = g.chain(second)[0]
    assert first_head.conversation_id == convs[0] and g.is_head(first_head)
    assert second.header.parent_n_tokens < first_head.header.n_tokens   # cut
    if how == "conversation":
        store_graph.delete_conversation(store, convs[0])
    else:
        report = store_graph.delete_node(store, first_head.path)
        assert report.kept == {store_graph.KEPT_CHAIN: [1, first_head.size]} and not report.deleted
    g = Graph.scan(store)
    assert {h.conversation_id for h in g.heads} == {convs[1]}, "the deleted conversation came back"
    assert first_head.path.exists() and store.deleted()
    rt.trim(0)
    assert rt.restore_chain(load_chain(second.path)).id == convs[1]
    if how == "conversation":
        store_graph.delete_conversation(store, convs[1])
    else:
        store_graph.delete_node(store, second.path)
    assert not list(store.folder.glob("*.kvckpt"))
    assert not store.deleted(), "the record outlived the files it is about"


def test_room_is_made_for_the_parent_a_cut_drops_a_tail_of():
    """A cut chain holds its parent whole for a moment (restore._apply): the room a restore
    asks for (restore.peak_tokens) is the most it holds at any point, not the last file's."""
    from types import SimpleNamespace

    from engine.restore import peak_tokens, used_end

    def file(n, start=0):
        return SimpleNamespace(header=SimpleNamespace(n_tokens=n, parent_n_tokens=start))
    chain = [file(300), file(4000, 300), file(3100, 3000)]
    assert peak_tokens(chain) == 4000
    assert peak_tokens(chain, keep=2) == 3100     # the parent is in the cache, trimmed
    assert used_end(chain, 1) == 3000 and used_end(chain, 0) == 300 and used_end(chain, 2) == 3100
    assert peak_tokens([file(300), file(500, 300)]) == 500


@pytest.mark.slow
def test_compacting_a_conversation_cut_from_another_keeps_none_of_the_others_turn_ends(smollm_runtime, tmp_path):
    """A conversation on another's document starts its chain with the other conversation's
    file, of which it holds only the document's tokens: that file's end (the other's turn
    end) is no point of the compacted file, whose tokens differ past the cut
    (engine.compaction.chain_points); the compacted file restores the conversation exactly."""
    from engine.checkpoints.format import read_checkpoint
    from engine.checkpoints.points import points_of
    from engine.compaction import compact_into
    rt, store = smollm_runtime, Store(tmp_path)
    rt.trim(0)
    first, _ = _ask(rt, store, QUESTIONS[0])
    second, writer = _ask(rt, store, QUESTIONS[1], n_predict=64)   # (it ends past the other's end)
    chain = load_chain(writer.head.path)
    cut = next(i for i in range(1, len(chain)) if chain[i].header.parent_n_tokens < chain[i - 1].header.n_tokens)
    other_end = chain[cut - 1].header.n_tokens
    assert chain[cut - 1].header.conversation_id == first.id
    assert chain[-1].header.n_tokens > other_end   # (else no point could lie there anyway)
    expected = np.array(rt.prefix_state(len(rt.kv_tokens)), copy=True)
    compacted = read_checkpoint(compact_into(rt, chain, tmp_path / "compacted.kvckpt").path)
    assert all(p.n_tokens <= chain[cut].header.parent_n_tokens for p in points_of(compacted)), \
        [p.n_tokens for p in points_of(compacted)]
    assert other_end not in [p.n_tokens for p in points_of(compacted)]
    rt.trim(0)
    rt.restore_chain([compacted])
    assert np.array_equal(rt.prefix_state(len(rt.kv_tokens)), expected)
