"""Issue 25 point 4: where a restore's time goes, and llama-server's slot restore beside it.

    python -m benchmarks.restore_profile [--sizes 2000,7500] [--repeats 3] [--threads 2]
                                         [--deltas 3] [--turns 12] [--llama-server PATH]
                                         [--against TREE] [--reader mapped|windows|copying] [--json out.json]
                                         [--model smollm|lfm2-wide|llama-8b-kv|qwen35-gdn|qwen35-4b-gdn|
                                                  qwen35-4b-vocab|qwen35-4b]

SmolLM2 (``--model lfm2-wide``: a hybrid built by tests/tinymodels.py at LFM2-2.6B's
attention widths, random weights; ``--model llama-8b-kv``: an attention model at
Llama-3-8B's KV widths, 68 KiB a token; each with its files in a folder of their own:
:data:`MODELS`) with
the app's context settings (q8_0 K and V, flash attention, a unified cache with a scratch
sequence), the context just large enough for the largest size.  For each size a long prose
prompt is prefilled and answered, and saved at the same token: as
one full checkpoint, as the files an answer leaves when its process ends before it does
(``chain``: a crash, a kill; the prompt's file, then ``--deltas`` autosaves, one every 16
generated tokens, written by the app's writer: in tiers for an attention memory, each
absorbing the newest ones that hold no more tokens of their own, so three files for three
autosaves and at most log2(k) + 2 for k, or each on the prompt's file replacing the one
before where the recurrent state outweighs the cells, so two; a pause writes two files for
every memory; ``chain-each``: the same with each autosave on the one before, as the app
wrote them before 2026-12-06 (twenty-second session), one file per autosave), and
as a conversation of ``--turns`` turns is written by the app's writer, twice: ``turns``, a
file per turn (each a delta on the last, a finished answer's file: no logits; the layout
before 2026-12-04), and ``merged``, as it writes them now (the head absorbs the turns
before it, up to 32 MiB, then in tiers: one file, O(log n) beyond); and ``shared``, the deduplicated layout of a
conversation on a long system prompt another one stored (a shared prefix of 1,500 tokens,
at most 3/4 of them, then the head absorbing the turns above it: two files).  Then,
for each file and each repeat, a NEW PROCESS loads the model and times one restore, with
the files warm in the page cache (read once just before, each by its own reader: ``_warm``):

* ``restore_ms``: what ``run --checkpoint-load`` counts as its restore (``restore_s``):
  ``load_chain`` (read, every check of the file) and ``Runtime.restore_chain`` (the
  compatibility and state checks, ``llama_state_seq_set_data``, the deltas' ``seq_cp``),
  broken down by timing the functions it calls on the restoring thread (each part
  exclusive of the parts inside it; ``read`` is what reading the file costs besides them,
  ``settle`` the wait for a large state's CRC, computed on a second thread while
  ``set_data`` copies, ``other`` the rest);
* ``floor_ms``: the raw floor — read each file's state section into fresh memory and
  hand it to ``llama_state_seq_set_data`` (a delta through sequence 1, ``seq_cp``,
  ``seq_rm``), with no check at all;
* ``loadfile_ms``: llama.cpp's own ``llama_state_seq_load_file`` of the same tokens'
  state, called as llama-server's slot restore calls it (once for the token count, once
  to load) and timed as it times it: llama-server's restore without the server, so it is
  measured on every machine (the file is written by ``llama_state_seq_save_file``).

With ``--against TREE`` (another checkout of this project, e.g. ``git worktree add TREE
HEAD~1``), each repeat also restores the same files with that tree's code, alternating
with this one's: ``against_ms``, and ``vs_against`` (this tree / that one), a change
measured side by side.

With a llama-server binary (``--llama-server PATH`` or ``LLAMA_SERVER=PATH``; build the
``llama-server`` target of the llama.cpp that llama-cpp-python vendors), the same tokens
go through its slot save (``--slot-save-path``, a completion with ``cache_prompt``, then
``POST /slots/0?action=save``), and each repeat starts a new server and times
``POST /slots/0?action=restore``: its own ``timings.restore_ms``.  Without one the table
says so.  Every file is evicted from the page cache once and read back by its own reader
before the first repeat (:func:`_read_back_cold`).  Each repeat runs every measurement
once, the server's restore first, then each layout's: everything is interleaved, because
this machine's speed drifts by 30 % and more over minutes (2026-12-05: the server's
restore of 7,500 tokens took 12.1 ms in one block of repeats, 19.4 ms in another).
Medians of the repeats; exits 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table, clock, ctx_size_for, median, ratio  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DELTAS, DELTA_TOKENS = 3, 16
TURNS = 12

#: (module, attribute, part): the functions of the restore path that are timed in place
PROBES = (
    ("engine.checkpoints.chain", "read_checkpoint", "read"),
    ("engine.checkpoints.format", "crc32", "crc"),
    ("engine.checkpoints.format", "decode_metadata", "json"),
    ("engine.checkpoints.format", "_token_arrays", "arrays"),
    ("engine.checkpoints.chain", "check_link", "link"),
    ("engine.restore", "check_link", "link"),
    ("engine.restore", "check_state_for", "walk"),
    ("engine.checkpoints.compat", "Target.check", "compat"),
    ("native.context", "Context.state_set_from", "set_data"),
    ("native.context", "Context.clear", "clear"),
    ("native.context", "Context.seq_cp", "seq_cp"),
    ("native.context", "Context.seq_rm", "seq_cp"),
    ("engine.restore", "_conversation_of", "conversation"),
    ("engine.checkpoints.format", "CheckpointData.settle", "settle"),
)
PARTS = ("read", "crc", "json", "arrays", "walk", "link", "compat", "clear", "set_data", "seq_cp",
         "conversation", "settle", "other")


def table() -> Table:
    return Table("Restore in a new process, files warm in the page cache (ms, medians)",
                 ["tokens", "layout", "files_MB", "restore_ms", "floor_ms", "loadfile_ms", "server_ms",
                  "against_ms", "vs_loadfile", "best_vs_loadfile", "vs_server", "vs_floor", "best_vs_server",
                  "vs_against", *PARTS])


# -- the child: one restore in a fresh process ------------------------------------------------
class _Probes:
    """Exclusive time per part: a probe's time less that of the probes called inside it."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._stack: list[float] = []   # time spent in nested probes, per open probe

    def wrap(self, part: str, fn):
        import threading
        main = threading.main_thread()

        def timed(*args, **kwargs):
            if threading.current_thread() is not main:   # a checksum running beside the restore
                return fn(*args, **kwargs)
            self._stack.append(0.0)
            started = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                took = clock() - started
                inner = self._stack.pop()
                self.spent[part] = self.spent.get(part, 0.0) + took - inner
                if self._stack:
                    self._stack[-1] += took
        return timed

    def install(self) -> None:
        import importlib
        for module_name, attr, part in PROBES:
            owner = importlib.import_module(module_name)
            *path, name = attr.split(".")
            for step in path:
                owner = getattr(owner, step)
            if hasattr(owner, name):   # an older tree may lack a function: its time is "other"
                setattr(owner, name, self.wrap(part, getattr(owner, name)))


#: set (by ``--reader``) in the children's environment: ``copying``, their reader copies the
#: state sections instead of mapping them, as on macOS (and on Windows before); ``windows``,
#: it maps as on Windows: no MADV_POPULATE_READ (engine.checkpoints.mapped)
READER_ENV = "CHECKPOINT_CHAT_BENCH_READER"
READERS = ("mapped", "windows", "copying")


def _reader_as(reader: str) -> None:
    from engine.checkpoints import mapped
    if reader == "copying":
        mapped.MAP_MIN_BYTES = 1 << 62
    elif reader == "windows":   # what Windows has of engine.checkpoints.mapped
        mapped.PINS_FILES = True
        mapped.populate = lambda *_a: None   # Windows' prefetch: a hint, nothing to read when warm
        mapped.in_page_cache = lambda *_a: False   # no cachestat
        mapped._ask_for_huge_pages = lambda *_a: None   # no MADV_HUGEPAGE


def child(args) -> int:
    from benchmarks.common import context_settings, model_path
    from engine.checkpoints import chain as chain_module
    from engine.checkpoints.chain import load_chain
    from engine.runtime import Runtime
    release = getattr(chain_module, "release", lambda _chain: None)
    _reader_as(os.environ.get(READER_ENV, "mapped"))
    model = Path(args.model_file) if args.model_file else model_path("smollm")
    rt = Runtime(model, context_settings(args.n_ctx, args.threads))
    try:
        files = [Path(p) for p in args.child_files]
        if args.child == "floor":
            result = {"total": _floor(rt, files)}
        elif args.child == "loadfile":
            result = {"total": _load_file(rt, files[0])}
        else:
            probes = _Probes()
            probes.install()
            started = clock()
            chain = load_chain(files[-1], crc_later=True)
            conv = rt.restore_chain(chain)
            release(chain)   # as the app's restores do (an older tree: nothing)
            total = clock() - started
            if len(conv.tokens) < chain[-1].header.n_tokens:
                raise SystemExit("the restore lost tokens")
            parts = dict(probes.spent)
            parts["other"] = total - sum(parts.values())
            result = {"total": total, "parts": parts}
    finally:
        rt.close()
    print(json.dumps(result))
    return 0


def _floor(rt, files: list[Path]) -> float:
    """Read each state section into fresh memory, set it; no check (the chain's order)."""
    import ctypes

    import numpy as np

    from engine.checkpoints.format import read_metadata
    from engine.checkpoints.points import recurrent_lengths

    def llama_part(path: Path):   # llama.cpp's bytes of the state section (not the points')
        h, meta = read_metadata(path)
        return h, h.state_len - (sum(recurrent_lengths(meta) or ()) if h.has_point_states else 0)
    parts = [llama_part(p) for p in files]   # before the clock: where the states lie
    ctx, ll = rt.ctx, rt.ctx._ll
    started = clock()
    for i, (path, (h, length)) in enumerate(zip(files, parts, strict=True)):
        if not length:
            continue
        with open(path, "rb", buffering=0) as f:
            f.seek(h.state_offset)
            buf = np.empty(length, dtype=np.uint8)
            if f.readinto(memoryview(buf)) != length:
                raise SystemExit(f"{path} is short")
        src = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        seq = 0 if i == 0 else 1
        if ll.llama_state_seq_set_data(ctx.ptr, src, length, seq) == 0:
            raise SystemExit("llama_state_seq_set_data refused a state")
        if seq:
            ctx.seq_cp(1, 0, -1, -1)
            ctx.seq_rm(1, -1, -1)
    return clock() - started


def _load_file(rt, path: Path) -> float:
    """llama_state_seq_load_file as llama-server's slot restore calls it (server-context.cpp)."""
    import ctypes
    ll, ctx = rt.ctx._ll, rt.ctx
    name = str(path).encode()
    count = ctypes.c_size_t(0)
    started = clock()
    if not ll.llama_state_seq_load_file(ctx.ptr, name, 0, None, 0, ctypes.byref(count)):
        raise SystemExit("llama_state_seq_load_file refused its own file")
    tokens = (ctypes.c_int32 * max(1, count.value))()
    if not ll.llama_state_seq_load_file(ctx.ptr, name, 0, tokens, len(tokens), ctypes.byref(count)):
        raise SystemExit("llama_state_seq_load_file refused its own file")
    spent = clock() - started
    if ctx.pos_max(0) + 1 != count.value:
        raise SystemExit("llama_state_seq_load_file restored other tokens")
    return spent


def _run_child(mode: str, files: list[Path], n_ctx: int, threads: int, root: Path = ROOT,
               model: Path | None = None) -> dict:
    """One measurement in a new process, with the code of ``root`` (this tree, or --against's),
    on ``model`` (None: SmolLM2)."""
    _warm(files)
    cmd = [sys.executable, "-m", "benchmarks.restore_profile", "--child", mode, "--n-ctx", str(n_ctx),
           "--threads", str(threads), *(["--model-file", str(model)] if model else []), *map(str, files)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(cmd, cwd=str(root), env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _warm(files: list[Path]) -> None:
    """Bring ``files`` into the page cache as their own reader leaves them there: llama.cpp's
    file by reading it; ours by the app's reader (a mapping that asks for huge pages,
    engine.checkpoints.mapped).  Once a file was evicted, how it is read back decides the
    page sizes it is cached in (benchmarks.page_cache), and some machines evict idle files
    within a minute."""
    from engine.checkpoints.format import read_checkpoint
    for f in files:
        if f.suffix == ".kvckpt":
            read_checkpoint(f)
        else:
            f.read_bytes()


def _read_back_cold(files: list[Path]) -> str | None:
    """Drop ``files`` from the page cache, then let each one's own reader read it back
    (:func:`_warm`): every file is then cached as after a reboot, whoever wrote it.

    How a file came into the page cache decides the sizes of its pages there, and reading
    it again from the cache costs up to a third more in small ones (2026-12-05: the same
    7,500 tokens' llama.cpp file restored in 17.9 ms as it had been cached, 13.6 ms once
    evicted and read back, the server's own file beside it 14.1 and 13.6 ms).  Returns a
    note when some file could not be evicted (tmpfs: the files stay as written)."""
    from benchmarks.page_cache import evict
    stayed = [f for f in files if not evict(f)]
    _warm(files)
    return f"{len(stayed)} file(s) could not be evicted and were read as written" if stayed else None


# -- the files -------------------------------------------------------------------------------
#: --model: what each measures on
MODELS = {
    "smollm": "SmolLM2-135M-Instruct",
    "lfm2-wide": "a random-weight LFM2 (tests/tinymodels.py) of 16 layers, 8 of them attention with "
                 "LFM2-2.6B's 8 KV heads of 64 (its KV bytes per token), 8 short convolutions of 1024",
    "llama-8b-kv": "a random-weight llama (tests/tinymodels.py) with Llama-3-8B's KV widths: 32 layers "
                   "of 8 KV heads of 128 (its KV bytes per token), narrow elsewhere",
    "qwen35-gdn": "a random-weight qwen35 hybrid (tests/tinymodels.py) of 8 layers, 6 of them gated "
                  "delta-nets at Qwen3-Next's widths (16 key heads, 32 value heads of 128: 12.6 MB of "
                  "recurrent state), 2 attention layers of 2 KV heads of 64, a narrow residual stream",
    "qwen35-4b-gdn": "the same at Qwen3.5-4B's depth: 32 layers, 24 of them gated delta-nets (50 MB of "
                     "recurrent state, as Qwen3.5-4B's and -9B's), 8 attention layers",
    "qwen35-4b-vocab": "the same with Qwen3.5's vocabulary (248,320 tokens, SmolLM2's padded with unused "
                       "ones: 1 MB of logits, which every file of a hybrid carries)",
    "qwen35-4b": "the same with Qwen3.5-4B's attention too (16 query heads, 4 KV heads of 256: 17 KB of "
                 "cells a token in q8_0), so every part of its state is the real model's size",
}
#: Qwen3.5's vocabulary
QWEN35_VOCAB = 248_320
#: the hybrid's widths: LFM2-2.6B's attention (8 KV heads of 64, 16 query heads); the layer
#: pattern alternates convolution and attention, so 16 layers hold its 8 attention layers;
#: its trained context LFM2's 32k (llama-server caps a slot's context at it)
WIDE_LFM2 = {"n_embd": 1024, "n_head": 16, "n_head_kv": 8, "head": 64, "n_ctx_train": 32768}
#: Llama-3-8B's KV widths (32 layers, 8 KV heads of 128; 8 query heads, not 32) on a narrow
#: residual stream and feed-forward, so that long prompts prefill in minutes on two cores
LLAMA_8B_KV = {"n_embd": 1024, "n_ff": 128, "n_head": 8, "n_head_kv": 8, "head": 128, "n_ctx_train": 32768}
#: Qwen3-Next's gated delta-net widths on a narrow residual stream
QWEN35_GDN = {"n_embd": 256, "gdn_state": 128, "gdn_k_heads": 16, "gdn_v_heads": 32,
              "n_head": 4, "n_head_kv": 2, "head": 64}
#: Qwen3.5-4B's attention widths (its KV bytes per token)
QWEN35_4B_ATTENTION = {"n_head": 16, "n_head_kv": 4, "head": 256}


def model_file(key: str, folder: Path) -> Path | None:
    """The GGUF ``--model`` names, built into ``folder`` once (None: SmolLM2, the app's own)."""
    if key == "smollm":
        return None
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import tinymodels
    if key == "llama-8b-kv":
        return tinymodels.cached("llama", folder, n_layer=32, shape=tinymodels.Shape(**LLAMA_8B_KV))
    if key.startswith("qwen35"):
        vocab = QWEN35_VOCAB if key in ("qwen35-4b-vocab", "qwen35-4b") else 0
        widths = {**QWEN35_GDN, **(QWEN35_4B_ATTENTION if key == "qwen35-4b" else {})}
        return tinymodels.cached("qwen35", folder, n_layer=8 if key == "qwen35-gdn" else 32,
                                 shape=tinymodels.Shape(**widths, n_vocab=vocab))
    return tinymodels.cached("lfm2", folder, n_layer=16, shape=tinymodels.Shape(**WIDE_LFM2))


LAYOUTS = ("full", "chain", "chain-each", "turns", "merged", "shared")
#: the shared layout's prefix: the issue's 1,500-token system prompt, at most 3/4 of the tokens
SHARED_PREFIX = 1500


def make_files(folder: Path, sizes: list[int], n_ctx: int, threads: int,
               deltas: int = DELTAS, turns: int = TURNS, model: Path | None = None) -> dict[int, dict[str, list[Path]]]:
    """Per size: the full checkpoint, the answer's chain (base + deltas) and the turns'
    chain, as paths, base first.

    Files already in ``folder`` from an earlier run (``--folder``) are used again."""
    # the name changes with what the app writes (aligned writes, turns without logits, the
    # messages once in the metadata, turns absorbed in tiers): files made before are made again
    manifest = folder / f"manifest-{n_ctx}-{deltas}-{turns}-tiers-app-answer-tiers.json"
    if manifest.is_file():
        known = {int(n): v for n, v in json.loads(manifest.read_text()).items()}
        if all(n in known and {"llama", *LAYOUTS} <= known[n].keys() for n in sizes):
            return {n: {**{k: [Path(p) for p in known[n][k]] for k in (*LAYOUTS, "llama")},
                        "tokens": known[n]["tokens"]} for n in sizes}
    return _make_files_anew(folder, sizes, n_ctx, threads, manifest, deltas, turns, model)


def _make_files_anew(folder: Path, sizes: list[int], n_ctx: int, threads: int, manifest: Path,
                     deltas: int, turns: int, model: Path | None) -> dict[int, dict[str, list[Path]]]:
    from benchmarks.common import context_settings, model_path, prompt_tokens
    from engine.checkpoints.format import KIND_PAUSE
    from engine.runtime import Runtime
    rt = Runtime(model or model_path("smollm"), context_settings(n_ctx, threads))
    files: dict[int, dict[str, list[Path]]] = {}
    try:
        for n in sizes:
            tokens = prompt_tokens(rt.model, n)
            rt.trim(0)
            rt.ctx.clear()
            prompt = tokens[:max(1, n - deltas * DELTA_TOKENS)]
            chain_each = _answer_files(rt, folder, prompt, deltas, tiers=False)[1]
            conv, chain = _answer_files(rt, folder, prompt, deltas)
            full = rt.save(folder / f"full-{n}-ctx{n_ctx}.kvckpt", conv, KIND_PAUSE).path
            llama_file = folder / f"llama-{n}-ctx{n_ctx}.seqstate"
            _save_llama_file(rt, llama_file, conv.tokens)
            files[n] = {"full": [full], "chain": chain, "chain-each": chain_each, "tokens": list(conv.tokens),
                        "llama": [llama_file],
                        "turns": _turn_files(rt, folder, list(conv.tokens), turns, merge=False),
                        "merged": _turn_files(rt, folder, list(conv.tokens), turns, merge=True),
                        "shared": _turn_files(rt, folder, list(conv.tokens), turns, merge=True,
                                              prefix=min(SHARED_PREFIX, n * 3 // 4))}
    finally:
        rt.close()
    manifest.write_text(json.dumps({n: {**{k: [str(p) for p in v[k]] for k in (*LAYOUTS, "llama")},
                                        "tokens": v["tokens"]} for n, v in files.items()}))
    return files


def _answer_files(rt, folder: Path, prompt: list[int], deltas: int, tiers: bool = True):
    """``prompt`` answered for ``deltas`` × DELTA_TOKENS tokens with an autosave every
    DELTA_TOKENS, the prompt's checkpoint first (with the prefill's logits), by the app's
    writer (engine.history.LineWriter), and no pause: what a crash leaves.  ``tiers``: the
    autosaves in tiers, as the app writes them now (ChainPolicy.tier_autosaves: popcount of
    ``deltas`` files after the prompt's); else each on the one before, as before
    2026-12-06 (twenty-second session).  Returns the conversation and the newest autosave's chain, base first."""
    from benchmarks.common import greedy_conversation
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.store import Store
    from engine.generation import generate
    from engine.history import ChainPolicy, LineWriter
    rt.trim(0)
    rt.ctx.clear()
    store = Store(folder / f"answer{deltas}-{len(prompt) + deltas * DELTA_TOKENS}{'' if tiers else '-each'}")
    writer = LineWriter(rt, store, uuid.uuid4().hex, policy=ChainPolicy(tier_autosaves=tiers))
    conv = greedy_conversation(prompt)
    generate(rt, conv, stop_after=0)
    newest = writer.autosave(conv)
    for _ in range(deltas):
        generate(rt, conv, stop_after=DELTA_TOKENS)
        newest = writer.autosave(conv)
    writer.close()
    return conv, [data.path for data in load_chain(newest.path)]


def _turn_files(rt, folder: Path, tokens: list[int], turns: int, merge: bool, prefix: int = 0) -> list[Path]:
    """The same tokens as a conversation of ``turns`` turns, written by the app's writer
    (:func:`write_turns`).  ``merge``: as the app writes them now, the turns before a head
    absorbed by it (ChainPolicy.merge_turns: up to 32 MiB, then in tiers); else a file per turn, as before
    2026-12-04.  ``prefix``: the first tokens are a shared prefix (a long system prompt
    another conversation stored: engine.shared_prefix), the turns follow on it.  Returns
    the last head's chain, base first."""
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.store import Store
    from engine.history import ChainPolicy, LineWriter
    rt.trim(0)
    rt.ctx.clear()
    kind = "shared" if prefix else "merged" if merge else "each"
    store = Store(folder / f"turns{turns}-{len(tokens)}-{kind}")
    base = [_shared_prefix(rt, store, tokens[:prefix])] if prefix else []
    writer = LineWriter(rt, store, uuid.uuid4().hex, base, policy=ChainPolicy(merge_turns=merge))
    head = write_turns(rt, writer, tokens, turns, lambda save: save(), start=prefix)
    writer.close()
    return [data.path for data in load_chain(head.path)]


def _shared_prefix(rt, store, tokens: list[int]):
    """``tokens`` decoded and stored as a shared prefix is (its own line, no logits)."""
    from benchmarks.common import greedy_conversation
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.graph import SHARED_LINE
    from engine.generation import generate
    conv = greedy_conversation(tokens)
    generate(rt, conv, stop_after=0)
    store.ensure()
    return rt.save(store.new_path("prefix"), conv, KIND_MANUAL, line=f"{SHARED_LINE}benchmark",
                   fresh=True, upto=len(tokens))


def write_turns(rt, writer, tokens: list[int], turns: int, around_save, start: int = 0):
    """Decode ``tokens`` as ``turns`` turns into ``rt`` (from an empty cache, or one that
    holds the first ``start`` of them), each turn's
    head saved by ``writer`` as a finished answer's (no logits), its metadata carrying the
    conversation so far; ``around_save(save)`` calls ``save()`` (to time it).  Returns the
    last head's SaveInfo."""
    from benchmarks.common import greedy_conversation
    from engine.checkpoints.format import KIND_MANUAL
    from engine.conversation import Answer
    from engine.generation import generate
    conv = greedy_conversation([])
    head = None
    for i in range(1, turns + 1):
        end = start + (len(tokens) - start) * i // turns
        conv.tokens = list(tokens[:end - 1])
        conv.answer = Answer(n_prompt_tokens=end - 1, n_predict=-1)
        conv.messages = [("user" if k % 2 == 0 else "assistant", f"turn {k}: " + "words " * 60)
                         for k in range(2 * i)]
        generate(rt, conv, stop_after=0)
        # the answer's last token is decoded alone, as a generated one is: its logits can be
        # had again by decoding it, so the finished answer's file carries none (logits_rule)
        rt.decode_token(tokens[end - 1])
        conv.tokens.append(tokens[end - 1])
        conv.answer = None   # finished
        head = around_save(lambda: writer.save_head(conv, KIND_MANUAL))
    return head


def _save_llama_file(rt, path: Path, tokens) -> None:
    """The sequence's state in llama.cpp's own sequence file (llama_state_seq_save_file)."""
    import ctypes
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    if not rt.ctx._ll.llama_state_seq_save_file(rt.ctx.ptr, str(path).encode(), 0, arr, len(tokens)):
        raise SystemExit("llama_state_seq_save_file failed")


# -- llama-server ----------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class LlamaServer:
    def __init__(self, binary: str, model: Path, n_ctx: int, threads: int, slots: Path, log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [binary, "-m", str(model), "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads),
             "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on", "-np", "1", "--slot-save-path", str(slots),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited with {self.proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"llama-server did not become ready; see {log}")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


class ServerSlot:
    """The same tokens saved through llama-server's slot save, then restored by a new server
    per :meth:`restore` (its own ``timings.restore_ms``)."""

    def __init__(self, binary: str, folder: Path, tokens: list[int], n_ctx: int, threads: int,
                 model: Path | None = None) -> None:
        from benchmarks.common import model_path
        self.binary, self.model, self.n_ctx, self.threads = binary, model or model_path("smollm"), n_ctx, threads
        self.slots = folder / "slots"
        self.slots.mkdir(exist_ok=True)
        self.log = folder / "llama-server.log"
        self.name = f"slot-{len(tokens)}.bin"
        self.runs: list[tuple] = []
        server = self._start()
        try:
            _post(server.url + "/completion", {"prompt": tokens, "n_predict": 1, "cache_prompt": True,
                                               "id_slot": 0, "temperature": 0})
            self.saved = _post(server.url + "/slots/0?action=save", {"filename": self.name})
        finally:
            server.close()
        _read_back_cold([self.slots / self.name])

    def _start(self) -> LlamaServer:
        return LlamaServer(self.binary, self.model, self.n_ctx, self.threads, self.slots, self.log)

    def restore(self) -> None:
        """One restore by a new server, the file warm in the page cache."""
        (self.slots / self.name).read_bytes()
        server = self._start()
        try:
            started = clock()
            got = _post(server.url + "/slots/0?action=restore", {"filename": self.name})
            wall = clock() - started
        finally:
            server.close()
        self.runs.append((got["timings"]["restore_ms"], wall * 1e3, got.get("n_restored"), got.get("n_read")))

    def summary(self) -> dict:
        runs = self.runs
        return {"restore_ms": median([r[0] for r in runs]), "best_ms": min(r[0] for r in runs),
                "http_ms": median([r[1] for r in runs]), "all_ms": [r[0] for r in runs],
                "n_restored": runs[-1][2], "n_read": runs[-1][3], "n_saved": self.saved.get("n_saved"),
                "file_MB": (self.slots / self.name).stat().st_size / 1e6}


def run(sizes: list[int], repeats: int, threads: int, server: str | None, echo=print,
        keep: str | None = None, deltas: int = DELTAS, turns: int = TURNS, against: Path | None = None,
        model_key: str = "smollm") -> dict:
    n_ctx = ctx_size_for(max(sizes))
    out = table()
    servers: dict[int, dict] = {}
    with tempfile.TemporaryDirectory(prefix="restore-profile-") as tmp:
        folder = Path(keep) if keep else Path(tmp)
        model = model_file(model_key, folder / "models")
        if model is not None:   # its files apart from SmolLM2's
            folder = folder / model.stem
            out.notes.append(f"model: {MODELS[model_key]}")
        folder.mkdir(parents=True, exist_ok=True)
        echo(f"making checkpoints of {sizes} tokens (n_ctx {n_ctx}) ...", file=sys.stderr)
        files = make_files(folder, sizes, n_ctx, threads, deltas, turns, model)
        cold = _read_back_cold([f for n in sizes for k in (*LAYOUTS, "llama") for f in files[n][k]])
        if cold is not None:
            out.notes.append(cold)
        for n in sizes:
            slot = None
            if server:
                echo(f"llama-server, {n} tokens ...", file=sys.stderr)
                slot = ServerSlot(server, folder, files[n]["tokens"], n_ctx, threads, model)
            runs: dict[str, dict[str, list]] = {layout: {"app": [], "floor": [], "load": [], "other": []}
                                                for layout in LAYOUTS}
            for r in range(repeats):
                # interleaved, the server too: the machine's noise falls on all alike
                echo(f"{n} tokens, repeat {r + 1} of {repeats} ...", file=sys.stderr)
                if slot is not None:
                    slot.restore()
                for layout in LAYOUTS:
                    _measure_once(runs[layout], files[n][layout], files[n]["llama"], n_ctx, threads, against,
                                  model)
            if slot is not None:
                servers[n] = slot.summary()
            for layout in LAYOUTS:
                out.add(**_row(n, layout, files[n][layout], runs[layout], servers.get(n, {})))
    if server:
        for n, s in servers.items():
            out.notes.append(f"llama-server {n}: n_restored {s['n_restored']}, {s['file_MB']:.1f} MB "
                             f"file, restore_ms {s['restore_ms']:.2f} (the HTTP request: {s['http_ms']:.1f} ms)")
    else:
        out.notes.append("llama-server not measured: no binary given (--llama-server PATH or LLAMA_SERVER)")
    if against is not None:
        out.notes.append(f"against_ms: the same restores with the code of {against}, alternating with this tree's")
    out.notes.append("best_vs_server: the fastest of the repeats on each side (a shared machine's noise only adds)")
    out.notes.append("parts are exclusive: read = reading the files besides the crc/json/arrays inside it")
    return {"table": out.to_json(), "servers": servers, "sizes": sizes, "repeats": repeats,
            "threads": threads, "n_ctx": n_ctx, "load_avg": os.getloadavg()}


def _measure_once(into: dict[str, list], paths: list[Path], llama: list[Path], n_ctx: int, threads: int,
                  against: Path | None, model: Path | None = None) -> None:
    into["app"].append(_run_child("app", paths, n_ctx, threads, model=model))
    if against is not None:
        into["other"].append(_run_child("app", paths, n_ctx, threads, against, model)["total"])
    into["floor"].append(_run_child("floor", paths, n_ctx, threads, model=model)["total"])
    into["load"].append(_run_child("loadfile", llama, n_ctx, threads, model=model)["total"])


def _row(n: int, layout: str, paths: list[Path], runs: dict[str, list], srv: dict) -> dict:
    apps, loads, others = runs["app"], runs["load"], runs["other"]
    restore_ms = median([a["total"] for a in apps]) * 1e3
    load_ms = median(loads) * 1e3
    floor_ms = median(runs["floor"]) * 1e3
    other_ms = median(others) * 1e3 if others else None
    best = min(a["total"] for a in apps) * 1e3
    parts = {p: median([a["parts"].get(p, 0.0) for a in apps]) * 1e3 for p in PARTS}
    return dict(tokens=n, layout=f"{layout} ({len(paths)})", files_MB=sum(p.stat().st_size for p in paths) / 1e6,
                restore_ms=restore_ms, floor_ms=floor_ms, loadfile_ms=load_ms, server_ms=srv.get("restore_ms"),
                against_ms=other_ms, vs_against=ratio(restore_ms, other_ms),
                vs_loadfile=ratio(restore_ms, load_ms), best_vs_loadfile=ratio(best, min(loads) * 1e3),
                vs_server=ratio(restore_ms, srv.get("restore_ms")), vs_floor=ratio(restore_ms, floor_ms),
                best_vs_server=ratio(best, srv.get("best_ms")), **parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.restore_profile",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2000,7500", help="tokens per checkpoint (default 2000,7500)")
    parser.add_argument("--repeats", type=int, default=3, help="new processes per measurement (default 3)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"), metavar="PATH")
    parser.add_argument("--json", metavar="PATH", help="write the report here")
    parser.add_argument("--folder", metavar="DIR", help="make the checkpoints here, or use those made there before")
    parser.add_argument("--deltas", type=int, default=DELTAS,
                        help=f"deltas of {DELTA_TOKENS} tokens in the chain (default {DELTAS}; "
                             "16: an answer's autosaves)")
    parser.add_argument("--turns", type=int, default=TURNS,
                        help=f"files of the turns' chain, one per turn (default {TURNS})")
    parser.add_argument("--against", metavar="TREE", type=Path,
                        help="another checkout: its restore of the same files, alternating with this one's")
    parser.add_argument("--reader", choices=READERS, default="mapped",
                        help="the app's reader: mapped as on Linux (default); as on Windows (mapped, no "
                             "MADV_POPULATE_READ); copying, as on macOS")
    parser.add_argument("--model", choices=tuple(MODELS), default="smollm",
                        help="smollm (default), or a hybrid at a real model's widths, built here")
    parser.add_argument("--model-file", help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("app", "floor", "loadfile"), help=argparse.SUPPRESS)
    parser.add_argument("--n-ctx", type=int, help=argparse.SUPPRESS)
    parser.add_argument("child_files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.against is not None and not (args.against / "benchmarks" / "restore_profile.py").is_file():
        parser.error(f"--against {args.against}: not a checkout of this project")
    server = args.llama_server
    if server and not Path(server).is_file():
        print(f"note: no llama-server at {server}; it is not measured", file=sys.stderr)
        server = None
    os.environ[READER_ENV] = args.reader
    report = run([int(s) for s in args.sizes.split(",") if s.strip()], args.repeats, args.threads, server,
                 echo=print, keep=args.folder, deltas=args.deltas, turns=args.turns, against=args.against,
                 model_key=args.model)
    data = report["table"]
    if args.reader != "mapped":
        data["notes"].append({"copying": "--reader copying: the app's reader copied the states instead of "
                                         "mapping them (macOS; Windows before)",
                              "windows": "--reader windows: the app's reader mapped the states as on Windows "
                                         "(no MADV_POPULATE_READ), measured on Linux"}[args.reader])
    print(Table(data["title"], data["columns"], data["rows"], data["notes"]).render())
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
