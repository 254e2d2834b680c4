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
        self._tail_start: int | None = None   # document position where the last message starts
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
            appendable = bool(self.messages) and not self._streaming and self._tail_start is not None
            self.messages.append(Message("user", user_text))
            self.messages.append(Message("assistant", "", complete=False))
            if appendable:
                # add to the end of the document instead of laying out the whole conversation again
                self._append_tail(len(self.messages) - 2, streaming=False)
                self._append_tail(len(self.messages) - 1, streaming=True)
                return
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
            if self._tail_start is not None:
                self._replace_tail(self._message_html(len(self.messages) - 1))
                self._streaming = False
                return
        self.render()

    def set_note(self, note: str) -> None:
        if self.messages and self.messages[-1].role == "assistant" and not self.messages[-1].complete:
            self.messages[-1].note = note
            if self._tail_start is not None and not self._streaming:
                self._replace_tail(self._message_html(len(self.messages) - 1))
            else:
                self.render()

    def answer_text(self) -> str:
        """The last assistant message's text (what a test compares)."""
        for m in reversed(self.messages):
            if m.role == "assistant":
                return m.text
        return ""

    # -- rendering ------------------------------------------------------------------------------
    # The last message is kept as the document's "tail" (from _tail_start to the end) so
    # that streaming, finishing or pausing an answer re-lays out only that message: a full
    # setHtml costs time in proportion to the whole conversation (tens of ms for a
    # 4,000-token prompt), which would show as a stall in the UI.
    def _colors(self) -> dict[str, str]:
        pal = self.palette()
        dark = pal.color(QPalette.ColorRole.Base).lightness() < 128
        return {"code_bg": "#2b2b2b" if dark else "#f2f2f2", "user_bg": "#26323f" if dark else "#eef3fa",
                "muted": pal.color(QPalette.ColorRole.PlaceholderText).name(),
                "accent": pal.color(QPalette.ColorRole.Link).name()}

    def _message_html(self, i: int, streaming: bool = False) -> str:
        c = self._colors()
        m = self.messages[i]
        copy = "" if streaming else f' &nbsp;<a href="copy:{i}" style="color:{c["accent"]};">Copy</a>'
        head = (f'<p style="margin-top:10px;"><b>{ROLE_LABELS[m.role]}</b>'
                f'<span style="color:{c["muted"]};">{copy}</span></p>')
        if streaming:
            # a plain paragraph the streamed text is appended to; Markdown comes at the end
            return head + f"<p>{html.escape(m.text)}</p>"
        body = to_html(m.text, c["code_bg"])
        if m.role == "user":
            body = (f'<table width="100%" cellpadding="6" style="background-color:{c["user_bg"]};">'
                    f"<tr><td>{body}</td></tr></table>")
        if not m.complete and m.role == "assistant":
            note = m.note or "Paused"
            body += f'<p style="color:{c["accent"]};"><b>‖ {html.escape(note)}</b></p>'
        return head + body

    def render(self, *, streaming: bool = False) -> None:
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self._tail_start = None
        if not self.messages:
            muted = self._colors()["muted"]
            self.setHtml(f'<p style="color:{muted};">{html.escape(self.placeholder)}</p>')
        else:
            last = len(self.messages) - 1
            self.setHtml("\n".join(self._message_html(i) for i in range(last)))
            self._append_tail(last, streaming=streaming)
        self._streaming = streaming
        if at_bottom or streaming:
            bar.setValue(bar.maximum())

    def _append_tail(self, index: int, *, streaming: bool) -> None:
        """Append message ``index`` at the end of the document; it becomes the tail."""
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if not self.document().isEmpty():
            cursor.insertBlock()
        self._tail_start = cursor.position()
        cursor.insertHtml(self._message_html(index, streaming))
        self._space_tail()
        self._streaming = streaming
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _replace_tail(self, html_text: str) -> None:
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._tail_start)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        cursor.insertHtml(html_text)
        self._space_tail()

    def _space_tail(self) -> None:
        # insertHtml merges its first paragraph into the block at the cursor and drops
        # that paragraph's top margin: put the gap between messages back
        cursor = QTextCursor(self.document())
        cursor.setPosition(self._tail_start)
        fmt = cursor.blockFormat()
        fmt.setTopMargin(10)
        cursor.setBlockFormat(fmt)

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
