"""`run --checkpoint-save P --checkpoint-save-interval 16`: what autosaving costs generation.

    python benchmarks/named_autosave.py [--tokens 512] [--every 16] [--prompt 1500] [--repeats 3]

Four ways, interleaved run by run and compared side by side: no autosave; the first
round's autosave, which rewrote P whole every N tokens; deltas in a folder beside P
(engine.history.LineWriter) with each fsync on the generation thread; and today's, the
same deltas landing on a helper thread.  Every mode writes P whole once the answer ends
(and removes its autosaves), timed apart from the answer.  Target: generation under 3 %
slower than no autosave.  Tokens/s are given best and median of ``--repeats`` (a shared
machine's noise only slows a run down, and runs here differ by up to 10 %); the share of
the answer's time spent inside autosave calls, measured in each run, is the steadier
figure.  Prints a table, exits 0.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class _Foreground:
    """A Landing that lands each save at once, on the generation thread."""
    in_flight = False

    def submit(self, finish) -> None:
        finish()

    def settle(self):
        return None


def _print_table(runs: dict, n_prompt: int, args) -> None:
    """The modes side by side, each against the runs without autosave."""
    best_base = max(r["tps"] for r in runs["none"])
    median_base = statistics.median(r["tps"] for r in runs["none"])
    print(f"Autosave to a named file (SmolLM2-135M, {n_prompt:,}-token prompt, {args.tokens} tokens, "
          f"every {args.every}, {args.repeats} interleaved runs each)\n")
    print("| mode | tokens/s (best) | autosaves | cost vs none, best | cost vs none, median | "
          "time inside autosave calls | after the answer: P + cleanup |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, label in (("none", "no autosave"), ("rewrite", "rewrite P whole (first round)"),
                        ("beside-sync", "deltas beside P, fsync on the generation thread"),
                        ("beside", "deltas beside P, landing on a helper thread (now)")):
        rs = runs[mode]
        best = max(r["tps"] for r in rs)
        median = statistics.median(r["tps"] for r in rs)
        inside = statistics.median(r["inside"] for r in rs)
        after = statistics.median(r["after_ms"] for r in rs)
        print(f"| {label} | {best:.1f} | {rs[0]['saves']} | {100 * (best_base - best) / best_base:.1f} % | "
              f"{100 * (median_base - median) / median_base:.1f} % | {100 * inside:.2f} % | {after:.0f} ms |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=1500, help="tokens of the prompt (a long context "
                        "is where rewriting P whole costs most)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from engine.checkpoint_policy import beside_folder
    from engine.checkpoints.format import KIND_AUTOSAVE, KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.history import LineWriter
    from engine.models import default_model_path
    from engine.runtime import Runtime
    from engine.sampling import SamplerSettings
    from native.context import ContextSettings

    ctx = args.prompt + args.tokens + 256
    rt = Runtime(default_model_path(), ContextSettings(n_ctx=ctx, n_threads=args.threads))
    work = Path(tempfile.mkdtemp(prefix="named-autosave-"))
    target = work / "story.kvckpt"
    text = "Here is a long story about a lighthouse keeper. " * max(1, args.prompt // 10)
    conv0 = Conversation(sampler=SamplerSettings(seed=3, temperature=0.0, ignore_eos=True))
    begin_answer(conv0, rt, text + "Go on with it.", n_predict=args.tokens)
    prompt = list(conv0.tokens)

    def one(mode: str) -> dict:
        conv = Conversation(sampler=conv0.sampler)
        begin_answer(conv, rt, text + "Go on with it.", n_predict=args.tokens)
        rt.trim(len(prompt))
        rt.prefill(prompt)                      # the prompt is in the cache: time the answer only
        inside = []
        writer = None
        if mode in ("beside", "beside-sync"):
            writer = LineWriter.starting(rt, Store(beside_folder(target)), uuid.uuid4().hex)
        if mode == "beside-sync":
            writer._landing = _Foreground()     # as before: each autosave waits for its fsync

        def autosave(c):
            t0 = time.perf_counter()
            if mode == "rewrite":
                rt.save(target, c, KIND_AUTOSAVE)
            else:
                writer.autosave(c)
            inside.append(time.perf_counter() - t0)

        started = time.perf_counter()
        result = generate(rt, conv, autosave=None if mode == "none" else autosave,
                          autosave_every=0 if mode == "none" else args.every)
        answered = time.perf_counter()
        rt.save(target, conv, KIND_MANUAL)      # every mode ends with P written whole
        if writer is not None:                  # and its autosaves gone, as `run` does
            writer.close()
            shutil.rmtree(beside_folder(target), ignore_errors=True)
        ended = time.perf_counter()
        assert result.n_generated == args.tokens
        return {"tps": args.tokens / (answered - started), "saves": len(inside),
                "inside": sum(inside) / (answered - started), "after_ms": 1e3 * (ended - answered)}

    one("none")                                 # warm-up (first decodes, page cache), untimed
    runs = {"none": [], "rewrite": [], "beside-sync": [], "beside": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(one(mode))
    rt.close()
    shutil.rmtree(work, ignore_errors=True)
    _print_table(runs, len(prompt), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
