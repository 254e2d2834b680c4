"""Checkpoint paths with non-ASCII characters work end to end."""

from __future__ import annotations

import json

from conftest import run_cli


def test_checkpoint_in_non_ascii_folder(smollm_path, tmp_path):
    folder = tmp_path / "检查点" / "用户 文档 🐉"
    folder.mkdir(parents=True)
    path = folder / "对话.kvckpt"
    run_cli("run", "-m", str(smollm_path), "-p", "Bonjour, ça va ?", "-n", "10", "--stop-after", "4",
            "--temp", "0", "--ctx-size", "512", "--checkpoint-save", str(path), check=True)
    assert path.is_file()
    assert run_cli("validate", str(path), "--model", str(smollm_path)).returncode == 0
    listed = json.loads(run_cli("list", "--dir", str(folder), "--json", check=True).stdout)
    assert [e["path"] for e in listed] == [str(path)]
    resumed = json.loads(run_cli("run", "--checkpoint-load", str(path), "--json",
                                 check=True).stdout.strip().splitlines()[-1])
    assert resumed["n_generated"] == 6
