"""What crosses the thread boundary between the engine and its front ends: plain,
immutable data, and the listener interface that delivers it.

Front ends (the window, the server, the command line, tests) send typed commands
(engine.commands) and hear the engine thread through a :class:`WorkerListener`, whose
callbacks carry the values below (frozen dataclasses, no native object inside) or
plain numbers and text.  A failure carries its kind (engine.commands.Action), never
only a sentence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path

from engine.checkpoints.compat import Target
from engine.checkpoints.format import Header
from engine.commands import Action
from engine.reasoning import ThinkFormat
from engine.requests import RequestRefusal
from engine.sampling import SamplerSettings


@dataclass(frozen=True)
class ModelOptions:
    path: Path
    n_ctx: int = 4096
    n_threads: int = 0
    n_gpu_layers: int = 0
    llama_lib: str | None = None
    #: remote workers "host:port, ..." that take the n_gpu_layers (native.rpc); "": none
    rpc_servers: str = ""
    #: the rest of the context settings (native.context.ContextSettings): None keeps the
    #: default; the command line's flags (`serve`) set them, the window does not
    n_batch: int | None = None
    flash_attn: bool | None = None
    type_k: int | None = None
    type_v: int | None = None
    main_gpu: int = 0
    rpc_timeout: float | None = None     # seconds a remote worker may take (None: native.rpc's)
    #: conversations the cache holds at once (engine.parallel): resident ones switch without
    #: a restore, and up to this many answers generate together
    sequences: int = 4

    def context_overrides(self) -> dict:
        """ContextSettings fields these options set beyond n_ctx and n_threads."""
        out = {name: getattr(self, name) for name in ("flash_attn", "type_k", "type_v")
               if getattr(self, name) is not None}
        if self.n_batch:
            out["n_batch"] = out["n_ubatch"] = self.n_batch
        return out


@dataclass(frozen=True)
class ModelInfo:
    """The loaded model as the UI may know it (no native object inside)."""
    name: str
    path: Path
    architecture: str
    size: int
    n_ctx: int
    backend: str
    library_path: str
    library_version: str
    #: what checkpoints must fit (engine.checkpoints.compat): the rule the Runtime uses,
    #: as a frozen value other threads may use without waiting for a generation
    target: Target | None = field(default=None, repr=False, compare=False)
    #: the sampler this model starts with, and where that came from (engine.sampling)
    sampling_defaults: SamplerSettings = field(default_factory=SamplerSettings)
    sampling_source: str = ""
    #: conversations resident at once, and how many answers one decode may hold with each
    #: bit-identical to its run alone (engine.parallel.ParallelRuntime.exact_width)
    sequences: int = 1
    exact_width: int = 1
    #: how the model marks its thinking (engine.reasoning), read from its chat template;
    #: None: it does not think.  An answer's text holds its thinking as the model wrote it:
    #: a front end shows the parts with engine.reasoning.split or a Splitter of this format
    thinking: ThinkFormat | None = None

    def incompatibility(self, header: Header, meta: dict | None = None) -> str | None:
        """Why a checkpoint cannot be restored into this model, or None."""
        return self.target.incompatibility(header, meta) if self.target is not None else None


@dataclass(frozen=True)
class ConversationSnapshot:
    """A copy of a conversation for display; the engine thread keeps the original."""
    id: uuid.UUID
    title: str
    transcript: tuple[dict, ...]
    paused: bool
    n_tokens: int
    n_ctx: int
    seed: int
    checkpoint: Path | None
    checkpoint_size: int = 0
    #: per transcript entry: its alternatives among the conversation's branches
    #: (engine.branches.Alternatives), or None where there is only the one shown
    alternatives: tuple = ()


@dataclass(frozen=True)
class GenerationSummary:
    conversation_id: uuid.UUID
    finish_reason: str
    n_generated: int
    n_prompt_tokens: int
    n_reused_tokens: int
    tokens_per_s: float
    text: str
    #: seconds from the command starting on the engine thread to the first token, the
    #: restore below included; None when the answer paused before its first token
    ttft_s: float | None = None
    #: bringing the conversation into the cache from its checkpoint chain first (read,
    #: verify, set state; with a switch, saving the conversation the cache held when its
    #: newest tokens were not on disk yet); 0.0 when the cache already held it
    restore_s: float = 0.0
    #: decoding the prompt tokens the cache lacked, nothing else
    prefill_s: float = 0.0


class WorkerListener:
    """Callbacks the engine thread makes; override what you need.  They must return fast."""

    def on_model_loading(self, fraction: float) -> None: ...
    def on_model_loaded(self, info: ModelInfo) -> None: ...
    def on_model_failed(self, message: str) -> None: ...
    def on_conversation_changed(self, snap: ConversationSnapshot) -> None: ...
    def on_generation_started(self, snap: ConversationSnapshot) -> None: ...
    def on_prefill_progress(self, conv_id: uuid.UUID, done: int, total: int) -> None: ...
    def on_text(self, conv_id: uuid.UUID, delta: str) -> None: ...
    def on_progress(self, conv_id: uuid.UUID, n_tokens: int, n_generated: int,
                    tokens_per_s: float) -> None: ...
    def on_generation_finished(self, summary: GenerationSummary) -> None: ...
    def on_checkpoint_saving(self, conv_id: uuid.UUID, kind: int) -> None: ...
    def on_checkpoint_saved(self, snap: ConversationSnapshot, path: Path, size: int,
                            seconds: float, kind: int) -> None: ...
    def on_conversation_deleted(self, conv_id: uuid.UUID) -> None: ...
    #: a conversation was brought into the cache for use: ``resident`` (it was there: nothing
    #: restored), else ``n_restored`` tokens restored from its files in ``seconds``
    def on_conversation_activated(self, conv_id: uuid.UUID, resident: bool, n_restored: int,
                                  seconds: float) -> None: ...
    def on_exported(self, source: Path, target: Path) -> None: ...
    def on_notice(self, title: str, message: str) -> None: ...
    def on_context_full(self, conv_id: uuid.UUID, text: str, message: str) -> None: ...
    #: ``action`` (engine.commands.Action) says what failed; a front end tells failures apart
    #: by it, never by the message's wording
    def on_error(self, action: Action, message: str) -> None: ...
    def on_stopped(self) -> None: ...
    # requests of another front end (engine.server): each one is tagged with the id it
    # was submitted with; its answer's own callbacks above carry its conversation's id
    def on_request_started(self, request_id: str, snap: ConversationSnapshot) -> None: ...
    def on_request_finished(self, request_id: str, conv_id: uuid.UUID, checkpoint: Path | None) -> None: ...
    def on_request_failed(self, request_id: str, refusal: RequestRefusal) -> None: ...


#: GenerationSummary.finish_reason of an answer stopped by a failure (reported with on_error)
FINISH_ERROR = "error"
