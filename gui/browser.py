"""The checkpoint browser: every file in the store, from headers alone.

The table is filled by :func:`list_rows` on a worker thread (256 bytes read per file,
so a thousand checkpoints list in well under a second) and shown through a sort/filter
proxy.  Status is "valid", "incompatible" (with the reason, against the loaded model)
or "corrupt" (with the reason); Validate runs the full CRC check with progress.  The
browser does no file work itself: it asks the main window, which owns the store, the
engine bridge and the background tasks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from PySide6.QtCore import (QAbstractTableModel, QModelIndex, QSortFilterProxyModel, Qt, Signal)
from PySide6.QtGui import QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import (QAbstractItemView, QHBoxLayout, QLabel, QLineEdit,
                               QProgressBar, QPushButton, QTableView, QVBoxLayout, QWidget)

from engine.checkpoint_format import KIND_NAMES, Header
from engine.store import Store
from engine.worker import ModelInfo
from gui.importer import file_size_text, local_checkpoint_paths


@dataclass(frozen=True)
class Row:
    path: Path
    size: int
    created: float
    header: Header | None
    status: str           # valid / incompatible / corrupt / verified
    reason: str = ""

    @property
    def title(self) -> str:
        return self.header.title if self.header else self.path.name


def list_rows(store: Store, model: ModelInfo | None) -> list[Row]:
    """Headers of every checkpoint, with their status against ``model`` (worker thread)."""
    rows = []
    for e in store.entries():
        if e.header is None:
            rows.append(Row(e.path, e.size, e.created, None, "corrupt", e.error or ""))
            continue
        reason = model.incompatibility(e.header) if model is not None else None
        rows.append(Row(e.path, e.size, e.created, e.header,
                        "incompatible" if reason else "valid", reason or ""))
    return rows


COLUMNS = ("Title", "Model", "Tokens", "Size", "Created", "Kind", "Status")


class CheckpointTableModel(QAbstractTableModel):
    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.rows: list[Row] = []
        self.model_info: ModelInfo | None = None

    def set_rows(self, rows: list[Row], model_info: ModelInfo | None) -> None:
        self.beginResetModel()
        self.rows = rows
        self.model_info = model_info
        self.endResetModel()

    def update_row(self, path: Path, **changes) -> None:
        for i, row in enumerate(self.rows):
            if row.path == path:
                self.rows[i] = replace(row, **changes)
                self.dataChanged.emit(self.index(i, 0), self.index(i, len(COLUMNS) - 1))

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation == Qt.Orientation.Horizontal and role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section]
        return None

    def _model_name(self, h: Header | None) -> str:
        if h is None:
            return "?"
        info = self.model_info
        if info is not None and info._compat is not None and h.model_fingerprint == info._compat.fingerprint:
            return info.name
        return f"other model ({h.model_fingerprint.hex()[:8]})"

    def data(self, index: QModelIndex, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        col = index.column()
        h = row.header
        if role == Qt.ItemDataRole.UserRole:  # sort keys
            return (row.title.lower(), self._model_name(h), h.n_tokens_total if h else -1, row.size,
                    row.created, h.kind if h else -1, row.status)[col]
        if role == Qt.ItemDataRole.ToolTipRole:
            return row.reason or str(row.path)
        if role != Qt.ItemDataRole.DisplayRole:
            return None
        if col == 0:
            return row.title
        if col == 1:
            return self._model_name(h)
        if col == 2:
            return f"{h.n_tokens_total:,}" if h else ""
        if col == 3:
            return file_size_text(row.size)
        if col == 4:
            return time.strftime("%Y-%m-%d %H:%M", time.localtime(row.created))
        if col == 5:
            return KIND_NAMES.get(h.kind, "?") if h else ""
        return f"{row.status}: {row.reason}" if row.reason else row.status


class CheckpointTable(QTableView):
    """The table; accepts dropped files (handed to ``files_dropped``)."""

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
        self.setWordWrap(False)           # one line per checkpoint; the tooltip has the rest
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.verticalHeader().hide()
        self.horizontalHeader().setStretchLastSection(True)   # Status: the reasons matter most

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
    """A window with the table, a filter and the actions.

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
        self.resize(900, 460)
        self.model = CheckpointTableModel(self)
        self.proxy = QSortFilterProxyModel(self)
        self.proxy.setSourceModel(self.model)
        self.proxy.setSortRole(Qt.ItemDataRole.UserRole)
        self.proxy.setFilterKeyColumn(-1)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.table = CheckpointTable(self)
        self.table.setModel(self.proxy)
        self.table.sortByColumn(4, Qt.SortOrder.DescendingOrder)
        self.table.files_dropped.connect(self.files_dropped)
        self.table.doubleClicked.connect(lambda _i: self._emit_for_selected(self.resume_requested))

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
        hint = QLabel("Drop .kvckpt files here to import them (the originals are not changed).", self)
        hint.setEnabled(False)
        layout.addWidget(hint)
        self.table.selectionModel().selectionChanged.connect(self._update_buttons)
        self._update_buttons()

    def set_rows(self, rows: list[Row], model_info: ModelInfo | None, seconds: float = 0.0) -> None:
        self.model.set_rows(rows, model_info)
        self.table.resizeColumnsToContents()
        for col, cap in ((0, 230), (1, 170)):
            if self.table.columnWidth(col) > cap:
                self.table.setColumnWidth(col, cap)
        total = sum(r.size for r in rows)
        self.summary.setText(f"{len(rows)} checkpoints · {file_size_text(total)}"
                             + (f" · listed in {seconds * 1000:.0f} ms" if seconds else ""))
        self._update_buttons()

    def selected_row(self) -> Row | None:
        indexes = self.table.selectionModel().selectedRows()
        if not indexes:
            return None
        return self.model.rows[self.proxy.mapToSource(indexes[0]).row()]

    def select_path(self, path: Path) -> bool:
        for i, row in enumerate(self.model.rows):
            if row.path == path:
                self.table.selectRow(self.proxy.mapFromSource(self.model.index(i, 0)).row())
                return True
        return False

    def _emit_for_selected(self, signal) -> None:
        row = self.selected_row()
        if row is not None:
            signal.emit(row.path)

    def _update_buttons(self, *_args) -> None:
        row = self.selected_row()
        for name, b in self.buttons.items():
            enabled = row is not None
            if name == "Resume":
                enabled = row is not None and row.status in ("valid", "verified")
            b.setEnabled(enabled)
