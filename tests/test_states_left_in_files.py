"""A restore leaves the recurrent states it may go back to in their files
(engine.checkpoints.file_bytes): the answer's prompt end (Regenerate) and a turn end a head
absorbed (an Edit).  Each is read when it is used, checked against its CRC and walked;
a file that no longer holds it (deleted, replaced, damaged) is not used, and going back
then reads the prompt again, exactly.

Tiny random-weight models (tests/tinymodels.py); exactness is the regenerated answer's text
(greedy) and the state's bytes against llama.cpp's own.
"""

from __future__ import annotations

import logging
import os
import shutil

import memkit
import numpy as np
import pytest
from test_point_states import _chat

from engine.checkpoints.chain import load_chain, restoring, tokens_digest
from engine.checkpoints.crc import crc32
from engine.checkpoints.file_bytes import BytesInFile
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_PAUSE
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import CorruptState
from engine.generation import begin_answer, discard_answer, generate
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from engine.snapshots import PromptSnapshot, Shelf

HOW = ["deleted", "replaced", "damaged", "shortened"]


# -- BytesInFile ----------------------------------------------------------------------------
def test_bytes_in_file_are_read_after_their_prefix_and_checked(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 100 + bytes(range(200)) + b"y" * 50)
    part = BytesInFile(path, 100, 200, crc32(bytes(range(200))), b"HEAD")
    got = part.read()
    assert got.tobytes() == b"HEAD" + bytes(range(200)) and not got.flags.writeable
    for damage, says in ((lambda: path.write_bytes(b"x" * 120), "shorter"),
                         (lambda: path.write_bytes(b"x" * 100 + bytes(199) + b"!" + b"y" * 50), "no longer holds"),
                         (lambda: path.unlink(), "can no longer be read")):
        damage()
        with pytest.raises(CorruptState, match=says):
            part.read()


@pytest.mark.parametrize("reader", ["mapped", "copying"])
@pytest.mark.parametrize("how", ["read", "restore's read", "restore's read, queued"])
def test_a_state_parts_crc_comes_from_the_reads_checksum(how, reader, made, merged, monkeypatch):
    """CheckpointData.crc_of_state_tail, derived from the read's own checksum where it ended
    at the state's end (the points' states left unread, or none), is the CRC of those bytes:
    a prompt's file, and a head whose point states a plain read checksums too; released, the
    state's CRC is refused rather than made up."""
    from engine.checkpoints import format as fmt
    from engine.checkpoints import mapped
    from engine.checkpoints.crc import combine
    assert combine is not None, "python-isal's crc32_combine: every platform shipped has it"
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0 if reader == "mapped" else 1 << 62)
    if how.endswith("queued"):
        monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)
    later = how != "read"
    for path in (made("qwen35")[0], merged):
        data = fmt.read_checkpoint(path, crc_later=later)
        assert (data.mapping is not None) == (reader == "mapped" and mapped.supported())
        data.settle()
        state = data.state.tobytes()
        assert (data.crc_through_state is not None) == (later or not data.header.has_point_states), path.name
        for start in (0, 1, len(state) // 3, len(state) - 4096, len(state) - 1, len(state)):
            assert data.crc_of_state_tail(start) == crc32(state[start:]), (path.name, start)
        if data.mapping is not None:
            data.release()
            with pytest.raises(ValueError, match="released"):
                data.crc_of_state_tail(0)


# -- the answer's prompt end -----------------------------------------------------------------
def _prompt_then_answer(rt, folder):
    """A prompt's file and its answer's on it (as an autosave at the prompt's end and a pause
    make them); the answer's text, greedy."""
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    begin_answer(conv, rt, "Hello there.", n_predict=12)   # short: the recurrent part is the larger
    rt.prefill(conv.tokens)
    prompt = rt.save(folder / "prompt.kvckpt", conv, KIND_AUTOSAVE)
    text = generate(rt, conv).text
    answer = rt.save(folder / "answer.kvckpt", conv, KIND_PAUSE, parent=prompt)
    return prompt.path, answer.path, conv.answer.n_prompt_tokens, text


def _restored(rt, path):
    """Restore ``path``'s chain as the app does (checksums beside the copy, the files let go)."""
    chain = load_chain(path, crc_later=True)
    with restoring(chain):
        return rt.restore_chain(chain)


def _regenerate(rt, conv):
    discard_answer(conv)
    return generate(rt, conv)


@pytest.fixture(scope="module")
def made(tiny_model_path, tmp_path_factory):
    """Per arch: a prompt file, its answer's file, the prompt's length and the answer's text."""
    cache = {}

    def make(arch):
        if arch not in cache:
            folder = tmp_path_factory.mktemp(arch)
            rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
            try:
                cache[arch] = _prompt_then_answer(rt, folder)
            finally:
                rt.close()
        return cache[arch]
    return make


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_the_prompt_ends_state_stays_in_its_file_until_regenerate(arch, made, tiny_model_path, monkeypatch):
    """Restored, the snapshot at the answer's prompt end is where the prompt's file holds it,
    its logits too, not a copy; Regenerate reads them (once: a second Regenerate has them in
    memory), and draws the answer the first run drew, having read nothing of the prompt again."""
    prompt, answer, n_prompt, text = made(arch)
    reads = []
    real = BytesInFile.read
    monkeypatch.setattr(BytesInFile, "read", lambda self: (reads.append(self.path.name), real(self))[1])
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        conv = _restored(rt, answer)
        kept = rt._snapshots.at(rt.kv_tokens, n_prompt)
        assert kept is not None and isinstance(kept.state, BytesInFile) and kept.state.path == prompt
        assert isinstance(kept.logits, BytesInFile) and kept.logits.path == prompt
        assert reads == []
        for _ in range(2):
            again = _regenerate(rt, conv)
            assert (again.text, again.n_reused_tokens) == (text, n_prompt)
        assert reads == [prompt.name, prompt.name]   # its recurrent state, its logits
        assert isinstance(kept.state, np.ndarray) and isinstance(kept.logits, np.ndarray)
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_a_sequence_of_the_windows_context_goes_back_to_a_state_in_its_file(arch, made, tiny_model_path, tmp_path):
    """The window's context (a sequence of a ParallelRuntime, not sequence 0) keeps the
    prompt end where its file holds it and goes back there as the single-sequence Runtime
    does: the same state, byte for byte; its file gone, it says it can keep none."""
    import dataclasses

    from engine.parallel import ParallelRuntime
    prompt, answer, n_prompt, _text = made(arch)
    folder = tmp_path / "copy"
    shutil.copytree(prompt.parent, folder)
    prt = ParallelRuntime(tiny_model_path(arch), dataclasses.replace(memkit.SETTINGS, n_seq_max=3), sequences=2)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        prt.view_of("other").restore_chain(load_chain(answer))   # sequence 0 taken: the next is another
        view = prt.view_of("regenerate")
        chain = load_chain(folder / answer.name, crc_later=True)
        with restoring(chain):
            view.restore_chain(chain)
        assert view.seq != 0
        assert view.trim(n_prompt) == n_prompt
        rt.restore_chain(load_chain(prompt))
        size = prt.ctx.state_size(view.seq, 1)   # (STATE_RECURRENT_ONLY: the recurrent part)
        ours = np.empty(size, np.uint8)
        theirs = np.empty(rt.ctx.state_size(0, 1), np.uint8)
        assert ours[8:prt.ctx.state_get_into(ours, size, view.seq, 1)].tobytes() \
            == theirs[8:rt.ctx.state_get_into(theirs, len(theirs), 0, 1)].tobytes()   # (past magic and sequence id)
        other = prt.view_of("gone")
        chain = load_chain(folder / answer.name, crc_later=True)
        with restoring(chain):
            other.restore_chain(chain)
        (folder / prompt.name).unlink()
        assert other.can_keep(n_prompt) == 0
    finally:
        prt.close()
        rt.close()


def _spoil(path, stored: BytesInFile, how: str) -> None:
    if how == "deleted":
        path.unlink()
    elif how == "replaced":   # another file under its name (os.replace: what a save does)
        other, data = path.with_suffix(".other"), path.read_bytes()
        other.write_bytes(data[:stored.offset] + bytes(stored.length) + data[stored.offset + stored.length:])
        os.replace(other, path)
    elif how == "damaged":
        with open(path, "r+b") as f:
            f.seek(stored.offset + stored.length // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    else:
        with open(path, "r+b") as f:
            f.truncate(stored.offset + stored.length - 1)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_a_prompt_state_its_file_no_longer_holds_is_not_used(arch, how, made, tiny_model_path, tmp_path, caplog):
    """The prompt's file deleted, replaced, damaged or cut short after the restore: Regenerate
    does not put back what it holds now; it says why and reads the prompt again, and the
    answer is the first run's."""
    prompt, answer, n_prompt, text = made(arch)
    folder = tmp_path / "copy"
    shutil.copytree(prompt.parent, folder)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        conv = _restored(rt, folder / answer.name)
        kept = rt._snapshots.at(rt.kv_tokens, n_prompt)
        assert kept is not None and isinstance(kept.state, BytesInFile)
        _spoil(folder / prompt.name, kept.state, how)
        with caplog.at_level(logging.WARNING, logger="engine"):
            again = _regenerate(rt, conv)
        assert (again.text, again.n_reused_tokens) == (text, 0)
        assert any("cannot be had" in r.getMessage() for r in caplog.records), caplog.text
        assert rt._snapshots.at(rt.kv_tokens, n_prompt) is not kept   # it left the shelf
    finally:
        rt.close()


# -- a turn end a head absorbed --------------------------------------------------------------
@pytest.fixture(scope="module")
def merged(tiny_model_path, tmp_path_factory):
    """lfm2: four turns whose head absorbed the turns before it (their ends: points)."""
    folder = tmp_path_factory.mktemp("merged")
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        _conv, heads = _chat(rt, Store(folder / "store"))
    finally:
        rt.close()
    return heads[-1].path


@pytest.mark.parametrize("how", [None, "damaged", "deleted"])
def test_a_turn_end_kept_by_a_restore_is_read_when_regenerate_goes_back(how, merged, tiny_model_path, tmp_path,
                                                                        caplog):
    """Regenerate of a merged head's last answer goes back to the turn end before it: the
    restore keeps that point where the head holds it, and reads it then.  Intact, the answer
    reads only the last question again; its file spoiled, the prompt is read again, and the
    answer is the same."""
    folder = tmp_path / "store"
    shutil.copytree(merged.parent, folder)
    head = folder / merged.name
    expected = []
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        conv = _restored(rt, head)   # the reference: a restore of the intact head
        previous = max(s.n_tokens for s in rt._snapshots._items)
        expected = [_regenerate(rt, conv).text, previous]
        rt.trim(0)
        conv = _restored(rt, head)
        kept = rt._snapshots.at(rt.kv_tokens, previous)
        assert kept is not None and isinstance(kept.state, BytesInFile) and kept.state.path == head
        if how is not None:
            _spoil(head, kept.state, how)
        with caplog.at_level(logging.WARNING, logger="engine"):
            again = _regenerate(rt, conv)
        assert again.text == expected[0]
        assert again.n_reused_tokens == (previous if how is None else 0)
        assert ("cannot be had" in caplog.text) == (how is not None)
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_saving_from_a_state_its_file_no_longer_holds_uses_none(arch, made, tiny_model_path, tmp_path, caplog):
    """What a save takes from a snapshot (Runtime.snapshot_at: a shared prefix, an autosave
    written one token short) reads a restore's state from its file too: gone, it leaves the
    shelf and nothing is taken from it; there, it is read and is llama.cpp's own state."""
    from engine.runtime import can_save_prefix
    prompt, answer, n_prompt, _text = made(arch)
    for spoiled in (False, True):
        folder = tmp_path / f"copy-{spoiled}"
        shutil.copytree(prompt.parent, folder)
        rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
        try:
            _restored(rt, folder / answer.name)
            assert rt._snapshots.at(rt.kv_tokens, n_prompt).still_in_file()
            if spoiled:
                (folder / prompt.name).unlink()
            with caplog.at_level(logging.WARNING, logger="engine"):
                kept = rt.snapshot_at(n_prompt)
            assert (kept is None) == spoiled and can_save_prefix(rt, n_prompt) == (not spoiled)
            assert rt._snapshots.at(rt.kv_tokens, n_prompt) is kept
            if not spoiled:
                rt.trim(n_prompt)   # llama.cpp's state there, after the prompt's own file
                expected = PromptSnapshot.take(rt.ctx, 0, rt.kv_tokens, None, recurrent_only=True)
                assert not kept.still_in_file() and kept.state_now().tobytes() == expected.state_now().tobytes()
        finally:
            rt.close()
    assert "cannot be had" in caplog.text


def _snapshot_in(path, tokens, n):
    """A snapshot whose state is the 16 bytes of ``path`` (not a real state: nothing walks it)."""
    return PromptSnapshot(n, tokens_digest(tokens[:n]), BytesInFile(path, 0, 16, crc32(bytes(16))), None,
                          recurrent_only=True)


@pytest.mark.parametrize("failure", [PermissionError(13, "held by another program"), MemoryError()])
def test_a_state_that_cannot_be_had_now_stays_on_the_shelf(failure, tmp_path, monkeypatch, caplog):
    """A read refused for the moment (Windows: another program holding the file open) or no
    memory for the copy: the next nearest state is used, that one stays for the next time,
    and putting it back leaves the sequence as it was."""
    from engine.checkpoints import file_bytes
    path = tmp_path / "held.bin"
    path.write_bytes(bytes(16))
    tokens = list(range(10))
    first = PromptSnapshot(4, tokens_digest(tokens[:4]), np.zeros(8, np.uint8), None, recurrent_only=True)
    held = _snapshot_in(path, tokens, 8)
    shelf = Shelf()
    shelf.add(first, tokens)
    shelf.add(held, tokens)

    def refused(*_args):
        raise failure
    monkeypatch.setattr(file_bytes, "read_at", refused)
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert shelf.nearest_had(tokens, 9) is first
        assert shelf.at_had(tokens, 8) is None

    class Context:   # a context that must not be touched
        def __getattr__(self, name):
            raise AssertionError(f"the sequence was touched: {name}")
    assert held.put_back(Context(), 0) is False
    assert len(shelf) == 2 and held.still_in_file() and "cannot be had now" in caplog.text
    monkeypatch.undo()
    assert shelf.at_had(tokens, 8) is held and not held.still_in_file()


def test_a_step_in_memory_is_preferred_to_a_state_still_in_its_file(tmp_path):
    """At one position, the shelf gives the state in memory (the step an autosave is written
    one token short from) before a restore's still in its file, which would cost a read."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(16))
    tokens = list(range(10))
    in_file = _snapshot_in(path, tokens, 8)
    step = PromptSnapshot(8, tokens_digest(tokens[:8]), np.zeros(8, np.uint8), None, recurrent_only=True)
    shelf = Shelf()
    shelf.add(in_file, tokens)
    shelf.keep_step(step)
    assert shelf.at(tokens, 8) is step and shelf.nearest(tokens, 9) is step
    assert in_file.still_in_file()
    shelf.nearest_had(tokens, 8)   # (its state read: now both are in memory, and the prompt's is first)
    in_file.state_now()
    assert shelf.at(tokens, 8) is in_file


def test_an_earlier_state_is_used_when_the_nearest_cannot_be_had(tmp_path, caplog):
    """The shelf's nearest state gone, the next nearest is put back (PromptSnapshot.state_now
    fails before the sequence is touched)."""
    path = tmp_path / "gone.bin"
    path.write_bytes(bytes(16))
    tokens = list(range(10))
    shelf = Shelf()
    first = PromptSnapshot(4, tokens_digest(tokens[:4]), np.zeros(8, np.uint8), None, recurrent_only=True)
    gone = _snapshot_in(path, tokens, 8)
    shelf.add(first, tokens)
    shelf.add(gone, tokens)
    path.unlink()
    with caplog.at_level(logging.WARNING, logger="engine"):
        assert shelf.nearest_had(tokens, 9) is first
    assert len(shelf) == 1 and "cannot be had" in caplog.text




@pytest.mark.parametrize("damage", ["none", "NaN", "+inf", "a byte"])
def test_a_snapshots_logits_left_in_their_file_are_checked_when_read(damage, tmp_path):
    """Logits a snapshot keeps in their file are read with its state, checked against their
    CRC and for NaN and +inf (-inf is a masked-out token); damaged, the snapshot cannot be had
    (CorruptState, so the shelf drops it) and stays as it was."""
    logits = np.linspace(-3, 3, 16, dtype="<f4")
    logits[2] = -np.inf
    if damage in ("NaN", "+inf"):
        logits[5] = np.nan if damage == "NaN" else np.inf
    raw = b"head" + logits.tobytes()
    path = tmp_path / "logits.bin"
    path.write_bytes(raw if damage != "a byte" else raw[:9] + bytes([raw[9] ^ 1]) + raw[10:])
    stored = BytesInFile(path, 4, len(raw) - 4, crc32(raw[4:]))
    snapshot = PromptSnapshot(3, tokens_digest([1, 2, 3]), np.zeros(8, np.uint8), stored)
    if damage == "none":
        snapshot.state_now()
        assert np.array_equal(snapshot.logits_now(), logits)
        return
    with pytest.raises(CorruptState, match="logits.bin"):
        snapshot.state_now()
    assert snapshot.logits is stored
