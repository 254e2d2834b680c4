"""A loaded GGUF model: its shape, vocabulary, chat template and tokenizer.

:class:`Model` owns one ``llama_model`` and frees it exactly once (on :meth:`close`,
on leaving a ``with`` block, or when garbage-collected).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from native.errors import ModelLoadError
from native.library import bindings
from native.logs import failure_reason, take_errors

if TYPE_CHECKING:
    from native.rpc import Workers

log = logging.getLogger("native")

#: Called with a fraction in [0, 1] while the weights load; return False to cancel.
ProgressCallback = Callable[[float], bool]

#: n_gpu_layers value meaning "offload every layer" (llama.cpp's own default, -1); on a
#: CPU-only build it is the same as 0.
GPU_LAYERS_ALL = -1

#: llama.h's LLAMA_ROPE_TYPE_MROPE / _IMROPE (GGML_ROPE_TYPE_MROPE = 8; IMROPE = 8 | 32)
ROPE_TYPE_MROPE, ROPE_TYPE_IMROPE = 8, 40


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide whether a KV state fits this model."""
    n_vocab: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_embd: int
    n_embd_head_k: int
    n_embd_head_v: int
    n_ctx_train: int
    n_swa: int


class Model:
    """One loaded llama.cpp model."""

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, main_gpu: int = 0,
                 progress: ProgressCallback | None = None, vocab_only: bool = False,
                 workers: Workers | None = None) -> None:
        self.path = Path(path)
        self._ptr = None
        self._guard = None
        #: where the layers went ("layers: 31 on 127.0.0.1:50052"), with remote workers only
        self.placement: str | None = None
        self.workers = workers
        if not self.path.is_file():
            raise ModelLoadError(f"model file not found: {self.path}")
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"not a GGUF model file: {self.path}")
        ll = self._ll = bindings()
        params = ll.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        if main_gpu:
            # with one GPU (split_mode NONE) main_gpu picks it; with LAYER split it holds
            # the output layer and scratch buffers
            if not 0 <= main_gpu < ll.llama_max_devices():
                raise ModelLoadError(f"main GPU {main_gpu} does not exist "
                                     f"(this build supports up to {ll.llama_max_devices()})")
            params.main_gpu = main_gpu
            params.split_mode = 0  # LLAMA_SPLIT_MODE_NONE: the whole model on that GPU
        if workers is not None:
            if main_gpu:
                raise ModelLoadError("choose either a main GPU or remote workers, not both")
            self._use_workers(params, workers, n_gpu_layers)
        params.vocab_only = vocab_only
        self._progress_cb = None  # referenced while llama.cpp may call it
        guard = self._guard
        if progress is not None or guard is not None:
            def on_progress(fraction: float, _user: ctypes.c_void_p) -> bool:
                if guard is not None:
                    guard.tick()
                try:
                    return bool(progress(fraction)) if progress is not None else True
                except Exception:
                    log.exception("model load progress callback failed")
                    return True
            self._progress_cb = ll.llama_progress_callback(on_progress)
            params.progress_callback = self._progress_cb
        take_errors()   # what llama.cpp logs from here on is this load's
        # a worker that stops answering while the weights go out ends the load (bounded)
        with guard.watching() if guard is not None else contextlib.nullcontext():
            # llama_model * llama_model_load_from_file(const char * path_model, struct llama_model_params params)
            self._ptr = ll.llama_model_load_from_file(os.fsencode(self.path) if os.name != "nt"
                                                      else str(self.path).encode("utf-8"), params)
        if not self._ptr:
            self._stop_guard()
            reason = failure_reason("unsupported architecture, damaged file, or cancelled")
            raise ModelLoadError(f"llama.cpp could not load the model {self.path} ({reason})")
        self._vocab = ll.llama_model_get_vocab(self._ptr)
        self.shape = self._read_shape(layers=not vocab_only)
        if workers is not None:
            from native.rpc import describe_plan, layer_plan
            self.placement = describe_plan(layer_plan(self.shape.n_layer, n_gpu_layers, self._split),
                                           self._devices)
        self.n_gpu_layers = n_gpu_layers
        self.main_gpu = main_gpu
        self._piece_cache: dict[int, bytes] = {}

    # -- ownership -------------------------------------------------------------------
    @property
    def ptr(self):
        if not self._ptr:
            raise ModelLoadError("the model was closed")
        return self._ptr

    def _use_workers(self, params, workers: Workers, n_gpu_layers: int) -> None:
        """Layers on the workers' devices (and this machine's GPUs), split by free memory.

        The split is passed explicitly (``tensor_split``) so that :attr:`placement` says
        exactly where llama.cpp puts each layer (native.rpc.layer_plan, its rule).  The
        socket guard runs from before the load until :meth:`close`: llama.cpp connects
        while loading, and every later wait on a worker must be bounded.
        """
        from native.rpc import device_memory, local_devices
        local = [d for d in local_devices() if d.kind in ("GPU", "iGPU")]
        remote = workers.memory()
        self._devices = [dev for dev, _free, _total in remote] + local
        self._split = [float(free or total) for _dev, free, total in remote] + \
                      [float(device_memory(d)[0]) for d in local]
        if not any(self._split):
            self._split = [1.0] * len(self._devices)
        max_devices = self._ll.llama_max_devices()
        if len(self._devices) > max_devices:
            raise ModelLoadError(f"this llama.cpp build takes at most {max_devices} devices, "
                                 f"not {len(self._devices)}")
        # const ggml_backend_dev_t * devices: NULL-terminated, alive for the whole load
        self._device_array = (ctypes.c_void_p * (len(self._devices) + 1))(
            *[d.ptr for d in self._devices], None)
        self._split_array = (ctypes.c_float * max_devices)(*self._split)
        params.devices = ctypes.cast(self._device_array, ctypes.c_void_p)
        params.tensor_split = self._split_array
        params.n_gpu_layers = n_gpu_layers
        self._guard = workers.guard().start()

    def _stop_guard(self) -> None:
        guard, self._guard = getattr(self, "_guard", None), None
        if guard is not None:
            guard.stop()

    def close(self) -> None:
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr:
            # void llama_model_free(struct llama_model * model)
            self._ll.llama_model_free(ptr)
        self._stop_guard()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    # -- shape and metadata ------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as a string, or None when absent."""
        buf = ctypes.create_string_buffer(4096)
        # int32_t llama_model_meta_val_str(const llama_model * model, const char * key, char * buf, size_t buf_size)
        n = self._ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            self._ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def _read_shape(self, *, layers: bool = True) -> ModelShape:
        ll, m = self._ll, self._ptr
        if not layers:   # vocab-only: llama.cpp has no layers, and aborts when asked for one's
            return ModelShape(n_vocab=ll.llama_vocab_n_tokens(self._vocab), n_layer=0, n_head=0, n_head_kv=0,
                              n_embd=0, n_embd_head_k=0, n_embd_head_v=0, n_ctx_train=0, n_swa=0)
        n_head = ll.llama_model_n_head(m)
        n_embd = ll.llama_model_n_embd(m)
        arch = self.meta("general.architecture") or ""
        default_head = n_embd // n_head if n_head else 0

        def meta_int(key: str, default: int) -> int:
            value = self.meta(f"{arch}.{key}")
            try:
                return int(value) if value is not None else default
            except ValueError:
                return default

        return ModelShape(
            n_vocab=ll.llama_vocab_n_tokens(self._vocab),
            n_layer=ll.llama_model_n_layer(m),
            n_head=n_head,
            n_head_kv=ll.llama_model_n_head_kv(m),
            n_embd=n_embd,
            n_embd_head_k=meta_int("attention.key_length", default_head),
            n_embd_head_v=meta_int("attention.value_length", default_head),
            n_ctx_train=ll.llama_model_n_ctx_train(m),
            n_swa=ll.llama_model_n_swa(m),
        )

    @property
    def name(self) -> str:
        return self.meta("general.name") or self.path.stem

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        self._ll.llama_model_desc(self.ptr, buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    @property
    def is_recurrent(self) -> bool:
        return bool(self._ll.llama_model_is_recurrent(self.ptr))

    @property
    def is_hybrid(self) -> bool:
        """Attention layers and recurrent ones (LFM2, Qwen3.5, Granite-H, Falcon-H1, …)."""
        # bool llama_model_is_hybrid(const struct llama_model * model)
        return bool(self._ll.llama_model_is_hybrid(self.ptr))

    @property
    def memory_kind(self) -> int:
        """llama.cpp's memory kind for this model: 0 attention, 1 recurrent, 2 hybrid
        (the values of engine.checkpoints.format's MEMORY_*)."""
        return 1 if self.is_recurrent else 2 if self.is_hybrid else 0

    @property
    def has_cell_ext(self) -> bool:
        """Whether llama.cpp's KV cells carry 2D positions (M-RoPE: Qwen2-VL, Qwen3-VL,
        Qwen3.5): 12 more bytes per cell in a sequence state."""
        # enum llama_rope_type llama_model_rope_type(const struct llama_model * model)
        return int(self._ll.llama_model_rope_type(self.ptr)) in (ROPE_TYPE_MROPE, ROPE_TYPE_IMROPE)

    @property
    def can_abort_mid_batch(self) -> bool:
        """Whether a decode may be cut short inside a batch.  After an abort llama.cpp
        removes the unfinished micro-batch from memory; a recurrent state cannot drop a
        tail, so for recurrent and hybrid memory that removal fails (and is ignored) and
        the memory would hold half-computed positions.  Those decodes run to their end and
        a pause lands between them."""
        return self.memory_kind == 0

    # -- vocabulary ------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        capacity = len(data) + 16
        for _ in range(2):
            out = (ctypes.c_int32 * capacity)()
            # int32_t llama_tokenize(vocab, text, text_len, tokens, n_tokens_max, add_special, parse_special)
            n = self._ll.llama_tokenize(self._vocab, data, len(data), out, capacity,
                                        add_special, parse_special)
            if n >= 0:
                return list(out[:n])
            capacity = -n
        raise ModelLoadError("tokenization failed")

    def tokenize_prompt(self, text: str) -> list[int]:
        """Tokens of a rendered chat prompt, with BOS added once if the model wants it."""
        tokens = self.tokenize(text, add_special=True, parse_special=True)
        bos = self._ll.llama_vocab_bos(self._vocab)
        if len(tokens) >= 2 and tokens[0] == bos and tokens[1] == bos:
            del tokens[0]  # the template already wrote the BOS text
        return tokens

    def token_to_piece(self, token: int) -> bytes:
        """The bytes of one token as generated text (special tokens rendered empty)."""
        piece = self._piece_cache.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            # int32_t llama_token_to_piece(vocab, token, buf, length, lstrip, special)
            n = self._ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._ll.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            piece = buf.raw[:n]
            self._piece_cache[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.token_to_piece(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self._ll.llama_vocab_is_eog(self._vocab, token))

    @property
    def add_bos(self) -> bool:
        return bool(self._ll.llama_vocab_get_add_bos(self._vocab))

    # -- chat template ----------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        # const char * llama_model_chat_template(const struct llama_model * model, const char * name)
        raw = self._ll.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    def apply_chat_template_native(self, messages: Sequence[tuple[str, str]],
                                   add_assistant: bool) -> str | None:
        """llama.cpp's built-in rendering of the GGUF template; None if it cannot."""
        template = self._ll.llama_model_chat_template(self.ptr, None)
        if not template:
            return None
        keep = [(r.encode("utf-8"), c.encode("utf-8")) for r, c in messages]
        chat = (self._ll.llama_chat_message * len(keep))()
        for i, (role, content) in enumerate(keep):
            chat[i].role = role
            chat[i].content = content
        size = 1024 + 2 * sum(len(c) + len(r) for r, c in keep)
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            # int32_t llama_chat_apply_template(tmpl, chat, n_msg, add_ass, buf, length)
            n = self._ll.llama_chat_apply_template(template, chat, len(keep), add_assistant, buf, size)
            if n < 0:
                return None
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n
        return None
