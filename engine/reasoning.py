"""An answer's thinking apart from its final text, for models that think before they answer.

Qwen3, Qwen3.5, DeepSeek-R1 and SmolLM3 write their reasoning first, between ``<think>``
and ``</think>``, then the answer.  Some templates (Qwen3.5, DeepSeek-R1's newer ones)
open the block themselves at the end of the generation prompt, so the model's output
starts inside its thinking and only the closing tag appears in the answer's text.
gpt-oss writes channels (OpenAI's harmony format): ``<|channel|>analysis<|message|>``
opens its thinking, and ``<|end|><|start|>assistant<|channel|>final<|message|>`` begins
the answer (``<|end|>`` is a control token, rendered empty in an answer's text; llama.cpp
renders the other three); an answer without thinking starts with
``<|channel|>final<|message|>`` (:attr:`ThinkFormat.answer_tag`), which is not shown.

Whether a model thinks, and whether its prompt opens the block, is read from its chat
template (:func:`format_of`), never guessed from an answer.  The answer's text stays
what the model wrote, tags included — it is the text of the tokens in the cache, which
exact continuation depends on; the parts are derived from it by :class:`Splitter`, the
one rule every front end uses:

- a thinking block is recognised only at the start of the answer (whitespace before it
  allowed), or from the first character when the prompt opened it; the first closing
  tag ends it, and everything after is the answer;
- whitespace at the start of each part and at the end of the thinking is dropped (the
  tags sit on lines of their own); the answer keeps the rest as written;
- text that may still become a tag (``<thi`` at the end of what has arrived) is held
  back until the next piece decides, so a tag split across tokens is never shown;
- an unclosed block is still thinking: while streaming, the model has not answered yet;
  at the end (a length limit, a pause), the thinking is all there is.

    splitter = Splitter(fmt)            # one per answer
    for piece in stream:
        for kind, text in splitter.feed(piece):   # kind: THINKING or ANSWER
            ...
    splitter.finish()                   # the held-back rest, at the end of the answer

    split(text, fmt) -> Parts(thinking, answer, state, block)   # the same rule, whole text
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

THINKING = "thinking"
ANSWER = "answer"

#: Splitter.state: nothing decided yet (only whitespace or part of an opening tag seen),
#: inside the thinking block, after it (or no block at all): the answer
STARTING, IN_THINKING, ANSWERING = "starting", "thinking", "answering"


@dataclass(frozen=True)
class ThinkFormat:
    """How a model marks its thinking."""
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    #: the generation prompt ends with ``open_tag``: the answer starts inside the block
    opened_by_prompt: bool = False
    #: a header an answer without a thinking block starts with, dropped (gpt-oss)
    answer_tag: str = ""


#: the tags the supported families use (Qwen3, Qwen3.5, QwQ, DeepSeek-R1, SmolLM3)
TAGS = ("<think>", "</think>")

#: gpt-oss's channels, as they appear in an answer's text (module docstring)
HARMONY = ThinkFormat(open_tag="<|channel|>analysis<|message|>",
                      close_tag="<|start|>assistant<|channel|>final<|message|>",
                      answer_tag="<|channel|>final<|message|>")


def format_of(template: str | None, generation_prompt: str | None) -> ThinkFormat | None:
    """The thinking format of a chat template, or None for a model that does not think.

    ``template`` is the model's Jinja template (GGUF ``tokenizer.chat_template``), and
    ``generation_prompt`` what it renders for one user message with the generation prompt
    (None when it cannot be rendered).  A template that writes the closing tag knows
    thinking blocks; its prompt opens one when the rendered prompt ends with the opening
    tag (an empty block, ``<think>\\n\\n</think>``, is thinking switched off, not opened).
    """
    open_tag, close_tag = TAGS
    if template and HARMONY.open_tag in template:
        return HARMONY    # its generation prompt ends with "<|start|>assistant": nothing is opened
    if not template or close_tag not in template:
        return None
    opened = generation_prompt is not None and generation_prompt.rstrip().endswith(open_tag)
    return ThinkFormat(open_tag, close_tag, opened_by_prompt=opened)


@dataclass(frozen=True)
class Parts:
    thinking: str
    answer: str
    state: str = ANSWERING    # STARTING, IN_THINKING or ANSWERING where the text ended
    block: bool = False       # a thinking block was opened (it may be empty, or still open)
    headed: bool = False      # the answer began with the format's answer_tag (dropped)

    @property
    def thinking_open(self) -> bool:
        """The model has not finished thinking (or not shown yet whether it will)."""
        return self.state != ANSWERING


class Splitter:
    """Splits one answer's text, piece by piece, into thinking and answer (module docstring)."""

    def __init__(self, fmt: ThinkFormat | None) -> None:
        self.fmt = fmt
        self.state = ANSWERING if fmt is None else IN_THINKING if fmt.opened_by_prompt else STARTING
        self.had_block = self.state == IN_THINKING
        self.had_header = False
        self._held = ""          # text not given out yet: it may still be (part of) a tag
        self._strip = True       # drop whitespace at the start of the current part

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """The parts that ``piece`` (appended to what came before) decides: (kind, text)
        pairs in order, with no empty text."""
        out: list[tuple[str, str]] = []
        text = self._held + piece
        self._held = ""
        fmt = self.fmt
        while text:
            if self.state == ANSWERING or fmt is None:
                if fmt is None or not self._strip:
                    out.append((ANSWER, text))
                    text = ""
                else:
                    rest = text.lstrip()
                    if rest:
                        self._strip = False
                        out.append((ANSWER, rest))
                    text = ""
            elif self.state == STARTING:
                rest = text.lstrip()
                tag = fmt.open_tag
                header = fmt.answer_tag
                if rest.startswith(tag):
                    self.state, self.had_block, self._strip = IN_THINKING, True, True
                    text = rest[len(tag):]
                elif header and rest.startswith(header):
                    self.state, self.had_header, self._strip = ANSWERING, True, True
                    text = rest[len(header):]
                elif tag.startswith(rest) or header.startswith(rest):
                    self._held = text          # whitespace and a part of the tag, or nothing
                    text = ""
                else:
                    self.state, self._strip = ANSWERING, False
            else:                              # IN_THINKING
                if self._strip:
                    text = text.lstrip()
                    if not text:
                        break
                    self._strip = False
                tag = fmt.close_tag
                end = text.find(tag)
                if end >= 0:
                    thought = text[:end].rstrip()
                    if thought:
                        out.append((THINKING, thought))
                    self.state, self._strip = ANSWERING, True
                    text = text[end + len(tag):]
                    continue
                keep = _tail_to_hold(text, tag)
                if keep < len(text):
                    out.append((THINKING, text[:len(text) - keep]))
                self._held = text[len(text) - keep:]
                text = ""
        return _merged(out)

    def finish(self) -> list[tuple[str, str]]:
        """The answer ended: what was held back, given out as what it is now."""
        held, self._held = self._held, ""
        if not held:
            return []
        if self.state == STARTING:
            self.state = ANSWERING
            return [(ANSWER, held)] if held.strip() else []
        if self.state == IN_THINKING:
            held = held.rstrip()
            return [(THINKING, held)] if held else []
        return [(ANSWER, held)]


def _tail_to_hold(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` must wait: trailing whitespace (the
    thinking's end is dropped before the tag) and a start of ``tag``."""
    keep = 0
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            keep = k
            break
    body = text[:len(text) - keep]
    return keep + len(body) - len(body.rstrip())


def _merged(parts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for kind, text in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        elif text:
            out.append((kind, text))
    return out


def thinking_tokens(pieces: Sequence[bytes], fmt: ThinkFormat | None) -> int:
    """How many of an answer's tokens (``pieces``: their bytes, in order) are its thinking:
    every one up to the token that completes the block's closing tag; all of them while the
    block is still open; none when the answer has no block."""
    whole = b"".join(pieces)
    parts = split(whole.decode("utf-8", "replace"), fmt)
    if fmt is None or not parts.block:
        return 0
    end = whole.find(fmt.close_tag.encode())
    if end < 0:
        return len(pieces)
    end += len(fmt.close_tag.encode())
    seen = 0
    for n, piece in enumerate(pieces, 1):
        seen += len(piece)
        if seen >= end:
            return n
    return len(pieces)


def split(text: str, fmt: ThinkFormat | None, *, final: bool = True, before: str = "") -> Parts:
    """``text`` (a whole answer, or all of it so far when not ``final``) in its parts.

    ``before``: the answer's text before ``text`` (a paused answer resumed), which decides
    where ``text`` begins but is not part of the result.
    """
    splitter = Splitter(fmt)
    if before:
        splitter.feed(before)
    pieces = splitter.feed(text) + (splitter.finish() if final else [])
    thinking = "".join(t for kind, t in pieces if kind == THINKING)
    answer = "".join(t for kind, t in pieces if kind == ANSWER)
    return Parts(thinking, answer, splitter.state, splitter.had_block, splitter.had_header)
