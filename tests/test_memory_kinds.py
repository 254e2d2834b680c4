"""Every memory kind gets the whole checkpoint contract: recurrent (mamba2, rwkv7), hybrid
(lfm2, qwen35, granitehybrid, falcon-h1) and plain attention (the tiny llama control).

Tiny random-weight models (tests/tinymodels.py) prove exactness by the last logits and
the sequence state's bytes, not by text.  Before this, every checkpoint of a recurrent or
hybrid model was written, announced as saved, and refused on load.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import subprocess
import sys
from pathlib import Path

import memkit
import numpy as np
import pytest
from conftest import ROOT, run_cli
from tinymodels import ARCHS, KIND

from engine.checkpoints.chain import load_chain
from engine.checkpoints.compat import ModelIdentity
from engine.checkpoints.format import (
    FORMAT_VERSION,
    HEADER_LEN,
    KIND_PAUSE,
    MEMORY_ATTENTION,
    MEMORY_HYBRID,
    MEMORY_RECURRENT,
    pack_header,
    read_checkpoint,
    read_header,
    unpack_header,
)
from engine.checkpoints.kvstate import check_state_for
from engine.checkpoints.store import Store
from engine.errors import CorruptState, SaveFailed
from engine.generation import generate
from engine.history import LineWriter
from engine.runtime import Runtime

MEMORY = {"recurrent": MEMORY_RECURRENT, "hybrid": MEMORY_HYBRID, "attention": MEMORY_ATTENTION}
NOT_CONTROL = [a for a in ARCHS if KIND[a] != "attention"]


@pytest.fixture(scope="module")
def references(tiny_model_path):
    """Each arch's uninterrupted answer (greedy-free: temperature 0.8, fixed seed)."""
    out = {}

    def reference(arch: str) -> dict:
        if arch not in out:
            rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
            try:
                result = generate(rt, memkit.conversation(rt))
                out[arch] = memkit.fingerprint(rt, result.text)
            finally:
                rt.close()
        return out[arch]
    return reference


@pytest.mark.parametrize("arch", ARCHS)
def test_shape_is_read_one_way(arch, tiny_model_path):
    """`validate --model` (the file alone) and a loaded model agree on the shape, and the
    memory kind is llama.cpp's."""
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        loaded = rt.target.model
        assert loaded.memory == MEMORY[KIND[arch]]
        assert dataclasses.replace(ModelIdentity.from_gguf(path), name="") == dataclasses.replace(loaded, name="")
        if arch in ("lfm2", "granitehybrid"):   # layer 0 is recurrent: llama.cpp says 0 heads
            assert rt.model.shape.n_head_kv == 0 and loaded.n_head_kv > 0
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_pause_and_resume_in_a_new_process_is_exact(arch, tiny_model_path, references, tmp_path):
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        part = generate(rt, conv, stop_after=9)
        assert part.finish_reason == "paused"
        info = rt.save(tmp_path / "p.kvckpt", conv, KIND_PAUSE)
    finally:
        rt.close()
    header = read_header(info.path)
    assert (header.version, header.memory) == (FORMAT_VERSION, MEMORY[KIND[arch]])
    assert header.cell_ext == (arch == "qwen35")   # M-RoPE cells
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "memkit.py"), str(path), str(info.path)],
                          capture_output=True, text=True, timeout=300, cwd=str(ROOT), check=True)
    resumed = json.loads(done.stdout.strip().splitlines()[-1])
    reference = references(arch)
    assert part.text + resumed["text"] == reference["text"]
    assert (resumed["logits"], resumed["state"], resumed["n_tokens"]) == \
        (reference["logits"], reference["state"], reference["n_tokens"])


@pytest.mark.parametrize("arch", ARCHS)
def test_autosave_chain_restores_exactly(arch, tiny_model_path, references, tmp_path):
    """Deltas every 4 tokens: attention cells as deltas, the recurrent snapshot whole, and
    no logits (a recurrent memory's autosave is its state one token short).  With a
    recurrent part (these: states of KB, cells of tens of bytes) each autosave goes on the
    first file, and the one before is retired: its recurrent state was dead weight
    (LineWriter._tail_mostly_dead)."""
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        saver = LineWriter(rt, Store(tmp_path), "line")
        # autosaves after 4, 8, 12 and 16 tokens: an attention memory's in tiers, the one after
        # 12 absorbing the one after 8 (LineWriter._tier_below): the first, 8 tokens, 4 tokens
        generate(rt, conv, autosave=saver, autosave_every=4, stop_after=17)
        chain_infos = list(saver.chain)
        saver.close()
    finally:
        rt.close()
    assert [i.delta for i in chain_infos] == ([False, True, True] if KIND[arch] == "attention" else [False, True])
    assert sorted(tmp_path.glob("*.kvckpt")) == sorted(i.path for i in chain_infos), "a retired autosave stayed"
    full = read_header(chain_infos[0].path)
    for info in chain_infos[1:]:
        h = read_header(info.path)
        # a delta's state: its own 4 tokens' cells and, with a recurrent part, one
        # snapshot; never the whole conversation's cells
        if KIND[arch] != "recurrent":
            assert h.state_len < full.state_len
    for info in chain_infos:
        h = read_header(info.path)
        # no file carries logits: an attention memory decodes its last token again; a
        # recurrent one is saved from its state before that token (saves_one_short)
        assert not h.has_logits
        assert h.n_tokens == h.n_tokens_total - (KIND[arch] != "attention")
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = rt.restore_chain(load_chain(chain_infos[-1].path))
        rest = generate(rt, conv)
        got = memkit.fingerprint(rt, rest.text)
    finally:
        rt.close()
    assert rest.n_prefilled == 1     # the last token, decoded alone as it was
    reference = references(arch)
    assert (got["logits"], got["state"]) == (reference["logits"], reference["state"])


@pytest.mark.parametrize("arch", ARCHS)
def test_pause_inside_the_prompt_resumes_exactly(arch, tiny_model_path, tmp_path):
    """A pause while the prompt is read: the memory holds exactly what the app counts (a
    recurrent or hybrid memory cannot drop a half-done batch, so its decodes are never
    cut), and resuming in a fresh context gives the uninterrupted run's logits."""
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        assert len(conv.tokens) > 4 * memkit.SETTINGS.n_batch
        read = []   # the pause comes once two chunks are read, before the third
        report = rt.prefill(conv.tokens, should_stop=lambda: len(read) >= 2,
                            on_progress=lambda done, total: read.append(done))
        assert report.aborted and 0 < len(rt.kv_tokens) < len(conv.tokens)
        assert rt.ctx.pos_max(0) + 1 == len(rt.kv_tokens)
        if KIND[arch] != "attention":
            assert len(rt.kv_tokens) % memkit.SETTINGS.n_batch == 0
        info = rt.save(tmp_path / "prefill.kvckpt", conv, KIND_PAUSE)
        assert read_header(info.path).prefill_pending
        rt.trim(0)
        rt.prefill(conv.tokens)
        expected = np.array(rt.logits(), copy=True)
    finally:
        rt.close()
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = rt.restore(read_checkpoint(info.path))
        report = rt.prefill(conv.tokens)
        assert report.n_reused == read_header(info.path).n_tokens
        assert np.array_equal(rt.logits(), expected)
    finally:
        rt.close()


def _recurrent_offset(state: np.ndarray, header) -> int:
    """Where the recurrent block starts (after the attention block of a hybrid)."""
    layout = check_state_for(header, state)
    if not layout.blocks:
        return 8
    # the walk's own reader, re-run to the end of the attention block
    from engine.checkpoints import kvstate
    r = kvstate._Reader(memoryview(state).cast("B"))
    r.pos = 8
    kvstate._attention_blocks(r, len(layout.blocks), header.n_tokens, header.n_ctx, header.n_layer,
                              header.type_k, header.type_v, header.flash_attn, header.n_head_kv,
                              header.n_embd_head_k, header.n_embd_head_v, 0, 0, header.cell_ext)
    return r.pos


@pytest.mark.parametrize("arch", NOT_CONTROL)
def test_a_corrupt_recurrent_state_is_refused_with_its_reason(arch, tiny_model_path, tmp_path):
    path = tiny_model_path(arch)
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        generate(rt, conv, stop_after=3)
        data = read_checkpoint(rt.save(tmp_path / "good.kvckpt", conv, KIND_PAUSE).path)
        held = list(rt.kv_tokens)
        base = _recurrent_offset(data.state, data.header)
        cases = {
            "two snapshots": (base, struct.pack("<I", 2), "snapshots"),
            "wrong position": (base + 4, struct.pack("<i", 3), "position"),
            "other sequences": (base + 8, struct.pack("<I", 1), "other sequences"),
            "layout flag": (base + 12, struct.pack("<I", 1), "layout flag"),
            "layer count": (base + 16, struct.pack("<I", 99), "layer count"),
            "row type": (base + 20, struct.pack("<i", 1), "float32"),
            "row size": (base + 24, struct.pack("<Q", 1 << 40), "impossible size"),
        }
        for name, (offset, patch, reason) in cases.items():
            bad = data.state.copy()
            bad[offset:offset + len(patch)] = np.frombuffer(patch, dtype=np.uint8)
            with pytest.raises(CorruptState, match=reason):
                rt.restore_chain([dataclasses.replace(data, state=bad)])
            # refused before llama.cpp saw a byte: the cache still holds the conversation
            assert rt.kv_tokens == held and rt.ctx.pos_max(0) + 1 == len(held), name
        for bad in (data.state[:-3], np.concatenate([data.state, np.zeros(8, np.uint8)])):
            with pytest.raises(CorruptState):
                check_state_for(dataclasses.replace(data.header, state_len=len(bad)), bad)
        # the model's recurrent layer count and row sizes are checked too (a state with a
        # layer too few would otherwise reach llama.cpp)
        r_row, s_row, layers = rt.target.model.recurrent_rows
        assert layers > 0 and check_state_for(data.header, data.state, (r_row, s_row, layers)).recurrent[0] == layers
        with pytest.raises(CorruptState, match="recurrent layers"):
            check_state_for(data.header, data.state, (r_row, s_row, layers + 1))
        # the model's rows known, the layers are compared as runs (kvstate._known_recurrent_layers):
        # the same verdicts as the step-by-step walk, a fault in any layer named as it names it
        rows = (r_row, s_row, layers)
        assert check_state_for(data.header, data.state, rows) == check_state_for(data.header, data.state)
        last_s = base + 20 + layers * (12 + r_row) + (layers - 1) * (12 + s_row)
        for offset, patch in ((last_s, struct.pack("<i", 1)), (last_s + 4, struct.pack("<Q", s_row + 4)),
                              (base + 24, struct.pack("<Q", r_row + 4))):
            bad = data.state.copy()
            bad[offset:offset + len(patch)] = np.frombuffer(patch, dtype=np.uint8)
            said = []
            for known in (rows, None):
                with pytest.raises(CorruptState) as refused:
                    check_state_for(data.header, bad, known)
                said.append(str(refused.value))
            assert said[0] == said[1], said
        with pytest.raises(CorruptState, match="R rows hold"):
            check_state_for(data.header, data.state, (r_row + 4, s_row, layers))
    finally:
        rt.close()


def test_a_version_1_file_still_loads(tiny_model_path, tmp_path):
    """Files written before memory kinds (format version 1, attention only) keep loading."""
    path = tiny_model_path("llama")
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        generate(rt, conv, stop_after=5)
        info = rt.save(tmp_path / "v2.kvckpt", conv, KIND_PAUSE)
        raw = bytearray(info.path.read_bytes())
        old = dataclasses.replace(unpack_header(bytes(raw[:HEADER_LEN])), version=1)
        raw[:HEADER_LEN] = pack_header(old)
        assert raw[79] == 0 and raw[82:84] == b"\0\0" and raw[8] == 1
        v1 = tmp_path / "v1.kvckpt"
        v1.write_bytes(bytes(raw))
        data = read_checkpoint(v1)
        assert data.header.version == 1 and data.header.memory == MEMORY_ATTENTION
        rt.trim(0)
        restored = rt.restore(data)
        assert restored.tokens == conv.tokens
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "qwen35"])
def test_cli_save_resume_validate(arch, tiny_model_path, tmp_path):
    """The user's path: `run --stop-after --checkpoint-save`, `validate --model`, then
    `run --checkpoint-load` in a new process continues the same text."""
    model = str(tiny_model_path(arch))
    common = ["-m", model, "-n", "20", "--temp", "0.8", "--seed", "5", "--ignore-eos", "-t", "2", "--json"]
    full = json.loads(run_cli("run", "-p", "Hello there", *common, check=True).stdout)
    saved = tmp_path / "a.kvckpt"
    part = run_cli("run", "-p", "Hello there", *common, "--stop-after", "7", "--checkpoint-save", str(saved),
                   check=True)
    assert json.loads(part.stdout)["finish_reason"] == "paused"
    valid = run_cli("validate", str(saved), "--model", model, check=True)
    assert "Dimensions match model" in valid.stdout
    assert f"{KIND[arch]} memory" in valid.stdout
    rest = json.loads(run_cli("run", "--checkpoint-load", str(saved), *common[2:], check=True).stdout)
    assert json.loads(part.stdout)["text"] + rest["text"] == full["text"]


@pytest.mark.parametrize("arch", NOT_CONTROL)
def test_regenerate_reads_nothing_again(arch, tiny_model_path):
    """Regenerate goes back to the end of the prompt from the snapshot kept there (a
    recurrent memory cannot drop the answer's tail): nothing is decoded again, and the same
    seed draws the same answer, bit for bit."""
    from engine.generation import discard_answer
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        first = generate(rt, conv)
        logits_first = memkit.fingerprint(rt, first.text)
        discard_answer(conv)
        again = generate(rt, conv)
        assert (again.n_reused_tokens, again.n_prefilled) == (again.n_prompt_tokens, 0)
        assert memkit.fingerprint(rt, again.text) == logits_first
    finally:
        rt.close()


@pytest.mark.parametrize("arch", NOT_CONTROL)
def test_regenerate_after_a_restore_reads_nothing_again(arch, tiny_model_path, tmp_path):
    """In a new process, Regenerate of a restored answer goes back to the chain's file at
    the end of its prompt (a snapshot kept while restoring), reads nothing again, and
    draws what Regenerate in the first process drew, bit for bit."""
    from engine.checkpoints.format import KIND_AUTOSAVE
    from engine.generation import discard_answer
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        rt.prefill(conv.tokens)
        prompt = rt.save(tmp_path / "prompt.kvckpt", conv, KIND_AUTOSAVE)   # as an answer's first autosave
        generate(rt, conv)
        rt.save(tmp_path / "answer.kvckpt", conv, KIND_PAUSE, parent=prompt)
        discard_answer(conv)
        again = generate(rt, conv)
        expected = memkit.fingerprint(rt, again.text)
    finally:
        rt.close()
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        restored = rt.restore_chain(load_chain(tmp_path / "answer.kvckpt"))
        discard_answer(restored)
        regen = generate(rt, restored)
        assert (regen.n_reused_tokens, regen.n_prefilled) == (regen.n_prompt_tokens, 0)
        assert memkit.fingerprint(rt, regen.text) == expected
    finally:
        rt.close()


@pytest.mark.parametrize("arch", NOT_CONTROL)
def test_an_edit_is_read_from_where_the_message_started(arch, tiny_model_path):
    """Editing the last user message goes back to the snapshot kept where that message
    started (Answer.marks), not to the start: only the new message is read, and the answer,
    its logits and the state are, bit for bit, those of reading the edited prompt whole in a
    new cache.  (The history is given, not generated: tokens decoded one by one as an answer
    give other bits than the same tokens read in a prompt, which is why a branch continues
    the states the model had, and a re-read is no reference for it.)"""
    import copy

    from engine.conversation import Conversation
    from engine.generation import begin_answer, commit_answer
    from engine.sampling import SamplerSettings
    history = [("user", memkit.PROMPT), ("assistant", "The keeper lit the lamp and watched the sea all night.")]
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        conv = Conversation(messages=list(history), sampler=SamplerSettings(temperature=0.8, seed=11, ignore_eos=True))
        begin_answer(conv, rt, "And then what happened?", n_predict=8)
        generate(rt, conv)
        commit_answer(conv)
        edit = copy.deepcopy(conv)              # the second message edited: the first turn kept
        edit.messages, edit.answer = edit.messages[:2], None
        begin_answer(edit, rt, "Who was he?", n_predict=8)
        alone = copy.deepcopy(edit)
        start, _ = edit.answer.marks
        assert edit.tokens[:start] == conv.tokens[:start] and edit.tokens[start] != conv.tokens[start]
        edited = generate(rt, edit)
        assert (edited.n_reused_tokens, edited.n_prefilled) == (start, edited.n_prompt_tokens - start)
        expected = memkit.fingerprint(rt, edited.text)
    finally:
        rt.close()
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        whole = generate(rt, alone)
        assert whole.n_reused_tokens == 0
        assert memkit.fingerprint(rt, whole.text) == expected
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["lfm2", "rwkv7"])
def test_the_window_engine_regenerates_edits_and_switches(arch, tiny_model_path, tmp_path):
    """The window's engine thread on a hybrid and a recurrent model: answers, Regenerate
    (nothing read again), Continue, a second turn, Edit, three conversations in a cache of
    two (evicted ones restored from their files), two answers at once."""
    from enginekit import Recorder

    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(tiny_model_path(arch), n_ctx=1024, n_threads=2, sequences=2))
        rec.wait("loaded")
        w.autosave_every = 4
        # (ignore_eos: Regenerate draws with a new random seed, which may end the answer early)
        a = w.new_conversation(sampler=SamplerSettings(seed=3, temperature=0.8, ignore_eos=True))
        w.send(a, "Tell me about rivers.", n_predict=12)
        first = rec.wait("finished")[-1][1]
        w.regenerate(a)
        regen = rec.wait("finished", 2)[-1][1]
        assert regen.n_reused_tokens == regen.n_prompt_tokens > 0
        w.continue_answer(a, n_predict=6)
        w.send(a, "And lakes?", n_predict=8)
        w.edit_message(a, 0, "Tell me about seas.", n_predict=8)
        b = w.new_conversation(sampler=SamplerSettings(seed=4))
        w.send(b, "Hi", n_predict=6)
        c = w.new_conversation(sampler=SamplerSettings(seed=5))
        w.send(c, "Yo", n_predict=6)
        rec.wait("finished", 7)
        for conv_id in (a, b, c):   # three conversations, two sequences: one comes from its files
            w.show(conv_id)
        rec.wait("activated", 3)
        w.send(b, "A long answer, please", n_predict=20)
        w.send(c, "Another long one", n_predict=20)
        summaries = [e[1] for e in rec.wait("finished", 9)]
        assert not rec.of("error"), rec.of("error")
        assert [s.finish_reason for s in summaries] == ["length"] * 9
        assert first.n_generated == regen.n_generated == 12
        # some conversation was evicted, then restored from its files, not re-read
        activations = rec.of("activated")
        assert any(not resident and restored > 0 for _, _, resident, restored in activations), activations
    finally:
        w.shutdown()
        assert w.join(60)


def test_a_context_that_cannot_be_made_says_llama_cpps_reason(smollm_path):
    from native.context import KV_TYPES, Context, ContextSettings
    from native.errors import ContextError
    from native.model import Model
    model = Model(smollm_path)
    try:
        with pytest.raises(ContextError, match="quantized V cache requires flash_attn"):
            Context(model, ContextSettings(n_ctx=512, flash_attn=False, type_v=KV_TYPES["q8_0"]))
    finally:
        model.close()


def test_a_model_llama_cpp_refuses_says_why_and_vocab_only_loads(smollm_path, tmp_path):
    from native.errors import ModelLoadError
    from native.model import Model
    bad = tmp_path / "no-arch.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ModelLoadError, match="unknown model architecture"):
        Model(bad)
    vocab = Model(smollm_path, vocab_only=True)   # used to abort the process (no layers)
    try:
        assert vocab.shape.n_vocab == 49152 and vocab.tokenize("hello", add_special=False)
    finally:
        vocab.close()


def test_a_checkpoint_of_another_llama_cpp_state_layout_is_read_again(smollm_path, tmp_path, app_home):
    """A llama.cpp upgrade never strands a conversation: a file whose recorded state layout
    this build cannot take still opens — its text is read again, with a notice, and it is
    saved anew in the current layout (a full file, no delta on the old one)."""
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    common = ["-n", "16", "--temp", "0.7", "--seed", "3", "--ignore-eos", "-t", "2", "-c", "1024", "--json"]
    full = json.loads(run_cli("run", "-p", "Tell me about owls.", *common, check=True).stdout)
    saved = tmp_path / "old.kvckpt"
    part = json.loads(run_cli("run", "-p", "Tell me about owls.", *common, "--stop-after", "6",
                              "--checkpoint-save", str(saved), check=True).stdout)
    raw = bytearray(saved.read_bytes())
    raw[:HEADER_LEN] = pack_header(dataclasses.replace(unpack_header(bytes(raw[:HEADER_LEN])), state_layout=2))
    saved.write_bytes(bytes(raw))
    valid = run_cli("validate", str(saved), "--model", str(smollm_path), check=True).stdout
    assert "state layout 2" in valid and "reads its" in valid and "Dimensions match model" in valid
    done = run_cli("run", "--checkpoint-load", str(saved), *common, check=True)
    assert "read again" in done.stderr
    rest = json.loads(done.stdout)
    assert rest["n_reused_tokens"] == 0
    assert part["text"] + rest["text"] == full["text"]
    head = read_checkpoint(rest["checkpoint"])
    assert head.header.state_layout == 1 and not head.header.is_delta
    assert Path(rest["checkpoint"]).name in {h.path.name for h in Graph.scan(Store()).heads}


def test_the_window_reads_a_checkpoint_of_another_layout_again(tiny_model_path, tmp_path):
    """Opened in the window's engine: a notice says why, Resume reads its tokens again,
    and its new head is a full file in this layout."""
    from enginekit import Recorder

    from engine.sampling import SamplerSettings
    from engine.worker import EngineWorker, ModelOptions

    class Listener(Recorder):
        def on_notice(self, e):
            self._add("notice", e.title, e.message)

    path = tiny_model_path("lfm2")
    rt = Runtime(path, memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        generate(rt, conv, stop_after=5)
        info = rt.save(tmp_path / "old.kvckpt", conv, KIND_PAUSE)
    finally:
        rt.close()
    raw = bytearray(info.path.read_bytes())
    raw[:HEADER_LEN] = pack_header(dataclasses.replace(unpack_header(bytes(raw[:HEADER_LEN])), state_layout=7))
    info.path.write_bytes(bytes(raw))
    rec = Listener()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    try:
        w.load_model(ModelOptions(path, n_ctx=1024, n_threads=2))
        rec.wait("loaded")
        w.open_checkpoint(info.path)
        (_, title, message), = rec.wait("notice")
        assert "state layout 7" in message and "read again" in message
        conv_id = rec.wait("changed")[-1][1].id
        w.set_sampler(conv_id, SamplerSettings(temperature=0.8, seed=11, ignore_eos=True))
        w.resume(conv_id)
        summary = rec.wait("finished")[-1][1]
        assert summary.finish_reason == "length" and summary.n_reused_tokens == 0
        head = rec.wait("saved")[-1][2]
        # the new head's chain is of this layout alone (its base: where the prompt was read
        # to a mark, or the head itself), none of the old file's
        chain = load_chain(head)
        assert [d.header.state_layout for d in chain] == [1] * len(chain) and not chain[0].header.is_delta
        assert info.path not in [d.path for d in chain]
        assert not rec.of("error")
    finally:
        w.shutdown()
        assert w.join(60)


@pytest.mark.parametrize("arch", ["lfm2", "mamba2", "llama"])
def test_only_an_attention_memory_is_cut_inside_a_decode(arch, tiny_model_path):
    """After an abort llama.cpp cannot remove a half-done batch from a recurrent state (the
    removal fails and is ignored): those decodes are never cut; an attention one is."""
    from native.context import DECODE_ABORTED, DECODE_OK
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        tokens = memkit.conversation(rt).tokens[:memkit.SETTINGS.n_batch]
        asked = []
        rc = rt.ctx.decode(tokens, 0, abortable=True, should_abort=lambda: asked.append(1) or True)
        if KIND[arch] == "attention":
            assert rc == DECODE_ABORTED and asked
        else:
            assert rc == DECODE_OK and not asked
            assert rt.ctx.pos_max(0) == len(tokens) - 1
    finally:
        rt.close()


def test_a_save_the_walk_refuses_writes_nothing(tiny_model_path, tmp_path, monkeypatch):
    """A state that could not be loaded again is never announced as saved: the save fails,
    the file it would replace is untouched, and no temporary file is left."""
    import engine.runtime as runtime_module
    rt = Runtime(tiny_model_path("lfm2"), memkit.SETTINGS)
    try:
        conv = memkit.conversation(rt)
        generate(rt, conv, stop_after=3)
        target = tmp_path / "p.kvckpt"
        rt.save(target, conv, KIND_PAUSE)
        before = target.read_bytes()
        generate(rt, conv, stop_after=2)

        def refuse(*_args, **_kwargs):
            raise CorruptState("the recurrent state's rows are not float32")
        monkeypatch.setattr(runtime_module, "check_state_for", refuse)
        with pytest.raises(SaveFailed, match="could not be loaded again.*nothing was saved"):
            rt.save(target, conv, KIND_PAUSE)
        assert target.read_bytes() == before
        assert [p.name for p in tmp_path.iterdir()] == ["p.kvckpt"]
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_a_chains_earlier_recurrent_states_are_not_set(arch, tiny_model_path, tmp_path, monkeypatch):
    """Only the last file's recurrent state survives a chain's restore, so an earlier file's
    is not handed to llama.cpp: a recurrent memory's earlier files not at all, a hybrid's
    attention part alone where its recurrent state is the larger part (engine.restore;
    a chain of Qwen3-Next-width files restored 2.6x slower than llama-server's one file).
    The state restored is byte for byte the one the last file's whole state gives."""
    from engine.checkpoints.kvstate import recurrent_block_len
    from engine.conversation import Conversation
    from engine.generation import begin_answer
    from engine.sampling import SamplerSettings
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        # a short prompt: the hybrid's attention cells are then the smaller part, as at
        # Qwen3-Next's widths at any length
        conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=5, ignore_eos=True))
        begin_answer(conv, rt, "Hello there.", n_predict=24)
        generate(rt, conv, stop_after=4)
        base = rt.save(tmp_path / "base.kvckpt", conv)
        generate(rt, conv, stop_after=4)
        middle = rt.save(tmp_path / "middle.kvckpt", conv, parent=base)
        generate(rt, conv, stop_after=4)
        last = rt.save(tmp_path / "last.kvckpt", conv, parent=middle)
        expected = memkit.state_bytes(rt)
        chain = load_chain(last.path)
        assert [d.path.name for d in chain] == ["base.kvckpt", "middle.kvckpt", "last.kvckpt"]
        # a delta of metadata only on the last (nothing new since): its parent's recurrent
        # state is the one that survives, and is set
        head = rt.save(tmp_path / "head.kvckpt", conv, parent=last)
        assert not len(load_chain(head.path)[-1].state)
        rt.trim(0)
        rt.restore_chain(load_chain(head.path))
        assert memkit.state_bytes(rt) == expected
        handed = []
        real = rt.ctx.state_set_from
        monkeypatch.setattr(rt.ctx, "state_set_from", lambda *a, **k: (handed.append(a[1]), real(*a, **k))[1])
        rt.trim(0)
        rt.restore_chain(chain)
        assert memkit.state_bytes(rt) == expected
        assert rt.kv_tokens == list(chain[-1].tokens[:chain[-1].header.n_tokens])
        layouts = [check_state_for(d.header, d.state) for d in chain]
        recurrent = [recurrent_block_len(layout) for layout in layouts]
        if arch == "mamba2":
            assert handed == [len(chain[-1].state)]   # the last file's state alone
        else:
            assert len(chain[0].state) - recurrent[0] < recurrent[0] // 4, "the recurrent part is not the larger"
            assert handed[-1] == len(chain[-1].state)
            # the earlier files: their attention cells, and a recurrent block of no cell
            assert handed[:-1] == [len(d.state) - r + 12 + 24 * layouts[i].recurrent[0]
                                                 for i, (d, r) in enumerate(zip(chain[:-1], recurrent, strict=False))]
    finally:
        rt.close()


@pytest.mark.parametrize("arch", ["qwen35", "mamba2"])
def test_the_prompt_ends_snapshot_comes_from_its_file(arch, tiny_model_path, tmp_path, monkeypatch):
    """The snapshot a restore keeps at the answer's prompt end (Regenerate) is the recurrent
    part of the prompt's file, copied out of the file once the chain settled, not set into
    llama.cpp and copied back out of it (12.6 MB each way at Qwen3-Next's widths): the
    prompt file gives its attention cells alone (a hybrid) or nothing (a recurrent memory),
    and the snapshot is byte for byte the one llama.cpp gives after that file."""
    from engine.checkpoints.format import KIND_AUTOSAVE
    from engine.checkpoints.kvstate import recurrent_block_len
    from engine.conversation import Conversation
    from engine.generation import begin_answer
    from engine.sampling import SamplerSettings
    from engine.snapshots import PromptSnapshot
    rt = Runtime(tiny_model_path(arch), memkit.SETTINGS)
    try:
        conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=5, ignore_eos=True))
        begin_answer(conv, rt, "Hello there.", n_predict=24)   # short: the recurrent part is the larger
        rt.prefill(conv.tokens)
        prompt = rt.save(tmp_path / "prompt.kvckpt", conv, KIND_AUTOSAVE)
        generate(rt, conv, stop_after=6)
        answer = rt.save(tmp_path / "answer.kvckpt", conv, KIND_PAUSE, parent=prompt)
        chain = load_chain(answer.path)
        n_prompt = chain[0].header.n_tokens
        assert conv.answer is not None and conv.answer.n_prompt_tokens == n_prompt
        rt.trim(0)
        rt.restore_chain(chain[:1])
        expected = PromptSnapshot.take(rt.ctx, 0, rt.kv_tokens, None, recurrent_only=True)
        assert expected is not None
        handed = []
        real = rt.ctx.state_set_from
        monkeypatch.setattr(rt.ctx, "state_set_from", lambda *a, **k: (handed.append(a[1]), real(*a, **k))[1])
        rt.trim(0)
        rt.restore_chain(chain)
        kept = rt._snapshots.at(rt.kv_tokens, n_prompt)
        assert kept is not None and kept.recurrent_only
        assert kept.state_now().tobytes() == expected.state_now().tobytes()
        assert kept.logits is not None and np.array_equal(kept.logits, chain[0].logits)
        layout = check_state_for(chain[0].header, chain[0].state)
        block = recurrent_block_len(layout)
        if arch == "mamba2":
            assert handed == [len(chain[1].state)]   # the prompt file is not set at all
        else:
            assert handed == [len(chain[0].state) - block + 12 + 24 * layout.recurrent[0], len(chain[1].state)]
    finally:
        rt.close()
