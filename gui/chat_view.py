"""The chat transcript view and the prompt editor.

:class:`ChatView` keeps the messages as data and renders them as HTML (Markdown per
message, a Copy link per message, a "paused" badge on an unfinished answer).  While an
answer streams, new text is appended at the end of the document with a text cursor
instead of re-rendering: a full render costs time proportional to the whole
conversation, an append only to the new text.  The answer is rendered properly once it
stops.
"""

from __future__ import annotations

import html
from dataclasses import dataclass

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import QGuiApplication, QKeyEvent, QPalette, QTextCursor
from PySide6.QtWidgets import QPlainTextEdit, QTextBrowser

from gui.markdown import to_html

ROLE_LABELS = {"user": "You", "assistant": "Assistant"}


@dataclass
class Message:
    role: str
    text: str
    complete: bool = True
    note: str = ""          # e.g. "Paused · saved 1.2 MB"


class ChatView(QTextBrowser):
    """Read-only transcript.  ``messages`` is the source of truth; the document a view of it."""

    copied = Signal(int)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setAccessibleName("Chat transcript")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor_clicked)
        self.messages: list[Message] = []
        self._streaming = False
        self.placeholder = "Type a message below and press Enter."

    # -- content ------------------------------------------------------------------------------
    def set_transcript(self, transcript, *, paused: bool = False, note: str = "") -> None:
        self.messages = [Message(m["role"], m["content"], bool(m.get("complete", True)))
                         for m in transcript if m.get("role") in ROLE_LABELS]
        if self.messages and not self.messages[-1].complete:
            self.messages[-1].note = note
        self._streaming = False
        self.render()

    def begin_answer(self, user_text: str | None = None) -> None:
        """Show the user's message (if new) and an empty answer that text will stream into."""
        if user_text is not None:
            self.messages.append(Message("user", user_text))
            self.messages.append(Message("assistant", "", complete=False))
        elif not self.messages or self.messages[-1].role != "assistant":
            self.messages.append(Message("assistant", "", complete=False))
        self.messages[-1].note = ""
        self.render(streaming=True)

    def append_text(self, delta: str) -> None:
        if not self.messages or self.messages[-1].role != "assistant":
            self.messages.append(Message("assistant", "", complete=False))
            self.render(streaming=True)
        self.messages[-1].text += delta
        if not self._streaming:
            self.render(streaming=True)
            return
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertText(delta)
        if at_bottom:
            bar.setValue(bar.maximum())

    def finish_answer(self, *, complete: bool, note: str = "") -> None:
        if self.messages and self.messages[-1].role == "assistant":
            self.messages[-1].complete = complete
            self.messages[-1].note = note
        self.render()

    def set_note(self, note: str) -> None:
        if self.messages and self.messages[-1].role == "assistant" and not self.messages[-1].complete:
            self.messages[-1].note = note
            self.render()

    def answer_text(self) -> str:
        """The last assistant message's text (what a test compares)."""
        for m in reversed(self.messages):
            if m.role == "assistant":
                return m.text
        return ""

    # -- rendering ------------------------------------------------------------------------------
    def render(self, *, streaming: bool = False) -> None:
        pal = self.palette()
        dark = pal.color(QPalette.ColorRole.Base).lightness() < 128
        code_bg = "#2b2b2b" if dark else "#f2f2f2"
        muted = pal.color(QPalette.ColorRole.PlaceholderText).name()
        accent = pal.color(QPalette.ColorRole.Link).name()
        user_bg = "#26323f" if dark else "#eef3fa"
        parts = []
        if not self.messages:
            parts.append(f'<p style="color:{muted};">{html.escape(self.placeholder)}</p>')
        for i, m in enumerate(self.messages):
            last_streaming = streaming and i == len(self.messages) - 1
            label = ROLE_LABELS[m.role]
            copy = "" if last_streaming else f' &nbsp;<a href="copy:{i}" style="color:{accent};">Copy</a>'
            parts.append(f'<p style="margin-top:10px;"><b>{label}</b>'
                         f'<span style="color:{muted};">{copy}</span></p>')
            if last_streaming:
                # plain paragraph the streamed text is appended to; Markdown comes at the end
                parts.append(f"<p>{html.escape(m.text)}")
                continue
            body = to_html(m.text, code_bg)
            if m.role == "user":
                body = (f'<table width="100%" cellpadding="6" style="background-color:{user_bg};">'
                        f"<tr><td>{body}</td></tr></table>")
            parts.append(body)
            if not m.complete and m.role == "assistant":
                note = m.note or "Paused"
                parts.append(f'<p style="color:{accent};"><b>‖ {html.escape(note)}</b></p>')
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self.setHtml("\n".join(parts))
        self._streaming = streaming
        if at_bottom or streaming:
            bar.setValue(bar.maximum())

    @Slot(QUrl)
    def _on_anchor_clicked(self, url: QUrl) -> None:
        target = url.toString()
        if target.startswith("copy:"):
            index = int(target[5:])
            if 0 <= index < len(self.messages):
                QGuiApplication.clipboard().setText(self.messages[index].text)
                self.copied.emit(index)


class PromptEdit(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("promptEdit")
        self.setAccessibleName("Message")
        self.setPlaceholderText("Message the model… (Enter sends, Shift+Enter: new line)")
        self.setTabChangesFocus(True)
        line = self.fontMetrics().lineSpacing()
        self.setFixedHeight(line * 4 + 12)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and \
                not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)
