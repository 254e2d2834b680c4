"""Checkpoints by memory kind: what restoring, Regenerate and autosaves cost for attention,
recurrent and hybrid models (issue 23).  Prints tables and exits 0; asserts nothing.

    python benchmarks/memory_kinds.py [--tokens 4096] [--archs lfm2,qwen35,...] [--repeats 3]

Models: the tiny random-weight GGUFs of tests/tinymodels.py (8 layers for the hybrids), so
the *ratios* matter, not the absolute times: a real model's layers cost far more per token
and so widen every gap measured here.  For each, in one process, side by side (best of
``--repeats``, a fresh context each time, files warm in the page cache):

* re-reading the conversation (prefill of ``--tokens`` tokens, first token sampled) against
  restoring its checkpoint (read, verify, set the state, sample);
* Regenerate of the last answer: the snapshot at the end of the prompt (engine.snapshots)
  against re-reading the conversation, which is what llama-server does for these models;
* an Edit of the last user message (a long first turn given, then a short question): from
  the snapshot kept where that message started (Answer.marks) against re-reading;
* an autosave delta (16 new tokens) against a full save of the same conversation;
* the state's bytes: per token, and the fixed recurrent part.

A last table computes what a real hybrid would hold, from the shapes in its published
configuration (no weights needed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for extra in (ROOT, ROOT / "tests"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from benchmarks.common import prompt_text, prompt_tokens  # noqa: E402
from engine.checkpoints.chain import load_chain  # noqa: E402
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_PAUSE, read_header  # noqa: E402
from engine.conversation import Conversation  # noqa: E402
from engine.generation import Answer, begin_answer, commit_answer, discard_answer, generate  # noqa: E402
from engine.runtime import Runtime  # noqa: E402
from engine.sampling import SamplerSettings  # noqa: E402
from native.context import ContextSettings  # noqa: E402

LAYERS = {"lfm2": 8, "qwen35": 8, "granitehybrid": 8, "falcon-h1": 4, "mamba2": 4, "rwkv7": 4, "llama": 4}


def _conversation(rt: Runtime, tokens: list[int]) -> Conversation:
    conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=5, ignore_eos=True))
    conv.tokens = list(tokens)
    conv.answer = Answer(n_prompt_tokens=len(tokens), n_predict=16)
    return conv


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _restore_first_token(rt: Runtime, path: Path) -> None:
    c = rt.restore_chain(load_chain(path))
    c.answer = Answer(n_prompt_tokens=len(c.tokens), n_predict=1)
    generate(rt, c)


def _edit_first_token(rt: Runtime, n_tokens: int, repeats: int) -> tuple[float, float]:
    """An Edit of the second user message of a conversation whose first turn is about
    ``n_tokens`` long, to its first token: (from the mark, re-reading the whole prompt)."""
    long_text = rt.model.detokenize(prompt_tokens(rt.model, n_tokens - 64)[1:])
    conv = Conversation(messages=[("user", long_text), ("assistant", prompt_text(1))],
                        sampler=SamplerSettings(temperature=0.8, seed=5, ignore_eos=True))
    begin_answer(conv, rt, "What happened next?", n_predict=8)
    generate(rt, conv)
    commit_answer(conv)
    from_mark, reread = [], []
    for k in range(repeats):
        for times, clear in ((from_mark, False), (reread, True)):
            generate(rt, _edited(conv, rt, k))            # the cache holds another edit...
            edit = _edited(conv, rt, k + 1)
            if clear:
                rt.trim(0)
            times.append(_timed(lambda edit=edit: generate(rt, edit, stop_after=1)))   # ...then this one
    return min(from_mark), min(reread)


def _edited(conv: Conversation, rt: Runtime, k: int) -> Conversation:
    edit = Conversation(messages=conv.messages[:2], sampler=conv.sampler, tokens=list(conv.tokens))
    begin_answer(edit, rt, f"Who was the keeper, number {k}?", n_predict=8)
    return edit


def measure(arch: str, model: Path, n_tokens: int, repeats: int, folder: Path) -> dict:
    settings = ContextSettings(n_ctx=n_tokens + 256, n_threads=2)
    rt = Runtime(model, settings)
    try:
        tokens = prompt_tokens(rt.model, n_tokens)
        kind = rt.shape.memory_name
        # the conversation, its checkpoint, then an answer and a delta on it
        conv = _conversation(rt, tokens)
        rt.prefill(conv.tokens)
        full = rt.save(folder / f"{arch}.kvckpt", conv, KIND_PAUSE)
        state_at_prompt = read_header(full.path).state_len
        generate(rt, conv)
        delta = rt.save(folder / f"{arch}-delta.kvckpt", conv, KIND_AUTOSAVE, parent=full)
        whole = rt.save(folder / f"{arch}-whole.kvckpt", conv, KIND_AUTOSAVE)
        delta_state, whole_state = read_header(delta.path).state_len, read_header(whole.path).state_len
        # Regenerate: back to the end of the prompt, first token
        regen, reread = [], []
        for _ in range(repeats):
            discard_answer(conv)
            regen.append(_timed(lambda: generate(rt, conv, stop_after=1)))
            generate(rt, conv)
            discard_answer(conv)
            rt.trim(0)
            reread.append(_timed(lambda: generate(rt, conv, stop_after=1)))
            generate(rt, conv)
        rt.trim(0)
        edit, edit_reread = _edit_first_token(rt, n_tokens, repeats)
        rt.trim(0)
        rt.prefill(tokens[:1])
        fixed = rt.ctx.state_size(0)   # one token: the recurrent part and one attention cell
    finally:
        rt.close()
    # restore vs re-read to the first token, a fresh context each time
    restore, prefill = [], []
    for _ in range(repeats):
        fresh = Runtime(model, settings)
        try:
            _ = fresh.eog_ids, fresh.candidates   # made once per runtime: not part of either path
            restore.append(_timed(partial(_restore_first_token, fresh, full.path)))
            fresh.trim(0)
            c = _conversation(fresh, tokens)
            c.answer.n_predict = 1
            prefill.append(_timed(partial(generate, fresh, c)))
        finally:
            fresh.close()
    per_token = (state_at_prompt - fixed) / max(1, n_tokens - 1)
    fixed -= per_token
    return {"arch": arch, "kind": kind, "restore": min(restore), "prefill": min(prefill),
            "regen": min(regen), "reread": min(reread), "edit": edit, "edit_reread": edit_reread,
            "delta": delta_state, "whole": whole_state,
            "fixed": round(fixed), "per_token": per_token, "file": full.size}


def real_model_rows(n_tokens: int) -> list[tuple[str, str, str, str]]:
    """What a real model's sequence state holds at ``n_tokens``, from its published shapes
    (q8_0 KV: 34 bytes per 32 values; recurrent rows float32)."""
    q8 = 34 / 32
    rows = []
    # LFM2-2.6B (LiquidAI config.json): 30 layers, 8 of them full attention (8 KV heads of
    # 64), 22 short-convolution layers with L_cache 3 over hidden size 2048
    attn = 8 * 2 * 8 * 64 * q8
    conv = 22 * 2048 * (3 - 1) * 4
    rows.append(("LFM2-2.6B (hybrid)", f"{attn / 1024:.1f} KB", f"{conv / 1024:.0f} KB",
                 f"{(attn * n_tokens + conv) / 2**20:.1f} MB"))
    # the same depth and widths with every layer attention (a plain model of its size)
    dense = 30 * 2 * 8 * 64 * q8
    rows.append(("same shape, all 30 layers attention", f"{dense / 1024:.1f} KB", "0",
                 f"{dense * n_tokens / 2**20:.1f} MB"))
    return rows


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]
    line = lambda r: "| " + " | ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    import tinymodels
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--archs", default="lfm2,qwen35,granitehybrid,falcon-h1,mamba2,rwkv7,llama")
    args = parser.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for arch in args.archs.split(","):
            model = tinymodels.cached(arch, folder / "models", n_layer=LAYERS.get(arch))
            results.append(measure(arch, model, args.tokens, args.repeats, folder))
    ms = lambda s: f"{s * 1000:.1f} ms"  # noqa: E731
    print(f"\nRestore vs re-reading a {args.tokens}-token conversation, to the first token "
          f"(best of {args.repeats}):")
    print(table(["model", "memory", "re-read", "restore", "faster"],
                [[r["arch"], r["kind"], ms(r["prefill"]), ms(r["restore"]), f"{r['prefill'] / r['restore']:.1f}x"]
                 for r in results]))
    print("\nRegenerate the last answer, to its first token: snapshot vs re-reading the conversation:")
    print(table(["model", "re-read", "snapshot", "faster"],
                [[r["arch"], ms(r["reread"]), ms(r["regen"]), f"{r['reread'] / r['regen']:.1f}x"] for r in results]))
    print("\nEdit the last user message, to the first token: from where it started vs re-reading:")
    print(table(["model", "re-read", "from the mark", "faster"],
                [[r["arch"], ms(r["edit_reread"]), ms(r["edit"]), f"{r['edit_reread'] / r['edit']:.1f}x"]
                 for r in results]))
    print("\nAutosave of 16 new tokens: delta state vs full state; state bytes by memory kind:")
    print(table(["model", "memory", "delta", "full", "delta/full", "per token", "fixed (recurrent)"],
                [[r["arch"], r["kind"], f"{r['delta']:,} B", f"{r['whole']:,} B", f"{r['delta'] / r['whole']:.3f}",
                  f"{r['per_token']:.0f} B", f"{r['fixed']:,} B"] for r in results]))
    print(f"\nA real hybrid's sequence state at {args.tokens} tokens, computed from its shapes:")
    print(table(["model", "per token", "fixed", f"at {args.tokens}"],
                [list(r) for r in real_model_rows(args.tokens)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
