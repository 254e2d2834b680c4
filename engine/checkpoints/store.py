"""The checkpoint store: one folder of ``.kvckpt`` files, listed from headers alone.

Names.  ``<title-slug>-<UTC timestamp>-<64 random bits>.kvckpt`` for a conversation's
heads and ``autosave-<conversation>-<nanoseconds>.kvckpt`` for autosaves: two processes
never pick the same name, so no save ever overwrites another file.  That matters: a
delta names its parent by file name, id and CRC, so a file rewritten in place would
orphan its children.

Readers never see half a file.  Files being written are hidden temp files (see
engine.checkpoints.atomic) that the listing never matches; they become visible by an
atomic rename.

Locking.  The folder holds an empty marker file (``.kvstore``); every atomic write into
a marked folder renames under the store's cross-process ``filelock``, and so does every
delete.  Writing the bytes happens outside the lock, so concurrent saves only
serialise on the rename.

What may be deleted, and when, is the graph's business (engine.checkpoints.graph:
prune, retire, delete a conversation); importing and exporting are in
engine.checkpoints.transfer.  Temp files left by killed writers are removed by
:meth:`Store.remove_stale_temps`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import time
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout

from engine import paths
from engine.checkpoints.atomic import STORE_MARKER, atomic_write, is_stale_temp, is_temp_name, store_lock
from engine.checkpoints.format import EXTENSION, HEADER_LEN, Header, unpack_header
from engine.errors import CheckpointError

#: A temp file untouched this long, with no live writer, is a killed writer's leftover.
STALE_TEMP_AGE_S = 60.0

#: what the user deleted while another conversation's chain still held some of its files
#: (engine.checkpoints.graph: delete_conversation, delete_node): a JSON object,
#: ``{"conversations": [ids], "checkpoints": [file names]}`` (before 2026-12-05 a list of
#: conversation ids, still read)
DELETED_RECORD = ".deleted-conversations.json"


@dataclass(frozen=True)
class Deleted:
    """What :data:`DELETED_RECORD` says the user deleted and the store still holds: whole
    conversations, and single heads (by file name) that another line was cut from."""
    conversations: frozenset[uuid.UUID] = frozenset()
    checkpoints: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.conversations or self.checkpoints)

    def to_json(self) -> dict[str, list[str]]:
        return {"conversations": sorted(str(i) for i in self.conversations),
                "checkpoints": sorted(self.checkpoints)}

    @classmethod
    def from_json(cls, data: object) -> Deleted:
        """The record read back; ValueError (or TypeError, AttributeError) when malformed."""
        if isinstance(data, list):   # the record before 2026-12-05
            return cls(frozenset(uuid.UUID(i) for i in data))
        if not isinstance(data, dict):
            raise ValueError("not a record of deleted files")
        names = data.get("checkpoints", [])
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ValueError("the deleted checkpoints are not a list of names")
        return cls(frozenset(uuid.UUID(i) for i in data.get("conversations", [])), frozenset(names))


@dataclass(frozen=True)
class Entry:
    """One file of the store: its header, or why it could not be read."""
    path: Path
    size: int
    mtime: float
    header: Header | None
    error: str | None = None
    identity: tuple[int, int, int] = (0, 0, 0)   # (inode, size, mtime_ns) when listed

    @property
    def valid(self) -> bool:
        return self.header is not None

    @property
    def created(self) -> float:
        return self.header.created_unix_ns / 1e9 if self.header else self.mtime


def slugify(text: str, limit: int = 40) -> str:
    """A file-name-safe form of a title that keeps non-ASCII letters."""
    text = unicodedata.normalize("NFC", text)
    text = re.sub(r"[^\w\-]+", "-", text, flags=re.UNICODE).strip("-_").lower()
    return (text[:limit].rstrip("-_") or "checkpoint")


def file_identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def fresh_path(folder: Path, stem: str, suffix: str = "") -> Path:
    """An unused file name ``stem-<UTC time>-<64 random bits><suffix>.kvckpt`` in ``folder``:
    a name collision (and so an overwrite) is out of reach even for thousands of saves per
    second from many processes."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    while True:
        path = Path(folder) / f"{stem}-{stamp}-{secrets.token_hex(8)}{suffix}{EXTENSION}"
        if not path.exists():
            return path


class Store:
    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else paths.checkpoint_dir()

    # -- the folder and its lock -----------------------------------------------------------
    def ensure(self) -> Path:
        """Create the folder and its store marker (idempotent)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        marker = self.folder / STORE_MARKER
        if not marker.exists():
            marker.touch(exist_ok=True)
        return self.folder

    def lock(self):
        """The cross-process lock (a ``filelock.FileLock``) of this store."""
        self.ensure()
        return store_lock(self.folder)

    # -- names -----------------------------------------------------------------------------
    def _mark(self) -> None:
        """Mark an existing folder as a store; a path function never creates folders
        (the save does), so the very first save into a new store renames unlocked,
        which only matters to a pruner, and a pruner marks the folder itself."""
        if self.folder.is_dir() and not (self.folder / STORE_MARKER).exists():
            self.ensure()

    def new_path(self, title: str, suffix: str = "") -> Path:
        """A fresh, unused file name in the store."""
        self._mark()
        return fresh_path(self.folder, slugify(title), suffix)

    def new_autosave_path(self, conversation_id) -> Path:
        """A fresh autosave name; they sort chronologically (to the clock's tick), and the
        random part keeps two writers in one tick apart."""
        self._mark()
        while True:
            path = self.folder / (f"autosave-{conversation_id.hex[:12]}-{time.time_ns():020d}-"
                                  f"{secrets.token_hex(4)}{EXTENSION}")
            if not path.exists():
                return path

    # -- leases ------------------------------------------------------------------------------
    def lease_line(self, line: str) -> FileLock | None:
        """Hold a line of history for one writer: the held lock, or None when another
        writer (another process, or another writer in this one) holds it.

        The operating system drops the lock with its process, so a killed writer never
        leaves a line held.  Lock files live in ``.leases/``, named by a digest of the
        line (a line is read from metadata: never a path).
        """
        self.ensure()
        folder = self.folder / ".leases"
        folder.mkdir(exist_ok=True)
        name = hashlib.blake2b(line.encode("utf-8"), digest_size=12).hexdigest()
        lock = FileLock(str(folder / f"{name}.lock"), timeout=0)
        try:
            lock.acquire()
        except Timeout:
            return None
        return lock

    # -- listing ---------------------------------------------------------------------------
    def files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return [p for p in self.folder.iterdir()
                if p.name.endswith(EXTENSION) and not p.name.startswith(".") and p.is_file()]

    def entries(self) -> list[Entry]:
        """Every checkpoint with its header (or the reason it is unreadable), newest first."""
        out = []
        for path in self.files():
            try:
                with open(path, "rb") as f:
                    raw = f.read(HEADER_LEN)
                    st = os.fstat(f.fileno())
            except OSError:
                continue  # vanished between listing and opening (deleted or pruned)
            try:
                header, error = unpack_header(raw, st.st_size), None
            except CheckpointError as exc:
                header, error = None, str(exc)
            out.append(Entry(path, st.st_size, st.st_mtime, header, error, file_identity(st)))
        out.sort(key=lambda e: e.created, reverse=True)
        return out

    def temp_files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return [p for p in self.folder.iterdir() if is_temp_name(p.name)]

    # -- changing the store ----------------------------------------------------------------
    def remove_stale_temps(self, min_age_s: float = STALE_TEMP_AGE_S) -> int:
        """Delete temp files whose writer died; returns how many were removed."""
        removed = 0
        for tmp in self.temp_files():
            if is_stale_temp(tmp, min_age_s):
                try:
                    tmp.unlink()
                    removed += 1
                except OSError:
                    pass  # Windows: still open by its writer; or removed meanwhile
        return removed

    # -- what the user deleted that another conversation still holds -------------------------
    def deleted(self) -> Deleted:
        """The record of :data:`DELETED_RECORD` (read with the lock held).  A missing or
        unreadable record reads as empty: then fewer files are deleted, never a wrong one."""
        try:
            return Deleted.from_json(json.loads((self.folder / DELETED_RECORD).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError, AttributeError):
            return Deleted()

    def record_deleted(self, record: Deleted) -> None:
        """Replace the record, atomically (lock held); an empty one is removed."""
        path = self.folder / DELETED_RECORD
        if not record:
            path.unlink(missing_ok=True)
            return
        # the checkpoints' own atomic write: a temp name the store sweeps when a writer dies,
        # the rename retried where Windows briefly refuses it; the caller holds the lock
        with atomic_write(path, lock=contextlib.nullcontext()) as f:
            f.write(json.dumps(record.to_json()).encode("utf-8"))

    def contains(self, path: str | os.PathLike) -> bool:
        """Whether ``path`` names a checkpoint file of this store's folder."""
        path = Path(path)
        try:
            return path.parent.resolve() == self.folder.resolve() and path.name.endswith(EXTENSION)
        except OSError:
            return False

