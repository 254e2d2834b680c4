"""The benchmark suite's smallest configuration runs end to end (no timing is judged)."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("llama_cpp")

EXPECTED = {
    "ttft": {"recompute_s", "restore_s", "floor_s", "restore_speedup", "restore_vs_floor"},
    "disk": {"save_s", "raw_write_s", "save_vs_raw", "load_s", "raw_read_s", "load_vs_raw"},
    "size": {"file_MB", "kv_formula_MB", "transcript_KB", "size_vs_formula"},
    "memory": {"state_MB", "save_extra_MB", "save_extra_x", "load_extra_MB", "load_extra_x"},
    "autosave": {"every", "none_tok_s", "full_tok_s", "full_cost_pct"},
    "throughput": {"phase", "bare", "ours", "llama", "ours_vs_bare", "ours_vs_llama"},
    "pause": {"phase", "halt_ms", "durable_ms"},
    "branches": {"switch_ms", "floor_ms", "switch_vs_floor", "recompute_ms", "edit_ms", "disk_bytes",
                 "disk_target_bytes", "disk_vs_target"},
}
# may be negative or absent by nature: a cost within noise, a column of a missing feature
SIGNED = {"full_cost_pct", "delta_cost_pct", "last_token_ms"}


def test_smallest_configuration_produces_every_table(smollm_path, tmp_path, capsys):
    from benchmarks.suite import main
    out = tmp_path / "bench.json"
    assert main(["--smoke", "--json", str(out)]) == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    printed = capsys.readouterr().out
    for name, keys in EXPECTED.items():
        table = report["tables"][name]
        assert table["title"] in printed
        assert table["rows"], f"table {name} is empty"
        for row in table["rows"]:
            assert keys <= row.keys(), (name, keys - row.keys())
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in SIGNED:
                    assert value >= 0 and not math.isnan(value), (name, key, value)
    phases = {r["phase"] for r in report["tables"]["throughput"]["rows"]}
    assert phases == {"prefill", "generate"}
    assert {r["target"] for r in report["targets"]} >= {"restore / raw floor", "save / raw write+fsync",
                                                        "switch alternative / own cells"}


def test_the_restore_profile_times_llama_cpps_own_load_beside_ours(smollm_path, tmp_path):
    """benchmarks.restore_profile at its smallest: our checked restore, the raw floor and
    llama.cpp's own llama_state_seq_load_file of the same tokens, each in a new process;
    and the same restores by another tree's code (--against; here this tree's own)."""
    from benchmarks.restore_profile import ROOT, run
    report = run([96], 1, 2, None, echo=lambda *a, **k: None, keep=str(tmp_path), turns=4, against=ROOT)
    rows = report["table"]["rows"]
    assert [r["layout"] for r in rows] == ["full (1)", "chain (3)", "chain-each (4)", "turns (4)",
                                            "merged (1)", "shared (2)"]
    for row in rows:
        assert row["restore_ms"] > 0 and row["floor_ms"] > 0 and row["loadfile_ms"] > 0
        assert row["vs_loadfile"] > 0 and row["server_ms"] is None
        assert row["against_ms"] > 0 and row["vs_against"] > 0


def test_folding_an_answers_autosaves_into_its_head_leaves_fewer_files_to_read(smollm_path):
    """benchmarks.head_fold at its smallest: the pause's head on the newest autosave and
    folded onto the last anchor, side by side."""
    from benchmarks.head_fold import measure, parse
    rows = measure(parse(["--prompt", "300", "--tokens", "40", "--every", "8", "--repeats", "1"])).rows
    before, now = rows
    assert before["files_read"] == 1 + 40 // 8 + 1   # the prompt's file, 5 autosaves, the head
    assert now["files_read"] == 2                # the prompt's file and the head
    assert now["head_MB"] > before["head_MB"] and now["store_MB"] < before["store_MB"]
    assert all(r["pause_ms"] > 0 and r["restore_ms"] > 0 for r in rows)


def test_the_page_cache_benchmark_maps_each_way_side_by_side(tmp_path):
    """benchmarks.page_cache at its smallest: the writer's aligned writes against the earlier
    unaligned ones, a cold read with and without huge pages, each row measured."""
    from benchmarks.page_cache import run
    from engine.checkpoints import mapped
    report = run([4], 1, tmp_path, echo=lambda *a, **k: None)
    rows = report["table"].rows
    if not mapped.supported():
        assert rows == [] and "nothing measured" in report["table"].notes[0]
        return
    assert [r["case"] for r in rows] == [
        "hot, written aligned (now)", "hot, written unaligned (before)",
        "cold, read with MADV_HUGEPAGE (now)", "  then mapped again, with MADV_HUGEPAGE (now)",
        "cold, read without (before)", "  then mapped again, without (before)"]
    for row in rows:
        assert row["copy_ms"] > 0 and math.isfinite(row["huge_MB"]) and row["vs_first"] > 0
    assert rows[0]["populate_ms"] > 0 and rows[1]["populate_ms"] > 0


def test_merged_turns_keep_fewer_files_than_a_file_per_turn(smollm_path):
    """benchmarks.merged_turns at its smallest: the layouts of the same turns, side by side."""
    from benchmarks.merged_turns import measure, parse
    before, capped, now = measure(parse(["--tokens", "240", "--turns", "6", "--repeats", "1"])).rows
    assert capped["files"] == now["files"]   # (far below 32 MiB: no tier)
    assert before["files"] == 6 and now["files"] < before["files"]
    assert now["written_MB"] > before["written_MB"]   # absorbed turns are written again
    assert now["store_MB"] <= before["store_MB"] * 1.05 and now["restore_ms"] > 0


def test_an_answers_autosaves_in_tiers_leave_a_crash_fewer_files_to_read(smollm_path):
    """benchmarks.autosave_tiers at its smallest: six autosaves each on the one before and
    in tiers, side by side (popcount(6) = 2 of them after the prompt's file)."""
    from benchmarks.autosave_tiers import measure, parse
    before, now = measure(parse(["--prompt", "300", "--tokens", "48", "--every", "8", "--repeats", "1"])).rows
    assert before["files_read"] == 1 + 6 and now["files_read"] == 1 + 2
    assert now["written_MB"] > before["written_MB"] and now["restore_ms"] > 0 and now["answer_s"] > 0


def test_recurrent_autosaves_leave_one_file_on_the_anchor_instead_of_one_each(tmp_path):
    """benchmarks.recurrent_autosaves at its smallest (the tiny qwen35): what a crash in the
    middle of an answer leaves, each autosave on the newest one vs on the anchor."""
    from benchmarks.recurrent_autosaves import measure, parse
    before, now = measure(parse(["--model", "qwen35", "--tokens", "24", "--every", "4",
                                 "--folder", str(tmp_path)])).rows
    assert before["chain_files"] >= 5 and now["chain_files"] == 2
    assert now["crash_files"] == 2 and now["crash_MB"] < before["crash_MB"]
    assert now["restore_ms"] > 0 and now["store_after_head_MB"] == pytest.approx(before["store_after_head_MB"],
                                                                                  rel=0.05)


def test_the_copy_runs_benchmark_prints_each_layout_and_piece(capsys):
    """benchmarks.copy_runs at its smallest: the same bytes as one, three and twelve files'
    runs, and in pieces of each size, every figure measured."""
    from benchmarks.copy_runs import main
    assert main(["--mb", "4", "--repeats", "3"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.strip()}
    assert {"one", "three", "twelve"} <= rows.keys()
    assert rows["one"][-1] == "1.00" and float(rows["three"][-1]) > 0 and float(rows["twelve"][-1]) > 0
    pieces = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 2]
    assert len(pieces) == 7 and all(float(gbs) > 0 for _, gbs in pieces)   # pieces up to 4 MB


def test_the_first_go_back_after_a_restore_is_timed(tiny_model_path, tmp_path):
    """benchmarks.first_go_back at its smallest (the tiny qwen35): the answer's files as a
    crash leaves them, restored, then going back to the prompt's end twice."""
    from benchmarks.common import context_settings
    from benchmarks.first_go_back import measure
    from benchmarks.restore_profile import _answer_files
    from engine.runtime import Runtime
    model = tiny_model_path("qwen35")
    rt = Runtime(model, context_settings(512, 2))
    try:
        _conv, chain = _answer_files(rt, tmp_path, list(range(40, 140)), 2)
    finally:
        rt.close()
    assert len(chain) == 2   # the autosaves on the prompt's file (a recurrent state outweighs the cells)
    got = measure(model, chain[-1], 1, 512, 2)
    assert got["first_ms"] > 0 and got["again_ms"] > 0


def test_turn_states_weighs_one_file_per_conversation_against_its_writes(tiny_model_path):
    """benchmarks.turn_states at its smallest (the tiny qwen35, whose turns a head absorbs:
    one file already, so one file saves nothing and never pays for its writes)."""
    from benchmarks.turn_states import measure, parse
    rows = measure(parse(["--model-path", str(tiny_model_path("qwen35")), "--tokens", "120", "--turns", "4",
                          "--repeats", "1"])).rows
    by_what = {row["what"]: row for row in rows}
    assert by_what["files a restore reads"]["now"] == 1
    assert by_what["restore of the conversation, ms"]["now"] > 0
    assert "+ at least" in by_what["a turn's head save, ms (MB written)"]["one_file"]
    assert len(rows) == 5
