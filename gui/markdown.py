"""A small Markdown-to-HTML renderer for chat messages.

Models write a modest Markdown subset: fenced code blocks, inline code, bold/italic,
headings, bullet and numbered lists, links.  Qt's own ``setMarkdown`` renders a whole
document and cannot mix in our per-message frames and copy links, so this converts one
message to an HTML fragment that QTextBrowser's rich-text subset displays.  Everything
is escaped first; only the markup generated here reaches the document.
"""

from __future__ import annotations

import html
import re

_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_BOLD = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*")
_ITALIC = re.compile(r"(?<![\w*])\*(?=\S)([^*\n]+?)(?<=\S)\*(?![\w*])")
_LINK = re.compile(r"\[([^\]\n]+)\]\((https?://[^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_BULLET = re.compile(r"^\s*[-*+]\s+(.*)$")
_NUMBERED = re.compile(r"^\s*\d+[.)]\s+(.*)$")


def _inline(text: str) -> str:
    """Escape ``text`` and apply inline markup; code spans are left untouched."""
    parts = _INLINE_CODE.split(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append(f"<code>{html.escape(part)}</code>")
            continue
        s = html.escape(part, quote=False)
        s = _LINK.sub(lambda m: f'<a href="{html.escape(m.group(2))}">{m.group(1)}</a>', s)
        s = _BOLD.sub(r"<b>\1</b>", s)
        s = _ITALIC.sub(r"<i>\1</i>", s)
        out.append(s)
    return "".join(out)


def to_html(text: str, code_bg: str = "#f0f0f0") -> str:
    """One message as an HTML fragment."""
    out: list[str] = []
    para: list[str] = []
    list_tag: str | None = None
    lines = text.split("\n")
    i = 0

    def flush_para() -> None:
        if para:
            out.append("<p>" + "<br>".join(_inline(p) for p in para) + "</p>")
            para.clear()

    def close_list() -> None:
        nonlocal list_tag
        if list_tag:
            out.append(f"</{list_tag}>")
            list_tag = None

    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            flush_para()
            close_list()
            body = []
            i += 1
            while i < len(lines) and not lines[i].lstrip().startswith("```"):
                body.append(lines[i])
                i += 1
            i += 1  # the closing fence (or the end of an unfinished block while streaming)
            code = html.escape("\n".join(body))
            out.append(f'<table width="100%" cellpadding="6" style="background-color:{code_bg};">'
                       f'<tr><td><pre style="font-family:monospace;">{code}</pre></td></tr></table>')
            continue
        heading = _HEADING.match(line)
        bullet = _BULLET.match(line)
        numbered = _NUMBERED.match(line)
        if heading:
            flush_para()
            close_list()
            level = min(6, len(heading.group(1)) + 2)  # keep headings modest inside a chat
            out.append(f"<h{level}>{_inline(heading.group(2))}</h{level}>")
        elif bullet or numbered:
            flush_para()
            tag = "ul" if bullet else "ol"
            if list_tag != tag:
                close_list()
                out.append(f"<{tag}>")
                list_tag = tag
            out.append(f"<li>{_inline((bullet or numbered).group(1))}</li>")
        elif not line.strip():
            flush_para()
            close_list()
        else:
            close_list()
            para.append(line)
        i += 1
    flush_para()
    close_list()
    return "\n".join(out)
