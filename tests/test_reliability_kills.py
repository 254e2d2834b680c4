"""Issue 4, cases 1 and 7: writers killed mid-save, and many processes on one store.

The synthetic writer uses the real writer (``write_sections`` in ``atomic_write``) with
a well-formed state blob; one test kills a writer that saves a real SmolLM2 KV state.
Store folders have non-ASCII names throughout (case 6).
"""

from __future__ import annotations

import os
import random
import sys
import time
import uuid

import pytest
from faultkit import synthetic
from faultkit.campaigns import concurrency_campaign, kill_campaign
from faultkit.zygote import Zygote

from engine.checkpoints import format as fmt
from engine.checkpoints.store import Store

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and fork are POSIX")


@pytest.fixture(scope="module")
def zygote():
    with Zygote() as z:
        yield z


def test_killed_writer_never_costs_a_conversation_its_checkpoint(tmp_path, zygote):
    folder = tmp_path / "用户" / "文档" / "检查点 🧠"
    stats = kill_campaign(folder, 220, seed=1, zygote=zygote)
    assert stats.problems == []
    assert stats.lost == 0
    assert stats.kills >= 200
    # the kills really landed during saves, and saves really completed between them
    assert stats.temps_left >= 20
    assert stats.saves_acked >= 20
    assert stats.checkpoints_checked >= stats.kills
    assert Store(folder).temp_files() == []


def test_listing_never_shows_a_file_being_written(tmp_path):
    store = Store(tmp_path / "store")
    store.ensure()
    conv = uuid.uuid4()
    target = store.new_path("in progress")
    from engine.checkpoints.atomic import atomic_write
    with atomic_write(target) as f:
        f.write(synthetic.file_bytes()[:100])
        assert store.files() == [] and store.entries() == []
        assert len(store.temp_files()) == 1
        # a live writer's temp file is not stale, whatever its age
        assert store.remove_stale_temps(min_age_s=0) == 0
        f.write(synthetic.file_bytes()[100:])
    assert [e.path for e in store.entries()] == [target]
    synthetic.write(synthetic.fixed_path(store, conv), conv, 1)
    assert len(store.entries()) == 2 and store.temp_files() == []


@pytest.mark.slow
def test_killed_real_model_writer_leaves_a_restorable_checkpoint(tmp_path, zygote, smollm_path,
                                                                smollm_runtime):
    """SIGKILL a process saving SmolLM2's real KV state; the survivor restores and generates."""
    from engine.generation import generate
    folder = tmp_path / "检查点"
    conv_id = uuid.uuid4()
    rng = random.Random(4)
    kills, seq, last = 0, 1, None
    for k in range(4):
        ack = tmp_path / f"model-{k}.ack"
        pid = zygote.spawn({"role": "model-writer", "folder": str(folder), "model": str(smollm_path),
                            "n_ctx": 2048, "conv": conv_id.hex, "next_seq": seq,
                            "prompt": "Name three colours.", "ack": str(ack),
                            "error_log": str(tmp_path / "errors.log")})
        deadline = time.monotonic() + 60
        while not (ack.exists() and ack.read_text().startswith("READY")):
            assert time.monotonic() < deadline, "the model writer never became ready"
            assert not (tmp_path / "errors.log").exists(), (tmp_path / "errors.log").read_text()
            time.sleep(0.01)
        time.sleep(rng.uniform(0.005, 0.08))
        kills += zygote.kill(pid)
        acked = [int(line.split()[2]) for line in ack.read_text().splitlines()[1:]]
        store = Store(folder)
        entries = store.entries()
        assert all(e.valid for e in entries)
        assert store.temp_files() == [] or store.remove_stale_temps(min_age_s=0) >= 1
        if acked or last is not None:
            data = synthetic.fmt.read_checkpoint(synthetic.fixed_path(store, conv_id))   # full CRC
            assert data.header.kind == fmt.KIND_AUTOSAVE and data.header.n_tokens > 0
            last = data
        seq += len(acked) + 2
    assert kills == 4
    assert last is not None, "no save completed in four runs"
    conv = smollm_runtime.restore(last)
    result = generate(smollm_runtime, conv, stop_after=3)
    assert result.n_generated == 3 and result.n_reused_tokens == last.header.n_tokens


def test_concurrent_autosaves_listing_and_pruning(tmp_path, zygote):
    stats = concurrency_campaign(tmp_path / "共享 store 🔒", n_writers=3, n_saves=160,
                                 zygote=zygote, seed=7)
    assert stats.problems == []
    assert stats.saves == 3 * 160
    assert stats.listings >= 10 and stats.validations >= 100
    assert stats.prunes >= 1 and stats.pruned >= 1   # superseded history really was deleted
    print(f"concurrency: {stats.operations} operations ({stats.saves} saves, {stats.listings} "
          f"listings, {stats.validations} validations, {stats.prunes} prunes, {stats.pruned} pruned)")


def test_concurrency_check_can_fail(tmp_path, zygote):
    """The campaign's checks see an overwrite: a store whose names collide."""
    folder = tmp_path / "colliding"
    store = Store(folder)
    store.ensure()
    conv = uuid.uuid4()
    first = store.new_path("same title")
    synthetic.write(first, conv, 1, kind=fmt.KIND_MANUAL)
    synthetic.write(first, conv, 2, kind=fmt.KIND_MANUAL)   # what a name collision would do
    assert synthetic.load_fully(first).meta["seq"] == 2
    names = {store.new_path("same title").name for _ in range(2000)}
    assert len(names) == 2000
    assert os.path.basename(first) not in names
