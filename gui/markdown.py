"""Markdown in the chat view: markdown-it-py parses, this module writes Qt's document.

A message is parsed by markdown-it-py (CommonMark with GitHub's tables and
strikethrough, raw HTML switched off) and written into the view's ``QTextDocument``
through a ``QTextCursor``: blocks with formats, Qt lists, Qt tables, and one framed box
per code block with Pygments colours and a Copy link.  No HTML is generated on the way,
so nothing a model prints can become markup: ``<script>`` or ``<img src=...>`` in an
answer is inserted as the text it is, and a link is one only if it is http(s) or mailto.

Streaming: CommonMark closes a block for good once a later line starts another block,
so while a text grows at its end, every top-level block is final except the last one
that starts on a complete line and whatever follows it (:func:`stable_count`).  The
chat view writes the final blocks once and rewrites only the rest on each new piece of
text.  A code fence still waiting for its closing fence is drawn as a code block whose
header says "writing…" where its Copy link will be.  (A link reference definition that
arrives later does not reach back into blocks already written; models hardly write them.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache

from markdown_it import MarkdownIt
from markdown_it.token import Token
from pygments.lexers import get_lexer_by_name
from pygments.lexers.special import TextLexer
from pygments.styles import get_style_by_name
from pygments.util import ClassNotFound
from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import (
    QColor,
    QFont,
    QFontDatabase,
    QPalette,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFormat,
    QTextFrameFormat,
    QTextLength,
    QTextList,
    QTextListFormat,
    QTextTableCellFormat,
    QTextTableFormat,
)

_PARSER = MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])
LINK_SCHEMES = ("http", "https", "mailto")
INDENT_PX = 24          # a block quote's indent per level
LINE_SEPARATOR = "\u2028"


@dataclass(frozen=True)
class Theme:
    """The colours a message is written in, taken from the widget's palette."""

    code_bg: QColor
    muted: QColor
    accent: QColor
    pygments_style: str

    @classmethod
    def from_palette(cls, pal: QPalette) -> Theme:
        dark = pal.color(QPalette.ColorRole.Base).lightness() < 128
        return cls(code_bg=QColor("#2b2b2b" if dark else "#f2f2f2"),
                   muted=pal.color(QPalette.ColorRole.PlaceholderText),
                   accent=pal.color(QPalette.ColorRole.Link),
                   pygments_style="monokai" if dark else "default")


@dataclass
class Block:
    """One top-level Markdown block: its first line in the parsed text, and its tokens."""

    line: int
    tokens: list[Token] = field(default_factory=list)


def parse(text: str) -> list[Block]:
    """``text`` as top-level blocks; a fence still missing its closing line has ``meta["open"]``."""
    lines = text.split("\n")
    blocks: list[Block] = []
    for tok in _PARSER.parse(text):
        if tok.type == "fence":
            tok.meta["open"] = not _fence_closed(tok, lines)
        if tok.level == 0 and tok.nesting >= 0:
            blocks.append(Block(tok.map[0] if tok.map else 0))
        blocks[-1].tokens.append(tok)
    return blocks


def _fence_closed(tok: Token, lines: list[str]) -> bool:
    start, end = tok.map
    last = lines[end - 1].strip() if end - 1 > start else ""
    return bool(last) and set(last) == {tok.markup[0]} and len(last) >= len(tok.markup)


def stable_count(blocks: list[Block], text: str) -> int:
    """How many leading ``blocks`` of ``text`` no text appended to it can change."""
    growing = text.count("\n")          # the last line, which may still grow
    starts = [k for k, b in enumerate(blocks) if b.line < growing]
    return starts[-1] if starts else 0


def line_offset(text: str, line: int) -> int:
    """The index in ``text`` where line number ``line`` starts."""
    pos = 0
    for _ in range(line):
        pos = text.index("\n", pos) + 1
    return pos


def reset_block(cursor: QTextCursor) -> None:
    """Make the cursor's block a plain paragraph (out of any list, no formats)."""
    lst = cursor.currentList()
    if lst is not None:
        lst.remove(cursor.block())
    cursor.setBlockFormat(QTextBlockFormat())
    cursor.setBlockCharFormat(QTextCharFormat())
    cursor.setCharFormat(QTextCharFormat())


def monospace(fmt: QTextCharFormat | None = None) -> QTextCharFormat:
    out = QTextCharFormat(fmt) if fmt is not None else QTextCharFormat()
    out.setFontFamilies([_fixed_family(), "monospace"])
    out.setFontFixedPitch(True)
    return out


@lru_cache(maxsize=1)
def _fixed_family() -> str:
    return QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont).family()


@lru_cache(maxsize=64)
def _lexer(language: str):
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return TextLexer(stripnl=False, ensurenl=False)


@lru_cache(maxsize=1024)
def _token_format(style_name: str, ttype) -> QTextCharFormat:
    style = get_style_by_name(style_name).style_for_token(ttype)
    fmt = monospace()
    if style["color"]:
        fmt.setForeground(QColor("#" + style["color"]))
    if style["bold"]:
        fmt.setFontWeight(QFont.Weight.Bold)
    if style["italic"]:
        fmt.setFontItalic(True)
    return fmt


def _runs(code: str, language: str, style_name: str) -> list[tuple[str, QTextCharFormat]]:
    return [(value, _token_format(style_name, ttype))
            for ttype, value in _lexer(language.lower()).get_tokens(code)]


# The code block being streamed: its complete lines already lexed, and their runs.
_growing: tuple[tuple[str, str], str, list[tuple[str, QTextCharFormat]]] = (("", ""), "", [])


def highlighted(code: str, language: str, style_name: str, *,
                growing: bool = False) -> list[tuple[str, QTextCharFormat]]:
    """``code`` as runs of text with their Pygments colours (the text is unchanged).

    ``growing``: a block still being written, highlighted again after every piece.  Its
    complete lines are lexed once and kept; only the lines after them are lexed each time
    (each part on its own, so a string open across the cut is coloured right only once the
    block is complete and highlighted whole).
    """
    global _growing
    if not growing:
        return _runs(code, language, style_name)
    key, done, runs = _growing
    if key != (language, style_name) or not code.startswith(done):
        key, done, runs = (language, style_name), "", []
    cut = code.rfind("\n") + 1
    if cut > len(done):
        runs = runs + _runs(code[len(done):cut], language, style_name)
        done = code[:cut]
        _growing = key, done, runs
    return runs + _runs(code[len(done):], language, style_name)


@dataclass
class _ListLevel:
    fmt: QTextListFormat
    tight: bool
    items: QTextList | None = None


class DocWriter:
    """Writes parsed Markdown blocks at a cursor.

    ``code`` collects the text of each code block written, in order; the Copy link of the
    n-th one points at ``code_href(n)``.  ``streaming`` marks an unclosed fence as being
    written instead of giving it a Copy link.
    """

    def __init__(self, cursor: QTextCursor, theme: Theme, code_href: Callable[[int], str], *,
                 streaming: bool = False) -> None:
        self.cursor = cursor
        self.theme = theme
        self.code_href = code_href
        self.streaming = streaming
        self.code: list[str] = []
        self._fresh = cursor.block().length() == 1   # the cursor's block is empty: reuse it
        self._lists: list[_ListLevel] = []
        self._item_pending = False                  # the next block starts a list item
        self._quote = 0

    def write(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            self._write_tokens(block.tokens)

    def start_region(self) -> None:
        """Leave the cursor at the start of an empty block (where a rewritable part can start)."""
        if not self._fresh:
            self.cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
            self._fresh = True

    # -- blocks ------------------------------------------------------------------------------
    def _write_tokens(self, tokens: list[Token]) -> None:
        i = 0
        while i < len(tokens):
            tok = tokens[i]
            kind = tok.type
            if kind in ("paragraph_open", "heading_open"):
                self._text_block(tok, tokens[i + 1])
                i += 3
                continue
            if kind == "table_open":
                end = next(j for j in range(i, len(tokens)) if tokens[j].type == "table_close")
                self._table(tokens[i:end + 1])
                i = end + 1
                continue
            if kind in ("bullet_list_open", "ordered_list_open"):
                self._open_list(tok, tokens, i)
            elif kind in ("bullet_list_close", "ordered_list_close"):
                self._lists.pop()
            elif kind == "list_item_open":
                self._item_pending = True
            elif kind == "list_item_close" and self._item_pending:
                self._new_block(self._paragraph_format(tight=True), QTextCharFormat())
            elif kind == "blockquote_open":
                self._quote += 1
            elif kind == "blockquote_close":
                self._quote -= 1
            elif kind in ("fence", "code_block"):
                self._code(tok)
            elif kind == "hr":
                fmt = self._paragraph_format(tight=False)
                fmt.setProperty(QTextFormat.Property.BlockTrailingHorizontalRulerWidth,
                                QTextLength(QTextLength.Type.PercentageLength, 100))
                self._new_block(fmt, QTextCharFormat())
            elif kind == "html_block":               # only if raw HTML were switched on: text
                self._new_block(self._paragraph_format(tight=False), self._base_char())
                self.cursor.insertText(tok.content.rstrip("\n"))
            i += 1

    def _open_list(self, tok: Token, tokens: list[Token], i: int) -> None:
        fmt = QTextListFormat()
        depth = len(self._lists)
        if tok.type == "ordered_list_open":
            fmt.setStyle(QTextListFormat.Style.ListDecimal)
            fmt.setStart(int(tok.attrs.get("start", 1)))
        else:
            fmt.setStyle((QTextListFormat.Style.ListDisc, QTextListFormat.Style.ListCircle,
                          QTextListFormat.Style.ListSquare)[depth % 3])
        fmt.setIndent(depth + 1)
        # markdown-it hides the paragraphs of a tight list's items
        tight = i + 2 < len(tokens) and tokens[i + 2].hidden
        self._lists.append(_ListLevel(fmt, tight))

    def _paragraph_format(self, *, tight: bool) -> QTextBlockFormat:
        fmt = QTextBlockFormat()
        fmt.setBottomMargin(2 if tight else 8)
        if self._quote:
            fmt.setLeftMargin(INDENT_PX * self._quote)
        if self._lists and not self._item_pending:
            fmt.setIndent(len(self._lists))      # a later paragraph of a list item
        return fmt

    def _base_char(self) -> QTextCharFormat:
        fmt = QTextCharFormat()
        if self._quote:
            fmt.setForeground(self.theme.muted)
        return fmt

    def _new_block(self, fmt: QTextBlockFormat, char_fmt: QTextCharFormat) -> None:
        if self._fresh:
            reset_block(self.cursor)
            self.cursor.setBlockFormat(fmt)
            self.cursor.setBlockCharFormat(char_fmt)
            self.cursor.setCharFormat(char_fmt)
        else:
            self.cursor.insertBlock(fmt, char_fmt)
        self._fresh = False
        if self._item_pending:
            self._item_pending = False
            level = self._lists[-1]
            if level.items is None:
                level.items = self.cursor.createList(level.fmt)
            else:
                level.items.add(self.cursor.block())

    def _text_block(self, tok: Token, inline: Token) -> None:
        tight = bool(self._lists) and self._lists[-1].tight
        fmt = self._paragraph_format(tight=tight)
        char_fmt = self._base_char()
        if tok.type == "heading_open":
            level = int(tok.tag[1])
            fmt.setHeadingLevel(level)
            fmt.setTopMargin(10)
            fmt.setBottomMargin(4)
            char_fmt.setFontWeight(QFont.Weight.Bold)
            # modest headings inside a chat: h1 1.44x, h2 1.2x, the rest body size
            char_fmt.setProperty(QTextFormat.Property.FontSizeAdjustment, max(0, 3 - level))
        self._new_block(fmt, char_fmt)
        self._inline(self.cursor, inline.children or [], char_fmt)

    def _frame_start(self) -> None:
        """Prepare to insert a frame (code box, table) at the cursor."""
        if self._item_pending:                       # a list item that starts with a code block
            self._new_block(self._paragraph_format(tight=True), QTextCharFormat())
        elif self._fresh:
            # the empty block stays before the frame: make it take no room
            reset_block(self.cursor)
            fmt = QTextBlockFormat()
            fmt.setLineHeight(0, QTextBlockFormat.LineHeightTypes.FixedHeight.value)
            self.cursor.setBlockFormat(fmt)

    def _frame_end(self, last_position: int) -> None:
        self.cursor.setPosition(last_position + 1)   # the block after the frame
        reset_block(self.cursor)
        self._fresh = True

    def _frame_margin(self) -> float:
        return INDENT_PX * self._quote + (self.cursor.document().indentWidth() * len(self._lists))

    def _code(self, tok: Token) -> None:
        code = tok.content[:-1] if tok.content.endswith("\n") else tok.content
        language = tok.info.split()[0] if tok.type == "fence" and tok.info.strip() else ""
        number = len(self.code)
        self.code.append(code)
        writing = self.streaming and tok.meta.get("open", False)
        self._frame_start()
        frame_fmt = QTextFrameFormat()
        frame_fmt.setBackground(self.theme.code_bg)
        frame_fmt.setPadding(8)
        frame_fmt.setTopMargin(2)
        frame_fmt.setBottomMargin(8)
        frame_fmt.setLeftMargin(self._frame_margin())
        frame = self.cursor.insertFrame(frame_fmt)
        header = QTextBlockFormat()
        header.setBottomMargin(4)
        self.cursor.setBlockFormat(header)
        label = QTextCharFormat()
        label.setForeground(self.theme.muted)
        label.setProperty(QTextFormat.Property.FontSizeAdjustment, -1)
        self.cursor.insertText(language or "code", label)
        self.cursor.insertText("   ", QTextCharFormat())
        if writing:
            label.setFontItalic(True)
            self.cursor.insertText("writing…", label)
        else:
            self.cursor.insertText("Copy", self._anchor(self.code_href(number), QTextCharFormat()))
        self.cursor.insertBlock(QTextBlockFormat(), monospace())
        for text, fmt in highlighted(code, language, self.theme.pygments_style, growing=writing):
            self.cursor.insertText(text, fmt)       # a newline starts the next line's block
        self._frame_end(frame.lastPosition())

    def _table(self, tokens: list[Token]) -> None:
        rows: list[list[tuple[Token, str, bool]]] = []
        align, header = "", False
        for tok in tokens:
            if tok.type == "tr_open":
                rows.append([])
            elif tok.type in ("th_open", "td_open"):
                align, header = str(tok.attrs.get("style", "")), tok.type == "th_open"
            elif tok.type == "inline":
                rows[-1].append((tok, align, header))
        columns = max(len(r) for r in rows)
        self._frame_start()
        fmt = QTextTableFormat()
        fmt.setBorder(1)
        fmt.setBorderBrush(self.theme.muted)
        fmt.setBorderStyle(QTextFrameFormat.BorderStyle.BorderStyle_Solid)
        fmt.setBorderCollapse(True)
        fmt.setCellSpacing(0)
        fmt.setCellPadding(4)
        fmt.setHeaderRowCount(1)
        fmt.setTopMargin(2)
        fmt.setBottomMargin(8)
        fmt.setLeftMargin(self._frame_margin())
        table = self.cursor.insertTable(len(rows), columns, fmt)
        for r, row in enumerate(rows):
            for c, (inline, style, is_header) in enumerate(row):
                if is_header:
                    shade = QTextTableCellFormat()
                    shade.setBackground(self.theme.code_bg)
                    table.cellAt(r, c).setFormat(shade)
                cell = table.cellAt(r, c).firstCursorPosition()
                block = QTextBlockFormat()
                if "center" in style:
                    block.setAlignment(Qt.AlignmentFlag.AlignHCenter)
                elif "right" in style:
                    block.setAlignment(Qt.AlignmentFlag.AlignRight)
                cell.setBlockFormat(block)
                char_fmt = QTextCharFormat()
                if is_header:
                    char_fmt.setFontWeight(QFont.Weight.Bold)
                self._inline(cell, inline.children or [], char_fmt)
        self._frame_end(table.lastPosition())

    # -- inline ------------------------------------------------------------------------------
    def _anchor(self, href: str, base: QTextCharFormat) -> QTextCharFormat:
        fmt = QTextCharFormat(base)
        fmt.setAnchor(True)
        fmt.setAnchorHref(href)
        fmt.setForeground(self.theme.accent)
        fmt.setFontUnderline(True)
        return fmt

    def _inline(self, cursor: QTextCursor, children: list[Token], base: QTextCharFormat) -> None:
        stack = [base]
        for tok in children:
            kind = tok.type
            if kind in ("softbreak", "hardbreak"):
                cursor.insertText(LINE_SEPARATOR, stack[-1])   # chat text means its line breaks
            elif kind == "code_inline":
                fmt = monospace(stack[-1])
                fmt.setBackground(self.theme.code_bg)
                cursor.insertText(tok.content, fmt)
            elif kind == "image":                    # never loaded: its text, linked if safe
                src = str(tok.attrs.get("src", ""))
                text = tok.content or src
                fmt = self._anchor(src, stack[-1]) if _safe_link(src) else stack[-1]
                cursor.insertText(text, fmt)
            elif kind.endswith("_open"):
                stack.append(self._inline_format(tok, stack[-1]))
            elif kind.endswith("_close"):
                if len(stack) > 1:
                    stack.pop()
            else:                                    # text (and anything unknown) as plain text
                cursor.insertText(tok.content, stack[-1])

    def _inline_format(self, tok: Token, outer: QTextCharFormat) -> QTextCharFormat:
        if tok.type == "link_open":
            href = str(tok.attrs.get("href", ""))
            return self._anchor(href, outer) if _safe_link(href) else QTextCharFormat(outer)
        fmt = QTextCharFormat(outer)
        if tok.type == "strong_open":
            fmt.setFontWeight(QFont.Weight.Bold)
        elif tok.type == "em_open":
            fmt.setFontItalic(True)
        elif tok.type == "s_open":
            fmt.setFontStrikeOut(True)
        return fmt


def _safe_link(href: str) -> bool:
    return QUrl(href).scheme().lower() in LINK_SCHEMES
