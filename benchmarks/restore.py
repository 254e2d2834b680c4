"""Sections a, b and f: first token after restore vs recompute, save/load vs raw file I/O,
checkpoint size vs the theoretical KV bytes, and peak memory during a save and a load.

For each context length the prompt is prefilled once (the recompute time), then, side
by side and interleaved, the engine's save and a raw write+fsync of the same bytes, the
engine's load and a raw read, and the engine's restore-to-first-token and the raw floor
(read the state bytes, ``llama_state_seq_set_data``, decode one token).  The page cache
is warm for both sides of each comparison.  Times are the best of the repeats (the noise
of a shared machine only ever adds); the recompute is measured once.
"""

from __future__ import annotations

import ctypes
import gc
from pathlib import Path

import numpy as np

from benchmarks.common import (
    TYPE_NAMES,
    PeakRSS,
    Table,
    clock,
    greedy_conversation,
    kv_bytes,
    prompt_tokens,
    ratio,
    raw_read,
    raw_write,
)

MB = 1e6


def tables() -> dict[str, Table]:
    return {
        "ttft": Table("a. Time to first new token: restore vs recompute (s)",
                      ["model", "tokens", "recompute_s", "restore_s", "floor_s", "restore_speedup",
                       "floor_speedup", "restore_vs_floor", "read_s", "set_s", "first_token_s"]),
        "disk": Table("b. Save and load vs raw file I/O (s, warm page cache)",
                      ["model", "tokens", "save_s", "raw_write_s", "save_vs_raw", "get_write_s",
                       "save_vs_get_write", "load_s", "raw_read_s", "load_vs_raw"]),
        "size": Table("b. Checkpoint size vs theoretical KV bytes",
                      ["model", "tokens", "kv_type", "file_MB", "kv_formula_MB", "transcript_KB",
                       "size_vs_formula", "kv_cells_MB", "size_vs_cells"]),
        "memory": Table("f. Peak extra resident memory during a save and a load",
                        ["model", "tokens", "state_MB", "save_extra_MB", "save_extra_x",
                         "load_extra_MB", "load_extra_x"]),
    }


def _floor_trial(rt, state_path: Path, n: int, token: int) -> float:
    """Raw floor: read the state bytes, set them, decode one token."""
    ctx = rt.ctx
    ll = ctx._ll
    ctx.clear()
    started = clock()
    _, buf = raw_read(state_path)
    src = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
    if ll.llama_state_seq_set_data(ctx.ptr, src, len(buf), 0) == 0:
        raise RuntimeError("llama_state_seq_set_data refused the raw state")
    ctx.decode((token,), n, logits_last=True)
    ctx.logits_last()
    seconds = clock() - started
    del src, buf
    # the runtime's bookkeeping no longer matches the cache: empty both
    ctx.clear()
    rt.kv_tokens = []
    rt._forget_logits()
    return seconds


def _save_vs_raw(rt, conv, ckpt: Path, copy_path: Path, state_path: Path, size: int,
                 repeats: int) -> tuple[list[float], list[float], list[float]]:
    """Save vs a raw write of the same file vs get-state + raw write, interleaved."""
    saves, raws, get_write_floor = [], [], []
    file_bytes = None
    for i in range(repeats):
        t0 = clock()
        rt.save(ckpt, conv)
        saves.append(clock() - t0)
        if i == 0:
            _, file_bytes = raw_read(ckpt)
        raws.append(raw_write(copy_path, file_bytes))
        buf = np.empty(size, dtype=np.uint8)
        t0 = clock()
        got = rt.ctx.state_get_into(buf, size)
        raw_write(state_path, buf[:got])
        get_write_floor.append(clock() - t0)
        del buf
    return saves, raws, get_write_floor


def _add_size_row(table: Table, rt, key: str, n: int, ckpt: Path) -> int:
    """The checkpoint's size against the KV formula and the cells it holds; its state length."""
    from engine.checkpoints.format import read_checkpoint
    from engine.checkpoints.kvstate import check_state_for
    data = read_checkpoint(ckpt)
    h = data.header
    layout = check_state_for(h, data.state)
    shape = rt.model.shape
    file_size = ckpt.stat().st_size
    formula = kv_bytes(shape, h.type_k, h.type_v, [n] * shape.n_layer)
    cells = kv_bytes(shape, h.type_k, h.type_v, [c for c, layers in layout.blocks for _ in range(layers)])
    transcript = file_size - h.state_len
    table.add(model=key, tokens=n, kv_type=TYPE_NAMES.get(h.type_k, str(h.type_k)),
              file_MB=file_size / MB, kv_formula_MB=formula / MB, transcript_KB=transcript / 1e3,
              size_vs_formula=ratio(file_size, formula + transcript), kv_cells_MB=cells / MB,
              size_vs_cells=ratio(file_size, cells + transcript))
    return h.state_len


def measure(rt, key: str, n: int, folder: Path, repeats: int, out: dict[str, Table]) -> None:
    from engine.checkpoints.format import read_checkpoint
    from engine.generation import generate

    tokens = prompt_tokens(rt.model, n)
    conv = greedy_conversation(tokens)
    ckpt = folder / f"{key}-{n}.kvckpt"
    state_path = folder / f"{key}-{n}.state"
    copy_path = folder / f"{key}-{n}.raw"

    # -- recompute: prefill from an empty cache (the first token is sampled below) -------
    rt.trim(0)
    rt.ctx.clear()
    started = clock()
    generate(rt, conv, stop_after=0)
    prefill_s = clock() - started

    # -- the state bytes, for the raw floors ------------------------------------------
    size = rt.ctx.state_size()
    state = np.empty(size, dtype=np.uint8)
    state = state[:rt.ctx.state_get_into(state, size)]
    raw_write(state_path, state)
    del state
    saves, raws, get_write_floor = _save_vs_raw(rt, conv, ckpt, copy_path, state_path, size, repeats)

    # -- f: memory during a save ---------------------------------------------------------
    gc.collect()
    with PeakRSS() as save_mem:
        rt.save(ckpt, conv)

    # the recompute's first token, from the live logits
    first = generate(rt, conv, stop_after=1)
    recompute_s = prefill_s + (first.ttft_s or 0.0)
    next_token = conv.tokens[n]

    # -- load vs raw read; restore-to-first-token vs the raw floor -----------------------
    loads, reads, ttfts, floors, parts = [], [], [], [], []
    for _ in range(repeats):
        t0 = clock()
        data = read_checkpoint(ckpt)
        t1 = clock()
        conv2 = rt.restore(data)
        t2 = clock()
        res = generate(rt, conv2, stop_after=1)
        ttfts.append(t2 - t0 + (res.ttft_s or 0.0))
        parts.append((t1 - t0, t2 - t1, res.ttft_s or 0.0))
        loads.append(t1 - t0)
        if conv2.tokens[n] != next_token:
            out["ttft"].notes.append(f"{key} {n}: the restored run chose another first token")
        del data
        reads.append(raw_read(ckpt)[0])
        floors.append(_floor_trial(rt, state_path, n, next_token))

    # -- f: memory during a load (read + verify + restore) -------------------------------
    gc.collect()
    with PeakRSS() as load_mem:
        data = read_checkpoint(ckpt)
        rt.restore(data)
        del data

    state_len = _add_size_row(out["size"], rt, key, n, ckpt)
    for p in (state_path, copy_path):
        p.unlink(missing_ok=True)

    restore_s, floor_s = min(ttfts), min(floors)
    part = [min([p[i] for p in parts]) for i in range(3)]
    out["ttft"].add(model=key, tokens=n, recompute_s=recompute_s, restore_s=restore_s, floor_s=floor_s,
                    restore_speedup=ratio(recompute_s, restore_s), floor_speedup=ratio(recompute_s, floor_s),
                    restore_vs_floor=ratio(restore_s, floor_s), read_s=part[0], set_s=part[1],
                    first_token_s=part[2])
    save_s, raw_s = min(saves), min(raws)
    out["disk"].add(model=key, tokens=n, save_s=save_s, raw_write_s=raw_s, save_vs_raw=ratio(save_s, raw_s),
                    get_write_s=min(get_write_floor),
                    save_vs_get_write=ratio(save_s, min(get_write_floor)),
                    load_s=min(loads), raw_read_s=min(reads),
                    load_vs_raw=ratio(min(loads), min(reads)))
    out["memory"].add(model=key, tokens=n, state_MB=state_len / MB, save_extra_MB=save_mem.extra / MB,
                      save_extra_x=ratio(save_mem.extra, state_len), load_extra_MB=load_mem.extra / MB,
                      load_extra_x=ratio(load_mem.extra, state_len))
