"""A file's own recurrent block, which a restore replaces with a later file's, is neither
read nor checksummed by it (engine.checkpoints.format, The file's own recurrent block):
its metadata gives the block's CRC, the payload CRC is checked around it, and the block is
checked where it is used after all (set as a chain's last state, or read to go back to).

Tiny random-weight models of every memory with a recurrent part (tests/tinymodels.py);
exactness is the restored sequence's state and logits against an undamaged chain's.
"""

from __future__ import annotations

import io
import shutil

import memkit
import numpy as np
import pytest
import test_states_left_in_files

from engine.checkpoints import mapped
from engine.checkpoints.chain import load_chain, restoring
from engine.checkpoints.crc import combine, crc32
from engine.checkpoints.format import encode_metadata, read_checkpoint, write_sections
from engine.checkpoints.kvstate import check_state_for, recurrent_block_len
from engine.errors import BrokenChain, ChecksumMismatch, CorruptState
from engine.restore import _set_whole
from engine.runtime import Runtime

ARCHS = ["qwen35", "mamba2", "lfm2", "granitehybrid"]

#: per arch: a prompt's file, the answer's file on it, the prompt's length, the answer
made = test_states_left_in_files.made


@pytest.fixture(autouse=True)
def _mapped(monkeypatch):
    """The tiny models' states are small: mapped as a large one is (where this OS can)."""
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)
    assert combine is not None, "python-isal's crc32_combine: every platform shipped has it"


def _copy(made, arch, tmp_path):
    prompt, answer, *_rest = made(arch)
    folder = tmp_path / "copy"
    shutil.copytree(prompt.parent, folder)
    return folder / prompt.name, folder / answer.name


def _block_of(path) -> tuple[int, int]:
    """Where the recurrent block ending a file's llama.cpp state lies: (file offset, length)."""
    data = read_checkpoint(path)
    block = recurrent_block_len(check_state_for(data.header, data.state))
    return data.header.state_offset + len(data.state) - block, block


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))


def _state_and_logits(rt) -> tuple[bytes, bytes]:
    ctx = rt.ctx
    size = ctx.state_size(0)
    buf = np.empty(size, dtype=np.uint8)
    return bytes(buf[:ctx.state_get_into(buf, size, 0)]), np.asarray(rt.logits()).tobytes()


def _restore(rt, chain):
    with restoring(chain):
        rt.restore_chain(chain)
    return _state_and_logits(rt)


def _restored_then_read_again(rt, answer):
    """The answer's chain restored (its state and logits), the sequence emptied, and the
    chain read again for the test to restore its own way."""
    restored = _restore(rt, load_chain(answer, crc_later=True))
    rt.trim(0)
    return restored, load_chain(answer, crc_later=True)


@pytest.mark.parametrize("arch", [*ARCHS, "llama"])
def test_a_file_gives_its_own_recurrent_blocks_length_and_crc(arch, made):
    """Every file with a recurrent state says where its block is and its CRC32; a plain
    attention memory's say nothing."""
    for path in made(arch)[:2]:
        data = read_checkpoint(path)
        layout = check_state_for(data.header, data.state)
        if layout.recurrent is None:
            assert "recurrent_block" not in data.meta, path.name
            continue
        block = recurrent_block_len(layout)
        assert data.meta["recurrent_block"] == {"len": block, "crc32": crc32(data.state.tobytes()[-block:])}


@pytest.mark.parametrize("arch", ARCHS)
def test_a_restore_neither_reads_nor_checks_an_ancestors_block_it_replaces(arch, made, tiny_model_path,
                                                                        tmp_path, monkeypatch):
    """A byte of the prompt's block damaged: restoring the answer's chain does not use that
    block, so it gives exactly the undamaged chain's state and logits (before: refused as
    damaged); the block's pages were never mapped in, nor its bytes checksummed.  Where the
    restore sets the block after all (a memory whose attention cells are the larger part:
    copying them out would cost more), it is checked, and the damage found."""
    prompt, answer = _copy(made, arch, tmp_path)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        clean = _restore(rt, load_chain(answer, crc_later=True))
        offset, length = _block_of(prompt)
        _flip(prompt, offset + 33)   # a byte of the first R row (after the block's 20 bytes, its 12)
        calls: list[tuple[object, int, int]] = []
        real = mapped.populate
        monkeypatch.setattr(mapped, "populate", lambda m, start, n: (calls.append((m, start, n)), real(m, start, n))[1])
        monkeypatch.setattr(mapped, "in_page_cache", lambda *a: True)
        chain = load_chain(answer, crc_later=True)
        assert chain[0].unread_recurrent == (chain[0].meta["recurrent_block"]["crc32"], length)
        assert chain[-1].unread_recurrent is None   # the last file's block is set: checked as ever
        if chain[0].mapping is not None:
            mine = [(start, n) for m, start, n in calls if m is chain[0].mapping]
            assert mine and not any(start < offset + length and offset < start + n for start, n in mine), mine
        rt.trim(0)
        layout = check_state_for(chain[0].header, chain[0].state)
        if 0 not in _set_whole(chain, set(), [layout, None]):   # (the answer: the last file)
            assert _restore(rt, chain) == clean
        else:
            with pytest.raises(BrokenChain, match=f"{prompt.name} is damaged"):
                _restore(rt, chain)
    finally:
        rt.close()


@pytest.mark.parametrize("where", ["row", "row header"])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_block_left_unchecked_is_checked_where_it_is_set_after_all(arch, where, made, tiny_model_path, tmp_path,
                                                                     monkeypatch):
    """Restoring the chain up to the prompt's file (an Edit, ``--from-turn``: the prompt's
    state set whole): its block is checked then — intact, the state is the prompt file's own;
    damaged, the restore fails as damaged and the sequence is left empty; and walked, which
    the walk of an earlier file left undone: a damaged row header refuses it before llama.cpp
    sees a byte."""
    prompt, answer = _copy(made, arch, tmp_path)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        alone = _restore(rt, load_chain(prompt, crc_later=True))
        rt.trim(0)
        chain = load_chain(answer, crc_later=True)
        assert chain[0].unread_recurrent is not None
        assert _restore(rt, chain[:1]) == alone
        offset, length = _block_of(prompt)
        _flip(prompt, offset + (33 if where == "row" else 20))
        chain = load_chain(answer, crc_later=True)
        rt.trim(0)
        sets: list[object] = []
        real = rt.ctx.state_set_from
        monkeypatch.setattr(rt.ctx, "state_set_from", lambda *args: (sets.append(args), real(*args))[1])
        with pytest.raises(ChecksumMismatch), restoring(chain[:1]):
            rt.restore_chain(chain[:1])
        assert rt.kv_tokens == [] and (sets == []) == (where == "row header")
    finally:
        rt.close()


@pytest.mark.parametrize("where", ["head", "row header", "before the block"])
@pytest.mark.parametrize("arch", ARCHS)
def test_damage_the_walk_or_the_payload_crc_finds_is_named_as_damage(arch, where, made, tiny_model_path, tmp_path,
                                                                     monkeypatch):
    """The walk of an earlier file reads its unread block's head alone (its length is the
    model's rows'): a damaged row header is neither read nor needed where the block is not
    set (the restore is exactly the undamaged chain's), and stops the walk where it is (the
    block is walked before it is set); a damaged head stops the walk, which read those bytes
    unchecked.  Either way the block is checked and the restore says the prompt's file is
    damaged, before llama.cpp sees a byte.  A damaged byte before the block fails the payload
    CRC checked around it."""
    prompt, answer = _copy(made, arch, tmp_path)
    offset, _length = _block_of(prompt)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        clean, chain = _restored_then_read_again(rt, answer)
        layout = check_state_for(chain[0].header, chain[0].state)
        set_whole = 0 in _set_whole(chain, set(), [layout, None])
        # the block: a cell count, one cell (pos, n_seq_id), s_trans, n_layer, then layer 0's type
        _flip(prompt, {"head": offset + 8, "row header": offset + 20,
                       "before the block": read_checkpoint(prompt).header.state_offset + 2}[where])
        chain = [] if where == "before the block" else load_chain(answer, crc_later=True)
        if where == "row header" and not set_whole:
            assert _restore(rt, chain) == clean
            return
        sets = []
        monkeypatch.setattr(rt.ctx, "state_set_from", lambda *args: sets.append(args))
        with pytest.raises(BrokenChain, match=f"{prompt.name} is damaged"):
            chain = chain or load_chain(answer, crc_later=True)
            with restoring(chain):
                rt.restore_chain(chain)
        assert sets == []
    finally:
        rt.close()


def _rewritten(path, out, change) -> None:
    """``path`` written again to ``out`` with its metadata changed by ``change(meta, state)``."""
    data = read_checkpoint(path)
    meta = dict(data.meta)
    change(meta, data.state.tobytes())
    buf = io.BytesIO()
    write_sections(buf, data.header, encode_metadata(meta), data.tokens, data.logits, data.state,
                   point_states=(data.point_states,) if len(data.point_states) else ())
    out.write_bytes(buf.getvalue())


def test_a_block_the_metadata_misplaces_is_refused_and_one_it_omits_is_checked(made, tiny_model_path, tmp_path):
    """A file whose metadata claims a longer block than its state ends with (attention cells
    would go unchecked into llama.cpp) is refused; a file without the key (written before
    it) is checksummed whole, and restores."""
    prompt, _answer, *_rest = made("qwen35")

    def longer(meta, state):
        n = meta["recurrent_block"]["len"] + 4
        meta["recurrent_block"] = {"len": n, "crc32": crc32(state[-n:])}

    liar, old = tmp_path / "liar.kvckpt", tmp_path / "old.kvckpt"
    _rewritten(prompt, liar, longer)
    _rewritten(prompt, old, lambda meta, _state: meta.pop("recurrent_block"))
    rt = Runtime(tiny_model_path("qwen35"), memkit.SETTINGS)
    try:
        data = read_checkpoint(liar, crc_later=True, ancestor=True)
        assert data.unread_recurrent is not None
        with pytest.raises(CorruptState, match="is not the one its state ends with"), restoring([data]):
            rt.restore_chain([data])
        data = read_checkpoint(old, crc_later=True, ancestor=True)
        assert data.unread_recurrent is None
        with restoring([data]):
            rt.restore_chain([data])
        assert rt.kv_tokens == read_checkpoint(prompt).tokens.tolist()
    finally:
        rt.close()


def test_a_known_state_tail_crc_gives_the_same_file(made):
    """write_sections with the block's CRC given (a save computes it for the metadata) writes
    the bytes it writes computing every CRC itself."""
    data = read_checkpoint(made("qwen35")[0])
    meta = encode_metadata(data.meta)
    block = data.meta["recurrent_block"]
    files = []
    for tail in (None, (block["crc32"], block["len"])):
        buf = io.BytesIO()
        _header, crc = write_sections(buf, data.header, meta, data.tokens, data.logits, data.state, state_tail_crc=tail)
        files.append((buf.getvalue(), crc))
    assert files[0] == files[1] and files[0][1] == data.payload_crc


@pytest.mark.parametrize("prefetch_only", [False, True], ids=["linux", "windows"])
def test_a_blocks_pages_are_mapped_in_only_where_the_disk_must_be_read_and_never_on_windows(
        prefetch_only, made, tmp_path, monkeypatch):
    """A cold file (the page cache said to hold none of it): Linux maps the block left unread
    in at the read (a read error is then the reader's, not SIGBUS); Windows, where a page is
    only prefetched and a file with a view cannot shrink, leaves it alone (a prefetch of a
    cold file would read from the disk what is most likely never used)."""
    if not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here: the state is read, not mapped")
    prompt, answer = _copy(made, "qwen35", tmp_path)
    offset, length = _block_of(prompt)
    calls: list[tuple[object, int, int]] = []
    real = mapped.populate
    monkeypatch.setattr(mapped, "populate", lambda m, start, n: (calls.append((m, start, n)), real(m, start, n))[1])
    monkeypatch.setattr(mapped, "in_page_cache", lambda *a: False)
    monkeypatch.setattr(mapped, "PREFETCH_ONLY", prefetch_only)
    chain = load_chain(answer, crc_later=True)
    try:
        assert chain[0].unread_recurrent is not None
        mine = [(start, n) for m, start, n in calls if m is chain[0].mapping]
        covered = sum(max(0, min(start + n, offset + length) - max(start, offset)) for start, n in mine)
        assert covered == (0 if prefetch_only else length), (mine, offset, length)
    finally:
        chain[0].release()
        chain[1].release()


def test_a_block_checked_once_is_not_checked_again(made, tmp_path, monkeypatch):
    """Once a block left unread has been checked (it was set), the file holds no unchecked
    bytes, and the CRC a snapshot in its file is checked against is the metadata's, not
    computed again over 50 MB on the restoring thread."""
    prompt, answer = _copy(made, "qwen35", tmp_path)
    chain = load_chain(answer, crc_later=True)
    first = chain[0]
    assert first.holds_unchecked_bytes()
    first.check_recurrent_later()
    first.settle()
    assert not first.holds_unchecked_bytes()
    from engine.checkpoints import format as fmt
    _offset, length = _block_of(prompt)
    monkeypatch.setattr(fmt, "crc32", lambda *a: pytest.fail("checksummed again"))
    assert first.crc_of_state_tail(len(first.state) - length) == first.meta["recurrent_block"]["crc32"]
    chain[0].release()
    chain[1].release()


@pytest.mark.parametrize("wrong", ["crc32", "len"])
def test_validate_and_import_refuse_a_block_the_metadata_misstates(wrong, made, tiny_model_path, tmp_path, capsys):
    """A file whose metadata gives its recurrent block a wrong CRC or length restores as the
    last of a chain (every byte checked) but would be refused as an earlier one: `validate`
    and import's check find it."""
    from types import SimpleNamespace

    from engine.checkpoints.kvstate import check_file_states
    from engine.checkpoints.transfer import CORRUPT, check_file
    from engine.cli.files import cmd_validate
    prompt, *_rest = made("qwen35")

    def misstate(meta, state):
        block = dict(meta["recurrent_block"])
        block[wrong] += 1 if wrong == "crc32" else 4
        meta["recurrent_block"] = block

    bad = tmp_path / "bad.kvckpt"
    _rewritten(prompt, bad, misstate)
    with pytest.raises(CorruptState, match="not the one its state ends with"):
        check_file_states(read_checkpoint(bad))
    assert check_file(bad, None).status == CORRUPT
    assert cmd_validate(SimpleNamespace(path=str(bad), model=None)) != 0
    assert "FAILED" in capsys.readouterr().err
    good = tmp_path / "good.kvckpt"
    _rewritten(prompt, good, lambda meta, state: None)
    check_file_states(read_checkpoint(good))
    assert cmd_validate(SimpleNamespace(path=str(good), model=None)) == 0


HYBRIDS = [arch for arch in ARCHS if arch != "mamba2"]


def _first_set(rt, chain, monkeypatch, tail_len: int) -> tuple[int, int, bytes]:
    """Restore ``chain`` (its files still held): the address, size and last ``tail_len``
    bytes of the first state llama.cpp is given; the earlier file's state bytes are checked
    to be its file's again after the restore."""
    seen = []
    real = rt.ctx.state_set_from

    def spy(buffer, size, seq, *flags):
        at = np.frombuffer(buffer, dtype=np.uint8)
        seen.append((at.ctypes.data, size, at[size - tail_len:size].tobytes()))
        return real(buffer, size, seq, *flags)

    with monkeypatch.context() as m:
        m.setattr(rt.ctx, "state_set_from", spy)
        with restoring(chain):
            rt.restore_chain(chain)
            assert chain[0].overwritten is None
            assert chain[0].state.tobytes() == read_checkpoint(chain[0].path).state.tobytes()
    return seen[0]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_a_hybrids_earlier_file_gives_its_attention_part_from_its_own_mapping(arch, made, tiny_model_path,
                                                                             tmp_path, monkeypatch):
    """The prompt's file of the answer's chain is set without its recurrent state (the
    answer's replaces it) straight from its mapping, an empty recurrent block written over
    the start of its own: no copy of its attention cells.  The sequence is exactly what the
    copy gives; the mapping holds the file's bytes again after, and the file is untouched."""
    if not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here: the state is read, not mapped")
    from engine.checkpoints.format import CheckpointData
    from engine.checkpoints.kvstate import emptied_block
    prompt, answer = _copy(made, arch, tmp_path)
    before = prompt.read_bytes()
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        with monkeypatch.context() as m:
            m.setattr(CheckpointData, "sets_tail_in_place", lambda self: False)
            copied, chain = _restored_then_read_again(rt, answer)
        first = chain[0]
        layout = check_state_for(first.header, first.state)
        cut, empty = emptied_block(len(first.state), layout, first.header.n_layer)
        assert 0 not in _set_whole(chain, set(), [layout, None])
        whole = np.frombuffer(first.mapping, dtype=np.uint8)
        low, high = whole.ctypes.data, whole.ctypes.data + len(whole)
        del whole
        at, size, tail = _first_set(rt, chain, monkeypatch, len(empty))
        assert low <= at < high and size == cut + len(empty) and tail == empty
        assert _state_and_logits(rt) == copied
        assert prompt.read_bytes() == before
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_the_files_bytes_are_back_when_llama_cpp_refuses_the_part_set_in_place(arch, made, tiny_model_path,
                                                                               tmp_path, monkeypatch):
    """llama.cpp refusing the attention part set from the mapping: the restore fails, and the
    mapping holds the file's bytes again; the same chain read again restores."""
    from engine.errors import RestoreFailed
    from native.errors import StateError
    _prompt, answer = _copy(made, arch, tmp_path)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        clean, chain = _restored_then_read_again(rt, answer)

        def refuse(*args):
            raise StateError("refused")

        with restoring(chain):
            in_place = chain[0].sets_tail_in_place()
            with monkeypatch.context() as m, pytest.raises(RestoreFailed):
                m.setattr(rt.ctx, "state_set_from", refuse)
                rt.restore_chain(chain)
            assert chain[0].overwritten is None
            assert chain[0].state.tobytes() == read_checkpoint(chain[0].path).state.tobytes()
        assert in_place == mapped.supported()
        assert _restore(rt, load_chain(answer, crc_later=True)) == clean
    finally:
        rt.close()


def test_only_a_block_nothing_reads_is_written_over(made, tmp_path):
    """The tail is written in place only over the block of an earlier file the read left
    unread and nothing checks meanwhile, in a mapping: not the last file's (the payload's
    checksum reads it), not once its check is queued, never before the block."""
    if not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here: the state is read, not mapped")
    from engine.checkpoints.kvstate import emptied_block
    _prompt, answer = _copy(made, "qwen35", tmp_path)
    chain = load_chain(answer, crc_later=True)
    with restoring(chain):
        first = chain[0]
        cut, empty = emptied_block(len(first.state), check_state_for(first.header, first.state), first.header.n_layer)
        assert first.sets_tail_in_place() and not chain[1].sets_tail_in_place()
        with pytest.raises(ValueError, match="outside the unread recurrent block"):
            first.state_with_tail(cut - 1, empty)
        with pytest.raises(ValueError, match="read-only"):
            first.state[-1] = 0   # the arrays over the private mapping are read-only
        first.check_recurrent_later()
        assert not first.sets_tail_in_place() and first.state_with_tail(cut, empty) is None
        first.settle()


def test_only_the_files_written_over_are_mapped_privately(made, tmp_path):
    """A private mapping is charged for its whole size against the commit limit (Windows):
    only an earlier file whose block the restore leaves unread, the one it may write over,
    is mapped so; the chain's last file, and a file read whole, are mapped read-only."""
    if not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here: the state is read, not mapped")
    prompt, answer = _copy(made, "qwen35", tmp_path)
    chain = load_chain(answer, crc_later=True)
    with restoring(chain):
        first, last = chain[0].mapping, chain[1].mapping
        assert first is not None and last is not None
        first[0:1] = first[0:1]   # its own copy of the page: the file is not written
        with pytest.raises(TypeError):
            last[0:1] = last[0:1]
    whole = read_checkpoint(prompt, crc_later=True)
    try:
        assert whole.mapping is not None
        with pytest.raises(TypeError):
            whole.mapping[0:1] = whole.mapping[0:1]
    finally:
        whole.settle()
        whole.release()


@pytest.mark.parametrize("where", ["writing over the first file", "setting the second"])
@pytest.mark.parametrize("error", [OSError(5, "Input/output error"), KeyboardInterrupt()])
def test_an_error_while_a_chain_is_set_empties_the_sequence_and_puts_the_bytes_back(error, where, made,
                                                                                   tiny_model_path, tmp_path,
                                                                                   monkeypatch):
    """A read error of the page written over (a disk failing under it), or an interrupt,
    while the earlier file is set or after it: the error goes on as it is, the sequence
    keeps nothing of the restore (the first file's cells included), and the mapping holds
    the file's bytes again."""
    from engine.checkpoints.format import CheckpointData
    _prompt, answer = _copy(made, "lfm2", tmp_path)
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        chain = load_chain(answer, crc_later=True)
        nothing = rt.ctx.state_size(0), rt.ctx.state_size(1)   # (a hybrid's pos_max says -1 without a recurrent state)
        real_tail, real_set, sets = CheckpointData.state_with_tail, rt.ctx.state_set_from, []

        def tail_fails(self, cut, tail):
            real_tail(self, cut, tail)
            raise error

        def second_fails(*args):
            sets.append(args[1])
            if len(sets) == 2:
                raise error
            return real_set(*args)

        with restoring(chain):
            with monkeypatch.context() as m, pytest.raises(type(error)):
                if where == "setting the second":
                    m.setattr(rt.ctx, "state_set_from", second_fails)
                else:
                    m.setattr(CheckpointData, "state_with_tail", tail_fails)
                rt.restore_chain(chain)
            assert chain[0].overwritten is None
            assert rt.kv_tokens == [] and (rt.ctx.state_size(0), rt.ctx.state_size(1)) == nothing
        assert len(sets) == (2 if where == "setting the second" else 0)
    finally:
        rt.close()
