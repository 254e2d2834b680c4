"""Tiny random-weight GGUF models of llama.cpp's recurrent and hybrid architectures.

Test fixtures, generated at test time with the ``gguf`` package (PyPI): a few MB each,
deterministic for a seed, loadable and runnable by the pinned llama.cpp (llama-cpp-python
0.3.36, llama.cpp ``0c1e57098``).  They carry SmolLM2's tokenizer (vocabulary, merges,
token types, special ids, chat template), copied from the default model's GGUF, so prompts
tokenize exactly as with the app's default model.  Random weights prove exactness (logits,
state bytes), not quality: compare logits and state bytes, not text.

    build(arch, path, *, seed=0, n_layer=None, chat_template=None, shape=TINY) -> path

Architectures (:data:`ARCHS`, in this order) and their memory (:data:`KIND`):

==============  ==========  ===============================================================
arch            memory      layers (default n_layer)
==============  ==========  ===============================================================
mamba2          recurrent   2 Mamba-2 (SSD) layers
lfm2            hybrid      conv, attn, conv, attn (short convolutions + GQA attention);
                            per-layer ``head_count_kv`` array, 0 for conv layers, as real
                            LFM2 files have (so ``llama_model_n_head_kv`` = 0: layer 0)
qwen35          hybrid      3 gated delta-net layers + full attention every 4th layer
rwkv7           recurrent   2 RWKV-7 layers
granitehybrid   hybrid      mamba2, attn, mamba2, attn (``head_count_kv`` 0 = Mamba layer)
falcon-h1       hybrid      2 layers, each Mamba-2 and attention side by side (parallel)
llama           attention   2 plain attention layers: the control
==============  ==========  ===============================================================

Shapes (:data:`TINY`, the default :class:`Shape`): ``n_embd`` 64, attention head size 32
(head size 16 fails to create a context with the default q8_0 KV cache), 2 query heads and
1 KV head.  ``token_embd`` (and RWKV-7's separate ``output``) are Q8_0 (49,152 x 64: 3.3
MB instead of 12.6 MB in F32); every other tensor is F32, with small values so logits stay
finite.  Tensor names and shapes follow ``load_arch_tensors`` of ``src/models/<arch>.cpp``
in the vendored llama.cpp, hyperparameter keys its ``load_arch_hparams`` and
``src/llama-arch.cpp``; llama.cpp refuses a file with one tensor too many or too few, so
each builder writes exactly the tensors its loader creates.

All seven load and generate with this llama.cpp; none had to be skipped.

``python tests/tinymodels.py [DIR]`` builds them into DIR and prints, per arch, the file
size, llama.cpp's description and the sequence state size after 1 and 64 tokens.
"""

from __future__ import annotations

import functools
import hashlib
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

#: The architectures this module builds, recurrent and hybrid first, the control last.
ARCHS = ("mamba2", "lfm2", "qwen35", "rwkv7", "granitehybrid", "falcon-h1", "llama")

#: What llama.cpp's memory is for each: "recurrent" (llama_model_is_recurrent), "hybrid"
#: (llama_model_is_hybrid: attention KV cells + recurrent state) or "attention" (KV only).
KIND = {
    "mamba2": "recurrent",
    "lfm2": "hybrid",
    "qwen35": "hybrid",
    "rwkv7": "recurrent",
    "granitehybrid": "hybrid",
    "falcon-h1": "hybrid",
    "llama": "attention",
}

#: Bumped whenever a builder changes what it writes: cached files carry it in their name.
BUILD_VERSION = 2


@dataclass(frozen=True)
class Shape:
    """The widths a model is built with.  The default is the fixtures' (a few MB, every
    test's); a benchmark asks for a real model's widths to get a real model's state sizes
    (the layer pattern and the tokenizer stay the tiny ones)."""

    n_embd: int = 64
    n_ff: int = 128
    head: int = 32         # attention head size (key and value)
    n_head: int = 2
    n_head_kv: int = 1
    gdn_state: int = 32    # qwen35's gated delta net: head size of keys and values
    gdn_k_heads: int = 2
    gdn_v_heads: int = 2
    n_ctx_train: int = 4096   # llama-server caps its slots' context at it
    #: the vocabulary: 0, SmolLM2's 49,152 tokens; more, those padded with unused tokens (a
    #: real model's logits size: Qwen3.5's 248,320)
    n_vocab: int = 0

    @property
    def ssm_inner(self) -> int:
        """Mamba-2's inner size: 2 x n_embd (granite requires it)."""
        return 2 * self.n_embd

    @property
    def rwkv_ff(self) -> int:
        """RWKV-7's channel-mix size: 4 x n_embd."""
        return 4 * self.n_embd

    def tag(self) -> str:
        """'' for the default shape, else the widths that differ, for file names."""
        changed = [f"{f.name}{getattr(self, f.name)}" for f in fields(self)
                   if getattr(self, f.name) != f.default]
        return "-".join(changed)


TINY = Shape()
RMS_EPS = 1e-5
# Weights N(0, (MATRIX_GAIN / sqrt(fan_in))^2); embeddings N(0, EMBD_STD^2).  The output
# is tied to the embeddings: with larger embeddings (0.1) the attention models repeat their
# input token forever (the embedding's self-similarity wins); these give varied greedy text.
MATRIX_GAIN = 1.0
EMBD_STD = 0.02

# Mamba-2 mixers (mamba2, granitehybrid, falcon-h1): inner size Shape.ssm_inner, 4 SSM
# heads (of 32 at the default width), one group, state 16, conv kernel 4.
SSM_STATE = 16
SSM_HEADS = 4
SSM_GROUPS = 1
SSM_CONV = 4

DEFAULT_LAYERS = {"mamba2": 2, "lfm2": 4, "qwen35": 4, "rwkv7": 2, "granitehybrid": 4,
                  "falcon-h1": 2, "llama": 2}


# -- tokenizer ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer() -> tuple:
    """SmolLM2's ``tokenizer.*`` metadata: (key, value, type, sub type) tuples."""
    import gguf

    from engine.models import default_model_path
    reader = gguf.GGUFReader(default_model_path())
    out = []
    for field in reader.fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((field.name, field.contents(), vtype, sub))
    return tuple(out)


# -- writing -------------------------------------------------------------------------------

class _Writer:
    """A GGUFWriter with deterministic random tensors given in ggml's order {ne0, ne1, ...}."""

    def __init__(self, arch: str, seed: int, chat_template: str | None = None, shape: Shape = TINY) -> None:
        import gguf
        self.gguf = gguf
        self.arch = arch
        self.seed = seed
        self.shape = shape
        self.chat_template = chat_template   # None: SmolLM2's
        self.kv: list[tuple[str, object, object, object]] = []
        self.tensors: list[tuple[str, np.ndarray, object]] = []

    # metadata
    def u32(self, key: str, value: int) -> None:
        self.kv.append((f"{self.arch}.{key}", int(value), self.gguf.GGUFValueType.UINT32, None))

    def f32(self, key: str, value: float) -> None:
        self.kv.append((f"{self.arch}.{key}", float(value), self.gguf.GGUFValueType.FLOAT32, None))

    def i32_array(self, key: str, values) -> None:
        self.kv.append((f"{self.arch}.{key}", [int(v) for v in values], self.gguf.GGUFValueType.ARRAY,
                        self.gguf.GGUFValueType.INT32))

    # tensors
    def rng(self, name: str) -> np.random.Generator:
        # one stream per tensor: a tensor's values depend on the seed and its name only
        return np.random.default_rng([self.seed, zlib.crc32(name.encode())])

    def tensor(self, name: str, ne: tuple[int, ...], init: Callable | str | float = "matrix",
               *, q8: bool = False) -> None:
        shape = tuple(reversed(ne))          # numpy order
        if callable(init):
            data = init(self.rng(name), shape)
        elif init == "matrix":               # weights: N(0, (gain / sqrt(fan_in))^2)
            data = self.rng(name).normal(0.0, MATRIX_GAIN / np.sqrt(ne[0]), shape)
        elif init == "embedding":
            data = self.rng(name).normal(0.0, EMBD_STD, shape)
        else:                                # a constant (norm weights 1, biases 0)
            data = np.full(shape, float(init))
        data = np.ascontiguousarray(data, dtype=np.float32)
        if q8:
            qtype = self.gguf.GGMLQuantizationType.Q8_0
            self.tensors.append((name, self.gguf.quants.quantize(data, qtype), qtype))
        else:
            self.tensors.append((name, data, None))

    def write(self, path: Path) -> None:
        writer = self.gguf.GGUFWriter(str(path), self.arch)
        writer.add_name(f"tiny-{self.arch}-seed{self.seed}")
        for key, value, vtype, sub in self.kv:
            writer.add_key_value(key, value, vtype, sub)
        for key, value, vtype, sub in _smollm2_tokenizer():
            if key == "tokenizer.chat_template" and self.chat_template is not None:
                value = self.chat_template
            pad = _n_vocab(self.shape) - _n_vocab()
            if key == "tokenizer.ggml.tokens" and pad > 0:
                value = [*value, *(f"<unused_{i}>" for i in range(pad))]
            elif key == "tokenizer.ggml.token_type" and pad > 0:
                value = [*value, *([UNUSED_TOKEN] * pad)]
            writer.add_key_value(key, value, vtype, sub)
        for name, data, qtype in self.tensors:
            writer.add_tensor(name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()


def _ssm_a(rng, shape):
    """Mamba's A = -exp(A_log), A in [-16, -1]."""
    return -rng.uniform(1.0, 16.0, shape)


def _ssm_dt_bias(rng, shape):
    """softplus^-1 of a step in [0.001, 0.1], as Mamba initialises dt."""
    dt = np.exp(rng.uniform(np.log(1e-3), np.log(1e-1), shape))
    return np.log(np.expm1(dt))


def _common(w: _Writer, n_layer: int, *, n_ff: int | None = None) -> None:
    s = w.shape
    n_ff = s.n_ff if n_ff is None else n_ff
    w.u32("context_length", s.n_ctx_train)
    w.u32("embedding_length", s.n_embd)
    w.u32("block_count", n_layer)
    w.u32("feed_forward_length", n_ff)
    w.u32("vocab_size", _n_vocab(s))
    w.f32("attention.layer_norm_rms_epsilon", RMS_EPS)
    w.tensor("token_embd.weight", (s.n_embd, _n_vocab(s)), "embedding", q8=True)


#: llama.cpp's token type of a token that is never produced (LLAMA_TOKEN_TYPE_UNUSED)
UNUSED_TOKEN = 5


def _n_vocab(shape: Shape = TINY) -> int:
    """The vocabulary's size: SmolLM2's, or ``shape.n_vocab`` where that is larger."""
    for key, value, _t, _s in _smollm2_tokenizer():
        if key == "tokenizer.ggml.tokens":
            return max(len(value), shape.n_vocab)
    raise RuntimeError("SmolLM2's GGUF has no token list")


def _mamba2_keys(w: _Writer) -> None:
    s = w.shape
    w.u32("ssm.conv_kernel", SSM_CONV)
    w.u32("ssm.inner_size", s.ssm_inner)
    w.u32("ssm.state_size", SSM_STATE)
    w.u32("ssm.time_step_rank", SSM_HEADS)
    w.u32("ssm.group_count", SSM_GROUPS)


def _mamba2_mixer(w: _Writer, i: int, *, conv_bias: bool = True) -> None:
    s = w.shape
    conv_dim = s.ssm_inner + 2 * SSM_GROUPS * SSM_STATE
    d_in_proj = s.ssm_inner + conv_dim + SSM_HEADS            # z, xBC, dt
    b = f"blk.{i}"
    w.tensor(f"{b}.ssm_in.weight", (s.n_embd, d_in_proj))
    w.tensor(f"{b}.ssm_conv1d.weight", (SSM_CONV, conv_dim))
    if conv_bias:
        w.tensor(f"{b}.ssm_conv1d.bias", (conv_dim,), 0.0)
    w.tensor(f"{b}.ssm_dt.bias", (SSM_HEADS,), _ssm_dt_bias)
    w.tensor(f"{b}.ssm_a", (1, SSM_HEADS), _ssm_a)
    w.tensor(f"{b}.ssm_d", (1, SSM_HEADS), 1.0)
    w.tensor(f"{b}.ssm_norm.weight", (s.ssm_inner // SSM_GROUPS, SSM_GROUPS), 1.0)
    w.tensor(f"{b}.ssm_out.weight", (s.ssm_inner, s.n_embd))


def _attention(w: _Writer, i: int, *, q_out: int | None = None, qk_norm: bool = False) -> None:
    s = w.shape
    q_out = s.n_head * s.head if q_out is None else q_out
    b = f"blk.{i}"
    w.tensor(f"{b}.attn_q.weight", (s.n_embd, q_out))
    w.tensor(f"{b}.attn_k.weight", (s.n_embd, s.n_head_kv * s.head))
    w.tensor(f"{b}.attn_v.weight", (s.n_embd, s.n_head_kv * s.head))
    w.tensor(f"{b}.attn_output.weight", (s.n_head * s.head, s.n_embd))
    if qk_norm:
        w.tensor(f"{b}.attn_q_norm.weight", (s.head,), 1.0)
        w.tensor(f"{b}.attn_k_norm.weight", (s.head,), 1.0)


def _ffn(w: _Writer, i: int, *, norm_name: str = "ffn_norm.weight") -> None:
    s = w.shape
    b = f"blk.{i}"
    if norm_name:
        w.tensor(f"{b}.{norm_name}", (s.n_embd,), 1.0)
    w.tensor(f"{b}.ffn_gate.weight", (s.n_embd, s.n_ff))
    w.tensor(f"{b}.ffn_down.weight", (s.n_ff, s.n_embd))
    w.tensor(f"{b}.ffn_up.weight", (s.n_embd, s.n_ff))


# -- the architectures -------------------------------------------------------------------------

def _mamba2(w: _Writer, n_layer: int) -> None:
    # src/models/mamba2.cpp; head_count 0 as convert_hf_to_gguf writes for Mamba
    s = w.shape
    _common(w, n_layer, n_ff=0)
    w.u32("attention.head_count", 0)
    _mamba2_keys(w)
    w.tensor("output_norm.weight", (s.n_embd,), 1.0)
    for i in range(n_layer):
        w.tensor(f"blk.{i}.attn_norm.weight", (s.n_embd,), 1.0)
        _mamba2_mixer(w, i)


def _lfm2_attention_layers(n_layer: int) -> list[bool]:
    return [i % 2 == 1 for i in range(n_layer)]        # conv, attn, conv, attn, ...


def _lfm2(w: _Writer, n_layer: int) -> None:
    # src/models/lfm2.cpp: a layer is a short convolution iff its head_count_kv is 0
    s = w.shape
    if n_layer < 2:
        raise ValueError("lfm2 needs at least 2 layers (conv, attn)")
    attn = _lfm2_attention_layers(n_layer)
    _common(w, n_layer)
    w.u32("attention.head_count", s.n_head)
    w.i32_array("attention.head_count_kv", [s.n_head_kv if a else 0 for a in attn])
    w.f32("rope.freq_base", 1_000_000.0)
    w.u32("shortconv.l_cache", 3)
    w.tensor("token_embd_norm.weight", (s.n_embd,), 1.0)   # LFM2's output norm is named so
    for i, a in enumerate(attn):
        b = f"blk.{i}"
        _ffn(w, i)
        w.tensor(f"{b}.attn_norm.weight", (s.n_embd,), 1.0)
        if a:
            _attention(w, i, q_out=s.n_embd, qk_norm=True)
        else:
            w.tensor(f"{b}.shortconv.conv.weight", (3, s.n_embd))
            w.tensor(f"{b}.shortconv.in_proj.weight", (s.n_embd, 3 * s.n_embd))
            w.tensor(f"{b}.shortconv.out_proj.weight", (s.n_embd, s.n_embd))


QWEN35_ATTENTION_INTERVAL = 4


def _qwen35(w: _Writer, n_layer: int) -> None:
    # src/models/qwen35.cpp: layer i is full attention iff (i + 1) % interval == 0
    s = w.shape
    if n_layer < QWEN35_ATTENTION_INTERVAL:
        raise ValueError(f"qwen35 needs at least {QWEN35_ATTENTION_INTERVAL} layers (one attention layer)")
    _common(w, n_layer)
    w.u32("attention.head_count", s.n_head)
    w.u32("attention.head_count_kv", s.n_head_kv)
    w.u32("attention.key_length", s.head)
    w.u32("attention.value_length", s.head)
    w.u32("rope.dimension_count", s.head)
    w.i32_array("rope.dimension_sections", [6, 5, 5, 0])     # sums to rope dims / 2
    w.f32("rope.freq_base", 10_000_000.0)
    w.u32("full_attention_interval", QWEN35_ATTENTION_INTERVAL)
    key_dim, value_dim = s.gdn_state * s.gdn_k_heads, s.gdn_state * s.gdn_v_heads
    w.u32("ssm.conv_kernel", 4)
    w.u32("ssm.inner_size", value_dim)
    w.u32("ssm.state_size", s.gdn_state)
    w.u32("ssm.time_step_rank", s.gdn_v_heads)
    w.u32("ssm.group_count", s.gdn_k_heads)
    w.tensor("output_norm.weight", (s.n_embd,), 1.0)
    for i in range(n_layer):
        b = f"blk.{i}"
        w.tensor(f"{b}.attn_norm.weight", (s.n_embd,), 1.0)
        w.tensor(f"{b}.post_attention_norm.weight", (s.n_embd,), 1.0)
        if (i + 1) % QWEN35_ATTENTION_INTERVAL == 0:
            _attention(w, i, q_out=s.n_head * s.head * 2, qk_norm=True)   # query + gate
        else:
            w.tensor(f"{b}.attn_qkv.weight", (s.n_embd, 2 * key_dim + value_dim))
            w.tensor(f"{b}.attn_gate.weight", (s.n_embd, value_dim))
            w.tensor(f"{b}.ssm_conv1d.weight", (4, 2 * key_dim + value_dim))
            w.tensor(f"{b}.ssm_dt.bias", (s.gdn_v_heads,), _ssm_dt_bias)
            w.tensor(f"{b}.ssm_a", (s.gdn_v_heads,), _ssm_a)
            w.tensor(f"{b}.ssm_beta.weight", (s.n_embd, s.gdn_v_heads))
            w.tensor(f"{b}.ssm_alpha.weight", (s.n_embd, s.gdn_v_heads))
            w.tensor(f"{b}.ssm_norm.weight", (s.gdn_state,), 1.0)
            w.tensor(f"{b}.ssm_out.weight", (value_dim, s.n_embd))
        _ffn(w, i, norm_name="")


RWKV_HEAD = 32
RWKV_LORA = 8


def _rwkv7(w: _Writer, n_layer: int) -> None:
    # src/models/rwkv7.cpp
    s = w.shape
    w.u32("context_length", s.n_ctx_train)
    w.u32("embedding_length", s.n_embd)
    w.u32("block_count", n_layer)
    w.u32("feed_forward_length", s.rwkv_ff)
    w.u32("vocab_size", _n_vocab(w.shape))
    w.u32("attention.head_count", 0)
    w.f32("attention.layer_norm_epsilon", 1e-5)
    w.u32("wkv.head_size", RWKV_HEAD)
    for key in ("decay_lora_rank", "iclr_lora_rank", "value_residual_mix_lora_rank", "gate_lora_rank"):
        w.u32(f"attention.{key}", RWKV_LORA)
    w.u32("token_shift_count", 2)
    E, L = s.n_embd, RWKV_LORA
    w.tensor("token_embd.weight", (E, _n_vocab(w.shape)), "embedding", q8=True)
    w.tensor("token_embd_norm.weight", (E,), 1.0)
    w.tensor("token_embd_norm.bias", (E,), 0.0)
    w.tensor("output_norm.weight", (E,), 1.0)
    w.tensor("output_norm.bias", (E,), 0.0)
    w.tensor("output.weight", (E, _n_vocab(w.shape)), "embedding", q8=True)

    def uniform(rng, shape):
        return rng.uniform(0.0, 1.0, shape)

    def small(rng, shape):
        return rng.normal(0.0, 0.1, shape)

    for i in range(n_layer):
        b = f"blk.{i}"
        for norm in ("attn_norm", "attn_norm_2", "time_mix_ln"):
            w.tensor(f"{b}.{norm}.weight", (E,), 1.0)
            w.tensor(f"{b}.{norm}.bias", (E,), 0.0)
        for x in ("w", "a", "v"):
            w.tensor(f"{b}.time_mix_{x}0.weight", (E,), small)
            w.tensor(f"{b}.time_mix_{x}1.weight", (E, L))
            w.tensor(f"{b}.time_mix_{x}2.weight", (L, E))
        w.tensor(f"{b}.time_mix_g1.weight", (E, L))
        w.tensor(f"{b}.time_mix_g2.weight", (L, E))
        w.tensor(f"{b}.time_mix_lerp_fused.weight", (E, 1, 1, 6), uniform)
        w.tensor(f"{b}.time_mix_k_k.weight", (E,), 0.85)
        w.tensor(f"{b}.time_mix_k_a.weight", (E,), 1.0)
        w.tensor(f"{b}.time_mix_r_k.weight", (E,), small)
        for m in ("key", "value", "receptance", "output"):
            w.tensor(f"{b}.time_mix_{m}.weight", (E, E))
        w.tensor(f"{b}.channel_mix_lerp_k.weight", (E, 1, 1), uniform)
        w.tensor(f"{b}.channel_mix_key.weight", (E, s.rwkv_ff))
        w.tensor(f"{b}.channel_mix_value.weight", (s.rwkv_ff, E))


def _granitehybrid(w: _Writer, n_layer: int) -> None:
    # src/models/granite-hybrid.cpp: a layer is Mamba-2 iff its head_count_kv is 0
    s = w.shape
    if n_layer < 2:
        raise ValueError("granitehybrid needs at least 2 layers (mamba2, attn)")
    attn = _lfm2_attention_layers(n_layer)
    _common(w, n_layer)
    w.u32("attention.head_count", s.n_head)
    w.i32_array("attention.head_count_kv", [s.n_head_kv if a else 0 for a in attn])
    w.f32("rope.freq_base", 10_000.0)
    _mamba2_keys(w)
    w.tensor("output_norm.weight", (s.n_embd,), 1.0)
    for i, a in enumerate(attn):
        w.tensor(f"blk.{i}.attn_norm.weight", (s.n_embd,), 1.0)
        if a:
            _attention(w, i)
        else:
            _mamba2_mixer(w, i)
        _ffn(w, i)


def _falcon_h1(w: _Writer, n_layer: int) -> None:
    # src/models/falcon-h1.cpp: every layer has a Mamba-2 mixer and attention in parallel.
    # Its loader names the FFN norm "blk.N.ffn_norm", without ".weight".
    s = w.shape
    _common(w, n_layer)
    w.u32("attention.head_count", s.n_head)
    w.u32("attention.head_count_kv", s.n_head_kv)
    w.u32("attention.key_length", s.head)
    w.u32("attention.value_length", s.head)
    w.f32("rope.freq_base", 10_000.0)
    _mamba2_keys(w)
    w.tensor("output_norm.weight", (s.n_embd,), 1.0)
    for i in range(n_layer):
        _mamba2_mixer(w, i)
        _attention(w, i)
        w.tensor(f"blk.{i}.attn_norm.weight", (s.n_embd,), 1.0)
        _ffn(w, i, norm_name="ffn_norm")


def _llama(w: _Writer, n_layer: int) -> None:
    # src/models/llama.cpp
    s = w.shape
    _common(w, n_layer)
    w.u32("attention.head_count", s.n_head)
    w.u32("attention.head_count_kv", s.n_head_kv)
    w.u32("rope.dimension_count", s.head)
    w.f32("rope.freq_base", 10_000.0)
    w.tensor("output_norm.weight", (s.n_embd,), 1.0)
    for i in range(n_layer):
        w.tensor(f"blk.{i}.attn_norm.weight", (s.n_embd,), 1.0)
        _attention(w, i)
        _ffn(w, i)


_BUILDERS = {"mamba2": _mamba2, "lfm2": _lfm2, "qwen35": _qwen35, "rwkv7": _rwkv7,
             "granitehybrid": _granitehybrid, "falcon-h1": _falcon_h1, "llama": _llama}


def build(arch: str, path: Path, *, seed: int = 0, n_layer: int | None = None,
          chat_template: str | None = None, shape: Shape = TINY) -> Path:
    """Write a tiny random-weight GGUF of ``arch`` to ``path`` (atomically) and return it.

    The same arch, seed and n_layer give the same bytes.  ``n_layer`` defaults to
    :data:`DEFAULT_LAYERS`; hybrids need enough layers for one attention layer.
    ``chat_template`` replaces SmolLM2's ``tokenizer.chat_template`` (a thinking model's,
    from tests/templates/).  ``shape`` gives other widths (:class:`Shape`).
    """
    if arch not in _BUILDERS:
        raise ValueError(f"unknown tiny architecture {arch!r} (choose from {', '.join(ARCHS)})")
    path = Path(path)
    n_layer = DEFAULT_LAYERS[arch] if n_layer is None else int(n_layer)
    if n_layer < 1:
        raise ValueError(f"n_layer must be positive, not {n_layer}")
    w = _Writer(arch, seed, chat_template, shape)
    _BUILDERS[arch](w, n_layer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        w.write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def file_name(arch: str, *, seed: int = 0, n_layer: int | None = None,
              chat_template: str | None = None, shape: Shape = TINY) -> str:
    """The cache file name for these parameters (includes :data:`BUILD_VERSION`)."""
    n_layer = DEFAULT_LAYERS[arch] if n_layer is None else n_layer
    template = "" if chat_template is None else \
        f"-t{hashlib.sha256(chat_template.encode()).hexdigest()[:12]}"
    widths = f"-{shape.tag()}" if shape != TINY else ""
    return f"tiny-{arch}-L{n_layer}-s{seed}{template}{widths}-v{BUILD_VERSION}.gguf"


def cached(arch: str, folder: Path, *, seed: int = 0, n_layer: int | None = None,
           chat_template: str | None = None, shape: Shape = TINY) -> Path:
    """``folder/<file_name>``, built unless already there (many tests share one file)."""
    path = Path(folder) / file_name(arch, seed=seed, n_layer=n_layer, chat_template=chat_template, shape=shape)
    if not path.is_file():
        build(arch, path, seed=seed, n_layer=n_layer, chat_template=chat_template, shape=shape)
    return path


def digest(path: Path) -> str:
    """sha256 of a built file (for determinism checks)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _report(folder: Path) -> None:
    """Print, per arch: file size, llama.cpp's description, memory kind, and the sequence
    state size after 1 and 64 tokens (full / PARTIAL_ONLY), on the app's default context."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from native.context import Context, ContextSettings
    from native.library import bindings
    from native.model import Model
    ll = bindings()
    print(f"{'arch':14} {'bytes':>9}  {'description':32} {'kind':9} {'state@1':>8} {'@64':>8} "
          f"{'partial@1':>9} {'@64':>8}")
    for arch in ARCHS:
        path = cached(arch, folder)
        with Model(path) as model, Context(model, ContextSettings(n_ctx=256, n_threads=2)) as ctx:
            tokens = (model.tokenize("The quick brown fox jumps over the lazy dog.", add_special=True) * 8)[:64]
            sizes = []
            for lo, hi in ((0, 1), (1, 64)):
                ctx.decode(tokens[lo:hi], lo)
                sizes.append((ctx.state_size(0), int(ll.llama_state_seq_get_size_ext(ctx.ptr, 0, 1))))
            print(f"{arch:14} {path.stat().st_size:>9}  {model.description:32} {KIND[arch]:9} "
                  f"{sizes[0][0]:>8} {sizes[1][0]:>8} {sizes[0][1]:>9} {sizes[1][1]:>8}")


if __name__ == "__main__":
    import sys
    import tempfile
    _report(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tiny-models-")))
