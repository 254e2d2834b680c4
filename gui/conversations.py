"""The conversation list: in-memory conversations and the ones saved in the store.

Each item carries the conversation id and, once it has one, its checkpoint path.  A
conversation found in the store but not yet opened is restored from that file when the
user selects it (the main window decides; this widget only shows and reports).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QListWidget, QListWidgetItem, QMenu

from engine.checkpoints.format import KIND_AUTOSAVE, KIND_EXIT, KIND_PAUSE
from engine.checkpoints.graph import Graph
from engine.checkpoints.store import Store

ID_ROLE = Qt.ItemDataRole.UserRole
PATH_ROLE = Qt.ItemDataRole.UserRole + 1
PAUSED_ROLE = Qt.ItemDataRole.UserRole + 2
#: Prefix of a paused conversation's title ("⏸" is missing from common UI fonts)
PAUSED_MARK = "‖ "


@dataclass(frozen=True)
class StoredConversation:
    id: uuid.UUID
    title: str
    path: Path
    created: float
    paused: bool


def stored_conversations(store: Store) -> list[StoredConversation]:
    """Each conversation's newest head in the store, newest first (any thread)."""
    seen: dict[uuid.UUID, StoredConversation] = {}
    for head in Graph.scan(store).heads:     # newest first
        if head.conversation_id in seen:
            continue
        seen[head.conversation_id] = StoredConversation(
            head.conversation_id, head.title, head.path, head.created_ns / 1e9,
            head.header.kind in (KIND_PAUSE, KIND_EXIT, KIND_AUTOSAVE))  # see EngineWorker._save
    return list(seen.values())


class ConversationList(QListWidget):
    """Signals: new_requested(), rename_requested(UUID), delete_requested(UUID)."""

    new_requested = Signal()
    rename_requested = Signal(object)
    delete_requested = Signal(object)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("conversationList")
        self.setAccessibleName("Conversations")
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.setMinimumWidth(180)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.setUniformItemSizes(True)

    def item_for(self, conv_id: uuid.UUID) -> QListWidgetItem | None:
        for i in range(self.count()):
            item = self.item(i)
            if item.data(ID_ROLE) == conv_id:
                return item
        return None

    def upsert(self, conv_id: uuid.UUID, title: str, *, path: Path | None = None,
               paused: bool | None = None, top: bool = False) -> QListWidgetItem:
        item = self.item_for(conv_id)
        if item is None:
            item = QListWidgetItem()
            item.setData(ID_ROLE, conv_id)
            if top:
                self.insertItem(0, item)
            else:
                self.addItem(item)
        if path is not None:
            item.setData(PATH_ROLE, str(path))
        if paused is not None:
            item.setData(PAUSED_ROLE, paused)
        is_paused = bool(item.data(PAUSED_ROLE))
        item.setText((PAUSED_MARK if is_paused else "") + title)
        item.setToolTip(title + (f"\n{item.data(PATH_ROLE)}" if item.data(PATH_ROLE) else ""))
        return item

    def remove(self, conv_id: uuid.UUID) -> None:
        item = self.item_for(conv_id)
        if item is not None:
            self.takeItem(self.row(item))

    def current_id(self) -> uuid.UUID | None:
        item = self.currentItem()
        return item.data(ID_ROLE) if item else None

    def path_of(self, conv_id: uuid.UUID) -> Path | None:
        item = self.item_for(conv_id)
        value = item.data(PATH_ROLE) if item else None
        return Path(value) if value else None

    def select(self, conv_id: uuid.UUID) -> None:
        item = self.item_for(conv_id)
        if item is not None and self.currentItem() is not item:
            self.blockSignals(True)   # selecting programmatically is not a user's request
            self.setCurrentItem(item)
            self.blockSignals(False)

    def _menu(self, pos) -> None:
        item = self.itemAt(pos)
        menu = QMenu(self)
        menu.addAction("New conversation", self.new_requested.emit)
        if item is not None:
            conv_id = item.data(ID_ROLE)
            menu.addAction("Rename…", lambda: self.rename_requested.emit(conv_id))
            menu.addAction("Delete…", lambda: self.delete_requested.emit(conv_id))
        menu.exec(self.viewport().mapToGlobal(pos))
