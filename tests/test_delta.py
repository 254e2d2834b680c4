"""Delta checkpoints: O(new tokens) autosaves that restore exactly what a full one would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import ROOT, run_cli
from faultkit import corrupt

from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import HEADER_LEN, KIND_PAUSE, read_header
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import BrokenChain
from engine.generation import begin_answer, generate
from engine.history import ChainPolicy, LineWriter
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from native.context import ContextSettings

LONG = "Here is a long and winding passage about rivers, hills and old towns. " * 60


def _conversation(runtime, text: str) -> Conversation:
    conv = Conversation(sampler=SamplerSettings(temperature=0.8, seed=77, ignore_eos=True))
    begin_answer(conv, runtime, text, n_predict=48)
    return conv


def _autosaved_answer(runtime, folder, *, stop_after: int):
    """The whole answer's text (the reference), then the same answer again from an empty
    cache, autosaved every 8 tokens on a line in ``folder`` and stopped after ``stop_after``
    tokens: (reference, conversation, its LineWriter, the part generated)."""
    # the prompt is longer than Gemma 3's 512-token window, so its ring wraps
    reference = generate(runtime, _conversation(runtime, LONG)).text
    runtime.trim(0)
    conv = _conversation(runtime, LONG)
    saver = LineWriter(runtime, Store(folder), "line")
    part = generate(runtime, conv, autosave=saver, autosave_every=8, stop_after=stop_after)
    return reference, conv, saver, part


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_chain_restores_exactly(model, request, tmp_path):
    """Autosave deltas every 8 tokens; resume from the chain in a fresh context."""
    path = request.getfixturevalue(f"{model}_path")
    settings = ContextSettings(n_ctx=2048, n_threads=2)
    first = Runtime(path, settings)
    try:
        # a full file after 8 tokens, then the autosaves after 16, 24 and 32, the 24th absorbing
        # the 16th (it held no more tokens of its own: LineWriter._tier_below)
        reference, conv, saver, part = _autosaved_answer(first, tmp_path, stop_after=32)
        assert [info.n_tokens - info.parent_n_tokens for info in saver.chain[1:]] == [16, 8]
        assert [info.delta for info in saver.chain] == [False, True, True]
        full_size = saver.chain[0].size
        assert all(info.size < full_size / 4 for info in saver.chain[1:]), "deltas are not small"
        latest = saver.head.path
    finally:
        first.close()
    second = Runtime(path, settings)
    try:
        chain = load_chain(latest)
        assert len(chain) == 3
        # an autosave of a plain attention model carries no logits (engine.runtime.logits_rule):
        # its last token, a generated one, is decoded again, alone, as it was the first time
        assert not chain[-1].header.has_logits
        resumed = second.restore_chain(chain)
        rest = generate(second, resumed)
        assert rest.n_reused_tokens == rest.n_prompt_tokens - 1
        assert part.text + rest.text == reference
    finally:
        second.close()


@pytest.mark.parametrize("model", ["smollm", "gemma"])
def test_a_pause_folds_its_answers_autosaves_into_one_file(model, request, tmp_path):
    """The head an answer's stop writes goes on the last anchor, not on the newest autosave:
    a restore then reads one file for the answer, and the autosaves are retired."""
    path = request.getfixturevalue(f"{model}_path")
    settings = ContextSettings(n_ctx=2048, n_threads=2)
    first = Runtime(path, settings)
    try:
        reference, conv, saver, part = _autosaved_answer(first, tmp_path, stop_after=32)
        autosaves = [info.path for info in saver.chain]
        assert len(autosaves) == 3   # a full file (its base: an anchor), then 2 deltas (16 and 8 tokens)
        head = saver.save_head(conv, KIND_PAUSE)
        logits_at_pause = first.logits().copy()
        assert [info.path for info in saver.chain] == [autosaves[0], head.path]
        assert not any(p.exists() for p in autosaves[1:]), "the folded autosaves were not retired"
    finally:
        first.close()
    second = Runtime(path, settings)
    try:
        chain = load_chain(head.path)
        assert [d.path for d in chain] == [autosaves[0], head.path]
        resumed = second.restore_chain(chain)
        assert np.array_equal(second.logits(), logits_at_pause)
        rest = generate(second, resumed)
        assert rest.n_reused_tokens == rest.n_prompt_tokens   # the pause kept its logits
        assert part.text + rest.text == reference
    finally:
        second.close()


def test_broken_chains_are_refused_with_reason(smollm_runtime, tmp_path):
    rt = smollm_runtime
    rt.trim(0)
    conv = _conversation(rt, "Tell me about owls.")
    saver = LineWriter(rt, Store(tmp_path), "line")
    generate(rt, conv, autosave=saver, autosave_every=4, stop_after=16)
    base, middle, last = (info.path for info in saver.chain)

    middle_bytes = middle.read_bytes()
    middle.unlink()
    with pytest.raises(BrokenChain, match="missing"):
        load_chain(last)
    middle.write_bytes(middle_bytes[:-10] + bytes(10))
    with pytest.raises(BrokenChain, match="damaged"):
        load_chain(last)
    middle.write_bytes(middle_bytes)

    # a different base under the same name: linked by id and CRC, so it is noticed
    other = LineWriter(rt, Store(tmp_path / "other"), "line")
    rt.trim(0)
    generate(rt, _conversation(rt, "Tell me about owls."), autosave=other, autosave_every=4, stop_after=4)
    base.write_bytes(other.chain[0].path.read_bytes())
    kv_before = list(rt.kv_tokens)
    with pytest.raises(BrokenChain, match="replaced or altered"):
        rt.restore_chain(load_chain(last))
    assert rt.kv_tokens == kv_before, "a refused chain touched the cache"
    done = run_cli("validate", str(last))
    assert done.returncode == 1 and "replaced or altered" in done.stderr

    # a delta that names itself as its parent (resealed: its checksum is right)
    raw = last.read_bytes()
    meta_len = corrupt.header_fields(raw)["meta_len"]
    meta = json.loads(raw[HEADER_LEN:HEADER_LEN + meta_len])
    meta["parent"]["file"] = last.name
    new_meta = json.dumps(meta).encode()
    last.write_bytes(corrupt.with_payload_crc(corrupt.with_header(raw[:HEADER_LEN], meta_len=len(new_meta))
                                              + new_meta + raw[HEADER_LEN + meta_len:]))
    with pytest.raises(BrokenChain, match="loops back"):
        load_chain(last)


def test_crash_loses_at_most_the_autosave_interval(smollm_path, app_home, tmp_path):
    """SIGKILL mid-generation: the last delta in the store resumes the same text."""
    common = ["-m", str(smollm_path), "-p", "Write a long poem about the moon.", "--seed", "3",
              "--temp", "0.8", "--ctx-size", "1024", "--ignore-eos", "--threads", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", *common, "-n", "400",
                             "--checkpoint-save-interval", "16"], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ))
    store = app_home / "data" / "checkpoints"
    deadline = time.monotonic() + 600   # generous: a loaded 2-core machine is slow, not wrong
    while len(list(store.glob("autosave-*.kvckpt"))) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, "no autosaves appeared"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    files = sorted(store.glob("autosave-*.kvckpt"))
    latest = files[-1]
    header = json.loads(run_cli("inspect", str(latest), "--json", check=True).stdout)["header"]
    assert header["kind"] == "autosave"
    k = header["n_generated"]
    assert k % 16 == 0 and k >= 32
    assert run_cli("validate", str(latest)).returncode == 0
    rest = json.loads(run_cli("run", "--checkpoint-load", str(latest), "-n", str(k + 10), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    # an autosave carries no logits: only its last token, a generated one, is decoded again
    assert rest["n_reused_tokens"] == rest["n_prompt_tokens"] - 1
    full = json.loads(run_cli("run", *common, "-n", str(k + 10), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    transcript = json.loads(run_cli("inspect", str(latest), "--json", check=True).stdout)["transcript"]
    assert transcript[-1]["content"] + rest["text"] == full["text"]

    compacted = tmp_path / "merged.kvckpt"
    done = run_cli("compact", str(latest), "-o", str(compacted), check=True)
    assert "merged" in done.stdout
    again = json.loads(run_cli("run", "--checkpoint-load", str(compacted), "-n", str(k + 10), "--json",
                               check=True).stdout.strip().splitlines()[-1])
    assert again["text"] == rest["text"]


def test_autosave_to_a_named_file_writes_deltas_beside_it(smollm_path, app_home, tmp_path):
    """--checkpoint-save P with an interval: small deltas in a hidden folder beside P while
    generating, P written once, whole, at the end; killed midway, the newest autosave
    beside P is named when P is loaded, and it continues the answer."""
    target = tmp_path / "story.kvckpt"
    common = ["-m", str(smollm_path), "-p", "Write a long poem about the sea.", "--seed", "5", "--temp", "0.8",
              "--ctx-size", "1024", "--ignore-eos", "--threads", "2"]
    done = run_cli("run", *common, "-n", "40", "--checkpoint-save", str(target),
                   "--checkpoint-save-interval", "8", "--json", check=True)
    assert json.loads(done.stdout.strip().splitlines()[-1])["checkpoint"] == str(target)
    assert load_chain(target)[-1].header.n_generated == 40 and len(load_chain(target)) == 1
    assert not (tmp_path / ".story.kvckpt.autosaves").exists()     # folded into P, then removed

    killed = tmp_path / "killed.kvckpt"
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "run", *common, "-n", "400",
                             "--checkpoint-save", str(killed), "--checkpoint-save-interval", "8"],
                            cwd=str(ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ))
    beside = tmp_path / ".killed.kvckpt.autosaves"
    deadline = time.monotonic() + 600
    while len(list(beside.glob("*.kvckpt"))) < 4:
        assert time.monotonic() < deadline and proc.poll() is None, "no autosaves appeared beside it"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert not killed.exists()                                       # never rewritten while generating
    files = sorted(beside.glob("*.kvckpt"))
    # small deltas on one base, not whole files (how many are there at the kill depends on
    # its moment: each autosave absorbs the ones in the tier below it, retired once it landed)
    deltas = [p for p in files if read_header(p).is_delta]
    assert deltas and len(files) - len(deltas) == 1
    newest = max(files, key=lambda p: read_header(p).n_tokens)
    k = read_header(newest).n_generated
    rest = json.loads(run_cli("run", "--checkpoint-load", str(newest), "-n", str(k + 6), "--json",
                              check=True).stdout.strip().splitlines()[-1])
    # an autosave carries no logits: only its last token, a generated one, is decoded again
    assert rest["n_reused_tokens"] == rest["n_prompt_tokens"] - 1
    full = json.loads(run_cli("run", *common, "-n", str(k + 6), "--json", check=True).stdout.strip().splitlines()[-1])
    transcript = json.loads(run_cli("inspect", str(newest), "--json", check=True).stdout)["transcript"]
    assert transcript[-1]["content"] + rest["text"] == full["text"]

    # a later run saving to the same P removes only its own autosaves: the crashed run's,
    # which loading P points at, stay
    run_cli("run", *common, "-n", "12", "--checkpoint-save", str(killed), "--checkpoint-save-interval", "8",
            check=True)
    assert killed.exists() and set(files) <= set(beside.glob("*.kvckpt"))


class _HeldLanding:
    """A Landing whose saves land only when settled: the test decides when."""

    def __init__(self) -> None:
        self.finish = None
        self.after = []

    @property
    def in_flight(self) -> bool:
        return self.finish is not None

    def submit(self, finish) -> None:
        self.settle()
        self.finish = finish

    def then(self, step) -> None:
        assert self.finish is not None
        self.after.append(step)

    def settle(self):
        finish, self.finish = self.finish, None
        after, self.after = self.after, []
        if finish is None:
            return None
        try:
            finish()
        except BaseException as exc:  # noqa: BLE001 - handed back as Landing does
            return exc
        for step in after:
            step()
        return None


def test_autosaves_land_in_the_background_and_a_failed_landing_is_no_file_of_the_chain(smollm_runtime, tmp_path):
    from engine.checkpoints.format import KIND_AUTOSAVE
    from engine.checkpoints.graph import Graph
    rt = smollm_runtime
    rt.trim(0)
    conv = _conversation(rt, "Tell me about rivers.")
    store = Store(tmp_path / "store")
    # each autosave on the one before (no tiers), so the one whose parent goes is a delta on it
    writer = LineWriter.starting(rt, store, "line", policy=ChainPolicy(tier_autosaves=False))
    writer._landing = held = _HeldLanding()
    saved = []
    generate(rt, conv, autosave=lambda c: saved.append(writer.autosave(c)), autosave_every=8, stop_after=24)
    # each autosave, the first (a full file) as the deltas on it, lands when the next save
    # (or anyone reading the chain) settles it, so the answer never waited for its fsync
    assert held.in_flight and not saved[-1].path.exists()
    assert all(info.path.exists() for info in saved[:-1])
    assert writer.chain[-1] is saved[-1] and saved[-1].path.exists()     # reading the chain settles
    # a landing that fails (its parent deleted before it landed) is no file of the chain,
    # and the next save, in the foreground, writes a full checkpoint instead of a delta on it
    generate(rt, conv, autosave=lambda c: saved.append(writer.autosave(c)), autosave_every=8, stop_after=8)
    assert held.in_flight
    saved[-2].path.unlink()
    writer.settle()
    assert not saved[-1].path.exists() and writer.chain[-1] is saved[-2]   # (deleted: found out next)
    generate(rt, conv, autosave=lambda c: saved.append(writer.autosave(c)), autosave_every=8, stop_after=8)
    assert not held.in_flight and saved[-1].path.exists() and not saved[-1].delta
    head = Graph.scan(store).heads[0]
    assert head.path == saved[-1].path and head.header.kind == KIND_AUTOSAVE
    restored = rt.restore_chain(load_chain(head.path))
    assert restored.tokens == conv.tokens


def test_an_autosave_in_tiers_retires_what_it_absorbed_and_a_failed_one_gives_it_back(
        smollm_runtime, tmp_path, monkeypatch):
    """An answer's autosaves in tiers (LineWriter._tier_below): what each absorbs leaves the
    store once it has landed, so the store holds the newest autosave's chain alone.  One
    that fails to land (its fsync fails) absorbed nothing: the files it would have replaced
    are the live chain again, and the next autosave absorbs and retires them."""
    import errno

    from engine.checkpoints import atomic
    rt = smollm_runtime
    rt.trim(0)
    conv = _conversation(rt, "Tell me about rivers.")
    store = Store(tmp_path / "store")
    writer = LineWriter.starting(rt, store, "line")
    writer._landing = held = _HeldLanding()

    def autosave():
        generate(rt, conv, stop_after=4)
        return writer.autosave(conv)

    def on_disk():
        return sorted(store.folder.glob("*.kvckpt"))
    saved = [autosave() for _ in range(4)]   # the first a full file, then 4, 4 (absorbing), 4 tokens
    assert [i.n_tokens - i.parent_n_tokens for i in writer.chain[1:]] == [8, 4]
    assert on_disk() == sorted(i.path for i in writer.chain)   # the absorbed one retired
    before = list(writer.chain)

    def fails(_fd):
        raise OSError(errno.EIO, "the disk failed")
    monkeypatch.setattr(atomic, "fsync", fails)
    saved.append(autosave())   # absorbs both (4 <= 4, 8 <= 8): on the full file, in flight
    assert held.in_flight and saved[-1].parent_n_tokens == before[0].n_tokens
    writer.settle()
    monkeypatch.undo()
    assert writer.chain == before and on_disk() == sorted(i.path for i in before)
    saved.append(autosave())   # in the foreground: absorbs them again, and retires them
    assert not held.in_flight and [i.path for i in writer.chain] == [before[0].path, saved[-1].path]
    assert on_disk() == sorted(i.path for i in writer.chain)
    restored = rt.restore_chain(load_chain(saved[-1].path))
    assert restored.tokens == conv.tokens


def test_what_an_autosave_supersedes_is_retired_only_once_it_has_landed(smollm_runtime, tmp_path):
    from engine.checkpoints.format import KIND_MANUAL
    from engine.checkpoints.graph import Graph
    rt = smollm_runtime
    rt.trim(0)
    conv = _conversation(rt, "Tell me about deserts.")
    store = Store(tmp_path / "store")
    generate(rt, conv, stop_after=8)
    first = LineWriter.starting(rt, store, "line")
    old_head = first.save_head(conv, KIND_MANUAL)            # a head lands at once
    assert old_head.path.exists()
    first.close()

    # a new writer on the same line (a crash's successor): its first autosave is a full
    # file that supersedes the old head, which must outlive it until the new one is durable
    generate(rt, conv, stop_after=8)
    second = LineWriter.starting(rt, store, "line")
    second._landing = held = _HeldLanding()
    new = second.autosave(conv)
    assert held.in_flight and not new.path.exists() and old_head.path.exists()
    second.settle()
    assert new.path.exists() and not old_head.path.exists()
    assert Graph.scan(store).head_of_line["line"].path == new.path
    second.close()

    # when the superseding autosave fails to land, nothing it would supersede is deleted
    generate(rt, conv, stop_after=8)
    third = LineWriter.starting(rt, store, "line", mode="full")
    third._landing = held = _HeldLanding()
    failed = third.autosave(conv)
    failed.path.write_bytes(b"another writer's file")       # the name is taken before the rename
    third.settle()
    assert new.path.exists() and third.chain == []
    assert failed.path.read_bytes() == b"another writer's file"
    third.close()
