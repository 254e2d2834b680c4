"""What crosses the thread boundary between the engine and its front ends: plain,
immutable data, and the listener interface that delivers it.

Front ends (the window, the server, the command line, tests) send typed commands
(engine.commands) and hear the engine thread's events: the :class:`Event` dataclasses
below (frozen, no native object inside), delivered to a :class:`WorkerListener`.  A
failure (:class:`Failed`) carries its kind (engine.commands.Action), never only a sentence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from engine.checkpoints.compat import Target
from engine.checkpoints.format import Header
from engine.commands import Action
from engine.reasoning import ThinkFormat
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
class Event:
    """Something the engine thread reports.  Each kind is a frozen dataclass below, delivered
    to :meth:`WorkerListener.on_event`, which hands it to the listener's method named by
    ``handler`` (``on_text`` for :class:`TextDelta`, ...)."""
    handler: ClassVar[str]


@dataclass(frozen=True)
class ModelLoading(Event):
    handler = "on_model_loading"
    fraction: float


@dataclass(frozen=True)
class LeftConversation:
    """A conversation the engine had open with the model it unloaded (``model_name``),
    closed when another model loaded: it stays in the store, its newest head the file at
    ``path`` (``header``), and is opened again like any conversation of another model."""
    id: uuid.UUID
    title: str
    path: Path
    header: Header
    model_name: str


@dataclass(frozen=True)
class ModelLoaded(Event):
    """``left``: the conversations closed because the model loaded is another one."""
    handler = "on_model_loaded"
    info: ModelInfo
    left: tuple[LeftConversation, ...] = ()


@dataclass(frozen=True)
class ModelFailed(Event):
    handler = "on_model_failed"
    message: str


@dataclass(frozen=True)
class ConversationChanged(Event):
    """A conversation's transcript, title, branches or head changed (or it is new)."""
    handler = "on_conversation_changed"
    snap: ConversationSnapshot


@dataclass(frozen=True)
class GenerationStarted(Event):
    handler = "on_generation_started"
    snap: ConversationSnapshot


@dataclass(frozen=True)
class PrefillProgress(Event):
    """``done`` of the ``total`` prompt tokens are in the cache."""
    handler = "on_prefill_progress"
    conv_id: uuid.UUID
    done: int
    total: int


@dataclass(frozen=True)
class TextDelta(Event):
    """More of an answer's text."""
    handler = "on_text"
    conv_id: uuid.UUID
    delta: str


@dataclass(frozen=True)
class Progress(Event):
    """An answer's counts with its text: tokens in the context, generated, and its speed."""
    handler = "on_progress"
    conv_id: uuid.UUID
    n_tokens: int
    n_generated: int
    tokens_per_s: float


@dataclass(frozen=True)
class GenerationSummary(Event):
    """An answer ended: finished, paused, stopped by a failure (``FINISH_ERROR``) or the
    context's end, as ``finish_reason`` says."""
    handler = "on_generation_finished"
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
    #: of the n_generated tokens, those of the model's thinking (engine.reasoning.thinking_tokens)
    n_reasoning_tokens: int = 0


@dataclass(frozen=True)
class CheckpointSaving(Event):
    """A checkpoint of ``kind`` (engine.checkpoints.format KIND_*) is being written."""
    handler = "on_checkpoint_saving"
    conv_id: uuid.UUID
    kind: int


@dataclass(frozen=True)
class CheckpointSaved(Event):
    """A checkpoint landed (it was verified loadable before this is told)."""
    handler = "on_checkpoint_saved"
    snap: ConversationSnapshot
    path: Path
    size: int
    seconds: float
    kind: int


@dataclass(frozen=True)
class ConversationDeleted(Event):
    handler = "on_conversation_deleted"
    conv_id: uuid.UUID


@dataclass(frozen=True)
class ConversationActivated(Event):
    """A conversation was brought into the cache for use: ``resident`` (it was there: nothing
    restored), else ``n_restored`` tokens restored from its files in ``seconds``."""
    handler = "on_conversation_activated"
    conv_id: uuid.UUID
    resident: bool
    n_restored: int
    seconds: float


@dataclass(frozen=True)
class Exported(Event):
    handler = "on_exported"
    source: Path
    target: Path


@dataclass(frozen=True)
class Notice(Event):
    """Something a user should read that is not a failure (a template problem, a fallback)."""
    handler = "on_notice"
    title: str
    message: str


@dataclass(frozen=True)
class NoRoomToAnswer(Event):
    """``text`` was not sent: the context has no room left for an answer to it."""
    handler = "on_context_full"
    conv_id: uuid.UUID
    text: str
    message: str


@dataclass(frozen=True)
class Failed(Event):
    """A command (or the engine's own work) failed.  ``action`` (engine.commands.Action) says
    what failed: a front end tells failures apart by it, never by the message's wording.
    ``conv_id``: the conversation it happened to, when it was one conversation's (an
    autosave in the background, an answer, a command about one conversation)."""
    handler = "on_error"
    action: Action
    message: str
    conv_id: uuid.UUID | None = None


@dataclass(frozen=True)
class Stopped(Event):
    """The engine thread ended (after shutdown: every answer paused and saved)."""
    handler = "on_stopped"


@dataclass(frozen=True)
class RequestRefusal:
    """Why a server's request was not answered."""
    reason: str       # one of engine.requests' reasons (CONTEXT_LENGTH_EXCEEDED, ...)
    message: str      # one sentence for the client


# requests of another front end (engine.server): each one is tagged with the id it was
# submitted with; its answer's own events above carry its conversation's id
@dataclass(frozen=True)
class RequestStarted(Event):
    handler = "on_request_started"
    request_id: str
    snap: ConversationSnapshot


@dataclass(frozen=True)
class RequestFinished(Event):
    handler = "on_request_finished"
    request_id: str
    conv_id: uuid.UUID
    checkpoint: Path | None


@dataclass(frozen=True)
class RequestFailed(Event):
    handler = "on_request_failed"
    request_id: str
    refusal: RequestRefusal


class WorkerListener:
    """Hears the engine thread's events; override the methods of the events you need.

    The engine calls :meth:`on_event`, which calls the method the event's class names
    (its ``handler``) with the event.  They run on the engine thread and must return fast.
    """

    def on_event(self, event: Event) -> None:
        getattr(self, event.handler)(event)

    def on_model_loading(self, e: ModelLoading) -> None: ...
    def on_model_loaded(self, e: ModelLoaded) -> None: ...
    def on_model_failed(self, e: ModelFailed) -> None: ...
    def on_conversation_changed(self, e: ConversationChanged) -> None: ...
    def on_generation_started(self, e: GenerationStarted) -> None: ...
    def on_prefill_progress(self, e: PrefillProgress) -> None: ...
    def on_text(self, e: TextDelta) -> None: ...
    def on_progress(self, e: Progress) -> None: ...
    def on_generation_finished(self, e: GenerationSummary) -> None: ...
    def on_checkpoint_saving(self, e: CheckpointSaving) -> None: ...
    def on_checkpoint_saved(self, e: CheckpointSaved) -> None: ...
    def on_conversation_deleted(self, e: ConversationDeleted) -> None: ...
    def on_conversation_activated(self, e: ConversationActivated) -> None: ...
    def on_exported(self, e: Exported) -> None: ...
    def on_notice(self, e: Notice) -> None: ...
    def on_context_full(self, e: NoRoomToAnswer) -> None: ...
    def on_error(self, e: Failed) -> None: ...
    def on_stopped(self, e: Stopped) -> None: ...
    def on_request_started(self, e: RequestStarted) -> None: ...
    def on_request_finished(self, e: RequestFinished) -> None: ...
    def on_request_failed(self, e: RequestFailed) -> None: ...


#: GenerationSummary.finish_reason of an answer stopped by a failure (reported with on_error)
FINISH_ERROR = "error"
