"""Bringing checkpoint files into the store, and checking one file in full.

The one importer (the window's drops, File › Open Checkpoint and double-clicked files
all come here).  It never moves or alters a source file:

1. every file is verified in full (header, lengths, payload CRC) and, given a
   :class:`~engine.checkpoints.compat.Target`, against the loaded model and context;
2. a checkpoint already in the store (same checkpoint id and payload CRC) is not
   copied again, and neither is the second of two identical files;
3. files given together are linked up: a delta's parent may be among them or already
   in the store.  A delta whose parent is in neither is refused with the reason (and,
   when the parent lies beside it, the folder to import its chain from), and so is
   every file that depends on it;
4. parents are copied before their children, each through a temp file that is
   verified before it is renamed into place (never over a file that appeared there
   meanwhile).  A file keeps its name unless the store already holds another file by
   that name.  Every copy is written with its metadata adjusted — same checkpoint id,
   same state bytes — and its original CRC kept as ``origin_crc``, so a later import of
   the untouched original is recognised:

   * its line of history is a new one (one per line of the files given together), so a
     copy never competes with the line it came from: an older copy cannot retire the
     original's newer files, nor a newer one the original (engine.checkpoints.graph);
   * a delta's parent reference names the parent's name and CRC in the store.

5. what an import brings back is a head afterwards (listed, kept while the user keeps it):
   the record of deletions lets go of it (engine.checkpoints.graph.bring_back), and a
   file the store held already that is no head (an older state of a conversation, a file
   kept only for another conversation's sake) gets one: a delta of metadata only on it, on
   a line of its own (:func:`_write_head_on`), unless a head of that state on it exists
   (an earlier import's).  Only the files no other file of the batch builds on are meant
   as heads; a shared prefix is nobody's.

Export of a single file is the caller's: a full checkpoint is copied as it is, a delta
is compacted into one full file by the engine (engine.compaction), because only llama.cpp
can merge KV states.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from engine.checkpoints.atomic import atomic_write
from engine.checkpoints.chain import ParentRef, facts_of, link_problem, load_chain, parent_ref
from engine.checkpoints.compat import Target
from engine.checkpoints.format import (
    EXTENSION,
    FLAG_DELTA,
    KIND_AUTOSAVE,
    CheckpointData,
    Header,
    encode_metadata,
    read_checkpoint,
    stored_payload_crc,
    write_sections,
)
from engine.checkpoints.graph import Graph, bring_back, is_shared_line, line_of
from engine.checkpoints.kvstate import check_file_states
from engine.checkpoints.store import Store
from engine.errors import CheckpointError, NotACheckpoint

VALID, INCOMPATIBLE, CORRUPT, NOT_CHECKPOINT, UNREADABLE, MISSING_PARENT = (
    "valid", "incompatible", "corrupt", "not a checkpoint", "unreadable", "missing parent")


@dataclass(frozen=True)
class FileCheck:
    """What checking or importing one file found."""
    path: Path
    status: str
    reason: str = ""
    header: Header | None = None
    imported: Path | None = None      # the store's copy (also when it was already there)
    already: bool = False             # the store held this checkpoint before
    head: Path | None = None          # the head of ``imported``'s state, which is none itself (step 5)
    chain_folder: Path | None = None  # MISSING_PARENT: a folder that holds its parent

    @property
    def ok(self) -> bool:
        return self.status == VALID

    def message(self) -> str:
        name = self.path.name
        if self.imported is not None:
            if self.already:
                listed = f", listed again as {self.head.name}" if self.head is not None else ""
                return f"{name}: already in the store as {self.imported.name}{listed}"
            return f"{name}: imported as {self.imported.name}"
        if self.status == VALID:
            return f"{name}: valid"
        if self.status == NOT_CHECKPOINT:
            return f"{name} is not a Checkpoint Chat checkpoint; nothing was imported."
        if self.status == INCOMPATIBLE:
            return f"{name} belongs to another model or context: {self.reason}. Nothing was imported."
        if self.status == MISSING_PARENT:
            return f"{name} was not imported: {self.reason}"
        return f"{name} is {self.status}: {self.reason}. Nothing was imported."


def import_summary(results: Sequence[FileCheck]) -> str:
    """One sentence on what an import brought: how many files are new in the store, and
    how many it held already (a file given twice counts once)."""
    new = {r.imported for r in results if r.imported is not None and not r.already}
    held = {r.imported for r in results if r.imported is not None and r.already} - new
    if new and held:
        return (f"Imported {_checkpoints(len(new))} into the store; "
                f"{len(held)} more {'was' if len(held) == 1 else 'were'} there already.")
    if new:
        return f"Imported {_checkpoints(len(new))} into the store."
    if held:
        return ("The store already holds this checkpoint." if len(held) == 1
                else f"The store already holds these {len(held)} checkpoints.")
    return "Nothing was imported."


def _checkpoints(n: int) -> str:
    return f"{n} checkpoint{'s' if n != 1 else ''}"


def _status_of(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, NotACheckpoint):
        return NOT_CHECKPOINT, str(exc)
    if isinstance(exc, CheckpointError):
        return CORRUPT, str(exc)
    return UNREADABLE, getattr(exc, "strerror", None) or str(exc)


def check_file(path: Path, target: Target | None, progress=None) -> FileCheck:
    """Full verification of a file — and of its whole chain when it is a delta beside
    its parents — plus, with a target, compatibility."""
    path = Path(path)
    try:
        data = read_checkpoint(path, load_state=not _is_delta(path), progress=progress)
        chain = load_chain(path) if data.header.is_delta else [data]
        for item in chain:
            check_file_states(item)
    except (CheckpointError, OSError) as exc:
        return FileCheck(path, *_status_of(exc))
    if target is not None:
        reason = target.incompatibility(data.header, data.meta)
        if reason:
            return FileCheck(path, INCOMPATIBLE, reason, data.header)
    return FileCheck(path, VALID, "", data.header)


def _is_delta(path: Path) -> bool:
    from engine.checkpoints.format import read_header
    try:
        return read_header(path).is_delta
    except (CheckpointError, OSError):
        return False


@dataclass
class _Item:
    path: Path
    data: CheckpointData            # state not loaded
    ref: ParentRef | None = None
    result: FileCheck | None = None
    dest: Path | None = None
    written_crc: int | None = None  # the store copy's payload CRC

    @property
    def key(self) -> tuple[str, int]:
        return (self.data.meta.get("checkpoint_id") or "", self.data.payload_crc)


def import_files(paths: Iterable[Path], store: Store, target: Target | None = None,
                 progress=None) -> list[FileCheck]:
    """Import ``paths`` into ``store`` as the module docstring describes; one result each."""
    paths = [Path(p) for p in paths]
    results: dict[Path, FileCheck] = {}
    items: list[_Item] = []
    by_key: dict[tuple[str, int], _Item] = {}
    for path in paths:
        if path in results:
            continue
        try:
            data = read_checkpoint(path, load_state=False, progress=progress)
        except (CheckpointError, OSError) as exc:
            results[path] = FileCheck(path, *_status_of(exc))
            continue
        reason = target.incompatibility(data.header, data.meta) if target is not None else None
        if reason:
            results[path] = FileCheck(path, INCOMPATIBLE, reason, data.header)
            continue
        item = _Item(path, data)
        if data.header.is_delta:
            try:
                item.ref = parent_ref(data.meta, path.name)
            except CheckpointError as exc:
                results[path] = FileCheck(path, CORRUPT, str(exc), data.header)
                continue
        twin = by_key.get(item.key) if item.key[0] else None
        if twin is not None:
            item.result = FileCheck(path, VALID, "", data.header, already=True)  # filled below
            items.append(item)
            continue
        if item.key[0]:
            by_key[item.key] = item
        items.append(item)

    store.ensure()
    graph = Graph.scan(store)
    lines: dict[str, str] = {}   # each line of the files given -> its new line in the store
    for item in _parents_first(items, by_key):
        if item.result is not None and item.result.already:
            continue   # a twin of another file in this batch
        results[item.path] = _import_one(item, store, graph, by_key, lines)
    for item in items:   # twins take their original's outcome
        if item.path not in results:
            first = by_key[item.key].result
            assert first is not None   # every original was imported by the loop above
            results[item.path] = replace(first, path=item.path, already=first.imported is not None)
    bring_back(store, {r.imported.name for r in results.values() if r.ok and r.imported is not None})
    _heads_for(store, results)
    return [results[p] for p in paths]


def _heads_for(store: Store, results: dict[Path, FileCheck]) -> None:
    """Step 5: each file imported (or found in the store) that is not in the chain of another
    one of the batch is a head afterwards; the result names the head of its state when
    that is another file."""
    names = {path: r.imported.name for path, r in results.items() if r.ok and r.imported is not None}
    if not names:
        return
    graph = Graph.scan(store)
    nodes = {path: graph.nodes.get(name) for path, name in names.items()}
    below = {n.name for node in nodes.values() if node is not None for n in graph.chain(node)[:-1]}
    written: dict[str, Path] = {}
    for path, node in nodes.items():
        if node is None or node.name in below or graph.is_head(node) or is_shared_line(node.line):
            continue
        result = results[path]
        try:
            head = written.get(node.name) or _listed_as(graph, node) or _write_head_on(store, node)
        except (OSError, CheckpointError) as exc:
            results[path] = replace(result, status=UNREADABLE, imported=None,
                                    reason=f"it is in the store as {node.name}, which is no head, and a "
                                           f"head could not be written on it: {exc}")
            continue
        written[node.name] = head
        results[path] = replace(result, head=head)


def _listed_as(graph: Graph, node) -> Path | None:
    """A head of ``node``'s conversation that holds exactly its state, on it (the one an
    earlier import wrote, say), or None."""
    state = (node.header.n_tokens, node.header.n_tokens_total, node.tokens_digest)
    return next((h.path for h in graph.heads_of(node.conversation_id)
                 if (h.header.n_tokens, h.header.n_tokens_total, h.tokens_digest) == state
                 and node in graph.chain(h)), None)


def _write_head_on(store: Store, node) -> Path:
    """A head for ``node`` (a graph Node): a delta of metadata only on it (no cells: the
    cache its chain gives, its conversation, tokens and logits), on a new line; a full
    file of no cells when it holds none.  Its rename waits under the store's lock for
    ``node`` to be still there, unchanged (a delete or prune runs under the same lock)."""
    data = read_checkpoint(node.path, load_state=False)
    if data.payload_crc != node.payload_crc:
        raise CheckpointError(f"{node.name} changed while it was being imported")
    h = data.header
    meta = {k: v for k, v in data.meta.items() if k not in ("parent", "points", "origin_crc", "recurrent_block")}
    meta.update(checkpoint_id=uuid.uuid4().hex, line=uuid.uuid4().hex, seq=1)
    header = replace(h, created_unix_ns=time.time_ns(), parent_n_tokens=0, flags=h.flags & ~FLAG_DELTA)
    if h.n_tokens:
        header = replace(header, flags=header.flags | FLAG_DELTA, parent_n_tokens=h.n_tokens)
        meta["parent"] = ParentRef(node.name, node.checkpoint_id or "", node.payload_crc, h.n_tokens).to_json()
    dest = (store.new_autosave_path(h.conversation_id) if h.kind == KIND_AUTOSAVE
            else store.new_path(h.title or node.path.stem, suffix="-imported"))

    def parent_unchanged() -> None:
        if stored_payload_crc(node.path) != node.payload_crc:
            raise CheckpointError(f"{node.name} was deleted or replaced meanwhile")

    with atomic_write(dest, precondition=parent_unchanged) as out:
        write_sections(out, header, encode_metadata(meta), data.tokens, data.logits, np.empty(0, np.uint8))
    return dest


def _parents_first(items: list[_Item], by_key: dict) -> list[_Item]:
    ordered, placed = [], set()

    def place(item: _Item, depth: int = 0) -> None:
        if id(item) in placed or depth > 1024:
            return
        if item.ref is not None:
            parent = by_key.get((item.ref.checkpoint_id, item.ref.payload_crc))
            if parent is not None and parent is not item:
                place(parent, depth + 1)
        placed.add(id(item))
        ordered.append(item)

    for item in items:
        place(item)
    return ordered


def _import_one(item: _Item, store: Store, graph: Graph, by_key: dict,
                lines: dict[str, str]) -> FileCheck:
    data, path = item.data, item.path
    h = data.header
    cid = data.meta.get("checkpoint_id")
    if store.contains(path):
        item.result = FileCheck(path, VALID, "", h, imported=path, already=True)
        item.dest, item.written_crc = path, data.payload_crc
        return item.result
    existing = graph.by_id(cid, data.payload_crc) if isinstance(cid, str) else None
    if existing is not None:
        item.result = FileCheck(path, VALID, "", h, imported=existing.path, already=True)
        item.dest, item.written_crc = existing.path, existing.payload_crc
        return item.result

    new_ref = None
    if item.ref is not None:
        found = _find_parent(item, item.ref, store, graph, by_key)
        if isinstance(found, FileCheck):
            item.result = found
            return found
        parent_name, parent_crc = found
        new_ref = replace(item.ref, file=parent_name, payload_crc=parent_crc)
    old_line = line_of(data.meta, h)
    # a shared prefix keeps its content address (it is nobody's history to compete with)
    line = old_line if is_shared_line(old_line) else lines.setdefault(old_line, uuid.uuid4().hex)

    dest = store.folder / path.name
    if dest.exists() or not path.name.endswith(EXTENSION) or path.name.startswith("."):
        dest = (store.new_autosave_path(h.conversation_id) if h.kind == KIND_AUTOSAVE
                else store.new_path(h.title or path.stem, suffix="-imported"))
    try:
        item.written_crc = _write_copy(path, dest, data, new_ref, line)
    except (OSError, CheckpointError) as exc:
        item.result = FileCheck(path, UNREADABLE, f"could not copy it into the store: {exc}", h)
        return item.result
    item.dest = dest
    item.result = FileCheck(path, VALID, "", h, imported=dest)
    return item.result


def _find_parent(item: _Item, ref: ParentRef, store: Store, graph: Graph,
                 by_key: dict) -> tuple[str, int] | FileCheck:
    """The parent's name and CRC in the store (imported in this batch or already there);
    ``ref`` is ``item``'s parent reference."""
    data = item.data
    sibling = by_key.get((ref.checkpoint_id, ref.payload_crc))
    if sibling is not None and sibling is not item:
        if sibling.dest is None:
            return FileCheck(item.path, MISSING_PARENT,
                             f"its parent {sibling.path.name} was not imported", data.header)
        problem = link_problem(facts_of(sibling.data), facts_of(data))
        if problem:
            return FileCheck(item.path, CORRUPT, problem, data.header)
        return sibling.dest.name, sibling.written_crc
    node = graph.by_id(ref.checkpoint_id, ref.payload_crc)
    if node is not None:
        facts = node.facts
        if node.origin_crc == ref.payload_crc:   # a relinked copy: it was that file
            facts = replace(facts, payload_crc=ref.payload_crc)
        problem = link_problem(facts, facts_of(data)) or graph.chain_problem(node)
        if problem:
            return FileCheck(item.path, MISSING_PARENT,
                             f"its parent is in the store as {node.name}, but cannot be used: {problem}",
                             data.header)
        return node.name, node.payload_crc
    beside = item.path.parent / ref.file
    folder = item.path.parent if beside.is_file() else None
    hint = (f"; import its chain from {folder} (Import its chain), or a compacted copy"
            if folder else "; import the folder it came from, or a compacted copy "
            "(checkpoint-chat compact, or Export in the app that made it)")
    return FileCheck(item.path, MISSING_PARENT,
                     f"it is a delta checkpoint and its parent {ref.file} is neither among the "
                     f"files given nor in the store{hint}", data.header, chain_folder=folder)


def _write_copy(src: Path, dest: Path, data: CheckpointData, new_ref: ParentRef | None,
                line: str) -> int:
    """Write ``src`` as ``dest`` with its store metadata (line, parent reference, origin
    CRC); returns the copy's payload CRC.  The temp file is verified in full before it
    becomes ``dest``, and it never replaces a file that took that name meanwhile."""
    full = read_checkpoint(src)   # the state too, verified again
    if full.payload_crc != data.payload_crc:
        raise CheckpointError(f"{src} changed while it was being imported")
    check_file_states(full)   # (and what its metadata says of them, which a restore trusts)
    meta = dict(full.meta)
    meta["line"] = line
    meta.setdefault("origin_crc", full.payload_crc)
    if new_ref is not None:
        meta["parent"] = new_ref.to_json()

    def name_still_free() -> None:
        if dest.exists():
            raise CheckpointError(f"{dest.name} was written by another process meanwhile")

    with atomic_write(dest, precondition=name_still_free) as out:
        _, crc = write_sections(out, full.header, encode_metadata(meta), full.tokens,
                                full.logits, full.state, point_states=(full.point_states,))
        out.flush()
        copy = read_checkpoint(out.name, load_state=False)
        if copy.payload_crc != crc or copy.meta.get("checkpoint_id") != data.meta.get("checkpoint_id"):
            raise CheckpointError(f"{dest.name} did not read back as written")
    return crc


def chain_paths(path: Path) -> list[Path]:
    """The files of ``path``'s chain in its own folder (for "Import folder")."""
    try:
        return [d.path for d in load_chain(path)]
    except (CheckpointError, OSError):
        return [path]


def export_copy(src: Path, dest: Path) -> Path:
    """Write a full checkpoint as ``dest`` (Export of a file that needs no compaction).

    The copy is a line of its own (as an import is): placed in a store folder, it can
    never compete with the history it came from."""
    full = read_checkpoint(src)
    if full.header.is_delta:
        raise CheckpointError(f"{src.name} is a delta: it is exported compacted, with its chain")
    meta = dict(full.meta)
    meta["line"] = uuid.uuid4().hex
    meta.pop("seq", None)
    with atomic_write(Path(dest)) as out:
        write_sections(out, full.header, encode_metadata(meta), full.tokens, full.logits, full.state,
                       point_states=(full.point_states,))
    return Path(dest)
