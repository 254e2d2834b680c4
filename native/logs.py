"""llama.cpp's log, routed into Python's `logging` under the ``native.llama`` logger.

llama.cpp writes log lines in fragments (a level of CONT continues the previous one)
and from its own threads.  The callback joins fragments into lines and must never
raise: an exception escaping a ctypes callback is printed and swallowed, but it would
still cost time inside the decode loop.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from types import ModuleType

llama_log = logging.getLogger("native.llama")

# enum ggml_log_level in this llama.cpp: NONE=0, DEBUG=1, INFO=2, WARN=3, ERROR=4, CONT=5
# (older builds numbered them differently; llama-cpp-python's own table is the old one)
_LEVELS = {0: logging.INFO, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING,
           4: logging.ERROR}
_CONT = 5


class _LineJoiner:
    """Joins llama.cpp's log fragments into whole lines, one level per line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buffer = ""
        self._level = logging.INFO
        #: the last few error lines: llama.cpp says why a call failed only in its log
        self.errors: collections.deque[str] = collections.deque(maxlen=32)

    def feed(self, level: int, text: str) -> None:
        with self._lock:
            if level != _CONT:
                self._level = _LEVELS.get(level, logging.INFO)
            self._buffer += text
            *lines, self._buffer = self._buffer.split("\n")
            level_now = self._level
            if level_now >= logging.ERROR:
                self.errors.extend(line.strip() for line in lines if line.strip())
        for line in lines:
            if line.strip():
                llama_log.log(level_now, "%s", line)


_joiner = _LineJoiner()


def take_errors() -> list[str]:
    """The error lines llama.cpp logged since the last call (at most the last 32): a failed
    call's reason, for its message (call once before the call to start afresh).  llama.cpp
    logs from other threads too; a context or model is made on one thread at a time here."""
    with _joiner._lock:
        lines = list(_joiner.errors)
        _joiner.errors.clear()
    return lines


def failure_reason(default: str) -> str:
    """Why the llama.cpp call just made failed: the first error it logged since
    :func:`take_errors` was last called, without the C function's name, or ``default``."""
    lines = take_errors()
    if not lines:
        return default
    head, _, rest = lines[0].partition(": ")
    return "llama.cpp said: " + (rest if rest and head.isidentifier() else lines[0])
_callback = None  # kept referenced for as long as llama.cpp may call it


def install_log_router(ll: ModuleType) -> None:
    """Send llama.cpp's log into `logging` (replacing llama-cpp-python's printer)."""
    global _callback

    def on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        try:
            _joiner.feed(level, text.decode("utf-8", "replace") if text else "")
        except Exception:  # never let an exception cross into C
            pass

    _callback = ll.llama_log_callback(on_log)
    ll.llama_log_set(_callback, ctypes.c_void_p(0))
