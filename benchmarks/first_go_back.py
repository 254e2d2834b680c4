"""What the first Regenerate after a restore costs, now that a restore leaves the prompt
end's recurrent state in its file (engine.checkpoints.file_bytes).

    python -m benchmarks.first_go_back [--model qwen35-gdn] [--repeats 9] [--folder DIR] [--against TREE]

The answer's files as a crash leaves them (benchmarks.restore_profile's ``chain``: the
prompt's file and three autosaves, at Qwen3-Next's gated delta-net widths by default: 12.6
MB of recurrent state), restored in one process ``--repeats`` times, the files warm; after
each restore, the time of going back to the prompt's end (``Runtime.trim``: the state read
from its file, checked against its CRC, walked, then set), and of going back there again
after one more token (the state now in memory: only the set).  With ``--against TREE``
(another checkout, e.g. the code before), the same in a child process with that tree's
code.  Medians; exits 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import Table, clock, median
from benchmarks.restore_profile import MODELS, ROOT, make_files, model_file


def measure(model: Path | None, chain_head: Path, repeats: int, n_ctx: int, threads: int) -> dict[str, float]:
    """Median ms of the first go-back to the prompt's end after a restore, and of a second."""
    from benchmarks.common import context_settings, model_path
    from engine.checkpoints.chain import load_chain, restoring
    from engine.runtime import Runtime
    rt = Runtime(model or model_path("smollm"), context_settings(n_ctx, threads))
    first, again = [], []
    try:
        for _ in range(repeats):
            rt.trim(0)
            chain = load_chain(chain_head, crc_later=True)
            with restoring(chain):
                conv = rt.restore_chain(chain)
            n = conv.answer.n_prompt_tokens
            started = clock()
            if rt.trim(n) != n:
                raise SystemExit("the restore kept no state at the prompt's end")
            first.append(clock() - started)
            rt.decode_token(conv.tokens[n])
            started = clock()
            rt.trim(n)
            again.append(clock() - started)
    finally:
        rt.close()
    return {"first_ms": median(first) * 1e3, "again_ms": median(again) * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_go_back", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(MODELS), default="qwen35-gdn")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--folder", metavar="DIR", help="make the files here, or use those made there before")
    parser.add_argument("--against", metavar="TREE", type=Path, help="another checkout, measured the same way")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "HEAD"), help=argparse.SUPPRESS)
    parser.add_argument("--n-ctx", type=int, default=2304, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        model = None if args.child[0] == "-" else Path(args.child[0])
        print(json.dumps(measure(model, Path(args.child[1]), args.repeats, args.n_ctx, args.threads)))
        return 0
    # the files where benchmarks.restore_profile --folder makes them (shared with it)
    folder = Path(args.folder) if args.folder else ROOT / "build" / "first-go-back"
    model = model_file(args.model, folder / "models")
    files_folder = folder / model.stem if model else folder
    files_folder.mkdir(parents=True, exist_ok=True)
    files = make_files(files_folder, [2000], args.n_ctx, args.threads, model=model)
    head = files[2000]["chain"][-1]
    table = Table("The first go-back to the prompt's end after a restore (ms, medians, files warm)",
                  ["code", "chain_files", "first_ms", "again_ms", "first_less_again_ms"])
    for name, tree in [("this tree", ROOT), *([("--against", args.against)] if args.against else [])]:
        # this script, the tree's code (its engine, and its benchmarks.common)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(model or "-"), str(head),
               "--repeats", str(args.repeats), "--threads", str(args.threads), "--n-ctx", str(args.n_ctx)]
        env = dict(os.environ, PYTHONPATH=str(tree))
        done = subprocess.run(cmd, cwd=str(tree), env=env, capture_output=True, text=True, timeout=1200)
        if done.returncode:
            raise SystemExit(f"{name}: {done.stderr[-2000:]}")
        got = json.loads(done.stdout.strip().splitlines()[-1])
        table.add(code=name, chain_files=len(files[2000]["chain"]), first_ms=got["first_ms"], again_ms=got["again_ms"],
                  first_less_again_ms=got["first_ms"] - got["again_ms"])
    print(table.render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
