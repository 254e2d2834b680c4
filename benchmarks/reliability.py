"""Reliability figures for issue 4: break checkpoints on purpose, many times, and count.

    python benchmarks/reliability.py          # the suite-sized campaigns (about two minutes)
    python benchmarks/reliability.py --soak   # the long ones: 2,000 kills, 4 x 500 saves, ...

Prints one table (cases, runs, kills, corrupt files tried, concurrent operations,
checkpoints lost, crashes) and exits 0 when no checkpoint was lost and nothing crashed,
1 otherwise (what went wrong goes to stderr).  POSIX only (SIGKILL and fork).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

SIZES = {   # suite-sized, soak
    "kills": (220, 2000), "model_kills": (4, 20), "flips": (2000, 20000),
    "disk": (200, 2000), "windows": (60, 300), "writers": (3, 4), "saves": (160, 500),
    "fuzz": (2000, 50000), "compositions": (4, 40),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--soak", action="store_true", help="run the long versions")
    parser.add_argument("--no-models", action="store_true",
                        help="skip the cases that load SmolLM2 and Gemma 3")
    args = parser.parse_args(argv)
    pick = 1 if args.soak else 0
    n = {k: v[pick] for k, v in SIZES.items()}

    with tempfile.TemporaryDirectory(prefix="reliability-") as tmp:
        work = Path(tmp)
        os.environ["CHECKPOINT_CHAT_HOME"] = str(work / "home")
        from faultkit import figures
        from faultkit.zygote import Zygote
        started = time.monotonic()
        with Zygote() as zygote:
            rows = [figures.killed_writer(work, n["kills"], zygote)]
            if not args.no_models:
                rows.append(figures.killed_model_writer(work, n["model_kills"], zygote))
            rows += [figures.truncation_and_flips(work, n["flips"]), figures.hostile_headers(work)]
            if not args.no_models:
                rows.append(figures.foreign_and_mismatched())
            rows += [figures.disk_trouble(work, n["disk"]), figures.windows_replace(work, n["windows"]),
                     figures.concurrency(work, n["writers"], n["saves"], zygote),
                     figures.fuzz(work, n["fuzz"])]
        composed = None if args.no_models else figures.composition(work, n["compositions"])
        elapsed = time.monotonic() - started

    print_table(rows, "soak" if args.soak else "suite-sized", elapsed)
    if composed is not None:
        print_compositions(composed)
    for row in rows + ([composed] if composed else []):
        for problem in row.problems[:5]:
            print(f"{row.case}: {problem}", file=sys.stderr)
    ok = all(r.lost == 0 and r.crashes == 0 for r in rows)
    ok = ok and (composed is None or (composed.heads_lost == 0 and composed.orphans == 0
                                      and not composed.problems))
    return 0 if ok else 1


def print_compositions(row) -> None:
    """The store's graph under random user sequences (heads lost and orphans must be 0)."""
    head = ("Case", "Sequences", "Actions", "Kills", "Heads checked", "Heads lost", "Orphans left")
    cells = (row.case, row.sequences, row.actions, row.kills, row.heads_checked, row.heads_lost,
             row.orphans)
    print()
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    print("| " + " | ".join(str(c) for c in cells) + " |")


def print_table(rows, mode: str, elapsed: float) -> None:
    head = ("Case", "Runs", "Kills", "Corrupt files tried", "Concurrent ops",
            "Checkpoints lost", "Crashes")
    total = ("Total", sum(r.runs for r in rows), sum(r.kills for r in rows),
             sum(r.corrupt for r in rows), sum(r.concurrent for r in rows),
             sum(r.lost for r in rows), sum(r.crashes for r in rows))
    body = [(r.case, r.runs, r.kills, r.corrupt, r.concurrent, r.lost, r.crashes) for r in rows]
    print(f"Checkpoint Chat reliability ({mode}, {elapsed:.0f} s)\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for line in body + [total]:
        cells = [str(line[0])] + [f"{v:,}" if v else "0" for v in line[1:]]
        if line is total:
            cells = [f"**{c}**" for c in cells]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
