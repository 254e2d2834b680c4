"""What ``checkpoint-chat run --json`` reports as its timings, fresh and resumed (issue 13).

    python -m benchmarks.cli_timings [--tokens 2048] [--model smollm] [--root DIR]

Three runs of the real CLI, each in its own process: a fresh run that prefills a long
prompt and pauses after a few tokens (saving a checkpoint), the same checkpoint resumed,
and the checkpoint continued with a new message.  For each it prints what the JSON says
(``ttft_s``, ``restore_s``, ``prefill_s``) next to ``wall_s``, the whole process as
timed from outside (interpreter start, model load and exit included), so that a time to
first token which leaves out what the user waited for stands out.  ``--root`` runs the
CLI of another checkout (for before/after tables).  Exits 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import MODEL_KEYS, Table, model_path, prompt_text  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def table() -> Table:
    return Table("run --json timings: fresh, resumed, continued with a new message (s)",
                 ["run", "n_prompt", "n_reused", "ttft_s", "restore_s", "prefill_s", "wall_s",
                  "ttft_ge_restore"])


def _run(root: Path, args: list[str], home: Path) -> tuple[dict, float]:
    env = dict(os.environ, CHECKPOINT_CHAT_HOME=str(home))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "engine.cli", "run", *args, "--json", "--threads", "2"],
                          cwd=str(root), capture_output=True, text=True, env=env)
    wall = time.perf_counter() - started
    if done.returncode not in (0,):
        raise SystemExit(f"checkpoint-chat run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), wall


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cli_timings", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2048, help="approximate prompt length")
    ap.add_argument("--model", default="smollm", choices=MODEL_KEYS)
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose CLI runs")
    args = ap.parse_args(argv)
    out = table()
    path = model_path(args.model)
    prompt = prompt_text(max(4, args.tokens // 40))
    with tempfile.TemporaryDirectory(prefix="cli-timings-") as tmp:
        home, ckpt = Path(tmp) / "home", Path(tmp) / "paused.kvckpt"
        common = ["-m", str(path), "--seed", "1", "--temp", "0"]   # a resumed run takes n_ctx from the file
        n_ctx = -(-(args.tokens + 512) // 256) * 256
        runs = [("fresh", [*common, "-p", prompt, "-n", "64", "--stop-after", "4", "--ignore-eos",
                           "--ctx-size", str(n_ctx), "--checkpoint-save", str(ckpt)]),
                ("resumed", [*common, "--checkpoint-load", str(ckpt), "-n", "8"]),
                ("new message", [*common, "--checkpoint-load", str(ckpt), "-p", "And then?", "-n", "4"])]
        for name, run_args in runs:
            result, wall = _run(args.root, run_args, home)
            ttft, restore = result.get("ttft_s"), result.get("restore_s")
            out.add(run=name, n_prompt=result.get("n_prompt_tokens"), n_reused=result.get("n_reused_tokens"),
                    ttft_s=ttft, restore_s=restore, prefill_s=result.get("prefill_s"), wall_s=wall,
                    ttft_ge_restore=None if ttft is None or restore is None else ttft >= restore)
    out.notes.append(f"{args.model}, 2 threads, CLI of {args.root}; wall_s includes interpreter start and "
                     "model load, which ttft_s leaves out by definition; n/a: the field is not reported")
    print(out.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
