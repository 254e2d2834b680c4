"""Prefix reuse across checkpoints: which stored checkpoint shares most of a new prompt?

Beside the store lies ``.prefix-index.json``: for every checkpoint, the model fingerprint,
the context settings that shape its KV cache, and a chain of hashes of its decoded tokens
in blocks of 64 (hash i covers tokens 0..64(i+1)-1), and the points it holds before its
end (engine.checkpoints.points: for a memory with a recurrent part, where it can go back
to).  A new prompt is hashed the same way; the entries with the most leading hashes in
common are the candidates, and their token arrays give the exact common prefix.  The
index is refreshed from file size and mtime, so it never trusts a stale entry, and it is
only a hint: the chosen checkpoint is verified in full when it is restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.checkpoints.atomic import atomic_write
from engine.checkpoints.chain import common_prefix
from engine.checkpoints.compat import Target
from engine.checkpoints.format import Header, read_index_facts, read_tokens
from engine.checkpoints.points import point_positions
from engine.errors import CheckpointError

log = logging.getLogger("engine")
BLOCK = 64
INDEX_NAME = ".prefix-index.json"


def block_hashes(tokens: Sequence[int] | np.ndarray) -> list[str]:
    out = []
    h = hashlib.blake2b(digest_size=8)
    arr = np.asarray(tokens, dtype="<i4")
    for start in range(0, len(arr) - len(arr) % BLOCK, BLOCK):
        h.update(arr[start:start + BLOCK].tobytes())
        out.append(h.copy().hexdigest())
    return out


INDEX_VERSION = 5   # 3: keys are engine.checkpoints.compat.Target.key (every compared field); 4: with memory
#                     kinds; 5: with points


def context_key(header: Header) -> str:
    """The compatibility key of the model and context a checkpoint was made for."""
    return Target.of_header(header).key


@dataclass(frozen=True)
class Match:
    path: Path
    n_common: int        # tokens the prompt shares with the checkpoint's cache
    n_tokens: int        # tokens in the checkpoint's cache
    #: ``n_common`` is one of the checkpoint's points (a memory with a recurrent part goes
    #: back there: engine.checkpoints.points), not its end
    at_point: bool = False

    @property
    def exact(self) -> bool:
        """The whole checkpoint is a prefix of the prompt: nothing to trim."""
        return self.n_common == self.n_tokens


class PrefixIndex:
    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / INDEX_NAME

    def _load(self) -> dict:
        try:
            data = json.loads(self.path.read_text("utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != INDEX_VERSION:
            return {}
        entries = data.get("files")
        return entries if isinstance(entries, dict) else {}

    def refresh(self) -> dict:
        """Bring the index up to date with the folder; returns it."""
        old = self._load()
        new = {}
        changed = False
        files = sorted(p for p in self.folder.glob("*.kvckpt") if not p.name.startswith(".")) \
            if self.folder.is_dir() else []
        for path in files:
            try:
                st = path.stat()
            except OSError:
                continue
            entry = old.get(path.name)
            if entry and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
                new[path.name] = entry
                continue
            try:
                header, meta, tokens = read_index_facts(path)
                points = point_positions(header, meta) if meta is not None else []
            except (CheckpointError, OSError):
                continue
            new[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                              "key": context_key(header), "n_tokens": header.n_tokens,
                              "hashes": block_hashes(tokens[:header.n_tokens]), "points": points}
            changed = True
        if changed or set(new) != set(old):
            try:
                with atomic_write(self.path, durable=False) as f:
                    f.write(json.dumps({"version": INDEX_VERSION, "files": new}).encode("utf-8"))
            except OSError as exc:
                log.warning("could not write the prefix index: %s", exc)
        return new

    def matches(self, tokens: Sequence[int], key: str, limit: int = 4, *, whole: bool = False,
                entries: dict | None = None) -> list[Match]:
        """The checkpoints sharing the longest prefixes with ``tokens``, best first;
        ``whole``: only where the checkpoint, or its part up to one of its points, is a
        prefix of ``tokens`` entire (for a memory that cannot drop a tail, which goes back
        only to a point: the longer ones would crowd them out of ``limit``).  ``entries``:
        what :meth:`refresh` returned just before (one look at the folder for several asks)."""
        wanted = block_hashes(tokens)
        entries = self.refresh() if entries is None else entries
        scored = []
        for name, entry in entries.items():
            if entry.get("key") != key:
                continue
            hashes = entry.get("hashes", [])
            blocks = 0
            while blocks < min(len(hashes), len(wanted)) and hashes[blocks] == wanted[blocks]:
                blocks += 1
            if whole:   # the most of it that may be a prefix: its end, or a point
                ends = [n for n in _ends(entry, len(tokens)) if n // BLOCK <= blocks]
                if ends and blocks:
                    scored.append((max(ends), name))
            elif blocks:
                scored.append((blocks, name))
        out: list[Match] = []
        for _, name in sorted(scored, reverse=True):
            if len(out) == limit:
                break
            try:
                header, stored = read_tokens(self.folder / name)
            except (CheckpointError, OSError):
                continue
            n = common_prefix(list(stored[:header.n_tokens]), list(tokens))
            if whole:   # (the file read may have changed since the index: its end still counts)
                ends = [end for end in {*_ends(entries[name], len(tokens)), header.n_tokens}
                        if end <= min(n, header.n_tokens)]
                if not ends:
                    continue
                n = max(ends)
            out.append(Match(self.folder / name, n, header.n_tokens, at_point=n < header.n_tokens and whole))
        return sorted(out, key=lambda m: (m.n_common, m.exact), reverse=True)


def _ends(entry: dict, n_prompt: int) -> list[int]:
    """Where a checkpoint of the index may be cut for a memory that cannot drop a tail, for
    a prompt of ``n_prompt`` tokens: its end, and its points before the prompt's end (a
    point carries no logits: at the prompt's end its last token would be decoded again,
    which a recurrent memory cannot do from there)."""
    n_tokens, points = entry.get("n_tokens"), entry.get("points")
    ends = [n_tokens] if type(n_tokens) is int and 0 < n_tokens <= n_prompt else []
    return ends + [n for n in (points if isinstance(points, list) else []) if type(n) is int and 0 < n < n_prompt]
