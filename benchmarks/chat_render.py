"""What does the chat view cost per piece of streamed text?  (A benchmark, not a test.)

Streams synthetic answers (paragraphs, lists, a table, code blocks) into a real
:class:`gui.chat_view.ChatView` offscreen, after an earlier conversation of some length,
in pieces of about four tokens as the bridge delivers them, and times each
``append_text`` (parse + rewrite of the answer's open blocks + layout), the closing
``finish_answer``, and for comparison a full ``render()`` of the same transcript.  The
per-piece cost should follow the size of the block being written, not the answer's or
the conversation's: the rows with the long conversation and the long answer show it.

    QT_QPA_PLATFORM=offscreen python benchmarks/chat_render.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PIECE = 16          # characters per delivery, about four tokens
SENTENCE = "The lighthouse keeper wrote down every ship that passed, and the weather with it. "


def answer(paragraphs: int, code_lines: int) -> str:
    parts = []
    for k in range(paragraphs):
        parts.append(f"Paragraph {k}: " + SENTENCE * 3)
        if k % 8 == 3:
            parts.append("- first point\n- second point with `code`\n- third point")
        if k % 8 == 5:
            parts.append("```python\n" + "".join(f"value_{i} = compute({i}) * 2  # step {i}\n"
                                                 for i in range(code_lines)) + "```")
        if k % 8 == 7:
            parts.append("| item | count |\n|---|---:|\n" + "".join(f"| row {i} | {i} |\n" for i in range(8)))
    return "\n\n".join(parts)


def history(turns: int) -> list[dict]:
    out = []
    for t in range(turns):
        out.append({"role": "user", "content": f"Question {t}?"})
        out.append({"role": "assistant", "content": answer(4, 6)})
    return out


def measure(view, app, turns: int, text: str) -> dict:
    view.set_transcript(history(turns))
    view.begin_answer("And now a long one?")
    app.processEvents()
    times = []
    for i in range(0, len(text), PIECE):
        t0 = time.perf_counter()
        view.append_text(text[i:i + PIECE])
        view.viewport().repaint()          # layout and paint, as the event loop would
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    view.finish_answer(complete=True)
    view.viewport().repaint()
    finish = time.perf_counter() - t0
    t0 = time.perf_counter()
    view.render()
    view.viewport().repaint()
    full = time.perf_counter() - t0
    times.sort()
    return {"turns": turns, "answer_chars": len(text), "pieces": len(times),
            "mean_ms": statistics.fmean(times) * 1000, "p95_ms": times[int(len(times) * 0.95)] * 1000,
            "max_ms": times[-1] * 1000, "finish_ms": finish * 1000, "full_render_ms": full * 1000}


def main() -> int:
    from PySide6.QtWidgets import QApplication

    from gui.chat_view import ChatView

    app = QApplication.instance() or QApplication(sys.argv)
    view = ChatView()
    view.resize(900, 700)
    view.show()
    rows = [measure(view, app, turns, answer(paragraphs, code_lines))
            for turns, paragraphs, code_lines in ((0, 8, 10), (0, 40, 10), (30, 8, 10), (30, 40, 10),
                                                  (0, 8, 120))]
    columns = list(rows[0])
    print("Chat view: cost of one streamed piece (16 characters) and of finishing the answer")
    print("  ".join(f"{c:>14}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]:>14.2f}" if isinstance(row[c], float) else f"{row[c]:>14}"
                        for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
