"""A large state's checksum is computed while llama.cpp copies it (load_chain's ``crc_later``,
issue 25's restore speed): a damaged file is still refused with the reason it had before,
and nothing of it stays in the cache, the conversation's or another's.

The files are real (SmolLM2, the default q8_0 cache); the threshold for checksumming later
is lowered so that small states take that path, on the mapped reader and the copying one.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoints import format as fmt
from engine.checkpoints import mapped
from engine.checkpoints.chain import load_chain
from engine.concurrent import Batcher, Job
from engine.conversation import Conversation
from engine.errors import BrokenChain, ChecksumMismatch, RestoreFailed
from engine.generation import begin_answer, generate
from engine.parallel import ParallelRuntime
from engine.prefix_reuse import reuse_stored_prefix
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from native.context import ContextSettings

SETTINGS = ContextSettings(n_ctx=1024, n_threads=2)


@pytest.fixture(params=["mapped", "read"])
def later_always(request, monkeypatch):
    """Every state is checksummed later; mapped or read into memory, as the parameter says."""
    if request.param == "mapped" and not mapped.supported():
        pytest.skip("no MADV_POPULATE_READ here")
    monkeypatch.setattr(fmt, "CRC_LATER_MIN_BYTES", 0)
    monkeypatch.setattr(mapped, "MAP_MIN_BYTES", 0 if request.param == "mapped" else 1 << 62)


@pytest.fixture(scope="module")
def rt(smollm_path):
    runtime = Runtime(smollm_path, SETTINGS)
    yield runtime
    runtime.close()


def _conv(runtime, text: str, seed: int) -> Conversation:
    conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=seed, ignore_eos=True))
    begin_answer(conv, runtime, text, n_predict=24)
    return conv


def _saved(runtime: Runtime, path, text: str, seed: int, stop_after: int = 6, parent=None):
    runtime.trim(0)
    conv = _conv(runtime, text, seed)
    generate(runtime, conv, stop_after=stop_after)
    return runtime.save(path, conv, parent=parent), conv


def _damaged_copy(src, dst, where: str = "state") -> None:
    """``src`` with one bit flipped: in the middle of the K/V data, or in a token id."""
    data = bytearray(src.read_bytes())
    h = fmt.read_header(src)
    at = h.state_offset + h.state_len - h.state_len // 3 if where == "state" else \
        fmt.HEADER_LEN + h.meta_len + 4 * (h.n_tokens // 2) + 3   # a token id's high byte
    data[at] ^= 0x40
    dst.write_bytes(bytes(data))


def test_a_damaged_state_is_refused_after_the_copy_and_nothing_of_it_stays(rt, tmp_path, later_always,
                                                                            monkeypatch):
    good, _ = _saved(rt, tmp_path / "good.kvckpt", "Write a few lines about lighthouses.", 1)
    bad = tmp_path / "bad.kvckpt"
    _damaged_copy(good.path, bad)
    chain = load_chain(bad, crc_later=True)
    assert chain[-1].pending_crc is not None, "the checksum was not left to run on"
    copied = []
    real = rt.ctx.state_set_from
    monkeypatch.setattr(rt.ctx, "state_set_from", lambda *a, **k: (copied.append(a[1]), real(*a, **k))[1])
    rt.trim(0)
    with pytest.raises(ChecksumMismatch, match="damaged after it was written"):
        rt.restore_chain(chain)
    assert copied, "llama.cpp never took the state: the overlap was not exercised"
    assert rt.ctx.pos_max(0) == -1 and rt.kv_tokens == [], "cells of a damaged file stayed in the cache"
    with pytest.raises(ChecksumMismatch):   # and it stays refused
        chain[-1].settle()
    # the same file undamaged restores, and continues as it would have
    conv = rt.restore_chain(load_chain(good.path, crc_later=True))
    assert rt.ctx.pos_max(0) == good.n_tokens - 1
    assert generate(rt, conv).n_prefilled == 0


def test_a_damaged_token_array_is_a_checksum_mismatch_not_a_vocabulary_error(rt, tmp_path, later_always):
    good, _ = _saved(rt, tmp_path / "good.kvckpt", "List three fruits and their colours.", 2)
    bad = tmp_path / "bad.kvckpt"
    _damaged_copy(good.path, bad, where="tokens")
    with pytest.raises(ChecksumMismatch):
        load_chain(bad, crc_later=True)


def test_a_damaged_parent_is_named_as_before(rt, tmp_path, later_always):
    base, conv = _saved(rt, tmp_path / "base.kvckpt", "Tell me a short story about a cat.", 3)
    generate(rt, conv, stop_after=5)
    delta = rt.save(tmp_path / "delta.kvckpt", conv, parent=base)
    assert fmt.read_header(delta.path).is_delta
    _damaged_copy(base.path, tmp_path / "base.kvckpt")
    chain = load_chain(delta.path, crc_later=True)
    rt.trim(0)
    with pytest.raises(BrokenChain, match="the parent checkpoint base.kvckpt is damaged: payload checksum"):
        rt.restore_chain(chain)
    assert rt.ctx.pos_max(0) == -1


def test_every_chains_checksums_run_in_turn_on_one_thread_no_restore_starts(rt, tmp_path, later_always,
                                                                            monkeypatch):
    """Every large state of every chain is checksummed in turn on ONE helper thread,
    started when the runtime loaded its model (crc_helper: a thread per file made the
    checksums run at once beside the copy; a thread per chain cost each restore 0.2–0.3 ms);
    a restore starts no thread, and a damaged middle file is still named."""
    import threading

    from engine.checkpoints import crc_helper
    base, conv = _saved(rt, tmp_path / "base.kvckpt", "Describe a walk through a forest.", 4)
    generate(rt, conv, stop_after=4)
    mid = rt.save(tmp_path / "mid.kvckpt", conv, parent=base)
    generate(rt, conv, stop_after=4)
    last = rt.save(tmp_path / "last.kvckpt", conv, parent=mid)
    started: list[threading.Thread] = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda self: (started.append(self), real_start(self))[1])
    ran_on: list[str] = []
    real_compute = crc_helper.QueuedCrc.compute
    monkeypatch.setattr(crc_helper.QueuedCrc, "compute",
                        lambda job: (ran_on.append(threading.current_thread().name), real_compute(job))[1])
    for _ in range(2):
        chain = load_chain(last.path, crc_later=True)
        assert len(chain) == 3 and all(d.pending_crc is not None for d in chain)
        rt.trim(0)
        rt.restore_chain(chain)
        assert rt.ctx.pos_max(0) == last.n_tokens - 1
    assert not started, "a restore started a thread"
    assert ran_on == ["checkpoint-restore-crc"] * 6
    _damaged_copy(mid.path, tmp_path / "mid.kvckpt")
    rt.trim(0)
    with pytest.raises(BrokenChain, match="the parent checkpoint mid.kvckpt is damaged: payload checksum"):
        rt.restore_chain(load_chain(last.path, crc_later=True))
    assert rt.ctx.pos_max(0) == -1


def test_a_runtime_starts_the_checksum_thread_and_asks_the_mapping_questions_as_it_loads(smollm_path):
    """In a new process, the helper thread and the mapping probes are there once a model is
    loaded, before any restore (engine.checkpoints.chain.prepare_to_load): a first restore
    does not pay for them."""
    import subprocess
    import sys
    script = (
        "import sys, threading\n"
        "from engine.checkpoints import mapped\n"
        "from engine.runtime import Runtime\n"
        "from native.context import ContextSettings\n"
        "names = lambda: sorted(t.name for t in threading.enumerate())\n"
        "print(names(), mapped.supported.cache_info().currsize, mapped._syscall.cache_info().currsize)\n"
        "rt = Runtime(sys.argv[1], ContextSettings(n_ctx=256, n_threads=1))\n"
        "print(names(), mapped.supported.cache_info().currsize, mapped._syscall.cache_info().currsize)\n"
        "rt.close()\n")
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", script, str(smollm_path)], capture_output=True, text=True,
                          timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = done.stdout.strip().splitlines()[-2:]
    assert "checkpoint-restore-crc" not in before and before.endswith("0 0")
    assert "'checkpoint-restore-crc'" in after and after.endswith("1 1")


def test_another_conversation_in_the_cache_keeps_its_state(smollm_path, tmp_path, later_always):
    """ParallelRuntime: a damaged file restored into one sequence costs the others nothing:
    their state bytes are the same before and after, and their answers go on exactly."""
    single = Runtime(smollm_path, SETTINGS)
    try:
        good, _ = _saved(single, tmp_path / "good.kvckpt", "What is the capital of France? Explain.", 4)
        expected = generate(single, _conv(single, "Write a few lines about lighthouses.", 5)).text \
            if single.trim(0) == 0 else None
    finally:
        single.close()
    _damaged_copy(good.path, tmp_path / "bad.kvckpt")
    prt = ParallelRuntime(smollm_path, SETTINGS, sequences=2)
    try:
        other = _conv(prt, "Write a few lines about lighthouses.", 5)
        job = Job(other, prt.place(other.id, running=True).seq)
        job.stop_after = 9
        b = Batcher(prt)
        b.add(job)
        b.run()
        before = _state(prt, job.seq)
        target = prt.place("restored", running=True).seq
        with pytest.raises(ChecksumMismatch):
            prt.restore(load_chain(tmp_path / "bad.kvckpt", crc_later=True), target)
        assert prt.tokens(target) == [] and prt.ctx.pos_max(target) == -1
        assert np.array_equal(_state(prt, job.seq), before), "the other conversation's state changed"
        first = job.result.text
        resumed = Job(other, job.seq)
        b = Batcher(prt)
        b.add(resumed)
        b.run()
        assert first + resumed.result.text == expected
    finally:
        prt.close()


def _state(prt: ParallelRuntime, seq: int) -> np.ndarray:
    size = prt.ctx.state_size(seq)
    buf = np.empty(size, dtype=np.uint8)
    return buf[:prt.ctx.state_get_into(buf, size, seq)].copy()


def test_prefix_reuse_skips_a_damaged_file_and_says_what_the_cache_holds(rt, tmp_path, later_always):
    """The stored file that shares the most of a prompt is damaged in its state: it is
    skipped, and since its restore emptied the cache, the answer says nothing is reused
    (not the tokens the cache held before)."""
    store = tmp_path / "store"
    store.mkdir()
    text = " ".join(f"Line {i}: write a few lines about lighthouses and the sea." for i in range(8))
    good, conv = _saved(rt, tmp_path / "good.kvckpt", text, 6)   # over the index's 64-token blocks
    _damaged_copy(good.path, store / "damaged.kvckpt")
    prompt = list(conv.tokens)
    rt.trim(0)
    rt.prefill(prompt[:5])               # the cache holds the prompt's first tokens
    reuse = reuse_stored_prefix(rt, store, prompt)
    assert (reuse.how, reuse.n_tokens) == ("recompute", 0), reuse.describe()
    assert rt.kv_tokens == [] and rt.ctx.pos_max(0) == -1


def test_prefix_reuse_skips_a_file_gone_since_it_was_found(rt, tmp_path, monkeypatch):
    """The stored file that shares the most of a prompt is deleted (another process, a
    prune) between the index finding it and its read: it is skipped like a damaged one,
    and the cache's own prefix is what is reused."""
    import engine.prefix_reuse as prefix_reuse
    store = tmp_path / "store"
    store.mkdir()
    text = " ".join(f"Line {i}: write a few lines about lighthouses and the sea." for i in range(8))
    good, conv = _saved(rt, store / "good.kvckpt", text, 6)   # over the index's 64-token blocks
    prompt = list(conv.tokens)
    rt.trim(0)
    rt.prefill(prompt[:5])               # the cache holds the prompt's first tokens
    real = prefix_reuse.load_chain

    def gone(path, **kwargs):
        os.unlink(path)
        return real(path, **kwargs)

    monkeypatch.setattr(prefix_reuse, "load_chain", gone)
    reuse = reuse_stored_prefix(rt, store, prompt)
    assert not good.path.exists()
    assert (reuse.how, reuse.n_tokens) == ("cache", 5), reuse.describe()
    assert rt.kv_tokens == prompt[:5]


def test_a_state_llama_cpp_refuses_leaves_no_snapshot_of_the_files_before_it(tiny_model_path, tmp_path,
                                                                            monkeypatch):
    """A hybrid memory (tiny qwen35) keeps a snapshot after the file at its answer's prompt
    end while restoring; when llama.cpp then refuses a later file's state, that snapshot
    goes with the rest (an earlier large file's checksum may still have been running)."""
    from native.errors import StateError
    rt = Runtime(tiny_model_path("qwen35"), SETTINGS)
    try:
        conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=9, ignore_eos=True))
        begin_answer(conv, rt, "Tell me a short story about a cat.", n_predict=24)
        rt.prefill(conv.tokens)
        base = rt.save(tmp_path / "base.kvckpt", conv)          # at the prompt's end
        generate(rt, conv, stop_after=5)
        middle = rt.save(tmp_path / "middle.kvckpt", conv, parent=base)
        rt.trim(0)
        rt.restore_chain(load_chain(middle.path))
        assert rt.snapshot_at(base.n_tokens) is not None, "no snapshot at the prompt's end: nothing tested"
        rt.trim(0)
        real, calls = rt.ctx.state_set_from, []

        def refuse_the_second(*args, **kwargs):
            calls.append(args[2])
            if len(calls) == 2:
                raise StateError("refused")
            return real(*args, **kwargs)
        monkeypatch.setattr(rt.ctx, "state_set_from", refuse_the_second)
        with pytest.raises(RestoreFailed, match="refused"):
            rt.restore_chain(load_chain(middle.path))
        assert rt.kv_tokens == [] and rt.ctx.pos_max(0) == -1
        assert len(rt._snapshots) == 0, "a snapshot of the partly restored chain stayed"
    finally:
        rt.close()
