"""A model's memory shape: the one place that reads it, for saving, loading and ``validate``.

What a checkpoint's state depends on in a model is how llama.cpp lays out its memory for
one sequence.  llama.cpp has three kinds of sequence memory:

* **attention**: a KV cache, one K and one V row per layer and token (two caches with a
  sliding window, ``n_swa`` > 0);
* **recurrent** (mamba, mamba2, rwkv6/7): per layer one R row (convolution or token
  shift) and one S row (the SSM/WKV state), a fixed size however long the conversation,
  which cannot drop a tail;
* **hybrid** (lfm2, qwen35/qwen3next, granitehybrid, falcon-h1, jamba, nemotron_h, …):
  an attention KV cache for the attention layers, then a recurrent part for the others.

Everything is computed from the GGUF file's metadata (pure Python, see engine.gguf), so a
file on disk (``validate --model``) and a loaded model give the same answer.  Per-layer
arrays count: real LFM2 and Granite-H files have recurrent layer 0, so llama.cpp's
``llama_model_n_head_kv`` (layer 0) is 0 there, while the attention layers have heads.
``n_head_kv`` here is the largest count of any layer.  The memory kind follows llama.cpp's
own lists (``llm_arch_is_recurrent`` / ``llm_arch_is_hybrid`` in the pinned
``src/llama-arch.cpp``); a loaded model passes llama.cpp's answer, which wins.

Recurrent row sizes (``n_embd_r``, ``n_embd_s``: float32 elements) follow
``llama_hparams::n_embd_r/n_embd_s``; 0 means "not known for this architecture" and the
state walk then checks only their structure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from engine.checkpoints.format import MEMORY_ATTENTION, MEMORY_HYBRID, MEMORY_RECURRENT, recurrent_part_suffices
from engine.gguf import read_metadata

MEMORY_NAMES = {MEMORY_ATTENTION: "attention", MEMORY_RECURRENT: "recurrent", MEMORY_HYBRID: "hybrid"}

RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
#: architectures whose rope is M-RoPE / interleaved M-RoPE (llama_model_rope_type): their
#: KV cells carry a 2D position, 12 more bytes per cell in a state
MROPE_ARCHS = frozenset({"qwen2vl", "paddleocr", "qwen3vl", "qwen3vlmoe", "qwen35", "qwen35moe",
                         "qwen4exp", "qwen3tts"})
#: ... and those that use M-RoPE only when the file has rope sections (llama_hparams::use_mrope)
MROPE_IF_SECTIONS = frozenset({"glm4", "glm4moe", "bailingmoe3", "hunyuan_vl", "dflash"})
HYBRID_ARCHS = frozenset({
    "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
    "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
    "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01"})


def memory_name(kind: int, n_swa: int = 0) -> str:
    """What users read: attention, sliding-window, recurrent or hybrid."""
    if kind == MEMORY_ATTENTION and n_swa:
        return "sliding-window"
    return MEMORY_NAMES.get(kind, f"unknown ({kind})")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide whether a sequence state fits a model."""
    name: str
    architecture: str
    memory: int
    n_vocab: int
    n_layer: int
    n_head_kv: int          # the largest of any layer (0: no attention layer)
    n_embd_head_k: int      # 0 when no layer has attention
    n_embd_head_v: int
    n_swa: int
    n_embd_r: int = 0       # recurrent R row, in float32 elements (0: unknown or none)
    n_embd_s: int = 0       # recurrent S row
    cell_ext: bool = False  # KV cells carry M-RoPE positions (format.FLAG_CELL_EXT)
    n_layer_recurrent: int = 0   # layers with a recurrent state (0: unknown or none)
    #: layer 0's KV head count: what format version 1 headers recorded as n_head_kv
    n_head_kv_first: int = 0

    @property
    def memory_name(self) -> str:
        return memory_name(self.memory, self.n_swa)

    @property
    def snapshot_recurrent_only(self) -> bool:
        """Whether a prompt snapshot (engine.snapshots) may keep only the recurrent part:
        a hybrid whose attention cells can drop a tail (no sliding window)."""
        return self.memory == MEMORY_HYBRID and not self.n_swa

    @property
    def logits_recomputable(self) -> bool:
        """Whether decoding a cache's last token again, alone, gives its logits bit for bit
        when it was decoded alone the first time: an attention memory (its tail can be
        dropped; measured exact for SmolLM2 and for Gemma 3's sliding window, whose
        window still holds what that token sees).  A recurrent state cannot go back a
        token.  A checkpoint of such a cache need not carry its logits (engine.runtime)."""
        return self.memory == MEMORY_ATTENTION

    @property
    def cells_by_position(self) -> bool:
        """Whether any range of positions can be saved and restored on its own: a plain
        attention memory without a sliding window (a window's cells depend on where the
        cache ends).  A shared prefix needs it (engine.shared_prefix)."""
        return self.memory == MEMORY_ATTENTION and not self.n_swa

    @property
    def holds_points(self) -> bool:
        """Whether a file can hold earlier turn ends within its own cells, as points
        (engine.checkpoints.points): an attention memory without a sliding window, whose
        cells before a point are the point's state; or a recurrent memory, or a hybrid
        without a sliding window, whose points also carry their recurrent states (the
        attention cells past a point then drop like any attention tail)."""
        return self.cells_by_position or self.prefix_from_snapshot

    @property
    def prefix_from_snapshot(self) -> bool:
        """Whether a prefix of the cache can be saved alone from a snapshot taken where it
        ends (engine.snapshots): a recurrent memory, or a hybrid without a sliding window,
        whose state at a position exists only where it was taken; the attention cells
        before it (a hybrid's) are then read by position.  A shared prefix of such a model
        needs its prefill cut at the system prompt's end (engine.generation.turn_marks)."""
        return recurrent_part_suffices(self.memory, self.n_swa)

    @property
    def prefix_from_window(self) -> bool:
        """Whether a prefix of the cache can be saved alone where the sliding window before
        its end is whole (a live cache; engine.snapshots.WindowCover): an attention memory
        with a sliding window (Gemma 3).  Its cells at the positions before the end are
        the same whatever follows them (measured byte for byte on Gemma 3 270M), and a
        saved state holds the window before its end."""
        return self.memory == MEMORY_ATTENTION and self.n_swa > 0

    @property
    def has_recurrent(self) -> bool:
        """A recurrent part: a fixed-size snapshot per sequence, which cannot drop a tail."""
        return self.memory != MEMORY_ATTENTION


def read_model_shape(path: str | os.PathLike, *, memory: int | None = None,
                     cell_ext: bool | None = None) -> ModelShape:
    """The shape of the model in GGUF file ``path``; ``memory`` and ``cell_ext``:
    llama.cpp's own answers for a loaded model (they win over the architecture tables)."""
    return shape_from_metadata(read_metadata(path, arrays=True), os.path.basename(path),
                               memory=memory, cell_ext=cell_ext)


def shape_from_metadata(meta: dict[str, Any], default_name: str = "", *, memory: int | None = None,
                        cell_ext: bool | None = None) -> ModelShape:
    arch = str(meta.get("general.architecture", ""))
    if cell_ext is None:
        sections = meta.get(f"{arch}.rope.dimension_sections")
        cell_ext = arch in MROPE_ARCHS or (arch in MROPE_IF_SECTIONS and isinstance(sections, list)
                                           and len(sections) >= 2 and sections[0] > 0 and sections[1] > 0)

    def value(key: str) -> Any:
        return meta.get(f"{arch}.{key}")

    def num(key: str, default: int = 0) -> int:
        v = value(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default

    def per_layer(key: str, default: int = 0) -> int:
        """The largest value of a scalar-or-per-layer key."""
        v = value(key)
        if isinstance(v, list):
            return max((int(x) for x in v if isinstance(x, (int, float))), default=default)
        return num(key, default)

    if memory is None:
        memory = (MEMORY_RECURRENT if arch in RECURRENT_ARCHS else
                  MEMORY_HYBRID if arch in HYBRID_ARCHS else MEMORY_ATTENTION)
    n_embd = num("embedding_length")
    n_head = per_layer("attention.head_count")
    n_head_kv = per_layer("attention.head_count_kv", n_head)
    heads_kv = value("attention.head_count_kv")
    first_kv = int(heads_kv[0]) if isinstance(heads_kv, list) and heads_kv else n_head_kv
    if memory == MEMORY_RECURRENT:
        n_head_kv = 0
    head = n_embd // n_head if n_head else 0
    head_k = num("attention.key_length", head) if n_head_kv else 0
    head_v = num("attention.value_length", head) if n_head_kv else 0
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = tokens[1] if isinstance(tokens, tuple) else num("vocab_size")
    r, s = (_recurrent_rows(value, num, n_embd) if memory != MEMORY_ATTENTION else (0, 0))
    n_layer = num("block_count") - num("nextn_predict_layers")
    return ModelShape(
        name=str(meta.get("general.name", default_name)), architecture=arch, memory=memory,
        # llama.cpp's n_layer leaves out the multi-token-prediction layers (Qwen3.5, GLM)
        n_vocab=int(n_vocab), n_layer=n_layer, n_head_kv=n_head_kv,
        n_embd_head_k=head_k, n_embd_head_v=head_v, n_swa=num("attention.sliding_window"),
        n_embd_r=r, n_embd_s=s, cell_ext=cell_ext and n_head_kv > 0,
        n_head_kv_first=0 if memory == MEMORY_RECURRENT else first_kv,
        n_layer_recurrent=_recurrent_layers(arch, memory, n_layer, value, num))


#: hybrids whose every n-th layer is full attention, the others recurrent (full_attention_interval)
INTERVAL_HYBRIDS = frozenset({"qwen35", "qwen35moe", "qwen3next", "minimax-01", "qwen4exp"})


def _recurrent_layers(arch: str, memory: int, n_layer: int, value, num) -> int:
    """How many layers hold a recurrent state, as llama.cpp's ``is_recr`` decides per
    architecture (src/models/<arch>.cpp); 0 where unknown."""
    if memory == MEMORY_RECURRENT or arch == "falcon-h1":   # falcon-h1: both in every layer
        return n_layer
    if memory != MEMORY_HYBRID:
        return 0
    if arch in INTERVAL_HYBRIDS:
        interval = num("full_attention_interval", 4)
        return sum(1 for i in range(n_layer) if interval and (i + 1) % interval != 0)
    heads = value("attention.head_count_kv")
    if not isinstance(heads, list):
        return 0
    if arch.startswith("nemotron_h"):   # recurrent: no attention and no feed-forward
        ffn = value("feed_forward_length")
        if not isinstance(ffn, list):
            return 0
        # a file's lists may be shorter than n_layer: count the layers both describe
        return sum(1 for h, f in zip(heads[:n_layer], ffn[:n_layer], strict=False) if h == 0 and f == 0)
    return sum(1 for h in heads[:n_layer] if h == 0)


def _recurrent_rows(value, num, n_embd: int) -> tuple[int, int]:
    """(n_embd_r, n_embd_s) as llama_hparams computes them, or 0 where unknown."""
    if num("wkv.head_size"):                        # RWKV: token shift, WKV state
        return num("token_shift_count", 2) * n_embd, n_embd * num("wkv.head_size")
    if num("shortconv.l_cache"):                    # LFM2: short convolution only
        return n_embd * (num("shortconv.l_cache") - 1), 0
    d_conv, d_inner, d_state = num("ssm.conv_kernel"), num("ssm.inner_size"), num("ssm.state_size")
    if d_inner and d_state:                         # Mamba, Mamba 2, gated delta nets
        n_group = num("ssm.group_count")
        return max(d_conv - 1, 0) * (d_inner + 2 * n_group * d_state), d_state * d_inner
    return 0, 0
