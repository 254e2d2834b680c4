"""Issue 4, cases 5 and 6: a full or failing disk, Windows sharing violations, non-ASCII paths.

Failures are injected through engine.checkpoints.atomic's seams (``open_file``, ``fsync``,
``replace``).  After every failed save: the previous file is byte-for-byte intact, no
temp file is left, and ``Runtime.save`` raises SaveFailed with the OS's reason.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import time
import uuid

import pytest
from faultkit import synthetic

from engine.checkpoints import atomic
from engine.checkpoints import format as fmt
from engine.checkpoints.store import Store
from engine.errors import SaveFailed

FOLDER_NAMES = ["检查点", "用户/文档/チェックポイント", "émoji 🧠💾", "C：Users用户文档"]


class FailingRaw(io.RawIOBase):
    """The raw file under Python's buffer, failing with ``err`` once ``after`` bytes were
    written: like a real full disk, the error surfaces in write, flush or close,
    depending on what the buffer holds at the time."""

    def __init__(self, real: io.FileIO, err: int, after: int) -> None:
        self._real, self._err, self._after = real, err, after
        self.written = 0
        self.name = real.name

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if self.written + n > self._after:
            raise OSError(self._err, os.strerror(self._err))
        self.written += n
        return self._real.write(data)

    def fileno(self) -> int:
        return self._real.fileno()

    def close(self) -> None:
        self._real.close()
        super().close()


def inject_write_failure(monkeypatch, err: int, after: int) -> None:
    monkeypatch.setattr(atomic, "open_file", lambda path, mode: io.BufferedWriter(
        FailingRaw(io.FileIO(path, mode.replace("b", "")), err, after)))


def inject_fsync_failure(monkeypatch, err: int, which: int = 0) -> list:
    """Fail the ``which``-th fsync call (0: the file's; 1: the folder's)."""
    calls = []
    real = atomic.fsync

    def fsync(fd):
        calls.append(fd)
        if len(calls) - 1 == which:
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(atomic, "fsync", fsync)
    return calls


@pytest.fixture(scope="module")
def smol_session(smollm_runtime, tmp_path_factory):
    """A saved SmolLM2 conversation; tests restore it into the shared runtime."""
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    conv = Conversation()
    begin_answer(conv, smollm_runtime, "Write one word.", n_predict=6)
    generate(smollm_runtime, conv, stop_after=2)
    path = tmp_path_factory.mktemp("disk") / "base.kvckpt"
    smollm_runtime.save(path, conv)
    return path


def _restored(runtime, path):
    return runtime.restore(fmt.read_checkpoint(path))


def _leftovers(folder):
    # a replaced file is freed under a temp name on the helper thread: let it finish first
    # (under load it had not, once, and the set-aside name was counted as a leftover)
    atomic.wait_for_helper(timeout=30)
    return [p.name for p in folder.iterdir() if atomic.is_temp_name(p.name)]


# -- case 5: ENOSPC and EIO ---------------------------------------------------------------------

@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
@pytest.mark.parametrize("after", [0, 100, 300, 9000, 100_000])
def test_write_failures_keep_the_old_file(tmp_path, monkeypatch, smollm_runtime, smol_session, err, after):
    folder = tmp_path / "检查点"
    folder.mkdir()
    target = folder / "conversation.kvckpt"
    conv = _restored(smollm_runtime, smol_session)
    smollm_runtime.save(target, conv)
    before = target.read_bytes()
    inject_write_failure(monkeypatch, err, after)
    with pytest.raises(SaveFailed) as info:
        smollm_runtime.save(target, conv)
    assert os.strerror(err) in str(info.value) and "untouched" in str(info.value)
    assert target.read_bytes() == before
    assert _leftovers(folder) == []


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_fsync_failure_keeps_the_old_file(tmp_path, monkeypatch, smollm_runtime, smol_session, err):
    target = tmp_path / "用户" / "a.kvckpt"
    conv = _restored(smollm_runtime, smol_session)
    smollm_runtime.save(target, conv)
    before = target.read_bytes()
    calls = inject_fsync_failure(monkeypatch, err, which=0)
    with pytest.raises(SaveFailed, match=os.strerror(err)):
        smollm_runtime.save(target, conv)
    assert len(calls) == 1
    assert target.read_bytes() == before and _leftovers(target.parent) == []


def test_folder_fsync_failure_after_the_rename_is_not_a_failed_save(tmp_path, monkeypatch, caplog):
    """Once the new file is renamed into place it is whole; only durability is in doubt."""
    target = tmp_path / "b.kvckpt"
    conv = uuid.uuid4()
    synthetic.write(target, conv, 1)
    calls = inject_fsync_failure(monkeypatch, errno.EIO, which=1)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        synthetic.write(target, conv, 2)
    assert len(calls) == 2 and "could not fsync folder" in caplog.text
    assert synthetic.load_fully(target).meta["seq"] == 2 and _leftovers(tmp_path) == []


@pytest.mark.parametrize("after", range(0, 40_000, 997))
def test_enospc_at_many_offsets_of_a_synthetic_save(tmp_path, monkeypatch, after):
    target = tmp_path / "c.kvckpt"
    conv = uuid.uuid4()
    synthetic.write(target, conv, 1, n_tokens=64)
    before = target.read_bytes()
    inject_write_failure(monkeypatch, errno.ENOSPC, after)
    with pytest.raises(OSError) as info:
        synthetic.write(target, conv, 2, n_tokens=80)
    assert info.value.errno == errno.ENOSPC
    assert target.read_bytes() == before and _leftovers(tmp_path) == []


# -- case 6: Windows sharing violations, by injection --------------------------------------------

class WinError(PermissionError):
    """What os.replace raises on Windows while a scanner holds the file."""

    def __init__(self, winerror: int) -> None:
        super().__init__(errno.EACCES, "The process cannot access the file")
        self.winerror = winerror


def inject_replace_failures(monkeypatch, winerror: int | None, times: int) -> list:
    attempts = []
    real = atomic.replace

    def replace(src, dst):
        attempts.append(time.monotonic())
        if len(attempts) <= times:
            raise WinError(winerror) if winerror is not None else PermissionError(errno.EACCES, "denied")
        real(src, dst)

    monkeypatch.setattr(atomic, "replace", replace)
    return attempts


@pytest.mark.parametrize("winerror", [5, 32, 33])
def test_transient_sharing_violations_are_retried(tmp_path, monkeypatch, smollm_runtime,
                                                  smol_session, winerror):
    target = tmp_path / "文档" / "w.kvckpt"
    conv = _restored(smollm_runtime, smol_session)
    attempts = inject_replace_failures(monkeypatch, winerror, times=4)
    started = time.monotonic()
    info = smollm_runtime.save(target, conv)
    assert len(attempts) == 5
    assert time.monotonic() - started < atomic.REPLACE_RETRY_S
    assert fmt.read_checkpoint(info.path).header.n_tokens == len(smollm_runtime.kv_tokens)
    assert _leftovers(target.parent) == []


def test_permanent_sharing_violation_is_a_clear_error_within_the_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "REPLACE_RETRY_S", 0.4)
    target = tmp_path / "émoji 🧠" / "p.kvckpt"
    target.parent.mkdir()
    conv = uuid.uuid4()
    synthetic.write(target, conv, 1)
    before = target.read_bytes()
    attempts = inject_replace_failures(monkeypatch, 32, times=10**6)
    started = time.monotonic()
    with pytest.raises(PermissionError) as info:
        synthetic.write(target, conv, 2)
    elapsed = time.monotonic() - started
    assert info.value.winerror == 32
    assert 0.2 < elapsed < 1.5 and 3 <= len(attempts) < 40
    assert f"tried {len(attempts)} times over 0.4 s" in str(info.value)
    assert target.read_bytes() == before and _leftovers(target.parent) == []


def test_the_retry_waits_long_enough_for_a_scanner_backing_off_and_then_says_so(tmp_path, monkeypatch):
    """The default schedule, on a clock of its own: pauses that grow to at most a second,
    REPLACE_RETRY_S in all (a scanner reading a new file of some GB), never longer; the
    error names the tries and the time."""
    now = [0.0]
    pauses = []

    def sleep(s):
        pauses.append(s)
        now[0] += s
    monkeypatch.setattr(atomic, "clock", lambda: now[0])
    monkeypatch.setattr(atomic, "sleep", sleep)
    attempts = inject_replace_failures(monkeypatch, 32, times=10**6)
    src = tmp_path / "new"
    src.write_bytes(b"x")
    with pytest.raises(PermissionError) as info:
        atomic.replace_with_retry(src, tmp_path / "held")
    assert 5.0 <= atomic.REPLACE_RETRY_S <= 10.0, "a few seconds: a scanner's hold, not for ever"
    assert sum(pauses) == pytest.approx(atomic.REPLACE_RETRY_S)
    assert pauses[0] <= 0.01 and max(pauses) <= 1.0
    assert pauses[:-1] == sorted(pauses[:-1]), "backing off"
    assert len(attempts) == len(pauses) + 1 < 30
    assert info.value.winerror == 32
    assert f"tried {len(attempts)} times over {atomic.REPLACE_RETRY_S:.1f} s" in str(info.value)
    assert "another program" in str(info.value) and src.exists()


def test_permanent_sharing_violation_through_runtime_save(tmp_path, monkeypatch, smollm_runtime,
                                                          smol_session):
    monkeypatch.setattr(atomic, "REPLACE_RETRY_S", 0.2)
    target = tmp_path / "q.kvckpt"
    conv = _restored(smollm_runtime, smol_session)
    inject_replace_failures(monkeypatch, 33, times=10**6)
    with pytest.raises(SaveFailed, match="could not save the checkpoint"):
        smollm_runtime.save(target, conv)
    assert not target.exists() and _leftovers(tmp_path) == []


def test_other_errors_are_not_retried(tmp_path, monkeypatch):
    attempts = inject_replace_failures(monkeypatch, None, times=10**6)
    with pytest.raises(PermissionError):
        synthetic.write(tmp_path / "n.kvckpt", uuid.uuid4(), 1)
    assert len(attempts) == 1 and _leftovers(tmp_path) == []


# -- non-ASCII paths, everywhere ---------------------------------------------------------------

@pytest.mark.parametrize("name", FOLDER_NAMES)
def test_store_round_trip_in_non_ascii_folders(tmp_path, smollm_runtime, smol_session, name):
    store = Store(tmp_path / name)
    conv = _restored(smollm_runtime, smol_session)
    conv.title = "标题 😀 заголовок"
    saved = smollm_runtime.save(store.new_path(conv.title), conv)
    assert saved.path.parent == store.folder and "标题" in saved.path.name
    auto = smollm_runtime.save(synthetic.fixed_path(store, conv.id), conv, fmt.KIND_AUTOSAVE)
    entries = store.entries()
    assert {e.path for e in entries} == {saved.path, auto.path} and all(e.valid for e in entries)
    assert entries[0].header.title == "标题 😀 заголовок"
    outside = tmp_path / "外部 📁" / "copy.kvckpt"
    outside.parent.mkdir()
    outside.write_bytes(saved.path.read_bytes())
    from engine.checkpoints.transfer import import_files
    (result,) = import_files([outside], Store(tmp_path / name / "子文件夹"))
    imported = result.imported
    assert fmt.read_checkpoint(imported).header.conversation_id == conv.id
    assert smollm_runtime.restore(fmt.read_checkpoint(imported)).tokens == conv.tokens
    from engine.checkpoints.graph import delete_node
    assert delete_node(store, saved.path).deleted == [saved.path] and not saved.path.exists()
