"""Issue 13, save speed: the CRC is computed on a helper thread while the bytes are written,
and every save reuses one state buffer.  Neither may change a single byte of the file.

The reference writer below follows the format's spec (engine.checkpoints.format's
docstring) in the simplest way, serially, as the writer did before the change.
"""

from __future__ import annotations

import errno
import io
import os
import struct
import sys
import threading
import time
import uuid
import zlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.checkpoints import format as fmt
from engine.checkpoints.chain import load_chain
from engine.conversation import Conversation
from engine.generation import begin_answer, generate
from engine.sampling import SamplerSettings


def reference_write(out, header, meta_bytes, tokens, logits, state, point_states=(), state_tail_crc=None):
    """The checkpoint as the spec lays it out, written and checksummed in one pass (every byte:
    ``state_tail_crc``, a CRC the writer had already, is not used)."""
    tokens_bytes = np.asarray(tokens, dtype="<i4").tobytes()
    logits_bytes = b"" if logits is None else np.asarray(logits, dtype="<f4").tobytes()
    points_bytes = b"".join(bytes(memoryview(p).cast("B")) for p in point_states)
    state_bytes = bytes(memoryview(state).cast("B")) + points_bytes
    flags = (fmt.FLAG_HAS_LOGITS if logits is not None else 0) | (
        fmt.FLAG_PREFILL_PENDING if header.n_tokens < header.n_tokens_total else 0) | (
        header.flags & fmt.FLAG_DELTA) | (fmt.FLAG_POINT_STATES if points_bytes else 0)
    header = replace(header, flags=flags, meta_len=len(meta_bytes), tokens_len=len(tokens_bytes),
                     logits_len=len(logits_bytes), state_len=len(state_bytes))
    payload = meta_bytes + tokens_bytes + logits_bytes + state_bytes
    crc = zlib.crc32(payload)
    out.write(fmt.pack_header(header) + payload + struct.pack("<I", crc) + fmt.TRAILER_MAGIC)
    return header, crc


def _header(n_tokens: int, n_total: int, n_vocab: int = 1000) -> fmt.Header:
    return fmt.Header(
        model_fingerprint=b"\x07" * 16, model_size=123, n_vocab=n_vocab, n_layer=30, n_head_kv=3,
        n_embd_head_k=64, n_embd_head_v=64, n_swa=0, n_ctx=4096, type_k=8, type_v=8,
        flash_attn=True, kv_unified=True, n_seq_max=2, n_tokens=n_tokens, n_tokens_total=n_total,
        n_generated=0, created_unix_ns=1_700_000_000_000_000_000,
        conversation_id=uuid.UUID(int=42), library="test", title="save path")


def _sections(state_len: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    n = 300
    tokens = rng.integers(0, 1000, n, dtype=np.int32)
    logits = rng.standard_normal(1000).astype(np.float32)
    state = np.empty(state_len, dtype=np.uint8)
    state[:] = rng.integers(0, 256, state_len, dtype=np.uint8)
    meta = fmt.encode_metadata({"checkpoint_id": "ab" * 16, "title": "save path", "n": state_len})
    # no state: nothing decoded yet, so no logits either (the reader refuses logits without
    # a token, and so the writer does)
    return _header(n if state_len else 0, n), meta, tokens, logits if state_len else None, state


# sizes around the thread threshold and the write chunk: empty, tiny, just below and at the
# threshold, not a multiple of any chunk, several write chunks
SIZES = [0, 1, (1 << 20) - 5000, 1 << 20, 3_000_001, (8 << 20) * 2 + 12345]


@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["crc-thread", "crc-inline"])
@pytest.mark.parametrize("state_len", SIZES)
def test_file_is_byte_identical_to_the_reference_writer(monkeypatch, threshold, state_len):
    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", threshold)
    header, meta, tokens, logits, state = _sections(state_len)
    ours, ref = io.BytesIO(), io.BytesIO()
    written, crc = fmt.write_sections(ours, header, meta, tokens, logits, state, chunk=1 << 20)
    ref_header, ref_crc = reference_write(ref, header, meta, tokens, logits, state)
    assert ours.getvalue() == ref.getvalue()
    assert (written, crc) == (ref_header, ref_crc)


class _Writes(io.BytesIO):
    """A file that records where each write lands."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[int, int]] = []

    def write(self, data) -> int:
        start = self.tell()
        n = super().write(data)
        self.spans.append((start, start + n))
        return n


@pytest.mark.parametrize("state_len,chunk", [(3_000_001, 1 << 20), ((8 << 20) * 2 + 12345, 1 << 20),
                                             (100_001, 4096)])   # the last: the logits cross boundaries too
def test_the_state_is_written_in_chunks_aligned_in_the_file(state_len, chunk):
    # a large-folio page cache keeps an aligned 2 MiB write as one huge page, which a
    # restore maps at once (format._write_parts): no write may straddle a chunk boundary,
    # and every chunk wholly inside the state is written by one write
    header, meta, tokens, logits, state = _sections(state_len)
    out = _Writes()
    written, _ = fmt.write_sections(out, header, meta, tokens, logits, state, chunk=chunk)
    assert all(start // chunk == (end - 1) // chunk for start, end in out.spans if end > start)
    state_start = fmt.HEADER_LEN + written.meta_len + written.tokens_len + written.logits_len
    inside = {(b, b + chunk) for b in range(0, state_start + state_len - chunk + 1, chunk) if b >= state_start}
    assert inside and inside <= set(out.spans)
    ref = io.BytesIO()
    reference_write(ref, header, meta, tokens, logits, state)
    assert out.getvalue() == ref.getvalue()


@pytest.mark.parametrize("threshold", [0, 1 << 62], ids=["crc-thread", "crc-inline"])
def test_crc_written_is_the_crc_of_the_bytes(monkeypatch, tmp_path, threshold):
    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", threshold)
    header, meta, tokens, logits, state = _sections(5_000_003, seed=7)
    path = tmp_path / "c.kvckpt"
    with open(path, "wb") as f:
        _, crc = fmt.write_sections(f, header, meta, tokens, logits, state)
    raw = path.read_bytes()
    assert struct.unpack("<I", raw[-8:-4])[0] == crc == zlib.crc32(raw[fmt.HEADER_LEN:-8])
    data = fmt.read_checkpoint(path)            # the reader agrees, byte for byte
    assert data.payload_crc == crc
    assert np.array_equal(data.state, state) and np.array_equal(data.tokens, tokens)


class _FullDisk(io.RawIOBase):
    def __init__(self, after: int) -> None:
        self.after, self.written = after, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        n = len(memoryview(data).cast("B"))
        if self.written + n > self.after:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += n
        return n


def test_a_failed_write_stops_the_checksum_thread(monkeypatch):
    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", 0)
    header, meta, tokens, logits, state = _sections(20 << 20, seed=3)
    out = io.BufferedWriter(_FullDisk(after=3 << 20))
    with pytest.raises(OSError) as info:
        fmt.write_sections(out, header, meta, tokens, logits, state, chunk=1 << 20)
    assert info.value.errno == errno.ENOSPC
    # the caller may reuse (overwrite) its state buffer at once: nothing reads it any more
    assert not [t for t in threading.enumerate() if t.name == "checkpoint-crc"]


def test_a_failing_checksum_is_reported_not_lost(monkeypatch):
    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", 0)

    real = fmt.crc32

    def broken(data, *args):   # fails on the state's chunks only (the header's CRC is small)
        if len(memoryview(data)) >= 1 << 20:
            raise MemoryError("simulated")
        return real(data, *args)
    monkeypatch.setattr(fmt, "crc32", broken)
    header, meta, tokens, logits, state = _sections(2 << 20)
    with pytest.raises(MemoryError):
        fmt.write_sections(io.BytesIO(), header, meta, tokens, logits, state)


# -- the runtime's save: real SmolLM2 ------------------------------------------------------

def _conversation(rt, text: str, n: int) -> Conversation:
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0, seed=3, ignore_eos=True))
    begin_answer(conv, rt, text)
    generate(rt, conv, stop_after=n)     # a paused answer: it can be continued
    return conv


def _fresh_state(rt) -> bytes:
    size = rt.ctx.state_size(0)
    buf = np.empty(size, dtype=np.uint8)
    return bytes(buf[:rt.ctx.state_get_into(buf, size, 0)])


def test_saves_reuse_one_buffer_and_write_the_current_state(smollm_runtime, tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", 0)   # the threaded path even for small files
    rt = smollm_runtime
    conv = _conversation(rt, "Name three rivers. " * 20, 8)
    rt.save(tmp_path / "a.kvckpt", conv)
    buffer = rt._state_buffer
    assert buffer is not None
    rt.release_state_buffer()
    rt.save(tmp_path / "a.kvckpt", conv)          # a released buffer comes back on demand
    buffer = rt._state_buffer
    # the same conversation, a few tokens longer: the buffer's headroom holds it
    generate(rt, conv, stop_after=4)
    info = rt.save(tmp_path / "b.kvckpt", conv)
    assert rt._state_buffer is buffer, "the second save allocated a new state buffer"
    data = fmt.read_checkpoint(info.path)
    assert bytes(data.state) == _fresh_state(rt), "the file holds another state than the cache"
    raw = info.path.read_bytes()
    assert info.payload_crc == zlib.crc32(raw[fmt.HEADER_LEN:-8]) == data.payload_crc


def test_save_is_byte_identical_to_the_old_way(smollm_runtime, tmp_path, monkeypatch):
    """Same conversation, same state: the old writer (a fresh buffer, serial CRC) and the
    new one (reused buffer, CRC on a thread) produce the same file."""
    import engine.runtime as runtime_module
    rt = smollm_runtime
    conv = _conversation(rt, "Describe a harbour at dawn. " * 40, 6)
    # the two saves must not differ in their id or time stamp
    monkeypatch.setattr(runtime_module.uuid, "uuid4", lambda: uuid.UUID(int=7))
    monkeypatch.setattr(runtime_module.time, "time_ns", lambda: 1_700_000_000_123_456_789)

    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", 0)
    rt.save(tmp_path / "warm.kvckpt", conv)       # the buffer now exists and is reused below
    new = rt.save(tmp_path / "new.kvckpt", conv)

    rt.release_state_buffer()
    monkeypatch.setattr(runtime_module, "write_sections", reference_write)
    old = rt.save(tmp_path / "old.kvckpt", conv)
    assert (tmp_path / "new.kvckpt").read_bytes() == (tmp_path / "old.kvckpt").read_bytes()
    assert new.payload_crc == old.payload_crc


def test_delta_saves_go_through_the_same_buffer(smollm_runtime, tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "CRC_THREAD_MIN_BYTES", 0)
    rt = smollm_runtime
    conv = _conversation(rt, "Write about winter. " * 30, 5)
    base = rt.save(tmp_path / "base.kvckpt", conv)
    buffer = rt._state_buffer
    generate(rt, conv, stop_after=12)
    delta = rt.save(tmp_path / "delta.kvckpt", conv, parent=base)
    assert delta.delta and rt._state_buffer is buffer
    raw = delta.path.read_bytes()
    assert delta.payload_crc == zlib.crc32(raw[fmt.HEADER_LEN:-8])
    kv, logits = list(rt.kv_tokens), np.array(rt.logits(), copy=True)
    # overwrite the buffer (another save) before restoring: the files must not share it
    rt.save(tmp_path / "other.kvckpt", conv)
    chain = load_chain(delta.path)
    assert [Path(d.path).name for d in chain] == ["base.kvckpt", "delta.kvckpt"]
    rt.trim(0)
    rt.restore_chain(chain)
    assert rt.kv_tokens == kv and np.array_equal(rt.logits(), logits)
    assert rt.last_restore_s > 0


def test_restore_time_is_recorded(smollm_runtime, tmp_path):
    rt = smollm_runtime
    conv = _conversation(rt, "One line about tea.", 3)
    info = rt.save(tmp_path / "t.kvckpt", conv)
    rt.last_restore_s = 0.0
    started = time.perf_counter()
    rt.restore(fmt.read_checkpoint(info.path))
    assert 0 < rt.last_restore_s <= time.perf_counter() - started


def test_the_fast_crc_is_zlibs_crc32():
    from engine.checkpoints import crc
    data = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    view = memoryview(data)
    assert crc.FAST                                     # python-isal is a dependency
    assert crc.crc32(view) == zlib.crc32(view)
    assert crc.crc32(view[100:], crc.crc32(view[:100])) == zlib.crc32(view)
    assert crc.crc32(b"") == 0 and crc.crc32(b"abc", 7) == zlib.crc32(b"abc", 7)


def _write_through_atomic(path: Path, size: int, **kwargs) -> None:
    from engine.checkpoints.atomic import atomic_write
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    with atomic_write(path, **kwargs) as f:
        for start in range(0, size, 1 << 20):
            f.write(memoryview(data)[start:start + (1 << 20)])
    if kwargs.get("landing") is not None:
        assert kwargs["landing"].settle() is None
    assert path.read_bytes() == data.tobytes()


def test_a_waited_for_save_hints_the_os_to_write_out_as_it_goes(monkeypatch, tmp_path):
    from engine.checkpoints import atomic
    hinted = []

    def hint(fd):
        hinted.append(os.fstat(fd).st_size)   # what the file held when the hint came
    monkeypatch.setattr(atomic, "start_writeback", hint)
    step = atomic.WRITEBACK_STEP
    _write_through_atomic(tmp_path / "a.bin", 3 * step + 12345)
    assert hinted == [step, 2 * step, 3 * step]     # every step, with the bytes flushed first
    # no hint where nothing waits for the fsync: a landing's happens on a helper thread,
    # and a non-durable write has none
    hinted.clear()
    landing = atomic.Landing()
    _write_through_atomic(tmp_path / "b.bin", 3 * step, landing=landing)
    _write_through_atomic(tmp_path / "c.bin", 3 * step, durable=False)
    assert hinted == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")
def test_the_writeback_hint_is_the_real_call_on_linux(tmp_path):
    from engine.checkpoints import atomic
    assert atomic.start_writeback is not None
    _write_through_atomic(tmp_path / "real.bin", 2 * atomic.WRITEBACK_STEP + 1)
    assert atomic.start_writeback(-1) is None    # a bad descriptor: ignored, as a hint may be


def test_the_replaced_file_is_freed_after_the_rename_and_nothing_is_left(tmp_path):
    from engine.checkpoints.atomic import atomic_write, wait_for_helper
    target = tmp_path / "p.kvckpt"
    target.write_bytes(b"old" * 1000)
    old_inode = target.stat().st_ino
    with open(target, "rb") as reader:          # a reader of the old file keeps reading it
        with atomic_write(target) as f:
            f.write(b"new" * 1000)
        assert target.read_bytes() == b"new" * 1000 and target.stat().st_ino != old_inode
        assert reader.read() == b"old" * 1000
    wait_for_helper(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.kvckpt"]   # the second name is gone


def test_a_failed_rename_keeps_the_old_file_and_leaves_no_second_name(monkeypatch, tmp_path):
    from engine.checkpoints import atomic
    from engine.checkpoints.atomic import wait_for_helper
    target = tmp_path / "p.kvckpt"
    target.write_bytes(b"old")

    def refuse(src, dst):
        raise OSError(errno.EIO, "Input/output error")
    monkeypatch.setattr(atomic, "replace", refuse)
    with pytest.raises(OSError):
        with atomic.atomic_write(target) as f:
            f.write(b"new")
    wait_for_helper(timeout=30)
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.kvckpt"]


def test_a_step_after_a_landing_runs_once_it_landed_and_never_after_a_failure(tmp_path, caplog):
    from engine.checkpoints import atomic
    ran = []
    landing = atomic.Landing()
    with atomic.atomic_write(tmp_path / "ok.bin", landing=landing) as f:
        f.write(b"ok")
    landing.then(lambda: ran.append((tmp_path / "ok.bin").exists()))
    assert landing.settle() is None and ran == [True]          # after the rename, not before

    def refuse():
        raise OSError(errno.ENOSPC, "No space left on device")
    landing.submit(refuse)
    landing.then(lambda: ran.append("after a failure"))
    assert isinstance(landing.settle(), OSError) and ran == [True]   # the failure reported, the step skipped

    def broken_step():
        raise RuntimeError("a step's own bug")
    with atomic.atomic_write(tmp_path / "ok2.bin", landing=landing) as f:
        f.write(b"ok")
    landing.then(broken_step)
    assert landing.settle() is None                     # the save landed: its step's failure is logged
    assert (tmp_path / "ok2.bin").exists() and "a step after a checkpoint landed failed" in caplog.text
