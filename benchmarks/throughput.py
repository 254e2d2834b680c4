"""Section d: prefill and generation tokens/s of our engine, llama-cpp-python's high-level
``Llama`` (``create_completion(stream=True)``) and a bare ctypes loop.

``ours`` is ``generate()`` as the window calls it; ``ours_conf`` also computes the
per-token confidence (a softmax over the vocabulary), as ``run --json`` asks for and as
every token paid for before issue 13.  ``*_us`` columns: microseconds per generated
token spent outside ``llama_decode`` (median of the runs): the engine's own cost, which
a busy machine disturbs far less than the tokens/s it decides.

All three use the same model file, threads, context size, batch sizes, KV cache type and
flash-attention setting, the same prompt tokens and greedy decoding.  The bare loop is
``llama_batch_get_one`` + ``llama_decode`` + ``argmax`` over the logits and nothing else.
Runs are interleaved (bare, ours, Llama, bare, ...) and the best of each is reported
(the noise of a shared machine only ever slows a run down).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from benchmarks.common import TYPE_NAMES, Table, clock, greedy_conversation, median, prompt_tokens, ratio


def table() -> Table:
    return Table("d. Prefill and generation speed: ours vs llama-cpp-python Llama vs bare ctypes loop (tokens/s)",
                 ["model", "kv", "phase", "tokens", "bare", "ours", "ours_conf", "llama", "ours_vs_bare",
                  "ours_conf_vs_bare", "ours_vs_llama", "llama_vs_bare", "bare_us", "ours_us",
                  "ours_conf_us"])


class TimedDecode:
    """The bindings, with the time spent inside ``llama_decode`` added up in ``inside``.

    Every other function is the bindings' own object, copied as an attribute, so a call
    through this namespace costs what a call through the module does.
    """

    def __init__(self, ll) -> None:
        self.__dict__.update({k: getattr(ll, k) for k in dir(ll) if not k.startswith("__")})
        real = ll.llama_decode
        self.inside = 0.0

        def llama_decode(ctx, batch):
            started = clock()
            rc = real(ctx, batch)
            self.inside += clock() - started
            return rc
        self.llama_decode = llama_decode


class BareLoop:
    """A second context on the same model, driven with raw llama.cpp calls only."""

    def __init__(self, rt) -> None:
        from native.library import bindings
        ll = self.ll = TimedDecode(bindings())
        s = rt.settings
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = rt.ctx.n_ctx, s.n_batch, min(s.n_ubatch, s.n_batch), s.n_seq_max
        p.n_threads = p.n_threads_batch = rt.ctx.n_threads
        p.flash_attn_type = 1 if s.flash_attn else 0
        p.type_k, p.type_v, p.kv_unified, p.no_perf = s.type_k, s.type_v, s.kv_unified, True
        self.ctx = ll.llama_init_from_model(rt.model.ptr, p)
        if not self.ctx:
            raise RuntimeError("could not create the bare loop's context")
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_batch = s.n_batch
        self.n_vocab = rt.model.shape.n_vocab

    def run(self, tokens: list[int], n_gen: int) -> tuple[float, float, list[int], float]:
        ll = self.ll
        ll.llama_memory_clear(self.mem, True)
        arr = (ctypes.c_int32 * len(tokens))(*tokens)
        started = clock()
        for i in range(0, len(tokens), self.n_batch):
            n = min(self.n_batch, len(tokens) - i)
            ptr = ctypes.cast(ctypes.addressof(arr) + 4 * i, ctypes.POINTER(ctypes.c_int32))
            if ll.llama_decode(self.ctx, ll.llama_batch_get_one(ptr, n)) != 0:
                raise RuntimeError("bare prefill failed")
        logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
        token = int(np.argmax(logits))
        prefill_s = clock() - started
        one = (ctypes.c_int32 * 1)()
        out = []
        ll.inside = 0.0
        started = clock()
        for _ in range(n_gen):
            out.append(token)
            one[0] = token
            if ll.llama_decode(self.ctx, ll.llama_batch_get_one(one, 1)) != 0:
                raise RuntimeError("bare decode failed")
            logits = np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, -1), shape=(self.n_vocab,))
            token = int(np.argmax(logits))
        gen_s = clock() - started
        return prefill_s, gen_s, out, (gen_s - ll.inside) / max(1, n_gen)

    def close(self) -> None:
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None


def _ours(rt, tokens: list[int], n_gen: int, confidence: bool = False):
    """Prefill s, generation s, tokens generated, the tokens, µs/token outside llama_decode."""
    from engine.generation import generate
    rt.trim(0)
    rt.ctx.clear()
    conv = greedy_conversation(tokens, n_predict=n_gen, ignore_eos=False)
    real, timed = rt.ctx._ll, TimedDecode(rt.ctx._ll)
    rt.ctx._ll = timed
    try:
        prefill_s = generate(rt, conv, stop_after=0).prefill_s
        timed.inside = 0.0
        res = generate(rt, conv, confidence=confidence)
    finally:
        rt.ctx._ll = real
    outside = (res.generation_s - timed.inside) / max(1, res.n_generated)
    return prefill_s, res.generation_s, res.n_generated, conv.tokens[len(tokens):], outside


def _llama_open(path: Path, rt):
    from llama_cpp import Llama
    s = rt.settings
    return Llama(model_path=str(path), n_ctx=rt.ctx.n_ctx, n_batch=s.n_batch, n_ubatch=s.n_ubatch,
                 n_threads=rt.ctx.n_threads, n_threads_batch=rt.ctx.n_threads, n_gpu_layers=0,
                 flash_attn=s.flash_attn, type_k=s.type_k, type_v=s.type_v, verbose=False)


def _llama(llm, tokens: list[int], n_gen: int) -> tuple[float, float, int]:
    llm.reset()
    times = []
    started = clock()
    for _chunk in llm.create_completion(prompt=list(tokens), max_tokens=n_gen, temperature=0.0,
                                        repeat_penalty=1.0, stream=True):
        times.append(clock())
    if len(times) < 2:
        return times[0] - started if times else float("nan"), float("nan"), len(times)
    # first chunk: prefill + first sample; then one decode + sample per chunk
    return times[0] - started, times[-1] - times[0], len(times) - 1


def measure(rt, key: str, path: Path, n_prompt: int, n_gen: int, repeats: int, out: Table) -> None:
    tokens = prompt_tokens(rt.model, n_prompt)
    bare = BareLoop(rt)
    llm = _llama_open(path, rt)
    rows = {"bare": ([], []), "ours": ([], []), "ours_conf": ([], []), "llama": ([], [])}
    outside = {"bare": [], "ours": [], "ours_conf": []}
    same = True
    try:
        warm = tokens[:min(len(tokens), 16)]   # first-call costs (thread pools, buffers) out of the way
        bare.run(warm, 2)
        _ours(rt, warm, 2)
        _llama(llm, warm, 2)
        for _ in range(repeats):
            pf, gen, bare_tokens, us = bare.run(tokens, n_gen)
            rows["bare"][0].append(n_prompt / pf)
            rows["bare"][1].append(n_gen / gen)
            outside["bare"].append(us)
            pf, gen, n, our_tokens, us = _ours(rt, tokens, n_gen)
            rows["ours"][0].append(n_prompt / pf)
            rows["ours"][1].append(n / gen if gen > 0 else float("nan"))
            outside["ours"].append(us)
            same = same and our_tokens == bare_tokens[:len(our_tokens)]
            pf, gen, n, conf_tokens, us = _ours(rt, tokens, n_gen, confidence=True)
            rows["ours_conf"][0].append(n_prompt / pf)
            rows["ours_conf"][1].append(n / gen if gen > 0 else float("nan"))
            outside["ours_conf"].append(us)
            same = same and conf_tokens == our_tokens
            pf, gen, n = _llama(llm, tokens, n_gen)
            rows["llama"][0].append(n_prompt / pf)
            rows["llama"][1].append(n / gen if gen > 0 else float("nan"))
    finally:
        bare.close()
        llm.close()
    kv = TYPE_NAMES.get(rt.settings.type_k, "?") + ("+FA" if rt.settings.flash_attn else "")
    for i, phase in enumerate(("prefill", "generate")):
        b, o, oc, lm = (max(rows[e][i]) for e in ("bare", "ours", "ours_conf", "llama"))
        us = {k: median(v) * 1e6 for k, v in outside.items()} if phase == "generate" else {}
        out.add(model=key, kv=kv, phase=phase, tokens=n_prompt if i == 0 else n_gen, bare=b, ours=o,
                ours_conf=oc, llama=lm, ours_vs_bare=ratio(o, b), ours_conf_vs_bare=ratio(oc, b),
                ours_vs_llama=ratio(o, lm), llama_vs_bare=ratio(lm, b), bare_us=us.get("bare"),
                ours_us=us.get("ours"), ours_conf_us=us.get("ours_conf"))
    if not same:
        out.notes.append(f"{key} {kv}: our greedy tokens differ from the bare loop's")
    out.notes.append(f"{key} {kv}: best of {repeats} interleaved runs each, threads={rt.ctx.n_threads}, "
                     f"n_ctx={rt.ctx.n_ctx}, n_batch={rt.settings.n_batch}")
