"""The ``checkpoint-chat`` command line.

Subcommands: ``run`` (generate, pause, resume), ``validate``, ``inspect``, ``list``,
``info``; with none, the desktop app starts.  Every user mistake is one line on stderr
and a non-zero exit status, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

from engine import APP_VERSION
from engine.errors import AppError, CheckpointError

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
log = logging.getLogger("engine")


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


# -- argument parsing ------------------------------------------------------------------------

def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def _not_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="checkpoint-chat",
                                description="Chat with local GGUF models; pause, save and resume "
                                            "generation exactly.")
    p.add_argument("--version", action="version", version=f"checkpoint-chat {APP_VERSION}")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    sub = p.add_subparsers(dest="command")

    run = sub.add_parser("run", help="generate text (and pause/resume with checkpoints)")
    run.add_argument("-m", "--model", help="GGUF model (default: SmolLM2-135M-Instruct)")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument("-p", "--prompt", help="user message")
    prompt.add_argument("-f", "--prompt-file", help="read the user message from a file")
    run.add_argument("--system", help="system prompt")
    run.add_argument("-n", "--n-predict", type=int, default=None,
                     help="answer length limit in tokens (-1: no limit; default -1)")
    run.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--temp", type=float, default=None, help="temperature (0: greedy; default 0.8)")
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--min-p", type=float, default=None)
    run.add_argument("--repeat-penalty", type=float, default=None)
    run.add_argument("--repeat-last-n", type=int, default=None)
    run.add_argument("--ignore-eos", action="store_true", default=None,
                     help="keep generating past end-of-generation tokens")
    run.add_argument("--stop", action="append", default=None, metavar="TEXT",
                     help="stop when this text appears (repeatable)")
    run.add_argument("-c", "--ctx-size", type=_positive, default=None, help="context size (default 4096)")
    run.add_argument("-b", "--batch-size", type=_positive, default=None, help="prefill chunk (default 512)")
    run.add_argument("-t", "--threads", type=_not_negative, default=None)
    run.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                     help="layers to offload to the GPU (-1: all; default 0)")
    run.add_argument("--main-gpu", type=int, default=0, help="GPU to use (default 0)")
    run.add_argument("-fa", "--flash-attn", choices=("on", "off"), default=None)
    run.add_argument("-ctk", "--cache-type-k", default=None, help="K cache type (f16, q8_0, ...)")
    run.add_argument("-ctv", "--cache-type-v", default=None, help="V cache type (f16, q8_0, ...)")
    run.add_argument("--llama-lib", help="folder with llama.dll / libllama.so to use")
    run.add_argument("--checkpoint-save", metavar="PATH", help="where pause / Ctrl+C / the end saves")
    run.add_argument("--checkpoint-load", metavar="PATH", help="continue from this checkpoint")
    run.add_argument("--checkpoint-save-interval", type=_not_negative, default=0, metavar="N",
                     help="autosave every N generated tokens")
    run.add_argument("--stop-after", type=_not_negative, default=None, metavar="N",
                     help="pause after N generated tokens and save, as the Pause button does")
    run.add_argument("--reuse-prefix", action="store_true",
                     help="start from the stored checkpoint sharing the longest prefix with the prompt")
    run.add_argument("--json", action="store_true", help="print one JSON object at the end")
    run.add_argument("--progress", action="store_true", help="print prefill progress on stderr")

    val = sub.add_parser("validate", help="check a checkpoint file")
    val.add_argument("path")
    val.add_argument("--model", help="also check it fits this GGUF model")

    comp = sub.add_parser("compact", help="merge a delta chain into one full checkpoint")
    comp.add_argument("path")
    comp.add_argument("-o", "--output", help="where to write it (default: beside, *-full.kvckpt)")
    comp.add_argument("--model", help="GGUF model (default: the one the checkpoint names)")
    comp.add_argument("--threads", type=int, default=None)
    comp.add_argument("--llama-lib", help="folder with llama.dll / libllama.so to use")

    ins = sub.add_parser("inspect", help="show a checkpoint's header and metadata")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true")

    lst = sub.add_parser("list", help="list the checkpoints in the store, newest first")
    lst.add_argument("--dir", help="store folder (default: the app's data folder)")
    lst.add_argument("--json", action="store_true")

    info = sub.add_parser("info", help="show the llama library, backends and devices")
    info.add_argument("--llama-lib", help="folder with llama.dll / libllama.so to use")
    info.add_argument("--json", action="store_true")

    sub.add_parser("gui", help="start the desktop app (the default)")
    return p


def main(argv: list[str] | None = None, gui_main=None) -> int:
    """Run one subcommand; with none (or a .kvckpt file, as a file manager passes it),
    hand over to ``gui_main`` — the desktop app, which engine/ itself never imports."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].lower().endswith(".kvckpt"):
        return _start_gui(gui_main, argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # llama.cpp's own log (including the error lines it prints when a pause aborts a
    # prefill) is for -v; failures reach the user as one sentence of ours instead
    logging.getLogger("native.llama").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    if args.command in (None, "gui"):
        return _start_gui(gui_main, [])
    if args.command == "run":
        _report_previous_crash()
    from native.errors import NativeError
    handler = {"run": cmd_run, "validate": cmd_validate, "inspect": cmd_inspect, "compact": cmd_compact,
               "list": cmd_list, "info": cmd_info}[args.command]
    try:
        return handler(args)
    except (AppError, NativeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except FileNotFoundError as exc:
        print(f"error: file not found: {exc.filename}", file=sys.stderr)
        return EXIT_ERROR
    except (IsADirectoryError, PermissionError) as exc:
        print(f"error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the pause handler was installed, or a second Ctrl+C
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _start_gui(gui_main, argv: list[str]) -> int:
    if gui_main is None:
        print("error: the desktop app starts with `checkpoint-chat` (no subcommand) or "
              "`checkpoint-chat-gui`", file=sys.stderr)
        return EXIT_USAGE
    return gui_main(argv)


# -- run ---------------------------------------------------------------------------------------

def _report_previous_crash() -> None:
    """Install the crash trace for this run; tell about a crash of an earlier one."""
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


def _context_settings(args, header):
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


def _sampler_from_args(args, base):
    from engine.sampling import SamplerSettings, random_seed
    base = base or SamplerSettings(seed=random_seed())
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


def _model_path(args, meta: dict | None) -> Path:
    from engine.models import default_model_path
    if args.model:
        return Path(args.model)
    stored = ((meta or {}).get("model") or {}).get("path")
    if stored and Path(stored).is_file():
        return Path(stored)
    return default_model_path()


def cmd_run(args) -> int:
    from engine.generation import Control
    from engine.shutdown import ShutdownGuard

    prompt = args.prompt
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
            outcome = _run_session(args, prompt, control, guard)
        finally:
            guard.save_finished()  # a waiting console-close handler may let the process go
    if args.json:
        print(json.dumps(outcome, ensure_ascii=False))
    return guard.exit_status if guard.requested else EXIT_OK


def _run_session(args, prompt: str | None, control, guard) -> dict[str, Any]:
    from engine.checkpoints import graph
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.compat import ContextShape, Target
    from engine.checkpoints.format import KIND_AUTOSAVE, KIND_EXIT, KIND_MANUAL, KIND_PAUSE
    from engine.checkpoints.store import Store
    from engine.conversation import Conversation
    from engine.generation import begin_answer, commit_answer, generate
    from engine.history import LineWriter
    from engine.runtime import Runtime
    from native.library import bindings, choose_library

    bindings(choose_library(cli_dir=args.llama_lib))
    chain = load_chain(args.checkpoint_load) if args.checkpoint_load else None
    data = chain[-1] if chain else None
    settings = _context_settings(args, data.header if data else None)
    if data is not None:   # before spending time on loading the model
        Target(context=ContextShape.of(settings)).check(data.header, data.meta)
    runtime = Runtime(_model_path(args, data.meta if data else None), settings,
                      n_gpu_layers=args.n_gpu_layers, main_gpu=args.main_gpu)
    try:
        if data is not None:
            conv = runtime.restore_chain(chain)
            conv.sampler = _sampler_from_args(args, conv.sampler)
            if args.stop:
                conv.stop_strings = args.stop
        else:
            conv = Conversation(system_prompt=args.system or "", stop_strings=args.stop or [],
                                sampler=_sampler_from_args(args, None))
        if prompt is not None:
            if conv.paused:
                # a new message after a paused answer keeps what was generated so far
                conv.answer.finish_reason = "interrupted"
            begin_answer(conv, runtime, prompt,
                         n_predict=-1 if args.n_predict is None else args.n_predict)
        elif not conv.paused:
            raise AppError("this checkpoint's answer is complete; give --prompt to continue "
                           "the conversation")
        elif args.n_predict is not None:
            conv.answer.n_predict = args.n_predict

        store = Store()
        reuse = None
        if args.reuse_prefix and data is None:
            from engine.prefix_reuse import reuse_stored_prefix
            reuse = reuse_stored_prefix(runtime, store.folder, conv.tokens)
            if not args.json:
                print(f"[PREFIX] {reuse.describe()}", file=sys.stderr)
        save_path = Path(args.checkpoint_save) if args.checkpoint_save else None
        # with --checkpoint-save, autosaves rewrite that file; otherwise the conversation's
        # line in the store grows by deltas (on the loaded file when it is a store head)
        writer = None
        if save_path is None:
            writer = (LineWriter.continuing(runtime, store, chain) if chain
                      else LineWriter(runtime, store, conv.id.hex))

        def autosave(c: Conversation) -> None:
            try:
                if writer is None:
                    runtime.save(save_path, c, KIND_AUTOSAVE)
                else:
                    writer.autosave(c)
            except CheckpointError as exc:
                print(f"warning: autosave failed: {exc}", file=sys.stderr)

        class Printer:
            def on_prefill_progress(self, done: int, total: int) -> None:
                if args.progress:
                    print(f"[PREFILL] {done}/{total}", file=sys.stderr, flush=True)

            def on_text(self, delta: str) -> None:
                if not args.json:
                    sys.stdout.write(delta)
                    sys.stdout.flush()

        result = generate(runtime, conv, control=control, listener=Printer(),
                          stop_after=args.stop_after,
                          autosave_every=max(0, args.checkpoint_save_interval), autosave=autosave)
        checkpoint = None
        autosaved = writer is not None and writer.saves > 0
        if result.paused or save_path or autosaved:
            kind = KIND_EXIT if guard.requested else (KIND_PAUSE if result.paused else KIND_MANUAL)
            commit_answer(conv)
            checkpoint = (runtime.save(save_path, conv, kind) if save_path
                          else writer.save_head(conv, kind))
            if not args.json and result.text and not result.text.endswith("\n"):
                print()
            print(f"[CHECKPOINT] Saved to: {checkpoint.path} (size: {human_size(checkpoint.size)})",
                  file=sys.stderr)
        elif not args.json:
            print()
        if store.folder.is_dir():
            graph.prune(store, graph.DEFAULT_BUDGET_BYTES)
        return {
            "text": result.text, "finish_reason": result.finish_reason,
            "n_prompt_tokens": result.n_prompt_tokens, "n_reused_tokens": result.n_reused_tokens,
            "n_generated": result.n_generated, "ttft_s": result.ttft_s,
            "prefill_s": result.prefill_s, "tokens_per_s": result.tokens_per_s,
            "checkpoint": str(checkpoint.path) if checkpoint else None,
            "confidence": result.confidence, "seed": conv.sampler.seed,
            "prefix_reuse": reuse.how if reuse else None,
            "prefix_source": str(reuse.source) if reuse and reuse.source else None,
        }
    finally:
        runtime.close()


# -- validate / inspect / list / info ------------------------------------------------------------

def cmd_validate(args) -> int:
    from engine.checkpoints import format as fmt
    from engine.checkpoints.chain import load_chain
    from engine.checkpoints.compat import ModelIdentity, Target
    from engine.checkpoints.kvstate import check_state_for

    path = Path(args.path)
    try:
        header = fmt.read_header(path)
        print("Header OK")
        # this file and every ancestor, CRCs verified and each linked to the next
        chain = load_chain(path) if header.is_delta else [fmt.read_checkpoint(path)]
        data = chain[-1]
        print("CRC32 OK")
        for item in chain:
            if item.header.n_tokens:
                check_state_for(item.header, item.state)
        print("KV state OK")
        if header.is_delta:
            print(f"Chain OK (a full checkpoint and {len(chain) - 1} delta(s))")
        if args.model:
            Target(ModelIdentity.from_gguf(args.model)).check(header, data.meta)
            print("Dimensions match model")
    except CheckpointError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return EXIT_ERROR
    return EXIT_OK


def cmd_compact(args) -> int:
    from engine.checkpoints.chain import load_chain
    from engine.compaction import compact_into, runtime_for
    from native.library import bindings, choose_library

    chain = load_chain(args.path)
    if not chain[-1].header.is_delta:
        print(f"{args.path} is already a full checkpoint")
        return EXIT_OK
    bindings(choose_library(cli_dir=args.llama_lib))
    runtime = runtime_for(chain, model=args.model, n_threads=args.threads or 0)
    try:
        out = Path(args.output) if args.output else Path(args.path).with_name(
            Path(args.path).stem + "-full.kvckpt")
        info = compact_into(runtime, chain, out)
    finally:
        runtime.close()
    print(f"[CHECKPOINT] Saved to: {info.path} (size: {human_size(info.size)}; "
          f"merged {len(chain)} files)")
    return EXIT_OK


def _header_json(h) -> dict[str, Any]:
    return {
        "format_version": h.version, "title": h.title, "kind": h.kind_name,
        "conversation_id": str(h.conversation_id),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(h.created_unix_ns / 1e9)),
        "model_fingerprint": h.model_fingerprint.hex(), "model_size": h.model_size,
        "n_vocab": h.n_vocab, "n_layer": h.n_layer, "n_head_kv": h.n_head_kv,
        "n_embd_head_k": h.n_embd_head_k, "n_embd_head_v": h.n_embd_head_v, "n_swa": h.n_swa,
        "n_ctx": h.n_ctx, "type_k": h.type_k, "type_v": h.type_v, "flash_attn": h.flash_attn,
        "kv_unified": h.kv_unified, "n_seq_max": h.n_seq_max, "n_tokens": h.n_tokens,
        "n_tokens_total": h.n_tokens_total, "n_generated": h.n_generated,
        "has_logits": h.has_logits, "prefill_pending": h.prefill_pending, "library": h.library,
        "sections": {"metadata": h.meta_len, "tokens": h.tokens_len, "logits": h.logits_len,
                     "state": h.state_len},
        "file_size": h.file_len,
    }


def _node_json(node, g) -> dict[str, Any]:
    """A file's place in its folder's graph (engine.checkpoints.graph)."""
    parent = g.parent(node)
    problem = g.chain_problem(node)
    return {
        "id": node.checkpoint_id,
        "parent": node.parent.file if node.parent else None,
        "parent_found": parent is not None if node.is_delta else None,
        "conversation": str(node.conversation_id), "line": node.line,
        "head": g.is_head(node),
        "needed_by_head": g.reachable(node),
        "chain": [n.name for n in g.chain(node)], "chain_size": g.chain_size(node),
        "chain_problem": problem,
    }


def _graph_of(path: Path):
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    g = Graph.scan(Store(path.parent))
    return g, g.nodes.get(path.name)


def cmd_inspect(args) -> int:
    from engine.checkpoints import format as fmt
    path = Path(args.path)
    header, meta = fmt.read_metadata(path)
    meta = dict(meta)
    g, node = _graph_of(path)
    place = _node_json(node, g) if node is not None else None
    if args.json:
        print(json.dumps({"header": _header_json(header), "metadata": meta, "graph": place},
                         ensure_ascii=False, indent=2))
        return EXIT_OK
    for key, value in _header_json(header).items():
        print(f"{key:18} {value}")
    # the metadata's shape is not trusted: a field of another type shows as "?"
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    print(f"{'model':18} {model.get('name', '?')} ({model.get('path', '?')})")
    conv = meta.get("conversation") if isinstance(meta.get("conversation"), dict) else {}
    print(f"{'sampler':18} {json.dumps(conv.get('sampler', '?'), ensure_ascii=False)}")
    if place is not None:
        role = "head of its line" if place["head"] else (
            "part of a head's chain" if place["needed_by_head"] else "not needed by any head")
        print(f"{'place':18} {role}")
        print("chain:" + (f"  BROKEN: {place['chain_problem']}" if place["chain_problem"] else ""))
        for name in place["chain"]:
            member = g.nodes[name]
            what = "delta" if member.is_delta else "full"
            print(f"  {what:5} {member.header.n_tokens:7d} tok  {human_size(member.size):>9}  {name}")
        print(f"  total {human_size(place['chain_size'])}")
    print("transcript:")
    transcript = meta.get("transcript")
    for message in transcript if isinstance(transcript, list) else []:
        if isinstance(message, dict):
            content = str(message.get("content", ""))
            more = "" if message.get("complete", True) else "  [paused]"
            print(f"  {message.get('role', '?')}: {content[:200]}{'…' if len(content) > 200 else ''}{more}")
    return EXIT_OK


def cmd_list(args) -> int:
    from engine.checkpoints.graph import Graph
    from engine.checkpoints.store import Store
    store = Store(args.dir)
    g = Graph.scan(store)
    nodes = sorted(g.nodes.values(), key=lambda n: n.created_ns, reverse=True)
    if args.json:
        out = [{"path": str(n.path), "size": n.size, "valid": True, "error": None,
                "header": _header_json(n.header), **_node_json(n, g)} for n in nodes]
        out += [{"path": str(u.path), "size": u.size, "valid": False, "error": u.error,
                 "id": None, "parent": None, "conversation": None, "head": False}
                for u in g.unreadable]
        print(json.dumps(out, ensure_ascii=False, indent=2))
        return EXIT_OK
    if not nodes and not g.unreadable:
        print("no checkpoints")
        return EXIT_OK
    # heads first, newest first, each with the files its chain needs folded under it
    shown = set()
    for head in g.heads:
        chain = g.chain(head)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(head.created_ns / 1e9))
        h = head.header
        extra = f"  ({len(chain)} files, {human_size(g.chain_size(head))})" if len(chain) > 1 else ""
        print(f"{when}  {h.kind_name:8} {h.n_tokens:6d} tok  {human_size(head.size):>9}  "
              f"{h.title}  [{head.path}]{extra}")
        for member in reversed(chain[:-1]):
            if member.name not in shown:
                print(f"{'':18}  └ {member.header.kind_name:8} {member.header.n_tokens:6d} tok  "
                      f"{human_size(member.size):>9}  {member.name}")
        shown.update(n.name for n in chain)
    for n in nodes:
        if n.name not in shown:
            why = g.chain_problem(n) or "superseded by a newer head of its line"
            print(f"{'':18}  {n.header.kind_name:8} {n.header.n_tokens:6d} tok  {human_size(n.size):>9}  "
                  f"{n.name}  ({why})")
    for u in g.unreadable:
        print(f"{'':18}  CORRUPT  {u.error}  [{u.path}]")
    return EXIT_OK


def cmd_info(args) -> int:
    from engine.models import default_model_path
    from native.library import REQUIRED_LLAMA_CPP_COMMIT, bindings, choose_library
    from native.sysinfo import system_info

    bindings(choose_library(cli_dir=args.llama_lib))
    info = system_info()
    try:
        model = str(default_model_path())
    except AppError as exc:
        model = f"not installed ({exc})"
    if args.json:
        print(json.dumps({"version": APP_VERSION, "library": info.library_path,
                          "library_version": info.library_version, "bundled": info.bundled,
                          "required_commit": REQUIRED_LLAMA_CPP_COMMIT,
                          "gpu_offload": info.gpu_offload, "features": info.features,
                          "devices": [d.__dict__ for d in info.devices], "default_model": model},
                         indent=2))
        return EXIT_OK
    print(f"Checkpoint Chat {APP_VERSION}")
    print(f"llama library   {info.library_path} ({'bundled' if info.bundled else 'user-chosen'}, "
          f"{info.library_version}; needs llama.cpp commit {REQUIRED_LLAMA_CPP_COMMIT})")
    print(f"GPU offload     {'yes' if info.gpu_offload else 'no'}")
    print(f"CPU features    {info.features}")
    for d in info.devices:
        print(f"device          {d.kind} {d.name}: {d.description}, "
              f"{human_size(d.memory_free)} free of {human_size(d.memory_total)}")
    print(f"default model   {model}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
