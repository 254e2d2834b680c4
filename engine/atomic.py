"""Atomic file replacement: readers see the old file or the new one, never a mix.

The recipe (as python-atomicwrites and pip's ``adjacent_tmp_file``): write a temp file
in the destination folder, flush and fsync it, ``os.replace`` it over the destination,
then fsync the folder on POSIX so the rename itself is durable.  On any failure the
temp file is removed and the destination is untouched.

On Windows ``os.replace`` fails with ERROR_ACCESS_DENIED / SHARING_VIOLATION /
LOCK_VIOLATION (winerror 5 / 32 / 33) while an antivirus scanner or the search indexer
holds the destination open; those are retried for a bounded time.  The module-level
``fsync`` and ``replace`` names are the seams tests use to inject failures.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from pathlib import Path
from typing import BinaryIO, Iterator

#: Windows errors caused by another process holding the file for a moment.
TRANSIENT_WINERRORS = frozenset({5, 32, 33})
REPLACE_RETRY_S = 3.0
TEMP_SUFFIX = ".tmp"

fsync = os.fsync
replace = os.replace


def temp_path_for(path: Path) -> Path:
    """A hidden sibling of ``path`` that listings (``*.kvckpt``) never match."""
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def replace_with_retry(src: Path, dst: Path, budget_s: float = REPLACE_RETRY_S) -> None:
    deadline = time.monotonic() + budget_s
    delay = 0.01
    while True:
        try:
            replace(src, dst)
            return
        except OSError as exc:
            transient = getattr(exc, "winerror", None) in TRANSIENT_WINERRORS
            if not transient or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


def fsync_dir(folder: Path) -> None:
    if sys.platform == "win32":
        return  # NTFS journals the rename; folders cannot be opened for fsync
    fd = os.open(folder, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, *, durable: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file; on normal exit it atomically becomes ``path``."""
    path = Path(path)
    tmp = temp_path_for(path)
    f = open(tmp, "xb")
    try:
        yield f
        f.flush()
        if durable:
            fsync(f.fileno())
        f.close()
        replace_with_retry(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except BaseException:
        f.close()
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
