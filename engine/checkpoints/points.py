"""Turn ends a file holds before its own end (metadata ``points``), and their recurrent states.

A head that ends a turn absorbs the files below it that ended earlier turns
(engine.history.LineWriter), so a conversation restores from one file.  Each absorbed
turn end becomes a *point* of the head: the state after the conversation's first
``n_messages`` messages is the head's first ``n_tokens`` tokens.  An attention memory
without a sliding window gets that state back by trimming the head's cells.  A memory
with a recurrent part (recurrent, or a hybrid without a sliding window) holds its
recurrent state only after its last token, so each of its points also carries the
recurrent part of the state at that point (llama.cpp's ``PARTIAL_ONLY`` state of the
sequence, what ``engine.snapshots`` keeps in memory): putting it back, then dropping the
attention cells past the point, gives the point's state byte for byte (every recurrent and
hybrid architecture: tests/test_tiny_models.py for llama.cpp, tests/test_point_states.py
for the files).

On disk (engine.checkpoints.format, flag ``POINT_STATES``) those recurrent parts follow
llama.cpp's state in the file's state section, in the order of the metadata's points,
each entry saying its length as ``recurrent_len`` and its CRC32 as ``crc32`` (files from
before 2026-12-06 have none).  A restore sets none of them, so it does not read them: the
file's checksum is checked through theirs (engine.checkpoints.format), and a point's state
against its own CRC when it is used (:func:`check_point_crc`).  This module is the one
reader and writer of that metadata.

A thinking model's mark file (engine.generation.mark_wants_file) has one point too: where
the user's message starts in its prompt, after the messages before it (its template drops
the answers' thinking, so no file ends at that history; engine.history.LineWriter._mark_points).
Its tokens also hold the template's opening of that user message, which a new message
there starts with too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.checkpoints.crc import crc32
from engine.checkpoints.file_bytes import BytesInFile
from engine.errors import CorruptState


@dataclass(frozen=True)
class Point:
    """The state after a conversation's first ``n_messages`` messages, every answer
    finished, is a file's first ``n_tokens`` tokens (a thinking model's mark file's point
    also holds the template's opening of the next user message: the module docstring);
    ``recurrent``: the recurrent part of that state (None for an attention memory, which
    trims exactly without it); ``crc32``: the CRC32 its file's metadata gives for
    ``recurrent`` (None: a point made in memory, or read from a file that gives none), which
    a file written of it keeps: bytes not yet checked against it stay checkable."""
    n_tokens: int
    n_messages: int
    recurrent: np.ndarray | None = None
    crc32: int | None = None

    def to_json(self) -> dict[str, int]:
        entry = {"n_tokens": self.n_tokens, "n_messages": self.n_messages}
        if self.recurrent is not None:
            entry["recurrent_len"] = len(self.recurrent)
            entry["crc32"] = crc32(self.recurrent) if self.crc32 is None else self.crc32
        return entry


def metadata_of(points: Sequence[Point]) -> list[dict[str, int]]:
    """The metadata ``points`` of a file that holds ``points`` (their recurrent parts, in
    the same order, after llama.cpp's state: :func:`recurrent_parts`)."""
    return [p.to_json() for p in points]


def recurrent_parts(points: Sequence[Point]) -> list[np.ndarray]:
    """What follows llama.cpp's state in the state section of a file with ``points``."""
    return [p.recurrent for p in points if p.recurrent is not None]


def recurrent_lengths(meta: dict[str, Any]) -> list[int] | None:
    """The lengths of the recurrent parts a file's metadata says its state section ends
    with, in order; None where the metadata's points do not say them well (not a list of
    objects, each with a positive integer ``recurrent_len``).  The format's reader
    refuses a file with ``POINT_STATES`` that gets None."""
    return _every_point(meta, "recurrent_len", 1, None)


def recurrent_crcs(meta: dict[str, Any]) -> list[int] | None:
    """The CRC32 of each recurrent part a file's metadata lists (:func:`recurrent_lengths`),
    in order; None unless every point gives one (an unsigned 32-bit integer ``crc32``)."""
    return _every_point(meta, "crc32", 0, 0xFFFFFFFF)


def _every_point(meta: dict[str, Any], key: str, low: int, high: int | None) -> list[int] | None:
    """Every metadata point's integer ``key`` (within ``low..high``), in order; None where the
    points are not a non-empty list of objects that each give one."""
    raw = meta.get("points")
    if not isinstance(raw, list) or not raw:
        return None
    out = []
    for point in raw:
        value = point.get(key) if isinstance(point, dict) else None
        if type(value) is not int or value < low or (high is not None and value > high):
            return None
        out.append(value)
    return out


def check_point_crc(point: Point) -> None:
    """CorruptState where a point's recurrent state is not the bytes its file's metadata gives
    the CRC32 of (a file read without checking them: engine.checkpoints.format); every use of a
    point's state checks it first (engine.snapshots.PromptSnapshot.of_point, validation)."""
    if point.recurrent is not None and point.crc32 is not None and crc32(point.recurrent) != point.crc32:
        raise CorruptState(f"the recurrent state of the turn end at token {point.n_tokens} does not match "
                           "its checksum (the file was damaged, or replaced)")


def nearest_point(chain: Sequence, n: int) -> Point | None:
    """The point with the most tokens, at most ``n``, of the files of a chain (CheckpointData,
    base first: each file's points are prefixes of the chain's state); None: none.  Only its
    recurrent state is read (a restore's read may have left them in the file)."""
    below = sorted(((place.n_tokens, -i, data, place) for i, data in enumerate(chain) for place in _places(data)
                    if place.n_tokens <= n), key=lambda found: found[:2], reverse=True)
    # the nearest whose state can be had (a copying read's file may have gone since)
    return next((point for *_order, data, place in below if (point := _point(data, place)) is not None), None)


def nearest_point_in_file(chain: Sequence, n: int) -> tuple[int, BytesInFile] | None:
    """The point with the most tokens, at most ``n``, of the files of a chain (as
    :func:`nearest_point`, base first), as its token count and where its file holds its
    recurrent state (engine.checkpoints.file_bytes), read when it is used: None where there
    is none, or its file gives no CRC for it, or the read holds none of them."""
    below = [(place.n_tokens, -i, data, place) for i, data in enumerate(chain) for place in _places(data)
             if place.n_tokens <= n]
    if not below:
        return None
    *_order, data, place = max(below, key=lambda found: found[:2])
    offset = data.point_states_offset()
    if not place.length or place.crc32 is None or offset is None:
        return None
    return place.n_tokens, BytesInFile(data.path, offset + place.start, place.length, place.crc32)


def points_read_from(path, header, meta: dict[str, Any], wanted=lambda n_tokens: True) -> list[Point]:
    """The points of the file at ``path`` (its ``header`` and metadata, read before) at the
    token counts ``wanted`` takes, with their recurrent states, each read now and checked
    against its CRC; a point whose state cannot be had (no CRC given, the file gone or
    changed since) is left out.  For a file a writer did not write (a restored chain's),
    whose points its new file keeps (engine.history.LineWriter._turn_ends_left_behind)."""
    lengths = recurrent_lengths(meta) if header.has_recurrent and header.has_point_states else None
    crcs = recurrent_crcs(meta) if lengths is not None else None
    if lengths is None or crcs is None:
        return []
    offset = header.state_offset + header.state_len - sum(lengths)   # they end the state section
    out = []
    for entry, length, crc in zip(_entries(meta), lengths, crcs, strict=True):
        counts = _counts(entry, header)
        if counts is not None and wanted(counts[0]):
            try:
                out.append(Point(*counts, BytesInFile(path, offset, length, crc).read(), crc))
            except (CorruptState, OSError):
                pass
        offset += length
    return out


def point_at(data, n_tokens: int) -> Point | None:
    """The point of a file (CheckpointData) at ``n_tokens``, as :func:`points_of` gives it,
    only its recurrent state read; None: none there."""
    return next((_point(data, place) for place in _places(data) if place.n_tokens == n_tokens), None)


def points_of(data) -> list[Point]:
    """The turn ends a file (CheckpointData) holds before its own end, as its metadata
    ``points`` records them, each with its recurrent part where the file carries them;
    an entry that is not two counts within the file's own cells (from its parent's end,
    before its own end) is ignored: metadata is untrusted.  A file of a memory with a
    recurrent part whose points carry no recurrent state (written before they did) has
    none that can be used; nor has a point whose state its file no longer holds (a
    restore's read left it there, and the file went)."""
    return [point for place in _places(data) if (point := _point(data, place)) is not None]


@dataclass(frozen=True)
class _Place:
    """A point of a file as its metadata gives it: its counts, and where its recurrent state
    lies among the file's point states (``length`` 0: none; ``crc32``: the CRC given)."""
    n_tokens: int
    n_messages: int
    start: int = 0
    length: int = 0
    crc32: int | None = None


def _places(data) -> list[_Place]:
    header = data.header
    holds = getattr(data, "holds_point_states", None)
    lengths = recurrent_lengths(data.meta) if holds is not None and holds() else None
    crcs = recurrent_crcs(data.meta) if lengths is not None else None
    needs_state = header.has_recurrent
    out, offset = [], 0
    for i, entry in enumerate(_entries(data.meta)):
        start, length = offset, (lengths[i] if lengths is not None else 0)
        offset += length
        counts = _counts(entry, header)
        if counts is None or (needs_state and not length):
            continue
        out.append(_Place(*counts, start, length, crcs[i] if crcs is not None else None) if needs_state
                   else _Place(*counts))
    return out


def _point(data, place: _Place) -> Point | None:
    """The point at ``place`` with its recurrent state; None where the file no longer holds it."""
    if not place.length:
        return Point(place.n_tokens, place.n_messages)
    recurrent = data.point_state(place.start, place.length)
    return None if recurrent is None else Point(place.n_tokens, place.n_messages, recurrent, place.crc32)


def point_positions(header, meta: dict[str, Any]) -> list[int]:
    """The token counts of the points :func:`points_of` gives for a file with this header and
    metadata, read without its state (engine.checkpoints.prefix_index)."""
    return [n_tokens for n_tokens, _n_messages in point_counts(header, meta)]


def point_counts(header, meta: dict[str, Any]) -> list[tuple[int, int]]:
    """``(n_tokens, n_messages)`` of each point :func:`points_of` gives for a file with this
    header and metadata, read without its state: a memory with a recurrent part has them
    only where the file carries their states (POINT_STATES)."""
    if header.has_recurrent and not (header.has_point_states and recurrent_lengths(meta) is not None):
        return []
    return [counts for point in _entries(meta) if (counts := _counts(point, header)) is not None]


def _entries(meta: dict[str, Any]) -> list:
    raw = meta.get("points")
    return raw if isinstance(raw, list) else []


def _counts(point, header) -> tuple[int, int] | None:
    """``(n_tokens, n_messages)`` of a metadata entry, None where it is not two counts within
    the file's own cells (from its parent's end, before its own end)."""
    if not isinstance(point, dict):
        return None
    n_tokens, n_messages = point.get("n_tokens"), point.get("n_messages")
    if (type(n_tokens) is int and type(n_messages) is int
            and 0 < n_tokens < header.n_tokens and n_tokens >= header.parent_n_tokens and n_messages >= 0):
        return n_tokens, n_messages
    return None
