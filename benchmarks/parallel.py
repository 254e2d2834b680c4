"""Several conversations in one unified KV cache (issue 11): throughput, switching, exactness.

    python -m benchmarks.parallel [--model smollm|gemma] [--threads 2] [--tokens 64]
                                  [--switch-tokens 4000] [--exactness] [--tables abc] [--quick]
    python -m benchmarks.parallel --model-path GGUF --tables a ...    (table a on any model)

a. Aggregate generation tokens/s with 1, 2 and 4 answers at once (engine.concurrent's
   Batcher on an engine.parallel context), against one answer alone
   (engine.generation.generate on a single-sequence Runtime) and against a bare ctypes
   loop decoding the same batches (one token per sequence, ``per_decode`` of them per
   ``llama_decode``, argmax over each row, nothing else): the bare loop's gain over one
   alone is this machine's ceiling.  Where the runtime's exact width is below the count
   (Gemma 3: 3), a second row decodes all at once (``exact`` no: faster, not
   bit-identical to alone).  Greedy, same prompts, threads, context and cache for all; runs interleaved,
   best of ``--repeats`` (a shared machine's noise only ever slows a run down).
b. Switch latency at ``--switch-tokens`` tokens: until a conversation can sample its next
   token, when it is resident (nothing to do) and when it was evicted (read, verify and
   restore its file into a sequence); a full prefill of it for scale; and what packing the
   cache again costs (engine.parallel: after an Edit, Delete or eviction frees cells below
   another conversation's, every state is read out and put back in order).
c. (``--exactness``) max |logit difference|, teacher-forced, between each of 4 answers
   generated together and the same answer alone, per model, KV cache type, prefill mode
   (joint: the prompts in one decode; separate: one prompt per decode) and generated
   tokens per decode (the runtime's measured exact width, or all 4 at once).

Nothing is judged here; the table is printed and the exit status is 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import (
    MODEL_KEYS,
    Table,
    clock,
    ctx_size_for,
    greedy_conversation,
    model_path,
    prompt_tokens,
    ratio,
)

COUNTS = (1, 2, 4)


# -- a. throughput -------------------------------------------------------------------------
class BareBatchLoop:
    """A context on the same model, driven by raw llama.cpp calls: one batch of one token
    per sequence per decode, argmax over each output row."""

    def __init__(self, prt) -> None:
        from native.context import Context
        from native.library import bindings
        self.ll = bindings()
        self.ctx = Context(prt.model, prt.ctx.settings)   # owns the context; the loop is raw
        self.n_vocab = prt.ctx.n_vocab
        self.capacity = max(prt.settings.n_batch, prt.sequences)
        self.batch = self.ll.llama_batch_init(self.capacity, 0, 1)

    def _fill(self, tokens, positions, seqs, logits_all: bool) -> None:
        b = self.batch
        for i, (t, p, s) in enumerate(zip(tokens, positions, seqs, strict=True)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, 1 if logits_all else 0
            b.seq_id[i][0] = s
        b.n_tokens = len(tokens)

    def run(self, prompts: list[list[int]], n_gen: int, width: int | None = None) -> float:
        """Generation tokens/s for ``len(prompts)`` sequences (prefill not timed), their
        tokens decoded ``width`` at a time (default: all at once)."""
        ll, ctx = self.ll, self.ctx.ptr
        self.ctx.clear()
        next_tokens = []
        for seq, prompt in enumerate(prompts):
            self._fill(prompt, range(len(prompt)), [seq] * len(prompt), False)
            self.batch.logits[len(prompt) - 1] = 1
            if ll.llama_decode(ctx, self.batch) != 0:
                raise RuntimeError("bare prefill failed")
            row = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, -1), shape=(self.n_vocab,))
            next_tokens.append(int(np.argmax(row)))
        positions = [len(p) for p in prompts]
        seqs = list(range(len(prompts)))
        started = clock()
        width = width or len(seqs)
        for _ in range(n_gen):
            for start in range(0, len(seqs), width):
                group = seqs[start:start + width]
                self._fill([next_tokens[i] for i in group], [positions[i] for i in group], group, True)
                if ll.llama_decode(ctx, self.batch) != 0:
                    raise RuntimeError("bare decode failed")
                for row_index, i in enumerate(group):
                    row = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, row_index), shape=(self.n_vocab,))
                    next_tokens[i] = int(np.argmax(row))
                    positions[i] += 1
        return len(prompts) * n_gen / (clock() - started)

    def close(self) -> None:
        if self.batch is not None:
            self.ll.llama_batch_free(self.batch)
            self.batch = None
        self.ctx.close()


def _alone(rt, prompt: list[int], n_gen: int) -> float:
    from engine.generation import generate
    rt.trim(0)
    result = generate(rt, greedy_conversation(prompt, n_predict=n_gen))
    return result.tokens_per_s


def _ours(prt, prompts: list[list[int]], n_gen: int, exact: bool = True) -> float:
    from engine.concurrent import Batcher, Job
    for key in prt.table.residents():
        prt.evict(key)
    batcher = Batcher(prt, exact=exact)
    for prompt in prompts:
        conv = greedy_conversation(prompt, n_predict=n_gen)
        batcher.add(Job(conv, prt.place(conv.id, running=True).seq))
    batcher.run()
    return batcher.generated / batcher.generation_s


def throughput_table(key: str, args) -> Table:
    from engine.parallel import ParallelRuntime
    from engine.runtime import Runtime
    from native.context import ContextSettings
    path = Path(args.model_path) if args.model_path else model_path(key)
    shown = path.stem if args.model_path else key
    t = Table(f"a. Aggregate generation tokens/s, {shown}: n answers at once vs one alone vs a bare "
              "ctypes loop on the same batches",
              ["answers", "per_decode", "exact", "tokens", "alone", "ours", "bare", "ours_vs_alone",
               "bare_vs_alone", "ours_vs_bare"])
    settings = ContextSettings(n_ctx=ctx_size_for(max(COUNTS) * (args.prompt + args.tokens)),
                               n_threads=args.threads)
    rt = Runtime(path, settings)
    prt = ParallelRuntime(path, settings, sequences=max(COUNTS))
    bare = BareBatchLoop(prt)
    try:
        base = prompt_tokens(prt.model, args.prompt + max(COUNTS))
        prompts = [base[:args.prompt - k] + base[args.prompt:args.prompt + k] for k in range(max(COUNTS))]
        _alone(rt, prompts[0], 4)          # warm-up: first decodes fault the weights in
        _ours(prt, prompts[:2], 4)
        bare.run(prompts[:2], 4)
        alone = max(_alone(rt, prompts[0], args.tokens) for _ in range(args.repeats))
        width = prt.exact_width
        for n in COUNTS:
            # the Batcher's own batches (groups of the exact width), and all at once when
            # that is more: the bare loop decodes the same groups
            modes = [(min(n, width) if width else n, True)] + ([(n, False)] if 0 < width < n else [])
            for per_decode, exact in modes:
                ours, bare_tps = 0.0, 0.0
                for _ in range(args.repeats):       # interleaved
                    bare_tps = max(bare_tps, bare.run(prompts[:n], args.tokens, per_decode))
                    ours = max(ours, _ours(prt, prompts[:n], args.tokens, exact))
                t.add(answers=n, per_decode=per_decode, exact=exact and width > 0, tokens=n * args.tokens,
                      alone=alone, ours=ours, bare=bare_tps, ours_vs_alone=ratio(ours, alone),
                      bare_vs_alone=ratio(bare_tps, alone), ours_vs_bare=ratio(ours, bare_tps))
    finally:
        bare.close()
        prt.close()
        rt.close()
    t.notes.append(f"greedy, {args.prompt}-token prompts, {args.tokens} tokens per answer, "
                   f"{args.threads} threads, q8_0 KV + flash attention, best of {args.repeats}")
    return t


# -- b. switching --------------------------------------------------------------------------
def switch_table(key: str, args, work: Path) -> Table:
    from engine.checkpoints.chain import load_chain
    from engine.parallel import ParallelRuntime
    from native.context import ContextSettings
    t = Table(f"b. Switching to a conversation of {args.switch_tokens:,} tokens, {key} (ms until it "
              "can sample its next token)", ["how", "tokens", "ms", "vs_resident"])
    n = args.switch_tokens
    settings = ContextSettings(n_ctx=ctx_size_for(2 * n), n_threads=args.threads)
    prt = ParallelRuntime(model_path(key), settings, sequences=2)
    try:
        base = prompt_tokens(prt.model, n + 1)
        convs = [greedy_conversation(base[:n]), greedy_conversation(base[:n - 1] + base[n:n + 1])]
        prefill_s = []
        for conv in convs:
            seq = prt.place(conv.id).seq
            started = clock()
            for pos in range(0, n, prt.settings.n_batch):
                end = min(n, pos + prt.settings.n_batch)
                prt.decode_chunks([(seq, conv.tokens[pos:end], end == n)])
            prefill_s.append(clock() - started)
        a = convs[0]
        path = prt.save(work / "switch.kvckpt", a, prt.table.seq_of(a.id)).path
        resident, restored = [], []
        for _ in range(args.repeats):
            prt.place(convs[1].id)                       # the other one is current
            started = clock()
            seq = prt.place(a.id).seq
            prt.logits(seq)
            resident.append(clock() - started)
            prt.evict(a.id)
            prt.place(convs[1].id)
            started = clock()
            seq = prt.place(a.id).seq
            prt.restore(load_chain(path), seq)
            prt.logits(seq)
            restored.append(clock() - started)
        packed = []
        for _ in range(args.repeats):   # another conversation's Delete frees cells below it
            prt.place(a.id)
            prt.evict(convs[1].id)       # frees the cells below a's: the cache is packed again
            seq = prt.place(convs[1].id).seq
            prt.restore(load_chain(path), seq)   # (a's own file: the same size, any tokens do)
            started = clock()
            prt._repack()
            packed.append(clock() - started)
        r_ms, s_ms, p_ms = min(resident) * 1e3, min(restored) * 1e3, min(prefill_s) * 1e3
        k_ms = min(packed) * 1e3
        t.add(how="resident", tokens=n, ms=r_ms, vs_resident=1.0)
        t.add(how="restored from its file", tokens=n, ms=s_ms, vs_resident=ratio(s_ms, r_ms))
        t.add(how="packed again after a Delete (two conversations)", tokens=2 * n, ms=k_ms,
              vs_resident=ratio(k_ms, r_ms))
        t.add(how="prefilled again (for scale)", tokens=n, ms=p_ms, vs_resident=ratio(p_ms, r_ms))
        t.notes.append(f"file {path.stat().st_size / 1e6:.1f} MB (page cache warm); best of {args.repeats}")
    finally:
        prt.close()
    return t


# -- c. exactness --------------------------------------------------------------------------
def _forced_alone(model_file: str, settings, prompts, n_gen: int):
    """Per prompt: the logits after its prefill and after each of its greedy tokens, alone."""
    from engine.runtime import Runtime
    rt = Runtime(model_file, settings)
    try:
        out = []
        for prompt in prompts:
            rt.trim(0)
            rt.prefill(prompt)
            rows, tokens = [np.array(rt.logits(), copy=True)], []
            for _ in range(n_gen):
                tokens.append(int(np.argmax(rows[-1])))
                rt.decode_token(tokens[-1])
                rows.append(np.array(rt.logits(), copy=True))
            out.append((rows, tokens))
        return out
    finally:
        rt.close()


def _forced_together(model_file: str, settings, prompts, alone) -> list[dict]:
    """Rows of table c for one model and cache: the 4 answers together, teacher-forced."""
    from engine.parallel import ParallelRuntime
    prt = ParallelRuntime(model_file, settings, sequences=len(prompts))
    rows = []
    try:
        n = len(prompts)
        exact = prt.exact_width
        modes = [("separate", max(1, exact) if exact else n), ("separate", n), ("joint", max(1, exact) if exact else n)]
        for prefill, width in modes:
            for key in prt.table.residents():
                prt.evict(key)
            seqs = [prt.place(k).seq for k in range(n)]
            chunks = [(s, p, True) for s, p in zip(seqs, prompts, strict=True)]
            for group in ([chunks] if prefill == "joint" else [[c] for c in chunks]):
                prt.decode_chunks(group)
            worst = max(float(np.abs(prt.logits(s) - rows_[0]).max())
                        for s, (rows_, _) in zip(seqs, alone, strict=True))
            for step in range(len(alone[0][1])):
                tokens = [(s, toks[step]) for s, (_, toks) in zip(seqs, alone, strict=True)]
                for start in range(0, n, width):
                    prt.decode_tokens(dict(tokens[start:start + width]))
                worst = max(worst, max(float(np.abs(prt.logits(s) - rows_[step + 1]).max())
                                       for s, (rows_, _) in zip(seqs, alone, strict=True)))
            rows.append(dict(prefill=prefill, per_decode=width, exact_width=exact, max_diff=worst,
                             exact=worst == 0.0))
        return rows
    finally:
        prt.close()


def exactness_table(keys, args) -> Table:
    from native.context import KV_TYPES, ContextSettings
    from native.model import Model
    t = Table("c. Answers together vs alone: max |logit difference| over prefill + generated tokens "
              "(teacher-forced, 4 answers)",
              ["model", "kv_cache", "prefill", "per_decode", "exact_width", "max_diff", "exact"])
    configs = {"q8_0 + flash attn": dict(flash_attn=True, type_k=KV_TYPES["q8_0"], type_v=KV_TYPES["q8_0"]),
               "f16 + flash attn": dict(flash_attn=True, type_k=KV_TYPES["f16"], type_v=KV_TYPES["f16"]),
               "f16, no flash attn": dict(flash_attn=False, type_k=KV_TYPES["f16"], type_v=KV_TYPES["f16"])}
    if args.quick:
        configs = dict(list(configs.items())[:1])
    for key in keys:
        path = str(model_path(key))
        with Model(path) as model:
            base = prompt_tokens(model, 4 * args.prompt)
        prompts = [base[k * args.prompt // 2:(k + 2) * args.prompt // 2] for k in range(4)]
        for name, kw in configs.items():
            settings = ContextSettings(n_ctx=ctx_size_for(4 * (args.prompt + args.tokens)),
                                       n_threads=args.threads, **kw)
            alone = _forced_alone(path, settings, prompts, args.exact_tokens)
            for row in _forced_together(path, settings, prompts, alone):
                t.add(model=key, kv_cache=name, **row)
    t.notes.append(f"{args.prompt}-token prompts, {args.exact_tokens} generated tokens each; alone: "
                   "each prompt prefilled in one decode, then one token per decode; per_decode: "
                   "generated tokens per decode together (exact_width: what the runtime measured "
                   "at start and the Batcher uses)")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODEL_KEYS, default="smollm")
    p.add_argument("--model-path", default=None, metavar="GGUF",
                   help="table a on this model instead (a hybrid's, say: tests/tinymodels.py builds them)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per answer")
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per answer")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--switch-tokens", type=int, default=4000)
    p.add_argument("--exactness", action="store_true", help="also table c (both models, three caches)")
    p.add_argument("--exact-tokens", type=int, default=24)
    p.add_argument("--tables", default=None, help="which tables, e.g. ac (default ab; abc with --exactness)")
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.tokens, args.repeats, args.switch_tokens, args.exact_tokens = 32, 8, 1, 300, 4
    tables = args.tables or ("abc" if args.exactness or args.quick else "ab")
    if args.model_path and tables != "a":
        p.error("--model-path is for table a only (--tables a)")
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        if "a" in tables:
            print(throughput_table(args.model, args).render(), flush=True)
            print()
        if "b" in tables:
            print(switch_table(args.model, args, Path(tmp)).render(), flush=True)
            print()
        if "c" in tables:
            keys = [args.model] if args.quick else list(MODEL_KEYS)
            print(exactness_table(keys, args).render(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
