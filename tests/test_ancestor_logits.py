"""The logits an earlier file of a restore's chain holds are neither read nor checksummed by
the restore (engine.checkpoints.format, Logits an earlier file holds): the metadata gives
their CRC, the payload CRC is checked through it, and they are read, checked, where they
are used after all (the chain's last file at the restore; a recurrent memory's snapshot,
where it goes back to it).

SmolLM2 (real weights: its prompt's file carries logits) and a tiny random-weight hybrid
(tests/tinymodels.py: a memory whose every file carries them); exactness is the restored
sequence's state and logits against a chain read whole.
"""

from __future__ import annotations

import shutil

import memkit
import numpy as np
import pytest
from test_own_recurrent_blocks import _flip, _state_and_logits

from engine.checkpoints import format as fmt
from engine.checkpoints import mapped
from engine.checkpoints.chain import load_chain, restoring
from engine.checkpoints.crc import combine, crc32
from engine.checkpoints.file_bytes import BytesInFile
from engine.checkpoints.format import (
    KIND_AUTOSAVE,
    KIND_MANUAL,
    KIND_PAUSE,
    encode_metadata,
    read_checkpoint,
    write_sections,
)
from engine.checkpoints.kvstate import check_file_states
from engine.checkpoints.store import Store
from engine.checkpoints.transfer import import_files
from engine.conversation import Conversation
from engine.errors import ChecksumMismatch, CorruptMetadata
from engine.generation import begin_answer, commit_answer, generate
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from native.context import ContextSettings

MODELS = ["smollm", "qwen35"]


@pytest.fixture(params=["mapped", "copying"])
def reader(request, monkeypatch):
    """Both readers: a mapping (Linux, Windows) and a copy (macOS), which skip them alike."""
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0 if request.param == "mapped" else 1 << 62)
    assert combine is not None, "python-isal's crc32_combine: every platform shipped has it"
    return request.param


def _runtime(model, smollm_path, tiny_model_path) -> Runtime:
    if model == "smollm":
        return Runtime(smollm_path, ContextSettings(n_ctx=1024, n_threads=2))
    return Runtime(tiny_model_path(model), memkit.SETTINGS)


@pytest.fixture(scope="module")
def made(smollm_path, tiny_model_path, tmp_path_factory):
    """Per model: two turns as files, each on the one before: the first prompt's file (an
    autosave at its end), the first answer's (finished), the second answer's (a pause)."""
    cache = {}

    def make(model):
        if model not in cache:
            folder = tmp_path_factory.mktemp(model)
            rt = _runtime(model, smollm_path, tiny_model_path)
            try:
                conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
                begin_answer(conv, rt, "Name a river.", n_predict=6)
                rt.prefill(conv.tokens)
                prompt = rt.save(folder / "prompt.kvckpt", conv, KIND_AUTOSAVE)
                generate(rt, conv)
                commit_answer(conv)
                first = rt.save(folder / "first.kvckpt", conv, KIND_MANUAL, parent=prompt)
                begin_answer(conv, rt, "And another?", n_predict=6)
                generate(rt, conv)
                second = rt.save(folder / "second.kvckpt", conv, KIND_PAUSE, parent=first)
            finally:
                rt.close()
            cache[model] = (prompt.path, first.path, second.path)
        return cache[model]
    return make


def _copy(paths, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(paths[0].parent, folder)
    return [folder / p.name for p in paths]


def _logits_offset(path) -> int:
    return read_checkpoint(path, load_state=False).header.logits_offset


def _restore(rt, chain):
    with restoring(chain):
        rt.restore_chain(chain)
    return _state_and_logits(rt)


@pytest.mark.parametrize("model", MODELS)
def test_a_file_with_logits_gives_their_crc(model, made):
    """Every file that carries logits says their CRC32 in its metadata (as validation checks
    it); a file without logits says nothing of them."""
    carrying = 0
    for path in made(model):
        data = read_checkpoint(path)
        if data.logits is None:
            assert "logits_crc32" not in data.meta, path.name
            continue
        carrying += 1
        assert data.meta["logits_crc32"] == crc32(data.logits.astype("<f4").tobytes()), path.name
        check_file_states(data)
    # SmolLM2: the prompt's (a batch-decoded last token) and the pause's; the hybrid: every file's
    assert carrying == (2 if model == "smollm" else 3)


@pytest.mark.parametrize("model", MODELS)
def test_a_restore_reads_no_logits_of_an_earlier_file_it_does_not_keep(model, made, reader, smollm_path,
                                                                       tiny_model_path, monkeypatch):
    """Restoring the second answer's chain reads the first prompt's logits not at all (the
    read skips them, and nothing reads them after), nor the first answer's: the attention
    memory keeps no snapshot, and the hybrid's, where its Regenerate goes back to, keeps
    them where they are with its recurrent state, read when it goes back there (and then
    the file's own).  The result is exactly that of the chain read whole."""
    prompt, first, second = made(model)
    rt = _runtime(model, smollm_path, tiny_model_path)
    try:
        whole = _restore(rt, load_chain(second))
        rt.trim(0)
        reads = []
        real = fmt.CheckpointData.read_logits
        monkeypatch.setattr(fmt.CheckpointData, "read_logits",
                            lambda self: (reads.append(self.path.name) if self.unread_logits else None, real(self))[1])
        chain = load_chain(second, crc_later=True)
        assert chain[0].logits is None and chain[0].unread_logits == (chain[0].meta["logits_crc32"],
                                                                       _logits_offset(prompt))
        assert chain[-1].logits is not None and chain[-1].unread_logits is None   # the last file's: read
        assert _restore(rt, chain) == whole
        assert chain[0].logits is None and chain[0].unread_logits is not None
        assert reads == [] and chain[1].logits is None
        if model == "qwen35":
            kept = rt._snapshots.at(rt.kv_tokens, chain[1].header.n_tokens)
            assert kept is not None and isinstance(kept.logits, BytesInFile) and kept.logits.path == first
            kept.state_now()
            assert np.array_equal(kept.logits_now(), read_checkpoint(first).logits)
        else:
            assert "logits_crc32" not in chain[1].meta
    finally:
        rt.close()


@pytest.mark.parametrize("model", MODELS)
def test_damaged_logits_of_an_earlier_file_are_not_needed_and_validation_finds_them(
        model, made, reader, smollm_path, tiny_model_path, tmp_path):
    """A byte of the first prompt's logits damaged: the second answer's chain restores exactly
    as the undamaged one (before: refused as damaged, for bytes it never uses); reading the
    file whole (validate, an export, the prompt's own restore) still finds the damage."""
    paths = _copy(made(model), tmp_path)
    rt = _runtime(model, smollm_path, tiny_model_path)
    try:
        clean = _restore(rt, load_chain(paths[2], crc_later=True))
        _flip(paths[0], _logits_offset(paths[0]) + 4 * 17 + 2)
        rt.trim(0)
        assert _restore(rt, load_chain(paths[2], crc_later=True)) == clean
        with pytest.raises(ChecksumMismatch):
            read_checkpoint(paths[0])
        with pytest.raises(ChecksumMismatch):
            load_chain(paths[0], crc_later=True)[0].settle()   # the prompt as a chain's last: read whole
    finally:
        rt.close()


def test_damaged_logits_of_a_kept_snapshot_are_found_where_it_is_used(made, reader, smollm_path,
                                                                     tiny_model_path, tmp_path, monkeypatch):
    """The hybrid's first answer is where its Regenerate goes back to: the restore keeps that
    file's logits there with its recurrent state, so their damage is not the restore's (it is
    exactly the undamaged one) but going back's: the snapshot cannot be had, leaves the
    shelf, and the sequence keeps no cell of it.  Restoring the chain up to that file (an
    Edit, ``--from-turn``) reads them as the last file's: refused, naming the damage, before
    llama.cpp sees a byte and with the sequence as it was (the prompt's file, restored
    before)."""
    paths = _copy(made("qwen35"), tmp_path)
    rt = _runtime("qwen35", smollm_path, tiny_model_path)
    try:
        clean = _restore(rt, load_chain(paths[2], crc_later=True))
        _flip(paths[1], _logits_offset(paths[1]) + 4 * 5 + 1)
        rt.trim(0)
        chain = load_chain(paths[2], crc_later=True)
        n = chain[1].header.n_tokens
        assert _restore(rt, chain) == clean
        assert rt._snapshots.at(rt.kv_tokens, n) is not None
        assert rt.trim(n) < n and rt._snapshots.at(rt.kv_tokens, n) is None
        rt.trim(0)
        _restore(rt, load_chain(paths[0], crc_later=True))
        for token in (rt.kv_tokens[-1], rt.kv_tokens[-2]):   # the cache goes on past the prompt's file
            rt.decode_token(token)
        before, tokens = _state_and_logits(rt), list(rt.kv_tokens)
        sets: list[object] = []
        real = rt.ctx.state_set_from
        monkeypatch.setattr(rt.ctx, "state_set_from", lambda *args: (sets.append(args), real(*args))[1])
        chain = load_chain(paths[2], crc_later=True)
        with pytest.raises(ChecksumMismatch), restoring(chain):
            rt.restore_chain(chain[:2])
        assert sets == [] and list(rt.kv_tokens) == tokens and _state_and_logits(rt) == before
    finally:
        rt.close()


@pytest.mark.parametrize("model", MODELS)
def test_a_chain_restored_up_to_an_earlier_file_has_that_files_logits(model, made, reader, smollm_path,
                                                                     tiny_model_path):
    """``--from-turn`` and an Edit restore a chain read for its last file up to an earlier one:
    that file's logits, left unread, are read then, and the sequence holds them."""
    prompt, first, second = made(model)
    rt = _runtime(model, smollm_path, tiny_model_path)
    try:
        chain = load_chain(second, crc_later=True)
        assert chain[0].logits is None
        with restoring(chain):
            rt.restore_chain(chain[:1])
        assert np.array_equal(rt.logits(), read_checkpoint(prompt).logits)
    finally:
        rt.close()


def _rewritten(src, dest, change) -> None:
    """``src`` written again as ``dest`` with its metadata changed by ``change`` (a valid file
    whose payload CRC is that of its bytes)."""
    data = read_checkpoint(src)
    meta = dict(data.meta)
    change(meta)
    with open(dest, "wb") as out:
        write_sections(out, data.header, encode_metadata(meta), data.tokens, data.logits, data.state)


@pytest.mark.parametrize("model", MODELS)
def test_a_wrong_logits_crc_is_refused_and_a_file_without_one_is_read_whole(model, made, reader, tmp_path):
    """A file whose metadata gives a wrong CRC of its logits: read whole it is intact, but
    validation and import refuse it, and read as an earlier file it fails its payload CRC
    (never the wrong logits taken for right ones).  A file from before the key reads its
    logits as an earlier file too."""
    prompt = made(model)[0]
    liar, old = tmp_path / "liar.kvckpt", tmp_path / "old.kvckpt"
    _rewritten(prompt, liar, lambda meta: meta.update(logits_crc32=meta["logits_crc32"] ^ 1))
    _rewritten(prompt, old, lambda meta: meta.pop("logits_crc32"))
    data = read_checkpoint(liar)
    with pytest.raises(CorruptMetadata, match="logits"):
        check_file_states(data)
    (imported,) = import_files([liar], Store(tmp_path / "store"))
    assert not imported.ok and "logits" in imported.reason
    with pytest.raises(ChecksumMismatch):
        read_checkpoint(liar, crc_later=True, ancestor=True).settle()
    data = read_checkpoint(old, crc_later=True, ancestor=True)
    data.settle()
    assert data.unread_logits is None and np.array_equal(data.logits, read_checkpoint(prompt).logits)
