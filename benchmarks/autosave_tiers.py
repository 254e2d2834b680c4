"""What an answer's autosaves in tiers cost its generation, and save the restore a crash leaves.

    python -m benchmarks.autosave_tiers [--prompt 1000] [--tokens 960] [--every 64] [--repeats 3]
                                        [--model smollm|llama-8b-kv] [--folder DIR]

SmolLM2 (``--model llama-8b-kv``: benchmarks.restore_profile's attention model at
Llama-3-8B's KV widths, built into ``--folder`` once) with the app's context settings.  A
prompt of ``--prompt`` tokens is answered greedily for ``--tokens`` tokens with an autosave
every ``--every`` (the window's default is 64) on a line in a fresh store, as the app
writes it (engine.history.LineWriter, the prompt's own checkpoint included), and not
stopped: what a crash at the answer's end leaves (15 autosaves by default: the most files
tiers leave below 16, popcount(15) = 4 after the prompt's).  Two layouts, interleaved run by run:
each autosave on the one before (``ChainPolicy(tier_autosaves=False)``, before 2026-12-06 (twenty-second session))
and in tiers (now: each absorbs the newest autosaves that hold no more tokens of their own,
LineWriter._tier_below).  For each: the answer's time (every autosave included), the time
spent in the autosave calls on the generating thread (extracting the state, writing; the
fsync lands on a helper thread) and the slowest one, the bytes the autosaves wrote and the
most one wrote, the files the newest autosave's chain holds (what a restore after the crash
reads) and the store's bytes then, and the restore of that chain (``load_chain`` +
``Runtime.restore_chain``, every check; in a second context of the same process, warm,
median of 5).  Prints a table, exits 0.  ``benchmarks.restore_profile`` times the same two
layouts in new processes, beside llama-server (``chain``, ``chain-each``).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table, add_layout_rows, clock, ctx_size_for  # noqa: E402

#: (key, label, ChainPolicy's fields)
LAYOUTS = (("each", "each on the one before (before)", {"tier_autosaves": False}),
           ("tiers", "in tiers (now)", {}))


def one_run(rt, reader, prompt: list[int], args, policy: dict, folder: Path) -> dict:
    from benchmarks.common import greedy_conversation, warm_restores
    from engine.checkpoints.store import Store
    from engine.generation import generate
    from engine.history import ChainPolicy, LineWriter
    rt.trim(0)
    rt.ctx.clear()
    writer = LineWriter(rt, Store(folder), uuid.uuid4().hex, policy=ChainPolicy(**policy))
    saves, sizes, newest = [], [], []

    def autosave(conv):
        started, written = clock(), writer.bytes_written
        newest.append(writer.autosave(conv))
        saves.append(clock() - started)
        sizes.append(writer.bytes_written - written)
    conv = greedy_conversation(prompt)
    started = clock()
    generate(rt, conv, stop_after=args.tokens, autosave=autosave, autosave_every=args.every,
             checkpoint_prompt=writer.policy.prompt_checkpoint)
    answer_s = clock() - started
    writer.settle()   # the newest autosave landed, what it supersedes retired: as a crash then leaves it
    held = list(rt.kv_tokens[:newest[-1].n_tokens])
    writer.close()
    restore_s, files = warm_restores(reader, newest[-1].path, held)
    return {"answer_s": answer_s, "autosave_ms": sum(saves) * 1e3, "slowest_ms": max(saves) * 1e3,
            "written_mb": sum(sizes) / 1e6, "largest_mb": max(sizes) / 1e6, "files": files,
            "store_mb": sum(p.stat().st_size for p in folder.glob("*.kvckpt")) / 1e6,
            "restore_ms": restore_s * 1e3}


def measure(args) -> Table:
    """Both layouts, interleaved run by run; the table (see the module docstring)."""
    from benchmarks.common import context_settings, interleaved_layouts, prompt_tokens
    from benchmarks.restore_profile import model_file
    prompt: list[int] = []

    def run(rt, reader, policy: dict, folder: Path) -> dict:
        prompt[:] = prompt or prompt_tokens(rt.model, args.prompt)   # tokenized once, by the first run
        return one_run(rt, reader, prompt, args, policy, folder)
    model = model_file(args.model, Path(args.folder))
    settings = context_settings(ctx_size_for(args.prompt + args.tokens + 16), args.threads)
    runs = interleaved_layouts(settings, args.repeats, LAYOUTS, run, "autosave-tiers-", model)
    table = Table(f"An answer's autosaves and the restore a crash leaves ({args.model}, {args.prompt:,}-token "
                  f"prompt, {args.tokens} tokens, autosave every {args.every}; medians of {args.repeats})",
                  ["layout", "answer_s", "autosave_ms", "slowest_ms", "written_MB", "largest_MB",
                   "files_read", "store_MB", "restore_ms", "restore_vs_before"])
    add_layout_rows(table, runs, LAYOUTS, "each",
                    {"answer_s": "answer_s", "autosave_ms": "autosave_ms", "slowest_ms": "slowest_ms",
                     "written_MB": "written_mb", "largest_MB": "largest_mb", "store_MB": "store_mb",
                     "restore_ms": "restore_ms"}, {"files_read": "files"})
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=960)
    parser.add_argument("--every", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=("smollm", "llama-8b-kv"), default="smollm")
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "checkpoint-chat-bench-models"),
                        help="where --model llama-8b-kv is built once")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(measure(parse(argv)).render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
