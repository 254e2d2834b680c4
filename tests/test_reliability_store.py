"""The store's promises: pruning deletes only superseded files, imports never touch
their source, renames and deletes take the cross-process lock, dead writers' temp files
are cleaned up and live ones are not.  (The graph's own rules, with deltas, are in
test_store_graph.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from faultkit import corrupt, synthetic
from filelock import Timeout

from engine.checkpoints import atomic, graph, transfer
from engine.checkpoints import format as fmt
from engine.checkpoints.store import Store

A, M, P, X = fmt.KIND_AUTOSAVE, fmt.KIND_MANUAL, fmt.KIND_PAUSE, fmt.KIND_EXIT


def _save(store: Store, conv, seq, kind, name=None, line=None):
    store.ensure()
    path = store.folder / name if name else store.new_path(f"c{seq}")
    synthetic.write(path, conv, seq, kind=kind, n_tokens=32, line=line)
    time.sleep(0.002)   # distinct creation times, in the order of the calls
    return path


def test_prune_deletes_only_superseded_files(tmp_path):
    """Every conversation keeps its head; a damaged head is set aside, never trusted."""
    store = Store(tmp_path / "store")
    a, b, c, d = (uuid.uuid4() for _ in range(4))
    a_old = _save(store, a, 1, A)              # superseded by a's newer head
    a_head = _save(store, a, 2, M)
    b_only = _save(store, b, 1, A)             # b's only checkpoint: its head
    c_pause = _save(store, c, 1, P, line="branch")   # another line of c: a head of its own
    c_auto = _save(store, c, 2, A)
    d_old = _save(store, d, 1, A, "autosave-d-old.kvckpt")
    d_new = _save(store, d, 2, A, "autosave-d-new.kvckpt")
    damaged = bytearray(d_new.read_bytes())
    damaged[-100] ^= 1                         # d's newest is damaged: the older one is its head
    d_new.write_bytes(bytes(damaged))
    report = graph.prune(store, 0)
    assert report.deleted == [a_old]
    for kept in (a_head, b_only, c_pause, c_auto, d_old, d_new):
        assert kept.exists(), kept.name
    assert report.kept[graph.KEPT_HEAD][0] == 4 + 1   # a, b, c twice, d (its older file)
    assert report.store_bytes == sum(e.size for e in store.entries())
    assert "deleted 1 superseded file" in report.describe()


def test_prune_deletes_oldest_first_and_only_what_the_budget_needs(tmp_path):
    store = Store(tmp_path / "store")
    olds = []
    for _ in range(6):
        conv = uuid.uuid4()
        olds.append(_save(store, conv, 1, A))
        _save(store, conv, 2, M)   # each old file has a newer head: all are superseded
    size = olds[0].stat().st_size
    total = sum(e.size for e in store.entries())
    report = graph.prune(store, total - 2 * size - 1)
    assert report.deleted == olds[:3]                       # oldest first, no more than needed
    assert all(p.exists() for p in olds[3:])
    assert report.kept[graph.KEPT_BUDGET][0] == 3
    assert graph.prune(store, 10**12).deleted == []
    assert graph.prune(store, None).deleted == olds[3:]     # None: every superseded file


def test_prune_skips_a_file_replaced_since_it_was_scanned(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    old = _save(store, conv, 1, A)
    _save(store, conv, 2, M)
    scanned = graph.Graph.scan(store).nodes[old.name]
    time.sleep(0.01)
    synthetic.write(old, conv, 3, n_tokens=32)   # rewritten in place: now the newest
    report = graph.PruneReport()
    assert graph._delete(store, scanned, report) is False and report.skipped_changed == 1
    assert synthetic.load_fully(old).meta["seq"] == 3


def _hold_lock_in_other_process(store: Store, seconds: float) -> subprocess.Popen:
    code = ("import sys, time; from filelock import FileLock; l = FileLock(sys.argv[1]); "
            "l.acquire(); print('held', flush=True); time.sleep(float(sys.argv[2]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(store.folder / atomic.STORE_LOCK_NAME),
                             str(seconds)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_saves_into_a_store_rename_under_its_cross_process_lock(tmp_path, monkeypatch):
    store = Store(tmp_path / "存储")
    store.ensure()                             # the folder and its store marker
    conv = uuid.uuid4()
    path = synthetic.fixed_path(store, conv)
    holder = _hold_lock_in_other_process(store, 0.8)
    started = time.monotonic()
    synthetic.write(path, conv, 1)
    assert time.monotonic() - started > 0.5    # waited for the other process's lock
    holder.wait()
    holder = _hold_lock_in_other_process(store, 5)
    monkeypatch.setattr(atomic, "STORE_LOCK_TIMEOUT_S", 0.2)
    with pytest.raises(Timeout):               # an OSError: Runtime.save reports SaveFailed
        synthetic.write(path, conv, 2)
    holder.kill()
    holder.wait()
    assert synthetic.load_fully(path).meta["seq"] == 1 and store.temp_files() == []


def test_outside_a_store_no_lock_is_taken_and_path_functions_create_nothing(tmp_path):
    synthetic.write(tmp_path / "plain.kvckpt", uuid.uuid4(), 1)
    assert not (tmp_path / atomic.STORE_LOCK_NAME).exists()
    store = Store(tmp_path / "not yet")
    store.new_path("x"), store.new_autosave_path(uuid.uuid4())
    assert not store.folder.exists()
    store.folder.mkdir()
    store.new_path("x")                        # an existing folder becomes a marked store
    assert (store.folder / atomic.STORE_MARKER).exists()


def test_stale_temp_files_are_removed_and_young_or_live_ones_kept(tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    dead = store.folder / ".x.kvckpt.deadbeef.tmp"
    dead.write_bytes(b"half a checkpoint")
    old = time.time() - 3600
    os.utime(dead, (old, old))
    young = store.folder / ".y.kvckpt.cafebabe.tmp"
    young.write_bytes(b"being written")
    assert store.files() == [] and len(store.temp_files()) == 2
    assert store.remove_stale_temps() == 1
    assert not dead.exists() and young.exists()


def test_import_validates_copies_and_never_touches_the_source(tmp_path):
    src = tmp_path / "下载" / "shared.kvckpt"
    src.parent.mkdir()
    synthetic.write(src, uuid.uuid4(), 7, kind=M, title="共享")
    before = (src.read_bytes(), src.stat().st_mtime_ns)
    store = Store(tmp_path / "store")
    (result,) = transfer.import_files([src], store)
    copy = result.imported
    assert copy.parent == store.folder and not result.already
    # the same checkpoint (id, tokens, state), on a line of its own, its original CRC kept
    original, copied = fmt.read_checkpoint(src), fmt.read_checkpoint(copy)
    assert (copied.tokens == original.tokens).all() and (copied.state == original.state).all()
    assert copied.meta.get("checkpoint_id") == original.meta.get("checkpoint_id")
    assert copied.meta["origin_crc"] == original.payload_crc
    assert {k: v for k, v in copied.meta.items() if k not in ("line", "origin_crc")} == original.meta
    assert (src.read_bytes(), src.stat().st_mtime_ns) == before
    bad = tmp_path / "bad.kvckpt"
    bad.write_bytes(corrupt.flip(before[0], [8 * (len(before[0]) - 200)]))
    (refused,) = transfer.import_files([bad], store)
    assert refused.imported is None and refused.status == transfer.CORRUPT
    assert len(store.files()) == 1 and store.temp_files() == []


def test_delete_only_inside_the_store(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    path = _save(store, conv, 1, M)
    outside = tmp_path / "elsewhere.kvckpt"
    outside.write_bytes(path.read_bytes())
    with pytest.raises(ValueError):
        graph.delete_node(store, outside)
    assert graph.delete_node(store, path).deleted == [path]
    assert graph.delete_node(store, path).deleted == [] and outside.exists()
