"""A recurrent or hybrid conversation of many turns restores from one file: its head
absorbs the turns before it, each turn end kept as a point that carries the recurrent part
of the state there (engine.checkpoints.points), which an Edit, a fork or ``--from-turn``
puts back before dropping the attention cells past it.

Tiny random-weight models (tests/tinymodels.py) on every recurrent and hybrid
architecture; exactness is the sequence state's bytes and the next answer's text, compared
with the same conversation saved a file per turn (how it was stored before).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import struct

import memkit
import numpy as np
import pytest
from conftest import run_cli
from tinymodels import ARCHS, KIND

from engine.branches import turn_end
from engine.checkpoints import format as ckpt_format
from engine.checkpoints.chain import load_chain
from engine.checkpoints.crc import crc32
from engine.checkpoints.format import (
    HEADER_LEN,
    KIND_MANUAL,
    TRAILER_MAGIC,
    pack_header,
    read_checkpoint,
    write_sections,
)
from engine.checkpoints.graph import Graph
from engine.checkpoints.points import Point, point_at, points_of, recurrent_crcs, recurrent_lengths
from engine.checkpoints.store import Store
from engine.checkpoints.transfer import export_copy
from engine.conversation import Conversation
from engine.errors import ChecksumMismatch, CorruptMetadata, SaveFailed
from engine.generation import begin_answer, commit_answer, generate
from engine.history import ChainPolicy, LineWriter
from engine.parallel import ParallelRuntime
from engine.runtime import Runtime, relabel_as
from engine.sampling import SamplerSettings

WITH_RECURRENT = [a for a in ARCHS if KIND[a] != "attention"]
TURNS = 4


def _chat(rt, store: Store, policy: ChainPolicy | None = None, turns: int = TURNS):
    """``turns`` turns as the window makes them (a head after each answer)."""
    conv, heads, _writer = _chat_with_writer(rt, store, policy, turns)
    return conv, heads


def _chat_with_writer(rt, store: Store, policy: ChainPolicy | None = None, turns: int = TURNS):
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    writer = LineWriter(rt, store, "line", policy=policy or ChainPolicy())
    heads = []
    for i in range(turns):
        begin_answer(conv, rt, f"Question {i}: name a river and a hill.", n_predict=6)
        generate(rt, conv)
        commit_answer(conv)
        heads.append(writer.save_head(conv, KIND_MANUAL))
    return conv, heads, writer


def _state(ctx, seq: int = 0) -> bytes:
    size = ctx.state_size(seq)
    buf = np.empty(size, dtype=np.uint8)
    return bytes(buf[:ctx.state_get_into(buf, size, seq)])


def _edit(rt, files, n, point, messages) -> tuple[bytes, str]:
    """Restore ``files``, go back to ``n`` (``point``: its recurrent state put back), then
    ask another question: the state there and the new answer."""
    conv = rt.restore_chain(files)
    assert rt.trim(n, point) == n
    assert rt.kv_tokens == [int(t) for t in files[-1].tokens[:n]]
    state = _state(rt.ctx)
    conv.tokens, conv.messages, conv.answer = conv.tokens[:n], list(messages), None
    begin_answer(conv, rt, "Instead: name a mountain.", n_predict=6)
    return state, generate(rt, conv).text


@pytest.fixture(scope="module")
def layouts(tiny_model_path, tmp_path_factory):
    """Per arch: the conversation, its merged chain (now) and its chain of a file per turn
    (before), written in one Runtime."""
    made = {}

    def layout(arch: str):
        if arch not in made:
            folder = tmp_path_factory.mktemp(arch)
            rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
            try:
                conv, heads = _chat(rt, Store(folder / "now"))
                before, old_heads = _chat(rt, Store(folder / "before"), ChainPolicy(merge_turns=False))
            finally:
                rt.close()
            assert conv.tokens == before.tokens   # greedy: the same conversation either way
            made[arch] = (conv, load_chain(heads[-1].path), load_chain(old_heads[-1].path), folder)
        return made[arch]
    return layout


@pytest.mark.parametrize("arch", WITH_RECURRENT)
def test_the_turns_are_one_file_whose_points_carry_their_recurrent_states(arch, layouts):
    conv, chain, old_chain, folder = layouts(arch)
    assert len(old_chain) == TURNS
    assert len(chain) == 1 and chain[0].header.has_point_states, [d.header.n_tokens for d in chain]
    points = points_of(chain[0])
    assert [p.n_tokens for p in points] == [d.header.n_tokens for d in old_chain[:-1]]
    assert all(p.recurrent is not None and len(p.recurrent) for p in points)
    assert len(chain[0].state) + sum(len(p.recurrent) for p in points) == chain[0].header.state_len
    graph = Graph.scan(folder / "now")
    assert {n.name for n in graph.nodes.values()} == {chain[0].path.name}, "absorbed files left behind"


@pytest.mark.parametrize("arch", WITH_RECURRENT)
def test_every_turn_end_comes_back_byte_for_byte(arch, layouts, tiny_model_path):
    """Each earlier turn's end from the merged head (restored, its point's recurrent state
    put back, trimmed) is the state its own file gives, byte for byte, and the edit that
    follows answers the same; without the recurrent state the point cannot be reached."""
    conv, chain, old_chain, _folder = layouts(arch)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        for turn in range(2, TURNS + 1):
            messages = conv.messages[:2 * (turn - 1)]
            k, n, point = turn_end(chain, messages)
            assert k == 1 and point is not None and n == old_chain[turn - 2].header.n_tokens
            assert turn_end(old_chain, messages) == (turn - 1, n, None)
            now = _edit(rt, chain[:k], n, point, messages)
            before = _edit(rt, old_chain[:turn - 1], n, None, messages)
            assert now == before, turn
        # a point the restore keeps no snapshot of (not the last turn's) is reached through
        # its recurrent state alone
        _k, first_end, _point = turn_end(chain, conv.messages[:2])
        rt.restore_chain(chain)
        assert rt.trim(first_end) < first_end
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["lfm2", "mamba2"])
def test_a_conversation_of_a_parallel_context_goes_back_to_a_point(arch, layouts, tiny_model_path):
    """The window's context (a sequence of a ParallelRuntime, not sequence 0) puts a point
    back as the single-sequence Runtime does."""
    conv, chain, old_chain, _folder = layouts(arch)
    settings = dataclasses.replace(memkit.SETTINGS, n_seq_max=3)
    prt = ParallelRuntime(tiny_model_path(arch), settings, sequences=2)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        messages = conv.messages[:2]
        _k, n, point = turn_end(chain, messages)
        prt.view_of("other").restore_chain(old_chain)   # sequence 0 taken: the next is another
        view = prt.view_of("edit")
        view.restore_chain(chain)
        assert view.seq != 0 and view.trim(n, point) == n
        rt.restore_chain(old_chain[:1])
        state = np.frombuffer(_state(prt.ctx, view.seq), dtype=np.uint8).copy()
        relabel_as(state, view, n_tokens=n, first_pos=0, source=view.seq, seq_id=0)   # as a file's
        assert state.tobytes() == _state(rt.ctx)
    finally:
        prt.close()
        rt.close()


def test_a_damaged_point_state_is_not_put_back(layouts, tiny_model_path, tmp_path):
    """A point whose recurrent state does not walk (its bytes damaged, the file's CRC made to
    match) is never given to llama.cpp: going back reads the prompt again instead."""
    conv, chain, _old, _folder = layouts("lfm2")
    _k, n, point = turn_end(chain, conv.messages[:2])
    bad = Point(point.n_tokens, point.n_messages, np.zeros_like(point.recurrent))
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        rt.restore_chain(chain)
        assert rt.trim(n, bad) == 0 and rt.kv_tokens == []
    finally:
        rt.close()


def _rewritten(data, meta: dict, path):
    """``data``'s file again with ``meta`` as its metadata (lengths and CRC made to match)."""
    meta_bytes = json.dumps(meta).encode()
    header = dataclasses.replace(data.header, meta_len=len(meta_bytes))
    payload = [meta_bytes, data.tokens.tobytes(), b"" if data.logits is None else data.logits.tobytes(),
               bytes(data.state), bytes(data.point_states)]
    crc = 0
    for part in payload:
        crc = crc32(part, crc)
    path.write_bytes(pack_header(header) + b"".join(payload) + struct.pack("<I", crc) + TRAILER_MAGIC)
    return path


def _damaged_copy(data, offset: int, path):
    """``data``'s file at ``path`` with the byte ``offset`` into its state section flipped,
    its trailer left as it was (damage after the write)."""
    raw = bytearray(data.path.read_bytes())
    raw[data.header.state_offset + offset] ^= 0xFF
    path.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("reader", ["mapped", "copying"])
@pytest.mark.parametrize("queued", [False, True], ids=["inline", "queued"])
def test_a_restore_leaves_the_point_states_unread_and_checks_one_when_used(queued, reader, layouts, tiny_model_path,
                                                                            tmp_path, monkeypatch):
    """A restore sets none of a file's point states (each as large as a whole recurrent state),
    so it does not read them: the file's CRC is checked through the CRC each point's metadata
    gives, and a point's state against its own when it is put back (a copying reader's read
    from the file only then).  A point whose bytes were damaged on disk (still walking) leaves
    the restore exact and is not put back; damage to what the restore sets is refused as
    before, whether the checksum runs inline or on the helper thread (``queued``)."""
    from engine.checkpoints import mapped
    if queued:
        monkeypatch.setattr(ckpt_format, "CRC_LATER_MIN_BYTES", 0)
    if reader == "copying":
        monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 1 << 62)
    elif not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here: the state is read, not mapped")
    else:
        monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)
    conv, chain, _old, _folder = layouts("qwen35")
    data = chain[0]
    points = points_of(data)
    assert recurrent_crcs(data.meta) == [crc32(p.recurrent) for p in points]   # the writer gives each its CRC
    _k, n, point = turn_end(chain, conv.messages[:2])
    lengths = recurrent_lengths(data.meta)
    i = [p.n_tokens for p in points].index(point.n_tokens)
    # a byte of the point's last row of values, which still walks
    path = _damaged_copy(data, len(data.state) + sum(lengths[:i + 1]) - 5, tmp_path / data.path.name)
    with pytest.raises(ChecksumMismatch):
        read_checkpoint(path)   # a whole read checks every byte
    damaged = load_chain(path, crc_later=True)
    assert damaged[0].unread_point_crcs and damaged[0].state.tobytes() == data.state.tobytes()
    # a copying reader leaves them in the file
    assert (len(damaged[0].point_states), bool(damaged[0].point_states_at)) == \
        ((0, True) if reader == "copying" else (len(data.point_states), False))
    _k, n, point = turn_end(damaged, conv.messages[:2])
    _k, n_other, other = turn_end(damaged, conv.messages[:4])
    rt = Runtime(tiny_model_path("qwen35"), memkit.SETTINGS)
    try:
        rt.restore_chain(damaged)
        assert rt.kv_tokens == conv.tokens and _state(rt.ctx) == _state_of_chain(rt, chain)
        rt.restore_chain(damaged)
        assert rt.trim(n, point) == 0 and rt.kv_tokens == []   # not put back: read again
        rt.restore_chain(damaged)
        assert other is not None and rt.trim(n_other, other) == n_other   # an intact one is
        # damage to what the restore sets is refused
        for offset in (len(data.state) - 5, 100):
            with pytest.raises(ChecksumMismatch):
                rt.restore_chain(load_chain(_damaged_copy(data, offset, tmp_path / f"bad-{offset}.kvckpt"),
                                            crc_later=True))
    finally:
        rt.close()
    if reader == "copying":   # a point whose file went has no state to give: none
        path.unlink()
        assert point_at(damaged[0], n_other) is None and points_of(damaged[0]) == []
    # a file from before the points gave their CRCs is checked whole
    old = _rewritten(data, {**data.meta, "points": [{k: v for k, v in p.items() if k != "crc32"}
                                                    for p in data.meta["points"]]}, tmp_path / "old.kvckpt")
    assert not load_chain(old, crc_later=True)[0].unread_point_crcs
    assert not load_chain(data.path)[0].unread_point_crcs   # nor a read that is no restore's


def test_unread_point_states_are_mapped_in_only_where_the_disk_holds_them(layouts, tmp_path, monkeypatch):
    """The point states a restore leaves unread are read through the mapping only if a point
    is used: left as they are where the page cache holds them, mapped in at the read where a
    page needs the disk (engine.checkpoints.mapped: a read error is then the reader's, never
    SIGBUS; tests/test_mapped_read.py reads a file evicted from the page cache)."""
    import os

    from engine.checkpoints import mapped
    if not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here: the state is read, not mapped")
    data = layouts("qwen35")[1][0]
    path = tmp_path / "head.kvckpt"
    path.write_bytes(data.path.read_bytes())
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0)
    calls: list[tuple[int, int]] = []
    real = mapped.populate
    monkeypatch.setattr(mapped, "populate", lambda m, start, n: (calls.append((start, n)), real(m, start, n))[1])
    first, end = data.header.state_offset + len(data.state), data.header.state_offset + data.header.state_len

    def populated_of_the_points() -> int:
        return sum(max(0, min(start + n, end) - max(start, first)) for start, n in calls)

    fd = os.open(path, os.O_RDONLY)
    try:
        cached = mapped.in_page_cache(fd, 0, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    if not cached:
        pytest.skip("this kernel cannot say what the page cache holds (cachestat, Linux 6.5)")
    got = read_checkpoint(path, crc_later=True)
    got.settle()
    assert got.unread_point_crcs and populated_of_the_points() == 0
    # a cold file: the kernel's read-ahead of the metadata brings in a file this small, so the
    # page cache is made to say it holds none of it
    monkeypatch.setattr(mapped, "in_page_cache", lambda *a: False)
    calls.clear()
    got = read_checkpoint(path, crc_later=True)
    got.settle()
    assert populated_of_the_points() == end - first
    assert got.point_states.tobytes() == data.point_states.tobytes()


def _state_of_chain(rt, chain) -> bytes:
    rt.restore_chain(chain)
    return _state(rt.ctx)


def test_point_states_the_metadata_does_not_account_for_are_refused(layouts, tmp_path):
    conv, chain, _old, _folder = layouts("qwen35")
    data = chain[0]
    assert read_checkpoint(_rewritten(data, data.meta, tmp_path / "same.kvckpt")).point_states.tobytes() \
        == data.point_states.tobytes()   # the rewriting itself changes nothing
    for points in ([{k: v for k, v in p.items() if k != "recurrent_len"} for p in data.meta["points"]],
                   [{**p, "recurrent_len": "12"} for p in data.meta["points"]],
                   [{**p, "recurrent_len": data.header.state_len} for p in data.meta["points"]], None):
        meta = {**data.meta, "points": points}
        with pytest.raises(CorruptMetadata):
            read_checkpoint(_rewritten(data, meta, tmp_path / "bad.kvckpt"))
    # a writer never writes such a file
    with open(tmp_path / "w.kvckpt", "wb") as out, pytest.raises(CorruptMetadata):
        write_sections(out, data.header, json.dumps({**data.meta, "points": None}).encode(), data.tokens,
                       data.logits, data.state, point_states=(data.point_states,))


def test_an_export_keeps_the_points(layouts, tmp_path):
    """Export of a merged head (a full file) copies its points' recurrent states with it."""
    conv, chain, _old, _folder = layouts("granitehybrid")
    copy = read_checkpoint(export_copy(chain[0].path, tmp_path / "copy.kvckpt"))
    assert copy.point_states.tobytes() == chain[0].point_states.tobytes()
    assert [(p.n_tokens, p.recurrent.tobytes()) for p in points_of(copy)] \
        == [(p.n_tokens, p.recurrent.tobytes()) for p in points_of(chain[0])]


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "qwen35", "llama"])
def test_a_compacted_chain_keeps_its_turn_ends(arch, layouts, tiny_model_path, tmp_path):
    """Compaction (``compact``, and Export of a chain) restores a chain and saves one full
    file; the chain's turn ends stay in it as points, with the recurrent states a merged
    head's points carry, byte for byte, so an Edit of an earlier turn of a compacted or
    exported conversation goes back there: the same state and answer as the file of that
    turn gives.  Before, a compacted file held none, and the Edit read the conversation
    again from the start."""
    from engine.compaction import compact_into
    conv, chain, old_chain, _folder = layouts(arch)
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        compacted = [read_checkpoint(compact_into(rt, old_chain, tmp_path / "compacted.kvckpt").path)]
        points = points_of(compacted[0])
        assert [(p.n_tokens, p.n_messages) for p in points] \
            == [(d.header.n_tokens, 2 * (i + 1)) for i, d in enumerate(old_chain[:-1])]
        if KIND[arch] == "attention":
            assert all(p.recurrent is None for p in points)
        else:
            assert [p.recurrent.tobytes() for p in points] == [p.recurrent.tobytes() for p in points_of(chain[0])]
        for turn in range(2, TURNS + 1):
            messages = conv.messages[:2 * (turn - 1)]
            k, n, point = turn_end(compacted, messages)
            assert k == 1 and n == old_chain[turn - 2].header.n_tokens and point is not None
            assert _edit(rt, compacted, n, point, messages) == _edit(rt, old_chain[:turn - 1], n, None, messages)
    finally:
        rt.close()


def test_a_save_whose_point_state_does_not_walk_writes_nothing(tiny_model_path, tmp_path):
    rt = Runtime(tiny_model_path("mamba2"), memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        generate(rt, conv)
        bad = Point(4, 1, np.zeros(64, dtype=np.uint8))
        with pytest.raises(SaveFailed):
            rt.save(tmp_path / "x.kvckpt", conv, KIND_MANUAL, points=[bad])
        assert not (tmp_path / "x.kvckpt").exists()
    finally:
        rt.close()


def test_a_point_not_matching_the_crc_it_came_with_is_not_written_again(layouts, tiny_model_path, tmp_path):
    """A point read from a file keeps the CRC its metadata gave (a restore did not check its
    bytes): a save that would write it again checks them first, so damage is never given a
    fresh CRC of its own (compaction, a fork from a point)."""
    data = layouts("qwen35")[1][0]
    point = points_of(data)[0]
    assert point.crc32 == crc32(point.recurrent)
    damaged = dataclasses.replace(point, crc32=point.crc32 ^ 1)
    rt = Runtime(tiny_model_path("qwen35"), memkit.SETTINGS)
    try:
        rt.restore_chain([data])
        with pytest.raises(SaveFailed, match="checksum"):
            rt.save(tmp_path / "x.kvckpt", rt.restore_chain([data]), KIND_MANUAL, points=[damaged])
        assert not (tmp_path / "x.kvckpt").exists()
        rt.save(tmp_path / "y.kvckpt", rt.restore_chain([data]), KIND_MANUAL, points=[point])
        assert recurrent_crcs(read_checkpoint(tmp_path / "y.kvckpt").meta) == [point.crc32]
    finally:
        rt.close()


def test_header_only_readers_see_the_whole_section(layouts):
    """Listing and validation read lengths from the header: the state section is the file's."""
    _conv, chain, _old, _folder = layouts("falcon-h1")
    raw = chain[0].path.read_bytes()
    assert len(raw) == chain[0].header.file_len and raw[:HEADER_LEN] == pack_header(chain[0].header)


@pytest.mark.parametrize("arch", ["lfm2", "rwkv7"])
def test_from_turn_on_an_absorbed_turn_equals_continuing_that_turns_file(arch, layouts, tiny_model_path, app_home):
    """`run --from-turn 3` on the merged head: the same text as continuing the file-per-turn
    layout's own file of turn 2, its tokens restored, not read again."""
    _conv, chain, old_chain, _folder = layouts(arch)
    common = ["-m", str(tiny_model_path(arch)), "-n", "8", "--temp", "0", "--seed", "3", "--ignore-eos",
              "-t", "2", "--json"]

    def run(*args):
        done = run_cli("run", *common, *args, check=True)
        assert "read again" not in done.stderr, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    edited = run("--checkpoint-load", str(chain[0].path), "--from-turn", "3", "-p", "A mountain, then?")
    reference = run("--checkpoint-load", str(old_chain[1].path), "-p", "A mountain, then?")
    assert edited["n_prompt_tokens"] == reference["n_prompt_tokens"]   # the same history
    assert edited["text"] == reference["text"]
    assert edited["n_reused_tokens"] >= old_chain[1].header.n_tokens


@pytest.mark.parametrize("arch", ["lfm2", "rwkv7"])
def test_from_turn_on_a_compacted_chain_reads_only_the_new_message(arch, layouts, tiny_model_path, tmp_path,
                                                                    app_home):
    """`compact` of a file-per-turn chain, then `run --from-turn 3` on the one file: the same
    text as continuing the file of turn 2, its tokens restored (before, the compacted file
    held no turn ends, and a recurrent memory read the conversation again)."""
    _conv, _chain, old_chain, _folder = layouts(arch)
    model = str(tiny_model_path(arch))
    out = tmp_path / "compacted.kvckpt"
    run_cli("compact", str(old_chain[-1].path), "-o", str(out), "--model", model, check=True)
    # `inspect` names the turn ends the file holds, as a restore reads them
    held = [(p.n_tokens, p.n_messages) for p in points_of(read_checkpoint(out))]
    assert held and held[0][0] == old_chain[0].header.n_tokens
    info = json.loads(run_cli("inspect", str(out), "--json", check=True).stdout)
    assert [(e["n_tokens"], e["n_messages"]) for e in info["turn_ends"]] == held
    shown = run_cli("inspect", str(out), check=True).stdout
    assert f"after message {held[0][1]} ({held[0][0]} tokens)" in shown, shown
    common = ["-m", model, "-n", "8", "--temp", "0", "--seed", "3", "--ignore-eos", "-t", "2", "--json"]

    def run(*args):
        done = run_cli("run", *common, *args, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    edited = run("--checkpoint-load", str(out), "--from-turn", "3", "-p", "A mountain, then?")
    reference = run("--checkpoint-load", str(old_chain[1].path), "-p", "A mountain, then?")
    assert edited["n_prompt_tokens"] == reference["n_prompt_tokens"] and edited["text"] == reference["text"]
    assert edited["n_reused_tokens"] >= old_chain[1].header.n_tokens


def test_validate_walks_the_point_states(layouts, tiny_model_path, tmp_path):
    """`validate` reads a point's recurrent state as it reads llama.cpp's part: damaged bytes
    under a matching checksum are named, not passed."""
    _conv, chain, _old, _folder = layouts("lfm2")
    data = chain[0]
    model = str(tiny_model_path("lfm2"))
    assert run_cli("validate", str(data.path), "--model", model).returncode == 0
    damaged = dataclasses.replace(data, point_states=np.zeros_like(data.point_states))
    bad = _rewritten(damaged, data.meta, tmp_path / "bad.kvckpt")
    done = run_cli("validate", str(bad), "--model", model)
    assert done.returncode != 0 and "recurrent state" in (done.stdout + done.stderr), done.stdout + done.stderr


def test_past_the_bound_the_states_kept_for_points_are_let_go(tiny_model_path, tmp_path):
    """With ``merge_max_bytes`` of a few turns the turns go on in files of about that size,
    every turn's end still in the chain and coming back exactly; the writer keeps the
    recurrent states for points only of the files a later head can still absorb."""
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        probe = _chat(rt, Store(tmp_path / "probe"), turns=2)[1]
        growth = probe[1].size - probe[0].size   # a turn's cells and recurrent state (its logits are the head's)
        bound = probe[0].size + 2 * growth
        conv, heads, writer = _chat_with_writer(rt, Store(tmp_path / "store"), ChainPolicy(merge_max_bytes=bound),
                                                turns=10)
        chain = load_chain(heads[-1].path)
        assert 2 <= len(chain) < 10, [d.header.n_tokens for d in chain]
        ends = sorted({d.header.n_tokens for d in chain} | {p.n_tokens for d in chain for p in points_of(d)})
        assert ends == [h.n_tokens for h in heads]
        kept = [info for info in writer.chain
                if info.point_state is not None or any(p.recurrent is not None for p in info.points)]
        assert kept and sum(info.size for info in kept[:-1]) <= bound, [i.size for i in writer.chain]
        assert len(kept) < len(writer.chain)
        for turn in (2, 5, 9):
            messages = conv.messages[:2 * (turn - 1)]
            k, n, point = turn_end(chain, messages)
            assert k and n == heads[turn - 2].n_tokens
            files = chain[:k]
            rt.restore_chain(files)
            assert rt.trim(n, point) == n and rt.kv_tokens == conv.tokens[:n]
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "mamba2"])
def test_regenerate_after_a_restore_reads_only_the_last_question(arch, layouts, tiny_model_path):
    """In a new process, Regenerate of the merged head's last answer goes back to the turn
    end before it (a point kept while restoring, as the file of that turn was before) and
    reads only the last question again: the answer is the one the file-per-turn layout's
    Regenerate draws, having read as much."""
    from engine.generation import discard_answer
    _conv, chain, old_chain, _folder = layouts(arch)
    previous_end = old_chain[-2].header.n_tokens
    regenerated = []
    for files in (chain, old_chain):
        rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)   # (each as in a new process)
        try:
            restored = rt.restore_chain(files)
            assert restored.answer is not None and restored.answer.n_prompt_tokens > previous_end
            discard_answer(restored)
            answer = generate(rt, restored)
            assert answer.n_reused_tokens == previous_end, len(files)
            regenerated.append(answer.text)
        finally:
            rt.close()
    assert regenerated[0] == regenerated[1]


def test_point_states_only_with_a_recurrent_memory_and_no_sliding_window(layouts):
    """The header's own rule: POINT_STATES with an attention memory, a sliding window (whose
    cells past a point could not be dropped exactly) or a version 1 file is refused."""
    from engine.checkpoints.format import MEMORY_ATTENTION, unpack_header
    from engine.errors import CorruptHeader
    header = layouts("lfm2")[1][0].header
    assert unpack_header(pack_header(header)) == header
    for bad in (dataclasses.replace(header, n_swa=512), dataclasses.replace(header, memory=MEMORY_ATTENTION),
                dataclasses.replace(header, version=1)):
        with pytest.raises(CorruptHeader):
            unpack_header(pack_header(bad))


@contextlib.contextmanager
def _window_engine(model, store: Store):
    """The window's engine thread on ``model`` (two sequences) and ``store``: (worker, recorder)."""
    from enginekit import Recorder

    from engine.worker import EngineWorker, ModelOptions
    rec = Recorder()
    w = EngineWorker(rec, store)
    w.start()
    try:
        w.load_model(ModelOptions(model, n_ctx=1024, n_threads=2, sequences=2))
        rec.wait("loaded")
        yield w, rec
        assert not rec.of("error"), rec.of("error")
    finally:
        w.shutdown()
        assert w.join(60)


@pytest.mark.parametrize("arch", ["lfm2", "mamba2"])
def test_the_window_edits_an_absorbed_turn_exactly(arch, tiny_model_path, tmp_path):
    """The window's engine: three turns (the last head absorbing the first two), then an
    Edit of turn 2 goes back to turn 1's end through its point, reads only the new message,
    and answers what a conversation that said the same from the start answers."""
    store = Store(tmp_path / "store")
    with _window_engine(tiny_model_path(arch), store) as (w, rec):
        sampler = SamplerSettings(seed=3, temperature=0.0, ignore_eos=True)
        a = w.new_conversation(sampler=sampler)
        for i, text in enumerate(("Tell me about rivers.", "And lakes?", "And seas?")):
            w.send(a, text, n_predict=6)
            rec.wait("finished", i + 1)
        heads = Graph.scan(store.folder).heads_of(a)
        assert len(heads) == 1 and len(load_chain(heads[0].path)) == 1   # one file holds the three turns
        first_end = points_of(load_chain(heads[0].path)[0])[0].n_tokens
        w.edit_message(a, 2, "And mountains?", n_predict=6)
        edited = rec.wait("finished", 4)[-1][1]
        b = w.new_conversation(sampler=sampler)
        w.send(b, "Tell me about rivers.", n_predict=6)
        rec.wait("finished", 5)
        w.send(b, "And mountains?", n_predict=6)
        reference = rec.wait("finished", 6)[-1][1]
        assert edited.text == reference.text and edited.n_prompt_tokens == reference.n_prompt_tokens
        assert edited.n_reused_tokens == first_end   # turn 1's end, from the head's point


@pytest.mark.parametrize("restart", [False, True], ids=["same-process", "after-a-restart"])
@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_a_regenerated_branch_keeps_every_earlier_turn_end(arch, restart, tiny_model_path, tmp_path):
    """Four turns (one head, the first three turn ends its points), then Regenerate of the last
    answer: a recurrent memory cannot cut the head, so the new branch's file holds the cells
    again, and it held no turn end: an Edit of turn 2 in the new branch read the whole
    conversation again (a new user's trial on a hybrid).  The new file keeps the turn ends
    of the head it leaves (read from that file after a restart): the Edit reads only from
    turn 1's end on, and answers what the same Edit on the first branch answers."""
    store = Store(tmp_path / "store")
    sampler = SamplerSettings(seed=3, temperature=1.5, ignore_eos=True)   # (Regenerate draws another answer)
    greedy = SamplerSettings(seed=3, temperature=0.0, ignore_eos=True)
    texts = ("Tell me about rivers.", "And lakes?", "And seas?", "And oceans?")
    with _window_engine(tiny_model_path(arch), store) as (w, rec):
        a = w.new_conversation(sampler=sampler)
        for i, text in enumerate(texts):
            w.send(a, text, n_predict=6)
            rec.wait("finished", i + 1)
        rec.head_saved(a, len(texts))
        (first_head,) = Graph.scan(store.folder).heads_of(a)
        ends = [p.n_tokens for p in points_of(load_chain(first_head.path)[-1])]
        assert len(ends) == 3
        if not restart:
            w.regenerate(a)
            rec.wait("finished", 5)
            rec.head_saved(a, 5)
    if restart:
        with _window_engine(tiny_model_path(arch), store) as (w, rec):
            w.open_checkpoint(first_head.path)
            rec.wait("changed")
            w.regenerate(a)
            rec.wait("finished")
            rec.head_saved(a)
    branch = next(h for h in Graph.scan(store.folder).heads_of(a) if h.name != first_head.name)
    assert [p.n_tokens for data in load_chain(branch.path) for p in points_of(data)] == ends
    with _window_engine(tiny_model_path(arch), store) as (w, rec):   # each branch's Edit of turn 2
        edits = []
        for head in (branch, first_head):
            w.open_checkpoint(head.path)
            rec.next("changed")
            w.set_sampler(a, greedy)
            w.edit_message(a, 2, "And mountains?", n_predict=6)
            edits.append(rec.next("finished")[1])
        assert edits[0].n_reused_tokens == edits[1].n_reused_tokens == ends[0]   # turn 1's end
        assert edits[0].text == edits[1].text and edits[0].n_prompt_tokens == edits[1].n_prompt_tokens


def test_regenerate_after_a_restart_reads_nothing_of_a_long_last_message(tiny_model_path, tmp_path):
    """A long last message's prompt autosave (ChainPolicy.prompt_checkpoint, with the
    prompt's logits) stays a file below the head, which absorbs the turns below it: after a
    restart, Regenerate goes back to the prompt's end and reads nothing again."""
    store = Store(tmp_path / "store")
    sampler = SamplerSettings(seed=3, temperature=0.0, ignore_eos=True)
    long_message = "Here is a list of rivers to compare: " + "Rhine, Danube, Loire, Elbe, " * 40
    with _window_engine(tiny_model_path("lfm2"), store) as (w, rec):
        a = w.new_conversation(sampler=sampler)
        for i, text in enumerate(("Tell me about rivers.", "And lakes?", long_message)):
            w.send(a, text, n_predict=6)
            rec.wait("finished", i + 1)
        last = rec.of("finished")[-1][1]
        assert last.n_prompt_tokens - last.n_reused_tokens >= 256   # its prompt was saved
    heads = Graph.scan(store.folder).heads_of(a)
    chain = load_chain(heads[0].path)
    assert [d.header.n_tokens for d in chain[-2:]] == [last.n_prompt_tokens, last.n_prompt_tokens + 6]
    assert len(points_of(chain[0])) == 1   # (turn 2's head absorbed turn 1's)
    with _window_engine(tiny_model_path("lfm2"), store) as (w, rec):   # a restart
        w.open_checkpoint(heads[0].path)   # as the window opens a stored conversation
        rec.wait("changed")
        w.regenerate(a)
        again = rec.wait("finished")[-1][1]
        assert again.n_reused_tokens == again.n_prompt_tokens == last.n_prompt_tokens
        assert again.text == last.text   # greedy: the same answer, from the same state


@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "mamba2"])
def test_a_prompt_on_another_conversations_first_turns_goes_back_to_its_point(arch, tiny_model_path, tmp_path):
    """The prefix index offers a head's points too (engine.checkpoints.prefix_index): a prompt
    that repeats another conversation's first turns (a client sending a history again,
    ``run --reuse-prefix``) restores that head and goes back to the turn's end, reading only
    what follows, where it read everything after the system prompt before; the state is the
    one continuing that turn's own file gives (the file-per-turn layout), byte for byte."""
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        reuse, tokens, end, head, own_file = reuse_a_turn_end_of_another_head(rt, tmp_path)
        assert (reuse.how, reuse.n_tokens, reuse.source) == ("restored", end, head), reuse.describe()
        assert rt.prefill(tokens).n_decoded == len(tokens) - end
        reused = _state(rt.ctx)
        rt.trim(0)
        rt.restore_chain(load_chain(own_file))   # turn 4's own file
        assert rt.prefill(tokens).n_decoded == len(tokens) - end
        assert _state(rt.ctx) == reused
    finally:
        rt.close()


def reuse_a_turn_end_of_another_head(rt, tmp_path):
    """Five turns stored merged (one head, its turn ends points) and a file per turn; then a
    prompt repeating the first four turns reuses the stored prefix: (the PrefixReuse, the
    prompt, turn 4's end, the merged head's path, turn 4's own file)."""
    from engine.prefix_reuse import reuse_stored_prefix
    store = Store(tmp_path / "store")
    _conv, heads = _chat(rt, store, turns=5)
    _conv, own_files = _chat(rt, Store(tmp_path / "per-turn"), ChainPolicy(merge_turns=False), turns=5)
    head = load_chain(heads[-1].path)[-1]
    end = heads[3].n_tokens   # turn 4's end, a point of the last head (the index hashes blocks of 64)
    assert end in [p.n_tokens for p in points_of(head)] and end >= 64
    tokens = [int(t) for t in head.tokens[:end]] + rt.model.tokenize(" And a lake?", add_special=False)
    rt.trim(0)
    return reuse_stored_prefix(rt, store.folder, tokens), tokens, end, head.path, own_files[3].path
