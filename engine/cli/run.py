"""``checkpoint-chat run``: generate, pause (Ctrl+C or ``--stop-after``), save, resume.

:class:`RunSession` is one run: it chooses the library, reads the checkpoint to
continue (a delta brings its chain), checks the context before loading the model,
restores or starts the conversation, generates with autosave, and saves where the
user asked.  With ``--progress`` it announces its stages on stderr, one line each
(``[STAGE] loading``, ``[STAGE] prefill``, ``[STAGE] generating``, ``[STAGE] saving``),
so that scripts and tests can wait for a stage instead of sleeping.
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.cli.options import context_settings, model_path, sampler_from_args
from engine.cli.output import EXIT_ERROR, EXIT_OK, answer_fields, human_size, print_json
from engine.errors import AppError, CheckpointError

if TYPE_CHECKING:   # imported where used: the CLI starts before llama.cpp is loaded
    from engine.checkpoint_policy import Checkpoints
    from engine.checkpoints.format import CheckpointData
    from engine.prefix_reuse import PrefixReuse
    from engine.runtime import Runtime


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


def newer_autosave_beside(path: Path) -> Path | None:
    """The newest autosave beside ``path`` when a run saving to it ended before writing
    it (a crash, a kill): it holds more than ``path`` does."""
    from engine.checkpoint_policy import beside_folder
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
    if args.checkpoint_save:
        from engine.checkpoints.graph import overwrite_problem
        problem = overwrite_problem(args.checkpoint_save)
        if problem:   # before the model loads, before a token is generated
            raise AppError(problem)
    control = Control()
    # Ctrl+C, SIGTERM and (on Windows) closing the console all mean "pause and save";
    # installed before the model loads, so an early Ctrl+C saves an empty-handed pause
    # (the prompt, nothing decoded) instead of a traceback
    guard = ShutdownGuard(lambda reason: control.request_pause())
    with guard:
        session = RunSession(args, prompt, control, guard)
        try:
            outcome = session.run()
        except KeyboardInterrupt:   # a second Ctrl+C: leave now, without the pause's checkpoint
            session.say_what_remains()
            raise
        finally:
            guard.save_finished()  # a waiting console-close handler may let the process go
    if session.output_failed is not None:
        exc = session.output_failed
        why = getattr(exc, "strerror", None) or exc
        # (the failure may have come with the answer's last token: then it ended, not paused)
        saved = ("it was paused and saved (above); continue it with --checkpoint-load"
                 if outcome["finish_reason"] == "paused" else "it was saved whole (above)")
        print(f"error: the answer could not be written to the output ({why}): {saved}", file=sys.stderr)
        return EXIT_ERROR
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
        self.chain: list[CheckpointData] | None = None   # the checkpoint continued, base first
        #: its states were of another llama.cpp layout: read again, its files no parent of ours
        self.read_again = False
        self.runtime: Runtime | None = None
        self.checkpoints: Checkpoints | None = None   # where its files go
        self.reuse: PrefixReuse | None = None
        # Timings as the user lives them (see outcome): the checkpoint's read + verify
        # happens before the model loads, which time to first token does not count
        self.read_s = 0.0
        self.restore_s = 0.0     # read + verify + set state of the checkpoint started from
        self.requested_at: float | None = None
        self.answer_before = ""  # the answer's text shown before this run (a paused one resumed)
        #: why the answer could not be written to stdout (the reader went away: ``| head``):
        #: the run paused there and saved, as for Ctrl+C
        self.output_failed: Exception | None = None

    @property
    def rt(self) -> Runtime:
        """The loaded runtime: :meth:`run` loads it before every other step."""
        if self.runtime is None:
            raise RuntimeError("the model is not loaded yet")
        return self.runtime

    def say_what_remains(self) -> None:
        """Left at once (a second Ctrl+C): say what can be resumed; the pause is saved only
        where the interrupt came after its file was written."""
        checkpoints = self.checkpoints
        newest = checkpoints.newest_on_disk() if checkpoints is not None else None
        if newest is not None and checkpoints is not None and newest == checkpoints.saved_head:
            print(f"[CHECKPOINT] Saved to: {newest}", file=sys.stderr)
        elif newest is not None:
            print(f"[CHECKPOINT] Left without saving the pause; the newest checkpoint is: {newest}",
                  file=sys.stderr)
        elif self.requested_at is not None:   # (before the answer began nothing was lost)
            kept = (f"; {self.args.checkpoint_load}, which it continued, is as it was"
                    if self.args.checkpoint_load else "")
            print("[CHECKPOINT] Left without saving the pause: nothing of this run was saved "
                  f"(--checkpoint-save-interval N autosaves as it goes){kept}", file=sys.stderr)

    def lose_output(self, exc: Exception) -> None:
        """The answer cannot be written (a closed pipe, a stream that cannot take a
        character): pause and save it, as Ctrl+C does, rather than lose it with a traceback."""
        self.output_failed = exc
        self.control.request_pause()
        if isinstance(exc, OSError):   # what is left in stdout's buffer goes nowhere at exit
            try:
                devnull = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(devnull, sys.stdout.fileno())
                finally:
                    os.close(devnull)
            except (OSError, ValueError, AttributeError):
                pass

    def stage(self, name: str) -> None:
        if self.args.progress:
            self.progress(f"[STAGE] {name}")

    def progress(self, line: str) -> None:
        """A --progress line on stderr; one that cannot be written is dropped (stderr in the
        same closed pipe as stdout, ``2>&1 | head``): the answer's pause and save come first."""
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    # -- the steps ------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from engine.checkpoints.chain import load_chain, release, settle
        from engine.checkpoints.compat import ContextShape, Target
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
        # its checksums run on while the model loads (settled when it is restored)
        self.chain = load_chain(args.checkpoint_load, crc_later=True) if args.checkpoint_load else None
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
        try:
            self.runtime = rt = Runtime(model_path(args, data.meta if data else None), settings,
                                        n_gpu_layers=args.n_gpu_layers, main_gpu=args.main_gpu,
                                        workers=workers)
        except Exception:   # (an interrupt stays an interrupt)
            if self.chain:
                settle(self.chain)   # a damaged file named the model: that is the reason
            raise
        if workers is not None:
            print(f"[RPC] {rt.model.placement}", file=sys.stderr, flush=True)
        # the request, for time to first token: now (model loaded) less the read above
        self.requested_at = time.perf_counter() - self.read_s
        try:
            try:
                conv = self.conversation()
            finally:
                if self.chain:   # the files stay replaceable (Windows maps a restore's files)
                    release(self.chain)
            self.prepare_store(conv)
            result = self.generate(conv)
            checkpoint = self.save(conv, result)
            return self.outcome(conv, result, checkpoint)
        finally:
            if self.checkpoints is not None:   # after a failure the autosaves hold the newest state
                self.checkpoints.close()
            rt.close()

    def conversation(self):
        """The restored conversation (or a new one), with the new message if any."""
        from engine.conversation import Conversation
        from engine.generation import begin_answer, cut_to_history
        args, rt = self.args, self.rt
        if args.from_turn is not None and (self.chain is None or self.prompt is None):
            raise AppError("--from-turn K needs --checkpoint-load FILE and the new text of turn K (-p)")
        if self.chain is not None:
            chain, kept, point = self.chain, None, None
            if args.from_turn is not None:
                chain, kept, point = self.chain_to_edit(args.from_turn)
            conv = self.restore_or_read_again(chain)
            if kept is not None and point is not None:   # a turn end absorbed as a point
                conv.messages, conv.answer = kept, None
                # (read again: the cache is empty, the tokens are decoded as they were)
                upto = point.n_tokens
                conv.tokens = conv.tokens[:upto if self.read_again else rt.trim(upto, point)]
            elif kept is not None:      # turn K and what followed it stay on the old branch
                conv.messages, conv.answer = kept, None
                # the branch starts where that history ended, decoded as it was
                found = cut_to_history(conv, rt) is not None
                if self.read_again:
                    pass
                elif not found:
                    print(f"note: the tokens of the turns before turn {args.from_turn} do not match their text "
                          "in this file: the prompt is made from the text, and what differs from the file's "
                          "tokens is read again", file=sys.stderr)
                elif rt.trim(len(conv.tokens)) < len(conv.tokens):
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
            # a new message after a paused answer keeps what was generated so far
            conv.interrupt_paused()
            begin_answer(conv, rt, self.prompt,
                         n_predict=-1 if args.n_predict is None else args.n_predict)
            from engine.chat_template import template_problem
            problem = template_problem(rt.model)
            if problem:
                print(f"note: {problem}", file=sys.stderr)
        elif (paused := conv.paused_answer) is None:
            raise AppError("this checkpoint's answer is complete; give --prompt to continue "
                           "the conversation")
        elif args.n_predict is not None:
            paused.n_predict = args.n_predict
        return conv

    def restore_or_read_again(self, chain):
        """The chain restored; or, when its states were written by another llama.cpp (state
        layout), its conversation read again from its tokens, saved anew at the end."""
        from engine.checkpoints.chain import settle
        from engine.errors import IncompatibleState
        from engine.restore import text_of_chain
        rt = self.rt
        try:
            conv = rt.restore_chain(chain)
            settle(self.chain or chain)   # the files after an edited turn too: the new branch names them
            return conv
        except IncompatibleState as exc:
            conv = text_of_chain(chain, rt.target)
            settle(self.chain or chain)
            rt.trim(0)
            print(f"note: {exc}; its {chain[-1].header.n_tokens} tokens are read again, and it is "
                  "saved anew in this layout", file=sys.stderr)
            self.read_again = True
            return conv

    def chain_to_edit(self, turn: int):
        """The files to restore for editing user turn ``turn``, the messages to keep of their
        conversation and the point to trim their state to: the state at the end of the turn
        before it when the chain still has that file (None, None), or a file that absorbed it
        (the messages, its point: engine.checkpoints.points), else the whole chain (the
        messages, None)."""
        from engine.branches import turn_end, user_turn_index
        from engine.checkpoints.chain import settle
        from engine.conversation import Conversation
        from engine.generation import commit_answer
        chain = self.chain
        if chain is None:
            raise AppError("--from-turn K needs --checkpoint-load FILE")
        # the files' conversations decide what is restored: checked first (read with
        # crc_later, a large state's checksum may still be running)
        settle(chain)
        last = chain[-1]
        saved = last.meta.get("conversation")
        full = Conversation.from_json(saved if isinstance(saved, dict) else {}, [])
        commit_answer(full)
        try:
            index = user_turn_index(full.messages, turn)
        except ValueError as exc:
            raise AppError(str(exc)) from None
        kept = full.messages[:index]
        k, _n, point = turn_end(chain, kept)
        if k:
            # the file of exactly that history: restored as it was saved, so the new turn's
            # tokens follow its tokens as a continuation's would (a sliding-window or
            # recurrent memory depends on where each token was decoded); or a file that
            # absorbed it, trimmed to it (a point; a recurrent part is put back first)
            return chain[:k], (kept if point is not None else None), point
        return chain, kept, None

    def prepare_store(self, conv) -> None:
        """Prefix reuse, and where the conversation's checkpoints go: with --checkpoint-save
        P, autosaves are deltas in a hidden folder beside P, and P itself is written once,
        whole, at the end; otherwise the conversation's line in the store grows by deltas
        (engine.checkpoint_policy)."""
        from engine.checkpoint_policy import Checkpoints
        from engine.checkpoints.store import Store
        store = self.store = Store()
        if self.args.reuse_prefix and self.chain is None:
            from engine.prefix_reuse import reuse_stored_prefix, share_stored_prefix
            started = time.perf_counter()
            self.reuse = reuse = reuse_stored_prefix(self.rt, store.folder, conv.tokens)
            if not self.args.checkpoint_save:   # (a named file keeps no shared prefix beside it)
                share_stored_prefix(conv, reuse)
            if reuse.source is not None:
                self.restore_s = time.perf_counter() - started
            if not self.args.json:
                print(f"[PREFIX] {reuse.describe()}", file=sys.stderr)
        self.checkpoints = Checkpoints(self.rt, named=self.args.checkpoint_save or None,
                                       autosave_every=self.args.checkpoint_save_interval,
                                       store_line=lambda: self.store_line(store, conv))

    def store_line(self, store, conv):
        """The writer of the conversation's line in ``store``: on the loaded file when it
        is a store head; an edit (--from-turn) is a new branch."""
        from engine.checkpoints.graph import default_line
        from engine.history import LineWriter, saved_infos
        # files of another state layout are no parent of a file of ours: a full one comes first
        chain: list[CheckpointData] | None = [] if self.read_again else self.chain
        if self.chain and self.args.from_turn is not None:
            infos = saved_infos(chain) if chain and store.contains(chain[-1].path) else []
            return LineWriter.starting(self.rt, store, uuid.uuid4().hex, infos)
        if chain:
            return LineWriter.continuing(self.rt, store, self.in_store(store, chain))
        # --reuse-prefix: the first save builds on the files the prompt's beginning came from
        reused = self.reuse.chain if self.reuse is not None else ()
        infos = saved_infos(reused) if reused and store.contains(reused[-1].path) else []
        return LineWriter.starting(self.rt, store, default_line(conv.id), infos)

    def in_store(self, store, chain):
        """The loaded chain as files of ``store``: a file from elsewhere is imported once
        (engine.checkpoints.transfer; the next run finds it there), so the conversation's
        checkpoints are deltas on it rather than a full copy each run."""
        from engine.checkpoints.format import read_checkpoint
        from engine.checkpoints.transfer import import_files
        if store.contains(chain[-1].path):
            return chain
        results = import_files([d.path for d in chain], store, self.rt.target)
        imported = [r.imported for r in results if r.ok and r.imported is not None]
        if len(imported) != len(results):
            problem = next((r.message() for r in results if not r.ok), "")
            print(f"note: {chain[-1].path.name} could not be linked into the store ({problem}); "
                  "its conversation is saved there in full", file=sys.stderr)
            return chain
        head = results[-1].head   # the loaded file is in the store already, and no head: one on it
        return [read_checkpoint(path, load_state=False) for path in (*imported, *([head] if head else []))]

    def generate(self, conv):
        from engine.generation import generate
        args, runtime, checkpoints, session = self.args, self.rt, self.checkpoints, self
        assert checkpoints is not None   # prepare_store made them

        def autosave(c) -> None:
            try:
                checkpoints.autosave(c)
            except CheckpointError as exc:
                print(f"warning: autosave failed: {exc}", file=sys.stderr)

        class Printer:
            started = False

            def on_prefill_progress(self, done: int, total: int) -> None:
                if args.progress:
                    session.progress(f"[PREFILL] {done}/{total}")

            def on_text(self, delta: str) -> None:
                if not self.started:
                    self.started = True
                    session.stage("generating")
                if not args.json and session.output_failed is None:
                    try:
                        sys.stdout.write(delta)
                        sys.stdout.flush()
                    except (OSError, ValueError) as exc:   # (a UnicodeEncodeError is a ValueError)
                        session.lose_output(exc)

        self.stage("prefill")
        self.answer_before = conv.answer.text[:conv.answer.emitted]
        return generate(runtime, conv, control=self.control, listener=Printer(),
                        stop_after=args.stop_after,
                        autosave_every=max(0, args.checkpoint_save_interval), autosave=autosave,
                        checkpoint_prompt=checkpoints.prompt_checkpoint,
                        confidence=bool(args.json), requested_at=self.requested_at)

    def save(self, conv, result):
        """The pause / exit / end checkpoint; returns its SaveInfo."""
        from engine.checkpoint_policy import stop_kind
        from engine.generation import commit_answer
        args = self.args
        # every run ends with its conversation's head: in the store (a delta on what it
        # continued, so the next run, an edit of any turn or a branch builds on it), or
        # in the file --checkpoint-save names
        self.stage("saving")
        kind = stop_kind(result.paused, exiting=self.guard.requested)
        commit_answer(conv)
        assert self.checkpoints is not None   # prepare_store made them
        checkpoint = self.checkpoints.save_head(conv, kind)
        if not args.json and not result.text.endswith("\n") and self.output_failed is None:
            print()
        print(f"[CHECKPOINT] Saved to: {checkpoint.path} (size: {human_size(checkpoint.size)})",
              file=sys.stderr)
        # no prune here: each save retires what it supersedes on its own line, and how
        # much superseded history to keep is the window's setting, not this run's
        return checkpoint

    def outcome(self, conv, result, checkpoint) -> dict[str, Any]:
        """The ``--json`` result.  ``ttft_s`` counts from the request once the model is
        loaded and includes ``restore_s`` (reading, verifying and setting the state of
        the checkpoint the run started from, 0 without one); ``prefill_s`` is decoding
        only."""
        from engine.chat_template import think_format
        reuse = self.reuse
        return {
            **answer_fields(result.text, think_format(self.rt.model), before=self.answer_before,
                            final=not result.paused),
            "finish_reason": result.finish_reason,
            "n_prompt_tokens": result.n_prompt_tokens, "n_reused_tokens": result.n_reused_tokens,
            "n_generated": result.n_generated, "ttft_s": result.ttft_s,
            "restore_s": self.restore_s,
            "prefill_s": result.prefill_s, "tokens_per_s": result.tokens_per_s,
            "checkpoint": str(checkpoint.path) if checkpoint else None,
            "confidence": result.confidence, "seed": conv.sampler.seed,
            "prefix_reuse": reuse.how if reuse else None,
            "prefix_source": str(reuse.source) if reuse and reuse.source else None,
        }
