"""A restore's files are mapped on Windows too, and let go when the restore is done with them.

On Windows a mapped file can be neither replaced nor deleted (engine.checkpoints.mapped), so
there only a restore's read maps (``crc_later``), and whoever restores releases the chain
(engine.checkpoints.chain.release).  Here, on Linux, ``mapped.PINS_FILES`` is set as Windows
sets it, every state is mapped, and each mapping made is followed: the restores of the
window's engine and of prefix reuse must leave none open, and stay exact.  The same flows
run under Wine with Windows' own refusal to replace a mapped file (tests/test_windows_wine.py).
"""

from __future__ import annotations

import logging

import memkit
import pytest
from faultkit import synthetic

from engine.checkpoints import format as fmt
from engine.checkpoints import mapped
from engine.checkpoints.chain import load_chain, release

pytestmark = pytest.mark.skipif(not mapped.supported(), reason="this system does not map states")


@pytest.fixture
def pinned(monkeypatch, caplog):
    """Mappings as on Windows: only a restore's read maps; yields the mappings made (each
    ``(mapping, releasable)``); afterwards every one a restore made must be closed."""
    monkeypatch.setattr(mapped, "PINS_FILES", True)
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)
    made: list = []
    real = mapped.map_file

    def map_file(fileno, size, state_len, releasable, path, private=False):
        mapping = real(fileno, size, state_len, releasable, path, private)
        if mapping is not None:
            made.append((mapping, releasable))
        return mapping
    monkeypatch.setattr(mapped, "map_file", map_file)
    caplog.set_level(logging.WARNING, logger=fmt.__name__)
    yield made
    assert all(releasable for _m, releasable in made), "a read that nobody releases mapped its file"
    assert [m for m, _r in made if not m.closed] == [], "a restore left its file mapped"
    assert "stays mapped" not in caplog.text


def _file(tmp_path, n_tokens: int = 300):
    path = tmp_path / "m.kvckpt"
    path.write_bytes(synthetic.file_bytes(n_tokens))
    return path


def test_only_a_restores_read_maps_and_release_lets_the_file_go(tmp_path, pinned):
    path = _file(tmp_path)
    assert fmt.read_checkpoint(path).mapping is None and not pinned   # validate, import, export: a copy
    data = fmt.read_checkpoint(path, crc_later=True)
    expected = fmt.read_checkpoint(path).state.tobytes()
    assert data.mapping is not None and data.state.tobytes() == expected
    mapping = data.mapping
    data.settle()
    data.release()
    assert mapping.closed and data.released and len(data.state) == 0 and data.mapping is None
    assert data.tokens.size and data.meta   # what the writer and the store read of it stays
    data.release()   # again: nothing to do


def test_a_release_waits_for_the_checksum_reading_the_mapping(tmp_path, pinned, monkeypatch):
    monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)   # the helper thread reads the mapping
    data = fmt.read_checkpoint(_file(tmp_path), crc_later=True)
    assert data.pending_crc is not None
    data.release()   # no BufferError, no read of an unmapped page: it waits
    assert data.mapping is None
    data.settle()    # the verdict stays settle's


def test_a_view_still_held_keeps_the_mapping_until_it_goes(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(mapped, "PINS_FILES", True)
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)
    data = fmt.read_checkpoint(_file(tmp_path), crc_later=True)
    data.settle()
    mapping, kept = data.mapping, data.state[:10]
    with caplog.at_level(logging.WARNING, logger=fmt.__name__):
        data.release()
    assert "stays mapped" in caplog.text and not mapping.closed   # no crash; the view stays valid
    assert kept.tobytes() == bytes(mapping[data.header.state_offset:data.header.state_offset + 10])


def test_a_released_chain_is_not_restored_again(tiny_model_path, tmp_path, pinned):
    from test_point_states import _chat

    from engine.checkpoints.store import Store
    from engine.runtime import Runtime
    rt = Runtime(tiny_model_path("llama"), memkit.SETTINGS)
    try:
        conv, heads = _chat(rt, Store(tmp_path / "store"), turns=1)
        chain = load_chain(heads[-1].path, crc_later=True)
        assert chain[-1].mapping is not None
        rt.trim(0)
        rt.restore_chain(chain)
        assert rt.kv_tokens == conv.tokens
        release(chain)
        with pytest.raises(ValueError, match="released"):
            rt.restore_chain(chain)
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_prefix_reuse_at_a_point_releases_its_files_and_stays_exact(arch, tiny_model_path, tmp_path, pinned):
    """Another conversation's head restored to go back to one of its turn ends (a point whose
    recurrent state is read from the file after the release): the state is the one that
    turn's own file gives, byte for byte, and no file stays mapped."""
    from test_point_states import _state, reuse_a_turn_end_of_another_head

    from engine.runtime import Runtime
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        made = len(pinned)
        reuse, tokens, end, _head, own_file = reuse_a_turn_end_of_another_head(rt, tmp_path)
        assert (reuse.how, reuse.n_tokens) == ("restored", end), reuse.describe()
        assert len(pinned) > made and all(m.closed for m, _r in pinned)   # mapped, and let go
        assert all(d.released for d in reuse.chain)
        assert rt.prefill(tokens).n_decoded == len(tokens) - end
        reused = _state(rt.ctx)
        rt.trim(0)
        rt.restore_chain(load_chain(own_file))
        rt.prefill(tokens)
        assert _state(rt.ctx) == reused
    finally:
        rt.close()


def test_the_window_engine_releases_a_restored_head(tiny_model_path, tmp_path, pinned):
    """After a restart the window's engine restores a stored conversation's head to regenerate
    its answer (EngineWorker._activate): the same answer, and the head's files let go."""
    from test_point_states import _window_engine

    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    from engine.sampling import SamplerSettings
    store = Store(tmp_path / "store")
    sampler = SamplerSettings(seed=3, temperature=0.0, ignore_eos=True)
    with _window_engine(tiny_model_path("lfm2"), store) as (w, rec):
        a = w.new_conversation(sampler=sampler)
        for i, text in enumerate(("Tell me about rivers.", "And lakes?")):
            w.send(a, text, n_predict=6)
            rec.wait("finished", i + 1)
        last = rec.of("finished")[-1][1]
    head = Graph.scan(store.folder).heads_of(a)[0]
    with _window_engine(tiny_model_path("lfm2"), store) as (w, rec):   # a restart
        w.open_checkpoint(head.path)
        rec.wait("changed")
        assert pinned and all(m.closed for m, _r in pinned), "the opened head stayed mapped"
        made = len(pinned)
        w.regenerate(a)
        again = rec.wait("finished")[-1][1]
        assert again.text == last.text
        assert len(pinned) > made, "the head was not restored through a mapping"
        assert all(m.closed for m, _r in pinned)


def test_a_damaged_head_opened_in_the_window_is_refused_as_damaged(tiny_model_path, tmp_path, pinned, monkeypatch):
    """Opening a file restores it with its checksum computed while llama.cpp copies the state
    (then the file is let go): a byte flipped in the state is refused as damage, not used,
    and the conversation it belongs to goes on from its own intact head."""
    from enginekit import Recorder

    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions
    monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)   # every state checksummed beside the copy
    store = Store(tmp_path / "store")
    rec = Recorder()
    w = EngineWorker(rec, store)
    w.start()
    try:
        w.load_model(ModelOptions(tiny_model_path("llama"), n_ctx=1024, n_threads=2, sequences=2))
        rec.wait("loaded")
        a = w.new_conversation(sampler=SamplerSettings(seed=3, temperature=0.0, ignore_eos=True))
        w.send(a, "Tell me about rivers.", n_predict=6)
        rec.wait("finished", 1)
        rec.head_saved(a)
        head = Graph.scan(store.folder).heads_of(a)[0].path
        h = fmt.read_checkpoint(head).header
        damaged = tmp_path / "damaged.kvckpt"
        raw = bytearray(head.read_bytes())
        raw[h.state_offset + h.state_len // 2] ^= 0x40
        damaged.write_bytes(bytes(raw))
        w.open_checkpoint(damaged)
        message = rec.wait("error")[-1][2]
        assert "checksum" in message, message
        w.send(a, "And lakes?", n_predict=6)
        after = rec.wait("finished", 2)[-1][1]
        assert after.n_reused_tokens > 0   # its own head, restored
    finally:
        w.shutdown()
        assert w.join(60)
