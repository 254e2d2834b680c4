"""The conversation list: in-memory conversations and the ones saved in the store.

Each item carries the conversation id and, once it has one, its checkpoint path.  A
conversation found in the store but not yet opened is restored from that file when the
user selects it (the main window decides; this widget only shows and reports).

A stored conversation's item also keeps its newest head's header and the name of the
model that made it.  Against the loaded model (:meth:`ConversationList.set_target`, the
one rule of engine.checkpoints.compat) an item whose state does not fit gets its
``problem``, and one made with another model shows that model's name, dimmed: opening
it cannot restore its state, and the window offers something else instead.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QRect, Qt, Signal
from PySide6.QtGui import QFont, QFontMetrics, QPalette
from PySide6.QtWidgets import QListWidget, QListWidgetItem, QMenu, QStyle, QStyledItemDelegate, QStyleOptionViewItem

from engine.checkpoints.compat import Target
from engine.checkpoints.format import KIND_AUTOSAVE, KIND_EXIT, KIND_PAUSE, Header
from engine.checkpoints.graph import Graph
from engine.checkpoints.store import Store
from engine.errors import IncompatibleModel

ID_ROLE = Qt.ItemDataRole.UserRole
PATH_ROLE = Qt.ItemDataRole.UserRole + 1
PAUSED_ROLE = Qt.ItemDataRole.UserRole + 2
HEADER_ROLE = Qt.ItemDataRole.UserRole + 3     # the stored head's Header (not opened yet)
MODEL_ROLE = Qt.ItemDataRole.UserRole + 4      # the name of the model that made that head
OTHER_MODEL_ROLE = Qt.ItemDataRole.UserRole + 5    # that name, when it is not the loaded model
PROBLEM_ROLE = Qt.ItemDataRole.UserRole + 6    # why that head cannot be restored here, or None
ANSWERING_ROLE = Qt.ItemDataRole.UserRole + 7  # an answer is running in it
TITLE_ROLE = Qt.ItemDataRole.UserRole + 8      # the title, without the marks below
#: Prefix of a paused conversation's title ("⏸" is missing from common UI fonts)
PAUSED_MARK = "‖ "
#: Prefix of a conversation whose answer is running (in the background or shown)
ANSWERING_MARK = "● "


@dataclass(frozen=True)
class StoredConversation:
    id: uuid.UUID
    title: str
    path: Path
    created: float
    paused: bool
    header: Header | None = None
    model_name: str = ""         # as its metadata names the model that made it


def stored_conversations(store: Store) -> list[StoredConversation]:
    """Each conversation's newest head in the store, newest first (any thread)."""
    seen: dict[uuid.UUID, StoredConversation] = {}
    for head in Graph.scan(store).heads:     # newest first
        if head.conversation_id in seen:
            continue
        seen[head.conversation_id] = StoredConversation(
            head.conversation_id, head.title, head.path, head.created_ns / 1e9,
            head.header.kind in (KIND_PAUSE, KIND_EXIT, KIND_AUTOSAVE),  # see EngineWorker._save
            head.header, head.model_name)
    return list(seen.values())


class _Delegate(QStyledItemDelegate):
    """Draws an item as usual, and the name of the other model that made it dimmed at its right."""

    def paint(self, painter, option, index) -> None:
        other = index.data(OTHER_MODEL_ROLE)
        if not other:
            super().paint(painter, option, index)
            return
        opt = QStyleOptionViewItem(option)
        self.initStyleOption(opt, index)
        font = QFont(opt.font)
        font.setItalic(True)
        tag_metrics = QFontMetrics(font)
        room = opt.rect.width() - 12
        tag = tag_metrics.elidedText(other, Qt.TextElideMode.ElideRight, max(24, room // 2))
        tag_width = tag_metrics.horizontalAdvance(tag) + 10
        opt.text = opt.fontMetrics.elidedText(opt.text, Qt.TextElideMode.ElideRight,
                                              max(0, room - tag_width))
        style = opt.widget.style() if opt.widget is not None else None
        if style is None:
            super().paint(painter, option, index)
            return
        style.drawControl(QStyle.ControlElement.CE_ItemViewItem, opt, painter, opt.widget)
        painter.save()
        painter.setFont(font)
        group = (QPalette.ColorGroup.Normal if opt.state & QStyle.StateFlag.State_Selected
                 else QPalette.ColorGroup.Disabled)
        role = (QPalette.ColorRole.HighlightedText if opt.state & QStyle.StateFlag.State_Selected
                else QPalette.ColorRole.Text)
        painter.setPen(opt.palette.color(group, role))
        rect = QRect(opt.rect)
        rect.setRight(rect.right() - 6)
        painter.drawText(rect, int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter), tag)
        painter.restore()


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
        self.setItemDelegate(_Delegate(self))
        self.target: Target | None = None     # what checkpoints must fit (the loaded model)

    def item_for(self, conv_id: uuid.UUID) -> QListWidgetItem | None:
        for i in range(self.count()):
            item = self.item(i)
            if item.data(ID_ROLE) == conv_id:
                return item
        return None

    def upsert(self, conv_id: uuid.UUID, title: str, *, path: Path | None = None,
               paused: bool | None = None, top: bool = False, header: Header | None = None,
               model_name: str = "", opened: bool = False) -> QListWidgetItem:
        """Add or update an item.  ``header`` and ``model_name``: of its stored head (a
        conversation listed from the store); ``opened``: the engine has it open (with the
        loaded model), so no stored head's mark applies."""
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
        if header is not None:
            item.setData(HEADER_ROLE, header)
            item.setData(MODEL_ROLE, model_name)
        elif opened:
            item.setData(HEADER_ROLE, None)
        item.setData(TITLE_ROLE, title)
        self._label(item)
        self._mark(item)
        return item

    @staticmethod
    def _label(item: QListWidgetItem) -> None:
        mark = ANSWERING_MARK if item.data(ANSWERING_ROLE) else PAUSED_MARK if item.data(PAUSED_ROLE) else ""
        item.setText(mark + (item.data(TITLE_ROLE) or ""))

    def set_answering(self, conv_ids) -> None:
        """Mark the conversations whose answers are running (and only those)."""
        for i in range(self.count()):
            item = self.item(i)
            answering = item.data(ID_ROLE) in conv_ids
            if bool(item.data(ANSWERING_ROLE)) != answering:
                item.setData(ANSWERING_ROLE, answering)
                self._label(item)

    def set_target(self, target: Target | None) -> None:
        """Mark again every stored conversation against what checkpoints must now fit."""
        self.target = target
        for i in range(self.count()):
            self._mark(self.item(i))

    def _mark(self, item: QListWidgetItem) -> None:
        header = item.data(HEADER_ROLE)
        problem = self.target.problem(header) if header is not None and self.target is not None else None
        other = ""
        if isinstance(problem, IncompatibleModel):
            other = item.data(MODEL_ROLE) or "another model"
        item.setData(OTHER_MODEL_ROLE, other)
        item.setData(PROBLEM_ROLE, str(problem) if problem is not None else None)
        title = item.data(TITLE_ROLE) or ""
        path = item.data(PATH_ROLE)
        tip = title + (f"\n{path}" if path else "")
        if other:
            tip += (f"\nMade with {other}, not the loaded model: opening it shows its transcript "
                    f"and offers to load {other} or to go on with the loaded model.")
        elif problem is not None:
            tip += f"\nIt cannot be restored here: {problem}"
        item.setToolTip(tip)

    def remove(self, conv_id: uuid.UUID) -> None:
        item = self.item_for(conv_id)
        if item is not None:
            self.takeItem(self.row(item))

    def title_of(self, conv_id: uuid.UUID) -> str:
        item = self.item_for(conv_id)
        return (item.data(TITLE_ROLE) or "") if item else ""

    def current_id(self) -> uuid.UUID | None:
        item = self.currentItem()
        return item.data(ID_ROLE) if item else None

    def path_of(self, conv_id: uuid.UUID) -> Path | None:
        item = self.item_for(conv_id)
        value = item.data(PATH_ROLE) if item else None
        return Path(value) if value else None

    def other_model(self, conv_id: uuid.UUID) -> str:
        """The name of the other model that made this stored conversation, or ""."""
        item = self.item_for(conv_id)
        return (item.data(OTHER_MODEL_ROLE) or "") if item else ""

    def problem_of(self, conv_id: uuid.UUID) -> str | None:
        """Why this stored conversation's head cannot be restored into the loaded model."""
        item = self.item_for(conv_id)
        return item.data(PROBLEM_ROLE) if item else None

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
