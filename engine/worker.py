"""The engine thread: one thread owns the Runtime; everyone else sends it commands.

llama.cpp's context is not thread-safe and a decode may take seconds, so the desktop
app never touches the :class:`~engine.runtime.Runtime` itself.  :class:`EngineWorker`
starts one thread that owns the model, the context and every conversation object;
other threads hand it typed commands (engine.commands: :meth:`EngineWorker.submit`, or
the public methods that make them), which only go on a queue (or, for
:meth:`EngineWorker.pause`, set a flag) and return at once; the thread's loop only
dispatches each command to its handler.  Results come back as events (the frozen
dataclasses of engine.events), handed *on the engine thread* to each
:class:`~engine.events.WorkerListener`: a GUI turns them into queued Qt signals, a test can
record them; a failure comes with its command's kind (engine.commands.Action).  Several
front ends may share one worker (``add_listener``: the window and its local server);
the server's requests are served by the worker's :class:`~engine.requests.RequestDesk`.
This module never imports Qt or a front end (engine/cli, engine/server), and it imports
the native layer only on the engine thread (loading libllama is itself a native call
the UI thread must not make).

Everything the worker knows of one conversation is in its session (engine.sessions),
one table of them: ending a conversation releases it all in one place.  Which
checkpoint to write and when is engine.checkpoint_policy's rule; restoring a chain is
engine.restore's.

What the worker adds to the engine API is bookkeeping for "never recompute twice":

* each conversation has a :class:`~engine.history.LineWriter`: its autosaves (every N
  tokens) and heads (pause, exit, a finished answer, a rename) are deltas on the files
  already on disk, compacted now and then; what a new head supersedes is retired, and
  the store is pruned under a disk budget by reachability (engine.checkpoints.graph),
  so nothing a head needs is ever deleted;
* the KV cache holds several conversations, each in a sequence of one unified cache
  (engine.parallel.ParallelRuntime; engine.sequences decides which): coming back to a
  resident conversation restores nothing; one that was evicted (the least recently used
  idle one goes when room is needed: its newest state is on disk already) is restored
  through its head's chain instead of re-decoding its prompt;
* answers run concurrently, one decode per step for all of them
  (engine.concurrent.Batcher).  The thread steps them and, between two steps, runs the
  commands that arrived: a command for a conversation that is answering waits until its
  answer stops, one that needs a sequence waits while every sequence is busy, and one
  that needs the whole context (loading a model) waits until no answer runs.  Each
  answer has its own pause (:meth:`EngineWorker.pause` with its conversation), its own
  autosaves and its own save when it stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from engine import commands as cmd
from engine.checkpoint_policy import head_kind
from engine.checkpoints import graph
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_EXIT, KIND_MANUAL, KIND_PAUSE, read_header
from engine.checkpoints.graph import default_line
from engine.checkpoints.store import Store
from engine.conversation import Conversation
from engine.errors import (
    AppError,
    CheckpointError,
    ContextFull,
    GenerationError,
    IncompatibleModel,
    IncompatibleState,
)
from engine.events import (
    FINISH_ERROR,
    CheckpointSaved,
    CheckpointSaving,
    ConversationActivated,
    ConversationChanged,
    ConversationDeleted,
    ConversationSnapshot,
    Event,
    Exported,
    Failed,
    GenerationStarted,
    GenerationSummary,
    LeftConversation,
    ModelFailed,
    ModelInfo,
    ModelLoaded,
    ModelLoading,
    ModelOptions,
    NoRoomToAnswer,
    Notice,
    PrefillProgress,
    Progress,
    Stopped,
    TextDelta,
    WorkerListener,
)
from engine.requests import CompletionRequest, EngineHooks, RequestDesk
from engine.sampling import SamplerSettings, random_seed
from engine.sessions import RunningAnswer, SessionTable

if TYPE_CHECKING:   # imported where used: loading a model is what pulls llama.cpp in
    from engine.checkpoints.points import Point
    from engine.concurrent import Batcher
    from engine.parallel import ParallelRuntime

log = logging.getLogger("engine")


class _Listeners:
    """Every listener of a worker, called in the order they were added.

    The list is replaced, never changed in place, so the engine thread iterates a
    consistent one while another thread adds or removes a listener.  The first
    listener's exceptions reach the engine as they always did (a failing listener
    stops the answer, which is saved); an added listener's are logged, so one front
    end's bug never costs another its answer, and every listener is told each event.
    """

    def __init__(self, first: WorkerListener) -> None:
        self.members: tuple[WorkerListener, ...] = (first,)

    def emit(self, event: Event) -> None:
        failure = None
        for index, listener in enumerate(self.members):
            try:
                listener.on_event(event)
            except Exception as exc:  # noqa: BLE001 - the others must still hear of it
                if index == 0:
                    failure = exc
                else:
                    log.exception("a listener failed in %s", event.handler)
        if failure is not None:
            raise failure


class _Relay:
    """The generation loop's listener, tagging each event with the conversation, and
    reporting the answer's progress (tokens in the context, speed) with its text."""

    def __init__(self, listener: _Listeners, conv: Conversation) -> None:
        self._listener = listener
        self._conv = conv
        self._id = conv.id
        self._first: tuple[float, int] | None = None   # (time, tokens generated) at the first text

    def on_prefill_progress(self, done: int, total: int) -> None:
        self._listener.emit(PrefillProgress(self._id, done, total))

    def on_text(self, delta: str) -> None:
        self._listener.emit(TextDelta(self._id, delta))
        answer = self._conv.answer
        n = answer.n_generated if answer else 0
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, n)
        elapsed = now - self._first[0]
        speed = (n - self._first[1]) / elapsed if elapsed > 0 else 0.0
        self._listener.emit(Progress(self._id, len(self._conv.tokens), n, speed))


@dataclass(frozen=True)
class _Queued:
    """A command on the engine thread's queue: when it may run, and its answer's number."""
    command: cmd.Command | None     # None: shutdown's item
    wait: cmd.Wait
    number: int = 0                 # an answer's (engine.sessions: what a pause covers)


def _failed(conv_id: uuid.UUID, conv: Conversation | None) -> GenerationSummary:
    """The summary of an answer a failure stopped (or never let start)."""
    return GenerationSummary(conversation_id=conv_id, finish_reason=FINISH_ERROR, n_generated=0,
                             n_prompt_tokens=len(conv.tokens) if conv is not None else 0,
                             n_reused_tokens=0, tokens_per_s=0.0, text="")


#: shutdown's queue item: it runs after every command and answer before it
_STOP = _Queued(None, cmd.IDLE)
#: Tokens a new message must leave free for its answer, or the window offers a new branch.
ANSWER_ROOM = 128


class EngineWorker:
    """Owns the Runtime on a dedicated thread; every public method is thread-safe.

    More than one front end may share it (the window and the local server):
    :meth:`add_listener` adds another listener, told everything the first one is.
    """

    #: How many conversations served to requests stay open (in memory, their line leased)
    #: besides the one in the cache; older ones are let go and reopened from the store
    #: when a request continues them.  None keeps every one open: the window's way, whose
    #: list refers to them; a server of its own (``serve``) sets a bound, or a long-running
    #: one would hold a file descriptor per conversation it ever served.
    request_conversations_kept: int | None = None

    def __init__(self, listener: WorkerListener, store: Store | None = None) -> None:
        self._listeners = _Listeners(listener)
        self.store = store or Store()
        self.autosave_every = 0
        self.autosave_budget = graph.DEFAULT_BUDGET_BYTES
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._pause_kind = KIND_PAUSE
        self._stopping = threading.Event()
        self._generating = threading.Event()  # set while any answer runs
        self._busy = 0                       # commands queued or running
        #: every conversation's session (engine.sessions); its lock is this one, so that a
        #: pause, the start of an answer and the command count are ordered
        self._busy_lock = threading.RLock()
        self.sessions = SessionTable(self._busy_lock)
        self._answer_running = 0             # engine thread: the number of the answer command it runs
        self._answer_action: cmd.Action | None = None   # and its action (what a failure is reported as)
        # engine-thread state
        self.runtime: ParallelRuntime | None = None
        self._batcher: Batcher | None = None   # over the runtime; set and cleared with it
        #: the last model loaded (fingerprint, name): the open conversations' tokens are its,
        #: also while a failed load left no runtime (_leave_conversations_of)
        self._tokens_model: tuple[bytes, str] | None = None
        self._deferred: list[_Queued] = []   # commands waiting (see engine.commands.Wait), in order
        self.model_info: ModelInfo | None = None
        self._template_noticed = None        # the runtime whose template problem was told
        #: the server's requests (engine.requests), served through the hooks handed here
        self.requests = RequestDesk(self, EngineHooks(
            start_answer=self._generate, open_checkpoint=self._do_open_checkpoint,
            notice_template_problem=self._notice_template_problem, end_session=self._end_session))
        self._dispatch = self._handlers()

    # -- listeners ------------------------------------------------------------------------------
    @property
    def listener(self):
        """What the engine thread calls: every listener added, the first one first."""
        return self._listeners

    @listener.setter
    def listener(self, listener: WorkerListener) -> None:
        self._listeners.members = (listener,) + self._listeners.members[1:]

    def add_listener(self, listener: WorkerListener) -> None:
        """Tell ``listener`` too (on the engine thread) from the next event on."""
        if listener not in self._listeners.members:
            self._listeners.members = self._listeners.members + (listener,)

    def remove_listener(self, listener: WorkerListener) -> None:
        self._listeners.members = tuple(m for m in self._listeners.members if m is not listener)

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def generating(self) -> bool:
        return self._generating.is_set()

    @property
    def idle(self) -> bool:
        """No command waits or runs and no answer generates."""
        with self._busy_lock:
            return self._busy == 0 and not self._generating.is_set()

    @property
    def stopping(self) -> bool:
        """Shutdown was asked for: no new answer starts."""
        return self._stopping.is_set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, *, save: bool = True) -> None:
        """Pause a running generation (saved as an exit checkpoint) and stop the thread.

        Returns at once; ``on_stopped`` is called when the thread has saved and exited.
        """
        self._stopping.set()
        self.pause(kind=KIND_EXIT if save else KIND_PAUSE)
        self._queue.put(_STOP)

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- commands (any thread) -------------------------------------------------------------
    def submit(self, command: cmd.Command) -> None:
        """Queue ``command`` (engine.commands) for the engine thread; returns at once.

        An answer's command is numbered now: a pause from here on covers it, even before
        it starts (see :meth:`pause`).
        """
        number = self.sessions.number_answer(command.conv_id) if isinstance(command, cmd.AnswerCommand) else 0
        with self._busy_lock:
            self._busy += 1
        self._queue.put(_Queued(command, command.wait(), number))

    def load_model(self, options: ModelOptions) -> None:
        """Load a model (after every running answer has stopped)."""
        self.submit(cmd.LoadModel(options))

    def set_sampler(self, conv_id: uuid.UUID, sampler: SamplerSettings) -> None:
        self.submit(cmd.SetSampler(conv_id, sampler))

    def new_conversation(self, *, system_prompt: str = "",
                         sampler: SamplerSettings | None = None) -> uuid.UUID:
        conv = Conversation(system_prompt=system_prompt, sampler=sampler or SamplerSettings())
        self.submit(cmd.NewConversation(conv))
        return conv.id

    def send(self, conv_id: uuid.UUID, text: str, n_predict: int = -1) -> None:
        self.submit(cmd.Send(conv_id, text, n_predict))

    def resume(self, conv_id: uuid.UUID, n_predict: int | None = None) -> None:
        self.submit(cmd.Resume(conv_id, n_predict))

    def regenerate(self, conv_id: uuid.UUID, n_predict: int | None = None) -> None:
        """A new answer to the same prompt, on a new branch: the old answer stays one of
        its alternatives (engine.branches).  ``n_predict``: its limit (None: the old one's)."""
        self.submit(cmd.Regenerate(conv_id, n_predict))

    def edit_message(self, conv_id: uuid.UUID, index: int, text: str, n_predict: int = -1) -> None:
        """Replace user message ``index`` (of the transcript's messages, system prompt not
        counted) and answer it, on a new branch; the turns after it stay on the old one."""
        self.submit(cmd.EditMessage(conv_id, index, text, n_predict))

    def edit_system_prompt(self, conv_id: uuid.UUID, text: str) -> None:
        """Start the conversation over with another system prompt, on a new branch."""
        self.submit(cmd.EditSystemPrompt(conv_id, text))

    def continue_answer(self, conv_id: uuid.UUID, n_predict: int = -1) -> None:
        """Generate more of a finished answer (past the end the model chose)."""
        self.submit(cmd.ContinueAnswer(conv_id, n_predict))

    def send_in_new_branch(self, conv_id: uuid.UUID, text: str, n_predict: int = -1) -> None:
        """When the context is full: a new branch that keeps the system prompt and the most
        recent turns that fit with ``text`` and room for an answer (decoded once, then
        checkpointed like any other); the full conversation stays on its branch."""
        self.submit(cmd.SendInNewBranch(conv_id, text, n_predict))

    def switch_branch(self, conv_id: uuid.UUID, head: str | Path) -> None:
        """Show another branch of a conversation: restore only what differs from the cache."""
        self.submit(cmd.SwitchBranch(conv_id, Path(head)))

    def fork(self, conv_id: uuid.UUID, index: int) -> uuid.UUID:
        """A new conversation on this one's files: up to and including answer ``index``, or,
        at a message of the user's, everything before it (so the fork is ready for a new
        message).  ``index`` counts the messages, the system prompt not included."""
        new_id = uuid.uuid4()
        self.submit(cmd.Fork(conv_id, index, new_id))
        return new_id

    def open_checkpoint(self, path: str | Path, conv_id: uuid.UUID | None = None) -> None:
        """Restore a checkpoint into the cache and make its conversation known (``conv_id``:
        the one it holds, where the caller knows: a failure is reported as that one's)."""
        self.submit(cmd.OpenCheckpoint(Path(path), conv_id))

    def show(self, conv_id: uuid.UUID) -> None:
        """Report a conversation's snapshot again (on_conversation_changed), and bring it
        into the cache now, so that its next answer starts at once (on_conversation_activated
        says whether it was resident or how much was restored)."""
        self.submit(cmd.Show(conv_id))

    def rename(self, conv_id: uuid.UUID, title: str) -> None:
        self.submit(cmd.Rename(conv_id, title))

    def delete_conversation(self, conv_id: uuid.UUID) -> None:
        """Forget a conversation and delete every file that only it needs."""
        self.submit(cmd.Delete(conv_id))

    def export(self, path: str | Path, target: str | Path) -> None:
        """Write ``path``'s checkpoint as one self-contained file (a chain is compacted)."""
        self.submit(cmd.Export(Path(path), Path(target)))

    def complete(self, request: CompletionRequest) -> None:
        """Answer a server's ``request`` when its turn comes (engine.requests; the listener
        hears how it went with the request's id)."""
        self.requests.submitted(request.request_id)
        self.submit(cmd.Complete(request))

    def cancel_request(self, request_id: str) -> None:
        """The client went away: skip the request, or pause its answer (saved as a pause)."""
        self.requests.cancel(request_id)

    def continue_with_loaded_model(self, path: str | Path) -> uuid.UUID:
        """A conversation made with another model, continued with the loaded one: its
        transcript becomes a new branch, decoded once when it next answers."""
        conv_id = read_header(path).conversation_id   # 256 bytes; the rest on the engine thread
        self.submit(cmd.ContinueWithLoadedModel(conv_id, Path(path)))
        return conv_id

    def pause(self, conv_id: uuid.UUID | None = None, *, kind: int = KIND_PAUSE) -> None:
        """Ask the answer of ``conv_id`` (None: every answer) to stop within one token;
        it then saves its own sequence, and the other answers go on.

        Runs on the caller's thread: it only sets the answer's pause event (which
        llama.cpp's abort callback reads during a prompt chunk), so a click is never
        queued behind the generation it means to stop.  A pause that arrives while the
        answer is still queued (the button is enabled as soon as Send is clicked) is
        kept and stops that answer before its first token.
        """
        self._pause_kind = kind
        for control in self.sessions.pause(conv_id):
            control.request_pause()

    @property
    def answering(self) -> set[uuid.UUID]:
        """The conversations whose answers are running (any thread)."""
        return self.sessions.answering()

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                item = self._next_command()
                if item is None:
                    self._step()
                    continue
                if item is _STOP:
                    break
                try:
                    self._execute(item)
                except Exception as exc:  # noqa: BLE001 - one bad command must not kill the thread
                    self._report_error(item.command.action, exc,
                                       conv_id=getattr(item.command, "conv_id", None))
                finally:
                    with self._busy_lock:
                        self._busy -= 1
            self._save_residents_if_dirty(KIND_EXIT)
        except Exception as exc:  # noqa: BLE001
            self._report_error(cmd.Action.SAVE_BEFORE_EXIT, exc)
        finally:
            self.sessions.close_writers()
            self._collect_superseded()
            if self.runtime is not None:
                self.runtime.close()
                self.runtime = None
            self.listener.emit(Stopped())

    def _next_command(self):
        """The next command to run now, or None when the running answers take a step.

        A deferred command whose wait is over comes first, in arrival order; a new one
        waits behind a deferred one it must not overtake (the same conversation, or one
        waiting for everything).  With no answer running, the thread sleeps on the queue.
        """
        if self._batcher is not None and self._batcher.pausing:
            # a pause asked for lands first, saved: a request sent again at once (a client
            # that went away during a long prefill, and retried) finds that prefill stored,
            # where it began before and read the whole prompt again
            return None
        for i, item in enumerate(self._deferred):
            if not self._must_wait(item, self._deferred[:i]):
                return self._deferred.pop(i)
        while True:
            if self._batcher is not None and self._batcher.busy:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    return None
            else:
                item = self._queue.get()
            if self._must_wait(item, self._deferred):
                self._deferred.append(item)
                continue
            return item

    def _execute(self, item: _Queued) -> None:
        """Run one command: the handler its type names, with its fields as arguments."""
        command = item.command
        assert command is not None   # only _STOP has none, and _run stops there
        handler = self._dispatch[type(command)]
        if not isinstance(command, cmd.AnswerCommand):
            handler(*command.arguments())
            return
        self._answer_running, self._answer_action = item.number, command.action
        try:
            handler(*command.arguments())
        except Exception:
            # refused before its answer could start (or while starting): the front ends hear
            # which conversation's answer ended, then the error itself (on_error)
            conv_id = command.conv_id
            if not self.sessions.is_answering(conv_id):
                conv = self.sessions.conversation(conv_id)
                if conv is None:
                    self.sessions.end(conv_id)   # named by this command alone: nothing to keep
                self.listener.emit(_failed(conv_id, conv))
            raise
        finally:
            self._answer_running, self._answer_action = 0, None

    def _handlers(self) -> dict[type, Callable]:
        """Each command type's handler (engine.commands)."""
        return {
            cmd.LoadModel: self._do_load_model, cmd.NewConversation: self._do_adopt,
            cmd.SetSampler: self._do_set_sampler, cmd.Rename: self._do_rename,
            cmd.Delete: self._do_delete, cmd.Show: self._do_show,
            cmd.EditSystemPrompt: self._do_edit_system_prompt, cmd.SwitchBranch: self._do_switch_branch,
            cmd.Fork: self._do_fork, cmd.ContinueWithLoadedModel: self._do_continue_with_loaded_model,
            cmd.Send: self._do_send, cmd.Resume: self._do_resume, cmd.Regenerate: self._do_regenerate,
            cmd.EditMessage: self._do_edit_message, cmd.ContinueAnswer: self._do_continue_answer,
            cmd.SendInNewBranch: self._do_send_in_new_branch, cmd.OpenCheckpoint: self._do_open_checkpoint,
            cmd.Export: self._do_export, cmd.Complete: self.requests.serve,
            cmd.Landed: self._do_landed,
        }

    def _must_wait(self, item: _Queued, earlier: list[_Queued]) -> bool:
        wait = item.wait
        if wait.everything and earlier:
            return True
        if any(e.wait.everything or (wait.conv is not None and e.wait.conv == wait.conv) for e in earlier):
            return True
        answering = self.sessions.any_running
        if wait.everything:
            return answering
        if self.sessions.is_answering(wait.conv):
            return True
        # (with no answer running nothing would free a sequence: the command runs, and says so)
        if wait.sequence and answering and self.runtime is not None and wait.conv not in self.runtime.table:
            table = self.runtime.table
            return table.free == 0 and table.victim() is None
        return False

    def _step(self) -> None:
        """One decode of the running answers (engine.concurrent.Batcher.step)."""
        assert self._batcher is not None   # _next_command steps only a busy batcher
        try:
            self._batcher.step()
        except Exception as exc:  # noqa: BLE001 - every answer must end saved, then the engine goes on
            self._answers_failed(exc)

    def _collect_superseded(self) -> None:
        """Delete every superseded file (older states of histories that moved on, a killed
        run's leftovers): at start and at a clean exit nothing no head needs stays."""
        try:
            report = graph.prune(self.store, None)
        except OSError as exc:
            log.warning("could not clean up superseded checkpoints: %s", exc)
            return
        if report.deleted:
            log.info("cleaned up the store: %s", report.describe())

    def _report_error(self, action: cmd.Action, exc: BaseException, *, quiet: bool = False,
                      conv_id: uuid.UUID | None = None) -> str:
        """Log ``exc`` (unless ``quiet``: logged already) and tell the listener (about the
        conversation ``conv_id``, when it was one conversation's)."""
        from native.errors import NativeError
        if isinstance(exc, (AppError, NativeError, OSError)):
            message = str(exc)
            if not quiet:
                log.warning("could not %s: %s", action, exc)
        else:
            message = f"unexpected {type(exc).__name__}: {exc}"
            if not quiet:
                log.exception("unexpected failure while trying to %s", action)
        self.listener.emit(Failed(action, message, conv_id))
        return message

    # -- engine-thread implementations --------------------------------------------------------
    def _do_load_model(self, opts: ModelOptions) -> None:
        from engine.parallel import ParallelRuntime
        from native.context import ContextSettings
        from native.library import bindings, choose_library_dir, loaded_library, system_info
        try:
            bindings(choose_library_dir(cli_dir=opts.llama_lib))
            self._save_residents_if_dirty(KIND_MANUAL)
            if self.runtime is not None:
                self.runtime.close()
                self.runtime = self._batcher = None
            last = [-1.0]

            def progress(fraction: float) -> bool:
                if fraction - last[0] >= 0.01 or fraction >= 1.0:  # at most ~100 events
                    last[0] = fraction
                    self.listener.emit(ModelLoading(fraction))
                return not self._stopping.is_set()

            workers = None
            if opts.rpc_servers:   # after the close above: a worker serves one client at a time
                from engine import crashlog
                from native.rpc import Workers
                timeout = {"io_timeout": opts.rpc_timeout} if opts.rpc_timeout else {}
                workers = Workers.connect(opts.rpc_servers, message_prefix="Checkpoint Chat: ",
                                          crash_note=crashlog.trace_path(), **timeout)
            settings = replace(ContextSettings(n_ctx=opts.n_ctx, n_threads=opts.n_threads),
                               **opts.context_overrides())
            rt = ParallelRuntime(opts.path, settings, sequences=max(1, opts.sequences),
                                 n_gpu_layers=opts.n_gpu_layers, main_gpu=opts.main_gpu,
                                 progress=progress, workers=workers, should_abort=self._stopping.is_set)
        except Exception as exc:  # noqa: BLE001 - a failed load is reported, not raised
            self._report_error(cmd.Action.LOAD_MODEL, exc)
            self.listener.emit(ModelFailed(str(exc)))
            return
        self.runtime = rt
        self._batcher = self._new_batcher()
        previous, self._tokens_model = self._tokens_model, (rt.fingerprint, rt.model.name)
        left = self._leave_conversations_of(*previous) if previous and previous[0] != rt.fingerprint else ()
        for session in self.sessions.open():   # a model loaded again: its own kept conversations answer
            if session.tokens_model is not None and session.tokens_model[0] == rt.fingerprint:
                session.tokens_model = None
        self.sessions.close_writers()  # they wrote from the previous runtime's cache; heads stay
        self._collect_superseded()
        try:
            info = system_info()
            backend, lib_path, lib_version = info.backend_label, info.library_path, info.library_version
        except Exception as exc:  # noqa: BLE001 - device listing is informative only
            log.warning("system info unavailable: %s", exc)
            lib = loaded_library()
            backend, lib_path, lib_version = "CPU", str(lib.path), lib.version
        if rt.model.placement:   # remote workers: where the layers went, for the model bar
            backend = f"{backend} · {rt.model.placement}"
        from engine.chat_template import think_format
        from engine.sampling import defaults_for_model
        sampling, source = defaults_for_model(rt.model)
        self.model_info = ModelInfo(
            name=rt.model.name, path=Path(opts.path), architecture=rt.model.architecture,
            size=rt.model.size_bytes, n_ctx=rt.ctx.n_ctx, backend=backend,
            library_path=lib_path, library_version=lib_version, target=rt.target,
            sampling_defaults=sampling, sampling_source=source, sequences=rt.sequences,
            exact_width=rt.exact_width, thinking=think_format(rt.model))
        self.listener.emit(ModelLoaded(self.model_info, left))

    def _leave_conversations_of(self, fingerprint: bytes, model_name: str) -> tuple[LeftConversation, ...]:
        """Close the open conversations whose tokens are another model's (the one just
        unloaded, ``model_name``): decoding them with this one would read that model's token
        ids as its own, and continue a paused answer in another model's words.  Each was saved
        before the unload (_save_residents_if_dirty) and stays in the store as a conversation
        of that model (the window offers to load it, or to go on with this one as a new
        branch).  One whose head does not hold all of it (its save failed, which was
        reported) stays open, its state being nowhere else, marked as that model's
        (``Session.tokens_model``): it answers nothing until that model is loaded again
        (``_activate``)."""
        left = []
        for session in self.sessions.open():
            conv, head = session.conv, session.head_path
            if conv is None or not conv.tokens or session.tokens_model is not None:
                continue
            try:
                header = read_header(head) if head is not None else None
            except (CheckpointError, OSError) as exc:
                log.warning("%s stays open: its head %s cannot be read (%s)", conv.title, head, exc)
                header = None
            if header is not None and header.model_fingerprint != fingerprint:
                continue   # (its head is not of the model its tokens came from: left as it is)
            saved = session.writer.head if session.writer is not None else None   # (what the unload saved)
            if head is None or header is None or saved is None or not saved.holds(conv.tokens):
                session.tokens_model = (fingerprint, model_name)
                continue
            self._end_session(conv.id)
            left.append(LeftConversation(conv.id, conv.title, head, header, model_name))
        if left:
            log.info("closed %d conversation(s) of %s: they stay in the store", len(left), model_name)
        return tuple(left)

    def _new_batcher(self) -> Batcher:
        from engine.concurrent import Batcher
        return Batcher(self._need_runtime(), on_stopped=self._answer_stopped,
                       autosave=lambda job: self._autosave(job.conv))

    def _need_runtime(self) -> ParallelRuntime:
        if self.runtime is None:
            raise AppError("no model is loaded yet")
        return self.runtime

    def _view(self, conv: Conversation):
        """``conv``'s sequence as a single-sequence Runtime (engine.parallel.ConversationView)."""
        return self._need_runtime().view_of(conv.id)

    def _conv(self, conv_id: uuid.UUID) -> Conversation:
        conv = self.sessions.conversation(conv_id)
        if conv is None:
            raise AppError("that conversation is not open")
        return conv

    def _end_session(self, conv_id: uuid.UUID) -> None:
        """Forget a conversation: its session (its writer lets go of its line) and its
        sequence of the cache.  Its files stay."""
        self.sessions.end(conv_id)
        if self.runtime is not None:
            self.runtime.forget(conv_id)

    def snapshot(self, conv: Conversation, *, branches: bool = True) -> ConversationSnapshot:
        """A copy for display; ``branches`` adds the alternatives (reads the store's heads,
        so the autosave path, every few tokens, goes without)."""
        session = self.sessions.get(conv.id)
        path = session.head if session is not None else None
        size = 0
        if path is not None:
            try:
                size = path.stat().st_size
            except OSError:
                size = 0
        n_ctx = self.runtime.ctx.n_ctx if self.runtime is not None else 0
        transcript = tuple(dict(m) for m in conv.transcript())
        alternatives: tuple = ()
        if branches:
            from engine.branches import alternatives as alternatives_at
            from engine.branches import branches_of
            try:
                alternatives = tuple(alternatives_at([(m["role"], m["content"]) for m in transcript],
                                                     branches_of(self.store, conv.id)))
            except OSError as exc:
                log.warning("could not list the branches of %s: %s", conv.title, exc)
        return ConversationSnapshot(
            id=conv.id, title=conv.title, transcript=transcript,
            paused=conv.paused, n_tokens=len(conv.tokens), n_ctx=n_ctx, seed=conv.sampler.seed,
            checkpoint=path, checkpoint_size=size, alternatives=alternatives)

    def _do_adopt(self, conv: Conversation) -> None:
        self.sessions.adopt(conv)
        self.listener.emit(ConversationChanged(self.snapshot(conv)))

    def _do_show(self, conv_id: uuid.UUID) -> None:
        conv = self._conv(conv_id)
        self.listener.emit(ConversationChanged(self.snapshot(conv)))
        self._bring_in(conv)

    def _bring_in(self, conv: Conversation) -> None:
        """Make ``conv`` resident ahead of its next answer, when it has compatible files
        (a switch in the window): the listener hears whether anything was restored."""
        from engine.checkpoints.format import read_header
        rt = self.runtime
        session = self.sessions.named(conv.id)
        if rt is None or session.answer is not None:
            return
        head = session.head_path
        if not session.resident_in(rt):
            if head is None:
                return
            try:
                if rt.target.problem(read_header(head)) is not None:
                    return   # another model's conversation: the window offers what to do
            except (CheckpointError, OSError):
                return
        restores, restored = rt.restores, rt.restored_tokens
        started = time.perf_counter()
        placement = self._activate(conv)
        self.listener.emit(ConversationActivated(conv.id, placement.resident and rt.restores == restores,
                                                rt.restored_tokens - restored, time.perf_counter() - started))

    def _do_set_sampler(self, conv_id: uuid.UUID, sampler: SamplerSettings) -> None:
        self._conv(conv_id).sampler = sampler

    def _do_rename(self, conv_id: uuid.UUID, title: str) -> None:
        conv = self._conv(conv_id)
        conv.title = title
        if self.sessions.named(conv_id).head is not None:
            # the title lives in the checkpoint's header: rewrite the file (a delta of
            # metadata when the cache holds the head's tokens)
            self._activate(conv)
            self._save(conv, KIND_MANUAL)
        else:
            self.listener.emit(ConversationChanged(self.snapshot(conv)))

    def _do_delete(self, conv_id: uuid.UUID) -> None:
        self._end_session(conv_id)
        report = graph.delete_conversation(self.store, conv_id)
        log.info("deleted conversation %s: %s", conv_id, report.describe())
        self.listener.emit(ConversationDeleted(conv_id))
        in_use = report.kept.get(graph.KEPT_IN_USE)
        if in_use:
            raise AppError(f"{in_use[0]} of its files could not be deleted now (another program "
                           "has them open); they stay whole, and Delete can be tried again")

    def _do_open_checkpoint(self, path: Path, conv_id: uuid.UUID | None = None) -> None:
        """``conv_id``: the conversation the caller expects (a failure is reported as its:
        _run, from the command)."""
        from engine.checkpoints.chain import load_chain, restoring
        rt = self._need_runtime()
        # a delta brings its ancestors along, verified (the large states' checksums while
        # llama.cpp copies them: settled by the restore)
        with restoring(load_chain(path, crc_later=True)) as chain:
            self._open_chain(rt, chain, path)

    def _open_chain(self, rt, chain, path: Path) -> None:
        from engine.history import LineWriter
        from engine.restore import text_of_chain
        data = chain[-1]
        try:
            rt.check_compatible(data.header, data.meta)  # refuse before evicting anything
            other_layout = None
        except IncompatibleState as exc:     # another llama.cpp's state: its text is read again
            other_layout = exc
            text_of_chain(chain, rt.target)  # anything else wrong is refused all the same
        conv_id = data.header.conversation_id
        if self.sessions.is_answering(conv_id):
            raise AppError("that conversation is answering now; pause it first")
        if (shown := self.sessions.conversation(conv_id)) is not None:
            self._save_if_dirty(shown, KIND_MANUAL)
        view = rt.view_of(conv_id)
        conv = view.restore_chain(chain) if other_layout is None else text_of_chain(chain, rt.target)
        session = self.sessions.adopt(conv)
        session.close_writer()   # its lease: this writer may continue the same line
        if other_layout is None:
            writer = self.sessions.set_writer(conv.id, LineWriter.continuing(view, self.store, chain))
            session.head = writer.head.path if writer.head else Path(path)
        else:   # its files are no parent of ours: the next save is a full file in this layout
            self.sessions.set_writer(conv.id, LineWriter.starting(view, self.store, uuid.uuid4().hex))
            session.head = None
            self.listener.emit(Notice(
                "Checkpoint from another llama.cpp",
                f"{other_layout}. Its {data.header.n_tokens} tokens are read again when it continues, "
                "and it is saved anew in this layout."))
        self.listener.emit(ConversationChanged(self.snapshot(conv)))

    def _do_export(self, source: Path, target: Path) -> None:
        from engine.checkpoints.chain import load_chain
        from engine.checkpoints.transfer import export_copy
        from engine.compaction import compact_into, runtime_for
        chain = load_chain(source)
        problem = graph.overwrite_problem(target)
        if problem:
            raise AppError(problem)
        if len(chain) == 1:
            export_copy(source, target)
        elif self.runtime is not None and self.runtime.target.problem(chain[-1].header) is None:
            # compacted in a sequence of its own (an idle conversation may be evicted for it)
            key = ("export", uuid.uuid4())
            try:
                compact_into(self.runtime.view_of(key), chain, target)
            finally:
                self.runtime.forget(key)
        else:
            rt = runtime_for(chain)   # the chain's own model, loaded for the occasion
            try:
                compact_into(rt, chain, target)
            finally:
                rt.close()
        self.listener.emit(Exported(source, target))

    def _do_send(self, conv_id: uuid.UUID, text: str, n_predict: int) -> None:
        from engine.generation import begin_answer
        rt = self._need_runtime()
        conv = self._conv(conv_id)
        messages, answer, tokens = list(conv.messages), conv.answer, list(conv.tokens)
        finish = answer.finish_reason if answer is not None else None
        # a new message after a paused answer keeps what was generated so far
        conv.interrupt_paused()
        begin_answer(conv, rt, text, n_predict=n_predict)
        room = rt.ctx.n_ctx - len(conv.tokens)
        if room < ANSWER_ROOM:
            # said before anything is decoded; the conversation stays as it was, and the
            # front end may offer send_in_new_branch
            conv.messages, conv.answer, conv.tokens = messages, answer, tokens
            if answer is not None:
                answer.finish_reason = finish   # a paused answer stays resumable
            self.listener.emit(NoRoomToAnswer(conv_id, text, (
                f"The conversation is too long for this context ({len(tokens):,} of {rt.ctx.n_ctx:,} "
                f"tokens; this message needs {ANSWER_ROOM - room:,} more to leave room for an answer). "
                "It can go on in a new branch that keeps the system prompt and the most recent turns "
                "that fit; the full conversation stays as it is.")))
            return
        self._notice_template_problem(rt)
        self._generate(conv)

    def _do_send_in_new_branch(self, conv_id: uuid.UUID, text: str, n_predict: int) -> None:
        from engine import chat_template
        from engine.generation import begin_answer, commit_answer
        rt = self._need_runtime()
        conv = self._conv(conv_id)
        conv.interrupt_paused()
        commit_answer(conv)
        self._branch(conv)
        turns = conv.messages
        budget = rt.ctx.n_ctx - ANSWER_ROOM
        for start in range(0, len(turns) + 1):
            if start < len(turns) and turns[start][0] != "user":
                continue   # a kept history starts with a turn of the user's
            kept = turns[start:] + [("user", text)]
            head = [("system", conv.system_prompt)] if conv.system_prompt else []
            prompt = chat_template.render(rt.model, head + kept, add_assistant=True, now=conv.created)
            if len(rt.model.tokenize_prompt(prompt)) <= budget:
                break
        else:
            raise ContextFull("even this message alone does not fit the context with room for an answer")
        conv.messages, conv.answer = turns[start:], None
        begin_answer(conv, rt, text, n_predict=n_predict)
        self._generate(conv)

    def _do_continue_with_loaded_model(self, conv_id: uuid.UUID, path: Path) -> None:
        from engine.checkpoints.format import read_metadata
        from engine.history import LineWriter
        meta = read_metadata(path)[1]
        saved = meta.get("conversation")
        try:
            conv = Conversation.from_json(saved if isinstance(saved, dict) else {}, [])
        except (TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"the conversation in that checkpoint is malformed: {exc}") from None
        conv.id = conv_id
        conv.interrupt_paused()   # its tokens belong to the other model
        from engine.generation import commit_answer
        commit_answer(conv)
        session = self.sessions.named(conv_id)
        session.close_writer()
        self.sessions.adopt(conv)
        session.head = None
        self.sessions.set_writer(conv_id, LineWriter.starting(self._view(conv), self.store, uuid.uuid4().hex))
        self.listener.emit(ConversationChanged(self.snapshot(conv)))

    def _notice_template_problem(self, rt) -> None:
        """Tell the user once per loaded model when its chat template could not be used."""
        from engine import chat_template
        problem = chat_template.template_problem(rt.model)
        if problem and self._template_noticed is not rt:
            self._template_noticed = rt
            self.listener.emit(Notice("Chat template", problem[0].upper() + problem[1:] + "."))

    def _do_resume(self, conv_id: uuid.UUID, n_predict: int | None) -> None:
        conv = self._conv(conv_id)
        paused = conv.paused_answer
        if paused is None:
            raise GenerationError("there is no paused answer to resume")
        if n_predict is not None:
            paused.n_predict = n_predict
        self._generate(conv)

    def _do_regenerate(self, conv_id: uuid.UUID, n_predict: int | None) -> None:
        from engine.generation import discard_answer
        conv = self._conv(conv_id)
        if conv.answer is None:
            raise GenerationError("there is no answer to regenerate")
        self._branch(conv)
        discard_answer(conv)
        if n_predict is not None and conv.answer is not None:   # (the limit the user set since)
            conv.answer.n_predict = n_predict
        # the same seed would draw the same answer again: a new one (kept in the checkpoint,
        # so this answer resumes exactly like any other)
        conv.sampler = replace(conv.sampler, seed=random_seed())
        self._generate(conv)

    def _do_edit_message(self, conv_id: uuid.UUID, index: int, text: str, n_predict: int) -> None:
        from engine.generation import begin_answer, commit_answer
        conv = self._conv(conv_id)
        commit_answer(conv)
        if not 0 <= index < len(conv.messages) or conv.messages[index][0] != "user":
            raise GenerationError(f"message {index + 1} is not a message of yours in this conversation")
        self._branch(conv)
        self._restore_turn_end(conv, conv.messages[:index])
        conv.messages = conv.messages[:index]
        conv.answer = None
        begin_answer(conv, self._need_runtime(), text, n_predict=n_predict)
        self._generate(conv)

    def _restore_turn_end(self, conv: Conversation, messages) -> None:
        """Put the state at the end of the turn before an edit into the cache, from the
        chain's file of it (exact for every model), when the chain still has one."""
        files, n, point = self._files_of_history(conv, messages)
        if files:
            view = self._view(conv)
            view.restore_chain(files)
            view.trim(n, point)   # a turn end a later head absorbed (a point): exact

    def _files_of_history(self, conv: Conversation, messages) -> tuple[list, int, Point | None]:
        """The files of ``conv``'s chain whose state, trimmed to its first ``n`` tokens, holds
        exactly ``messages``, every answer finished (engine.branches.turn_end), ``n``, and the
        point to trim to (None: the last file's end); ``([], 0, None)`` when no file holds
        that point (compacted away, or unreadable)."""
        from engine.branches import turn_end
        from engine.checkpoints.chain import load_chain
        writer = self.sessions.named(conv.id).writer
        if writer is None or not writer.chain:
            return [], 0, None
        try:
            chain = load_chain(writer.chain[-1].path)
        except (CheckpointError, OSError) as exc:   # (OSError: deleted by another program)
            log.info("no file holds the turn's end (%s): its prompt is decoded", exc)
            return [], 0, None
        k, n, point = turn_end(chain, messages)
        return chain[:k], n, point

    def _do_edit_system_prompt(self, conv_id: uuid.UUID, text: str) -> None:
        conv = self._conv(conv_id)
        self._branch(conv)
        conv.system_prompt = text
        conv.messages, conv.answer, conv.tokens = [], None, []
        self.listener.emit(ConversationChanged(self.snapshot(conv)))

    def _do_continue_answer(self, conv_id: uuid.UUID, n_predict: int) -> None:
        conv = self._conv(conv_id)
        answer = conv.answer
        if answer is None or not answer.finished:
            raise GenerationError("there is no finished answer to continue")
        if conv.messages and conv.messages[-1] == ("assistant", answer.text):
            conv.messages.pop()   # the committed copy: the answer is open again
        skip_eog = answer.finish_reason == "stop"
        answer.finish_reason = None
        answer.n_predict = -1 if n_predict < 0 else answer.n_generated + n_predict
        self._generate(conv, skip_eog_once=skip_eog)

    def _do_switch_branch(self, conv_id: uuid.UUID, head: Path) -> None:
        from engine.checkpoints.chain import load_chain, restoring
        rt = self._need_runtime()
        with restoring(load_chain(head, crc_later=True)) as chain:   # settled by the restore
            self._switch_to(rt, conv_id, chain, head)

    def _switch_to(self, rt, conv_id: uuid.UUID, chain, head: Path) -> None:
        from engine.history import LineWriter
        data = chain[-1]
        if data.header.conversation_id != conv_id:
            raise AppError(f"{head.name} is not a branch of this conversation")
        rt.check_compatible(data.header, data.meta)
        if (shown := self.sessions.conversation(conv_id)) is not None:   # the branch shown so far keeps its state
            self._save_if_dirty(shown, KIND_MANUAL)
        view = rt.view_of(conv_id)
        conv = view.restore_chain(chain)     # the shared files stay in the cache
        session = self.sessions.adopt(conv)
        session.close_writer()
        writer = self.sessions.set_writer(conv.id, LineWriter.continuing(view, self.store, chain))
        session.head = writer.head.path if writer.head else head
        self.listener.emit(ConversationChanged(self.snapshot(conv)))

    def _do_fork(self, conv_id: uuid.UUID, index: int, new_id: uuid.UUID) -> None:
        from engine.conversation import Conversation
        from engine.history import LineWriter, saved_infos
        conv = self._conv(conv_id)
        messages = conv.messages_with_answer()
        if not 0 <= index < len(messages):
            raise GenerationError(f"there is no message {index + 1} to fork at")
        kept = messages[:index] if messages[index][0] == "user" else messages[:index + 1]
        fork = Conversation(id=new_id, title=f"{conv.title} (fork)", system_prompt=conv.system_prompt,
                            messages=list(kept), sampler=conv.sampler, stop_strings=list(conv.stop_strings))
        # the files of this conversation's chain that hold exactly those messages
        files, n, point = self._files_of_history(conv, kept)
        if files:
            fork.tokens = [int(t) for t in files[-1].tokens[:n]]
            view = self._view(fork)
            view.restore_chain(files)   # what the fork holds: shared files
            view.trim(n, point)         # (a turn end a later head absorbed: a point)
            session = self.sessions.adopt(fork)
            fork_writer = self.sessions.set_writer(fork.id, LineWriter.starting(
                view, self.store, default_line(fork.id), saved_infos(files)))
            # a delta of metadata only; at the last message, one holding the newest
            # file's cells again (LineWriter._below_others_tips: that file stays a head)
            session.head = fork_writer.save_head(fork, KIND_MANUAL).path
            self.listener.emit(ConversationChanged(self.snapshot(fork)))
            return
        # no file holds that point (compacted away): the fork decodes its prompt when used
        self.sessions.adopt(fork)
        self.listener.emit(ConversationChanged(self.snapshot(fork)))

    def _branch(self, conv: Conversation) -> None:
        """Go on with ``conv`` on a new line of history; its current line keeps its head.

        The conversation is saved first if its head lags, so the old line holds exactly
        what was shown; the new line builds on the old line's files.
        """
        from engine.history import LineWriter
        self._activate(conv)
        self._save_if_dirty(conv, KIND_MANUAL)
        session = self.sessions.named(conv.id)
        chain = list(session.writer.chain) if session.writer is not None else []
        session.close_writer()
        self.sessions.set_writer(conv.id, LineWriter.starting(self._view(conv), self.store, uuid.uuid4().hex, chain))

    def _generate(self, conv: Conversation, *, skip_eog_once: bool = False,
                  request_id: str | None = None) -> bool:
        """Start ``conv``'s answer beside the running ones; False when the worker is
        stopping (nothing started).  The answer ends in :meth:`_answer_stopped`."""
        from engine.concurrent import Job
        from engine.generation import Control
        rt = self._need_runtime()
        if self._stopping.is_set():
            return False
        session = self.sessions.adopt(conv)
        if session.answer is not None:
            raise GenerationError("this conversation is answering already")
        requested = time.perf_counter()
        rt.last_restore_s = 0.0
        try:
            self._activate(conv, running=True)
            prompt_checkpoint = self._writer(conv).policy.prompt_checkpoint
        except BaseException:
            if conv.id in rt.table:   # placed as running: it must not hold its sequence for good
                rt.table.finish(conv.id)
            raise
        restore_s = time.perf_counter() - requested if rt.last_restore_s else 0.0
        control = Control()
        others = self.sessions.any_running
        if self.sessions.begin_answer(session, self._answer_running, control, request_id,
                                      lambda: self.requests.cancelled(request_id)):
            control.request_pause()   # asked for before this answer started
        elif not others:
            self._pause_kind = KIND_PAUSE
        job = Job(conv, rt.table.seq_of(conv.id), control=control, listener=_Relay(self.listener, conv),
                  autosave_every=self.autosave_every, skip_eog_once=skip_eog_once,
                  checkpoint_prompt=prompt_checkpoint)
        action = cmd.Action.ANSWER_REQUEST if request_id is not None else self._answer_action or cmd.Action.SEND
        session.answer = RunningAnswer(job, restore_s, action, request_id)
        self._generating.set()
        rt.table.start(conv.id)
        try:
            self.listener.emit(GenerationStarted(self.snapshot(conv, branches=False)))
            assert self._batcher is not None   # made together with the runtime
            self._batcher.add(job, requested_at=requested)
        except BaseException:
            self._end_answer(conv)
            raise
        return True

    def _end_answer(self, conv: Conversation, *, durable: bool = True) -> RunningAnswer | None:
        with self._busy_lock:
            running = self.sessions.end_answer(self.sessions.named(conv.id))
            if not self.sessions.any_running:
                self._generating.clear()
        if self.runtime is not None and conv.id in self.runtime.table:
            self.runtime.table.finish(conv.id, durable=durable)
        return running

    def _reasoning_tokens(self, conv: Conversation, n_generated: int) -> int:
        """Of the last ``n_generated`` tokens of ``conv``'s answer, those of its thinking."""
        a, info, rt = conv.answer, self.model_info, self.runtime
        if a is None or info is None or info.thinking is None or rt is None or not n_generated:
            return 0
        from engine.reasoning import thinking_tokens
        answer_tokens = conv.tokens[a.n_prompt_tokens:a.n_prompt_tokens + a.n_generated]
        thinking = thinking_tokens([rt.model.token_to_piece(t) for t in answer_tokens], info.thinking)
        return max(0, thinking - (a.n_generated - n_generated))   # those of this run

    def _answer_stopped(self, job) -> None:
        """An answer stopped (Batcher callback, between two decodes): report it, save its
        sequence, and tell the request it served."""
        conv, result = job.conv, job.result
        running = self.sessions.named(conv.id).answer
        # the Batcher ran the job, so both are there: _generate recorded the answer first
        assert running is not None and self._batcher is not None
        self._batcher.done.clear()   # the Batcher's record of ended jobs: the worker keeps none
        saved = False
        try:
            self.listener.emit(GenerationSummary(
                conversation_id=conv.id, finish_reason=result.finish_reason,
                n_generated=result.n_generated, n_prompt_tokens=result.n_prompt_tokens,
                n_reused_tokens=result.n_reused_tokens, tokens_per_s=result.tokens_per_s,
                text=result.text, ttft_s=result.ttft_s, restore_s=running.restore_s,
                prefill_s=result.prefill_s, n_reasoning_tokens=self._reasoning_tokens(conv, result.n_generated)))
            kind = self._pause_kind if result.paused else KIND_MANUAL   # made truthful by _save
            if not result.paused:
                from engine.generation import commit_answer
                commit_answer(conv)
            self._save(conv, kind)
            saved = True
        except Exception as exc:  # noqa: BLE001 - the other answers go on
            self._report_error(cmd.Action.SAVE_ANSWER, exc, conv_id=conv.id)
            if running.request_id is not None:
                self.requests.ended(running.request_id, None, str(exc) or type(exc).__name__)
                running.request_id = None
        finally:
            self._end_answer(conv, durable=saved)
        if running.request_id is not None:
            try:
                self.requests.ended(running.request_id, conv.id)
            except Exception:  # noqa: BLE001 - a front end's failure must not stop the other answers
                log.exception("could not report the end of request %s", running.request_id)

    def _answers_failed(self, exc: BaseException) -> None:
        """A decode failed (a bug, a native error): every running answer stops where it is,
        saved where the cache holds its tokens, and the failure is reported once."""
        message = None
        for session in self.sessions.running():
            running = session.answer
            if running is None:
                continue   # ended already
            conv_id, conv = session.id, running.job.conv
            self._end_answer(conv, durable=self._save_after_failure(conv))
            try:
                # each front end hears which answer ended, under the action that started it
                if running.request_id is not None:   # as a request's other failures are told
                    self.requests.ended(running.request_id, None, str(exc) or type(exc).__name__)
                    self.listener.emit(Failed(running.action, str(exc) or type(exc).__name__, conv_id))
                else:
                    message = self._report_error(running.action, exc, quiet=message is not None,
                                                 conv_id=conv_id)
                self.listener.emit(_failed(conv.id, conv))
            except Exception:  # noqa: BLE001 - every other answer must still be ended
                log.exception("could not report the failed answer of %s", conv_id)
        self._batcher = self._new_batcher()   # the failed one's state is not to be trusted

    # -- checkpoints --------------------------------------------------------------------------
    def _writer(self, conv: Conversation):
        """This conversation's line writer (a new line for a conversation with no files)."""
        from engine.history import LineWriter
        session = self.sessions.named(conv.id)
        if session.writer is None:
            self.sessions.set_writer(conv.id, LineWriter.starting(self._view(conv), self.store,
                                                                  default_line(conv.id)))
        return session.writer

    def _save_after_failure(self, conv: Conversation) -> bool:
        """Save what the cache holds of ``conv`` after a failure; False when its sequence
        holds tokens that could not be saved (it must then not be evicted)."""
        if self.runtime is None:
            return True
        kv = self._view(conv).kv_tokens
        n = len(kv)
        if not n or not conv.paused or conv.tokens[:n] != kv:
            return True   # nothing of it to keep (or nothing that matches it)
        try:
            self._save(conv, KIND_EXIT)
            return True
        except Exception:  # noqa: BLE001 - the original failure is what gets reported
            log.exception("could not save after a failed generation")
            return False

    def _do_landed(self, conv_id: uuid.UUID, path: Path) -> None:
        """The save of ``conv_id`` into ``path`` has landed: settling its writer announces
        it.  Not when a newer save is landing by now: that one's settling announced this
        one, and settling now would wait for the newer one's fsync (its own word follows)."""
        session = self.sessions.get(conv_id)
        writer = session.writer if session is not None else None
        if writer is not None and writer.landing_path == path:
            writer.settle()

    def _save(self, conv: Conversation, kind: int) -> None:
        kind = head_kind(conv.paused, kind)   # engine.checkpoint_policy: a truthful kind
        self._writer(conv).settle()   # the autosave still landing is announced first
        self.listener.emit(CheckpointSaving(conv.id, kind))
        info = self._writer(conv).save_head(conv, kind)
        self.sessions.named(conv.id).head = info.path
        if self.runtime is not None and conv.id in self.runtime.table:
            self.runtime.table.saved(conv.id)   # evicting it now loses nothing
        self.listener.emit(CheckpointSaved(self.snapshot(conv), info.path, info.size, info.seconds, kind))

    def _autosave(self, conv: Conversation) -> None:
        """Autosave: a delta on the line's live chain (engine.history.LineWriter.autosave)."""
        writer = self._writer(conv)
        try:
            info = writer.autosave(conv)
        except CheckpointError as exc:
            self.listener.emit(Failed(cmd.Action.AUTOSAVE, str(exc), conv.id))
            return
        session = self.sessions.named(conv.id)
        saved = CheckpointSaved(self.snapshot(conv, branches=False), info.path, info.size,
                                info.seconds, KIND_AUTOSAVE)

        def landed() -> None:   # the session's head only once it is a file
            session.head = info.path
            self.listener.emit(saved)
        # announced by this thread once it has landed: when the writer next settles, which
        # the helper thread asks for at once (cmd.Landed), or before the next save
        writer.when_landed(landed, wake=lambda: self.submit(cmd.Landed(conv.id, info.path)),
                           failed=lambda exc: self.listener.emit(Failed(
                               cmd.Action.AUTOSAVE, f"an autosave could not be saved: {exc}", conv.id)))
        try:
            report = graph.prune(self.store, self.autosave_budget)
            if report.deleted:
                log.info("pruned the store: %s", report.describe())
        except OSError as exc:
            log.warning("could not prune the store: %s", exc)

    def _save_if_dirty(self, conv: Conversation, kind: int) -> None:
        """Save ``conv`` unless its head holds exactly what its sequence holds."""
        session = self.sessions.named(conv.id)
        if not session.resident_in(self.runtime) or session.answer is not None:
            return
        kv = self._view(conv).kv_tokens
        writer = session.writer
        head = writer.head if writer is not None else None
        saved = head is not None and head.holds(kv)
        if kv and not saved and conv.tokens[:len(kv)] == kv:
            self._save(conv, kind)

    def _save_residents_if_dirty(self, kind: int) -> None:
        """Before the cache goes (exit, another model): every resident conversation's head
        holds what its sequence holds."""
        if self.runtime is None:
            return
        for key in self.runtime.table.residents():
            # the table keys anything hashable; the worker places its conversations by id
            conv = self.sessions.conversation(cast(uuid.UUID, key))
            if conv is not None:
                try:
                    self._save_if_dirty(conv, kind)
                except Exception as exc:  # noqa: BLE001 - the others are saved all the same
                    self._report_error(cmd.Action.SAVE_BEFORE_CLOSING, exc, conv_id=conv.id)

    def _activate(self, conv: Conversation, *, running: bool = False):
        """Give ``conv`` a sequence and make it hold as much of ``conv`` as possible
        without decoding; returns the placement (engine.sequences.Placement).

        A resident conversation keeps its sequence and what it holds; another one gets a
        free sequence or the least recently used idle one's (evicting it writes nothing:
        its head holds its state), and is restored through its head's chain when that
        holds more of its tokens than the sequence shares with it.  Whatever is still
        missing, the prefill decodes.  ``running``: an answer starts in it at once.
        """
        from engine.checkpoints.chain import common_prefix, load_chain, release
        from engine.history import LineWriter
        rt = self._need_runtime()
        session = self.sessions.named(conv.id)
        if session.tokens_model is not None:   # (see _leave_conversations_of)
            raise IncompatibleModel(f"{conv.title}: its tokens are {session.tokens_model[1]}'s, whose save "
                                    "before the switch failed: load that model to go on with it")
        placement = rt.place(conv.id, running=running)
        view = rt.view_of(conv.id)
        writer, head = session.writer, session.head_path
        if head is None:
            if writer is None and conv.answer is not None and running:
                # a new conversation's first answer: from the store's longest stored prefix
                # of its prompt (a long system prompt's shared prefix), not from nothing
                from engine.prefix_reuse import start_from_stored_prefix
                self.sessions.set_writer(conv.id, start_from_stored_prefix(view, self.store, conv))
            self._writer(conv)
            return placement
        # what the sequence can go back to: a recurrent memory past its snapshots, none
        in_cache = view.can_keep(common_prefix(view.kv_tokens, conv.tokens))
        if writer is not None and writer.head and writer.head.n_tokens <= in_cache:
            return placement   # the cache already holds all the head has (and the writer knows its files)
        try:
            chain = load_chain(head, crc_later=True)   # settled by the restore, or the writer
            try:
                self._restore_prefix(chain, conv, in_cache)
            finally:
                release(chain)   # the files stay replaceable (Windows maps a restore's files)
            if writer is None:
                self.sessions.set_writer(conv.id, LineWriter.continuing(view, self.store, chain))
        except IncompatibleModel as exc:   # its tokens are that model's: never decoded by this one
            raise IncompatibleModel(f"{conv.title}: {exc}. Load that model to go on with it, or open it "
                                    "again to continue it with the loaded model as a new branch") from None
        except (CheckpointError, OSError) as exc:   # damaged, or gone (deleted by another program)
            log.warning("could not restore %s (%s); the prompt will be decoded again", head, exc)
            if writer is None:   # continue on a line of its own; the old head stays as it is
                self.sessions.set_writer(conv.id, LineWriter.starting(view, self.store, uuid.uuid4().hex))
        return placement

    def _restore_prefix(self, chain, conv: Conversation, in_cache: int) -> None:
        """Restore as much of ``conv`` as ``chain`` holds, when that beats the cache.

        The head may hold more than the conversation (Regenerate cut the answer, an Edit
        put an earlier turn's end in the cache): the chain is restored and the tail
        trimmed; a memory with a recurrent part goes back to the chain's nearest turn
        end (a point: engine.checkpoints.points) or a snapshot, and a memory that cannot trim
        otherwise (sliding-window layers) takes the deepest file of the chain that is wholly
        a prefix instead.  Nothing is restored where none of that beats the cache.
        """
        from engine.checkpoints.chain import common_prefix
        from engine.checkpoints.points import nearest_point
        rt = self._view(conv)
        last = chain[-1]
        common = common_prefix(last.tokens[:last.header.n_tokens], conv.tokens)
        point = nearest_point(chain, common) if rt.shape.has_recurrent else None
        prefix = [d for d in chain if d.header.n_tokens <= common]
        if common <= in_cache or (rt.shape.has_recurrent and max(
                point.n_tokens if point else 0, prefix[-1].header.n_tokens if prefix else 0) <= in_cache):
            return
        started = time.perf_counter()
        rt.restore_chain(chain)
        if point is not None and rt.can_keep(common) < point.n_tokens:
            kept = rt.trim(point.n_tokens, point)
        else:
            kept = rt.trim(common)
        if kept < common and prefix and prefix[-1].header.n_tokens > max(in_cache, kept):
            rt.restore_chain(chain[:len(prefix)])
        log.info("restored %d of %d tokens from %s (%d file(s)) in %.2f s", len(rt.kv_tokens),
                 len(conv.tokens), last.path.name if last.path else "a chain", len(chain),
                 time.perf_counter() - started)
