"""Bytes a restore leaves in their checkpoint file, read and checked when they are used.

A restore of a memory with a recurrent part keeps the states its conversation may go back to
(engine.snapshots: the answer's prompt end for Regenerate, the prompt's marks for an Edit):
the recurrent block a file's state ends with, or a turn end's (engine.checkpoints.points).
Copying one out of its file at the restore costs about what llama.cpp's own set of a
state does (12.6 MB at Qwen3-Next's widths: ~5 ms of fresh memory's page faults on a
2-core VM, a third of such a restore), and most are never used.  So the restore keeps a
:class:`BytesInFile` instead: where the bytes lie and their CRC32 (a point's from its
file's metadata; a file's recurrent block from its metadata too, or computed once the
file's own checksum settled in a file from before that), and :meth:`BytesInFile.read`
reads them when they are used, checked against that CRC before anything else sees a byte.
A file replaced, damaged or gone meanwhile (the conversation deleted, another program's
doing) is a :class:`~engine.errors.CorruptState` naming the cause: going back then reads the prompt
again, as it does where no snapshot was kept.  A file that cannot be read for the moment
(on Windows another program may hold it open) is an OSError: the state stays where it is.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.checkpoints.crc import crc32
from engine.errors import CorruptState


def read_at(path: str | os.PathLike, offset: int, into: memoryview) -> int:
    """Read bytes ``offset..offset+len(into)`` of a file into ``into`` (no buffering: one
    copy, from the page cache); how many there were (fewer: the file ends before).  OSError
    when the file cannot be opened or read."""
    done = 0
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while done < len(into) and (n := f.readinto(into[done:])):
            done += n
    return done


@dataclass(frozen=True)
class BytesInFile:
    """``length`` bytes at ``offset`` of the file at ``path``, whose CRC32 is ``crc32``;
    :meth:`read` gives them after ``prefix`` (a file's recurrent block becomes a state as a
    point carries it: llama.cpp's state magic and sequence id first)."""
    path: Path
    offset: int
    length: int
    crc32: int
    prefix: bytes = b""

    def __post_init__(self) -> None:   # the file, whatever the working folder is when it is read
        object.__setattr__(self, "path", Path(os.path.abspath(self.path)))

    def read(self) -> np.ndarray:
        """``prefix`` then the bytes, read now and checked against their CRC: a read-only
        array; CorruptState where the file no longer holds them (gone, shorter, other
        bytes); OSError where it cannot be read now."""
        out = np.empty(len(self.prefix) + self.length, dtype=np.uint8)
        out[:len(self.prefix)] = np.frombuffer(self.prefix, dtype=np.uint8)
        view = out.data.cast("B")[len(self.prefix):]
        try:
            got = read_at(self.path, self.offset, view)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as exc:
            raise CorruptState(f"{self.path.name} can no longer be read ({exc.strerror or exc})") from None
        # (any other OSError is the caller's: the file may be readable again later — on
        # Windows another program may hold it open for a moment)
        if got != self.length:
            raise CorruptState(f"{self.path.name} is shorter than when it was restored")
        if crc32(view) != self.crc32:
            raise CorruptState(f"{self.path.name} no longer holds the bytes it was restored with "
                               "(the file was replaced, or damaged)")
        out.flags.writeable = False
        return out
