"""The one compatibility rule: can this checkpoint be restored into this model and context?

A checkpoint's header records the model it was made with (fingerprint and KV shape) and
the settings that shape the KV cache (context size, K/V types, flash attention, sequence
count, unified cache).  A state restores exactly only into the same of both.  This module
is the only place that compares them:

* :class:`ModelIdentity` describes a model: from its shape (engine.model_shape, the one
  reader of it: for a loaded model and for a GGUF file on disk alike, so ``run`` and
  ``validate --model`` agree), or from a header;
* :class:`ContextShape` describes a KV cache: from context settings or from a header;
* :class:`Target` pairs them (either part may be missing: ``validate --model`` checks
  the model only, the CLI checks the context before it spends time loading the model)
  and answers :meth:`Target.incompatibility` with one sentence, or None.

Frozen, pure Python values: a listing on another thread (the checkpoint browser, the
importer) asks the same question the engine thread asks, without waiting for it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.checkpoints.fingerprint import model_fingerprint
from engine.checkpoints.format import MEMORY_ATTENTION, STATE_LAYOUT, Header
from engine.errors import CheckpointError, IncompatibleContext, IncompatibleModel, IncompatibleState
from engine.model_shape import ModelShape, memory_name, read_model_shape


@dataclass(frozen=True)
class ModelIdentity:
    """What a checkpoint's KV state depends on in a model."""
    name: str
    fingerprint: bytes
    n_vocab: int
    n_layer: int
    n_head_kv: int
    n_embd_head_k: int
    n_embd_head_v: int
    memory: int = MEMORY_ATTENTION
    cell_ext: bool = False
    #: layer 0's KV head count, which version 1 headers recorded (0: as n_head_kv)
    n_head_kv_first: int = 0
    #: bytes of one recurrent R and S row, and the recurrent layers (0: unknown); not in a
    #: header: the state walk compares them with what a file holds
    recurrent_rows: tuple[int, int, int] = (0, 0, 0)

    @classmethod
    def of(cls, name: str, fingerprint: bytes, shape: ModelShape) -> ModelIdentity:
        """From the model's shape (engine.model_shape)."""
        return cls(name=name, fingerprint=fingerprint, n_vocab=shape.n_vocab,
                   n_layer=shape.n_layer, n_head_kv=shape.n_head_kv,
                   n_embd_head_k=shape.n_embd_head_k, n_embd_head_v=shape.n_embd_head_v,
                   memory=shape.memory, cell_ext=shape.cell_ext, n_head_kv_first=shape.n_head_kv_first,
                   recurrent_rows=(4 * shape.n_embd_r, 4 * shape.n_embd_s, shape.n_layer_recurrent))

    @classmethod
    def from_gguf(cls, path: str | Path) -> ModelIdentity:
        """Read from the file alone (GGUF metadata and the sampled fingerprint)."""
        from engine.gguf import GGUFError
        try:
            shape = read_model_shape(path)
        except (GGUFError, OSError) as exc:
            raise IncompatibleModel(str(exc)) from None
        return cls.of(shape.name, model_fingerprint(path), shape)

    @classmethod
    def from_header(cls, header: Header, name: str = "") -> ModelIdentity:
        return cls(name=name, fingerprint=header.model_fingerprint, n_vocab=header.n_vocab,
                   n_layer=header.n_layer, n_head_kv=header.n_head_kv,
                   n_embd_head_k=header.n_embd_head_k, n_embd_head_v=header.n_embd_head_v,
                   memory=header.memory, cell_ext=header.cell_ext)


@dataclass(frozen=True)
class ContextShape:
    """The context settings that decide the KV cache's byte layout."""
    n_ctx: int
    type_k: int
    type_v: int
    flash_attn: bool
    n_seq_max: int
    kv_unified: bool

    @classmethod
    def of(cls, settings: Any, n_ctx: int | None = None) -> ContextShape:
        """From ``native.context.ContextSettings`` (``n_ctx``: what the context really got)."""
        return cls(n_ctx=settings.n_ctx if n_ctx is None else n_ctx, type_k=settings.type_k,
                   type_v=settings.type_v, flash_attn=settings.flash_attn,
                   n_seq_max=settings.n_seq_max, kv_unified=settings.kv_unified)

    @classmethod
    def from_header(cls, header: Header) -> ContextShape:
        return cls(n_ctx=header.n_ctx, type_k=header.type_k, type_v=header.type_v,
                   flash_attn=header.flash_attn, n_seq_max=header.n_seq_max,
                   kv_unified=header.kv_unified)


@dataclass(frozen=True)
class Target:
    """A model and/or a context that checkpoints are restored into."""
    model: ModelIdentity | None = None
    context: ContextShape | None = None

    @classmethod
    def of_header(cls, header: Header) -> Target:
        """The target a checkpoint itself was made for."""
        return cls(ModelIdentity.from_header(header), ContextShape.from_header(header))

    @property
    def key(self) -> str:
        """A string equal for two targets exactly when the same checkpoints fit both:
        every field the rule compares (the name is only for messages)."""
        m, c = self.model, self.context
        if m is None or c is None:
            raise ValueError("a key needs both the model and the context")
        values = [getattr(m, f.name) for f in fields(m)
                  if f.name not in ("name", "recurrent_rows", "n_head_kv_first")]
        values += [getattr(c, f.name) for f in fields(c)]
        return ":".join(v.hex() if isinstance(v, bytes) else str(int(v)) for v in values)

    @property
    def recurrent_rows(self) -> tuple[int, int, int] | None:
        """The model's recurrent state rows (engine.checkpoints.kvstate), None without a model."""
        return self.model.recurrent_rows if self.model is not None else None

    def problem(self, header: Header, meta: dict | None = None) -> CheckpointError | None:
        """The error restoring ``header`` here would raise, or None when it fits."""
        if self.model is not None:   # a loaded model: this build of llama.cpp, its layout
            if header.state_layout != STATE_LAYOUT:
                return IncompatibleState(
                    f"the checkpoint's state was written in llama.cpp state layout "
                    f"{header.state_layout}; this build of llama.cpp reads layout {STATE_LAYOUT}")
            error = _model_problem(self.model, header, meta)
            if error is not None:
                return error
        if self.context is not None:
            return _context_problem(self.context, header)
        return None

    def incompatibility(self, header: Header, meta: dict | None = None) -> str | None:
        """Why ``header`` cannot be restored here (one sentence), or None."""
        error = self.problem(header, meta)
        return None if error is None else str(error)

    def check(self, header: Header, meta: dict | None = None) -> None:
        """Raise IncompatibleModel / IncompatibleContext with the reason, or return."""
        error = self.problem(header, meta)
        if error is not None:
            raise error


def made_with(meta: dict | None) -> str:
    """The name of the model a checkpoint's metadata says it was made with."""
    model = (meta or {}).get("model")
    name = model.get("name") if isinstance(model, dict) else None
    return name if isinstance(name, str) and name else "another model"


def _model_problem(model: ModelIdentity, header: Header, meta: dict | None) -> IncompatibleModel | None:
    if header.model_fingerprint != model.fingerprint:
        return IncompatibleModel(f"this checkpoint was made with {made_with(meta)}; the model is "
                                 f"{model.name or 'another one'} (model fingerprints differ)")
    if header.memory != model.memory:
        return IncompatibleModel(f"the checkpoint holds {memory_name(header.memory, header.n_swa)} memory; "
                                 f"the model has {memory_name(model.memory)} memory")
    if header.cell_ext != model.cell_ext:
        return IncompatibleModel("the checkpoint's KV cells and the model's differ in their "
                                 "position layout (M-RoPE)")
    mismatched = [f"{name} {theirs} (model: {ours})" for name, theirs, ours in (
        ("n_vocab", header.n_vocab, model.n_vocab), ("n_layer", header.n_layer, model.n_layer),
        # version 1 headers recorded layer 0's count, now the largest of any layer
        ("n_head_kv", header.n_head_kv,
         model.n_head_kv_first if header.version == 1 and model.n_head_kv_first else model.n_head_kv),
        ("n_embd_head_k", header.n_embd_head_k, model.n_embd_head_k),
        ("n_embd_head_v", header.n_embd_head_v, model.n_embd_head_v)) if theirs != ours]
    if mismatched:
        return IncompatibleModel("the checkpoint's model shape differs from the model's: "
                                 + ", ".join(mismatched))
    return None


def _context_problem(context: ContextShape, header: Header) -> IncompatibleContext | None:
    # every difference is named at once, so one message tells the user all flags to change
    differences = []
    for name, theirs, ours, unit in (
            ("context size", header.n_ctx, context.n_ctx, " tokens"),
            ("K cache type", kv_type_name(header.type_k), kv_type_name(context.type_k), ""),
            ("V cache type", kv_type_name(header.type_v), kv_type_name(context.type_v), ""),
            ("flash attention", header.flash_attn, context.flash_attn, ""),
            ("sequence count", header.n_seq_max, context.n_seq_max, ""),
            ("unified KV", header.kv_unified, context.kv_unified, "")):
        if theirs != ours:
            differences.append(f"{name} {_show(theirs)}{unit} (this context: {_show(ours)}{unit})")
    if differences:
        return IncompatibleContext("the checkpoint needs " + ", ".join(differences)
                                   + "; exact resumption needs the same settings")
    return None


def kv_type_name(type_id: int) -> str:
    from native.context import KV_TYPES  # the names users type (-ctk q8_0); no native call
    return next((name for name, value in KV_TYPES.items() if value == type_id), f"type {type_id}")


def _show(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
