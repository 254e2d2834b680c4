"""The five ways the first round's store lost crash recovery or left litter (issue 9),
each reproduced as a user meets it: a real SmolLM2 run killed mid-answer, then the app's
engine thread (engine.worker) and the CLI on that store.  Each test failed on the first
round's code; the window's cases (delete, drop) are in test_gui_window.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, run_cli
from enginekit import Recorder

from engine.checkpoints.format import KIND_AUTOSAVE, KIND_PAUSE, read_header
from engine.checkpoints.store import Store
from engine.sampling import SamplerSettings
from engine.worker import EngineWorker, ModelOptions

RUN = ["-p", "Write a long poem about the moon.", "--seed", "3", "--temp", "0.8",
       "--ctx-size", "1024", "--ignore-eos", "--threads", "2"]


@pytest.fixture(scope="module")
def crashed_store(tmp_path_factory, smollm_path):
    """A store holding what a run killed (SIGKILL) after five autosaves leaves behind."""
    home = tmp_path_factory.mktemp("crashed-home")
    env = dict(os.environ, CHECKPOINT_CHAT_HOME=str(home))
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", "-m", str(smollm_path), *RUN,
                             "-n", "400", "--checkpoint-save-interval", "8"], cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    store = home / "data" / "checkpoints"
    deadline = time.monotonic() + 600   # generous: a loaded 2-core machine is slow, not wrong
    while len(list(store.glob("autosave-*.kvckpt"))) < 5:
        assert time.monotonic() < deadline and proc.poll() is None, "no autosaves appeared"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return store


def _copy_store(crashed: Path, app_home: Path) -> tuple[Store, Path]:
    """The crashed store as this test's app store; returns it and the newest autosave."""
    target = app_home / "data" / "checkpoints"
    shutil.copytree(crashed, target)
    newest = max(target.glob("autosave-*.kvckpt"), key=lambda p: read_header(p).created_unix_ns)
    return Store(target), newest


def _continue_uninterrupted(n_done: int, n_more: int) -> str:
    full = json.loads(run_cli("run", *RUN, "-n", str(n_done + n_more), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    return full["text"]


@pytest.fixture
def engine(smollm_path):
    made = []

    def start(store: Store) -> tuple[EngineWorker, Recorder]:
        rec = Recorder()
        w = EngineWorker(rec, store)
        w.start()
        w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2))
        rec.wait("loaded")
        made.append(w)
        return w, rec

    yield start
    for w in made:
        w.shutdown()
        assert w.join(120)


def test_1_a_store_over_budget_keeps_a_killed_answers_chain(crashed_store, app_home, engine):
    store, newest = _copy_store(crashed_store, app_home)
    k = read_header(newest).n_generated
    # the app runs another conversation with autosaves under a budget of one byte
    w, rec = engine(store)
    w.autosave_every, w.autosave_budget = 4, 1
    other = w.new_conversation(sampler=SamplerSettings(seed=9))
    w.send(other, "Name three rivers.", n_predict=12)
    rec.wait("finished")
    w.shutdown()
    assert w.join(120)
    # the killed answer still validates and resumes exactly where it stopped
    done = run_cli("validate", str(newest))
    assert done.returncode == 0, done.stderr
    rest = json.loads(run_cli("run", "--checkpoint-load", str(newest), "-n", str(k + 8), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    # a killed answer's autosave carries no logits: its last token, a generated one, is
    # decoded again, alone (engine.runtime.logits_rule); nothing before it is
    assert rest["n_reused_tokens"] == rest["n_prompt_tokens"] - 1
    transcript = json.loads(run_cli("inspect", str(newest), "--json", check=True).stdout)["transcript"]
    assert transcript[-1]["content"] + rest["text"] == _continue_uninterrupted(k, 8)


def test_2_resuming_a_crash_chain_and_pausing_leaves_one_head_and_no_litter(
        crashed_store, app_home, engine):
    store, newest = _copy_store(crashed_store, app_home)
    conv_id = read_header(newest).conversation_id
    w, rec = engine(store)
    w.open_checkpoint(newest)
    rec.wait("changed")
    w.resume(conv_id, n_predict=10_000)
    rec.wait("text", 3)
    w.pause()
    rec.wait("finished")
    saved = rec.wait("saved")[-1]
    assert saved[3] == KIND_PAUSE
    listing = json.loads(run_cli("list", "--json", check=True).stdout)
    mine = [e for e in listing if e["conversation"] == str(conv_id)]
    heads = [e for e in mine if e["head"]]
    assert len(heads) == 1, heads
    head = heads[0]
    assert head["header"]["kind"] == "pause" and Path(head["path"]) == Path(saved[2])
    # the pause is a new file under its own name, never written over an autosave's
    assert not Path(head["path"]).name.startswith("autosave-")
    assert all(e["header"]["kind"] == "autosave" for e in mine if Path(e["path"]).name.startswith("autosave-"))
    # every file of the conversation is one the head needs: nothing left behind
    assert {Path(e["path"]).name for e in mine} == set(head["chain"])
    assert len(head["chain"]) <= 16


def test_4_switching_back_to_a_conversation_restores_its_whole_chain(crashed_store, app_home, engine):
    store, newest = _copy_store(crashed_store, app_home)
    header = read_header(newest)
    assert header.is_delta                     # the newest file of the crash is a delta
    w, rec = engine(store)
    w.open_checkpoint(newest)
    rec.wait("changed")
    other = w.new_conversation(sampler=SamplerSettings(seed=2))
    w.send(other, "Say hello.", n_predict=4)   # the cache now holds another conversation
    rec.wait("finished")
    w.resume(header.conversation_id, n_predict=header.n_generated + 4)
    summary = rec.wait("finished", 2)[-1][1]
    assert summary.conversation_id == header.conversation_id
    # the crash's newest file is an autosave: only its last token is decoded again
    assert summary.n_reused_tokens == summary.n_prompt_tokens - 1, "the prompt was decoded again"
    assert not rec.of("error"), rec.of("error")


def test_5_a_delta_imported_alone_is_refused_with_the_way_out(crashed_store, tmp_path):
    from engine.checkpoints import transfer
    from engine.checkpoints.chain import load_chain
    newest = max(crashed_store.glob("autosave-*.kvckpt"), key=lambda p: read_header(p).created_unix_ns)
    store = Store(tmp_path / "other machine")
    (alone,) = transfer.import_files([newest], store)
    assert alone.imported is None and "parent" in alone.reason
    assert alone.chain_folder == crashed_store and store.files() == []
    results = transfer.import_files(transfer.chain_paths(newest), store)
    assert all(r.ok for r in results)
    assert len(load_chain(store.folder / newest.name)) == len(results)
    assert read_header(store.folder / newest.name).kind == KIND_AUTOSAVE
