"""A conversation of many turns keeps few files: a head that ends a turn absorbs the turns
before it (engine.history.LineWriter._absorbed_by_head) and records their ends as points,
which an edit restores exactly (engine.branches.turn_end)."""

from __future__ import annotations

from engine.branches import turn_end
from engine.checkpoints.chain import load_chain
from engine.checkpoints.format import KIND_MANUAL, KIND_PAUSE
from engine.checkpoints.graph import Graph
from engine.checkpoints.points import points_of
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.generation import begin_answer, commit_answer, generate
from engine.history import ChainPolicy, LineWriter, saved_infos
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from native.context import ContextSettings

SETTINGS = ContextSettings(n_ctx=2048, n_threads=2)


def _turn(rt, conv: Conversation, writer: LineWriter, i: int, n_predict: int = 6):
    """One turn as the window makes it: the question, the answer, its head."""
    begin_answer(conv, rt, f"Question {i}: name a river and a hill.", n_predict=n_predict)
    generate(rt, conv)
    commit_answer(conv)
    return writer.save_head(conv, KIND_MANUAL)


def _chat(rt, store: Store, turns: int, policy: ChainPolicy | None = None, line: str = "line"):
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    writer = LineWriter(rt, store, line, policy=policy or ChainPolicy())
    heads = [_turn(rt, conv, writer, i) for i in range(turns)]
    return conv, writer, heads


def test_a_conversation_of_many_turns_keeps_few_files(smollm_runtime, tmp_path):
    """Twelve turns: a file per turn before, one now (the head, a full file with the turn
    ends before it as points: all of it is far below ChainPolicy.merge_max_bytes), and
    nothing else left in the store; the head restores in a new context to the same tokens,
    and goes on as the first context does."""
    rt = smollm_runtime
    before, _, _ = _chat(rt, Store(tmp_path / "before"), 12, ChainPolicy(merge_turns=False))
    assert len(load_chain(Graph.scan(tmp_path / "before").heads[0].path)) == 12
    conv, writer, heads = _chat(rt, Store(tmp_path / "now"), 12)
    assert conv.tokens == before.tokens   # greedy: the same conversation either way
    chain = load_chain(heads[-1].path)
    assert len(chain) == 1 and not chain[0].header.is_delta, [d.header.n_tokens for d in chain]
    graph = Graph.scan(tmp_path / "now")
    assert {n.name for n in graph.nodes.values()} == {d.path.name for d in chain}, "absorbed files left behind"
    # every turn end before the last is in the chain: a file's own end or a point of one
    ends = sorted({d.header.n_tokens for d in chain} | {p.n_tokens for d in chain for p in points_of(d)})
    assert ends == [h.n_tokens for h in heads]
    # no cell is stored twice: the files' states cover the tokens once
    assert sum(d.header.n_tokens - d.header.parent_n_tokens for d in chain) == len(conv.tokens)
    second = Runtime(rt.model.path, SETTINGS)
    try:
        resumed = second.restore_chain(chain)
        assert resumed.tokens == conv.tokens
        begin_answer(resumed, second, "And a lake?", n_predict=8)
        begin_answer(conv, rt, "And a lake?", n_predict=8)
        assert generate(second, resumed).text == generate(rt, conv).text
    finally:
        second.close()


def test_editing_any_turn_restores_its_end_exactly(smollm_runtime, tmp_path):
    """For every turn of eight, turn_end finds the end of the turn before (a file's own end,
    or a point of a file that absorbed it); restoring those files and trimming them there
    gives the cache of that turn's end, token for token, and the edited turn's answer is
    the one the file-per-turn layout gives."""
    rt = smollm_runtime
    conv, _, heads = _chat(rt, Store(tmp_path / "now"), 8)
    chain = load_chain(heads[-1].path)
    _, _, old_heads = _chat(rt, Store(tmp_path / "before"), 8, ChainPolicy(merge_turns=False))
    old_chain = load_chain(old_heads[-1].path)
    fresh = Runtime(rt.model.path, SETTINGS)
    points = 0
    try:
        for turn in range(2, 9):
            messages = conv.messages[:2 * (turn - 1)]   # the history before user turn ``turn``
            k, n, _point = turn_end(chain, messages)
            assert k and n == heads[turn - 2].n_tokens, turn
            points += n < chain[k - 1].header.n_tokens
            assert turn_end(old_chain, messages) == (turn - 1, n, None)
            answers = []
            for files, upto in ((chain[:k], n), (old_chain[:turn - 1], n)):
                restored = fresh.restore_chain(files)
                assert fresh.trim(upto) == upto
                assert fresh.kv_tokens == conv.tokens[:upto]
                restored.tokens = restored.tokens[:upto]
                restored.messages, restored.answer = list(messages), None
                begin_answer(restored, fresh, "Instead: name a mountain.", n_predict=8)
                answers.append(generate(fresh, restored).text)
            assert answers[0] == answers[1], turn
    finally:
        fresh.close()
    assert points >= 3, "no turn end was absorbed as a point"


def test_a_turn_another_line_builds_on_is_not_absorbed(smollm_runtime, tmp_path):
    """A fork from a turn's end holds that file: a later head of the first line stops
    below it (nothing stored twice that a fork needs, and the fork still restores)."""
    rt = smollm_runtime
    store = Store(tmp_path)
    conv, writer, heads = _chat(rt, store, 3)
    chain = load_chain(heads[-1].path)
    fork_point = chain[-1]
    # another line goes on from that file (a branch: its own line, a delta on it)
    rt.trim(fork_point.header.n_tokens)
    fork = Conversation.from_json(fork_point.meta["conversation"], fork_point.tokens.tolist())
    fork_writer = LineWriter(rt, store, "fork", saved_infos(chain))
    begin_answer(fork, rt, "Another question.", n_predict=6)
    generate(rt, fork)
    commit_answer(fork)
    fork_head = fork_writer.save_head(fork, KIND_MANUAL)
    fork_writer.close()
    # the first line goes on: its next heads may not absorb the file the fork builds on
    for i in range(3, 6):
        _turn(rt, conv, writer, i)
    assert fork_point.path.exists()
    assert fork_point.path.name in {d.path.name for d in load_chain(writer.head.path)}
    assert load_chain(fork_head.path)[-2].path == fork_point.path


def test_a_pause_head_is_absorbed_without_a_point(smollm_runtime, tmp_path):
    """A paused answer's head is no turn end: a later merge absorbs it and records the
    turn ends only."""
    rt = smollm_runtime
    store = Store(tmp_path)
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    writer = LineWriter(rt, store, "line")
    heads = [_turn(rt, conv, writer, 0)]
    begin_answer(conv, rt, "Tell me a long story.", n_predict=16)
    generate(rt, conv, stop_after=6)
    paused = writer.save_head(conv, KIND_PAUSE)
    generate(rt, conv)
    commit_answer(conv)
    heads.append(writer.save_head(conv, KIND_MANUAL))
    heads += [_turn(rt, conv, writer, i, n_predict=16) for i in (2, 3)]
    chain = load_chain(heads[-1].path)
    ends = [d.header.n_tokens for d in chain]
    points = [p.n_tokens for d in chain for p in points_of(d)]
    assert paused.n_tokens not in ends + points and not paused.path.exists()
    assert sorted(ends + points) == [h.n_tokens for h in heads]
    assert len(chain) < len(heads)


def test_a_sliding_window_keeps_a_file_per_turn(gemma_path, tmp_path):
    """A sliding window's state exists only at a file's end: no turn is absorbed (recurrent
    and hybrid memories' points carry their recurrent states: tests/test_point_states.py)."""
    rt = Runtime(gemma_path, SETTINGS)
    try:
        _conv, _writer, heads = _chat(rt, Store(tmp_path), 4)
        assert len(load_chain(heads[-1].path)) == 4
    finally:
        rt.close()


def test_points_in_hostile_metadata_are_ignored(smollm_runtime, tmp_path):
    """Points that are no counts, or lie outside the file's own cells, are never used."""
    rt = smollm_runtime
    _conv, _writer, heads = _chat(rt, Store(tmp_path), 4)
    data = load_chain(heads[-1].path)[-1]   # the head, the turn ends before it as points
    good = points_of(data)
    assert good
    for bad in (None, "x", [1, 2], [{"n_tokens": "5", "n_messages": 2}],
                [{"n_tokens": data.header.n_tokens, "n_messages": 2}],
                [{"n_tokens": data.header.parent_n_tokens - 1, "n_messages": 2}], [{"n_tokens": 0, "n_messages": 0}],
                [{"n_tokens": True, "n_messages": 2}], [{"n_tokens": 40, "n_messages": -1}]):
        data.meta["points"] = bad
        assert points_of(data) == []


def test_from_turn_on_an_absorbed_turn_equals_continuing_that_turns_file(smollm_runtime, app_home, tmp_path):
    """`run --from-turn 3` on a head that absorbed turn 2's end: the same text as continuing
    the file-per-turn layout's own file of turn 2, with the turn's tokens restored, not
    decoded again."""
    import json

    from conftest import run_cli
    rt = smollm_runtime
    _conv, _, heads = _chat(rt, Store(), 4)
    assert len(load_chain(heads[-1].path)) < 4
    _, _, old_heads = _chat(rt, Store(tmp_path / "before"), 4, ChainPolicy(merge_turns=False))
    common = ["-n", "8", "--temp", "0", "--seed", "3", "--ignore-eos", "--json"]

    def run(*args):
        done = run_cli("run", *common, *args, check=True)
        assert "read again" not in done.stderr, done.stderr
        return json.loads(done.stdout.strip().splitlines()[-1])

    edited = run("--checkpoint-load", str(heads[-1].path), "--from-turn", "3", "-p", "A mountain, then?")
    reference = run("--checkpoint-load", str(old_heads[1].path), "-p", "A mountain, then?")
    assert edited["n_prompt_tokens"] == reference["n_prompt_tokens"]   # the same history
    assert edited["text"] == reference["text"]
    assert edited["n_reused_tokens"] >= heads[1].n_tokens


def test_editing_the_last_message_after_merges_stores_only_its_own_turn(smollm_runtime, tmp_path):
    """The previous turn's end is a point of the head: an Edit of the last message (a new line
    on the same files, as the window's branch makes it; Regenerate goes back to a point after
    it) is cut from the head there and stores only the new turn's cells, not the turns the
    head absorbed; the head stays its own line's head (the first version of the turn)."""
    import uuid
    rt = smollm_runtime
    store = Store(tmp_path)
    for turns in (5, 8, 9):   # after merges of several sizes
        conv, writer, heads = _chat(rt, store, turns, line=uuid.uuid4().hex)
        chain = load_chain(heads[-1].path)
        assert len(chain) == 1 and heads[-2].n_tokens in [p.n_tokens for p in points_of(chain[-1])]
        branch = LineWriter.starting(rt, store, uuid.uuid4().hex, writer.chain)
        writer.close()
        conv.messages, conv.answer = conv.messages[:-2], None
        conv.tokens = conv.tokens[:heads[-2].n_tokens]
        begin_answer(conv, rt, "Something else entirely: a lake?", n_predict=6)
        generate(rt, conv)
        commit_answer(conv)
        again = branch.save_head(conv, KIND_MANUAL)
        branch.close()
        # cut where the edited message starts: the previous turn's end, and the template's
        # tokens that open the next user message
        assert heads[-2].n_tokens <= again.parent_n_tokens < heads[-2].n_tokens + 8, turns
        assert again.path.stat().st_size < heads[-1].path.stat().st_size / 2, turns
        assert load_chain(again.path)[0].path == heads[-1].path
        graph = Graph.scan(store)
        assert heads[-1].path.name in {h.name for h in graph.heads}, "the first version of the turn is gone"
        assert again.path.name in {h.name for h in graph.heads}


def test_past_the_bound_a_head_absorbs_no_more(smollm_runtime, tmp_path):
    """With ``merge_max_bytes`` of a few turns (and no tiers beyond it), the turns go on in
    files that hold at most that much of earlier turns, and their own, still with every
    turn's end in the chain."""
    rt = smollm_runtime
    _conv, _, first = _chat(rt, Store(tmp_path / "probe"), 1)
    bound = 3 * first[0].size
    _conv, _, heads = _chat(rt, Store(tmp_path / "store"), 12,
                            ChainPolicy(merge_max_bytes=bound, tier_max_bytes=bound))
    chain = load_chain(heads[-1].path)
    sizes = [d.path.stat().st_size for d in chain]
    assert max(sizes) <= bound + first[0].size, sizes   # (a turn's own file: first[0])
    assert 3 <= len(chain) < 12, sizes
    ends = sorted({d.header.n_tokens for d in chain} | {p.n_tokens for d in chain for p in points_of(d)})
    assert ends == [h.n_tokens for h in heads]


def test_past_the_bound_turns_go_on_in_tiers(smollm_runtime, tmp_path):
    """A model whose turn alone exceeds ``merge_max_bytes`` (Llama-3-8B's: 68 KiB a token)
    kept a file per turn.  Now a head absorbs a file that holds no more tokens of its own
    than the head will above it: after every turn the chain holds O(log n) files, every
    turn's end is in it (a file's end or a point) and restores to its tokens, and all the
    saves together wrote each cell O(log n) times."""
    import math
    rt = smollm_runtime
    _conv, _, first = _chat(rt, Store(tmp_path / "probe"), 1)
    policy = ChainPolicy(merge_max_bytes=first[0].size // 2)   # (no turn fits the plain bound)
    store = Store(tmp_path / "store")
    rt.trim(0)
    conv = Conversation(sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
    writer = LineWriter(rt, store, "line", policy=policy)
    heads = []
    for turn in range(1, 13):
        heads.append(_turn(rt, conv, writer, turn - 1))
        chain = load_chain(heads[-1].path)
        assert len(chain) <= math.floor(math.log2(turn)) + 1, (turn, [d.header.n_tokens for d in chain])
    ends = sorted({d.header.n_tokens for d in chain} | {p.n_tokens for d in chain for p in points_of(d)})
    assert ends == [h.n_tokens for h in heads]
    held = sum(d.path.stat().st_size for d in chain)
    assert writer.bytes_written <= (math.log2(12) + 2) * held, (writer.bytes_written, held)
    for k in (3, 7):
        depth, n, point = turn_end(chain, conv.messages[:2 * k])
        rt.restore_chain(chain[:depth])
        assert rt.trim(n, point) == n == heads[k - 1].n_tokens and rt.kv_tokens == conv.tokens[:n]


def test_a_shared_prefix_is_never_absorbed(smollm_runtime, tmp_path):
    """A conversation on the store's shared prefix of its system prompt merges its own turns
    above it; the prefix stays, and the next conversation with that system prompt builds on it."""
    from engine.checkpoints.graph import is_shared_line, line_of
    rt = smollm_runtime
    store = Store(tmp_path)
    system = "You are the careful assistant of a shipping company; answer briefly. " * 24

    def chat(turns: int):
        rt.trim(0)
        conv = Conversation(system_prompt=system, sampler=SamplerSettings(temperature=0.0, ignore_eos=True))
        writer = LineWriter.starting(rt, store, conv.id.hex)
        heads = [_turn(rt, conv, writer, i) for i in range(turns)]
        writer.close()
        return load_chain(heads[-1].path)

    chain = chat(6)
    prefix = chain[0]
    assert is_shared_line(line_of(prefix.meta, prefix.header)), "the conversation did not start on a shared prefix"
    assert len(chain) == 2 and chain[1].header.parent_n_tokens == prefix.header.n_tokens
    assert prefix.path.exists()
    assert chat(2)[0].path == prefix.path
