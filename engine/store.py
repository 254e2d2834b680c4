"""The checkpoint store: one folder of ``.kvckpt`` files, listed from headers alone.

File names are ``<title-slug>-<UTC timestamp>-<random>.kvckpt`` so two processes never
pick the same name.  Files being written are hidden temp files (see engine.atomic)
that the ``*.kvckpt`` pattern never matches, so a listing never sees half a file.
"""

from __future__ import annotations

import os
import re
import secrets
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path

from engine import paths
from engine.checkpoint_format import EXTENSION, HEADER_LEN, Header, unpack_header
from engine.errors import CheckpointError


@dataclass(frozen=True)
class Entry:
    """One file of the store: its header, or why it could not be read."""
    path: Path
    size: int
    mtime: float
    header: Header | None
    error: str | None = None

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


class Store:
    def __init__(self, folder: str | os.PathLike | None = None) -> None:
        self.folder = Path(folder) if folder is not None else paths.checkpoint_dir()

    def new_path(self, title: str, suffix: str = "") -> Path:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        name = f"{slugify(title)}-{stamp}-{secrets.token_hex(3)}{suffix}{EXTENSION}"
        return self.folder / name

    def autosave_path(self, conversation_id) -> Path:
        """The one autosave file of a conversation (replaced atomically each time)."""
        return self.folder / f"autosave-{conversation_id.hex[:12]}{EXTENSION}"

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
            except OSError as exc:
                continue  # vanished between listing and opening (deleted or pruned)
            try:
                out.append(Entry(path, st.st_size, st.st_mtime, unpack_header(raw, st.st_size)))
            except CheckpointError as exc:
                out.append(Entry(path, st.st_size, st.st_mtime, None, str(exc)))
        out.sort(key=lambda e: e.created, reverse=True)
        return out
