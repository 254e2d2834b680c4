"""Finding and verifying the files of a delta-checkpoint chain.

A delta names its parent by file name (always in its own folder: a name with a path in
it is refused, so a file cannot point outside), checkpoint id and payload CRC.
:func:`load_chain` walks from any checkpoint back to its full base and returns the
files oldest first, each verified; a missing, damaged or replaced parent is reported
with the reason and nothing is restored.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.checkpoint_format import CheckpointData, read_checkpoint
from engine.errors import BrokenChain, CheckpointError

MAX_CHAIN = 1024


def parent_name(data: CheckpointData) -> str:
    ref = data.meta.get("parent")
    name = ref.get("file") if isinstance(ref, dict) else None
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise BrokenChain(f"{data.path.name if data.path else 'the delta'} does not name a valid parent")
    return name


def load_chain(path: str | os.PathLike, *, progress=None) -> list[CheckpointData]:
    """``path`` and its ancestors, base first, every file verified (not yet linked)."""
    path = Path(path)
    chain = [read_checkpoint(path, progress=progress)]
    seen = {path.resolve()}
    while chain[0].header.is_delta:
        if len(chain) >= MAX_CHAIN:
            raise BrokenChain(f"the chain is longer than {MAX_CHAIN} files")
        name = parent_name(chain[0])
        parent_path = path.parent / name
        if parent_path.resolve() in seen:
            raise BrokenChain(f"the chain loops back to {name}")
        if not parent_path.is_file():
            raise BrokenChain(f"the parent checkpoint {name} is missing from {path.parent}")
        try:
            chain.insert(0, read_checkpoint(parent_path, progress=progress))
        except CheckpointError as exc:
            raise BrokenChain(f"the parent checkpoint {name} is damaged: {exc}") from exc
        seen.add(parent_path.resolve())
    return chain


def chain_files(path: str | os.PathLike) -> list[Path]:
    """The files of ``path``'s chain, base first, from headers and metadata only."""
    from engine.checkpoint_format import read_metadata
    path = Path(path)
    files = [path]
    header, meta = read_metadata(path)
    while header.is_delta and len(files) < MAX_CHAIN:
        ref = meta.get("parent")
        name = ref.get("file") if isinstance(ref, dict) else None
        if not isinstance(name, str) or Path(name).name != name:
            break
        parent = path.parent / name
        if not parent.is_file() or parent in files:
            break
        files.insert(0, parent)
        header, meta = read_metadata(parent)
    return files
