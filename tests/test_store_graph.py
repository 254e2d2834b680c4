"""The store as a graph (engine.checkpoints.graph): heads, chains, and what may be deleted.

Synthetic files (faultkit.synthetic: the real writer, well-formed states) make the
shapes; the compositions with the real model are in test_store_cases.py and
test_store_properties.py.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from types import SimpleNamespace

import pytest
from conftest import run_cli
from faultkit import synthetic

from engine.checkpoints import graph, transfer
from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_MANUAL, KIND_PAUSE
from engine.checkpoints.graph import Graph
from engine.checkpoints.store import Store
from engine.errors import CheckpointError

A, M, P = KIND_AUTOSAVE, KIND_MANUAL, KIND_PAUSE


def _chain(store: Store, conv, lengths, *, kind_last=A, line=None, first_parent=None):
    """A base (or a delta on ``first_parent``) and deltas of the given token counts."""
    store.ensure()
    out, parent = [], first_parent
    for i, n in enumerate(lengths):
        kind = kind_last if i == len(lengths) - 1 else A
        path = store.new_autosave_path(conv) if kind == A else store.new_path(f"head {n}")
        parent = synthetic.write_node(path, conv, n, parent=parent, kind=kind, line=line)
        out.append(parent)
        time.sleep(0.001)
    return out


def test_heads_are_the_newest_whole_chain_of_each_line(tmp_path):
    store = Store(tmp_path / "store")
    a, b = uuid.uuid4(), uuid.uuid4()
    a_chain = _chain(store, a, [40, 48, 56], kind_last=P)
    b_old = _chain(store, b, [30, 38])
    b_new = _chain(store, b, [70])                 # a compaction: a new chain on b's line
    branch = _chain(store, b, [44], line="branch-1", first_parent=b_old[1])
    g = Graph.scan(store)
    assert [h.path for h in g.heads] == [branch[0].path, b_new[0].path, a_chain[-1].path]
    head_a = g.nodes[a_chain[-1].path.name]
    assert [n.path for n in g.chain(head_a)] == [w.path for w in a_chain]
    assert g.chain_size(head_a) == sum(w.path.stat().st_size for w in a_chain)
    assert g.is_head(head_a) and not g.is_head(g.nodes[a_chain[0].path.name])
    # b's old chain is superseded on its own line, but the branch still needs both files
    assert g.reachable(g.nodes[b_old[0].path.name]) and g.superseded() == []
    assert [h.line for h in g.heads_of(b)] == ["branch-1", b.hex]


def test_a_newest_file_with_a_missing_parent_is_kept_but_not_the_head(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    base, middle, last = _chain(store, conv, [40, 48, 56])
    middle.path.unlink()                          # as the first round's pruner did
    g = Graph.scan(store)
    (head,) = g.heads
    assert head.path == base.path
    assert "missing" in g.chain_problem(g.nodes[last.path.name])
    report = graph.prune(store, 0)
    assert report.deleted == [] and last.path.exists()
    assert report.kept[graph.KEPT_NEWER][0] == 1


def test_prune_never_deletes_a_live_chain_and_spends_the_budget_on_superseded_chains(tmp_path):
    """Issue case 1 in miniature: a store over budget keeps every file a head needs."""
    store = Store(tmp_path / "store")
    live = _chain(store, uuid.uuid4(), [400, 416, 432, 448])       # an answer being autosaved
    other = uuid.uuid4()
    old = _chain(store, other, [100, 116])                         # superseded by a compaction
    newer = _chain(store, other, [132])
    report = graph.prune(store, budget_bytes=1)
    assert sorted(report.deleted) == sorted(w.path for w in old)   # the whole old chain
    assert all(w.path.exists() for w in live + newer)
    assert report.kept[graph.KEPT_CHAIN][0] == 3 and report.kept[graph.KEPT_HEAD][0] == 2
    for w in live:   # the live chain still restores in full, every file linked
        assert len(load_chain(w.path)) == live.index(w) + 1


def test_retire_deletes_what_a_new_head_supersedes_after_it_is_written(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    first = _chain(store, conv, [40, 48, 56])
    trimmed = _chain(store, conv, [52], first_parent=first[0])     # a Regenerate cut the tail
    report = graph.retire(store, conv.hex)
    assert sorted(report.deleted) == sorted([first[1].path, first[2].path])
    assert first[0].path.exists() and trimmed[0].path.exists()
    assert graph.retire(store, conv.hex).deleted == []


def test_a_damaged_head_is_set_aside_before_anything_is_retired(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    old = _chain(store, conv, [40])
    new = _chain(store, conv, [80])
    data = bytearray(new[0].path.read_bytes())
    data[-100] ^= 1
    new[0].path.write_bytes(bytes(data))
    assert graph.retire(store, conv.hex).deleted == []
    assert old[0].path.exists()


def test_delete_conversation_deletes_every_line_of_it_and_nothing_else(tmp_path):
    store = Store(tmp_path / "store")
    c, d = uuid.uuid4(), uuid.uuid4()
    c_files = _chain(store, c, [40, 48])
    stray = _chain(store, c, [20], line="old")                      # another line of c
    branch = _chain(store, c, [60], line="branch", first_parent=c_files[0])
    d_files = _chain(store, d, [30, 38])
    report = graph.delete_conversation(store, c)
    assert sorted(report.deleted) == sorted(w.path for w in c_files + stray + branch)
    assert all(w.path.exists() for w in d_files)
    assert [h.conversation_id for h in Graph.scan(store).heads] == [d]


@pytest.mark.parametrize("how", ["conversation", "node"])
def test_deleting_never_brings_a_deleted_conversation_back(tmp_path, how):
    """Found by a random-composition soak on a hybrid: conversation B continued A's file
    whole (A's document prefix, no cut); deleting A kept that file for B; deleting B left
    it in no chain, and A came back as an autosave head.  Whatever a deleted
    conversation kept alive goes when nothing needs it any more."""
    store = Store(tmp_path / "store")
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    a_files = _chain(store, a, [447, 460], kind_last=M)
    b_files = _chain(store, b, [470, 480], kind_last=M, first_parent=a_files[0])
    c_files = _chain(store, c, [30], kind_last=M)
    graph.delete_conversation(store, a)
    assert a_files[0].path.exists()                                 # B needs it
    assert sorted(h.conversation_id for h in Graph.scan(store).heads) == sorted([b, c])
    if how == "conversation":
        report = graph.delete_conversation(store, b)
    else:
        report = graph.delete_node(store, b_files[-1].path)
    assert sorted(report.deleted) == sorted(w.path for w in [a_files[0], *b_files])
    assert [h.conversation_id for h in Graph.scan(store).heads] == [c]
    assert all(w.path.exists() for w in c_files)
    assert not store.deleted()                           # nothing of a or b is left


@pytest.mark.parametrize("how", ["conversation", "node"])
def test_an_import_brings_back_what_it_imports_of_a_deleted_conversation(tmp_path, how):
    """Found by the composition soak (a fork cut from a conversation's head, that conversation
    deleted, its exported head imported again): the head stayed in the store for the fork's
    sake, so the import found it there, and the record of the deletion went on hiding it:
    the conversation just imported had no head, and was gone after a restart.  An import
    brings back what it imports, and only that: another branch of it the store kept for
    another conversation stays deleted."""
    import shutil
    store = Store(tmp_path / "store")
    a, b, c = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    branch_1 = _chain(store, a, [100], kind_last=M)[0]
    branch_2 = _chain(store, a, [90], kind_last=M, line="branch-2")[0]
    synthetic.write_node(store.new_path("b"), b, 120, parent=branch_1, cut_at=80, kind=M)
    synthetic.write_node(store.new_path("c"), c, 110, parent=branch_2, cut_at=60, kind=M)
    assert sorted(h.conversation_id for h in Graph.scan(store).heads) == sorted([a, a, b, c])
    exported = tmp_path / "exported"
    exported.mkdir()
    shutil.copy2(branch_1.path, exported / branch_1.path.name)
    if how == "conversation":
        graph.delete_conversation(store, a)
    else:
        graph.delete_node(store, branch_1.path)
        graph.delete_node(store, branch_2.path)
    assert branch_1.path.exists() and branch_2.path.exists()       # b and c need them
    assert sorted(h.conversation_id for h in Graph.scan(store).heads) == sorted([b, c])
    (result,) = transfer.import_files([exported / branch_1.path.name], store)
    assert result.ok and result.already and result.imported == branch_1.path
    g = Graph.scan(store)
    assert branch_1.path in [h.path for h in g.heads_of(a)], "the import did not bring it back"
    assert [h.path for h in g.heads_of(a)] == [branch_1.path], "the import brought back more than itself"
    assert sorted(h.conversation_id for h in g.heads) == sorted([a, b, c])
    # and it stays: deleting the conversations it was kept for keeps it, and the other
    # branch, in no chain now, goes with them
    graph.delete_conversation(store, b)
    graph.delete_conversation(store, c)
    assert [h.path for h in Graph.scan(store).heads] == [branch_1.path]
    assert not branch_2.path.exists()


@pytest.mark.parametrize("case", ["kept for a fork", "an older state", "held whole"])
def test_an_import_of_a_file_the_store_holds_as_no_head_makes_it_one(tmp_path, case):
    """A backed-up file imported again may be in the store still, but as no head: an older
    state of its conversation (found by the composition test: a backup, a killed run's
    autosaves on it, the backup imported), a file kept only for a fork's sake after its
    conversation was deleted, or a tip another line builds on whole.  The import said
    "already in the store", yet nothing listed it, and deleting the conversation that held
    it deleted it.  Now it gets a head: a delta of metadata only on it, on a line of its own."""
    import shutil
    store = Store(tmp_path / "store")
    a, b = uuid.uuid4(), uuid.uuid4()
    older, newer = _chain(store, a, [80, 100], kind_last=M)
    if case == "held whole":
        newer = synthetic.write_node(store.new_path("b"), b, 120, parent=older, kind=M)
    else:
        synthetic.write_node(store.new_path("b"), b, 120, parent=newer, cut_at=90, kind=M)
    backup = tmp_path / "backup"
    backup.mkdir()
    shutil.copy2(older.path, backup / older.path.name)
    if case == "kept for a fork":
        graph.delete_conversation(store, a)
        assert older.path.exists() and newer.path.exists()   # b's chain needs them
    heads_before = {h.name for h in Graph.scan(store).heads}
    assert older.path.name not in heads_before
    (result,) = transfer.import_files([backup / older.path.name], store)
    assert result.ok and result.already and result.imported == older.path
    assert result.head is not None and "listed again as" in result.message()
    g = Graph.scan(store)
    head = g.nodes[result.head.name]
    assert g.is_head(head) and head.conversation_id == a
    assert [n.path for n in g.chain(head)] == [older.path, result.head]
    assert head.tokens_digest == g.nodes[older.path.name].tokens_digest
    assert head.header.parent_n_tokens == head.header.n_tokens == 80   # no cells of its own
    assert {h.name for h in g.heads} == heads_before | {result.head.name}   # nothing else changed
    loaded = load_chain(result.head)
    assert list(loaded[-1].tokens) == list(loaded[0].tokens) and len(loaded[-1].state) == 0
    # it stays while the user keeps it: the fork deleted, it is still there (and a's
    # deleted head the fork was cut from goes with the fork)
    graph.delete_conversation(store, b)
    assert older.path.exists() and result.head.exists()
    assert newer.path.exists() == (case == "an older state")
    # imported again: its head is there, so nothing more is written
    (again,) = transfer.import_files([backup / older.path.name], store)
    assert again.ok and again.already and again.head == result.head
    assert {h.name for h in Graph.scan(store).heads} == {h.name for h in g.heads if h.path.exists()}


def test_an_import_of_files_that_are_heads_writes_no_head(tmp_path):
    """A chain imported again whose tip is a head already, and the same chain into an empty
    store (copies, on a line of their own): no file but the copies is written, and only the
    tip of what was given is a head (its parents are no heads of their own)."""
    import shutil
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    chain = _chain(store, conv, [40, 48, 56], kind_last=P)
    backup = tmp_path / "backup"
    backup.mkdir()
    for w in chain:
        shutil.copy2(w.path, backup / w.path.name)
    files = sorted(backup.iterdir())
    before = sorted(p.name for p in store.files())
    results = transfer.import_files(files, store)
    assert all(r.ok and r.already and r.head is None for r in results)
    assert sorted(p.name for p in store.files()) == before
    # what the window's resume offer says: nothing new (it once said "Imported 3")
    assert transfer.import_summary(results) == "The store already holds these 3 checkpoints."
    other = Store(tmp_path / "other")
    results = transfer.import_files(files, other)
    assert all(r.ok and not r.already and r.head is None for r in results)
    assert [h.name for h in Graph.scan(other).heads] == [chain[-1].path.name]
    assert transfer.import_summary(results) == "Imported 3 checkpoints into the store."
    # the tip given twice and its parent new: counted once each
    third = Store(tmp_path / "third")
    base, tip = backup / chain[0].path.name, backup / chain[-1].path.name
    transfer.import_files([base], third)
    results = transfer.import_files([*files, tip], third)
    assert transfer.import_summary(results) == "Imported 2 checkpoints into the store; 1 more was there already."


def test_a_conversation_without_a_head_is_not_taken_for_a_deleted_one(tmp_path):
    """A store written before a fork stopped building on the original's newest file whole
    (or an import linking to a live tip) holds a live conversation whose head is in another
    conversation's chain, so it has no head: deleting that other conversation must give it
    its head back, not delete it (a review of the fix above found this)."""
    store = Store(tmp_path / "store")
    a, b = uuid.uuid4(), uuid.uuid4()
    a_files = _chain(store, a, [100, 140], kind_last=M)
    b_files = _chain(store, b, [150], kind_last=M, first_parent=a_files[-1])
    assert [h.conversation_id for h in Graph.scan(store).heads] == [b]
    report = graph.delete_conversation(store, b)
    assert report.deleted == [b_files[0].path]
    assert [h.path for h in Graph.scan(store).heads] == [a_files[-1].path]


def test_a_file_that_cannot_go_keeps_the_files_it_needs(tmp_path, monkeypatch):
    """Windows: a reader holds the head open; its chain must not be cut under it."""
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    chain = _chain(store, conv, [40, 48, 56], kind_last=P)
    real_unlink = type(chain[0].path).unlink

    def unlink(self, *args, **kwargs):
        if self.name == chain[-1].path.name:
            raise PermissionError(13, "in use")
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(type(chain[0].path), "unlink", unlink)
    report = graph.delete_conversation(store, conv)
    assert report.deleted == [] and all(w.path.exists() for w in chain)
    assert report.kept[graph.KEPT_IN_USE][0] == 3
    monkeypatch.undo()
    assert len(load_chain(chain[-1].path)) == 3   # still whole


def test_the_sequence_orders_a_line_not_the_clock(tmp_path):
    """A clock that steps back (or one tick for two saves) never makes a new head look old."""
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    store.ensure()
    late = synthetic.write_node(store.new_autosave_path(conv), conv, 40, created_ns=2_000_000_000_000_000_000)
    early = synthetic.write_node(store.new_path("pause"), conv, 80, kind=P,
                                 created_ns=1_000_000_000_000_000_000, seq=2)
    _ = late
    g = Graph.scan(store)
    assert [h.path for h in g.heads] == [early.path]
    report = graph.retire(store, conv.hex)
    assert report.deleted == [late.path] and early.path.exists()


def test_delete_node_follows_the_graph(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    chain = _chain(store, conv, [40, 48, 56], kind_last=P)
    with pytest.raises(CheckpointError, match="part of the chain"):
        graph.delete_node(store, chain[1].path)
    report = graph.delete_node(store, chain[-1].path)
    assert sorted(report.deleted) == sorted(w.path for w in chain)
    assert store.files() == []


def test_import_links_files_dropped_together_and_refuses_an_orphan(tmp_path):
    """Issue case 5: a delta alone is refused with the reason; with its parents it links."""
    outside = Store(tmp_path / "elsewhere")
    conv = uuid.uuid4()
    base, middle, last = _chain(outside, conv, [40, 48, 56], kind_last=P)
    store = Store(tmp_path / "store")
    (alone,) = transfer.import_files([last.path], store)
    assert alone.status == transfer.MISSING_PARENT and alone.imported is None
    assert middle.path.name in alone.reason and alone.chain_folder == outside.folder
    assert store.files() == []
    # "Import its chain" brings the chain files from that folder, in any order
    results = transfer.import_files(list(reversed(transfer.chain_paths(last.path))), store)
    assert all(r.ok and r.imported is not None for r in results)
    (head,) = Graph.scan(store).heads
    assert head.name == last.path.name and len(load_chain(head.path)) == 3
    # the same files again, and one twice in one drop: nothing is copied twice
    again = transfer.import_files([last.path, last.path, base.path], store)
    assert [r.already for r in again] == [True, True, True]
    assert len(store.files()) == 3


def test_import_relinks_a_delta_whose_parent_had_to_take_another_name(tmp_path):
    outside = Store(tmp_path / "elsewhere")
    conv = uuid.uuid4()
    base, last = _chain(outside, conv, [40, 48])
    store = Store(tmp_path / "store")
    store.ensure()
    (store.folder / base.path.name).write_bytes(synthetic.file_bytes())   # the name is taken
    results = transfer.import_files([base.path, last.path], store)
    assert all(r.ok for r in results)
    new_base, new_last = (r.imported for r in results)
    assert new_base.name != base.path.name and new_last.name == last.path.name
    chain = load_chain(new_last)                 # linked by the rewritten reference
    assert [d.path for d in chain] == [new_base, new_last]
    assert chain[-1].meta["origin_crc"] == last.payload_crc
    # the untouched original is still recognised as already imported
    assert transfer.import_files([last.path], store)[0].already


def test_list_and_inspect_show_the_graph(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    chain = _chain(store, conv, [40, 48, 56], kind_last=P)
    listing = json.loads(run_cli("list", "--dir", str(store.folder), "--json", check=True).stdout)
    by_name = {e["path"].rsplit("/", 1)[-1]: e for e in listing}
    head = by_name[chain[-1].path.name]
    assert head["head"] is True and head["parent"] == chain[1].path.name
    assert head["conversation"] == str(conv) and head["id"] == chain[-1].checkpoint_id
    assert by_name[chain[0].path.name]["parent"] is None and not by_name[chain[0].path.name]["head"]
    text = run_cli("list", "--dir", str(store.folder), check=True).stdout
    assert "(3 files," in text and text.count("└") == 2
    shown = run_cli("inspect", str(chain[-1].path), check=True).stdout
    assert "head of its line" in shown and all(w.path.name in shown for w in chain)


def test_list_of_a_folder_that_is_not_there_says_so(tmp_path):
    """``list --dir`` of a mistyped folder said "no checkpoints", status 0 (a user's test)."""
    (tmp_path / "file").write_text("x")
    for folder, said in ((tmp_path / "nowhere", "no such folder"), (tmp_path / "file", "is not a folder")):
        done = run_cli("list", "--dir", str(folder))
        assert done.returncode == 1 and said in done.stderr and "Traceback" not in done.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("list", "--dir", str(empty), check=True).stdout.strip() == "no checkpoints"
    # and inspect's tree is text: asked for JSON too, it says so (it printed text)
    done = run_cli("inspect", str(tmp_path / "file"), "--tree", "--json")
    assert done.returncode == 1 and "not allowed with" in done.stderr


def test_list_shows_files_no_head_needs_apart_from_the_last_heads_chain(tmp_path):
    """A delta whose parent is gone was printed right after the last head's chain, and
    read as one of its files (a user's test): it goes under a line of its own."""
    store = Store(tmp_path / "store")
    kept = _chain(store, uuid.uuid4(), [40, 48], kind_last=P)
    orphan = _chain(store, uuid.uuid4(), [30, 38])
    orphan[0].path.unlink()
    lines = run_cli("list", "--dir", str(store.folder), check=True).stdout.splitlines()
    apart = lines.index("in no head's chain:")
    assert any(kept[-1].path.name in line for line in lines[:apart])
    assert any(orphan[1].path.name in line for line in lines[apart + 1:])
    assert not any(orphan[1].path.name in line for line in lines[:apart])


def test_tree_names_a_branch_that_cannot_be_restored(tmp_path):
    """``inspect --tree`` showed only restorable branches: a branch whose parent is gone
    vanished without a word (a user's test).  It is named, with why."""
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    older = _chain(store, conv, [20, 24])     # on the head's line, older than it: superseded
    kept = _chain(store, conv, [40, 48], kind_last=P)
    lost = _chain(store, conv, [30, 38], kind_last=P, line="branch-1")
    older[0].path.unlink()
    lost[0].path.unlink()
    out = run_cli("inspect", str(kept[-1].path), "--tree", check=True).stdout
    assert "1 branch(es)" in out and kept[-1].path.name in out
    said = [line for line in out.splitlines() if line.startswith("cannot be restored:")]
    assert len(said) == 1 and lost[1].path.name in said[0] and lost[0].path.name in said[0], out


def test_compact_refuses_to_write_over_a_parent(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    base, last = _chain(store, conv, [40, 48])
    done = run_cli("compact", str(last.path), "-o", str(base.path))
    assert done.returncode == 1 and "parent of 1 delta" in done.stderr and "Traceback" not in done.stderr
    assert len(load_chain(last.path)) == 2          # untouched


def test_run_refuses_to_save_over_a_parent_before_loading_the_model(tmp_path):
    """``run --checkpoint-save`` named the root of a chain: the file was replaced and every
    delta on it broken (found by a user's test).  It is refused as ``compact -o`` refuses
    it, before a token is generated; the chain stays whole."""
    store = Store(tmp_path / "store")
    base, last = _chain(store, uuid.uuid4(), [40, 48])
    before = base.path.read_bytes()
    done = run_cli("run", "-m", str(tmp_path / "no-model.gguf"), "-p", "Hi", "--checkpoint-save", str(base.path))
    assert done.returncode == 1 and "parent of 1 delta" in done.stderr and "Traceback" not in done.stderr
    assert base.path.read_bytes() == before and len(load_chain(last.path)) == 2


@pytest.mark.parametrize("kind", ["symlink", "fifo", "folder"])
def test_a_name_that_is_no_regular_file_is_not_written_over(tmp_path, kind):
    """A file is written beside its name and renamed over it: a link, a pipe or a folder
    there (a device, ``--checkpoint-save /dev/full`` run as root, was replaced by a
    regular file in a user's test) is refused with what it is."""
    if kind != "folder" and not hasattr(os, "mkfifo"):
        pytest.skip("Windows: no pipes in a folder, and links need a privilege")
    target, other = tmp_path / "out.kvckpt", tmp_path / "real.kvckpt"
    other.write_bytes(b"x")
    {"symlink": lambda: target.symlink_to(other), "fifo": lambda: os.mkfifo(target),
     "folder": lambda: target.mkdir()}[kind]()
    problem = graph.overwrite_problem(target)
    assert problem is not None and {"symlink": "a link", "fifo": "device, a pipe",
                                    "folder": "a folder"}[kind] in problem
    assert graph.overwrite_problem(other) is None and graph.overwrite_problem(tmp_path / "new.kvckpt") is None


def test_a_named_file_that_became_a_parent_during_the_run_is_saved_beside(tmp_path, monkeypatch):
    """Checked before the run, the named file may still become another chain's parent
    before the answer stops (another run builds on it): the head then goes to a fresh name
    beside it, and nothing is written over."""
    from engine.checkpoint_policy import Checkpoints
    store = Store(tmp_path / "store")
    base, last = _chain(store, uuid.uuid4(), [40, 48])
    before = base.path.read_bytes()
    written = []

    class Saving:   # the runtime's save, recorded (the format's own writer is tested elsewhere)
        def save(self, path, conv, kind):
            written.append(path)
            return SimpleNamespace(path=path)

    checkpoints = Checkpoints(Saving(), named=base.path)
    assert checkpoints.save_head(object(), KIND_MANUAL).path == written[0]
    assert written[0] != base.path and written[0].parent == base.path.parent
    assert written[0].name.startswith(base.path.stem + "-") and written[0].suffix == ".kvckpt"
    assert base.path.read_bytes() == before and len(load_chain(last.path)) == 2
    fresh = tmp_path / "fresh.kvckpt"
    assert Checkpoints(Saving(), named=fresh).save_head(object(), KIND_MANUAL).path == fresh
    # a folder that cannot be listed: whether a delta builds on the file cannot be told, so
    # the head goes beside it rather than be lost
    monkeypatch.setattr(graph.Graph, "scan", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied")))
    unlisted = Checkpoints(Saving(), named=last.path).save_head(object(), KIND_MANUAL).path
    assert unlisted != last.path and unlisted.parent == last.path.parent


def test_a_line_whose_base_holds_no_tokens_puts_its_next_delta_on_its_newest_file(tmp_path):
    """The parent of the next save: the newest file the cache starts with, or the last
    milestone when autosaves pile up; a base of 0 tokens (no milestone to fold onto) is
    no error, and the choice digests the cache once, not once per file."""
    from types import SimpleNamespace

    from engine.checkpoints.chain import tokens_digest
    from engine.history import ChainPolicy, LineWriter
    from engine.runtime import SaveInfo
    kv = list(range(100))
    runtime = SimpleNamespace(kv_tokens=kv, settings=SimpleNamespace(supports_deltas=True),
                              shape=SimpleNamespace(has_recurrent=False))

    def info(n, kind, name, parent_n=None):   # an autosave: a delta on the file before it
        return SaveInfo(tmp_path / name, 1, 0.0, n, checkpoint_id=name, tokens_digest=tokens_digest(kv[:n]),
                        kind=kind, delta=parent_n is not None, parent_n_tokens=parent_n or 0)
    chain = [info(0, KIND_MANUAL, "base")] + [info(10 * k, KIND_AUTOSAVE, f"a{k}", 10 * k - 10) for k in range(1, 5)]

    def writer_of(chain, max_tail=2):   # as if it had written the chain's autosaves itself
        writer = LineWriter(runtime, Store(tmp_path), "line", chain, policy=ChainPolicy(max_tail=max_tail))
        writer._written.update(i.checkpoint_id for i in chain)
        return writer
    writer = writer_of(chain)
    assert writer._parent_index(writer._tip_index()) == 4
    assert writer._parent_index(writer._tip_index(), head=True) == 4   # no anchor to fold onto
    chain[0] = info(5, KIND_MANUAL, "base")            # now an anchor: the tail folds onto it
    chain[1] = info(10, KIND_AUTOSAVE, "a1", 5)
    writer = writer_of(chain)
    assert writer._parent_index(writer._tip_index()) == 0
    # files up to the answer's prompt end are anchors too (Regenerate and Edit go back there)
    assert writer._parent_index(writer._tip_index(), prompt_end=20) == 2
    runtime.kv_tokens = kv[:12] + [-1] * 2              # the cache left a2..a4 behind (a1 holds 5
    # tokens of its own, more than the 4 since: no tier)
    assert writer._tip_index() == 1 and writer._parent_index(1) == 1
    # a head folds the autosaves since the last anchor into itself, however few they are
    # (an autosave goes on the newest, which holds more tokens of its own than it will)
    runtime.kv_tokens = kv[:45]
    writer = writer_of(chain, max_tail=16)
    assert writer._parent_index(writer._tip_index()) == 4
    assert writer._parent_index(writer._tip_index(), head=True) == 0
    assert writer._parent_index(writer._tip_index(), prompt_end=30, head=True) == 3
    # but never the files it started from: a restored autosave stays (its user may name it again)
    writer = LineWriter(runtime, Store(tmp_path), "line", chain, policy=ChainPolicy(max_tail=2))
    assert writer._parent_index(writer._tip_index(), head=True) == 4



@pytest.mark.parametrize("tiers", [True, False])
def test_an_answers_autosaves_lie_in_tiers_so_a_crash_leaves_a_few_files(tmp_path, tiers):
    """An autosave absorbs the newest autosaves that hold no more tokens of their own than
    it will (LineWriter._tier_below): after k autosaves of 16 tokens the chain holds the
    prompt's file and popcount(k) autosaves whose sizes double downwards, as a binary
    counter holds k; each token's cells are written about log2(k) / 2 times more.
    Without tiers (as before 2026-12-06 (twenty-second session)), one file per autosave, up to ``max_tail``."""
    from types import SimpleNamespace

    from engine.checkpoints.chain import tokens_digest
    from engine.history import ChainPolicy, LineWriter
    from engine.runtime import SaveInfo
    kv = list(range(2000))
    runtime = SimpleNamespace(kv_tokens=[], settings=SimpleNamespace(supports_deltas=True),
                              shape=SimpleNamespace(has_recurrent=False))
    prompt = 300
    chain = [SaveInfo(tmp_path / "prompt", 1, 0.0, prompt, checkpoint_id="prompt", kind=KIND_AUTOSAVE,
                      tokens_digest=tokens_digest(kv[:prompt]))]
    writer = LineWriter(runtime, Store(tmp_path), "line", chain,
                        policy=ChainPolicy(max_tail=16, tier_autosaves=tiers))
    writer._written.add("prompt")
    written = 0
    for k in range(1, 40):
        n = prompt + 16 * k
        runtime.kv_tokens = kv[:n]
        parent = writer._parent_index(writer._tip_index())
        below = writer.chain[parent]
        new = SaveInfo(tmp_path / f"a{k}", 1, 0.0, n, checkpoint_id=f"a{k}", tokens_digest=tokens_digest(kv[:n]),
                       kind=KIND_AUTOSAVE, delta=True, parent_n_tokens=below.n_tokens, depth=below.depth + 1)
        writer._chain = writer._chain[:parent + 1] + [new]
        writer._written.add(new.checkpoint_id)
        written += n - below.n_tokens
        tail = [info.n_tokens - info.parent_n_tokens for info in writer.chain[1:]]
        if tiers:
            assert len(tail) == bin(k).count("1"), (k, tail)
            assert tail == sorted(tail, reverse=True) and all(t // 16 == 1 << t.bit_length() - 5 for t in tail)
        else:
            assert len(tail) == (k - 1) % 16 + 1, (k, tail)
    # 39 autosaves of 16 tokens: with tiers autosave k writes lowbit(k) of them (2.6 a token
    # here); without, one each, and all since the prompt at the 17th and the 33rd (max_tail)
    units = sum(k & -k for k in range(1, 40)) if tiers else 39 - 2 + 17 + 33
    assert written == 16 * units


@pytest.mark.parametrize("cells_per_token,recurrent,folds", [
    (1, 1000, True),        # a recurrent state far larger than the cells: the tail is mostly dead
    (1000, 1000, False),    # wide attention, a small recurrent part: each autosave on the last
    (0, 1000, True),        # a pure recurrent memory: no cells at all
])
def test_a_recurrent_memorys_autosave_goes_on_the_anchor_while_its_tail_is_mostly_dead(
        tmp_path, cells_per_token, recurrent, folds):
    """Every autosave of a memory with a recurrent part holds the whole recurrent state,
    which the next leaves dead (LineWriter._tail_mostly_dead): the next autosave goes on
    the last anchor, retiring the tail, while the tail's attention cells weigh no more than
    the rest of its bytes; an attention memory's goes on its newest autosave."""
    from types import SimpleNamespace

    from engine.checkpoints.chain import tokens_digest
    from engine.history import ChainPolicy, LineWriter
    from engine.runtime import SaveInfo
    kv = list(range(40))   # (5 tokens since the newest autosave: fewer than it holds, no tier)
    total = recurrent + cells_per_token * len(kv)
    runtime = SimpleNamespace(kv_tokens=kv, settings=SimpleNamespace(supports_deltas=True),
                              shape=SimpleNamespace(has_recurrent=True), state_sizes=lambda: (total, recurrent))
    # the anchor (5 tokens), then autosaves of 10 more tokens each: a recurrent state and 10 cells
    chain = [SaveInfo(tmp_path / "base", 10_000, 0.0, 5, checkpoint_id="base", tokens_digest=tokens_digest(kv[:5]),
                      kind=KIND_MANUAL)]
    chain += [SaveInfo(tmp_path / f"a{k}", recurrent + 10 * cells_per_token, 0.0, 5 + 10 * k,
                       checkpoint_id=f"a{k}", tokens_digest=tokens_digest(kv[:5 + 10 * k]), kind=KIND_AUTOSAVE)
              for k in range(1, 4)]
    writer = LineWriter(runtime, Store(tmp_path), "line", chain, policy=ChainPolicy(max_tail=16))
    writer._written.update(i.checkpoint_id for i in chain)
    assert writer._parent_index(writer._tip_index()) == (0 if folds else 3)
    runtime.shape.has_recurrent = False   # the same sizes, an attention memory: never
    assert writer._parent_index(writer._tip_index()) == 3


def test_the_record_of_deleted_files_reads_its_old_form_and_survives_damage(tmp_path):
    """The record of what the user deleted (Store.deleted) was a list of conversation ids
    before 2026-12-05; it is read still.  A damaged record reads as empty (fewer files are
    then deleted, never a wrong one), and an empty record leaves no file behind."""
    from engine.checkpoints.store import DELETED_RECORD, Deleted
    store = Store(tmp_path / "store")
    store.folder.mkdir(parents=True)
    a = uuid.uuid4()
    (store.folder / DELETED_RECORD).write_text(f'["{a}"]', encoding="utf-8")
    assert store.deleted() == Deleted(frozenset({a}))
    record = Deleted(frozenset({a}), frozenset({"x.kvckpt"}))
    with store.lock():
        store.record_deleted(record)
    assert store.deleted() == record
    for damage in ('{"checkpoints": [1]}', '{"conversations": ["not an id"]}', "[", '"text"'):
        (store.folder / DELETED_RECORD).write_text(damage, encoding="utf-8")
        assert store.deleted() == Deleted(), damage
    with store.lock():
        store.record_deleted(Deleted())
    assert not (store.folder / DELETED_RECORD).exists()
