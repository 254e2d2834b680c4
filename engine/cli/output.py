"""Writing the CLI's output so that no file name or answer text can make it fail; its exit
statuses and how it writes a size.

On Windows, Python writes a pipe or a file in the ANSI code page (cp1252 on an en-US
machine): a checkpoint folder named in Chinese, or an answer with an emoji, raised
``UnicodeEncodeError`` in ``list --json`` when its output was piped (seen under the Wine
tier).  JSON falls back to ``\\uXXXX`` escapes, which every JSON reader decodes to the
same text; other text is written with backslash escapes instead of failing.
"""

from __future__ import annotations

import codecs
import json
import sys
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def human_size(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def tolerate_unencodable(*streams, windows: bool | None = None) -> None:
    """Characters a stream's encoding lacks become backslash escapes instead of errors.

    Python's "strict" fails on them; so does "surrogateescape", which Windows always gives
    a redirected or piped stream, in the ANSI code page (an answer's first character outside
    cp1252 raised there, and the answer was lost with it).  Elsewhere "surrogateescape" is
    a UTF-8 locale's, which writes a path's undecodable bytes back as they were: kept."""
    windows = sys.platform == "win32" if windows is None else windows
    failing = ("strict", "surrogateescape") if windows else ("strict",)
    for stream in streams or (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", "") in failing:
            reconfigure(errors="backslashreplace")


def print_json(value: Any, *, stream=None, **dumps_args) -> None:
    """``value`` as JSON on ``stream`` (stdout): readable text where the stream writes UTF-8,
    ASCII escapes elsewhere.  JSON's readers (jq, PowerShell 7, Node) read UTF-8: a Windows
    pipe's ANSI code page wrote "Zoë" as one cp1252 byte they could not decode, and its
    encoding decided by the text (a character outside cp1252 made it ASCII) under Wine."""
    stream = sys.stdout if stream is None else stream
    try:
        utf8 = codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name == "utf-8"
    except LookupError:
        utf8 = False
    print(json.dumps(value, ensure_ascii=not utf8, **dumps_args), file=stream)


def answer_fields(text: str, thinking_format, *, before: str = "", final: bool = True) -> dict[str, Any]:
    """The answer's fields of a ``--json`` result: ``text`` the answer the run wrote, and
    ``reasoning_content`` its thinking (None when there is none), apart as the server
    returns them (engine.reasoning; ``before``: the answer's text before this run)."""
    from engine.reasoning import split
    parts = split(text, thinking_format, before=before, final=final)
    return {"text": parts.answer, "reasoning_content": parts.thinking or None}
