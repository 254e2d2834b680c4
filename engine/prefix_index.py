"""Prefix reuse across checkpoints: which stored checkpoint shares most of a new prompt?

Beside the store lies ``.prefix-index.json``: for every checkpoint, the model fingerprint,
the context settings that shape its KV cache, and a chain of hashes of its decoded tokens
in blocks of 64 (hash i covers tokens 0..64(i+1)-1).  A new prompt is hashed the same
way; the entries with the most leading hashes in common are the candidates, and their
token arrays give the exact common prefix.  The index is refreshed from file size and
mtime, so it never trusts a stale entry, and it is only a hint: the chosen checkpoint is
verified in full when it is restored.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from engine.atomic import atomic_write
from engine.checkpoint_format import Header, read_tokens
from engine.errors import CheckpointError
from engine.runtime import Runtime, common_prefix

log = logging.getLogger("engine")
BLOCK = 64
INDEX_NAME = ".prefix-index.json"


def block_hashes(tokens: Sequence[int]) -> list[str]:
    out = []
    h = hashlib.blake2b(digest_size=8)
    arr = np.asarray(tokens, dtype="<i4")
    for start in range(0, len(arr) - len(arr) % BLOCK, BLOCK):
        h.update(arr[start:start + BLOCK].tobytes())
        out.append(h.copy().hexdigest())
    return out


def context_key(header: Header) -> str:
    return (f"{header.model_fingerprint.hex()}:{header.n_ctx}:{header.type_k}:{header.type_v}:"
            f"{int(header.flash_attn)}:{header.n_seq_max}:{int(header.kv_unified)}")


@dataclass(frozen=True)
class Match:
    path: Path
    n_common: int        # tokens the prompt shares with the checkpoint's cache
    n_tokens: int        # tokens in the checkpoint's cache

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
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

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
                header, tokens = read_tokens(path)
            except (CheckpointError, OSError):
                continue
            new[path.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                              "key": context_key(header), "n_tokens": header.n_tokens,
                              "hashes": block_hashes(tokens[:header.n_tokens])}
            changed = True
        if changed or set(new) != set(old):
            try:
                with atomic_write(self.path, durable=False) as f:
                    f.write(json.dumps(new).encode("utf-8"))
            except OSError as exc:
                log.warning("could not write the prefix index: %s", exc)
        return new

    def matches(self, tokens: Sequence[int], key: str, limit: int = 4) -> list[Match]:
        """The checkpoints sharing the longest prefixes with ``tokens``, best first."""
        wanted = block_hashes(tokens)
        scored = []
        for name, entry in self.refresh().items():
            if entry.get("key") != key:
                continue
            hashes = entry.get("hashes", [])
            blocks = 0
            while blocks < min(len(hashes), len(wanted)) and hashes[blocks] == wanted[blocks]:
                blocks += 1
            if blocks:
                scored.append((blocks, name))
        out = []
        for _, name in sorted(scored, reverse=True)[:limit]:
            try:
                header, stored = read_tokens(self.folder / name)
            except (CheckpointError, OSError):
                continue
            n = common_prefix(list(stored[:header.n_tokens]), list(tokens))
            out.append(Match(self.folder / name, n, header.n_tokens))
        return sorted(out, key=lambda m: (m.n_common, m.exact), reverse=True)


def runtime_key(runtime: Runtime) -> str:
    s = runtime.settings
    return (f"{runtime.fingerprint.hex()}:{runtime.ctx.n_ctx}:{s.type_k}:{s.type_v}:"
            f"{int(s.flash_attn)}:{s.n_seq_max}:{int(s.kv_unified)}")


@dataclass(frozen=True)
class PrefixReuse:
    how: str                   # "restored", "restored-exact", "cache" or "recompute"
    n_tokens: int              # prompt tokens now in the cache, not to be decoded again
    source: Path | None = None

    def describe(self) -> str:
        return {"restored": f"reused {self.n_tokens} tokens from {self.source} (tail trimmed)",
                "restored-exact": f"reused {self.n_tokens} tokens from {self.source}",
                "cache": f"reused {self.n_tokens} tokens already in the cache",
                "recompute": "no stored checkpoint shares this prompt's beginning: full prefill",
                }[self.how]


def reuse_stored_prefix(runtime: Runtime, folder: str | Path, tokens: Sequence[int]) -> PrefixReuse:
    """Restore the stored checkpoint that shares the longest prefix with ``tokens``.

    The divergent tail is trimmed from the cache.  A memory that cannot drop a tail
    (``llama_memory_seq_rm`` fails: some sliding-window or recurrent models) only takes
    checkpoints that are entirely a prefix of the prompt; if none exists, the prompt is
    decoded in full.  Compares against what the cache already holds first.
    """
    from engine.chain import load_chain
    in_cache = common_prefix(runtime.kv_tokens, tokens)
    can_trim = True
    for match in PrefixIndex(folder).matches(tokens, runtime_key(runtime)):
        if match.n_common <= in_cache:
            break
        if not match.exact and not can_trim:
            continue
        try:
            runtime.restore_chain(load_chain(match.path))
        except CheckpointError as exc:
            log.info("prefix candidate %s skipped: %s", match.path.name, exc)
            continue
        kept = runtime.trim(match.n_common)
        if kept == match.n_common:
            return PrefixReuse("restored-exact" if match.exact else "restored", kept, match.path)
        can_trim = False  # the memory cannot drop a tail: only exact prefixes will do
        in_cache = common_prefix(runtime.kv_tokens, tokens)
    return PrefixReuse("cache" if in_cache else "recompute", in_cache)
