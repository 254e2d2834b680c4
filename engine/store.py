"""The checkpoint store: one folder of ``.kvckpt`` files, listed from headers alone.

Names.  ``<title-slug>-<UTC timestamp>-<64 random bits>.kvckpt``: two processes never
pick the same name, so a manual save never overwrites another.  Each conversation has
one autosave file (``autosave-<id>.kvckpt``) that is replaced atomically each time.

Readers never see half a file.  Files being written are hidden temp files (see
engine.atomic) that the listing never matches; they become visible by an atomic rename.

Locking.  The folder holds an empty marker file (``.kvstore``); every atomic write into
a marked folder renames under the store's cross-process ``filelock``, and so do this
module's deletes (prune, delete) and imports.  Writing the bytes happens outside the
lock, so concurrent saves only serialise on the rename.

Pruning (:meth:`Store.prune_autosaves`) deletes the oldest autosaves until the store
fits a byte budget and/or an autosave count, and never deletes

* a manual, pause or exit save (only ``kind == autosave`` is a candidate);
* the newest valid checkpoint of any conversation (verified by its full CRC: if the
  newest file is damaged, the newest intact one behind it is kept instead);
* a file whose header cannot be read (it is left for the user to inspect);
* a file that changed since it was listed (re-checked under the lock).

Temp files left by killed writers are removed by :meth:`Store.remove_stale_temps`.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

from engine import paths
from engine.atomic import (STORE_MARKER, atomic_write, is_stale_temp, is_temp_name,
                           store_lock)
from engine.checkpoint_format import (EXTENSION, HEADER_LEN, KIND_AUTOSAVE, TRAILER_LEN,
                                      Header, unpack_header, verify_file)
from engine.errors import CheckpointError, SaveFailed

#: A temp file untouched this long, with no live writer, is a killed writer's leftover.
STALE_TEMP_AGE_S = 60.0
_COPY_CHUNK = 8 << 20


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


@dataclass
class PruneReport:
    deleted: list[Path] = field(default_factory=list)
    freed_bytes: int = 0
    kept_protected: int = 0      # autosaves kept because they are a conversation's newest
    skipped_changed: int = 0     # candidates replaced by a newer write since listing
    stale_temps: int = 0
    store_bytes: int = 0         # total size of the store's checkpoints afterwards


def slugify(text: str, limit: int = 40) -> str:
    """A file-name-safe form of a title that keeps non-ASCII letters."""
    text = unicodedata.normalize("NFC", text)
    text = re.sub(r"[^\w\-]+", "-", text, flags=re.UNICODE).strip("-_").lower()
    return (text[:limit].rstrip("-_") or "checkpoint")


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


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
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        while True:
            # 64 random bits: a name collision (and so an overwrite) is out of reach
            # even for thousands of saves per second from many processes
            path = self.folder / f"{slugify(title)}-{stamp}-{secrets.token_hex(8)}{suffix}{EXTENSION}"
            if not path.exists():
                return path

    def autosave_path(self, conversation_id) -> Path:
        """The one autosave file of a conversation (replaced atomically each time)."""
        self._mark()
        return self.folder / f"autosave-{conversation_id.hex[:12]}{EXTENSION}"

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
            out.append(Entry(path, st.st_size, st.st_mtime, header, error, _identity(st)))
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

    def delete(self, path: str | os.PathLike) -> bool:
        """Delete one checkpoint of this store; False if it was already gone."""
        path = Path(path)
        if path.parent.resolve() != self.folder.resolve() or not path.name.endswith(EXTENSION):
            raise ValueError(f"{path} is not a checkpoint of the store in {self.folder}")
        with self.lock():
            try:
                path.unlink()
                return True
            except FileNotFoundError:
                return False

    def import_file(self, src: str | os.PathLike) -> Path:
        """Copy a checkpoint into the store after validating it; returns the store's copy.

        The source is only read.  The bytes are validated as they sit in the store's temp
        file (header, lengths, full CRC), so what lands in the store is exactly what was
        checked even if the source changes meanwhile.  A file already in the store (same
        header and checksum) is not copied twice.
        """
        src = Path(src)
        try:
            with open(src, "rb") as f:
                raw = f.read(HEADER_LEN)
                size = os.fstat(f.fileno()).st_size
                header = unpack_header(raw, size)
                f.seek(size - TRAILER_LEN)
                trailer = f.read(TRAILER_LEN)
        except OSError as exc:
            raise SaveFailed(f"could not read {src}: {exc.strerror or exc}") from exc
        existing = self._find_copy(raw, size, trailer)
        if existing is not None and _intact(existing):
            try:
                verify_file(src)   # same header and checksum, but the source may be damaged
            except OSError as exc:
                raise SaveFailed(f"could not read {src}: {exc.strerror or exc}") from exc
            return existing
        self.ensure()
        target = self.new_path(header.title or "imported")
        try:
            with atomic_write(target) as out, open(src, "rb") as f:
                copied = _copy_exactly(f, out, size)
                if copied != size:
                    raise SaveFailed(f"{src} changed while it was being imported")
                out.flush()
                verify_file(out.name)   # the temp file: what will be renamed into place
        except OSError as exc:
            raise SaveFailed(f"could not import {src} into {self.folder}: "
                             f"{exc.strerror or exc}; nothing was added") from exc
        return target

    def _find_copy(self, raw: bytes, size: int, trailer: bytes) -> Path | None:
        for entry in self.entries():
            if entry.size != size or entry.header is None:
                continue
            try:
                with open(entry.path, "rb") as f:
                    if f.read(HEADER_LEN) != raw[:HEADER_LEN]:
                        continue
                    f.seek(size - TRAILER_LEN)
                    if f.read(TRAILER_LEN) == trailer:
                        return entry.path
            except OSError:
                continue
        return None

    def prune_autosaves(self, budget_bytes: int | None = None, max_count: int | None = None,
                        *, stale_temp_age_s: float = STALE_TEMP_AGE_S) -> PruneReport:
        """Delete old autosaves until the store holds at most ``budget_bytes`` (all its
        checkpoints together) and at most ``max_count`` autosaves.

        What is never deleted is listed in the module docstring.  The budget may stay
        exceeded when only protected files remain.
        """
        report = PruneReport()
        if not self.folder.is_dir():
            return report
        with self.lock():
            report.stale_temps = self.remove_stale_temps(stale_temp_age_s)
            entries = self.entries()
            total = sum(e.size for e in entries)
            n_autosaves = sum(1 for e in entries if e.valid and e.header.kind == KIND_AUTOSAVE)
            candidates = self._prunable(entries, report)
            for entry in sorted(candidates, key=lambda e: e.created):   # oldest first
                over_budget = budget_bytes is not None and total > budget_bytes
                over_count = max_count is not None and n_autosaves > max_count
                if not (over_budget or over_count):
                    break
                if self._delete_if_unchanged(entry):
                    report.deleted.append(entry.path)
                    report.freed_bytes += entry.size
                    total -= entry.size
                    n_autosaves -= 1
                else:
                    report.skipped_changed += 1
            report.store_bytes = total
        return report

    def _prunable(self, entries: list[Entry], report: PruneReport) -> list[Entry]:
        """Autosaves that are older than their conversation's newest intact checkpoint."""
        by_conv: dict = {}
        for e in entries:
            if e.valid:
                by_conv.setdefault(e.header.conversation_id, []).append(e)
        out = []
        for group in by_conv.values():
            group.sort(key=lambda e: e.header.created_unix_ns, reverse=True)
            autosaves = [e for e in group if e.header.kind == KIND_AUTOSAVE]
            if not autosaves:
                continue
            if len(group) == 1:
                report.kept_protected += 1   # a conversation's only checkpoint
                continue
            keep = _newest_intact(group)
            if keep is None:
                report.kept_protected += len(autosaves)   # nothing intact: keep everything
                continue
            cutoff = keep.header.created_unix_ns
            for e in autosaves:
                if e is keep or e.header.created_unix_ns >= cutoff:
                    report.kept_protected += 1   # the newest intact one, or damaged newer ones
                else:
                    out.append(e)
        return out

    def _delete_if_unchanged(self, entry: Entry) -> bool:
        """Delete ``entry`` unless a save replaced it since it was listed (lock held)."""
        try:
            if _identity(entry.path.stat()) != entry.identity:
                return False
            entry.path.unlink()
            return True
        except OSError:
            return False   # gone already, or (Windows) held open by a reader: next time


def _intact(path: Path) -> bool:
    try:
        verify_file(path)
        return True
    except (CheckpointError, OSError):
        return False


def _newest_intact(group: list[Entry]) -> Entry | None:
    """The newest entry of a conversation whose whole file verifies (full CRC)."""
    return next((e for e in group if _intact(e.path)), None)   # group is newest first


def _copy_exactly(src, dst, size: int) -> int:
    """Copy at most ``size + 1`` bytes (one more reveals a source that grew)."""
    done = 0
    while done <= size:
        chunk = src.read(min(_COPY_CHUNK, size + 1 - done))
        if not chunk:
            break
        dst.write(chunk)
        done += len(chunk)
    return done
