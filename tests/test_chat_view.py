"""The chat view's Markdown, as a user sees it while an answer streams and after it ends.

Each test drives a real :class:`ChatView` offscreen through the calls the main window
makes (``set_transcript``, ``begin_answer``, ``append_text``, ``finish_answer``,
``set_note``) and reads back what Qt's document holds: text, links, frames, tables,
what a click puts on the clipboard, and where each piece of text changed the document.
"""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication, QTextCursor, QTextFrame, QTextTable

from gui.chat_view import ChatView
from gui.markdown import Theme

RICH = """Intro with a [link](https://example.com/?a=1&b=2) and `code`.

```python
def f(x):
    return x < 2 and "<b>"
```

| name | size |
|------|-----:|
| a    | 1    |
| b    | 22   |

1. one
2. two
   - nested

> quoted **bold**

```
unterminated
"""


@pytest.fixture
def view(qtbot):
    v = ChatView()
    v.resize(700, 500)
    qtbot.addWidget(v)
    v.show()
    v.set_transcript([])
    return v


def stream(view: ChatView, text: str, step: int = 3) -> None:
    for i in range(0, len(text), step):
        view.append_text(text[i:i + step])


def plain(view: ChatView) -> str:
    return view.document().toPlainText()


def anchors(view: ChatView) -> list[tuple[str, str]]:
    """(text, href) of every link in the document, in order."""
    out = []
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            frag = it.fragment()
            if frag.charFormat().isAnchor():
                out.append((frag.text(), frag.charFormat().anchorHref()))
            it += 1
        block = block.next()
    return out


def frames(view: ChatView, kind=QTextFrame) -> list:
    """The code boxes (or, with ``kind=QTextTable``, the tables) in the document."""
    code_bg = Theme.from_palette(view.palette()).code_bg
    out, todo = [], list(view.document().rootFrame().childFrames())
    while todo:
        frame = todo.pop(0)
        if kind is QTextTable and isinstance(frame, QTextTable):
            out.append(frame)
        elif kind is QTextFrame and not isinstance(frame, QTextTable) \
                and frame.frameFormat().background().color() == code_bg:
            out.append(frame)
        todo.extend(frame.childFrames())
    return out


def frame_text(frame) -> str:
    cursor = QTextCursor(frame.document())
    cursor.setPosition(frame.firstPosition())
    cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
    return cursor.selection().toPlainText()


def click_link(qtbot, view: ChatView, href: str, text: str = "Copy") -> None:
    """Click the link ``text`` to ``href`` where it is drawn, as a user would."""
    found = view.document().find(text)
    while not found.isNull() and found.charFormat().anchorHref() != href:
        found = view.document().find(text, found)
    assert not found.isNull(), f"no link to {href}"
    cursor = QTextCursor(view.document())
    cursor.setPosition(found.selectionStart() + 1)
    view.setTextCursor(cursor)
    view.ensureCursorVisible()
    point = view.cursorRect(cursor).center()
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=point)


def test_link_with_ampersand_is_escaped_once(view):
    view.begin_answer("links?")
    stream(view, "See [a & b](https://example.com/?a=1&b=2) now.")
    view.finish_answer(complete=True)
    assert ("a & b", "https://example.com/?a=1&b=2") in anchors(view)
    assert "See a & b now." in plain(view)
    html = view.document().toHtml()
    assert "&amp;amp;" not in html and "a &amp; b" in html


def test_fenced_code_renders_while_it_streams(view):
    view.begin_answer("code please")
    stream(view, "Here:\n\n```python\nx = 1 < 2\nprint(x)\n")
    text = plain(view)
    assert "```" not in text and "writing…" in text         # a code block in progress
    (box,) = frames(view)
    assert frame_text(box).endswith("x = 1 < 2\nprint(x)")
    code_char = view.document().find("print(x)").charFormat()
    assert code_char.fontFixedPitch()
    assert view.code_blocks(1) == ["x = 1 < 2\nprint(x)"]

    stream(view, "```\nDone.")                                # the fence closes mid-answer
    text = plain(view)
    assert "writing…" not in text and "```" not in text and "Done." in text
    assert ("Copy", "copy-code:1:0") in anchors(view)         # the block's own Copy link


def test_table_renders_while_it_streams(view):
    view.begin_answer("a table")
    stream(view, "| name | size |\n|---|---:|\n| a | 1 |\n| b | 22 |\n", step=2)
    (table,) = frames(view, QTextTable)
    assert (table.rows(), table.columns()) == (3, 2)
    assert [table.cellAt(2, c).firstCursorPosition().block().text() for c in range(2)] == ["b", "22"]
    assert "|" not in plain(view)
    assert view.messages[-1].text.count("|") == 12            # the message itself is untouched


def test_unterminated_fence_at_the_end_is_a_code_block_with_copy(view):
    view.begin_answer("stop mid code")
    stream(view, "```js\nlet a = 1;")
    assert "writing…" in plain(view)
    view.finish_answer(complete=False, note="Paused · saved 1 MB")
    text = plain(view)
    assert "writing…" not in text and "Paused · saved 1 MB" in text
    assert ("Copy", "copy-code:1:0") in anchors(view)
    assert view.code_blocks(1) == ["let a = 1;"]


def test_code_block_copy_puts_exactly_the_code_on_the_clipboard(qtbot, view):
    code = '    indented <tag> & "quotes"\n\n\tlast line\t'
    view.begin_answer("two blocks")
    stream(view, f"First:\n\n```\nnot this\n```\n\nSecond:\n\n~~~text\n{code}\n~~~\n", step=5)
    view.finish_answer(complete=True)
    QGuiApplication.clipboard().clear()
    with qtbot.waitSignal(view.code_copied, timeout=2000) as sig:
        click_link(qtbot, view, "copy-code:1:1")
    assert sig.args == [1, 1]
    assert QGuiApplication.clipboard().text() == code


def test_message_copy_puts_the_raw_message_on_the_clipboard(qtbot, view):
    view.begin_answer("question")
    stream(view, RICH)
    view.finish_answer(complete=True)
    with qtbot.waitSignal(view.copied, timeout=2000) as sig:
        click_link(qtbot, view, "copy:1")
    assert sig.args == [1] and QGuiApplication.clipboard().text() == RICH


def test_html_in_output_is_shown_as_text(view):
    answer = ('Try <script>alert(1)</script> or <img src="file:///etc/passwd"> and <b>x</b>.\n\n'
              "<div>\n<i>block</i>\n</div>\n\n"
              "[click](javascript:alert(1)) ![pic](file:///etc/hosts)")
    view.set_transcript([{"role": "user", "content": "<u>mine</u>"}])
    view.begin_answer(None)
    stream(view, answer, step=4)
    view.finish_answer(complete=True)
    text = plain(view)
    for literal in ("<script>alert(1)</script>", '<img src="file:///etc/passwd">', "<b>x</b>",
                    "<div>", "<i>block</i>", "<u>mine</u>"):
        assert literal in text
    assert view.document().find("x</b>").charFormat().fontWeight() < 600   # not bold
    hrefs = [href for _, href in anchors(view)]
    assert not any(h.startswith(("javascript:", "file:")) for h in hrefs)  # not links
    html = view.document().toHtml()
    assert "<img" not in html and "<script" not in html


def test_streaming_rewrites_only_the_end_of_the_last_message(view):
    """Each piece of text changes the document only from the block it may still change on."""
    view.set_transcript([{"role": "user", "content": "earlier question"},
                         {"role": "assistant", "content": "earlier answer " * 200}])
    view.begin_answer("a long answer")
    start_of_answer = plain(view).rindex("Assistant")
    paragraphs = [f"Paragraph {k} " + "word " * 40 for k in range(40)]
    paragraphs[10] = "```python\n" + "x = 1\n" * 20 + "```"
    paragraphs[20] = "| a | b |\n|---|---|\n" + "| 1 | 2 |\n" * 10
    changes: list[tuple[int, int, int]] = []
    view.document().contentsChange.connect(lambda pos, removed, added: changes.append((pos, removed, added)))
    worst_rewrite = 0
    for k, paragraph in enumerate(paragraphs):
        # the block before this one can still be open: the rewrite may start there, not earlier
        previous = k - 1 if k - 1 not in (10, 20) else k - 2
        floor = plain(view).find(f"Paragraph {previous} ") if previous >= 0 else start_of_answer
        for i in range(0, len(paragraph), 6):
            changes.clear()
            view.append_text(paragraph[i:i + 6] + ("\n\n" if i + 6 >= len(paragraph) else ""))
            # (a block's format lives on the separator just before its first character)
            assert changes and min(pos for pos, _, _ in changes) >= floor - 1 > 0
            worst_rewrite = max(worst_rewrite, max(removed for _, removed, _ in changes))
    assert worst_rewrite < 3 * max(len(p) for p in paragraphs)    # never the whole answer
    changes.clear()
    view.finish_answer(complete=True)
    assert min(pos for pos, _, _ in changes) >= start_of_answer - 1   # the earlier messages stay
    assert "Paragraph 39" in plain(view) and "```" not in plain(view)


@pytest.mark.parametrize("step", [1, 5, 64])
def test_streamed_document_equals_a_full_render(view, step):
    view.set_transcript([{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}])
    view.begin_answer("show everything")
    stream(view, RICH, step=step)
    view.finish_answer(complete=False, note="Paused · saved 2 MB")
    streamed = (plain(view).split(), anchors(view), view.code_blocks(3),
                len(frames(view)), len(frames(view, QTextTable)))
    view.render()
    full = (plain(view).split(), anchors(view), view.code_blocks(3),
            len(frames(view)), len(frames(view, QTextTable)))
    assert streamed == full
    assert view.code_blocks(3) == ['def f(x):\n    return x < 2 and "<b>"', "unterminated"]


def test_resume_continues_the_paused_answer_in_place(view):
    view.begin_answer("count")
    stream(view, "one two ")
    view.finish_answer(complete=False, note="Paused · saving checkpoint…")
    view.set_note("Paused · saved 1 MB — Resume continues it")
    assert "Resume continues it" in plain(view)
    view.begin_answer(None)
    assert "Paused" not in plain(view) and plain(view).count("Copy") == 1   # the question's
    stream(view, "three\n\n```\nfour\n```")
    view.finish_answer(complete=True)
    assert "one two three" in plain(view) and "Paused" not in plain(view)
    assert [m.role for m in view.messages] == ["user", "assistant"]
    assert view.messages[-1].text == "one two three\n\n```\nfour\n```"
    assert plain(view).count("Copy") == 3 and view.code_blocks(1) == ["four"]


def test_a_message_sent_after_a_pause_leaves_no_resume_note_on_the_paused_answer(view):
    """A new message after a paused answer leaves that answer as it is: it still said
    "Paused · … — Resume continues it", with Resume off and no Fork link (under Wine)."""
    view.begin_answer("count")
    stream(view, "one two ")
    view.finish_answer(complete=False, note="Paused · saving checkpoint…")
    view.set_note("Paused · saved 1 MB — Resume continues it")
    view.begin_answer("something else")
    assert "Resume continues it" not in plain(view) and "Paused" not in plain(view)
    assert view.messages[1].complete and "one two" in plain(view)
    assert [m.role for m in view.messages] == ["user", "assistant", "user", "assistant"]


def test_placeholder_and_regenerate_after_a_removed_answer(view):
    view.placeholder = "Opening the conversation…"
    view.render()
    assert plain(view) == "Opening the conversation…"
    view.begin_answer("q")
    stream(view, "first answer")
    view.finish_answer(complete=True)
    view.messages.pop()                     # what the window's Regenerate does
    view.begin_answer(None)
    stream(view, "second answer")
    view.finish_answer(complete=True)
    assert "first answer" not in plain(view) and "second answer" in plain(view)


def test_a_long_message_of_yours_is_folded_until_show_all(qtbot, view):
    from gui.chat_view import FOLD_ABOVE_CHARS
    pasted = "Summarise this.\n\n" + "The shelves hold maps and ledgers of the old trade. " * 400
    assert len(pasted) > FOLD_ABOVE_CHARS
    view.begin_answer(pasted)
    stream(view, "A short summary.")
    view.finish_answer(complete=True)
    shown = plain(view)
    assert "Show all" in shown and len(shown) < 3000            # a few lines, not the document
    assert ("Show all 20,817 characters", "expand:0") in anchors(view)
    with qtbot.waitSignal(view.copied, timeout=2000):
        click_link(qtbot, view, "copy:0")
    assert QGuiApplication.clipboard().text() == pasted          # Copy copies all of it
    click_link(qtbot, view, "expand:0", "Show all")
    assert pasted.split("\n\n")[1].strip() in plain(view) and "Show all" not in plain(view)
    assert view.answer_text() == "A short summary."
    view.begin_answer("short")                                   # a short one is never folded
    assert "Show all" not in plain(view)
