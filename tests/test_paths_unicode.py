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


def test_json_output_survives_a_cp1252_pipe():
    """Windows writes pipes in the ANSI code page: `list --json` of a Chinese folder crashed."""
    import io

    from engine.cli.output import print_json, tolerate_unencodable
    value = {"path": "C:\\\u68c0\u67e5\u70b9\\\u5bf9\u8bdd.kvckpt", "text": "ça va \U0001f409"}
    pipe = io.TextIOWrapper(io.BytesIO(), encoding="cp1252", newline="\n")
    print_json(value, stream=pipe, indent=2)
    pipe.flush()
    assert json.loads(pipe.buffer.getvalue().decode("cp1252")) == value
    # what fits cp1252 too is written as ASCII escapes: JSON's readers read UTF-8 ("Zoë" was
    # one cp1252 byte that jq could not decode, under Wine)
    latin = io.TextIOWrapper(io.BytesIO(), encoding="cp1252", newline="\n")
    print_json({"path": "C:\\Users\\Zoë Müller"}, stream=latin)
    latin.flush()
    assert json.loads(latin.buffer.getvalue().decode("utf-8")) == {"path": "C:\\Users\\Zoë Müller"}
    utf8 = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", newline="\n")
    print_json(value, stream=utf8)
    utf8.flush()
    assert "\u68c0\u67e5\u70b9" in utf8.buffer.getvalue().decode("utf-8")   # readable where it can be
    tolerate_unencodable(pipe)
    print("saved to \u68c0\u67e5\u70b9", file=pipe)
    pipe.flush()
    assert pipe.buffer.getvalue().decode("cp1252").endswith("saved to \\u68c0\\u67e5\\u70b9\n")
    # what Windows really gives a piped or redirected stdout: surrogateescape, not strict (an
    # answer's first Devanagari letter raised there, found under Wine)
    windows = io.TextIOWrapper(io.BytesIO(), encoding="cp1252", errors="surrogateescape", newline="\n")
    tolerate_unencodable(windows, windows=True)
    windows.write("नदी \u2514 ok")
    windows.flush()
    assert windows.buffer.getvalue().decode("cp1252") == "\\u0928\\u0926\\u0940 \\u2514 ok"
    # a UTF-8 locale's surrogateescape elsewhere writes a path's undecodable bytes back as they were
    linux = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="surrogateescape", newline="\n")
    tolerate_unencodable(linux, windows=False)
    linux.write("caf\udce9")
    linux.flush()
    assert linux.buffer.getvalue() == b"caf\xe9"


def test_list_and_tree_survive_a_pipe_in_the_consoles_code_page(tmp_path):
    """Windows gives a piped stdout the ANSI code page with surrogateescape: the └ of
    `list` and `inspect --tree` raised there (a user's test under Wine; a run's answer with
    such a character was lost the same way).  run_cli pipes stdout as a user's `| more` does."""
    import uuid

    from faultkit import synthetic

    from engine.checkpoints.format import KIND_PAUSE
    from engine.checkpoints.store import Store
    store = Store(tmp_path / "检查点")
    store.ensure()
    conv = uuid.uuid4()
    base = synthetic.write_node(store.new_autosave_path(conv), conv, 40)
    head = synthetic.write_node(store.new_path("head"), conv, 48, parent=base, kind=KIND_PAUSE)
    for args in (("list", "--dir", str(store.folder)), ("inspect", str(head.path), "--tree")):
        done = run_cli(*args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        assert "└" in done.stdout or "\\u2514" in done.stdout, done.stdout
