"""Save vs raw write+fsync, the old save path and the new one side by side (issue 13).

    python -m benchmarks.save_speed [--models smollm,gemma] [--sizes 2048,8192]
                                    [--repeats 7] [--threads 2]

For each context length the prompt is prefilled once; then, interleaved and in rotating
order, each trial runs:

* ``raw``: write the checkpoint's own bytes (already in memory) to a new file + fsync
  (the previous copy is deleted before the clock starts);
* ``get_write``: copy the state out of llama.cpp into a fresh buffer, then write + fsync
  it (what any save must at least do);
* ``old``: ``Runtime.save`` as before issue 13 (a fresh state buffer per save, CRC32
  computed inline, serially with the writes, no writeback hints, the replaced file freed
  inside the rename);
* ``new``: ``Runtime.save`` as it is (the state buffer reused; the CRC32 by
  engine.checkpoints.crc — python-isal, ~9x zlib's speed — inline, or on a helper thread
  while the bytes are written where only zlib's is available; on Linux the OS is asked
  to write the pages out every 4 MB; the file it replaces is freed on a helper thread);
* ``delta_old`` / ``delta_new``: a delta save of the last 256 tokens, both ways.

Times are the best of the repeats (a shared machine's noise only ever adds); the ratios
are what to read.  ``zlib_crc_ms``/``fast_crc_ms`` and ``get_ms`` show the costs the
changes work on.
Exits 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    MODEL_KEYS,
    Table,
    clock,
    context_settings,
    ctx_size_for,
    greedy_conversation,
    model_path,
    prompt_tokens,
    ratio,
    raw_read,
    raw_write,
)
from engine.checkpoints.atomic import wait_for_helper  # noqa: E402
from engine.checkpoints.crc import crc32 as fast_crc32  # noqa: E402

DELTA_TOKENS = 256


def table() -> Table:
    return Table("Save vs raw write+fsync: old path (fresh buffer, serial CRC, replaced file freed in the "
                 "rename) vs new (reused buffer, fast CRC, writeback hints, replaced file freed later) "
                 "(best of N, s)",
                 ["model", "tokens", "file_MB", "raw_s", "get_write_s", "old_s", "new_s", "old_vs_raw",
                  "new_vs_raw", "new_vs_old", "new_vs_get_write", "get_ms", "zlib_crc_ms", "fast_crc_ms",
                  "delta_old_s",
                  "delta_new_s", "delta_new_vs_old"])


@contextlib.contextmanager
def old_save_path(rt):
    """``Runtime.save`` as it was: a new state buffer every time, zlib's CRC computed inline,
    no writeback hints, the replaced file freed inside the rename."""
    from engine.checkpoints import atomic
    from engine.checkpoints import format as fmt
    saved = fmt.CRC_THREAD_MIN_BYTES, fmt.crc32, atomic.start_writeback, atomic.SET_ASIDE_REPLACED
    fmt.CRC_THREAD_MIN_BYTES, fmt.crc32 = 1 << 62, zlib.crc32
    atomic.start_writeback, atomic.SET_ASIDE_REPLACED = None, False
    rt.release_state_buffer()
    try:
        yield
    finally:
        fmt.CRC_THREAD_MIN_BYTES, fmt.crc32, atomic.start_writeback, atomic.SET_ASIDE_REPLACED = saved
        rt.release_state_buffer()


def _add_row(out: Table, key: str, n: int, file_len: int, best: dict) -> None:
    """One row: the best time of each trial, and the ratios that matter."""
    out.add(model=key, tokens=n, file_MB=file_len / 1e6, raw_s=best["raw"],
            get_write_s=best["get_write"], old_s=best["old"], new_s=best["new"],
            old_vs_raw=ratio(best["old"], best["raw"]), new_vs_raw=ratio(best["new"], best["raw"]),
            new_vs_old=ratio(best["new"], best["old"]),
            new_vs_get_write=ratio(best["new"], best["get_write"]),
            get_ms=best["get"] * 1e3, zlib_crc_ms=best["crc"] * 1e3,
            fast_crc_ms=best["fast_crc"] * 1e3, delta_old_s=best["delta_old"],
            delta_new_s=best["delta_new"], delta_new_vs_old=ratio(best["delta_new"], best["delta_old"]))


def measure(rt, key: str, n: int, folder: Path, repeats: int, out: Table) -> None:
    from engine.generation import generate
    tokens = prompt_tokens(rt.model, n)
    ckpt, copy, parent = folder / f"{key}-{n}.kvckpt", folder / f"{key}-{n}.raw", folder / "parent.kvckpt"
    state_copy = folder / f"{key}-{n}.state"
    # the delta's parent: the conversation without its last DELTA_TOKENS tokens, saved on
    # the way (the prefill keeps what the cache already shares)
    base_n = n - DELTA_TOKENS
    parent_info = None
    if base_n > 0 and rt.settings.supports_deltas:
        base = greedy_conversation(tokens[:base_n])
        generate(rt, base, stop_after=0)
        parent_info = rt.save(parent, base)
    conv = greedy_conversation(tokens)
    generate(rt, conv, stop_after=0)
    rt.save(ckpt, conv)                     # the buffer is warm, as in a session that saved before
    _, file_bytes = raw_read(ckpt)

    trials = {k: [] for k in ("raw", "get_write", "old", "new", "delta_old", "delta_new", "get", "crc",
                              "fast_crc")}

    def raw() -> None:
        copy.unlink(missing_ok=True)        # a new file: freeing the old one is not the write's cost
        trials["raw"].append(raw_write(copy, file_bytes))

    def get_write() -> None:
        size = rt.ctx.state_size()
        state_copy.unlink(missing_ok=True)
        t0 = clock()
        buf = np.empty(size, dtype=np.uint8)
        got = rt.ctx.state_get_into(buf, size)
        raw_write(state_copy, buf[:got])
        trials["get_write"].append(clock() - t0)

    def old() -> None:
        with old_save_path(rt):
            t0 = clock()
            rt.save(ckpt, conv)
            trials["old"].append(clock() - t0)
            if parent_info is not None:
                rt.release_state_buffer()
                t0 = clock()
                rt.save(folder / "delta.kvckpt", conv, parent=parent_info)
                trials["delta_old"].append(clock() - t0)
        rt.save(ckpt, conv)                 # the new path's buffer back, untimed
        wait_for_helper()   # untimed: no trial pays for freeing the file before it

    def new() -> None:
        t0 = clock()
        rt.save(ckpt, conv)
        trials["new"].append(clock() - t0)
        wait_for_helper()
        if parent_info is not None:
            t0 = clock()
            rt.save(folder / "delta.kvckpt", conv, parent=parent_info)
            trials["delta_new"].append(clock() - t0)
            wait_for_helper()

    def parts() -> None:
        buf = rt.state_buffer_for(rt.ctx.state_size())
        t0 = clock()
        rt.ctx.state_get_into(buf, rt.ctx.state_size())
        trials["get"].append(clock() - t0)
        t0 = clock()
        zlib.crc32(file_bytes)
        trials["crc"].append(clock() - t0)
        t0 = clock()
        fast_crc32(file_bytes)
        trials["fast_crc"].append(clock() - t0)

    order = [raw, get_write, old, new, parts]
    for i in range(repeats):
        for fn in order[i % len(order):] + order[:i % len(order)]:
            fn()
    _add_row(out, key, n, len(file_bytes), {k: min(v) if v else None for k, v in trials.items()})
    for p in (copy, state_copy):
        p.unlink(missing_ok=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.save_speed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODEL_KEYS))
    ap.add_argument("--sizes", default="2048,8192")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from engine.runtime import Runtime
    sizes = sorted(int(s) for s in args.sizes.split(",") if s.strip())
    out = table()
    with tempfile.TemporaryDirectory(prefix="save-speed-") as tmp:
        for key in [m.strip() for m in args.models.split(",") if m.strip()]:
            rt = Runtime(model_path(key), context_settings(ctx_size_for(max(sizes)), args.threads))
            try:
                for n in sizes:
                    print(f"[{key}] {n} tokens ...", file=sys.stderr, flush=True)
                    measure(rt, key, n, Path(tmp), args.repeats, out)
            finally:
                rt.close()
    out.notes.append(f"best of {args.repeats} interleaved trials; {args.threads} threads, q8_0 KV + flash "
                     f"attention; delta = the last {DELTA_TOKENS} tokens on a parent of the rest")
    print(out.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
