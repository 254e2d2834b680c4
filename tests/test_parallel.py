"""Several conversations in one unified KV cache, against the real models.

The contract tested: with the default cache (q8_0 K/V, flash attention, unified), a
conversation's answer generated together with others — prompts prefilled jointly,
2 or 4 answers per decode, paused mid-way and resumed, evicted and restored into
another sequence — is byte-identical to the same answer generated alone by
``engine.generation.generate`` on a single-sequence Runtime.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from engine.checkpoints.chain import load_chain
from engine.concurrent import Batcher, Job
from engine.conversation import Conversation
from engine.generation import begin_answer, generate
from engine.parallel import FILE_SEQ_MAX, ParallelRuntime
from engine.runtime import Runtime
from engine.sampling import SamplerSettings
from native.context import ContextSettings

PROMPTS = ["Write a few lines about lighthouses.", "What is the capital of France? Explain.",
           "Tell me a short story about a cat who learns to swim.", "List three fruits and their colours."]
N = 32
SETTINGS = ContextSettings(n_ctx=2048, n_threads=2)


def new_conv(runtime, i: int, temp: float) -> Conversation:
    conv = Conversation(sampler=SamplerSettings(temperature=temp, seed=1000 + i, ignore_eos=True))
    begin_answer(conv, runtime, PROMPTS[i], n_predict=N)
    return conv


@pytest.fixture(scope="module")
def alone(request):
    """Each prompt's answer generated alone (by the single-sequence path), per model and temperature."""
    cache: dict = {}

    def get(model_path, temp: float) -> list[str]:
        key = (str(model_path), temp)
        if key not in cache:
            rt = Runtime(model_path, SETTINGS)
            try:
                texts = []
                for i in range(len(PROMPTS)):
                    rt.trim(0)
                    texts.append(generate(rt, new_conv(rt, i, temp)).text)
            finally:
                rt.close()
            cache[key] = texts
        return cache[key]
    return get


@pytest.fixture(scope="module")
def smollm_parallel(smollm_path):
    prt = ParallelRuntime(smollm_path, SETTINGS, sequences=4)
    yield prt
    prt.close()


def reset(prt: ParallelRuntime) -> None:
    for key in prt.table.residents():
        prt.evict(key)


def run_together(prt: ParallelRuntime, indices, temp: float, **batcher) -> dict[int, Job]:
    reset(prt)
    b = Batcher(prt, **batcher)
    jobs = {}
    for i in indices:
        conv = new_conv(prt, i, temp)
        jobs[i] = Job(conv, prt.place(conv.id, running=True).seq)
        b.add(jobs[i])
    b.run()
    return jobs


@pytest.mark.parametrize("temp", [0.0, 0.8])
@pytest.mark.parametrize("count", [2, 4])
def test_answers_generated_together_equal_their_runs_alone(smollm_parallel, smollm_path, alone, temp, count):
    prt = smollm_parallel
    decodes = prt.decodes
    jobs = run_together(prt, range(count), temp)
    expected = alone(smollm_path, temp)
    for i, job in jobs.items():
        assert job.result.n_generated == N
        assert job.result.text == expected[i], f"answer {i} differs when generated with {count - 1} others"
    # one joint prefill (the prompts fit in one batch), then one decode per token for all
    assert prt.exact_width == 4
    assert prt.decodes - decodes == 1 + N


def test_a_paused_answer_resumes_in_place_and_after_eviction(smollm_parallel, smollm_path, alone, tmp_path):
    """Answer 0 pauses after 9 tokens (saved at once while 1 keeps going); it resumes
    from the sequence it never left, and again after being evicted and restored from
    its file into another sequence; both equal the uninterrupted run."""
    prt = smollm_parallel
    expected = alone(smollm_path, 0.8)
    saved = {}

    def on_stopped(job):
        if job.result.paused:
            saved[job.seq] = prt.save(tmp_path / f"seq{job.seq}.kvckpt", job.conv, job.seq)
            prt.table.finish(job.conv.id)

    reset(prt)
    b = Batcher(prt, on_stopped=on_stopped)
    convs = [new_conv(prt, i, 0.8) for i in (0, 1)]
    jobs = [Job(c, prt.place(c.id, running=True).seq) for c in convs]
    jobs[0].stop_after = 9
    for job in jobs:
        b.add(job)
    b.run()
    first = jobs[0].result.text
    assert jobs[0].result.paused and jobs[0].result.n_generated == 9
    assert jobs[1].result.text == expected[1]
    path = saved[jobs[0].seq].path

    # resumed where it is: nothing restored, nothing prefilled
    misses = prt.table.misses
    placement = prt.place(convs[0].id, running=True)
    assert placement.resident
    resumed = Job(convs[0], placement.seq)
    b = Batcher(prt)
    b.add(resumed)
    b.run()
    assert resumed.result.n_prefilled == 0 and prt.table.misses == misses
    assert first + resumed.result.text == expected[0]

    # evicted, then restored from its file into another sequence
    prt.evict(convs[0].id)
    for key in ("x", "y"):          # take sequence 0 so the restore lands elsewhere
        prt.place(key)
    placement = prt.place("again", running=True)
    conv = prt.restore(load_chain(path), placement.seq)
    assert placement.seq != jobs[0].seq
    again = Job(conv, placement.seq)
    other = new_conv(prt, 2, 0.8)      # and a newcomer prefilled while it runs
    newcomer = Job(other, prt.place(other.id, running=True).seq)
    b = Batcher(prt)
    b.add(again)
    b.add(newcomer)
    b.run()
    assert again.result.n_prefilled == 0, "the restored sequence was prefilled again"
    assert first + again.result.text == expected[0]
    assert newcomer.result.text == expected[2]


def test_a_sequence_saved_from_a_parallel_context_restores_in_a_single_sequence_one(
        smollm_parallel, smollm_path, alone, tmp_path):
    prt = smollm_parallel
    expected = alone(smollm_path, 0.8)
    reset(prt)
    for key in ("a", "b"):
        prt.place(key)
    conv = new_conv(prt, 3, 0.8)
    job = Job(conv, prt.place(conv.id, running=True).seq, stop_after=11)
    assert job.seq == 2
    b = Batcher(prt)
    b.add(job)
    b.run()
    info = prt.save(tmp_path / "from-seq-2.kvckpt", conv, job.seq)
    chain = load_chain(info.path)
    assert chain[0].header.n_seq_max == FILE_SEQ_MAX and chain[0].header.n_tokens == len(conv.tokens)

    rt = Runtime(smollm_path, SETTINGS)       # today's single-sequence restore
    try:
        restored = rt.restore_chain(chain)
        rest = generate(rt, restored)
    finally:
        rt.close()
    assert rest.n_prefilled == 0
    assert job.result.text + rest.text == expected[3]


def test_switching_among_resident_conversations_restores_nothing(smollm_parallel, tmp_path):
    prt = smollm_parallel
    reset(prt)
    convs = {}
    for i in range(4):
        conv = new_conv(prt, i, 0.0)
        seq = prt.place(conv.id).seq
        prt.decode_chunks([(seq, conv.tokens, True)])
        convs[conv.id] = (seq, list(conv.tokens))
    misses, decodes = prt.table.misses, prt.decodes
    for key in [*convs, *reversed(list(convs))]:
        placement = prt.place(key)
        assert placement.resident and placement.seq == convs[key][0]
        assert prt.tokens(placement.seq) == convs[key][1] and prt.has_logits(placement.seq)
    assert prt.table.misses == misses and prt.decodes == decodes
    # a fifth conversation evicts the least recently used idle one: the last switched away from
    fifth = prt.place("fifth")
    assert fifth.evicted == list(convs)[-1] and prt.tokens(fifth.seq) == []


def test_gemma_answers_together_equal_their_runs_alone(gemma_path, alone):
    """Sliding-window layers and repacked Q4_K weights: 4 answers, each prompt prefilled
    in a decode of its own, generated tokens decoded in groups of the measured exact
    width (3 here: CPU kernels multiply 4 rows of such weights otherwise than one)."""
    expected = alone(gemma_path, 0.8)
    prt = ParallelRuntime(gemma_path, SETTINGS, sequences=4)
    try:
        assert 1 <= prt.exact_width < 4
        jobs = run_together(prt, range(4), 0.8)
    finally:
        prt.close()
    assert [jobs[i].result.text for i in range(4)] == expected


def test_files_of_a_single_sequence_context_restore_into_any_sequence_and_bad_ones_change_nothing(
        smollm_parallel, smollm_path, alone, tmp_path):
    from engine.errors import IncompatibleContext
    prt = smollm_parallel
    expected = alone(smollm_path, 0.8)
    rt = Runtime(smollm_path, SETTINGS)
    other = Runtime(smollm_path, ContextSettings(n_ctx=1024, n_threads=2))
    try:
        conv = new_conv(rt, 1, 0.8)
        first = generate(rt, conv, stop_after=7)
        good = rt.save(tmp_path / "single.kvckpt", conv)
        wrong = other.save(tmp_path / "other-ctx.kvckpt", new_conv(other, 1, 0.8))
    finally:
        rt.close()
        other.close()
    reset(prt)
    for key in ("a", "b"):
        prt.place(key)
    placement = prt.place("restored", running=True)
    assert placement.seq == 2
    restored = prt.restore(load_chain(good.path), placement.seq)
    held = list(prt.tokens(placement.seq))
    with pytest.raises(IncompatibleContext):
        prt.restore(load_chain(wrong.path), placement.seq)
    assert prt.tokens(placement.seq) == held and prt.has_logits(placement.seq), "a refused file cost the sequence"
    job = Job(restored, placement.seq)
    b = Batcher(prt)
    b.add(job)
    b.run()
    assert job.result.n_prefilled == 0
    assert first.text + job.result.text == expected[1]


def test_without_flash_attention_no_batch_width_is_promised_exact(smollm_path):
    prt = ParallelRuntime(smollm_path, ContextSettings(n_ctx=512, n_threads=2, flash_attn=False,
                                                       type_k=1, type_v=1), sequences=2)
    try:
        assert prt.exact_width == 0 and prt.decodes == 0
        assert Batcher(prt).width == 2       # nothing to gain from splitting: all at once
    finally:
        prt.close()


def _logits_alone(model_path, pieces) -> np.ndarray:
    """The next-token logits after ``pieces`` (token runs, each one decode) in a cache
    holding nothing else."""
    prt = ParallelRuntime(model_path, ContextSettings(n_ctx=1024, n_threads=2), sequences=2, exact_width=1)
    try:
        for piece in pieces:
            prt.decode_chunks([(1, piece, True)])
        return np.array(prt.logits(1), copy=True)
    finally:
        prt.close()


@pytest.mark.parametrize("model", ["smollm_path", "gemma_path"])
@pytest.mark.parametrize("how", ["delete", "edit"])
def test_a_sequence_grown_into_cells_another_freed_keeps_its_bits(request, model, how):
    """Found by the store's compositions (``[("answer", 0, 24), ("pause", 1, 2), ("edit",
    0, 4) or ("delete", 0, 0), ("pause", 1, 5)]``): conversation B's next turn landed in
    the cells an Edit or a Delete of conversation A freed, below B's first cells; flash
    attention then summed B's cells in another order and B's logits (0.60 apart here),
    and so its files, were not B's alone (engine.parallel: cell order).  Gemma 3: a
    sliding window's cache is packed too."""
    model_path = request.getfixturevalue(model)
    prt = ParallelRuntime(model_path, ContextSettings(n_ctx=1024, n_threads=2), sequences=2, exact_width=1)
    try:
        tokens = prt.model.tokenize("Rivers and hills, roads and towns, lakes and seas, " * 6, add_special=True)
        pieces = [tokens[:12], tokens[12:26], tokens[26:30]]
        prt.decode_chunks([(0, tokens[:30], True)])   # A, then B above it
        prt.decode_chunks([(1, pieces[0], True)])
        for token in tokens[30:34]:                    # both answering: their cells interleave
            prt.decode_tokens({0: token, 1: token})
        prt.trim(1, 12)
        before = prt.repacks
        if how == "delete":
            prt.drop(0)                                # A deleted: B would grow into its cells
        else:
            prt.trim(0, 4)                             # A edited: the same below B's cells
        assert prt.fragmented
        prt.decode_chunks([(1, pieces[1], True)])
        prt.decode_chunks([(1, pieces[2], True)])
        assert prt.repacks == before + 1 and not prt.fragmented
        assert np.array_equal(prt.logits(1), _logits_alone(model_path, pieces))
        if how == "edit":   # A, packed too, still holds what it held
            assert prt.tokens(0) == tokens[:4] and prt.ctx.pos_max(0) == 3
    finally:
        prt.close()


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_a_hybrid_packed_again_keeps_its_bits(tiny_model_path, arch):
    """A hybrid's state holds its recurrent part beside its cells: packed again after a
    Delete of the conversation below it, the other continues as it would alone.  (The
    tiny models' attention gives the same bits in any cell order; what is tested here is
    that packing keeps a hybrid's state whole.)"""
    path = tiny_model_path(arch)
    prt = ParallelRuntime(path, ContextSettings(n_ctx=512, n_threads=2), sequences=2, exact_width=1)
    try:
        tokens = [(7 * i) % 200 + 3 for i in range(40)]
        prt.decode_chunks([(0, tokens[:20], True)])
        prt.decode_chunks([(1, tokens[:10], True)])
        prt.drop(0)
        prt.decode_chunks([(1, tokens[10:25], True)])
        assert prt.repacks == 1
        assert np.array_equal(prt.logits(1), _logits_alone(path, [tokens[:10], tokens[10:25]]))
    finally:
        prt.close()


def test_switching_and_growing_without_freeing_packs_nothing(smollm_parallel):
    prt = smollm_parallel
    reset(prt)   # evicting the others frees cells: packed once, at the next decode
    seqs = [prt.place(key).seq for key in ("a", "b")]
    tokens = prt.model.tokenize("Lakes and seas, rivers and hills.", add_special=True)
    prt.decode_chunks([(seqs[0], tokens, True)])
    before = prt.repacks
    prt.decode_chunks([(seqs[1], tokens, True)])
    prt.decode_tokens({seq: tokens[1] for seq in seqs})
    prt.place("a")
    prt.decode_tokens({seqs[0]: tokens[2]})
    assert prt.repacks == before and not prt.fragmented


@pytest.mark.parametrize("n_batch", [1, 3])
def test_a_batch_smaller_than_the_sequences_loads_and_generates_as_alone(smollm_path, alone, n_batch):
    """``serve -b 3`` or ``run --parallel -b 1``: the exact-width probe feeds its prompts in
    batches that fit (it decoded 5 tokens at once and could not load), and llama.cpp's
    context reserves an output for every sequence whatever the batch (a batch of 1 with
    5 sequences aborted the process)."""
    settings = replace(SETTINGS, n_batch=n_batch, n_ubatch=n_batch)
    prt = ParallelRuntime(smollm_path, settings, sequences=4)
    try:
        assert prt.exact_width >= 1
        jobs = run_together(prt, range(2), 0.8)
    finally:
        prt.close()
    assert [jobs[i].result.text for i in range(2)] == alone(smollm_path, 0.8)[:2]


@pytest.mark.parametrize("arch", ["rwkv7", "lfm2", "llama"])
def test_what_a_sequence_can_go_back_to_is_what_a_trim_keeps(tiny_model_path, arch):
    """ParallelRuntime.can_keep (the worker restores a file when the cache cannot go back
    as far as it shares) says what trim then does: a recurrent or hybrid memory goes back
    only to a snapshot, an attention one anywhere."""
    prt = ParallelRuntime(tiny_model_path(arch), ContextSettings(n_ctx=256, n_threads=2), sequences=1,
                          exact_width=1)
    try:
        tokens = [(5 * i) % 150 + 3 for i in range(30)]
        for n in (7, 12, 29):
            for target in (3, 9, 12, 20, 30, 40):
                prt.drop(0)
                prt.decode_chunks([(0, tokens[:n], False)])
                prt.keep_snapshot(0)                     # a mark at n, as a prompt cut there keeps
                prt.decode_chunks([(0, tokens[n:], True)])
                expected = prt.can_keep(0, target)
                assert prt.tokens(0) == tokens and prt.trim(0, target) == expected, (n, target)
                if arch == "llama":
                    assert expected == min(target, 30)
                else:
                    assert expected == (30 if target >= 30 else n if target >= n else 0), (n, target)
    finally:
        prt.close()


def test_a_sliding_window_packed_again_is_never_cut_where_its_window_has_holes(gemma_path):
    """Packing the cache puts a sequence's state back, and a sliding window's state holds
    only the window before its end (Gemma 3: 512 positions): a later Edit far back must
    not keep cells whose window is gone (the next tokens would see holes, silently wrong),
    so the sequence is read again from there and its logits are its own."""
    settings = ContextSettings(n_ctx=2048, n_threads=2)
    prt = ParallelRuntime(gemma_path, settings, sequences=2, exact_width=1)
    try:
        tokens = prt.model.tokenize("Rivers and hills, roads and towns, lakes and seas. " * 70,
                                    add_special=True)[:720]
        assert 300 < prt.shape.n_swa < len(tokens)
        prt.decode_chunks([(0, tokens[:40], True)])              # A below B
        for start in range(0, 700, 350):
            prt.decode_chunks([(1, tokens[start:start + 350], True)])
        prt.drop(0)                                             # A deleted: B is packed again
        prt.decode_chunks([(1, tokens[700:701], True)])
        assert prt.repacks == 1
        kept = prt.trim(1, 300)                                 # an Edit far back in B
        assert kept == 0     # its window before 300 was not put back: read again, not cut there
        rest = tokens[kept:310]
        for start in range(0, len(rest), 350):
            prt.decode_chunks([(1, rest[start:start + 350], True)])
        got = np.array(prt.logits(1), copy=True)
    finally:
        prt.close()
    assert np.array_equal(got, _logits_alone_in(gemma_path, settings, tokens[:310], kept))


def _logits_alone_in(model_path, settings, tokens, cut: int) -> np.ndarray:
    """The logits after ``tokens`` decoded alone, in the pieces the test above decoded them
    (a sliding window's bits depend on where a prefill was cut)."""
    prt = ParallelRuntime(model_path, settings, sequences=2, exact_width=1)
    try:
        pieces = [tokens[:cut]] if cut else []
        rest = tokens[cut:]
        pieces += [rest[start:start + 350] for start in range(0, len(rest), 350)]
        for piece in pieces:
            prt.decode_chunks([(1, piece, True)])
        return np.array(prt.logits(1), copy=True)
    finally:
        prt.close()


@pytest.mark.parametrize("arch", ["mamba2", "qwen35", "lfm2", "smollm"])
def test_the_probed_width_decodes_each_sequence_as_alone_state_and_all(tiny_model_path, smollm_path, arch):
    """What the exact-width probe vouches for: ``exact_width`` sequences decoded together
    leave each one the state and logits it has decoded alone, for several tokens.  A
    recurrent memory's batched kernels rounded the state otherwise while the token's logits
    came out the same, so the probe said 2 from the logits alone, and ``run --parallel``
    went apart from the prompt run alone from its second token (a user's test)."""
    from engine.snapshots import PromptSnapshot
    path = smollm_path if arch == "smollm" else tiny_model_path(arch)
    settings = ContextSettings(n_ctx=256, n_threads=2)
    prompts = [[(7 * i + 5 * k) % 200 + 3 for i in range(12 - k)] for k in range(4)]

    def decoded(prt: ParallelRuntime, seqs: list[int], width: int) -> list[tuple[np.ndarray, np.ndarray]]:
        for seq in seqs:
            prt.decode_chunks([(seq, prompts[seq], True)])
        for step in range(3):   # ``width`` at a time, as the scheduler decodes them
            for start in range(0, len(seqs), width):
                prt.decode_tokens({seq: 10 + step + seq for seq in seqs[start:start + width]})
        return [(np.array(prt.logits(seq), copy=True), PromptSnapshot.take(prt.ctx, seq, (), None).state)
                for seq in seqs]

    prt = ParallelRuntime(path, settings, sequences=4)
    try:
        width = prt.exact_width
        assert width >= 1
        together = decoded(prt, [0, 1, 2, 3], width)
    finally:
        prt.close()
    for seq in range(4):
        prt = ParallelRuntime(path, settings, sequences=4, exact_width=1)
        try:
            logits, state = decoded(prt, [seq], 1)[0]
        finally:
            prt.close()
        assert np.array_equal(together[seq][0], logits) and np.array_equal(together[seq][1], state), (arch, width, seq)
