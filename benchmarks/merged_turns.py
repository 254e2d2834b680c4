"""What a conversation of many turns costs its saves and saves its restore, when each
turn's head goes on a file absorbing the turns before it (up to 32 MiB, then in tiers) vs
a file per turn.

    python -m benchmarks.merged_turns [--tokens 2000] [--turns 12] [--repeats 3]
                                      [--model smollm|lfm2-wide|llama-8b-kv|qwen35-gdn|qwen35-4b-gdn] [--folder DIR]

SmolLM2 (``--model lfm2-wide``, ``llama-8b-kv``: benchmarks.restore_profile's models,
built into ``--folder`` once) with the app's context settings.  ``--tokens`` tokens of prose are cut into
``--turns`` turns; each turn is decoded and its head written by the app's writer
(engine.history.LineWriter, a finished answer's head) on a line in a fresh store, in two
layouts, interleaved run by run: a file per turn (``ChainPolicy(merge_turns=False)``,
before 2026-12-04), merged up to 32 MiB only (``tier_max_bytes=0``, before 2026-12-05's
fourteenth session) and merged, then in tiers (now).  For each: the files the last head's chain holds, the
bytes all the head saves wrote and the most one wrote (a merged file and the head), the
slowest head save (writes, fsyncs, retiring what was absorbed), the store's bytes after the last turn, and
the restore of the last head's chain (``load_chain`` + ``Runtime.restore_chain``, every
check; in a second context of the same process, warm, median of 5).  Prints a table,
exits 0.  ``benchmarks.restore_profile`` times the same two layouts in new processes,
beside llama.cpp's own load.
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
LAYOUTS = (("each", "a file per turn", {"merge_turns": False}),
           ("capped", "merged up to 32 MiB (before)", {"tier_max_bytes": 0}),
           ("merged", "merged, then in tiers (now)", {}))


def one_run(rt, reader, tokens: list[int], turns: int, policy: dict, folder: Path) -> dict:
    from benchmarks.common import warm_restores
    from benchmarks.restore_profile import write_turns
    from engine.checkpoints.store import Store
    from engine.history import ChainPolicy, LineWriter
    rt.trim(0)
    rt.ctx.clear()
    writer = LineWriter(rt, Store(folder), uuid.uuid4().hex, policy=ChainPolicy(**policy))
    saves, sizes = [], []

    def timed(save):
        started, written = clock(), writer.bytes_written
        info = save()
        saves.append(clock() - started)
        sizes.append(writer.bytes_written - written)   # a merged file's bytes too
        return info
    head = write_turns(rt, writer, tokens, turns, timed)
    writer.close()
    restore_s, files = warm_restores(reader, head.path, rt.kv_tokens)
    return {"files": files, "written_mb": sum(sizes) / 1e6,
            "largest_mb": max(sizes) / 1e6, "slowest_save_ms": max(saves) * 1e3,
            "store_mb": sum(p.stat().st_size for p in folder.glob("*.kvckpt")) / 1e6,
            "restore_ms": restore_s * 1e3}


def measure(args) -> Table:
    """Both layouts, interleaved run by run; the table (see the module docstring)."""
    from benchmarks.common import context_settings, interleaved_layouts, prompt_tokens
    tokens: list[int] = []

    def run(rt, reader, policy: dict, folder: Path) -> dict:
        tokens[:] = tokens or prompt_tokens(rt.model, args.tokens)   # tokenized once, by the first run
        return one_run(rt, reader, tokens, args.turns, policy, folder)
    from benchmarks.restore_profile import model_file
    model = model_file(args.model, Path(args.folder))
    runs = interleaved_layouts(context_settings(ctx_size_for(args.tokens), args.threads), args.repeats,
                               LAYOUTS, run, "merged-turns-", model)
    table = Table(f"A conversation of {args.turns} turns, {args.tokens:,} tokens ({args.model}; medians of "
                  f"{args.repeats}; restore warm, in-process)",
                  ["layout", "files", "written_MB", "largest_save_MB", "slowest_save_ms", "store_MB",
                   "restore_ms", "restore_vs_before"])
    add_layout_rows(table, runs, LAYOUTS, "each",
                    {"written_MB": "written_mb", "largest_save_MB": "largest_mb",
                     "slowest_save_ms": "slowest_save_ms", "store_MB": "store_mb", "restore_ms": "restore_ms"},
                    {"files": "files"})
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for flag, default in (("--tokens", 2000), ("--turns", 12), ("--repeats", 3), ("--threads", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--model", choices=("smollm", "lfm2-wide", "llama-8b-kv", "qwen35-gdn", "qwen35-4b-gdn"),
                        default="smollm")
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "checkpoint-chat-bench-models"),
                        help="where --model lfm2-wide or llama-8b-kv is built (once)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(measure(parse()).render())
