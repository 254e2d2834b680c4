"""benchmarks/parallel.py runs end to end with --quick and prints its tables (no timing judged)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT


def test_the_parallel_benchmark_runs_and_prints_its_tables(smollm_path, tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.parallel", "--quick"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "CHECKPOINT_CHAT_HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert "a. Aggregate generation tokens/s" in out and "ours_vs_bare" in out
    for answers in (1, 2, 4):
        assert any(line.split()[:1] == [str(answers)] for line in out.splitlines()), answers
    assert "restored from its file" in out and "resident" in out and "packed again" in out
    assert "q8_0 + flash attn     joint" in out and "exact_width" in out
