"""The ``checkpoint-chat`` command line: a front end of the engine, like the window.

The engine's core is everything in ``engine/`` but this package and ``engine/server``
(the other front end): the generation loop, sessions, checkpoints and their policy.
The command line builds on it and the core never imports it (tests/test_boundaries.py).

Subcommands: ``run`` (generate, pause, resume: engine.cli.run), the file commands
``validate``, ``inspect``, ``list``, ``compact`` (engine.cli.files), ``info``,
``rpc-worker`` (serve this machine's device to others: engine.cli.rpc), and ``serve``
(the OpenAI-compatible server: engine.cli.serve); with none, the desktop app starts.
Every user mistake is one line on stderr and a non-zero exit status, never a traceback.
Nothing else in engine/ imports this package.
"""

from __future__ import annotations

import logging
import sys

from engine.cli.output import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, tolerate_unencodable
from engine.errors import AppError, ModelFileMissing


def main(argv: list[str] | None = None, gui_main=None) -> int:
    """Run one subcommand; with none (or a .kvckpt or .gguf file, as a file manager passes
    it), hand over to ``gui_main`` — the desktop app, which engine/ itself never imports."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0].lower().endswith((".kvckpt", ".gguf")):   # (a file manager's way: the window)
        return _start_gui(gui_main, argv)
    from engine.cli.parser import build_parser
    args = build_parser().parse_args(argv)
    tolerate_unencodable()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # llama.cpp's own log (including the error lines it prints when a pause aborts a
    # prefill) is for -v; failures reach the user as one sentence of ours instead
    logging.getLogger("native.llama").setLevel(logging.DEBUG if args.verbose else logging.CRITICAL)
    if args.verbose:
        logging.getLogger().setLevel(logging.DEBUG)
    if args.command in (None, "gui"):
        return _start_gui(gui_main, [args.model] if getattr(args, "model", None) else [])
    from engine.cli import files, rpc, run, serve
    from native.errors import NativeError
    if args.command in ("run", "serve"):
        run.report_previous_crash()
    handler = {"run": run.cmd_run, "validate": files.cmd_validate, "inspect": files.cmd_inspect,
               "compact": files.cmd_compact, "list": files.cmd_list, "info": files.cmd_info,
               "rpc-worker": rpc.cmd_rpc_worker, "serve": serve.cmd_serve}[args.command]
    try:
        return handler(args)
    except ModelFileMissing as exc:
        print(f"error: {exc}: give its path with --model", file=sys.stderr)
        return EXIT_ERROR
    except (AppError, NativeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except FileNotFoundError as exc:
        print(f"error: file not found: {exc.filename}", file=sys.stderr)
        return EXIT_ERROR
    except (IsADirectoryError, PermissionError) as exc:
        # (Windows says "Permission denied" for a folder opened as a file: said so only
        # where a checkpoint file was asked for, not for a folder that may not be listed)
        wanted = [getattr(args, name, None) for name in ("path", "checkpoint_load")]
        print(f"error: {exc.filename} is a folder, not a checkpoint file"
              if _is_folder(exc.filename) and any(_same_path(exc.filename, w) for w in wanted)
              else f"error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:
        return EXIT_ERROR
    except OSError as exc:   # a full disk, a store lock held too long (filelock's Timeout)...
        print(f"error: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:  # before the pause handler was installed, or a second Ctrl+C
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _same_path(a, b) -> bool:
    from pathlib import Path
    try:
        return a is not None and b is not None and Path(a) == Path(b)
    except TypeError:
        return False


def _is_folder(name) -> bool:
    import os
    try:
        return name is not None and os.path.isdir(name)
    except (TypeError, ValueError):
        return False


def _start_gui(gui_main, argv: list[str]) -> int:
    if gui_main is None:
        print("error: the desktop app starts with `checkpoint-chat` (no subcommand) or "
              "`checkpoint-chat-gui`", file=sys.stderr)
        return EXIT_USAGE
    return gui_main(argv)
