"""The chat transcript view, the prompt editor, the message editor and the offer bar.

:class:`ChatView` keeps the messages as data (``messages``, the source of truth) and
writes them into its document with :mod:`gui.markdown`: per message a heading line
("System prompt" / "You" / "Assistant", the ``‹ k/n ›`` switcher of a message that has
alternatives, and its actions: Copy, Edit, Continue, Fork), the Markdown body, and under
a paused answer a note.  Code blocks carry their own Copy link.  The view only reports
a click on an action (its signals); the main window decides what it does.

Only the last message is ever rewritten.  Its places in the document are kept in a
:class:`_Tail`: streaming text into an answer, finishing, pausing, noting and resuming
it remove and write again the part from ``_Tail.body`` to the end, which holds the
answer's blocks that more text can still change (:func:`gui.markdown.stable_count`)
and the note; its heading's links (hidden while it streams) are rewritten in place.
A message added below the last answer takes that answer's Continue away the same way.
Everything above stays as laid out, so the cost of a token does not grow with the
conversation or the answer.  :meth:`ChatView.render` writes everything again (opening a
conversation, switching to another branch).

A thinking model's answer (``thinking``: the model's engine.reasoning.ThinkFormat) keeps
the text the model wrote; the view shows its parts (engine.reasoning.split): above the
answer a toggle, "Thinking… (n words)" while the model thinks, then "Show thinking" —
a click shows the thinking, muted, between the toggle and the answer.  While the model
thinks the toggle is part of the rewritten tail; once the answer begins it is final and
the tail starts below it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import Qt, QUrl, Signal, Slot
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFont,
    QGuiApplication,
    QKeyEvent,
    QPalette,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFrameFormat,
)
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
)

from engine.reasoning import ThinkFormat, split
from gui.markdown import LINK_SCHEMES, DocWriter, Theme, line_offset, parse, reset_block, stable_count

ROLE_LABELS = {"system": "System prompt", "user": "You", "assistant": "Assistant"}
MESSAGE_LINK = "copy:"          # copy:<message>
CODE_LINK = "copy-code:"        # copy-code:<message>:<code block>
EDIT_LINK = "edit:"             # edit:<message>
FORK_LINK = "fork:"             # fork:<message>
CONTINUE_LINK = "continue:"     # continue:<message>
ALTERNATIVE_LINK = "alt:"       # alt:<message>:<alternative, 1-based>
EXPAND_LINK = "expand:"         # expand:<message>
THINKING_LINK = "thinking:"     # thinking:<message>: show or hide an answer's thinking
#: A message of yours longer than this is shown folded to its first FOLDED_CHARS, with
#: "Show all": a pasted document then takes a few lines instead of screens, and laying out
#: tens of thousands of characters (~20 ms for 18,000 on this machine) does not stall the
#: window when it is sent or switched to (issue 13: no stall above 16 ms)
FOLD_ABOVE_CHARS = 4000
FOLDED_CHARS = 1500
COPY_GAP = "  "
LINK_GAP = " · "


@dataclass
class Message:
    role: str
    text: str
    complete: bool = True
    note: str = ""          # e.g. "Paused · saved 1.2 MB"
    #: engine.branches.Alternatives (alternative ``index`` of ``count``, ``heads``) when
    #: the message has others; None when it is the only one
    alternatives: Any = None
    expanded: bool = False  # a long message of the user's shown whole (see FOLD_ABOVE_CHARS)
    thinking_shown: bool = False   # an answer's thinking shown (a click on its toggle)

    @property
    def folded(self) -> bool:
        return self.role == "user" and not self.expanded and len(self.text) > FOLD_ABOVE_CHARS


def _shown(alternatives) -> Any:
    """Alternatives worth a switcher (two or more), else None."""
    return alternatives if alternatives is not None and alternatives.count > 1 else None


def _numbers(alternatives) -> tuple[int, int] | None:
    return (alternatives.index, alternatives.count) if alternatives is not None else None


@dataclass
class _Tail:
    """Where the document's last message lies, so that it can be rewritten in place."""

    index: int
    message: Message
    head_end: int           # where the heading line's links start
    body: int = -1          # from here to the end is rewritten; -1: never (not an answer)
    offset: int = 0         # index in message.text of what is written from ``body``
    code: list[str] = field(default_factory=list)   # code blocks written above ``body``
    links_len: int = 0      # characters of the heading's links; 0 while they are hidden
    thinking_done: bool = False   # the thinking toggle is written above ``body``, final


class ChatView(QTextBrowser):
    """Read-only transcript.  ``messages`` is the source of truth; the document a view of it.

    Message indexes are indexes into ``messages``, which hold the transcript's entries
    one for one (the system prompt's too), so they are the transcript's indexes.

    Signals:
        copied(int): a message's text was put on the clipboard.
        code_copied(int, int): code block n of message i was put on the clipboard.
        edit_requested(int): Edit was clicked on message i (a user message, the system prompt).
        fork_requested(int): Fork was clicked on message i.
        continue_requested(int): Continue was clicked on the last answer, message i.
        alternative_requested(int, int): ‹ or › was clicked on message i: show alternative j
            (1-based, of ``messages[i].alternatives``).
    """

    copied = Signal(int)
    code_copied = Signal(int, int)
    edit_requested = Signal(int)
    fork_requested = Signal(int)
    continue_requested = Signal(int)
    alternative_requested = Signal(int, int)

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
        #: Edit, Fork, Continue and the switchers shown (False: a transcript read from a
        #: file, of a conversation the engine does not have open)
        self.actions = True
        self._streaming = False
        self._tail: _Tail | None = None
        self._code: dict[int, list[str]] = {}    # message index -> its code blocks
        #: how the loaded model marks its thinking (engine.reasoning); None: it does not think
        self.thinking: ThinkFormat | None = None

    def set_thinking_format(self, fmt: ThinkFormat | None) -> None:
        """The loaded model's thinking format: answers are shown in their parts by it."""
        if fmt != self.thinking:
            self.thinking = fmt
            self.render(streaming=self._streaming)

    # -- content ------------------------------------------------------------------------------
    def set_transcript(self, transcript, *, paused: bool = False, note: str = "",
                       alternatives=(), actions: bool = True) -> None:
        """Show ``transcript`` (dicts: role, content, complete); ``alternatives`` is aligned
        with it (ConversationSnapshot.alternatives)."""
        alternatives = tuple(alternatives)
        self.messages = [Message(m["role"], m["content"], bool(m.get("complete", True)),
                                 alternatives=_shown(alternatives[i] if i < len(alternatives) else None))
                         for i, m in enumerate(transcript) if m.get("role") in ROLE_LABELS]
        if self.messages and not self.messages[-1].complete:
            self.messages[-1].note = note
        self.actions = actions
        self._streaming = False
        self.render()

    def set_alternatives(self, alternatives) -> bool:
        """Take each message's alternatives (aligned with ``messages``); False, changing
        nothing, when they do not align.  When only the last message's switcher changed
        (an answer regenerated) only its heading is written again, else everything."""
        alternatives = tuple(alternatives)
        if len(alternatives) != len(self.messages):
            return False
        changed = [i for i, (m, a) in enumerate(zip(self.messages, alternatives, strict=True))
                   if _numbers(m.alternatives) != _numbers(_shown(a))]
        for m, a in zip(self.messages, alternatives, strict=True):
            m.alternatives = _shown(a)       # the heads may differ where the numbers do not
        t = self._tail
        if not changed:
            return True
        if changed == [len(self.messages) - 1] and t is not None and t.message is self.messages[-1]:
            if not (self._streaming and t.body >= 0):
                self._set_head_links(True)   # while it streams its links are hidden anyway
        else:
            self.render(streaming=self._streaming)
        return True

    def shows(self, transcript, *, answer_open: bool = False) -> bool:
        """Whether the view shows ``transcript`` (a paused answer's text may hold characters
        not shown yet).  ``answer_open``: up to the answer being generated, which neither
        side's last assistant entry is compared with."""
        mine = [(m.role, m.text) for m in self.messages]
        theirs = [(e["role"], e["content"]) for e in transcript]
        if answer_open:
            mine, theirs = (x[:-1] if x and x[-1][0] == "assistant" else x for x in (mine, theirs))
        elif mine and theirs and mine[-1][0] == theirs[-1][0] == "assistant" \
                and theirs[-1][1].startswith(mine[-1][1]):
            mine, theirs = mine[:-1], theirs[:-1]
        return mine == theirs

    def truncate(self, count: int) -> None:
        """Keep the first ``count`` messages (an edited message and what follows go)."""
        del self.messages[count:]
        self._streaming = False
        self.render()

    def begin_answer(self, user_text: str | None = None) -> None:
        """Show the user's message (if new) and an answer that text will stream into.

        Without ``user_text`` a paused answer at the end goes on (resume).
        """
        if user_text is not None:
            before = self.messages[-1] if self.messages else None
            if before is not None and before.role == "assistant" and not before.complete:
                # a paused answer a new message leaves as it is: no longer "Resume continues it"
                before.complete, before.note = True, ""
                if self._shows_tail(before) and not self._streaming:
                    self._rewrite_tail()
                else:
                    self.render()
            self._append(Message("user", user_text))
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != "assistant" or user_text is not None:
            self._append(Message("assistant", "", complete=False), streaming=True)
            return
        last.note = ""
        if self._shows_tail(last) and not self._streaming:
            self._set_head_links(False)
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
                self._set_head_links(True)
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

    def thinking_of(self, index: int) -> str:
        """The thinking of message ``index`` as the view shows it ("" when none)."""
        m = self.messages[index]
        return self._parts(m, final=m.complete).thinking if m.role == "assistant" else ""

    def _parts(self, m: Message, *, final: bool):
        return split(m.text, self.thinking if m.role == "assistant" else None, final=final)

    def code_blocks(self, index: int) -> list[str]:
        """The code blocks of message ``index`` as written (what each block's Copy copies)."""
        return list(self._code.get(index, []))

    # -- writing ------------------------------------------------------------------------------
    def _colors(self) -> dict[str, QColor]:
        pal = self.palette()
        dark = pal.color(QPalette.ColorRole.Base).lightness() < 128
        return {"user_bg": QColor("#26323f" if dark else "#eef3fa"),
                "system_bg": QColor("#2b2b2b" if dark else "#f6f6f4"),
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
        if t.links_len and t.message.role == "assistant":
            self._set_head_links(True)   # no longer the last answer: no Continue
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
            tail.links_len = self._insert_links(cursor, index)
        if m.role == "system":
            frame_fmt = QTextFrameFormat()
            frame_fmt.setBackground(colors["system_bg"])
            frame_fmt.setPadding(6)
            frame = cursor.insertFrame(frame_fmt)
            muted = QTextCharFormat()
            muted.setForeground(colors["muted"])
            muted.setFontItalic(True)
            cursor.insertText(m.text, muted)
            cursor.setPosition(frame.lastPosition() + 1)
            reset_block(cursor)
            return tail
        if m.role == "user":
            frame_fmt = QTextFrameFormat()
            frame_fmt.setBackground(colors["user_bg"])
            frame_fmt.setPadding(6)
            frame = cursor.insertFrame(frame_fmt)
            writer = DocWriter(cursor, Theme.from_palette(self.palette()),
                               lambda n: f"{CODE_LINK}{index}:{n}")
            if m.folded:
                cut = m.text.rfind(" ", FOLDED_CHARS // 2, FOLDED_CHARS)
                writer.write(parse(m.text[:cut if cut > 0 else FOLDED_CHARS] + " …"))
                _new_block(cursor, QTextBlockFormat(), QTextCharFormat())
                self._insert_link(cursor, f"Show all {len(m.text):,} characters", f"{EXPAND_LINK}{index}")
            else:
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
        parts = self._parts(m, final=not streaming)
        if not tail.thinking_done and parts.block:
            self._write_thinking(cursor, tail.index, parts, live=streaming and parts.thinking_open)
        if not tail.thinking_done and not parts.thinking_open:
            tail.thinking_done = True      # the answer began: the thinking is what it is
            if cursor.block().length() > 1:
                cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            tail.body = cursor.position()
        rest = parts.answer[tail.offset:]
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

    def _write_thinking(self, cursor: QTextCursor, index: int, parts, *, live: bool) -> None:
        """An answer's thinking toggle and, when shown, its thinking (plain, muted)."""
        m = self.messages[index]
        words = len(parts.thinking.split())
        count = f"({words:,} word{'' if words == 1 else 's'})"
        label = f"Thinking… {count}" if live else f"{'Hide' if m.thinking_shown else 'Show'} thinking {count}"
        _new_block(cursor, QTextBlockFormat(), QTextCharFormat())
        self._insert_link(cursor, f"{'▾' if m.thinking_shown else '▸'} {label}", f"{THINKING_LINK}{index}")
        if not m.thinking_shown:
            return
        muted = QTextCharFormat()
        muted.setForeground(self._colors()["muted"])
        muted.setFontItalic(True)
        block = QTextBlockFormat()
        block.setLeftMargin(14)
        for line in parts.thinking.split("\n"):
            cursor.insertBlock(block, muted)
            cursor.insertText(line, muted)

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

    def _insert_links(self, cursor: QTextCursor, index: int) -> int:
        """Insert message ``index``'s heading links at the cursor; returns the characters
        they took.  The switcher ``‹ k/n ›`` first, then Copy and the actions."""
        m = self.messages[index]
        start = cursor.position()
        muted = QTextCharFormat()
        muted.setForeground(self._colors()["muted"])
        alt = m.alternatives if self.actions else None
        if alt is not None:
            cursor.insertText(COPY_GAP, QTextCharFormat())
            self._insert_link(cursor, "‹", f"{ALTERNATIVE_LINK}{index}:{alt.index - 1}"
                              if alt.index > 1 else "", arrow=True)
            cursor.insertText(f" {alt.index}/{alt.count} ", QTextCharFormat())
            self._insert_link(cursor, "›", f"{ALTERNATIVE_LINK}{index}:{alt.index + 1}"
                              if alt.index < alt.count else "", arrow=True)
        actions = [("Copy", MESSAGE_LINK)]
        if self.actions and m.complete:
            if m.role in ("system", "user"):
                actions.append(("Edit", EDIT_LINK))
            if m.role == "assistant" and index == len(self.messages) - 1:
                actions.append(("Continue", CONTINUE_LINK))
            if m.role != "system":
                actions.append(("Fork", FORK_LINK))
        cursor.insertText(COPY_GAP, QTextCharFormat())
        for k, (label, prefix) in enumerate(actions):
            if k:
                cursor.insertText(LINK_GAP, muted)
            self._insert_link(cursor, label, f"{prefix}{index}")
        return cursor.position() - start

    def _insert_link(self, cursor: QTextCursor, text: str, href: str, *, arrow: bool = False) -> None:
        """A link at the cursor; without ``href`` the same text, muted (not clickable).
        An ``arrow`` (the switcher's) is drawn larger: it is a small target otherwise."""
        fmt = QTextCharFormat()
        if arrow:
            fmt.setFontWeight(QFont.Weight.Bold)
            fmt.setFontPointSize(self.font().pointSizeF() * 1.3)
        if href:
            fmt.setAnchor(True)
            fmt.setAnchorHref(href)
            fmt.setForeground(self._colors()["accent"])
        else:
            fmt.setForeground(self._colors()["muted"])
        cursor.insertText(text, fmt)

    def _set_head_links(self, shown: bool) -> None:
        """Write the last message's heading links again (``shown``) or remove them."""
        t = self._tail
        if not shown and not t.links_len:
            return
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        cursor.setPosition(t.head_end)
        removed = t.links_len
        if removed:
            cursor.setPosition(t.head_end + removed, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
        t.links_len = self._insert_links(cursor, t.index) if shown else 0
        cursor.endEditBlock()
        if t.body >= 0:
            t.body += t.links_len - removed

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
                m = self.messages[index]
                QGuiApplication.clipboard().setText(self._parts(m, final=True).answer)
                self.copied.emit(index)
        elif target.startswith(EXPAND_LINK):
            index = int(target[len(EXPAND_LINK):])
            if 0 <= index < len(self.messages):
                self.messages[index].expanded = True
                self.render(streaming=self._streaming)
        elif target.startswith(THINKING_LINK):
            index = int(target[len(THINKING_LINK):])
            if 0 <= index < len(self.messages):
                self.messages[index].thinking_shown = not self.messages[index].thinking_shown
                self.render(streaming=self._streaming)
        elif target.startswith(ALTERNATIVE_LINK):
            index, number = (int(x) for x in target[len(ALTERNATIVE_LINK):].split(":"))
            if 0 <= index < len(self.messages):
                self.alternative_requested.emit(index, number)
        elif target.startswith((EDIT_LINK, FORK_LINK, CONTINUE_LINK)):
            prefix, _, number = target.partition(":")
            index = int(number)
            if 0 <= index < len(self.messages):
                {"edit": self.edit_requested, "fork": self.fork_requested,
                 "continue": self.continue_requested}[prefix].emit(index)
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


class MessageEditor(QDialog):
    """Edit a message of yours (or the system prompt); Send goes on from it as a new branch."""

    def __init__(self, text: str, *, system: bool = False, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("messageEditor")
        self.setWindowTitle("Edit the system prompt" if system else "Edit message")
        self.resize(560, 300)
        note = QLabel("The conversation starts over with this system prompt, as a new branch; the "
                      "current one stays reachable." if system else
                      "The conversation goes on from this message as a new branch; the turns after "
                      "it stay reachable with ‹ › on this message.", self)
        note.setWordWrap(True)
        self.edit = QPlainTextEdit(text, self)
        self.edit.setObjectName("messageEditorText")
        self.edit.setAccessibleName("Edited message")
        buttons = QDialogButtonBox(self)
        self.send_button = buttons.addButton("Start over" if system else "Send",
                                             QDialogButtonBox.ButtonRole.AcceptRole)
        buttons.addButton(QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(note)
        layout.addWidget(self.edit, 1)
        layout.addWidget(buttons)

    def text(self) -> str:
        return self.edit.toPlainText()


class OfferBar(QFrame):
    """A line between the transcript and the prompt: what happened, and what can be done
    about it (buttons).  It belongs to one conversation (``conversation``) and one
    occasion (``kind``), so the window can take back exactly the offers that went stale."""

    def __init__(self, parent=None) -> None:
        super().__init__(parent)
        self.setObjectName("offerBar")
        self.setAccessibleName("Notice")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setStyleSheet("#offerBar { background: palette(alternate-base); border: 1px solid "
                           "palette(mid); border-radius: 4px; }")
        self.label = QLabel(self)
        self.label.setObjectName("offerText")
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._row = QHBoxLayout(self)
        self._row.setContentsMargins(8, 6, 8, 6)
        self._row.addWidget(self.label, 1)
        self._buttons: list[QPushButton] = []
        self.conversation = None
        self.kind = ""
        self.hide()

    def offer(self, conversation, kind: str, text: str,
              actions: list[tuple[str, Callable[[], None]]] = ()) -> None:
        self.withdraw()
        self.conversation, self.kind = conversation, kind
        self.label.setText(text)
        for label, slot in actions:
            b = QPushButton(label, self)
            b.clicked.connect(slot)
            self._row.addWidget(b)
            self._buttons.append(b)
        self.show()

    def withdraw(self, kind: str | None = None) -> None:
        """Hide the bar (only if it is of ``kind``, when given)."""
        if kind is not None and kind != self.kind:
            return
        for b in self._buttons:
            self._row.removeWidget(b)
            b.deleteLater()
        self._buttons = []
        self.conversation, self.kind = None, ""
        self.hide()

    def buttons(self) -> list[QPushButton]:
        return list(self._buttons)

    def text(self) -> str:
        return self.label.text()
