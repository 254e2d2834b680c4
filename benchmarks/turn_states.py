"""Issue 25's last figure: a hybrid conversation of many turns restores from a file per turn
(each holds its turn end's recurrent state, which an Edit of that turn needs); what would one
file per conversation save its restore, and what would it cost its saves?

    python -m benchmarks.turn_states [--model qwen35-4b | --model-path GGUF] [--tokens 2000]
                                     [--turns 12] [--repeats 3] [--folder DIR]

The model (benchmarks.restore_profile's ``--model``, built into ``--folder`` once; default the
hybrid at Qwen3.5-4B's widths: 50 MB of recurrent state) with the app's context settings.
``--tokens`` tokens of prose are cut into ``--turns`` turns and each turn's head is written
by the app's writer (engine.history.LineWriter, a finished answer's head, timed).  A layout
that restores the conversation from one file must still keep every turn end's recurrent
state (no file holding the cells of a turn end can be kept for it without keeping the
cells again and again), so it writes each turn's state at least once more: that write is
timed each turn too (the state as a point carries it, ``Runtime.recurrent_part``, written
and fsynced as the app writes a file, ``atomic_write``) — a lower bound of its extra cost,
which leaves out the head's cells written again.  Then the last head's chain is restored
(every check, warm, in a second context of the same process, median of 5), and the same
tokens from one full file, the most such a layout could save a restore.

The table: per turn, the head's save now and the least one file would add; per
conversation, the restore now and from one file; and how many restores of the conversation
it takes per turn written before one file pays for its writes.  Exits 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import uuid
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import Table, clock, ctx_size_for, median  # noqa: E402


def one_run(rt, reader, tokens: list[int], turns: int, folder: Path) -> dict:
    """Write the turns (timing each head save and one more write of its recurrent state),
    then restore the last head's chain and one full file of the same tokens."""
    from benchmarks.common import warm_restores
    from benchmarks.restore_profile import write_turns
    from engine.checkpoints.atomic import atomic_write
    from engine.checkpoints.format import KIND_PAUSE
    from engine.checkpoints.store import Store
    from engine.history import ChainPolicy, LineWriter
    rt.trim(0)
    rt.ctx.clear()
    store = Store(folder / "store")
    writer = LineWriter(rt, store, uuid.uuid4().hex, policy=ChainPolicy())
    saves: list[float] = []
    extra: list[float] = []
    state_bytes = 0

    def timed(save):
        nonlocal state_bytes
        started = clock()
        info = save()
        saves.append(clock() - started)
        state = rt.recurrent_part()
        if state is None:
            raise SystemExit("this model has no recurrent state")
        state_bytes = state.nbytes
        started = clock()
        with atomic_write(folder / f"state-{len(extra)}.bin") as f:
            f.write(state.data)
        extra.append(clock() - started)
        return info
    head = write_turns(rt, writer, tokens, turns, timed)
    writer.close()
    written = writer.bytes_written
    now_s, files = warm_restores(reader, head.path, rt.kv_tokens)
    full = rt.save(folder / "full.kvckpt", writer_conversation(rt), KIND_PAUSE).path
    one_s, _ = warm_restores(reader, full, rt.kv_tokens)
    return {"files": files, "save_ms": median(saves) * 1e3, "extra_ms": median(extra) * 1e3,
            "written_mb": written / 1e6 / turns, "extra_mb": state_bytes / 1e6,
            "restore_ms": now_s * 1e3, "one_file_ms": one_s * 1e3}


def writer_conversation(rt):
    """A finished conversation of the cache's tokens (a full file of them)."""
    from benchmarks.common import greedy_conversation
    conv = greedy_conversation(list(rt.kv_tokens))
    conv.answer = None
    return conv


def measure(args) -> Table:
    from benchmarks.common import context_settings, prompt_tokens
    from benchmarks.restore_profile import model_file
    from engine.runtime import Runtime
    model = Path(args.model_path) if args.model_path else model_file(args.model, Path(args.folder))
    if model is None:
        raise SystemExit("give a model with a recurrent part")
    settings = context_settings(ctx_size_for(args.tokens), args.threads)
    rt, reader = Runtime(model, settings), Runtime(model, settings)
    runs = []
    try:
        tokens = prompt_tokens(rt.model, args.tokens)
        with tempfile.TemporaryDirectory(prefix="turn-states-") as tmp:
            for r in range(args.repeats):
                (Path(tmp) / str(r)).mkdir()
                runs.append(one_run(rt, reader, tokens, args.turns, Path(tmp) / str(r)))
    finally:
        rt.close()
        reader.close()
    m = {key: median([run[key] for run in runs]) for key in runs[0]}
    saved_ms = m["restore_ms"] - m["one_file_ms"]
    extra_per_conversation = m["extra_ms"] * args.turns
    name = Path(args.model_path).name if args.model_path else args.model
    table = Table(f"A hybrid conversation of {args.turns} turns, {args.tokens:,} tokens ({name}; "
                  f"medians of {args.repeats}; restores warm, in-process)",
                  ["what", "now", "one_file"])
    table.notes.append("now: a file per turn, as the app writes them; one_file: at best (see the docstring)")
    table.add(what="files a restore reads", now=runs[0]["files"], one_file=1)
    table.add(what="restore of the conversation, ms", now=m["restore_ms"], one_file=m["one_file_ms"])
    table.add(what="a turn's head save, ms (MB written)", now=f"{m['save_ms']:.1f} ({m['written_mb']:.1f})",
              one_file=f"+ at least {m['extra_ms']:.1f} (+{m['extra_mb']:.1f})")
    table.add(what="the conversation's saves, ms", now=m["save_ms"] * args.turns,
              one_file=m["save_ms"] * args.turns + extra_per_conversation)
    table.add(what="restores of the conversation before one file pays for its writes", now="",
              one_file=f"{extra_per_conversation / saved_ms:.0f}" if saved_ms > 0 else "never")
    return table


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    for flag, default in (("--tokens", 2000), ("--turns", 12), ("--repeats", 3), ("--threads", 2)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--model", choices=("lfm2-wide", "qwen35-gdn", "qwen35-4b-gdn", "qwen35-4b"),
                        default="qwen35-4b")
    parser.add_argument("--model-path", help="any GGUF with a recurrent part, instead of --model")
    parser.add_argument("--folder", default=str(Path(tempfile.gettempdir()) / "checkpoint-chat-bench-models"),
                        help="where --model is built (once)")
    return parser.parse_args(argv)


if __name__ == "__main__":
    print(measure(parse()).render())
