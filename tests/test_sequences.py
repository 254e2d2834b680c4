"""engine.sequences: residency of conversations in a unified KV cache (no threads, no model)."""

from __future__ import annotations

import random

import pytest

from engine.sequences import SequencesFull, SequenceTable


def test_switching_among_resident_conversations_restores_nothing():
    table = SequenceTable(4)
    seqs = {key: table.activate(key).seq for key in "abcd"}
    assert sorted(seqs.values()) == [0, 1, 2, 3]
    assert table.misses == 4
    for key in "dcbaabcdda":
        placement = table.activate(key)
        assert placement.resident and placement.seq == seqs[key] and placement.evicted is None
    assert table.hits == 10 and table.misses == 4 and table.evictions == 0


def test_the_least_recently_used_idle_conversation_is_evicted():
    table = SequenceTable(3)
    for key in "abc":
        table.activate(key)
    table.activate("a")                      # b is now the least recently used
    placement = table.activate("d")
    assert placement.evicted == "b" and not placement.resident
    assert placement.seq == 1                # b's sequence
    assert "b" not in table and table.seq_of("d") == 1
    assert table.residents() == ["d", "a", "c"]
    assert table.evictions == 1


def test_running_and_unsaved_conversations_are_never_evicted():
    table = SequenceTable(3)
    table.activate("a", running=True)
    table.activate("b")
    table.start("b")
    table.activate("c")
    table.finish("c", durable=False)         # paused, its save not written yet
    with pytest.raises(SequencesFull):
        table.activate("d")
    assert len(table) == 3 and table.evictions == 0
    table.saved("c")
    assert table.activate("d", running=True).evicted == "c"
    table.finish("a")
    assert table.victim() == "a"
    assert table.activate("e").evicted == "a"
    assert table.running == ["b", "d"]


def test_a_resumed_conversation_keeps_its_sequence():
    table = SequenceTable(2)
    a = table.activate("a", running=True)
    table.finish("a")
    again = table.activate("a", running=True)
    assert again.resident and again.seq == a.seq and table.is_running("a")


def test_sequence_ids_start_where_asked_and_evict_frees_one():
    table = SequenceTable(2, first=3)
    assert [table.activate(k).seq for k in "ab"] == [3, 4]
    assert table.evict("a") == 3 and table.evict("a") is None
    assert table.key_of(4) == "b" and table.free == 1
    assert table.activate("c").seq == 3
    with pytest.raises(ValueError):
        SequenceTable(0)


@pytest.mark.parametrize("seed", range(20))
def test_random_actions_keep_every_invariant(seed):
    """Random activations, starts, finishes, saves and deletions, against a plain model."""
    rng = random.Random(seed)
    capacity = rng.randint(1, 5)
    table = SequenceTable(capacity)
    keys = [f"c{i}" for i in range(capacity + 4)]
    # the model: key -> [last use, running, durable]
    model: dict[str, list] = {}
    for t in range(300):
        key = rng.choice(keys)
        action = rng.choice(("activate", "activate", "start", "finish", "finish_unsaved", "saved", "evict"))
        before = {k: table.seq_of(k) for k in model}
        if action == "activate":
            may_go = [(use, k) for k, (use, running, durable) in model.items() if not running and durable]
            expected_victim = min(may_go)[1] if may_go else None
            assert table.victim() == expected_victim
            try:
                placement = table.activate(key)
            except SequencesFull:
                assert key not in model and len(model) == capacity and expected_victim is None
                continue
            if key in model:
                assert placement.resident and placement.seq == before[key]
                model[key][0] = t
            elif len(model) < capacity:
                assert placement.evicted is None and placement.seq not in before.values()
                model[key] = [t, False, True]
            else:
                assert placement.evicted == expected_victim
                assert placement.seq == before[expected_victim]
                del model[expected_victim]
                model[key] = [t, False, True]
        elif key in model:
            if action == "start":
                table.start(key)
                model[key][:2] = [t, True]
            elif action in ("finish", "finish_unsaved"):
                table.finish(key, durable=action == "finish")
                model[key] = [t, False, action == "finish"]
            elif action == "saved":
                table.saved(key)
                model[key][2] = True
            else:
                assert table.evict(key) == before[key]
                del model[key]
        assert set(table.residents()) == set(model)
        assert table.residents() == sorted(model, key=lambda k: -model[k][0])
        seqs = [table.seq_of(k) for k in model]
        assert len(seqs) == len(set(seqs)) <= capacity
        assert all(0 <= s < capacity for s in seqs)
        assert set(table.running) == {k for k, v in model.items() if v[1]}
