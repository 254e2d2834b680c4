"""Delta-checkpoint chains: how a delta names its parent, and reading a chain safely.

A delta names its parent in its metadata (``"parent"``): the parent's file name (always
in the delta's own folder: a name with a path in it is refused, so a file cannot point
outside), its checkpoint id, its payload CRC32 and the number of tokens it holds (a
delta may build on fewer of them: a cut, :func:`can_cut`).
:func:`load_chain` walks from any checkpoint back to its full base and returns the
files oldest first, each verified (full CRC) and linked to the next (:func:`check_link`);
a missing, damaged or replaced parent is reported with the reason and nothing is
restored.  The store's graph (engine.checkpoints.graph) uses the same reference to draw
its edges from headers and trailers without reading any state.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoints import crc_helper, mapped
from engine.checkpoints.format import MEMORY_ATTENTION, CheckpointData, Header, read_checkpoint
from engine.errors import BrokenChain, CheckpointError

MAX_CHAIN = 1024


def tokens_digest(tokens: Sequence[int] | np.ndarray) -> str:
    """A short digest of a token list: proves a delta's parent is still a prefix."""
    return hashlib.blake2b(np.asarray(tokens, dtype="<i4").tobytes(), digest_size=16).hexdigest()


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n


@dataclass(frozen=True)
class ParentRef:
    """What a delta's metadata says about its parent."""
    file: str
    checkpoint_id: str
    payload_crc: int
    n_tokens: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "checkpoint_id": self.checkpoint_id,
                "payload_crc": self.payload_crc, "n_tokens": self.n_tokens}


def parent_ref(meta: dict, what: str = "the delta") -> ParentRef:
    """The parent a delta's metadata names; BrokenChain when it names none validly."""
    ref = meta.get("parent")
    if not isinstance(ref, dict):
        raise BrokenChain(f"{what} does not name its parent")
    name, cid, crc, n = (ref.get(k) for k in ("file", "checkpoint_id", "payload_crc", "n_tokens"))
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", "..") \
            or "\\" in name or "/" in name:
        raise BrokenChain(f"{what} does not name a valid parent file")
    if not isinstance(cid, str) or not isinstance(crc, int) or not isinstance(n, int) \
            or isinstance(crc, bool) or isinstance(n, bool):
        raise BrokenChain(f"{what} names its parent without an id and checksum")
    return ParentRef(name, cid, crc, n)


def load_chain(path: str | os.PathLike, *, progress=None, crc_later: bool = False) -> list[CheckpointData]:
    """``path`` and its ancestors, base first, every file verified and linked.

    ``crc_later``: the large states' checksums are still being computed when this returns
    (read_checkpoint), one after another on the process's helper thread
    (engine.checkpoints.crc_helper); whoever uses the chain calls :func:`settle` before
    keeping anything of it (engine.restore.restore_into does).  A damaged file is still
    reported as such, whatever else the unsettled files made go wrong here.  With
    ``crc_later``, the ancestors' own recurrent blocks, which a restore replaces with the
    last file's, and their logits, which it does not sample from, are left unchecked where
    their metadata gives their CRC (read_checkpoint's ``ancestor``): checked where one is
    used after all.
    """
    path = Path(path)
    chain = [read_checkpoint(path, progress=progress, crc_later=crc_later)]
    try:
        _load_ancestors(path, chain, progress, crc_later)
    except CheckpointError:
        settle(chain)   # damage is the reason, when a file's checksum says so
        raise
    return chain


def release(chain: Sequence[CheckpointData]) -> None:
    """Let a restore's files go once the restore is done with their states (their
    points' included): a file mapped for it can otherwise be neither replaced nor deleted on
    Windows (CheckpointData.release).  The chain's metadata stays usable."""
    for data in chain:
        data.release()


@contextlib.contextmanager
def restoring(chain: Sequence[CheckpointData]) -> Iterator[Sequence[CheckpointData]]:
    """Use a chain read with ``crc_later`` for a restore: whatever fails meanwhile, a damaged
    file is the reason (:func:`settle` first); the files are let go at the end
    (:func:`release`)."""
    try:
        yield chain
    except Exception:   # (an interrupt stays an interrupt)
        settle(chain)
        raise
    finally:
        release(chain)


def prepare_to_load() -> None:
    """Do before a first restore what it would otherwise pay for (a runtime calls this once
    its model is loaded): start the checksum helper thread (engine.checkpoints.crc_helper)
    and ask how files can be mapped (engine.checkpoints.mapped)."""
    crc_helper.start()
    mapped.prepare()


def _load_ancestors(path: Path, chain: list[CheckpointData], progress, crc_later: bool) -> None:
    # every parent is a plain name in the folder of ``path`` (parent_ref): names find a loop
    seen = {os.path.normcase(path.name)}
    first = path                   # the file chain[0] was read from
    while chain[0].header.is_delta:
        if len(chain) >= MAX_CHAIN:
            raise BrokenChain(f"the chain is longer than {MAX_CHAIN} files")
        name = parent_ref(chain[0].meta, first.name).file
        parent_path = path.parent / name
        if os.path.normcase(name) in seen:
            raise BrokenChain(f"the chain loops back to {name}")
        if not parent_path.is_file():
            raise BrokenChain(f"the parent checkpoint {name} is missing from {path.parent}")
        try:
            parent = read_checkpoint(parent_path, progress=progress, crc_later=crc_later, ancestor=crc_later)
        except CheckpointError as exc:
            raise BrokenChain(f"the parent checkpoint {name} is damaged: {exc}") from exc
        chain.insert(0, parent)
        check_link(parent, chain[1])
        first = parent_path
        seen.add(os.path.normcase(name))


def settle(chain: Sequence[CheckpointData]) -> None:
    """Wait for the checksums of a chain read with ``crc_later``, newest file first; its
    damage is a ChecksumMismatch, an ancestor's a BrokenChain that names it (as
    :func:`load_chain` reports them).  Returns at once for a checked chain."""
    for data in reversed(chain):
        try:
            data.settle()
        except CheckpointError as exc:
            if data is chain[-1]:
                raise
            raise BrokenChain(f"the parent checkpoint {data.path.name} is damaged: {exc}") from exc


def read_logits(chain: Sequence[CheckpointData], i: int) -> None:
    """Have ``chain[i]``'s logits read where :func:`load_chain` left an ancestor's in its file
    (CheckpointData.read_logits): a restore keeps them (with a snapshot after it, or as the
    last file's of a chain restored up to it).  An ancestor's damage is a BrokenChain that
    names it, as :func:`settle` reports it."""
    try:
        chain[i].read_logits()
    except CheckpointError as exc:
        if i == len(chain) - 1:
            raise
        raise BrokenChain(f"the parent checkpoint {chain[i].path.name} is damaged: {exc}") from exc


@dataclass(frozen=True)
class LinkFacts:
    """What the link rule needs to know of a file, whichever reader saw it: the graph
    (header, metadata, tokens, trailer) or a full read (CheckpointData)."""
    name: str
    checkpoint_id: str | None
    payload_crc: int
    n_tokens: int
    conversation_id: object
    tokens_digest: str               # of the n_tokens tokens its KV state holds
    parent: ParentRef | None = None  # a delta's reference
    parent_n_tokens: int = 0
    prefix_digest: str = ""          # a delta: digest of its first parent_n_tokens tokens
    cuttable: bool = False           # its memory may build on part of a parent (can_cut)
    #: the digest of its first k tokens (a cut child's parent is asked for it)
    digest_at: Callable[[int], str | None] | None = field(default=None, compare=False, repr=False)


def can_cut(header: Header) -> bool:
    """Whether a delta of this memory may build on the first tokens of a parent that holds
    more (a *cut*: the parent's cells from there on are dropped before the delta's are
    set): a plain attention memory without a sliding window, whose cells at the positions
    before a point are the same whatever follows them (ModelShape.cells_by_position)."""
    return header.memory == MEMORY_ATTENTION and not header.n_swa


def facts_of(data: CheckpointData) -> LinkFacts:
    facts = data.link_facts
    if not isinstance(facts, LinkFacts):   # computed once per file read (load_chain and the restore both link)
        facts = data.link_facts = _facts_of(data)
    return facts


def _facts_of(data: CheckpointData) -> LinkFacts:
    h = data.header
    cid = data.meta.get("checkpoint_id")
    name = data.path.name if data.path else "a checkpoint"
    ref = parent_ref(data.meta, name) if h.is_delta else None
    tokens = data.tokens
    return LinkFacts(name, cid if isinstance(cid, str) else None, data.payload_crc, h.n_tokens,
                     h.conversation_id, tokens_digest(tokens[:h.n_tokens]), ref,
                     h.parent_n_tokens,
                     tokens_digest(tokens[:h.parent_n_tokens]) if h.is_delta else "",
                     can_cut(h), lambda k: tokens_digest(tokens[:k]))


def link_problem(parent: LinkFacts, child: LinkFacts) -> str | None:
    """Why ``child`` is not a delta on exactly ``parent`` (one sentence), or None.

    The one rule: the reference names the parent's checkpoint id, payload CRC and token
    count; the delta continues from the parent's last token — or, a *cut* (:func:`can_cut`),
    from an earlier one of its tokens — and the delta's first tokens are the parent's up
    to there.  The conversation may differ: a fork, or a conversation that starts with
    another's document, builds on another conversation's files.  (Finding the parent by
    name is the caller's business: an import may have renamed it.)
    """
    ref = child.parent
    if ref is None:
        return f"{child.name} is not a delta"
    if ref.checkpoint_id != parent.checkpoint_id or ref.payload_crc != parent.payload_crc \
            or ref.n_tokens != parent.n_tokens:
        return f"{parent.name} is not the parent this delta was made on (it was replaced or altered since)"
    start = child.parent_n_tokens
    wanted: str | None
    if start == parent.n_tokens:
        wanted = parent.tokens_digest
    elif 0 < start < parent.n_tokens and child.cuttable and parent.digest_at is not None:
        wanted = parent.digest_at(start)
        if wanted is None:
            # the parent's tokens cannot be read just now (a share's hiccup, a lock): the
            # link counts as made, so that a store's bookkeeping never deletes what the
            # child needs on a passing read error; a restore reads and checks it again
            return None
    elif 0 < start < parent.n_tokens and child.cuttable:
        return f"the tokens of {parent.name} are not at hand to check the delta against"
    elif 0 < start < parent.n_tokens:
        return (f"the delta builds on the first {start} of the {parent.n_tokens} tokens of {parent.name}, "
                "which only a plain attention memory can")
    else:
        return f"the delta continues from token {start}, {parent.name} holds {parent.n_tokens}"
    if child.prefix_digest != wanted:
        return f"the delta's tokens do not continue those of {parent.name}"
    return None


def check_link(parent: CheckpointData, child: CheckpointData) -> None:
    """Raise BrokenChain unless ``child`` is a delta on exactly ``parent``."""
    if not child.header.is_delta:
        raise BrokenChain(f"{child.path.name if child.path else 'a checkpoint'} is not a delta")
    problem = link_problem(facts_of(parent), facts_of(child))
    if problem:
        raise BrokenChain(problem)
