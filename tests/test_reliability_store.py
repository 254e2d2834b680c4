"""The store's promises: pruning never deletes what it must keep, imports never touch
their source, renames and deletes take the cross-process lock, dead writers' temp files
are cleaned up and live ones are not."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest
from filelock import Timeout

from engine.checkpoints import atomic
from engine.checkpoints import format as fmt
from engine.errors import CheckpointError
from engine.checkpoints.store import Store
from faultkit import corrupt, synthetic

A, M, P, X = fmt.KIND_AUTOSAVE, fmt.KIND_MANUAL, fmt.KIND_PAUSE, fmt.KIND_EXIT


def _save(store: Store, conv, seq, kind, name=None):
    store.ensure()
    path = store.folder / name if name else (
        store.autosave_path(conv) if kind == A else store.new_path(f"c{seq}"))
    synthetic.write(path, conv, seq, kind=kind, n_tokens=32)
    time.sleep(0.002)   # distinct creation times, in the order of the calls
    return path


def test_prune_keeps_manual_saves_and_each_conversations_newest(tmp_path):
    store = Store(tmp_path / "store")
    a, b, c, d, e = (uuid.uuid4() for _ in range(5))
    a_auto = _save(store, a, 1, A)
    a_manual = _save(store, a, 2, M)           # newer than a's autosave: the autosave may go
    b_auto = _save(store, b, 1, A)             # b's only checkpoint
    c_pause = _save(store, c, 1, P)
    c_auto = _save(store, c, 2, A)             # c's newest
    d_old = _save(store, d, 1, A, "autosave-d-old.kvckpt")
    d_new = _save(store, d, 2, A, "autosave-d-new.kvckpt")
    damaged = bytearray(d_new.read_bytes())
    damaged[-100] ^= 1                         # d's newest is damaged: the older one is d's newest valid
    d_new.write_bytes(bytes(damaged))
    e_exit = _save(store, e, 1, X)
    report = store.prune_autosaves(budget_bytes=0)
    assert report.deleted == [a_auto]
    for kept in (a_manual, b_auto, c_pause, c_auto, d_old, d_new, e_exit):
        assert kept.exists(), kept.name
    assert report.store_bytes == sum(e.size for e in store.entries())


def test_prune_deletes_oldest_first_and_only_what_the_budget_needs(tmp_path):
    store = Store(tmp_path / "store")
    autos = []
    for i in range(6):
        conv = uuid.uuid4()
        autos.append(_save(store, conv, 1, A))
        _save(store, conv, 2, M)   # each autosave has a newer manual save: all are candidates
    size = autos[0].stat().st_size
    total = sum(e.size for e in store.entries())
    report = store.prune_autosaves(budget_bytes=total - 2 * size - 1)
    assert report.deleted == autos[:3]                       # oldest first, no more than needed
    assert all(p.exists() for p in autos[3:])
    report = store.prune_autosaves(max_count=1)
    assert report.deleted == autos[3:5] and autos[5].exists()
    assert store.prune_autosaves(budget_bytes=10**12, max_count=100).deleted == []


def test_prune_skips_a_file_replaced_since_it_was_listed(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    auto = _save(store, conv, 1, A)
    _save(store, conv, 2, M)
    listed = next(e for e in store.entries() if e.path == auto)
    time.sleep(0.01)
    _save(store, conv, 3, A)                    # a writer replaces the autosave: now the newest
    assert store._delete_if_unchanged(listed) is False
    assert synthetic.load_fully(auto).meta["seq"] == 3


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
    path = store.autosave_path(conv)
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
    store.new_path("x"), store.autosave_path(uuid.uuid4())
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
    copy = store.import_file(src)
    assert copy.parent == store.folder and copy.read_bytes() == before[0]
    assert (src.read_bytes(), src.stat().st_mtime_ns) == before
    assert store.import_file(src) == copy and len(store.files()) == 1   # not copied twice
    bad = tmp_path / "bad.kvckpt"
    bad.write_bytes(corrupt.flip(before[0], [8 * (len(before[0]) - 200)]))
    with pytest.raises(CheckpointError):
        store.import_file(bad)
    assert len(store.files()) == 1 and store.temp_files() == []


def test_delete_only_inside_the_store(tmp_path):
    store = Store(tmp_path / "store")
    conv = uuid.uuid4()
    path = _save(store, conv, 1, M)
    outside = tmp_path / "elsewhere.kvckpt"
    outside.write_bytes(path.read_bytes())
    with pytest.raises(ValueError):
        store.delete(outside)
    assert store.delete(path) is True and store.delete(path) is False and outside.exists()
