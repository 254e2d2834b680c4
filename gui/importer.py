"""Checking and importing checkpoint files, off the UI thread.

These functions do file I/O and CRC work only (no native call), and run in a worker
thread of the qasync executor.  Importing never moves or alters the source: the file is
verified, compared against the loaded model, then copied into the store through a temp
file that is renamed into place, so a listing never sees half a copy.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from engine.atomic import atomic_write
from engine.checkpoint_format import EXTENSION, Header, read_metadata, verify_file
from engine.errors import CheckpointError, NotACheckpoint
from engine.store import Store
from engine.worker import ModelInfo

VALID, INCOMPATIBLE, CORRUPT, NOT_CHECKPOINT, UNREADABLE = (
    "valid", "incompatible", "corrupt", "not a checkpoint", "unreadable")


@dataclass(frozen=True)
class FileCheck:
    path: Path
    status: str
    reason: str = ""
    header: Header | None = None
    imported: Path | None = None

    @property
    def ok(self) -> bool:
        return self.status == VALID

    def message(self) -> str:
        name = self.path.name
        if self.imported is not None:
            return f"{name}: imported as {self.imported.name}"
        if self.status == VALID:
            return f"{name}: valid"
        if self.status == NOT_CHECKPOINT:
            return f"{name} is not a Checkpoint Chat checkpoint; nothing was imported."
        if self.status == INCOMPATIBLE:
            return f"{name} belongs to another model or context: {self.reason}. Nothing was imported."
        return f"{name} is {self.status}: {self.reason}. Nothing was imported."


def check_file(path: Path, model: ModelInfo | None, progress=None) -> FileCheck:
    """Full verification (header, lengths, CRC) and, with a model, compatibility."""
    path = Path(path)
    try:
        verify_file(path, progress=progress)
        header, meta = read_metadata(path)
    except NotACheckpoint as exc:
        return FileCheck(path, NOT_CHECKPOINT, str(exc))
    except CheckpointError as exc:
        return FileCheck(path, CORRUPT, str(exc))
    except OSError as exc:
        return FileCheck(path, UNREADABLE, exc.strerror or str(exc))
    if model is not None:
        reason = model.incompatibility(header, meta)
        if reason:
            return FileCheck(path, INCOMPATIBLE, reason, header)
    return FileCheck(path, VALID, "", header)


def import_file(path: Path, store: Store, model: ModelInfo | None, progress=None) -> FileCheck:
    """Verify ``path`` and copy it into ``store``; the result says what happened."""
    check = check_file(path, model, progress)
    if not check.ok:
        return check
    path = Path(path)
    if path.parent.resolve() == store.folder.resolve() and path.name.endswith(EXTENSION):
        return FileCheck(path, VALID, "", check.header, imported=path)  # already in the store
    dest = store.new_path(check.header.title or path.stem, suffix="-imported")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "rb") as src, atomic_write(dest) as out:
            shutil.copyfileobj(src, out, 8 << 20)
        # the copy is what we will restore from: check it too (cheap next to the first read)
        verify_file(dest)
    except (OSError, CheckpointError) as exc:
        try:
            dest.unlink(missing_ok=True)
        except OSError:
            pass
        return FileCheck(path, UNREADABLE, f"could not copy it into the store: {exc}")
    return FileCheck(path, VALID, "", check.header, imported=dest)


def export_file(path: Path, target: Path) -> Path:
    """Copy a checkpoint to ``target`` atomically (Save As)."""
    with open(path, "rb") as src, atomic_write(Path(target)) as out:
        shutil.copyfileobj(src, out, 8 << 20)
    return Path(target)


def local_checkpoint_paths(urls) -> list[Path]:
    """Local files among dropped URLs (folders and remote URLs are ignored)."""
    out = []
    for url in urls:
        if url.isLocalFile():
            p = Path(url.toLocalFile())
            if p.is_file():
                out.append(p)
    return out


def file_size_text(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"


def remove_quietly(path: Path) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
