"""The store as a graph: files are nodes, parent links are edges, heads are what users have.

Delta checkpoints made the store a graph: a delta is worth nothing without its parent.
Every operation that deletes or lists files goes through this module, so none of them
can treat a file on its own again.

Nodes.  One per readable checkpoint file, from its header, its metadata and its trailer
(never its state): checkpoint id, parent reference (file name, id, payload CRC), the
conversation, the *line* of history, kind, token count and a digest of the tokens the
KV state holds.  Nodes are cached by (inode, size, mtime), so a rescan reads only files
that changed; files the app writes are never rewritten in place.

Edges.  A delta's parent is the node of the named file whose checkpoint id and payload
CRC match the reference; a delta whose parent is missing or replaced is *broken*.

Lines and heads.  A line is one line of a conversation's history (the metadata's
``"line"``; files written before lines existed belong to their conversation's line).
Each line's *tip* is its newest node whose chain is complete, and it is the line's
*head* unless another line's chain contains it whole (a fork point whose own line was
deleted holds nothing of its own).  A tip another line was *cut* from (built on its
first tokens only: an Edit or a Regenerate of a turn the tip absorbed) holds its own
tail and stays a head, unless the user deleted it or its conversation (Store.deleted:
the file is kept for the other line's sake, and it stays gone from the list).  A
conversation has one head per line, one per branch.  The chain of a head (the head and
its ancestors) is what restoring it needs.

Shared prefixes.  A line whose name starts with ``shared-`` holds the cells of a long
system prompt that several conversations' chains start with (engine.shared_prefix): it
has no tip and no head (it is nobody's conversation), is kept while some head's chain
holds it, and is deleted by any deleting operation once none does.

Superseded.  A node older than its line's tip and in no tip's chain holds an earlier
state of a history that has moved on: it is *superseded*.  That is the only kind of
file this module ever deletes on its own:

* :func:`retire` deletes a line's superseded nodes once a new head was written
  (the writer calls it after the new file is durable);
* :func:`prune` spends a byte budget on superseded nodes, oldest first, and reports
  what it kept and why;
* :func:`delete_conversation` deletes every node of a conversation that no head of
  another conversation depends on (the user asked for it), and what its chains hold of
  a conversation deleted before (up to a cut, engine.checkpoints.chain.can_cut, or of a
  conversation recorded as deleted, Store.deleted) that no other head needs: deleting
  never brings a conversation back;
* :func:`delete_node` deletes a head the user chose with what of its chain no other head
  needs; a head another line was cut from stays, recorded as deleted (Store.deleted).

The record of what was deleted (Store.deleted) lets go of what an import brings back
(:func:`bring_back`): a deleted head the store kept, imported again, is a head again.

Never deleted automatically: a head or anything in a head's chain; a node newer than
its line's head (a chain being written, or one whose parent went missing: the user may
restore the parent); a file whose header cannot be read.  Before a line's superseded
nodes go, the head's whole chain is verified (full CRC, once per file version); a head
that fails is set aside and the next newest complete node becomes the head.

Every deletion happens under the store's cross-process lock, with the graph scanned
under that same lock, and re-checks that the file is still the version that was
scanned.  A delta is renamed into place under the same lock only while its parent
still exists (see ``atomic_write(precondition=...)``), so a concurrent prune can never
leave a freshly written delta without its parent.
"""

from __future__ import annotations

import logging
import os
import stat
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.checkpoints.chain import (
    MAX_CHAIN,
    LinkFacts,
    ParentRef,
    can_cut,
    link_problem,
    parent_ref,
    tokens_digest,
)
from engine.checkpoints.format import (
    HEADER_LEN,
    TRAILER_LEN,
    Header,
    decode_metadata,
    read_tokens,
    unpack_header,
    verify_file,
)
from engine.checkpoints.store import STALE_TEMP_AGE_S, Deleted, Store, file_identity
from engine.errors import CheckpointError

log = logging.getLogger("checkpoint")

#: Lines of shared prefixes (engine.shared_prefix) start with this.
SHARED_LINE = "shared-"


def is_shared_line(line: str) -> bool:
    return line.startswith(SHARED_LINE)


#: Bytes of superseded checkpoints a store may hold before pruning deletes them.  The
#: one default for the window, the CLI and the settings dialog.
DEFAULT_BUDGET_BYTES = 2 << 30


@dataclass(frozen=True)
class Node:
    """One checkpoint file as the graph sees it."""
    path: Path
    size: int
    identity: tuple[int, int, int]
    header: Header
    checkpoint_id: str | None
    payload_crc: int                 # as stored in the trailer; verified when a chain is read
    parent: ParentRef | None         # deltas only
    line: str
    tokens_digest: str               # of the tokens the KV state holds (n_tokens)
    model_name: str = ""
    parent_error: str | None = None  # a delta whose metadata names no valid parent
    origin_crc: int | None = None    # an imported copy rewritten to relink it: its original CRC
    seq: int = 0                     # its place in its line's history (0: written before lines)
    prefix_digest: str = ""          # a delta: digest of its first parent_n_tokens tokens

    @property
    def order(self) -> tuple[int, int, str]:
        """Oldest first within a line: the writer's sequence, then time, then name.

        The sequence comes first so that a clock stepping back (or two saves in one
        clock tick) can never make an older state look newer.
        """
        return (self.seq, self.created_ns, self.name)

    @property
    def facts(self) -> LinkFacts:
        return LinkFacts(self.name, self.checkpoint_id, self.payload_crc, self.header.n_tokens,
                         self.conversation_id, self.tokens_digest, self.parent,
                         self.header.parent_n_tokens, self.prefix_digest, can_cut(self.header),
                         self._digest_at)

    def _digest_at(self, k: int) -> str | None:
        """The digest of its first ``k`` tokens, read again once per file version (only a
        cut child asks); None while the file cannot be read (see link_problem)."""
        key = (str(self.path), self.identity, k)
        digest = _CUT_DIGESTS.get(key)
        if digest is None:
            try:
                digest = tokens_digest(read_tokens(self.path)[1][:k])
            except (OSError, CheckpointError):
                return None
            if len(_CUT_DIGESTS) >= _NODE_CACHE_MAX:
                _CUT_DIGESTS.clear()
            _CUT_DIGESTS[key] = digest
        return digest

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def conversation_id(self) -> uuid.UUID:
        return self.header.conversation_id

    @property
    def created_ns(self) -> int:
        return self.header.created_unix_ns

    @property
    def is_delta(self) -> bool:
        return self.header.is_delta

    @property
    def title(self) -> str:
        return self.header.title or self.path.stem


@dataclass(frozen=True)
class Unreadable:
    """A ``.kvckpt`` file whose header or metadata cannot be read: kept, with the reason."""
    path: Path
    size: int
    error: str


def default_line(conversation_id: uuid.UUID) -> str:
    """A conversation's first line of history (and the line of files older than lines)."""
    return conversation_id.hex


def line_of(meta: dict, header: Header) -> str:
    line = meta.get("line")
    return line if isinstance(line, str) and 0 < len(line) <= 64 else default_line(header.conversation_id)


def seq_of(meta: dict) -> int:
    seq = meta.get("seq")
    return seq if isinstance(seq, int) and not isinstance(seq, bool) and 0 <= seq < 1 << 62 else 0


def read_node(path: Path) -> Node:
    """Header, metadata, token array and trailer of one file (no state, no full CRC)."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        header = unpack_header(f.read(HEADER_LEN), st.st_size)
        meta_bytes = f.read(header.meta_len)
        meta = decode_metadata(meta_bytes)
        tokens = f.read(4 * header.n_tokens)
        f.seek(st.st_size - TRAILER_LEN)
        trailer = f.read(TRAILER_LEN)
    if len(meta_bytes) != header.meta_len or len(tokens) != 4 * header.n_tokens \
            or len(trailer) != TRAILER_LEN:
        raise CheckpointError("the file ended while it was being read")
    parent, parent_error = None, None
    if header.is_delta:
        try:
            parent = parent_ref(meta, path.name)
        except CheckpointError as exc:
            parent_error = str(exc)
    cid = meta.get("checkpoint_id")
    model = meta.get("model")
    origin = meta.get("origin_crc")
    token_ids = np.frombuffer(tokens, dtype="<i4")
    return Node(path=path, size=st.st_size, identity=file_identity(st), header=header,
                checkpoint_id=cid if isinstance(cid, str) else None,
                payload_crc=int.from_bytes(trailer[:4], "little"), parent=parent,
                line=line_of(meta, header),
                tokens_digest=tokens_digest(token_ids),
                model_name=str(model.get("name", "")) if isinstance(model, dict) else "",
                parent_error=parent_error,
                origin_crc=origin if isinstance(origin, int) and not isinstance(origin, bool) else None,
                seq=seq_of(meta),
                prefix_digest=tokens_digest(token_ids[:header.parent_n_tokens]) if header.is_delta else "")


# Nodes by path, valid while the file keeps its identity (files are never rewritten in
# place by the app; a user's or a test's rewrite changes the identity).
_NODE_CACHE: dict[str, tuple[tuple[int, int, int], Node]] = {}
_NODE_CACHE_MAX = 8192
#: digests of a file's first k tokens (Node._digest_at), by path, file version and k
_CUT_DIGESTS: dict[tuple[str, tuple[int, int, int], int], str] = {}
# Files (by path and identity) whose full CRC was verified in this process.
_VERIFIED: set[tuple[str, tuple[int, int, int]]] = set()


def _cached_node(path: Path) -> Node:
    key = str(path)
    st = path.stat()
    hit = _NODE_CACHE.get(key)
    if hit is not None and hit[0] == file_identity(st):
        return hit[1]
    node = read_node(path)
    if len(_NODE_CACHE) >= _NODE_CACHE_MAX:
        _NODE_CACHE.clear()
    _NODE_CACHE[key] = (node.identity, node)
    return node


def verified(node: Node) -> bool:
    """True when the file is intact (full CRC), checked once per file version."""
    key = (str(node.path), node.identity)
    if key in _VERIFIED:
        return True
    try:
        verify_file(node.path)
        if file_identity(node.path.stat()) != node.identity:
            return False
    except (CheckpointError, OSError):
        return False
    _VERIFIED.add(key)
    return True


class Graph:
    """A snapshot of a store's files as nodes, parent edges, lines and heads."""

    def __init__(self, nodes: Iterable[Node], unreadable: Iterable[Unreadable] = (),
                 *, rejected: Iterable[str] = (), deleted: Deleted | None = None) -> None:
        self.nodes: dict[str, Node] = {n.name: n for n in nodes}
        self.unreadable: list[Unreadable] = list(unreadable)
        self._rejected = set(rejected)    # heads that failed verification: not heads
        self._parent: dict[str, Node | None] = {}
        self._problem: dict[str, str | None] = {}
        self.children: dict[str, list[Node]] = {}
        for node in self.nodes.values():
            parent = self._link(node)
            self._parent[node.name] = parent
            if parent is not None:
                self.children.setdefault(parent.name, []).append(node)
        self.lines: dict[str, list[Node]] = {}
        for node in sorted(self.nodes.values(), key=lambda n: n.order, reverse=True):
            self.lines.setdefault(node.line, []).append(node)   # newest first
        # each line's tip: its newest node whose chain is whole
        self.tip_of_line: dict[str, Node] = {}
        for line, members in self.lines.items():
            if is_shared_line(line):
                continue   # a shared prefix is no conversation's history
            tip = next((n for n in members if n.name not in self._rejected
                        and self.chain_problem(n) is None), None)
            if tip is not None:
                self.tip_of_line[line] = tip
        self._reachable: set[str] = set()
        held_whole: set[str] = set()   # files a child in some tip's chain builds on whole
        cut_from: set[str] = set()     # files a child there builds on the first tokens of
        for tip in self.tip_of_line.values():
            chain = self.chain(tip)
            self._reachable.update(n.name for n in chain)
            for parent, child in zip(chain, chain[1:], strict=False):
                cut = child.header.parent_n_tokens < parent.header.n_tokens
                (cut_from if cut else held_whole).add(parent.name)
        # a tip that another line's history holds whole holds nothing of its own (a fork
        # point whose own line was deleted, say): it is not a head.  One that another line
        # was cut from (an Edit or a Regenerate of a turn it absorbed) holds its own tail:
        # it stays a head, unless the user deleted it or its conversation (kept for the
        # other's sake)
        gone = deleted if deleted is not None else Deleted()
        self.head_of_line: dict[str, Node] = {
            line: tip for line, tip in self.tip_of_line.items()
            if tip.name not in held_whole and not (tip.name in cut_from and _recorded_deleted(tip, gone))}
        self.heads: list[Node] = sorted(self.head_of_line.values(),
                                        key=lambda n: (n.created_ns, n.name), reverse=True)
        self._head_names = {h.name for h in self.heads}
        self._holders: Counter[str] | None = None   # see footprint

    @classmethod
    def scan(cls, folder: str | os.PathLike | Store, *, rejected: Iterable[str] = ()) -> Graph:
        store = folder if isinstance(folder, Store) else Store(folder)
        nodes, unreadable = [], []
        for path in store.files():
            try:
                nodes.append(_cached_node(path))
            except FileNotFoundError:
                continue   # deleted between the listing and the read
            except (CheckpointError, OSError) as exc:
                try:
                    size = path.stat().st_size
                except OSError:
                    continue
                unreadable.append(Unreadable(path, size, getattr(exc, "strerror", None) or str(exc)))
        return cls(nodes, unreadable, rejected=rejected, deleted=store.deleted())

    # -- edges and chains -------------------------------------------------------------------
    def _link(self, node: Node) -> Node | None:
        if not node.is_delta:
            self._problem[node.name] = None
            return None
        if node.parent is None:
            self._problem[node.name] = node.parent_error or f"{node.name} does not name its parent"
            return None
        parent = self.nodes.get(node.parent.file)
        if parent is None:
            self._problem[node.name] = f"the parent checkpoint {node.parent.file} is missing"
            return None
        self._problem[node.name] = link_problem(parent.facts, node.facts)
        return parent if self._problem[node.name] is None else None

    def parent(self, node: Node) -> Node | None:
        return self._parent.get(node.name)

    def chain(self, node: Node) -> list[Node]:
        """``node`` and its linked ancestors, base first (stops where a link is broken)."""
        out = [node]
        while out[0].is_delta and len(out) < MAX_CHAIN:
            parent = self._parent.get(out[0].name)
            if parent is None or parent in out:
                break
            out.insert(0, parent)
        return out

    def chain_problem(self, node: Node) -> str | None:
        """Why ``node``'s chain cannot be restored (from headers alone), or None."""
        chain = self.chain(node)
        base = chain[0]
        if base.is_delta:
            return self._problem.get(base.name) or f"the chain of {node.name} is too long or loops"
        for member in chain:
            if member.name in self._rejected:
                return f"{member.name} is damaged"
        return None

    def chain_size(self, node: Node) -> int:
        return sum(n.size for n in self.chain(node))

    def footprint(self, head: Node) -> tuple[int, int]:
        """Bytes of ``head``'s chain that it alone holds, and bytes it shares with other
        heads (a shared prefix, a fork's common files): deleting it frees the first."""
        if self._holders is None:   # how many heads' chains hold each node, counted once
            self._holders = Counter(n.name for h in self.heads for n in self.chain(h))
        chain = self.chain(head)
        own = 1 if self.is_head(head) else 0
        shared = sum(n.size for n in chain if self._holders[n.name] > own)
        return sum(n.size for n in chain) - shared, shared

    def unused_shared(self) -> list[Node]:
        """Shared prefixes no head's chain holds any more."""
        return [n for line, members in self.lines.items() if is_shared_line(line)
                for n in members if n.name not in self._reachable]

    # -- heads --------------------------------------------------------------------------------
    def is_head(self, node: Node) -> bool:
        return node.name in self._head_names

    def reachable(self, node: Node) -> bool:
        """Whether some head's chain holds ``node``."""
        return node.name in self._reachable

    def heads_of(self, conversation_id: uuid.UUID) -> list[Node]:
        return [h for h in self.heads if h.conversation_id == conversation_id]

    def head_holding(self, node: Node) -> Node | None:
        """The newest head whose chain holds ``node``."""
        return next((h for h in self.heads if node in self.chain(h)), None)

    def superseded(self, line: str | None = None) -> list[Node]:
        """Nodes older than their line's head and in no head's chain, oldest first."""
        out = []
        for name, members in self.lines.items():
            if line is not None and name != line:
                continue
            tip = self.tip_of_line.get(name)
            if tip is None:   # (a shared prefix has none: unused ones go by _drop_unused_shared)
                continue   # no restorable node at all: keep everything for the user
            out += [n for n in members if n.name not in self._reachable and n.order < tip.order]
        return sorted(out, key=lambda n: (n.created_ns, n.name))

    def next_seq(self, line: str) -> int:
        """The sequence number the next file of ``line`` gets."""
        return max((n.seq for n in self.lines.get(line, ())), default=0) + 1

    def by_id(self, checkpoint_id: str, payload_crc: int) -> Node | None:
        """The node of that checkpoint (its CRC, or the CRC it had before a relinking import)."""
        return next((n for n in self.nodes.values() if n.checkpoint_id == checkpoint_id
                     and payload_crc in (n.payload_crc, n.origin_crc)), None)


# -- operations that delete ----------------------------------------------------------------------

@dataclass
class PruneReport:
    """What a prune, retire or delete did, and what it kept and why."""
    deleted: list[Path] = field(default_factory=list)
    freed_bytes: int = 0
    kept: dict[str, list[int]] = field(default_factory=dict)   # reason -> [files, bytes]
    skipped_changed: int = 0       # candidates rewritten since they were scanned
    stale_temps: int = 0
    store_bytes: int = 0           # every checkpoint in the store, afterwards

    def keep(self, reason: str, node_or_size) -> None:
        size = node_or_size if isinstance(node_or_size, int) else node_or_size.size
        slot = self.kept.setdefault(reason, [0, 0])
        slot[0] += 1
        slot[1] += size

    def describe(self) -> str:
        parts = [f"deleted {len(self.deleted)} superseded file(s), {self.freed_bytes:,} bytes"]
        parts += [f"kept {n} {reason} ({size:,} bytes)" for reason, (n, size) in sorted(self.kept.items())]
        return "; ".join(parts)


KEPT_HEAD = "head(s)"
KEPT_CHAIN = "file(s) a head depends on"
KEPT_NEWER = "file(s) newer than their line's head (a chain being written, or one with a missing parent)"
KEPT_UNREADABLE = "unreadable file(s)"
KEPT_NO_HEAD = "file(s) of lines with no restorable head"
KEPT_BUDGET = "superseded file(s) within the budget"


def _classify(graph: Graph, report: PruneReport, candidates: set[str]) -> None:
    for node in graph.nodes.values():
        if node.name in candidates:
            continue
        if graph.is_head(node):
            report.keep(KEPT_HEAD, node)
        elif graph.reachable(node):
            report.keep(KEPT_CHAIN, node)
        elif node.line not in graph.tip_of_line:
            report.keep(KEPT_NO_HEAD, node)
        else:
            report.keep(KEPT_NEWER, node)
    for bad in graph.unreadable:
        report.keep(KEPT_UNREADABLE, bad.size)


KEPT_IN_USE = "file(s) that could not be deleted now (in use), with the files they need"


def _verify_tips(store: Store, lines: set[str] | None) -> set[str]:
    """Full CRC of every tip chain that supersedes something, *outside* the store lock
    (a 7B model's chain is gigabytes; saves only wait for renames).  Returns the names
    of damaged files: set aside, they are no tips, and the next newest whole chain is."""
    rejected: set[str] = set()
    while True:
        graph = Graph.scan(store, rejected=rejected)
        bad: set[str] = set()
        for line, tip in graph.tip_of_line.items():
            if (lines is None or line in lines) and graph.superseded(line):
                bad.update(n.name for n in graph.chain(tip) if not verified(n))
        if not bad:
            return rejected
        log.warning("damaged checkpoint(s) found while pruning, set aside: %s", ", ".join(sorted(bad)))
        rejected |= bad


def _locked_graph(store: Store, rejected: set[str]) -> tuple[Graph, set[str]]:
    """Rescan under the lock; the lines whose tip chain was verified before (by identity:
    a file that changed since is not trusted) may lose their superseded files."""
    graph = Graph.scan(store, rejected=rejected)
    trusted = {line for line, tip in graph.tip_of_line.items()
               if all((str(n.path), n.identity) in _VERIFIED for n in graph.chain(tip))}
    return graph, trusted


def _delete(store: Store, node: Node, report: PruneReport) -> bool:
    """Delete ``node`` unless its file changed since the scan (lock held)."""
    try:
        if file_identity(node.path.stat()) != node.identity:
            report.skipped_changed += 1
            return False
        node.path.unlink()
    except FileNotFoundError:
        return True    # gone already: nothing depends on it being here
    except OSError as exc:   # Windows: held open by a reader; next time
        log.info("could not delete %s now: %s", node.name, exc)
        return False
    report.deleted.append(node.path)
    report.freed_bytes += node.size
    return True


def _delete_leaves_first(store: Store, graph: Graph, nodes: list[Node], report: PruneReport,
                         keep=lambda node: False) -> None:
    """Delete ``nodes`` children before parents; when a file cannot go, the files it
    needs stay too (a chain is never cut in the middle)."""
    blocked: set[str] = set()
    # deepest first: a file's children are deeper in its chain, whatever line they are of
    for node in sorted(nodes, key=lambda n: (len(graph.chain(n)), n.order), reverse=True):
        if node.name in blocked or keep(node):
            blocked.update(n.name for n in graph.chain(node)[:-1])
            if node.name in blocked:
                report.keep(KEPT_IN_USE, node)
            continue
        if not _delete(store, node, report):
            report.keep(KEPT_IN_USE, node)
            blocked.update(n.name for n in graph.chain(node)[:-1])


def _components(graph: Graph, nodes: list[Node]) -> list[list[Node]]:
    """Superseded nodes grouped into chains (parent links), the groups oldest first (by
    their newest member), so a budget removes whole old chains."""
    names = {n.name for n in nodes}
    group: dict[str, int] = {}
    groups: list[list[Node]] = []
    for node in sorted(nodes, key=lambda n: n.order):
        parent = graph.parent(node)
        if parent is not None and parent.name in names and parent.name in group:
            idx = group[parent.name]
        else:
            idx = len(groups)
            groups.append([])
        group[node.name] = idx
        groups[idx].append(node)
    return sorted((g for g in groups if g), key=lambda g: (g[-1].created_ns, g[-1].name))


#: an unused shared prefix younger than this is kept by a prune: its writer may not have
#: landed the delta on it yet (an autosave lands on a helper thread, and the worker prunes
#: right after its save)
SHARED_GRACE_S = 120.0


def prune(store: Store, budget_bytes: int | None = DEFAULT_BUDGET_BYTES, *,
          stale_temp_age_s: float = STALE_TEMP_AGE_S, shared_grace_s: float = SHARED_GRACE_S) -> PruneReport:
    """Delete superseded chains, oldest first, while the store holds more than
    ``budget_bytes`` (every checkpoint counts); None deletes every superseded file.  The
    shared prefixes no head uses go too, once older than ``shared_grace_s``."""
    report = PruneReport()
    if not store.folder.is_dir():
        return report
    rejected = _verify_tips(store, None)
    with store.lock():
        report.stale_temps = store.remove_stale_temps(stale_temp_age_s)
        graph, trusted = _locked_graph(store, rejected)
        total = sum(n.size for n in graph.nodes.values()) + sum(u.size for u in graph.unreadable)
        candidates = [n for n in graph.superseded() if n.line in trusted and not is_shared_line(n.line)]
        for chain in _components(graph, candidates):
            if budget_bytes is not None and total <= budget_bytes:
                for node in chain:
                    report.keep(KEPT_BUDGET, node)
                continue
            before = report.freed_bytes
            _delete_leaves_first(store, graph, chain, report)
            total -= report.freed_bytes - before
        before = report.freed_bytes
        unused = _drop_unused_shared(store, graph, report, shared_grace_s)
        total -= report.freed_bytes - before
        _classify(graph, report, {n.name for n in candidates} | unused)
        report.store_bytes = total
    return report


def _drop_unused_shared(store: Store, graph: Graph, report: PruneReport, grace_s: float = 0.0) -> set[str]:
    """Delete the shared prefixes no head uses any more, written over ``grace_s`` ago
    (lock held); their names.

    A writer that has just stored a prefix and not yet its delta on it loses the race
    harmlessly when the prefix goes meanwhile (the delta's rename requires its parent, so
    it writes a full file), but the conversation then shares nothing: a prune spares
    young prefixes; a delete (the user's) does not."""
    born_before = time.time_ns() - int(grace_s * 1e9)
    unused = [n for n in graph.unused_shared() if n.created_ns <= born_before]
    _delete_leaves_first(store, graph, unused, report)
    return {n.name for n in unused}


def retire(store: Store, line: str) -> PruneReport:
    """Delete what a line's new head supersedes (call once the head is durable)."""
    report = PruneReport()
    if not store.folder.is_dir():
        return report
    rejected = _verify_tips(store, {line})
    with store.lock():
        graph, trusted = _locked_graph(store, rejected)
        if line in trusted:
            _delete_leaves_first(store, graph, graph.superseded(line), report)
    return report


def delete_conversation(store: Store, conversation_id: uuid.UUID) -> PruneReport:
    """Delete every file of a conversation that no other conversation's head needs, and the
    files of others its heads' chains hold that no other head needs: up to a cut (a tip
    cut from is still its line's head, so a live conversation's file is always needed),
    and those of a conversation deleted before that kept them alive for this one (left,
    they would become its heads again).

    Which conversations were deleted is recorded (Store.deleted) while
    another's chain still holds some of their files: a conversation with no head is not
    necessarily deleted (a store written before 2026-12-04 may hide a live conversation's
    head in a fork's chain; an import may link to a live tip), so having no head is never
    the reason to delete a file."""
    report = PruneReport()
    if not store.folder.is_dir():
        return report
    with store.lock():
        graph = Graph.scan(store)
        needed: set[str] = set()
        for head in graph.heads:
            if head.conversation_id != conversation_id:
                needed.update(n.name for n in graph.chain(head))
        mine = [n for n in graph.nodes.values() if n.conversation_id == conversation_id]
        headed = {h.conversation_id for h in graph.heads}
        record = store.deleted()
        deleted = set(record.conversations) - headed   # an import may have brought one back
        borrowed: dict[str, Node] = {}
        for head in graph.heads:
            if head.conversation_id == conversation_id:
                chain = graph.chain(head)
                cuts = [i for i in range(len(chain) - 1)
                        if chain[i + 1].header.parent_n_tokens < chain[i].header.n_tokens]
                borrowed.update((n.name, n) for i, n in enumerate(chain)
                                if n.conversation_id != conversation_id and n.name not in needed
                                and (i <= max(cuts, default=-1) or n.conversation_id in deleted))
        mine += borrowed.values()
        for node in mine:
            if node.name in needed:
                report.keep("file(s) another conversation's head depends on", node)
        _delete_leaves_first(store, graph, [n for n in mine if n.name not in needed], report)
        _drop_unused_shared(store, Graph.scan(store), report)
        _record_deleted(store, Deleted(frozenset(deleted | {conversation_id}), record.checkpoints))
    return report


def bring_back(store: Store, names: set[str]) -> None:
    """An import brings back what it imports, and only that (engine.checkpoints.transfer
    calls this with the store's names of the files it imported or found there).

    A file the user deleted (or whose conversation they deleted) stays in the store while
    another line was cut from it, recorded as deleted so that it is no head (Store.deleted).
    Imported again, it is found there ("already in the store"), and the record would go on
    hiding it: the conversation just imported would have no head, and be gone from the
    list after a restart (found by the composition soak: a fork, its source deleted, its
    export imported again).  The record lets go of the imported files; a conversation's
    other tips the store kept stay deleted, by name."""
    if not names:
        return
    with store.lock():
        record = store.deleted()
        if not record:
            return
        graph = Graph.scan(store)
        brought = {graph.nodes[n].conversation_id for n in names if n in graph.nodes}
        conversations = brought & record.conversations
        if not conversations and not names & record.checkpoints:
            return
        still_gone = {tip.name for tip in graph.tip_of_line.values()
                      if tip.conversation_id in conversations and tip.name not in names}
        _record_deleted(store, Deleted(record.conversations - conversations,
                                       frozenset((record.checkpoints | still_gone) - names)))


def _recorded_deleted(node: Node, deleted: Deleted) -> bool:
    return node.conversation_id in deleted.conversations or node.name in deleted.checkpoints


def _record_deleted(store: Store, deleted: Deleted) -> None:
    """Keep the record of what the user deleted to what has files left (lock held);
    written only when it changes."""
    nodes = Graph.scan(store).nodes
    left = {n.conversation_id for n in nodes.values()}
    kept = Deleted(deleted.conversations & left, frozenset(n for n in deleted.checkpoints if n in nodes))
    if kept != store.deleted():
        store.record_deleted(kept)


def delete_node(store: Store, path: str | os.PathLike) -> PruneReport:
    """Delete one file the user chose, as far as the graph allows.

    A head goes with every file of its chain that no other head needs; a head another
    line was cut from (an Edit, a fork) stays for that line's sake, recorded as deleted
    (Store.deleted), so that it is no head any more.  A file some head needs is refused
    (CheckpointError naming the head); any other file (superseded, broken, unreadable)
    goes alone.
    """
    path = Path(path)
    if not store.contains(path):
        raise ValueError(f"{path} is not a checkpoint of the store in {store.folder}")
    report = PruneReport()
    with store.lock():
        g = Graph.scan(store)
        node = g.nodes.get(path.name)
        if node is None:
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                return report
            report.deleted.append(path)
            report.freed_bytes += size
            return report
        if g.reachable(node) and not g.is_head(node):
            head = g.head_holding(node)
            raise CheckpointError(f"{node.name} is part of the chain of {head.name if head else 'a head'}; "
                                  "delete that checkpoint (or its conversation) instead")
        if not g.is_head(node):
            if not _delete(store, node, report):
                report.keep(KEPT_IN_USE, node)
            return report
        needed: set[str] = set()
        for other in g.heads:
            if other is not node:
                needed.update(n.name for n in g.chain(other))
        _delete_leaves_first(store, g, [n for n in g.chain(node) if n.name not in needed], report)
        for member in g.chain(node):
            if member.name in needed:
                report.keep(KEPT_CHAIN, member)
        _drop_unused_shared(store, Graph.scan(store), report)
        record = store.deleted()
        hidden = {node.name} if node.name in needed else set()
        _record_deleted(store, Deleted(record.conversations, record.checkpoints | hidden))
    return report


def overwrite_problem(path: str | os.PathLike) -> str | None:
    """Why writing a new file over ``path`` would break something, or None.

    Deltas name their parent by file name and CRC: replacing a file that deltas build on
    would orphan them.  And a file is written beside its name and renamed over it
    (engine.checkpoints.atomic), which would put a regular file where a link, a device
    (``/dev/null`` run as root), a pipe or a folder was: those names are refused too.
    (Names the app picks are fresh; this guards names users pick.)
    """
    path = Path(path)
    try:
        st = os.lstat(path)
    except OSError:   # nothing there (or nothing that can be looked at: the write will say)
        return None
    # (Windows: a link other than a symbolic one — a WSL link, a mount point — is a reparse point)
    linked = stat.S_ISLNK(st.st_mode) or bool(getattr(st, "st_file_attributes", 0)
                                               & stat.FILE_ATTRIBUTE_REPARSE_POINT)
    if linked or not stat.S_ISREG(st.st_mode):
        what = ("a link" if linked else "a folder" if stat.S_ISDIR(st.st_mode)
                else "a device, a pipe or a socket")
        return f"{path} is {what}, not a checkpoint file; writing there would replace it — choose another name"
    g = Graph.scan(Store(path.parent))
    node = g.nodes.get(path.name)
    children = g.children.get(path.name, []) if node is not None else []
    if children:
        return (f"{path.name} is the parent of {len(children)} delta checkpoint(s) "
                f"({children[0].name}…); writing over it would break them — choose another name")
    return None
