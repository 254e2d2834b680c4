"""Branches: edit a message, keep every alternative answer, fork — each branch keeps its
KV state, so switching never recomputes (issue 10).  Real SmolLM2 and Gemma 3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_cli
from enginekit import Recorder

from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import read_header
from engine.checkpoints.graph import Graph
from engine.checkpoints.store import Store
from engine.sampling import SamplerSettings
from engine.worker import EngineWorker, ModelOptions


@pytest.fixture
def engine(smollm_path, tmp_path):
    rec = Recorder()
    w = EngineWorker(rec, Store(tmp_path / "store"))
    w.start()
    w.load_model(ModelOptions(smollm_path, n_ctx=1024, n_threads=2))
    rec.wait("loaded")
    yield w, rec
    w.shutdown()
    assert w.join(60)


def _answer(rec, w, action, *args) -> tuple:
    """Run one answering command; returns (summary, snapshot saved after it)."""
    n_finished, n_saved = len(rec.of("finished")), len(rec.of("saved"))
    action(*args)
    summary = rec.wait("finished", n_finished + 1)[-1][1]
    saved = rec.wait("saved", n_saved + 1)[-1]
    return summary, saved[1]


def test_regenerate_keeps_the_old_answer_and_switching_back_restores_it(engine):
    w, rec = engine
    conv = w.new_conversation(sampler=SamplerSettings(seed=3, temperature=0.8))
    _, first = _answer(rec, w, w.send, conv, "Name a colour.", 12)
    old_answer = first.transcript[-1]["content"]
    _, second = _answer(rec, w, w.regenerate, conv)
    new_answer = second.transcript[-1]["content"]
    assert new_answer != old_answer                       # Regenerate draws with a new seed
    w.show(conv)
    snap = rec.next("changed")[1]
    alt = snap.alternatives[-1]
    assert alt is not None and (alt.index, alt.count) == (2, 2)
    # back to the first answer: its own head, restored without decoding anything again
    w.switch_branch(conv, alt.heads[0])
    back = rec.next("changed")[1]
    assert back.transcript[-1]["content"] == old_answer
    assert back.alternatives[-1].index == 1
    # the next turn follows the alternative shown, and nothing of it is recomputed
    summary, _ = _answer(rec, w, w.send, conv, "Another one?", 4)
    assert summary.n_reused_tokens >= read_header(alt.heads[0]).n_tokens
    assert not rec.of("error"), rec.of("error")


def test_edit_keeps_the_old_turns_on_their_branch(engine):
    w, rec = engine
    conv = w.new_conversation(sampler=SamplerSettings(seed=4, temperature=0.0))
    _answer(rec, w, w.send, conv, "Name a fruit.", 8)
    _, two_turns = _answer(rec, w, w.send, conv, "Name a vegetable.", 8)
    assert len(two_turns.transcript) == 4
    _, edited = _answer(rec, w, w.edit_message, conv, 2, "Name a tree.", 8)   # message 2: turn 2
    assert [m["content"] for m in edited.transcript[:3]] == [m["content"] for m in two_turns.transcript[:2]] \
        + ["Name a tree."]
    w.show(conv)
    snap = rec.next("changed")[1]
    assert (snap.alternatives[2].index, snap.alternatives[2].count) == (2, 2)
    assert snap.alternatives[0] is None                      # turn 1 is shared
    heads = Graph.scan(w.store).heads_of(conv)
    assert len(heads) == 2                                    # both lines of history are kept


def test_fork_is_a_new_conversation_on_the_same_files(engine):
    w, rec = engine
    conv = w.new_conversation(sampler=SamplerSettings(seed=5, temperature=0.0))
    _answer(rec, w, w.send, conv, "Name a planet and tell me about it.", 96)
    _answer(rec, w, w.send, conv, "And a moon?", 8)
    # up to the first answer: a point of the head, which the fork is cut from
    fork = w.fork(conv, 1)
    snap = rec.next("changed")[1]
    assert snap.id == fork and len(snap.transcript) == 2
    g = Graph.scan(w.store)
    (head,) = g.heads_of(fork)
    assert head.is_delta and head.header.state_len == 0      # no bytes of KV copied
    assert g.parent(head).conversation_id == conv
    # the fork outlives the conversation it came from
    w.delete_conversation(conv)
    w.send(fork, "Is it large?", 4)
    summary = rec.next("finished")[1]
    assert summary.conversation_id == fork and summary.n_reused_tokens >= head.header.n_tokens
    assert len(load_chain(Graph.scan(w.store).heads_of(fork)[0].path)) >= 2


def test_a_fork_at_the_last_message_leaves_the_conversation_its_head(engine):
    """A fork of the whole conversation must not build on the conversation's newest file
    whole: a tip that another conversation's chain holds whole is no head, and the
    conversation vanished from the list (and came back when the fork was deleted).  It is
    cut one token short of it (and holds that one cell again): the head stays a head."""
    w, rec = engine
    conv = w.new_conversation(sampler=SamplerSettings(seed=5, temperature=0.0))
    _answer(rec, w, w.send, conv, "Name a planet.", 8)
    _, snap = _answer(rec, w, w.send, conv, "And a moon?", 8)
    fork = w.fork(conv, 3)                                    # at the last answer
    assert rec.next("changed")[1].id == fork
    g = Graph.scan(w.store)
    (head,), (fork_head,) = g.heads_of(conv), g.heads_of(fork)
    assert head.path == snap.checkpoint
    assert g.is_head(head)
    assert fork_head.header.n_tokens == head.header.n_tokens
    assert fork_head.header.parent_n_tokens == head.header.n_tokens - 1   # one cell again
    summary, _ = _answer(rec, w, w.send, fork, "Is it large?", 4)
    assert summary.n_reused_tokens >= head.header.n_tokens    # the fork's own file held it


def test_continue_generates_more_of_a_finished_answer(engine):
    w, rec = engine
    conv = w.new_conversation(sampler=SamplerSettings(seed=6, temperature=0.0))
    first, snap = _answer(rec, w, w.send, conv, "Count from one.", 6)
    assert first.finish_reason == "length"
    more, after = _answer(rec, w, w.continue_answer, conv, 6)
    assert more.n_generated == 6 and more.n_reused_tokens == more.n_prompt_tokens
    assert after.transcript[-1]["content"].startswith(snap.transcript[-1]["content"])
    assert len(after.transcript) == len(snap.transcript)


@pytest.mark.parametrize("model", ["smollm", "gemma"])
@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_from_turn_equals_continuing_that_history(model, temp, request, app_home):
    """Edit turn 2 of a three-turn conversation: the same text as continuing a checkpoint
    of turn 1 with the new message (for the sliding-window model too)."""
    path = str(request.getfixturevalue(f"{model}_path"))
    common = ["-m", path, "--ctx-size", "1024", "-n", "12", "--seed", "7", "--temp", temp, "--json",
              "--ignore-eos"]

    def run(*args):
        return json.loads(run_cli("run", *common, *args, check=True).stdout.strip().splitlines()[-1])

    one = run("-p", "Tell me about owls.")
    two = run("--checkpoint-load", one["checkpoint"], "-p", "And about bats?")
    three = run("--checkpoint-load", two["checkpoint"], "-p", "And about moths?")
    edited = run("--checkpoint-load", three["checkpoint"], "--from-turn", "2", "-p", "And about crows?")
    # the old turns are a branch of their own; the tree shows both
    tree = run_cli("inspect", edited["checkpoint"], "--tree", check=True).stdout
    assert "And about moths?" in tree and "And about crows?" in tree and "2 branch(es)" in tree
    reference = run("--checkpoint-load", one["checkpoint"], "-p", "And about crows?")
    assert edited["text"] == reference["text"]
    assert edited["n_reused_tokens"] >= one["n_prompt_tokens"] + one["n_generated"]
    bad = run_cli("run", *common, "--checkpoint-load", three["checkpoint"], "--from-turn", "9", "-p", "x")
    assert bad.returncode == 1 and "no turn 9" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert Path(edited["checkpoint"]).exists()


def test_from_turn_on_a_damaged_file_says_it_is_damaged(smollm_path, app_home):
    """A role in the last file's metadata changed ("user" to "usEr", still valid JSON): the
    turns --from-turn counts are read from it, so its checksum is checked first (also a
    large state's, whose checksum a restore leaves running), and the run names the
    damage, not a turn that the damaged metadata lacks."""
    common = ["-m", str(smollm_path), "--ctx-size", "1024", "-n", "6", "--seed", "7", "--temp", "0", "--json"]
    one = json.loads(run_cli("run", *common, "-p", "Tell me about owls.", check=True).stdout.strip().splitlines()[-1])
    two = json.loads(run_cli("run", *common, "--checkpoint-load", one["checkpoint"], "-p", "And bats?",
                             check=True).stdout.strip().splitlines()[-1])
    data = Path(two["checkpoint"]).read_bytes()
    at = data.rindex(b'"user"')   # the last turn's role, in the metadata
    bad = Path(two["checkpoint"]).with_name("bad.kvckpt")   # beside its parent
    bad.write_bytes(data[:at] + b'"usEr"' + data[at + len(b'"user"'):])
    done = run_cli("run", *common, "--checkpoint-load", str(bad), "--from-turn", "2", "-p", "x")
    assert done.returncode == 1 and "checksum mismatch" in done.stderr, done.stderr


@pytest.mark.parametrize("model", ["gemma", "lfm2", "mamba2"])
def test_from_turn_on_a_single_file_equals_continuing_that_history(model, request, tiny_model_path, tmp_path,
                                                                   app_home):
    """The conversation saved to named files (`--checkpoint-save`: one whole file, no file of
    turn 1's end in its chain): editing turn 2 starts from exactly the tokens turn 1 ended
    with, decoded as they were, so a sliding-window, hybrid or recurrent model gives the
    text of continuing a checkpoint of turn 1 (it kept one token fewer before)."""
    path = str(request.getfixturevalue("gemma_path") if model == "gemma" else tiny_model_path(model))
    common = ["-m", path, "--ctx-size", "1024", "-n", "16", "--temp", "0", "--json", "-t", "2"]

    def run(*args):
        return json.loads(run_cli("run", *common, *args, check=True).stdout.strip().splitlines()[-1])

    a, b = tmp_path / "a.kvckpt", tmp_path / "b.kvckpt"
    run("--system", "You are terse.", "-p", "Name three rivers.", "--checkpoint-save", str(a))
    run("--checkpoint-load", str(a), "-p", "Which is longest?", "--checkpoint-save", str(b))
    reference = run("--checkpoint-load", str(a), "-p", "Which is shortest?")
    edited = run("--checkpoint-load", str(b), "--from-turn", "2", "-p", "Which is shortest?")
    assert edited["text"] == reference["text"]
    if model == "gemma":
        assert edited["n_reused_tokens"] == reference["n_reused_tokens"]


def test_an_edit_finds_the_tokens_of_an_answer_cut_inside_a_character(smollm_runtime):
    """An answer whose bytes are no valid UTF-8 (a character cut by the token limit, a small
    model's stray bytes: its text holds a replacement character there) is the history an Edit
    goes back to: its tokens were matched by their bytes and never matched the text, so the
    whole conversation was read again (``run --from-turn`` on a tiny hybrid, a new user's
    trial).  Matched by their text, decoded as the answer's text was, they are found."""
    import codecs

    from engine.conversation import Conversation
    from engine.generation import begin_answer, commit_answer, cut_to_history
    rt = smollm_runtime
    model = rt.model
    conv = Conversation()
    begin_answer(conv, rt, "Show me a smiling face.")
    emoji = model.tokenize("Here: 😀 and 🙂 done", add_special=False)
    pieces = [model.token_to_piece(t) for t in emoji]
    split = next(i for i, p in enumerate(pieces) if p and not _valid_utf8(p))   # a token inside 😀
    answer = emoji[:split] + emoji[split + 1:]   # one byte token of the emoji left out
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(model.token_to_piece(t) for t in answer))
    assert "\ufffd" in text
    history = list(conv.tokens) + answer
    conv.answer.text, conv.answer.n_generated, conv.answer.finish_reason = text, len(answer), "length"
    conv.tokens = history + model.tokenize("<|im_end|>\n<|im_start|>user\nLater turn", add_special=False)
    commit_answer(conv)
    conv.answer = None   # (as an Edit leaves it: the messages up to an answer)
    assert cut_to_history(conv, rt) is not None
    assert conv.tokens == history


def _valid_utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_an_alternative_opens_the_branch_that_goes_on_from_an_unchanged_edit():
    """Nine turns, an Edit of turn 2 that changed nothing (the same answer came back: a branch
    of two turns, all of them the first branch's), then an Edit of turn 2 with new text:
    turn 2's first alternative opened the newest branch with it, the two-turn one, and the
    first branch's turns 3-9 could be reached from no message (a new user's trial)."""
    from engine.branches import Branch, alternatives
    turns = [m for k in range(9) for m in (("user", f"question {k}"), ("assistant", f"answer {k}"))]
    first = Branch(Path("first"), "a", tuple(turns), 900, 1, False)
    unchanged = Branch(Path("unchanged"), "b", tuple(turns[:4]), 200, 2, False)
    edited = Branch(Path("edited"), "c", (*turns[:2], ("user", "another question"), ("assistant", "x")), 200, 3,
                    False)
    branches = [first, unchanged, edited]
    at_turn_2 = alternatives(edited.messages, branches)[2]
    assert at_turn_2 is not None and (at_turn_2.index, at_turn_2.count) == (2, 2)
    assert at_turn_2.heads == (Path("first"), Path("edited"))
    # shown from the unchanged branch too, turn 2's first alternative is the first branch
    assert alternatives(unchanged.messages, branches)[2].heads == (Path("first"), Path("edited"))
    # and a branch that goes on from an edit stays what its own alternative opens
    on = Branch(Path("on"), "d", (*turns[:4], ("user", "a new turn 3"), ("assistant", "y")), 300, 4, False)
    assert alternatives(on.messages, [first, unchanged, on])[4].heads == (Path("first"), Path("on"))


def test_regenerate_answers_within_the_limit_set_since(engine):
    """The window's answer limit changed after the answer (Settings): Send, Edit and Continue
    took the new one, Regenerate the old one (1,400 tokens at a limit of 64, under Wine)."""
    w, rec = engine
    a = w.new_conversation(sampler=SamplerSettings(seed=5, ignore_eos=True))
    first, _ = _answer(rec, w, w.send, a, "Name three colours.", 12)
    assert first.n_generated == 12
    again, _ = _answer(rec, w, w.regenerate, a, 3)
    assert again.n_generated == 3 and again.finish_reason == "length"
    kept, _ = _answer(rec, w, w.regenerate, a)    # none given: the answer's own
    assert kept.n_generated == 3
