"""The checkpoint browser: the store as conversations, heads and chains.

:func:`list_rows` (a worker thread) reads the store's graph (engine.checkpoints.graph:
headers, metadata and trailers, never states) and returns one top-level row per head —
what the user can resume — with the files its chain needs folded under it (a delta
shows its own size, the head the chain's total).  A conversation with several heads
(branches) gets a row of its own with its heads under it, each showing its last message
and its fork point: the first message where it differs from the conversation's other
branches, and the tokens it shares with them on disk (engine.branches reads the
transcripts).  Resume works on any row: a file, or a conversation's newest branch.  Files no head needs
(superseded, broken chains) and unreadable files follow, each with the reason.  Status is
"valid", "incompatible" (against the loaded model, with the reason), "corrupt" or
"broken"; Validate runs the full CRC check of a file's whole chain with progress.

The browser does no file work itself: it asks the main window, which owns the store,
the engine bridge and the background tasks.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import QModelIndex, QSortFilterProxyModel, Qt, Signal
from PySide6.QtGui import QBrush, QDragEnterEvent, QDropEvent, QPalette, QStandardItem, QStandardItemModel
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QTreeView,
    QVBoxLayout,
    QWidget,
)

from engine.branches import branches_of
from engine.checkpoints.compat import Target
from engine.checkpoints.format import KIND_NAMES, Header
from engine.checkpoints.graph import Graph, Node
from engine.checkpoints.store import Store
from gui.files import file_size_text, local_checkpoint_paths

HEAD, CHAIN, CONVERSATION, LOOSE, UNREADABLE = "head", "chain", "conversation", "loose", "unreadable"


@dataclass(frozen=True)
class Row:
    path: Path | None       # None for a conversation's group row
    size: int
    created: float
    header: Header | None
    status: str             # valid / incompatible / corrupt / broken / verified
    reason: str = ""
    role: str = HEAD        # head / chain / conversation / loose / unreadable
    model_name: str = ""
    chain_size: int = 0     # a head's chain, all files together
    chain_files: int = 1
    #: bytes of the chain that other heads hold too (a shared system prompt, a fork's
    #: common files): deleting this head does not free them (Graph.footprint)
    shared_size: int = 0
    children: tuple[Row, ...] = ()
    #: a branch: where it leaves the others ("message 3 (yours) · 120 tokens shared");
    #: a file of a branch's chain: "shared" when other branches build on it too
    fork: str = ""
    last_message: str = ""  # a branch: its last message, "You: …" / "Assistant: …"

    @property
    def title(self) -> str:
        if self.header is not None:
            return self.header.title or (self.path.stem if self.path else "")
        return self.path.name if self.path else ""

    @property
    def resumable(self) -> bool:
        return self.path is not None and self.header is not None and self.status in ("valid", "verified")


def _node_row(g: Graph, node: Node, target: Target | None, role: str, children=()) -> Row:
    reason = target.incompatibility(node.header) if target is not None else None
    status, why = ("incompatible", reason) if reason else ("valid", "")
    problem = g.chain_problem(node)
    if problem and role != CHAIN:
        status, why = "broken", problem
    elif role == LOOSE:
        why = why or "superseded: a newer head of this conversation holds its history"
    shared = g.footprint(node)[1] if role == HEAD else 0
    return Row(node.path, node.size, node.created_ns / 1e9, node.header, status, why, role,
               node.model_name, g.chain_size(node), len(g.chain(node)), shared, tuple(children))


def list_rows(store: Store, target: Target | None) -> list[Row]:
    """The store as rows (see the module docstring); any thread."""
    g = Graph.scan(store)
    by_conv: dict[uuid.UUID, list[Row]] = {}
    shown: set[str] = set()
    for head in g.heads:
        chain = g.chain(head)
        members = [_node_row(g, n, target, CHAIN) for n in reversed(chain[:-1])]
        shown.update(n.name for n in chain)
        by_conv.setdefault(head.conversation_id, []).append(_node_row(g, head, target, HEAD, members))
    rows: list[Row] = []
    for heads in by_conv.values():
        if len(heads) == 1:
            rows.append(heads[0])
            continue
        newest = heads[0]
        rows.append(Row(None, sum(h.chain_size for h in heads), newest.created, newest.header,
                        newest.status, f"{len(heads)} branches", CONVERSATION, newest.model_name,
                        children=tuple(_branch_rows(g, store, heads))))
    for node in sorted(g.nodes.values(), key=lambda n: n.created_ns, reverse=True):
        if node.name not in shown:
            rows.append(_node_row(g, node, target, LOOSE))
    for bad in g.unreadable:
        rows.append(Row(bad.path, bad.size, _mtime(bad.path), None, "corrupt", bad.error, UNREADABLE))
    return rows


def _branch_rows(g: Graph, store: Store, heads: list[Row]) -> list[Row]:
    """The heads of one conversation, each with its fork point and last message."""
    transcripts = {b.head.name: b.messages for b in branches_of(store, heads[0].header.conversation_id, g)}
    chains = {h.path.name: [n for n in g.chain(g.nodes[h.path.name])] for h in heads}
    out = []
    for h in heads:
        mine = transcripts.get(h.path.name, ())
        others = [o for o in heads if o is not h]
        shared = max((_common(mine, transcripts.get(o.path.name, ())) for o in others), default=0)
        on_others = {n.name for o in others for n in chains[o.path.name]}
        fork_node = next((n for n in reversed(chains[h.path.name]) if n.name in on_others), None)
        fork = _fork_text(mine, shared)
        if fork_node is not None:
            fork += f" · {fork_node.header.n_tokens:,} tokens shared"
        last = ""
        if mine:
            role, content = mine[-1]
            last = f"{_ROLE_NAMES.get(role, role)}: {' '.join(content.split())}"
        # in its folded chain, the files it shares with other branches
        members = tuple(replace(m, fork="the fork point (shared)" if fork_node is not None
                                and m.path.name == fork_node.name else "shared")
                        if m.path.name in on_others else m for m in h.children)
        out.append(replace(h, fork=fork, last_message=last, children=members))
    return out


_ROLE_NAMES = {"system": "System prompt", "user": "You", "assistant": "Assistant"}


def _common(a, b) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):    # the common prefix: the shorter one bounds it
        if x != y:
            break
        n += 1
    return n


def _fork_text(messages, shared: int) -> str:
    """Where a branch with ``messages`` leaves the others: its first message of its own."""
    if not messages:
        return ""
    if shared >= len(messages):
        return "the start of another branch"
    if messages[shared][0] == "system":
        return "the system prompt"
    number = shared + 1 - (1 if messages[0][0] == "system" else 0)
    what = {"user": "yours", "assistant": "the answer"}.get(messages[shared][0], messages[shared][0])
    return f"message {number} ({what})"


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _flatten(rows) -> list[Row]:
    out = []
    for row in rows:
        out.append(row)
        out += _flatten(row.children)
    return out


COLUMNS = ("Title", "Fork point", "Model", "Tokens", "Size", "Created", "Kind", "Status")
ROW_ROLE = Qt.ItemDataRole.UserRole + 1
SORT_ROLE = Qt.ItemDataRole.UserRole


class CheckpointTreeModel(QStandardItemModel):
    """Rows as a tree of QStandardItems; each item carries its Row (ROW_ROLE)."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setHorizontalHeaderLabels(list(COLUMNS))
        self.top_rows: list[Row] = []
        self.target: Target | None = None

    @property
    def rows(self) -> list[Row]:
        """Every file's row, top-level and folded, each file once (a file several branches'
        chains hold is folded under each of them: the summary counted it as often)."""
        unique: dict[Path, Row] = {}
        for row in _flatten(self.top_rows):
            if row.path is not None:
                unique.setdefault(row.path, row)
        return list(unique.values())

    def set_rows(self, rows: list[Row], target: Target | None) -> None:
        self.beginResetModel()
        self.blockSignals(True)
        self.removeRows(0, self.rowCount())
        self.top_rows, self.target = rows, target
        root = self.invisibleRootItem()
        for row in rows:
            self._append(root, row)
        self.blockSignals(False)
        self.endResetModel()

    def _append(self, parent: QStandardItem, row: Row) -> None:
        items = self._items(row)
        parent.appendRow(items)
        for child in row.children:
            self._append(items[0], child)

    def _model_name(self, row: Row) -> str:
        h = row.header
        if h is None:
            return "?"
        if self.target is not None and self.target.model is not None \
                and h.model_fingerprint == self.target.model.fingerprint:
            return self.target.model.name
        return row.model_name or f"other model ({h.model_fingerprint.hex()[:8]})"

    def _items(self, row: Row) -> list[QStandardItem]:
        h = row.header
        if row.role == HEAD and row.chain_files > 1:
            chain = file_size_text(row.chain_size)
            if row.shared_size:   # what deleting it frees, and what other heads hold too
                chain = (f"{file_size_text(row.chain_size - row.shared_size)} own + "
                         f"{file_size_text(row.shared_size)} shared")
            size = f"{file_size_text(row.size)} · chain {chain} ({row.chain_files} files)"
        else:
            size = file_size_text(row.size)
        kind = KIND_NAMES.get(h.kind, "?") if h else ""
        if row.role == CONVERSATION:
            title, kind = f"{row.title} — {row.reason}", "branches"
        elif row.role == CHAIN:
            title = row.path.name        # the head above says what it is; here, which file
        elif row.last_message:
            title = row.last_message     # a branch: the conversation's title is on the row above
        else:
            title = row.title
        role_note = {HEAD: "", CHAIN: " · in the chain", LOOSE: "", UNREADABLE: "",
                     CONVERSATION: ""}[row.role]
        status = (f"{row.status}{role_note}: {row.reason}" if row.reason and row.role != CONVERSATION
                  else f"{row.status}{role_note}")
        texts = (title, row.fork, self._model_name(row), f"{h.n_tokens_total:,}" if h else "", size,
                 time.strftime("%Y-%m-%d %H:%M", time.localtime(row.created)), kind, status)
        keys = (title.lower(), row.fork, self._model_name(row), h.n_tokens_total if h else -1,
                row.chain_size or row.size, row.created, h.kind if h else -1, row.status)
        tip = row.reason or (str(row.path) if row.path else "")
        if row.last_message:
            tip = (f"A branch of “{row.title}”\nFork point: {row.fork or '—'}\n"
                   f"Last message: {_excerpt(row.last_message)}\n{row.path}"
                   + (f"\n{row.reason}" if row.reason else ""))
        if row.shared_size:
            tip += (f"\nIts chain: {file_size_text(row.chain_size - row.shared_size)} its own (deleting it frees "
                    f"them), {file_size_text(row.shared_size)} shared with other conversations "
                    "(a common system prompt, a fork's earlier turns)")
        items = []
        for text, key in zip(texts, keys, strict=True):
            item = QStandardItem(text)
            item.setEditable(False)
            item.setData(key, SORT_ROLE)
            item.setData(row, ROW_ROLE)
            item.setToolTip(tip)
            if row.role in (CHAIN, LOOSE) or row.status in ("incompatible", "corrupt", "broken"):
                item.setForeground(QBrush(QPalette().color(QPalette.ColorGroup.Disabled,
                                                           QPalette.ColorRole.Text)))
            items.append(item)
        return items

    def update_row(self, path: Path, **changes) -> None:
        """Replace the Row of ``path`` (status after Validate, say) wherever it is shown."""
        def walk(parent: QStandardItem) -> None:
            for r in range(parent.rowCount()):
                first = parent.child(r, 0)
                row = first.data(ROW_ROLE)
                if row is not None and row.path == path:
                    for c, item in enumerate(self._items(replace(row, **changes))):
                        if c == 0:
                            _swap_keep_children(parent, r, item)   # keep its folded chain
                        else:
                            parent.setChild(r, c, item)
                walk(parent.child(r, 0))
        walk(self.invisibleRootItem())
        self.top_rows = [_replaced(r, path, changes) for r in self.top_rows]

    def index_of(self, path: Path) -> QModelIndex:
        def walk(parent: QStandardItem) -> QModelIndex:
            for r in range(parent.rowCount()):
                item = parent.child(r, 0)
                row = item.data(ROW_ROLE)
                if row is not None and row.path == path:
                    return item.index()
                found = walk(item)
                if found.isValid():
                    return found
            return QModelIndex()
        return walk(self.invisibleRootItem())


def _excerpt(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 1].rstrip() + "…"


def _swap_keep_children(parent: QStandardItem, r: int, item: QStandardItem) -> None:
    old = parent.child(r, 0)
    old.setText(item.text())
    for role in (SORT_ROLE, ROW_ROLE):
        old.setData(item.data(role), role)
    old.setToolTip(item.toolTip())


def _replaced(row: Row, path: Path, changes: dict) -> Row:
    children = tuple(_replaced(c, path, changes) for c in row.children)
    row = replace(row, children=children) if children != row.children else row
    return replace(row, **changes) if row.path == path else row


class CheckpointTable(QTreeView):
    """The tree; accepts dropped files (handed to ``files_dropped``)."""

    files_dropped = Signal(list)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("checkpointBrowser")
        self.setAccessibleName("Checkpoints")
        self.setAcceptDrops(True)
        self.setDragDropMode(QAbstractItemView.DragDropMode.DropOnly)
        self.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.setSortingEnabled(True)
        self.setAlternatingRowColors(True)
        self.setUniformRowHeights(True)
        self.setWordWrap(False)           # one line per checkpoint; the tooltip has the rest
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.header().setStretchLastSection(True)   # Status: the reasons matter most

    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()
        else:
            super().dragEnterEvent(event)

    def dragMoveEvent(self, event) -> None:
        if event.mimeData().hasUrls():
            event.acceptProposedAction()
        else:
            super().dragMoveEvent(event)

    def dropEvent(self, event: QDropEvent) -> None:
        paths = local_checkpoint_paths(event.mimeData().urls())
        if paths:
            event.acceptProposedAction()
            self.files_dropped.emit(paths)
        else:
            event.ignore()


class CheckpointBrowser(QWidget):
    """A window with the tree, a filter and the actions.

    Signals:
        resume_requested(Path), validate_requested(Path), rename_requested(Path),
        delete_requested(Path), export_requested(Path), reveal_requested(Path),
        refresh_requested(), files_dropped(list)
    """

    resume_requested = Signal(object)
    validate_requested = Signal(object)
    rename_requested = Signal(object)
    delete_requested = Signal(object)
    export_requested = Signal(object)
    reveal_requested = Signal(object)
    refresh_requested = Signal()
    files_dropped = Signal(list)

    def __init__(self, parent=None) -> None:
        super().__init__(parent, Qt.WindowType.Window)
        self.setWindowTitle("Checkpoints — Checkpoint Chat")
        self.resize(980, 480)
        self.model = CheckpointTreeModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(SORT_ROLE)
        self.proxy.setFilterKeyColumn(-1)
        self.proxy.setRecursiveFilteringEnabled(True)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.table = CheckpointTable(self)
        self.table.setModel(self.proxy)
        self.table.sortByColumn(COLUMNS.index("Created"), Qt.SortOrder.DescendingOrder)
        self.table.files_dropped.connect(self.files_dropped)
        self.table.doubleClicked.connect(self._on_double_clicked)
        self.table.expanded.connect(self._fit_columns)

        self.filter_edit = QLineEdit(self)
        self.filter_edit.setObjectName("checkpointFilter")
        self.filter_edit.setAccessibleName("Filter checkpoints")
        self.filter_edit.setPlaceholderText("Filter…")
        self.filter_edit.setClearButtonEnabled(True)
        self.filter_edit.textChanged.connect(self.proxy.setFilterFixedString)
        self.summary = QLabel(self)
        self.progress = QProgressBar(self)
        self.progress.setMaximumWidth(220)
        self.progress.hide()

        buttons = QHBoxLayout()
        self.buttons = {}
        for name, signal in (("Resume", self.resume_requested), ("Validate", self.validate_requested),
                             ("Rename…", self.rename_requested), ("Delete…", self.delete_requested),
                             ("Export…", self.export_requested), ("Show in folder", self.reveal_requested)):
            b = QPushButton(name, self)
            b.clicked.connect(lambda _=False, s=signal: self._emit_for_selected(s))
            buttons.addWidget(b)
            self.buttons[name] = b
        refresh = QPushButton("Refresh", self)
        refresh.clicked.connect(self.refresh_requested)
        buttons.addStretch(1)
        buttons.addWidget(refresh)

        top = QHBoxLayout()
        top.addWidget(self.filter_edit, 1)
        top.addWidget(self.progress)
        top.addWidget(self.summary)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(self.table, 1)
        layout.addLayout(buttons)
        hint = QLabel("Each row is a checkpoint you can resume; ▸ unfolds a conversation's branches "
                      "and the files a chain needs. "
                      "Drop .kvckpt files here to import them (the originals are not changed).", self)
        hint.setEnabled(False)
        hint.setWordWrap(True)
        layout.addWidget(hint)
        self.table.selectionModel().selectionChanged.connect(self._update_buttons)
        self._update_buttons()

    def set_rows(self, rows: list[Row], target: Target | None, seconds: float = 0.0) -> None:
        self.model.set_rows(rows, target)
        self.table.blockSignals(True)            # one fit below, not one per unfolded row
        for r in range(self.proxy.rowCount()):   # a conversation's branches are what it shows
            index = self.proxy.index(r, 0)
            row = self.proxy.mapToSource(index).data(ROW_ROLE)
            if row is not None and row.role == CONVERSATION:
                self.table.expand(index)
        self.table.blockSignals(False)
        self._fit_columns()
        files = self.model.rows
        heads = sum(1 for r in files if r.role == HEAD)
        total = sum(r.size for r in files)
        self.summary.setText(f"{heads} resumable · {len(files)} files · {file_size_text(total)}"
                             + (f" · listed in {seconds * 1000:.0f} ms" if seconds else ""))
        self._update_buttons()

    def _fit_columns(self, *_args) -> None:
        """Columns as wide as what is unfolded, within caps (Status takes the rest)."""
        for col in range(len(COLUMNS) - 1):
            self.table.resizeColumnToContents(col)
        for name, cap in (("Title", 300), ("Fork point", 260), ("Model", 150), ("Size", 240)):
            col = COLUMNS.index(name)
            if self.table.columnWidth(col) > cap:
                self.table.setColumnWidth(col, cap)

    def selected_row(self) -> Row | None:
        indexes = self.table.selectionModel().selectedRows()
        if not indexes:
            return None
        return self.proxy.mapToSource(indexes[0]).data(ROW_ROLE)

    def select_path(self, path: Path) -> bool:
        index = self.model.index_of(Path(path))
        if not index.isValid():
            return False
        view_index = self.proxy.mapFromSource(index)
        self.table.scrollTo(view_index)
        self.table.selectionModel().select(
            view_index, self.table.selectionModel().SelectionFlag.ClearAndSelect
            | self.table.selectionModel().SelectionFlag.Rows)
        return True

    def _emit_for_selected(self, signal) -> None:
        row = self.selected_row()
        if signal is self.resume_requested:
            row = _resume_target(row)
        if row is not None and row.path is not None:
            signal.emit(row.path)

    def _on_double_clicked(self, index: QModelIndex) -> None:
        row = self.proxy.mapToSource(index).data(ROW_ROLE)
        if row is not None and row.path is not None and row.resumable:   # a group row only unfolds
            self.resume_requested.emit(row.path)

    def _update_buttons(self, *_args) -> None:
        row = self.selected_row()
        for name, b in self.buttons.items():
            enabled = row is not None and row.path is not None
            if name == "Resume":
                target = _resume_target(row)
                enabled = target is not None and target.resumable
            elif name == "Rename…":
                enabled = enabled and row.header is not None
            b.setEnabled(enabled)


def _resume_target(row: Row | None) -> Row | None:
    """What Resume opens for a row: the row's file, or a conversation's newest branch."""
    if row is not None and row.path is None and row.children:
        return row.children[0]
    return row
