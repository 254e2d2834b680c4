"""The tiny random-weight models of tests/tinymodels.py, through the app's native layer.

Each one loads, says through llama.cpp what memory it has (recurrent, hybrid, attention),
tokenizes like SmolLM2, generates greedily the same tokens and bit-identical logits in
two fresh contexts, and has a sequence state whose size documents its memory: constant in
the number of tokens for pure recurrent memory, growing (by the attention cells only) for
hybrids.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import tinymodels

from engine.snapshots import PromptSnapshot
from native.context import Context, ContextSettings
from native.library import bindings
from native.model import Model

#: The app's defaults (q8_0 K/V, flash attention, 2 sequences, unified KV), small and 2 threads.
SETTINGS = ContextSettings(n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2)
PROMPT = "<|im_start|>user\nHello, tiny model! Tell me about rivers.<|im_end|>\n<|im_start|>assistant\n"
N_GENERATE = 16
#: llama.h LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: only the SWA / recurrent part of a sequence
PARTIAL_ONLY = 1


@pytest.fixture(scope="module", params=tinymodels.ARCHS)
def tiny(request, tiny_model_path):
    arch = request.param
    model = Model(tiny_model_path(arch))
    yield arch, model
    model.close()


@pytest.fixture(scope="module")
def smollm(smollm_path):
    # the whole model: Model(vocab_only=True) aborts in llama_model_n_head (llama-hparams.cpp:55)
    with Model(smollm_path) as model:
        yield model


def greedy(model: Model, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after ``prompt`` in a fresh context, and the last position's logits."""
    with Context(model, SETTINGS) as ctx:
        ctx.decode(prompt, 0)
        tokens: list[int] = []
        for _ in range(n):
            logits = ctx.logits_last()
            assert np.isfinite(logits).all()
            tokens.append(int(np.argmax(logits)))
            ctx.decode(tokens[-1:], len(prompt) + len(tokens) - 1)
        return tokens, ctx.logits_last().copy()


def state_sizes(model: Model, tokens: list[int], at: tuple[int, ...]) -> dict[int, tuple[int, int]]:
    """{n: (state size, PARTIAL_ONLY state size)} of sequence 0 after ``n`` tokens, for each n."""
    ll = bindings()
    sizes = {}
    with Context(model, SETTINGS) as ctx:
        done = 0
        for n in at:
            ctx.decode(tokens[done:n], done)
            done = n
            # size_t llama_state_seq_get_size_ext(ctx, llama_seq_id seq_id, llama_state_seq_flags flags)
            sizes[n] = (ctx.state_size(0), int(ll.llama_state_seq_get_size_ext(ctx.ptr, 0, PARTIAL_ONLY)))
    return sizes


def test_loads_with_its_memory_kind(tiny):
    arch, model = tiny
    ll = bindings()
    assert model.architecture == arch
    assert model.description.startswith(arch)
    kind = tinymodels.KIND[arch]
    assert bool(ll.llama_model_is_recurrent(model.ptr)) == (kind == "recurrent")
    assert bool(ll.llama_model_is_hybrid(model.ptr)) == (kind == "hybrid")
    if arch in ("lfm2", "granitehybrid"):
        # layer 0 is recurrent, as in real LFM2 / Granite-H files: per-layer shapes must
        # come from the GGUF arrays, not from llama_model_n_head_kv
        assert model.shape.n_head_kv == 0


def test_tokenizes_like_smollm2(tiny, smollm):
    _arch, model = tiny
    assert model.shape.n_vocab == smollm.shape.n_vocab
    assert model.tokenize_prompt(PROMPT) == smollm.tokenize_prompt(PROMPT)
    assert model.chat_template == smollm.chat_template


def test_greedy_generation_is_deterministic(tiny):
    _arch, model = tiny
    prompt = model.tokenize_prompt(PROMPT)
    tokens_a, logits_a = greedy(model, prompt, N_GENERATE)
    tokens_b, logits_b = greedy(model, prompt, N_GENERATE)
    assert tokens_a == tokens_b
    assert logits_a.tobytes() == logits_b.tobytes()
    assert len(set(tokens_a)) > 1, "greedy text is one token repeated: weights too degenerate"


def test_state_size_documents_the_memory(tiny):
    arch, model = tiny
    tokens = (model.tokenize_prompt(PROMPT) * 8)[:64]
    sizes = state_sizes(model, tokens, (1, 64))
    (full_1, partial_1), (full_64, partial_64) = sizes[1], sizes[64]
    kind = tinymodels.KIND[arch]
    if kind == "recurrent":
        assert full_1 == full_64                      # one state, whatever the length
        assert (partial_1, partial_64) == (full_1, full_64)   # PARTIAL_ONLY is ignored
    elif kind == "hybrid":
        assert full_64 > full_1                       # the attention cells grow...
        assert partial_1 == partial_64 < full_1       # ...the recurrent part does not
    else:
        assert full_64 > full_1


def test_builds_are_deterministic(tmp_path, tiny_model_path):
    again = tinymodels.build("mamba2", tmp_path / "again.gguf", seed=0)
    other = tinymodels.build("mamba2", tmp_path / "other.gguf", seed=1)
    assert tinymodels.digest(again) == tinymodels.digest(tiny_model_path("mamba2"))
    assert tinymodels.digest(other) != tinymodels.digest(again)


def test_a_wider_shape_widens_the_state_as_its_widths_say(tmp_path, tiny_model_path):
    """Shape gives a benchmark a real model's state sizes: twice the KV heads, twice the
    attention bytes per token (q8_0: 34 bytes per 32 values, K and V, each attention
    layer); the default shape writes the fixtures' bytes."""
    wide = tinymodels.Shape(n_embd=128, n_head=4, n_head_kv=2, head=32)
    assert tinymodels.file_name("lfm2", shape=wide) != tinymodels.file_name("lfm2")
    assert tinymodels.digest(tinymodels.build("lfm2", tmp_path / "default.gguf", shape=tinymodels.TINY)) \
        == tinymodels.digest(tiny_model_path("lfm2"))
    wide_path = tinymodels.build("lfm2", tmp_path / "wide.gguf", shape=wide)
    growth = {}
    for name, path in (("tiny", tiny_model_path("lfm2")), ("wide", wide_path)):
        with Model(path) as model:
            tokens = (model.tokenize_prompt(PROMPT) * 8)[:64]
            sizes = state_sizes(model, tokens, (1, 64))
        growth[name] = (sizes[64][0] - sizes[1][0]) / 63
    attention_layers = sum(tinymodels._lfm2_attention_layers(tinymodels.DEFAULT_LAYERS["lfm2"]))
    extra_values = (wide.n_head_kv * wide.head) - (tinymodels.TINY.n_head_kv * tinymodels.TINY.head)
    assert growth["wide"] - growth["tiny"] == attention_layers * 2 * extra_values // 32 * 34


def _state(ctx: Context, tokens: list[int], *, recurrent_only: bool = False) -> bytes:
    """Sequence 0's state as engine.snapshots takes it."""
    snapshot = PromptSnapshot.take(ctx, 0, tokens, None, recurrent_only=recurrent_only)
    assert snapshot is not None
    return bytes(snapshot.state)


@pytest.mark.parametrize("arch", [a for a in tinymodels.ARCHS if tinymodels.KIND[a] != "attention"])
def test_a_turn_ends_state_comes_back_from_a_later_one_and_its_recurrent_part(arch, tiny_model_path):
    """What engine.snapshots relies on, and a head that absorbs a hybrid's turns would: the
    state after 200 tokens, then the recurrent part (PARTIAL_ONLY) saved after 120 put
    back, lets llama.cpp drop the attention cells from 120 on; the sequence is then byte
    for byte the state saved at 120, and the next logits are bit-identical.  A hybrid's
    recurrent part is its full state's first 8 bytes and its tail (a writer can take it
    from a file)."""
    settings = replace(SETTINGS, n_batch=256, n_ubatch=256)
    with Model(tiny_model_path(arch)) as model, Context(model, settings) as ctx:
        tokens = (model.tokenize_prompt(PROMPT) * 40)[:200]
        turn_end, later = 120, 200
        ctx.decode(tokens[:turn_end], 0)
        at_turn = _state(ctx, tokens[:turn_end])
        recurrent = _state(ctx, tokens[:turn_end], recurrent_only=True)
        ctx.decode(tokens[turn_end:later], turn_end)
        at_later = _state(ctx, tokens[:later])
        assert not ctx.seq_rm(0, turn_end, -1)          # the recurrent state ends past the cut
        ctx.clear()
        assert ctx.state_set_from(np.frombuffer(at_later, np.uint8), len(at_later), 0)
        assert ctx.state_set_from(np.frombuffer(recurrent, np.uint8), len(recurrent), 0, PARTIAL_ONLY)
        assert ctx.seq_rm(0, turn_end, -1)
        assert _state(ctx, tokens[:turn_end]) == at_turn
        ctx.decode([tokens[turn_end]], turn_end)
        from_later = ctx.logits_last().copy()
        ctx.clear()
        assert ctx.state_set_from(np.frombuffer(at_turn, np.uint8), len(at_turn), 0)
        ctx.decode([tokens[turn_end]], turn_end)
        assert ctx.logits_last().tobytes() == from_later.tobytes()
    if tinymodels.KIND[arch] == "hybrid":
        assert recurrent == at_turn[:8] + at_turn[len(at_turn) - len(recurrent) + 8:]
    else:
        assert recurrent == at_turn                    # PARTIAL_ONLY is ignored: the whole state
