"""`run --checkpoint-save P --checkpoint-save-interval 16`: what autosaving costs generation.

    python benchmarks/named_autosave.py [--tokens 512] [--every 16] [--prompt 1500] [--repeats 3]

Three ways, interleaved run by run and compared side by side (best of ``--repeats``, as
the noise of a shared machine only slows a run down): no autosave; the first round's
autosave, which rewrote P whole every N tokens; and today's, deltas in a folder beside
P (engine.history.LineWriter), with P written once at the end.  Target: under 3 %
slower than no autosave.  Prints a table, exits 0.
"""

from __future__ import annotations

import argparse
import shutil
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--every", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=1500, help="tokens of the prompt (a long context "
                        "is where rewriting P whole costs most)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    from engine.checkpoints.format import KIND_AUTOSAVE, KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.cli.run import beside_folder
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

    def one(mode: str) -> tuple[float, int]:
        conv = Conversation(sampler=conv0.sampler)
        begin_answer(conv, rt, text + "Go on with it.", n_predict=args.tokens)
        rt.trim(len(prompt))
        rt.prefill(prompt)                      # the prompt is in the cache: time the answer only
        saves = [0]
        writer = None
        if mode in ("beside", "beside-sync"):
            writer = LineWriter.starting(rt, Store(beside_folder(target)), uuid.uuid4().hex)
        if mode == "beside-sync":
            writer._landing = _Foreground()     # as before: each autosave waits for its fsync

        def autosave(c):
            saves[0] += 1
            if mode == "rewrite":
                rt.save(target, c, KIND_AUTOSAVE)
            else:
                writer.autosave(c)

        started = time.perf_counter()
        result = generate(rt, conv, autosave=None if mode == "none" else autosave,
                          autosave_every=0 if mode == "none" else args.every)
        rt.save(target, conv, KIND_MANUAL)      # every mode ends with P written whole
        if writer is not None:
            writer.close()
            shutil.rmtree(beside_folder(target), ignore_errors=True)
        elapsed = time.perf_counter() - started
        assert result.n_generated == args.tokens
        return args.tokens / elapsed, saves[0]

    best = {"none": 0.0, "rewrite": 0.0, "beside-sync": 0.0, "beside": 0.0}
    saves = {}
    for _ in range(args.repeats):
        for mode in best:
            tps, n = one(mode)
            best[mode] = max(best[mode], tps)
            saves[mode] = n
    rt.close()
    shutil.rmtree(work, ignore_errors=True)
    base = best["none"]
    print(f"Autosave to a named file (SmolLM2-135M, {len(prompt):,}-token prompt, {args.tokens} tokens, "
          f"every {args.every}, best of {args.repeats}, interleaved)\n")
    print("| mode | tokens/s | autosaves | cost vs none |")
    print("|---|---:|---:|---:|")
    for mode, label in (("none", "no autosave"), ("rewrite", "rewrite P whole (first round)"),
                        ("beside-sync", "deltas beside P, fsync on the generation thread (last round)"),
                        ("beside", "deltas beside P, landing on a helper thread (now)")):
        cost = 100.0 * (base - best[mode]) / base if base else 0.0
        print(f"| {label} | {best[mode]:.1f} | {saves[mode]} | {cost:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
