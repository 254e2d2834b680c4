"""How often a long story repeats itself under candidate default samplers (bundled model).

    python benchmarks/sampling_defaults.py [--tokens 900] [--seeds 1 2]

For each candidate, the share of word 6-grams that repeat an earlier one in a story of
``--tokens`` tokens (end-of-generation ignored, so the whole length is written), per
seed.  0 is no repetition; loops show as 0.3 and more.  Prints a table, exits 0.  The
winner is engine.sampling.BUNDLED_MODEL_DEFAULTS.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a long story about a lighthouse keeper."
CANDIDATES = {
    "0.8, top-p 0.95, no penalty (first round)": ["--temp", "0.8", "--top-p", "0.95", "--repeat-penalty", "1.0"],
    "0.2, top-p 0.9 (the model card's example)": ["--temp", "0.2", "--top-p", "0.9", "--repeat-penalty", "1.0"],
    "0.2, top-p 0.9, penalty 1.1": ["--temp", "0.2", "--top-p", "0.9", "--repeat-penalty", "1.1"],
    "0.7, top-p 0.9, penalty 1.1 (chosen)": ["--temp", "0.7", "--top-p", "0.9", "--repeat-penalty", "1.1"],
}


def repeated_share(text: str, n: int = 6) -> float:
    words = text.split()
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    counts = collections.Counter(grams)
    return sum(c - 1 for c in counts.values() if c > 1) / max(1, len(grams))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=900)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args(argv)
    print(f"| sampler | repeated 6-grams per seed ({args.tokens} tokens, seeds {args.seeds}) |")
    print("|---|---|")
    for name, flags in CANDIDATES.items():
        shares = []
        for seed in args.seeds:
            done = subprocess.run([sys.executable, "-m", "engine.cli", "run", "-p", PROMPT, "-n",
                                   str(args.tokens), "--ignore-eos", "--seed", str(seed), "--json",
                                   "--repeat-last-n", "64", *flags],
                                  capture_output=True, text=True, cwd=str(ROOT))
            text = json.loads(done.stdout.strip().splitlines()[-1])["text"] if done.returncode == 0 else ""
            shares.append(f"{repeated_share(text):.2f}" if text else "failed")
        print(f"| {name} | {' / '.join(shares)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
