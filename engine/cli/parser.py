"""The command line's arguments: llama.cpp's familiar flag names, checked as they are parsed."""

from __future__ import annotations

import argparse
from typing import NoReturn

from engine import APP_VERSION


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


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, not {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, not {text}")
    return value


def _text(text: str) -> str:
    """Text for the model (a prompt, a system prompt, a stop string): an argument holding a
    byte that is not UTF-8 arrives with it escaped (a lone surrogate, which the tokenizer
    cannot encode: a traceback before) and is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not text (an undecodable byte, or half a UTF-16 surrogate "
                                         "pair): check the terminal's encoding, or use --prompt-file") from None
    return text


class _Parser(argparse.ArgumentParser):
    """A mistake in the arguments is one line on stderr and exit status 1, as every user
    mistake is (docs/cli.md), not argparse's usage block and status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(1, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


class _Prompts(argparse.Action):
    """``-p`` may be repeated (``--parallel``): ``prompt`` is the first, ``prompts`` all."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.prompts = [*(getattr(namespace, "prompts", None) or []), values]
        setattr(namespace, self.dest, namespace.prompts[0])


def _add_rpc(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--rpc", metavar="HOST:PORT[,...]", default=None,
                        help=f"remote workers (`checkpoint-chat rpc-worker`) {what}")
    parser.add_argument("--rpc-timeout", type=_seconds, default=None, metavar="SECONDS",
                        help="how long a worker may take to answer before it counts as hung "
                             "(default 120)")


def _port_or_any(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535 (0: any free one), not {text}")
    return value


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API; every "
                                         "answer is checkpointed, every request restored from its "
                                         "longest stored prefix")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1: this machine only; any other "
                            "needs --api-key)")
    serve.add_argument("--port", type=_port_or_any, default=8080, help="port (default 8080; 0: any free one)")
    serve.add_argument("--api-key", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (or set CHECKPOINT_CHAT_API_KEY)")
    serve.add_argument("--max-request-kb", type=_positive, default=1024, metavar="KB",
                       help="largest request body accepted (default 1024 KB)")
    serve.add_argument("-m", "--model", help="GGUF model (default: SmolLM2-135M-Instruct)")
    serve.add_argument("-c", "--ctx-size", type=_positive, default=None, help="context size (default 4096)")
    serve.add_argument("-b", "--batch-size", type=_positive, default=None, help="prefill chunk (default 512)")
    serve.add_argument("-t", "--threads", type=_not_negative, default=None)
    serve.add_argument("--sequences", type=_positive, default=4, metavar="S",
                       help="conversations resident in the cache at once, and requests answered "
                            "together; more wait (default 4)")
    serve.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                       help="layers to offload to the GPU (-1: all; default 0)")
    serve.add_argument("--main-gpu", type=int, default=0, help="GPU to use (default 0)")
    _add_rpc(serve, "to put the -ngl layers on")
    serve.add_argument("-fa", "--flash-attn", choices=("on", "off"), default=None)
    serve.add_argument("-ctk", "--cache-type-k", default=None, help="K cache type (f16, q8_0, ...)")
    serve.add_argument("-ctv", "--cache-type-v", default=None, help="V cache type (f16, q8_0, ...)")
    serve.add_argument("--llama-lib", help="folder with llama.dll / libllama.so to use")
    serve.add_argument("--checkpoint-save-interval", type=_not_negative, default=0, metavar="N",
                       help="also autosave every N generated tokens (answers are saved when they end)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="checkpoint-chat",
                description="Chat with local GGUF models; pause, save and resume generation exactly.")
    p.add_argument("--version", action="version", version=f"checkpoint-chat {APP_VERSION}")
    p.add_argument("-v", "--verbose", action="store_true", help="show llama.cpp's log")
    sub = p.add_subparsers(dest="command")

    _add_run(sub)
    _add_checkpoint_commands(sub)
    _add_info(sub)
    _add_rpc_worker(sub)
    _add_serve(sub)
    gui = sub.add_parser("gui", help="start the desktop app (the default)")
    gui.add_argument("-m", "--model", help="open it on this GGUF model (as File › Open Model; "
                                          "`checkpoint-chat MODEL.gguf` does the same)")
    return p


def _add_run(sub) -> None:
    """``run``: generate, pause and continue from checkpoints."""
    run = sub.add_parser("run", help="generate text (and pause/resume with checkpoints)")
    run.add_argument("-m", "--model", help="GGUF model (default: SmolLM2-135M-Instruct)")
    prompt = run.add_mutually_exclusive_group()
    prompt.add_argument("-p", "--prompt", action=_Prompts, type=_text,
                        help="user message (repeatable with --parallel: one conversation each)")
    run.set_defaults(prompts=[])
    prompt.add_argument("-f", "--prompt-file", help="read the user message from a file")
    run.add_argument("--system", type=_text, help="system prompt")
    run.add_argument("-n", "--n-predict", type=int, default=None,
                     help="answer length limit in tokens (-1: no limit; default -1)")
    run.add_argument("-s", "--seed", type=int, default=None, help="sampling seed (default: random)")
    run.add_argument("--temp", type=float, default=None,
                     help="temperature (0: greedy; default: the model's, see `info`)")
    run.add_argument("--top-k", type=int, default=None)
    run.add_argument("--top-p", type=float, default=None)
    run.add_argument("--min-p", type=float, default=None)
    run.add_argument("--repeat-penalty", type=float, default=None)
    run.add_argument("--repeat-last-n", type=int, default=None)
    run.add_argument("--ignore-eos", action="store_true", default=None,
                     help="keep generating past end-of-generation tokens")
    run.add_argument("--stop", action="append", type=_text, default=None, metavar="TEXT",
                     help="stop when this text appears (repeatable)")
    run.add_argument("-c", "--ctx-size", type=_positive, default=None, help="context size (default 4096)")
    run.add_argument("-b", "--batch-size", type=_positive, default=None, help="prefill chunk (default 512)")
    run.add_argument("-t", "--threads", type=_not_negative, default=None)
    run.add_argument("-ngl", "--n-gpu-layers", type=int, default=0,
                     help="layers to offload to the GPU (-1: all; default 0)")
    run.add_argument("--main-gpu", type=int, default=0, help="GPU to use (default 0)")
    _add_rpc(run, "to put the -ngl layers on")
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
    run.add_argument("--from-turn", type=_positive, default=None, metavar="K",
                     help="with --checkpoint-load and -p: keep the turns before your turn K, replace "
                          "turn K by the prompt and answer it (a new branch)")
    run.add_argument("--reuse-prefix", action="store_true",
                     help="start from the stored checkpoint sharing the longest prefix with the prompt")
    run.add_argument("--parallel", action="store_true",
                     help="one conversation per -p, generated concurrently in one context; "
                          "--checkpoint-save names a folder")
    run.add_argument("--sequences", type=_positive, default=None, metavar="S",
                     help="with --parallel: conversations the context holds at once (default 4)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object at the end (--parallel: one per conversation, "
                          "then a summary)")
    run.add_argument("--progress", action="store_true", help="print prefill progress on stderr")


def _add_checkpoint_commands(sub) -> None:
    """``validate``, ``compact``, ``inspect`` and ``list``: checkpoint files and the store."""
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
    shown = ins.add_mutually_exclusive_group()   # (the tree is text only)
    shown.add_argument("--json", action="store_true")
    shown.add_argument("--tree", action="store_true", help="show the conversation's branches as a tree")

    lst = sub.add_parser("list", help="list the checkpoints in the store, newest first")
    lst.add_argument("--dir", help="store folder (default: the app's data folder)")
    lst.add_argument("--json", action="store_true")


def _add_info(sub) -> None:
    """``info``: the llama library, its backends and devices."""
    info = sub.add_parser("info", help="show the llama library, backends and devices")
    info.add_argument("--llama-lib", help="folder with llama.dll / libllama.so to use")
    info.add_argument("--json", action="store_true")
    _add_rpc(info, "whose devices to list")


def _add_rpc_worker(sub) -> None:
    """``rpc-worker``: serve this machine's devices to other machines."""
    worker = sub.add_parser("rpc-worker", help="serve this machine's CPU or GPU to other machines "
                                               "(llama.cpp RPC)")
    worker.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; the "
                             "protocol has no authentication, see the README)")
    worker.add_argument("--port", type=_port, default=50052, help="port (default 50052)")
    worker.add_argument("--device", action="append", default=None, metavar="NAME",
                        help="device to serve, e.g. CPU or CUDA0 (repeatable; default: every GPU, "
                             "else the CPU)")
    worker.add_argument("-t", "--threads", type=_positive, default=None,
                        help="CPU threads (default: the physical cores)")
    worker.add_argument("--cache", metavar="DIR", default=None,
                        help="keep large weights here so a client's next load skips sending them")
    worker.add_argument("--llama-lib", help="folder with llama.dll / libllama.so to use")
