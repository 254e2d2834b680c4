"""What folding an answer's autosaves into its head costs a pause, and saves a restore.

    python -m benchmarks.head_fold [--prompt 1000] [--tokens 512] [--every 64] [--repeats 3]

SmolLM2 with the app's context settings.  A prompt of ``--prompt`` tokens is answered
greedily for ``--tokens`` tokens with an autosave every ``--every`` (the window's default
is 64) on a line in a fresh store, as the app writes it (engine.history.LineWriter, the
prompt's own checkpoint included), then paused: the pause writes the line's head.  Two
layouts, interleaved run by run: the head on the newest autosave (before 2026-12-03) and
the head folded onto the last anchor (now, ``ChainPolicy.fold_heads``).  For each: the
pause's save (write, fsync, retiring what it supersedes), the head's bytes, the files a
restore reads and the store's bytes after the pause, and the restore of the head's chain
(``load_chain`` + ``Runtime.restore_chain``, every check; in a second context of the same
process, warm, median of 5).  Prints a table, exits 0.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table, add_layout_rows, clock, ctx_size_for  # noqa: E402

LAYOUTS = (("newest", "head on the newest autosave (before)", False),
           ("folded", "head folded onto the last anchor (now)", True))


def one_run(rt, reader, tokens: list[int], args, fold: bool, folder: Path) -> dict:
    from benchmarks.common import greedy_conversation, warm_restores
    from engine.checkpoints.format import KIND_PAUSE
    from engine.checkpoints.store import Store
    from engine.generation import generate
    from engine.history import ChainPolicy, LineWriter
    rt.trim(0)
    rt.ctx.clear()
    store = Store(folder)
    writer = LineWriter.starting(rt, store, uuid.uuid4().hex, policy=ChainPolicy(fold_heads=fold, tier_autosaves=fold))
    conv = greedy_conversation(tokens)
    generate(rt, conv, stop_after=args.tokens, autosave=writer, autosave_every=args.every,
             checkpoint_prompt=writer.policy.prompt_checkpoint)
    writer.settle()
    started = clock()
    head = writer.save_head(conv, KIND_PAUSE)
    pause_s = clock() - started
    writer.close()
    restore_s, files = warm_restores(reader, head.path, rt.kv_tokens)
    store_bytes = sum(p.stat().st_size for p in folder.glob("*.kvckpt"))
    return {"pause_ms": pause_s * 1e3, "head_mb": head.size / 1e6, "files": files,
            "store_mb": store_bytes / 1e6, "restore_ms": restore_s * 1e3}


def measure(args) -> Table:
    """Both layouts, interleaved run by run; the table (see the module docstring)."""
    from benchmarks.common import context_settings, interleaved_layouts, prompt_tokens
    tokens: list[int] = []

    def run(rt, reader, fold: bool, folder: Path) -> dict:
        tokens[:] = tokens or prompt_tokens(rt.model, args.prompt)   # tokenized once, by the first run
        return one_run(rt, reader, tokens, args, fold, folder)
    settings = context_settings(ctx_size_for(args.prompt + args.tokens + 16), args.threads)
    runs = interleaved_layouts(settings, args.repeats, LAYOUTS, run, "head-fold-")
    table = Table(f"An answer's pause and its restore (SmolLM2, {args.prompt:,}-token prompt, {args.tokens} "
                  f"tokens, autosave every {args.every}; medians of {args.repeats})",
                  ["layout", "pause_ms", "head_MB", "files_read", "store_MB", "restore_ms", "restore_vs_before"])
    add_layout_rows(table, runs, LAYOUTS, "newest",
                    {"pause_ms": "pause_ms", "head_MB": "head_mb", "store_MB": "store_mb", "restore_ms": "restore_ms"},
                    {"files_read": "files"})
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--every", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    print(measure(parse(argv)).render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
