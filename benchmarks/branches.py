"""Branches: switching among alternatives and editing a turn, against re-decoding.

    python benchmarks/branches.py [--tokens 4000] [--answer 48] [--threads 2] [--repeats 3]
    python -m benchmarks --sections g          # the same, as section g of the suite

A conversation of about ``--tokens`` tokens (a long first message, its answer, a second
turn) is built with the engine's own writer (engine.history.LineWriter), then:

* five alternatives of the last answer (Regenerate: a new line on the same files);
* **switch**: showing alternative 1 while alternative 2 is in the cache — the engine's
  restore (shared files stay, only the branch's own file is applied) — against
  restoring just that branch's own file onto the shared prefix (the floor: target
  within 1.2x) and against re-decoding the whole conversation;
* **edit turn 2**: restoring the end of turn 1 and decoding the new turn, against
  re-decoding everything;
* **disk**: the files of the five alternatives against one full checkpoint plus their
  own files (target: no more).

Prints one table and exits 0.  Times are medians of ``--repeats`` runs, side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table  # noqa: E402


def table() -> Table:
    return Table("g. Branches: switching alternatives and editing a turn vs re-decoding; disk of five "
                 "alternatives (SmolLM2-135M)",
                 ["tokens", "switch_ms", "floor_ms", "switch_vs_floor", "recompute_ms", "switch_speedup",
                  "edit_ms", "edit_recompute_ms", "edit_speedup", "shared_bytes", "disk_bytes",
                  "disk_target_bytes", "disk_vs_target", "first_prefill_s"],
                 notes=["floor: only the branch's own file applied onto the shared prefix (target: "
                        "switch within 1.2x of it); disk target: one full checkpoint + the five "
                        "alternatives' own files (disk_vs_target <= 1)"])


def _alternatives(rt, store, tokens: int, answer: int) -> tuple[list, float]:
    """A conversation of about ``tokens`` tokens whose last answer has five alternatives,
    each a line of its own on the same files; (their heads, the first prefill's seconds)."""
    from engine.checkpoints.format import KIND_MANUAL
    from engine.conversation import Conversation
    from engine.generation import begin_answer, commit_answer, discard_answer, generate
    from engine.history import LineWriter
    from engine.sampling import SamplerSettings
    words = "The river bends past the mill, the orchard and the old stone bridge. "
    conv = Conversation(sampler=SamplerSettings(seed=1, temperature=0.8, ignore_eos=True))
    long_text = words * max(1, tokens // 16)
    begin_answer(conv, rt, long_text[: len(long_text)], n_predict=answer)
    while len(conv.tokens) > tokens - 2 * answer - 40:      # fit the total
        long_text = long_text[: int(len(long_text) * 0.9)]
        conv = Conversation(sampler=conv.sampler)
        begin_answer(conv, rt, long_text, n_predict=answer)
    writer = LineWriter.starting(rt, store, uuid.uuid4().hex)
    t0 = time.perf_counter()
    generate(rt, conv, autosave=writer, checkpoint_prompt=writer.policy.prompt_checkpoint)
    decode_all_first = time.perf_counter() - t0
    commit_answer(conv)
    writer.save_head(conv, KIND_MANUAL)
    begin_answer(conv, rt, "Now tell it again, shorter.", n_predict=answer)
    generate(rt, conv, autosave=writer)
    heads = [writer.save_head(conv, KIND_MANUAL)]
    chain = writer.chain
    # four more alternatives of the last answer, each a line of its own on the same files
    for seed in range(2, 6):
        writer.close()
        writer = LineWriter.starting(rt, store, uuid.uuid4().hex, chain)
        discard_answer(conv)
        conv.sampler = SamplerSettings(seed=seed, temperature=0.8, ignore_eos=True)
        generate(rt, conv, autosave=writer)
        commit_answer(conv)
        heads.append(writer.save_head(conv, KIND_MANUAL))
    return heads, decode_all_first


def _edit_times(rt, chain1, chain2, median_of) -> tuple[float, float]:
    """Editing turn 2: from the end of turn 1's file vs decoding everything again."""
    from engine.branches import turn_end
    from engine.generation import begin_answer
    # edit turn 2: restore the end of turn 1, decode the new turn (vs everything)
    messages = chain1[-1].meta["conversation"]["messages"]
    kept = [(m["role"], m["content"]) for m in messages[:2]]
    k, n, point = turn_end(chain1, kept)   # (a point of a later head: restored, then trimmed to it)

    def edit():
        rt.restore_chain(chain2)

        def run():
            c = rt.restore_chain(chain1[:k])
            c.tokens = c.tokens[:rt.trim(n, point)]
            c.messages, c.answer = kept, None
            begin_answer(c, rt, "Now tell it in French.", n_predict=0)
            rt.prefill(c.tokens)
        return run

    def edit_recompute():
        rt.trim(0)

        def run():
            c = rt.restore_chain(chain1[:k])
            c.tokens = c.tokens[:rt.trim(n, point)]
            c.messages, c.answer = kept, None
            begin_answer(c, rt, "Now tell it in French.", n_predict=0)
            rt.trim(0)
            rt.prefill(c.tokens)
        return run

    t_edit, t_edit_recompute = median_of(edit), median_of(edit_recompute)
    return t_edit, t_edit_recompute


def measure(out: Table, tokens: int = 4000, answer: int = 48, threads: int = 2, repeats: int = 3) -> dict:
    """Build the conversation and its five alternatives, time switch and edit; one row."""
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.models import default_model_path
    from engine.runtime import Runtime
    from native.context import ContextSettings

    rt = Runtime(default_model_path(), ContextSettings(n_ctx=tokens + 1024, n_threads=threads))
    tmp = tempfile.TemporaryDirectory(prefix="branches-")
    store = Store(Path(tmp.name) / "store")
    try:
        heads, decode_all_first = _alternatives(rt, store, tokens, answer)
        total_tokens = heads[0].n_tokens

        def median_of(fn) -> float:
            times = []
            for _ in range(repeats):
                prepare = fn()
                t = time.perf_counter()
                prepare()
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        chain1, chain2 = load_chain(heads[0].path), load_chain(heads[1].path)
        shared = sum(1 for a, b in zip(chain1, chain2, strict=False) if a.path == b.path)

        def switch():       # alternative 2 in the cache, then the engine shows alternative 1
            rt.restore_chain(chain2)
            return lambda: rt.restore_chain(chain1)

        def own_file_only():   # the floor: the shared prefix in the cache, apply one file
            rt.restore_chain(chain1[:shared])
            return lambda: rt.restore_chain(chain1)

        def recompute():
            rt.trim(0)
            return lambda: rt.prefill([int(t) for t in chain1[-1].tokens[:total_tokens]])

        t_switch, t_floor, t_recompute = median_of(switch), median_of(own_file_only), median_of(recompute)

        t_edit, t_edit_recompute = _edit_times(rt, chain1, chain2, median_of)

        files = {p.name: p.stat().st_size for p in store.files()}
        own = [heads[i].size for i in range(5)]
        base_files = [d.path.name for d in chain1[:shared]]
        full = rt.save(store.folder.parent / "full.kvckpt", rt.restore_chain(chain1), KIND_MANUAL).size
        return out.add(tokens=total_tokens, switch_ms=t_switch * 1000, floor_ms=t_floor * 1000,
                       switch_vs_floor=t_switch / t_floor, recompute_ms=t_recompute * 1000,
                       switch_speedup=t_recompute / t_switch, edit_ms=t_edit * 1000,
                       edit_recompute_ms=t_edit_recompute * 1000, edit_speedup=t_edit_recompute / t_edit,
                       disk_bytes=sum(files.values()), disk_target_bytes=full + sum(own),
                       disk_vs_target=sum(files.values()) / (full + sum(own)),
                       shared_bytes=sum(files.get(n, 0) for n in base_files),
                       first_prefill_s=decode_all_first)
    finally:
        rt.close()
        tmp.cleanup()

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--answer", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    out = table()
    measure(out, args.tokens, args.answer, args.threads, args.repeats)
    print(out.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
