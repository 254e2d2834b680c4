"""A memory with a recurrent part: what an answer's autosaves leave on disk, and what a
crash in the middle of the answer makes its restore read.

    python -m benchmarks.recurrent_autosaves [--tokens 128] [--every 16] [--repeats 1]
                                             [--model qwen35-gdn|lfm2-wide] [--folder DIR]

Every file of such a memory holds its whole recurrent state, which the next autosave
leaves dead.  Two layouts of the same answer, interleaved run by run: each autosave on the
newest one (``ChainPolicy(fold_dead_tails=False)``, before 2026-12-05's fifteenth session)
and each on the last anchor while the autosaves since hold mostly dead recurrent states
(engine.history.LineWriter._tail_mostly_dead, now).  ``qwen35-gdn``: a random-weight
qwen35 (tests/tinymodels.py) with Qwen3-Next's gated delta-net widths (16 key heads and 32
value heads of 128: 2 MB of recurrent state in each of its 6 delta-net layers), narrow
elsewhere; ``lfm2-wide``: benchmarks.restore_profile's hybrid (LFM2-2.6B's attention, a
small convolution state), where the rule keeps the autosaves on the newest one; ``qwen35``:
the tests' tiny one.  A
~190-token prompt, then ``--tokens`` tokens with an autosave every ``--every``.  For each:
the files and bytes a crash just before the answer's end leaves, the bytes the autosaves
wrote, the restore of the newest autosave's chain (``load_chain`` + ``restore_chain``,
every check; a second context of the same process, warm, median of 5), and the store
after the answer's head.  Prints a table, exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table, add_layout_rows, clock  # noqa: E402

#: (key, label, ChainPolicy's fields)
LAYOUTS = (("newest", "each autosave on the newest (before)", {"fold_dead_tails": False, "tier_autosaves": False}),
           ("anchor", "on the anchor while the tail is mostly dead (now)", {}))
PROMPT = "Write a long story about a lighthouse keeper. " * 20


def model_for(key: str, folder: Path) -> Path:
    from benchmarks.restore_profile import ROOT, model_file
    if key == "qwen35":   # the tests' tiny one (a smoke test's)
        if str(ROOT / "tests") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests"))
        import tinymodels
        return tinymodels.cached("qwen35", folder)
    path = model_file(key, folder)   # lfm2-wide, qwen35-gdn
    assert path is not None
    return path


def one_run(rt, reader, args, policy: dict, folder: Path) -> dict:
    from benchmarks.common import warm_restores
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, generate
    from engine.history import ChainPolicy, LineWriter
    from engine.sampling import SamplerSettings
    rt.trim(0)
    rt.ctx.clear()
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    begin_answer(conv, rt, PROMPT, n_predict=args.tokens)
    writer = LineWriter(rt, Store(folder), uuid.uuid4().hex, policy=ChainPolicy(**policy))
    started = clock()
    generate(rt, conv, autosave=writer, autosave_every=args.every)
    answer_s = clock() - started
    newest = writer.head
    assert newest is not None
    crash_files = sorted(folder.glob("*.kvckpt"))   # what a crash now would leave (landed: .head settles)
    crash_mb = sum(p.stat().st_size for p in crash_files) / 1e6
    restore_s, files = warm_restores(reader, newest.path, rt.kv_tokens[:newest.n_tokens])
    written = writer.bytes_written
    writer.save_head(conv, KIND_MANUAL)
    writer.close()
    return {"crash_files": len(crash_files), "crash_mb": crash_mb,
            "chain": files, "written_mb": written / 1e6, "restore_ms": restore_s * 1e3, "answer_s": answer_s,
            "store_mb": sum(p.stat().st_size for p in folder.glob("*.kvckpt")) / 1e6,
            "state_mb": rt.ctx.state_size(0) / 1e6}


def measure(args) -> Table:
    from benchmarks.common import context_settings, interleaved_layouts
    model = model_for(args.model, Path(args.folder))
    runs = interleaved_layouts(context_settings(1024, args.threads), args.repeats,
                               [(k, label, (args, p)) for k, label, p in LAYOUTS],
                               lambda rt, reader, flag, folder: one_run(rt, reader, flag[0], flag[1], folder),
                               "recurrent-autosaves-", model)
    table = Table(f"An answer of {args.tokens} tokens, an autosave every {args.every} ({args.model}; "
                  f"medians of {args.repeats}; restore warm, in-process)",
                  ["layout", "crash_files", "crash_MB", "chain_files", "written_MB", "restore_ms",
                   "restore_vs_before", "answer_s", "store_after_head_MB", "state_MB"])
    add_layout_rows(table, runs, LAYOUTS, "newest",
                    {"crash_MB": "crash_mb", "written_MB": "written_mb", "restore_ms": "restore_ms",
                     "answer_s": "answer_s", "store_after_head_MB": "store_mb"},
                    {"crash_files": "crash_files", "chain_files": "chain", "state_MB": "state_mb"})
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for flag, default in (("--tokens", 128), ("--every", 16), ("--repeats", 1), ("--threads", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--model", choices=("qwen35-gdn", "lfm2-wide", "qwen35"), default="qwen35-gdn")
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "checkpoint-chat-bench-models"),
                        help="where the model is built (once)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(measure(parse()).render())
