"""``checkpoint-chat run``: generate, pause (Ctrl+C or ``--stop-after``), save, resume.

:class:`RunSession` is one run: it chooses the library, reads the checkpoint to
continue (a delta brings its chain), checks the context before loading the model,
restores or starts the conversation, generates with autosave, and saves where the
user asked.  With ``--progress`` it announces its stages on stderr, one line each
(``[STAGE] loading``, ``[STAGE] prefill``, ``[STAGE] generating``, ``[STAGE] saving``),
so that scripts and tests can wait for a stage instead of sleeping.
"""

from __future__ import annotations

import shutil
import sys
import uuid
import time
from pathlib import Path
from typing import Any

from engine.cli import EXIT_OK, human_size
from engine.cli.output import print_json
from engine.errors import AppError, CheckpointError


def report_previous_crash() -> None:
    """Install the crash trace for this run; tell about an earlier run that crashed."""
    from engine import crashlog
    from engine.checkpoints.store import Store
    try:
        reports = crashlog.pending_crashes()
        crashlog.install()
    except OSError:
        return  # an unwritable log folder must not stop the chat
    if not reports:
        return
    kept = crashlog.acknowledge(reports)
    autosave = crashlog.newest_autosave(Store())
    last = reports[-1]
    details = "" if last.killed else f" ({last.excerpt}); details: {kept[-1] if kept else last.log}"
    print(f"note: Checkpoint Chat {last.what} in an earlier run{details}", file=sys.stderr)
    if autosave:
        print(f"note: its last autosave can be resumed with: checkpoint-chat run --checkpoint-load "
              f"{autosave}", file=sys.stderr)


def beside_folder(path: Path) -> Path:
    """Where the autosaves of a run saving to ``path`` go: a hidden folder beside it."""
    return path.with_name(f".{path.name}.autosaves")


def newer_autosave_beside(path: Path) -> Path | None:
    """The newest autosave beside ``path`` when a run saving to it ended before writing
    it (a crash, a kill): it holds more than ``path`` does."""
    from engine.checkpoints.graph import Graph
    folder = beside_folder(path)
    if not folder.is_dir():
        return None
    heads = Graph.scan(folder).heads
    return heads[0].path if heads else None


def cmd_run(args) -> int:
    from engine.generation import Control
    from engine.shutdown import ShutdownGuard

    prompts = args.prompts
    if args.parallel and len(prompts) > 1:
        from engine.cli.parallel import cmd_run_parallel
        return cmd_run_parallel(args, prompts)
    if len(prompts) > 1:
        raise AppError("several prompts (-p) need --parallel")
    prompt = prompts[0] if prompts else None
    if args.prompt_file:
        try:
            prompt = Path(args.prompt_file).read_text("utf-8")
        except UnicodeDecodeError:
            raise AppError(f"the prompt file {args.prompt_file} is not UTF-8 text") from None
    if prompt is None and not args.checkpoint_load:
        raise AppError("give a prompt (--prompt or --prompt-file) or a checkpoint to continue "
                       "(--checkpoint-load)")
    control = Control()
    # Ctrl+C, SIGTERM and (on Windows) closing the console all mean "pause and save";
    # installed before the model loads, so an early Ctrl+C saves an empty-handed pause
    # (the prompt, nothing decoded) instead of a traceback
    guard = ShutdownGuard(lambda reason: control.request_pause())
    with guard:
        try:
            outcome = RunSession(args, prompt, control, guard).run()
        finally:
            guard.save_finished()  # a waiting console-close handler may let the process go
    if args.json:
        print_json(outcome)
    return guard.exit_status if guard.requested else EXIT_OK


class RunSession:
    """One ``run``: from the arguments to the JSON outcome."""

    def __init__(self, args, prompt: str | None, control, guard) -> None:
        self.args = args
        self.prompt = prompt
        self.control = control
        self.guard = guard
        self.chain = None        # the checkpoint continued, base first
        #: its states were of another llama.cpp layout: read again, its files no parent of ours
        self.read_again = False
        self.runtime = None
        self.writer = None       # engine.history.LineWriter, when saving into the store
        self.side_writer = None  # --checkpoint-save P with autosaves: deltas beside P
        self.reuse = None
        # Timings as the user lives them (see outcome): the checkpoint's read + verify
        # happens before the model loads, which time to first token does not count
        self.read_s = 0.0
        self.restore_s = 0.0     # read + verify + set state of the checkpoint started from
        self.requested_at = None

    def stage(self, name: str) -> None:
        if self.args.progress:
            print(f"[STAGE] {name}", file=sys.stderr, flush=True)

    # -- the steps ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from engine.checkpoints.compat import ContextShape, Target
        from engine.checkpoints.chain import load_chain
        from engine.runtime import Runtime
        from native.library import bindings, choose_library

        args = self.args
        bindings(choose_library(cli_dir=args.llama_lib))
        if args.checkpoint_load:
            newer = newer_autosave_beside(Path(args.checkpoint_load))
            if newer is not None:
                print(f"note: a run saving to {args.checkpoint_load} stopped before writing it; its "
                      f"newest autosave is {newer} (load that to continue from there)", file=sys.stderr)
        started = time.perf_counter()
        self.chain = load_chain(args.checkpoint_load) if args.checkpoint_load else None
        self.read_s = time.perf_counter() - started if self.chain else 0.0
        data = self.chain[-1] if self.chain else None
        settings = context_settings(args, data.header if data else None)
        if data is not None:   # before spending time on loading the model
            Target(context=ContextShape.of(settings)).check(data.header, data.meta)
        self.stage("loading")
        workers = None
        if args.rpc:
            from engine.cli.rpc import connect_workers
            workers = connect_workers(args.rpc, args.rpc_timeout)
        self.runtime = Runtime(model_path(args, data.meta if data else None), settings,
                               n_gpu_layers=args.n_gpu_layers, main_gpu=args.main_gpu, workers=workers)
        if workers is not None:
            print(f"[RPC] {self.runtime.model.placement}", file=sys.stderr, flush=True)
        # the request, for time to first token: now (model loaded) less the read above
        self.requested_at = time.perf_counter() - self.read_s
        try:
            conv = self.conversation()
            self.prepare_store(conv)
            result = self.generate(conv)
            checkpoint = self.save(conv, result)
            return self.outcome(conv, result, checkpoint)
        finally:
            if self.writer is not None:
                self.writer.close()
            if self.side_writer is not None:   # a failure before the end: they hold the newest state
                self.side_writer.close()
            self.runtime.close()

    def conversation(self):
        """The restored conversation (or a new one), with the new message if any."""
        from engine.conversation import Conversation
        from engine.generation import begin_answer, cut_to_history
        args, rt = self.args, self.runtime
        if args.from_turn is not None and (self.chain is None or self.prompt is None):
            raise AppError("--from-turn K needs --checkpoint-load FILE and the new text of turn K (-p)")
        if self.chain is not None:
            chain, kept = self.chain, None
            if args.from_turn is not None:
                chain, kept = self.chain_to_edit(args.from_turn)
            conv = self.restore_or_read_again(chain)
            if kept is not None:      # turn K and what followed it stay on the old branch
                conv.messages, conv.answer = kept, None
                # the branch starts where that history ended, decoded as it was
                if cut_to_history(conv, rt) is not None and rt.trim(len(conv.tokens)) < len(conv.tokens):
                    print(f"note: this model's memory ({rt.shape.memory_name}) cannot go back to the end of "
                          f"turn {args.from_turn - 1} and no checkpoint of it is left in this file's chain: "
                          f"its {len(conv.tokens)} tokens are read again", file=sys.stderr)
            self.restore_s = self.read_s + rt.last_restore_s
            conv.sampler = sampler_from_args(args, conv.sampler)
            if args.stop:
                conv.stop_strings = args.stop
        else:
            from dataclasses import replace
            from engine.sampling import defaults_for_model, random_seed
            defaults, _source = defaults_for_model(rt.model)   # the model's own
            conv = Conversation(system_prompt=args.system or "", stop_strings=args.stop or [],
                                sampler=sampler_from_args(args, replace(defaults, seed=random_seed())))
        if self.prompt is not None:
            if conv.paused:
                # a new message after a paused answer keeps what was generated so far
                conv.answer.finish_reason = "interrupted"
            begin_answer(conv, rt, self.prompt,
                         n_predict=-1 if args.n_predict is None else args.n_predict)
            from engine.chat_template import template_problem
            problem = template_problem(rt.model)
            if problem:
                print(f"note: {problem}", file=sys.stderr)
        elif not conv.paused:
            raise AppError("this checkpoint's answer is complete; give --prompt to continue "
                           "the conversation")
        elif args.n_predict is not None:
            conv.answer.n_predict = args.n_predict
        return conv

    def restore_or_read_again(self, chain):
        """The chain restored; or, when its states were written by another llama.cpp (state
        layout), its conversation read again from its tokens, saved anew at the end."""
        from engine.errors import IncompatibleState
        from engine.runtime import text_of_chain
        rt = self.runtime
        try:
            return rt.restore_chain(chain)
        except IncompatibleState as exc:
            conv = text_of_chain(chain, rt.target)
            rt.trim(0)
            print(f"note: {exc}; its {chain[-1].header.n_tokens} tokens are read again, and it is "
                  "saved anew in this layout", file=sys.stderr)
            self.read_again = True
            return conv

    def chain_to_edit(self, turn: int):
        """The files to restore for editing user turn ``turn``: the state at the end of the
        turn before it when the chain still has that file (and None), else the whole chain
        and the messages to keep of it."""
        from engine.branches import turn_end, user_turn_index
        from engine.conversation import Conversation
        from engine.generation import commit_answer
        last = self.chain[-1]
        saved = last.meta.get("conversation")
        full = Conversation.from_json(saved if isinstance(saved, dict) else {}, [])
        commit_answer(full)
        try:
            index = user_turn_index(full.messages, turn)
        except ValueError as exc:
            raise AppError(str(exc)) from None
        kept = full.messages[:index]
        k = turn_end(self.chain, kept)
        if k:
            # the file of exactly that history: restored as it was saved, so the new turn's
            # tokens follow its tokens as a continuation's would (a sliding-window or
            # recurrent memory depends on where each token was decoded)
            return self.chain[:k], None
        return self.chain, kept

    def prepare_store(self, conv) -> None:
        """Prefix reuse, and the writer of the conversation's line in the store."""
        from engine.checkpoints.graph import default_line
        from engine.checkpoints.store import Store
        from engine.history import LineWriter
        store = self.store = Store()
        if self.args.reuse_prefix and self.chain is None:
            from engine.prefix_reuse import reuse_stored_prefix
            started = time.perf_counter()
            self.reuse = reuse_stored_prefix(self.runtime, store.folder, conv.tokens)
            if self.reuse.source is not None:
                self.restore_s = time.perf_counter() - started
            if not self.args.json:
                print(f"[PREFIX] {self.reuse.describe()}", file=sys.stderr)
        # with --checkpoint-save P, autosaves are deltas in a hidden folder beside P, and P
        # itself is written once, whole, at the end; otherwise the conversation's line in
        # the store grows by deltas (on the loaded file when it is a store head)
        if self.args.checkpoint_save and self.args.checkpoint_save_interval:
            side = Store(beside_folder(Path(self.args.checkpoint_save)))
            self.side_writer = LineWriter.starting(self.runtime, side, uuid.uuid4().hex)
        if not self.args.checkpoint_save:
            # files of another state layout are no parent of a file of ours: a full one comes first
            chain = [] if self.read_again else self.chain
            if self.chain and self.args.from_turn is not None:   # an edit: a new branch
                from engine.history import saved_info
                infos = [saved_info(d) for d in chain] if chain and store.contains(chain[-1].path) else []
                self.writer = LineWriter.starting(self.runtime, store, uuid.uuid4().hex, infos)
            elif chain:
                self.writer = LineWriter.continuing(self.runtime, store, chain)
            else:
                self.writer = LineWriter.starting(self.runtime, store, default_line(conv.id))

    def generate(self, conv):
        from engine.generation import generate
        args, runtime, session = self.args, self.runtime, self

        def autosave(c) -> None:
            try:
                (session.writer or session.side_writer).autosave(c)
            except CheckpointError as exc:
                print(f"warning: autosave failed: {exc}", file=sys.stderr)

        class Printer:
            started = False

            def on_prefill_progress(self, done: int, total: int) -> None:
                if args.progress:
                    print(f"[PREFILL] {done}/{total}", file=sys.stderr, flush=True)

            def on_text(self, delta: str) -> None:
                if not self.started:
                    self.started = True
                    session.stage("generating")
                if not args.json:
                    sys.stdout.write(delta)
                    sys.stdout.flush()

        self.stage("prefill")
        return generate(runtime, conv, control=self.control, listener=Printer(),
                        stop_after=args.stop_after,
                        autosave_every=max(0, args.checkpoint_save_interval), autosave=autosave,
                        checkpoint_prompt=self.writer.policy.prompt_checkpoint if self.writer else 0,
                        confidence=bool(args.json), requested_at=self.requested_at)

    def save(self, conv, result):
        """The pause / exit / end checkpoint; returns its SaveInfo."""
        from engine.checkpoints.format import KIND_EXIT, KIND_MANUAL, KIND_PAUSE
        from engine.generation import commit_answer
        args = self.args
        # every run ends with its conversation's head: in the store (a delta on what it
        # continued, so the next run, an edit of any turn or a branch builds on it), or
        # in the file --checkpoint-save names
        self.stage("saving")
        kind = KIND_EXIT if self.guard.requested else (KIND_PAUSE if result.paused else KIND_MANUAL)
        commit_answer(conv)
        if args.checkpoint_save:
            checkpoint = self.runtime.save(Path(args.checkpoint_save), conv, kind)
            self.drop_side_autosaves()   # P, whole and durable, holds all they held
        else:
            checkpoint = self.writer.save_head(conv, kind)
        if not args.json and not result.text.endswith("\n"):
            print()
        print(f"[CHECKPOINT] Saved to: {checkpoint.path} (size: {human_size(checkpoint.size)})",
              file=sys.stderr)
        # no prune here: each save retires what it supersedes on its own line, and how
        # much superseded history to keep is the window's setting, not this run's
        return checkpoint

    def drop_side_autosaves(self) -> None:
        """P holds all this run's autosaves held: delete them, and the folder once empty.
        Another run's files there (a crashed run's, pointed at when P was loaded) stay."""
        if self.side_writer is not None:
            writer, self.side_writer = self.side_writer, None
            store = writer.store
            writer.close()
            for info in writer.chain:
                if info.line == writer.line:
                    info.path.unlink(missing_ok=True)
            if not store.files():
                shutil.rmtree(store.folder, ignore_errors=True)

    def outcome(self, conv, result, checkpoint) -> dict[str, Any]:
        """The ``--json`` result.  ``ttft_s`` counts from the request once the model is
        loaded and includes ``restore_s`` (reading, verifying and setting the state of
        the checkpoint the run started from, 0 without one); ``prefill_s`` is decoding
        only."""
        reuse = self.reuse
        return {
            "text": result.text, "finish_reason": result.finish_reason,
            "n_prompt_tokens": result.n_prompt_tokens, "n_reused_tokens": result.n_reused_tokens,
            "n_generated": result.n_generated, "ttft_s": result.ttft_s,
            "restore_s": self.restore_s,
            "prefill_s": result.prefill_s, "tokens_per_s": result.tokens_per_s,
            "checkpoint": str(checkpoint.path) if checkpoint else None,
            "confidence": result.confidence, "seed": conv.sampler.seed,
            "prefix_reuse": reuse.how if reuse else None,
            "prefix_source": str(reuse.source) if reuse and reuse.source else None,
        }


# -- turning arguments into settings ---------------------------------------------------------------

def context_settings(args, header):
    from native.context import KV_TYPES, ContextSettings
    from native.errors import ContextError

    def kv_type(name: str | None, fallback: int) -> int:
        if name is None:
            return fallback
        if name not in KV_TYPES:
            raise ContextError(f"unknown KV cache type {name!r} (choose from {', '.join(KV_TYPES)})")
        return KV_TYPES[name]

    base = ContextSettings()
    n_ctx = args.ctx_size or (header.n_ctx if header else base.n_ctx)
    return ContextSettings(
        n_ctx=n_ctx, n_batch=args.batch_size or base.n_batch,
        n_ubatch=args.batch_size or base.n_ubatch, n_threads=args.threads or 0,
        flash_attn=(args.flash_attn == "on") if args.flash_attn else (header.flash_attn if header else base.flash_attn),
        type_k=kv_type(args.cache_type_k, header.type_k if header else base.type_k),
        type_v=kv_type(args.cache_type_v, header.type_v if header else base.type_v),
        n_seq_max=header.n_seq_max if header else base.n_seq_max,
        kv_unified=header.kv_unified if header else base.kv_unified)


def sampler_from_args(args, base):
    """The flags given, over ``base``: a resumed answer's sampler, or the model's defaults."""
    from engine.sampling import SamplerSettings, random_seed
    if args.seed is None:
        seed = base.seed          # a resumed answer keeps its seed
    elif args.seed < 0:
        seed = random_seed()      # llama.cpp's convention: -1 means random
    else:
        seed = args.seed
    pick = lambda value, default: default if value is None else value  # noqa: E731
    return SamplerSettings(
        temperature=pick(args.temp, base.temperature), top_k=pick(args.top_k, base.top_k),
        top_p=pick(args.top_p, base.top_p), min_p=pick(args.min_p, base.min_p),
        repeat_penalty=pick(args.repeat_penalty, base.repeat_penalty),
        repeat_last_n=pick(args.repeat_last_n, base.repeat_last_n), seed=seed,
        ignore_eos=pick(args.ignore_eos, base.ignore_eos))


def model_path(args, meta: dict | None) -> Path:
    from engine.models import default_model_path
    if args.model:
        return Path(args.model)
    stored = ((meta or {}).get("model") or {}).get("path")
    if stored and Path(stored).is_file():
        return Path(stored)
    return default_model_path()
