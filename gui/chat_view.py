"""The chat transcript view and the prompt editor.

:class:`ChatView` keeps the messages as data (``messages``, the source of truth) and
writes them into its document with :mod:`gui.markdown`: per message a heading line
("You" / "Assistant" and a Copy link), the Markdown body, and under a paused answer a
note.  Code blocks carry their own Copy link.

Only the last message is ever rewritten.  Its places in the document are kept in a
:class:`_Tail`: streaming text into an answer, finishing, pausing, noting and resuming
it remove and write again the part from ``_Tail.body`` to the end, which holds the
answer's blocks that more text can still change (:func:`gui.markdown.stable_count`)
and the note.  Everything above stays as laid out, so the cost of a token does not grow
with the conversation or the answer.  :meth:`ChatView.render` writes everything again
(opening a conversation).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import (QColor, QDesktopServices, QFont, QGuiApplication, QKeyEvent, QPalette,
                           QTextBlockFormat, QTextCharFormat, QTextCursor, QTextFrameFormat)
from PySide6.QtWidgets import QPlainTextEdit, QTextBrowser

from gui.markdown import (LINK_SCHEMES, DocWriter, Theme, line_offset, parse, reset_block,
                          stable_count)

ROLE_LABELS = {"user": "You", "assistant": "Assistant"}
MESSAGE_LINK = "copy:"          # copy:<message>
CODE_LINK = "copy-code:"        # copy-code:<message>:<code block>
COPY_GAP = "  "


@dataclass
class Message:
    role: str
    text: str
    complete: bool = True
    note: str = ""          # e.g. "Paused · saved 1.2 MB"


@dataclass
class _Tail:
    """Where the document's last message lies, so that it can be rewritten in place."""

    index: int
    message: Message
    head_end: int           # where the heading line's Copy link starts
    body: int = -1          # from here to the end is rewritten; -1: never (a user message)
    offset: int = 0         # index in message.text of what is written from ``body``
    code: list[str] = field(default_factory=list)   # code blocks written above ``body``
    copy_len: int = 0       # characters of the heading's Copy link; 0 while it is hidden


class ChatView(QTextBrowser):
    """Read-only transcript.  ``messages`` is the source of truth; the document a view of it.

    Signals:
        copied(int): a message's text was put on the clipboard.
        code_copied(int, int): code block n of message i was put on the clipboard.
    """

    copied = Signal(int)
    code_copied = Signal(int, int)

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.setAccessibleName("Chat transcript")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.document().setUndoRedoEnabled(False)
        self.anchorClicked.connect(self._on_anchor_clicked)
        self.messages: list[Message] = []
        self.placeholder = "Type a message below and press Enter."
        self._streaming = False
        self._tail: _Tail | None = None
        self._code: dict[int, list[str]] = {}    # message index -> its code blocks

    # -- content ------------------------------------------------------------------------------
    def set_transcript(self, transcript, *, paused: bool = False, note: str = "") -> None:
        self.messages = [Message(m["role"], m["content"], bool(m.get("complete", True)))
                         for m in transcript if m.get("role") in ROLE_LABELS]
        if self.messages and not self.messages[-1].complete:
            self.messages[-1].note = note
        self._streaming = False
        self.render()

    def begin_answer(self, user_text: str | None = None) -> None:
        """Show the user's message (if new) and an answer that text will stream into.

        Without ``user_text`` a paused answer at the end goes on (resume).
        """
        if user_text is not None:
            self._append(Message("user", user_text))
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant" or user_text is not None:
            self._append(Message("assistant", "", complete=False), streaming=True)
            return
        last.note = ""
        if self._shows_tail(last) and not self._streaming:
            self._set_head_copy(False)
            self._streaming = True
            self._rewrite_tail()
        else:
            self.render(streaming=True)

    def append_text(self, delta: str) -> None:
        if not self.messages or self.messages[-1].role != "assistant":
            self._append(Message("assistant", "", complete=False), streaming=True)
        last = self.messages[-1]
        last.text += delta
        if not (self._streaming and self._shows_tail(last)):
            self.render(streaming=True)
            return
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        self._rewrite_tail()
        if at_bottom:
            bar.setValue(bar.maximum())

    def finish_answer(self, *, complete: bool, note: str = "") -> None:
        if self.messages and self.messages[-1].role == "assistant":
            last = self.messages[-1]
            last.complete = complete
            last.note = note
            if self._shows_tail(last):
                self._streaming = False
                self._set_head_copy(True)
                self._rewrite_tail()
                return
        self.render()

    def set_note(self, note: str) -> None:
        if self.messages and self.messages[-1].role == "assistant" and not self.messages[-1].complete:
            self.messages[-1].note = note
            if self._shows_tail(self.messages[-1]) and not self._streaming:
                self._rewrite_tail()
            else:
                self.render()

    def answer_text(self) -> str:
        """The last assistant message's text (what a test compares)."""
        for m in reversed(self.messages):
            if m.role == "assistant":
                return m.text
        return ""

    def code_blocks(self, index: int) -> list[str]:
        """The code blocks of message ``index`` as written (what each block's Copy copies)."""
        return list(self._code.get(index, []))

    # -- writing ------------------------------------------------------------------------------
    def _colors(self) -> dict[str, QColor]:
        pal = self.palette()
        dark = pal.color(QPalette.ColorRole.Base).lightness() < 128
        return {"user_bg": QColor("#26323f" if dark else "#eef3fa"),
                "muted": pal.color(QPalette.ColorRole.PlaceholderText),
                "accent": pal.color(QPalette.ColorRole.Link)}

    def render(self, *, streaming: bool = False) -> None:
        """Write the whole transcript again (the last message streaming if ``streaming``)."""
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        doc = self.document()
        doc.clear()
        doc.setUndoRedoEnabled(False)
        self._tail = None
        self._code = {}
        cursor = QTextCursor(doc)
        cursor.beginEditBlock()
        if not self.messages:
            muted = QTextCharFormat()
            muted.setForeground(self._colors()["muted"])
            cursor.insertText(self.placeholder, muted)
        else:
            last = len(self.messages) - 1
            for i in range(last):
                self._write_message(cursor, i, streaming=False)
            self._tail = self._write_message(cursor, last, streaming=streaming)
        cursor.endEditBlock()
        self._streaming = streaming
        if at_bottom or streaming:
            bar.setValue(bar.maximum())

    def _shows_tail(self, message: Message) -> bool:
        """Whether the document ends with ``message`` as the last of ``messages``, rewritable."""
        t = self._tail
        return (t is not None and t.message is message and t.index == len(self.messages) - 1
                and t.body >= 0)

    def _append(self, message: Message, *, streaming: bool = False) -> None:
        """Add a message; write it below the others unless the document is behind."""
        t = self._tail
        up_to_date = (t is not None and not self._streaming and t.index == len(self.messages) - 1
                      and t.message is self.messages[-1])
        self.messages.append(message)
        if not up_to_date:
            self.render(streaming=streaming)
            return
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        self._tail = self._write_message(cursor, len(self.messages) - 1, streaming=streaming)
        cursor.endEditBlock()
        self._streaming = streaming
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _write_message(self, cursor: QTextCursor, index: int, *, streaming: bool) -> _Tail:
        """Write message ``index`` at the end of the document (the cursor's place)."""
        m = self.messages[index]
        colors = self._colors()
        head = QTextBlockFormat()
        head.setTopMargin(10)
        head.setBottomMargin(4)
        bold = QTextCharFormat()
        bold.setFontWeight(QFont.Weight.Bold)
        _new_block(cursor, head, bold)
        cursor.insertText(ROLE_LABELS[m.role], bold)
        tail = _Tail(index, m, head_end=cursor.position())
        if not streaming:
            tail.copy_len = self._insert_copy(cursor, f"{MESSAGE_LINK}{index}")
        if m.role == "user":
            frame_fmt = QTextFrameFormat()
            frame_fmt.setBackground(colors["user_bg"])
            frame_fmt.setPadding(6)
            frame = cursor.insertFrame(frame_fmt)
            writer = DocWriter(cursor, Theme.from_palette(self.palette()),
                               lambda n: f"{CODE_LINK}{index}:{n}")
            writer.write(parse(m.text))
            self._code[index] = writer.code
            cursor.setPosition(frame.lastPosition() + 1)
            reset_block(cursor)
            return tail
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        tail.body = cursor.position()
        self._write_body(cursor, tail, streaming=streaming)
        return tail

    def _write_body(self, cursor: QTextCursor, tail: _Tail, *, streaming: bool) -> None:
        """Write the message from ``tail.offset`` on; move ``tail.body`` past what is final."""
        m = tail.message
        rest = m.text[tail.offset:]
        blocks = parse(rest)
        final = stable_count(blocks, rest)
        base = len(tail.code)
        writer = DocWriter(cursor, Theme.from_palette(self.palette()),
                           lambda n: f"{CODE_LINK}{tail.index}:{base + n}", streaming=streaming)
        writer.write(blocks[:final])
        if final:
            tail.code += writer.code
            tail.offset += line_offset(rest, blocks[final].line)
            writer.start_region()
            tail.body = cursor.position()
        written = len(writer.code)
        writer.write(blocks[final:])
        self._code[tail.index] = tail.code + writer.code[written:]
        if not streaming and m.role == "assistant" and not m.complete:
            colors = self._colors()
            note = QTextCharFormat()
            note.setForeground(colors["accent"])
            note.setFontWeight(QFont.Weight.Bold)
            block = QTextBlockFormat()
            block.setTopMargin(4)
            _new_block(cursor, block, note)
            cursor.insertText(f"‖ {m.note or 'Paused'}", note)

    def _rewrite_tail(self) -> None:
        """Remove the last message's part from ``body`` on and write it again."""
        t = self._tail
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        cursor.setPosition(t.body)
        cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        reset_block(cursor)
        self._write_body(cursor, t, streaming=self._streaming)
        cursor.endEditBlock()

    def _insert_copy(self, cursor: QTextCursor, href: str) -> int:
        """Insert a Copy link at the cursor; returns the characters it took."""
        link = QTextCharFormat()
        link.setAnchor(True)
        link.setAnchorHref(href)
        link.setForeground(self._colors()["accent"])
        cursor.insertText(COPY_GAP, QTextCharFormat())
        cursor.insertText("Copy", link)
        return len(COPY_GAP) + len("Copy")

    def _set_head_copy(self, shown: bool) -> None:
        t = self._tail
        if shown == bool(t.copy_len):
            return
        cursor = QTextCursor(self.document())
        cursor.setPosition(t.head_end)
        if shown:
            t.copy_len = self._insert_copy(cursor, f"{MESSAGE_LINK}{t.index}")
            t.body += t.copy_len
        else:
            cursor.setPosition(t.head_end + t.copy_len, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
            t.body -= t.copy_len
            t.copy_len = 0

    @Slot(QUrl)
    def _on_anchor_clicked(self, url: QUrl) -> None:
        target = url.toString()
        if target.startswith(CODE_LINK):
            index, number = (int(x) for x in target[len(CODE_LINK):].split(":"))
            code = self._code.get(index, [])
            if 0 <= number < len(code):
                QGuiApplication.clipboard().setText(code[number])
                self.code_copied.emit(index, number)
        elif target.startswith(MESSAGE_LINK):
            index = int(target[len(MESSAGE_LINK):])
            if 0 <= index < len(self.messages):
                QGuiApplication.clipboard().setText(self.messages[index].text)
                self.copied.emit(index)
        elif url.scheme().lower() in LINK_SCHEMES:
            QDesktopServices.openUrl(url)


def _new_block(cursor: QTextCursor, fmt: QTextBlockFormat, char_fmt: QTextCharFormat) -> None:
    """Start a block at the cursor (the end of the document), reusing an empty one."""
    if cursor.block().length() == 1:
        reset_block(cursor)
        cursor.setBlockFormat(fmt)
        cursor.setBlockCharFormat(char_fmt)
    else:
        cursor.insertBlock(fmt, char_fmt)


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
