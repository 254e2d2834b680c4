"""A conversation: messages, the answer in progress, settings and its token list.

Pure data: it serialises to the JSON metadata block of a checkpoint and back, and
holds no native object.  ``tokens`` is the whole sequence the model has seen or is
about to see: the rendered prompt followed by the tokens generated for the current
answer.  The generator keeps it in step with the KV cache.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.sampling import SamplerSettings

ROLES = ("system", "user", "assistant")


#: marks an answer's prompt may carry (Answer.marks)
MAX_MARKS = 4


@dataclass
class Answer:
    """The assistant answer being generated (or paused, or just finished)."""
    text: str = ""
    n_prompt_tokens: int = 0     # length of the prompt this answer continues
    n_generated: int = 0
    n_predict: int = -1          # answer length limit in tokens (-1: until the context is full)
    finish_reason: str | None = None   # None while unfinished; "stop", "length", "stop_string", "context_full"
    emitted: int = 0             # characters of ``text`` already shown (the rest may be a stop string's start)
    pending: bytes = b""         # trailing bytes of an incomplete UTF-8 character
    #: token counts inside the prompt where its user turn starts and ends (ascending, each
    #: 0 < mark < n_prompt_tokens): a recurrent memory cuts its prefill there and keeps a
    #: snapshot (engine.snapshots), so an Edit of the turn, or a next turn whose template
    #: rewrites this answer, reads from there instead of from the start
    marks: tuple[int, ...] = ()
    #: where a prefix this prompt shares with another stored conversation ends, when the
    #: memory cannot build on that one's file there (a recurrent part, a sliding window:
    #: engine.prefix_reuse.shareable_end); 0: none.  The prefill is cut there too, and the
    #: first save stores that prefix once (engine.shared_prefix), so the next conversation
    #: that starts with it (the same document, another question) reads only its own tokens
    shared_end: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cuts(self) -> tuple[int, ...]:
        """Where the prompt's prefill is cut (a recurrent memory keeping a snapshot there):
        its marks and its shared prefix's end."""
        return tuple(sorted({*self.marks, self.shared_end})) if self.shared_end else self.marks

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "n_prompt_tokens": self.n_prompt_tokens,
                "n_generated": self.n_generated, "n_predict": self.n_predict,
                "finish_reason": self.finish_reason, "emitted": self.emitted,
                "pending": self.pending.hex(), "marks": list(self.marks), "shared_end": self.shared_end}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Answer:
        n_prompt = int(data.get("n_prompt_tokens", 0))
        marks = data.get("marks")
        shared_end = data.get("shared_end", 0)
        return cls(text=str(data.get("text", "")),
                   n_prompt_tokens=n_prompt,
                   n_generated=int(data.get("n_generated", 0)),
                   n_predict=int(data.get("n_predict", -1)),
                   finish_reason=data.get("finish_reason"),
                   emitted=int(data.get("emitted", 0)),
                   pending=_hex_bytes(data.get("pending", ""))[:4],
                   # untrusted like every key: only ascending counts inside the prompt
                   marks=tuple(sorted({m for m in marks[:MAX_MARKS] if type(m) is int and 0 < m < n_prompt}))
                   if isinstance(marks, list) else (),
                   shared_end=shared_end if type(shared_end) is int and 0 < shared_end < n_prompt else 0)


def _hex_bytes(value) -> bytes:
    try:
        return bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        return b""


@dataclass
class Conversation:
    id: uuid.UUID = field(default_factory=uuid.uuid4)
    title: str = "New conversation"
    system_prompt: str = ""
    messages: list[tuple[str, str]] = field(default_factory=list)
    answer: Answer | None = None
    sampler: SamplerSettings = field(default_factory=SamplerSettings)
    stop_strings: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    created: float = field(default_factory=time.time)

    def chat_messages(self) -> list[tuple[str, str]]:
        """Messages for the chat template: the system prompt first, if any."""
        head = [("system", self.system_prompt)] if self.system_prompt else []
        return head + list(self.messages)

    def messages_with_answer(self) -> list[tuple[str, str]]:
        """The messages (no system prompt) and the answer in progress, as a Fork counts them."""
        answer = [("assistant", self.answer.text)] if self.answer is not None and not self.answer_committed() else []
        return list(self.messages) + answer

    def transcript(self) -> list[dict[str, Any]]:
        """Messages plus the answer in progress, for display and the metadata block."""
        out: list[dict[str, Any]] = [{"role": r, "content": c} for r, c in self.chat_messages()]
        if self.answer is not None and not self.answer_committed():
            out.append({"role": "assistant", "content": self.answer.text,
                        "complete": self.answer.finished})
        return out

    def answer_committed(self) -> bool:
        return bool(self.answer and self.answer.finished and self.messages
                    and self.messages[-1][0] == "assistant")

    @property
    def paused(self) -> bool:
        """True when an answer was started and not finished."""
        return self.paused_answer is not None

    @property
    def paused_answer(self) -> Answer | None:
        """The answer that was started and not finished, or None."""
        a = self.answer
        return a if a is not None and not a.finished else None

    def interrupt_paused(self) -> None:
        """End a paused answer where it stands (finish reason "interrupted"): what was
        generated so far is kept, and a new message may follow it."""
        a = self.paused_answer
        if a is not None:
            a.finish_reason = "interrupted"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": str(self.id), "title": self.title, "system_prompt": self.system_prompt,
            "messages": [{"role": r, "content": c} for r, c in self.messages],
            "answer": self.answer.to_json() if self.answer else None,
            "sampler": self.sampler.to_json(), "stop_strings": list(self.stop_strings),
            "created": self.created,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], tokens: list[int]) -> Conversation:
        # (a value that cannot be iterated is a TypeError: the file is refused; a transcript
        # shows what it can, transcript_of)
        messages = [m for m in map(_message, data.get("messages", [])) if m is not None]
        answer = data.get("answer")
        try:
            conv_id = uuid.UUID(str(data.get("id")))
        except ValueError:
            conv_id = uuid.uuid4()
        stops = [s for s in data.get("stop_strings", []) if isinstance(s, str) and s]
        sampler = data.get("sampler")
        return cls(
            id=conv_id, title=str(data.get("title", "Conversation")),
            system_prompt=str(data.get("system_prompt", "")), messages=messages,
            answer=Answer.from_json(answer) if isinstance(answer, dict) else None,
            sampler=SamplerSettings.from_json(sampler) if isinstance(sampler, dict) else SamplerSettings(),
            stop_strings=stops, tokens=list(tokens),
            created=float(data.get("created", time.time())))


def _message(item: Any) -> tuple[str, str] | None:
    """One message of a conversation's JSON (untrusted), or None when it cannot be read."""
    if isinstance(item, dict) and item.get("role") in ROLES and isinstance(item.get("content"), str):
        return item["role"], item["content"]
    return None


def transcript_of(meta: dict[str, Any]) -> list[dict[str, Any]]:
    """The transcript a checkpoint's metadata holds, for display: its conversation's
    (:meth:`Conversation.transcript`, read field by field: a mistyped setting loses no
    message), or, in a file written before the metadata held the messages once
    (2026-12-04), its ``transcript`` key when the conversation shows nothing.  The
    metadata is untrusted: what cannot be read is left out, never an exception."""
    data = meta.get("conversation")
    shown: list[dict[str, Any]] = []
    if isinstance(data, dict):
        system, answer = data.get("system_prompt"), data.get("answer")
        try:
            read = Answer.from_json(answer) if isinstance(answer, dict) else None
        except (TypeError, ValueError, AttributeError, OverflowError):
            read = None
        items = data.get("messages")
        messages = [m for m in map(_message, items if isinstance(items, list) else []) if m is not None]
        shown = Conversation(system_prompt=system if isinstance(system, str) else "",
                             messages=messages, answer=read).transcript()
    written = meta.get("transcript")
    return shown or ([e for e in written if isinstance(e, dict) and isinstance(e.get("role"), str)
                      and isinstance(e.get("content"), str)] if isinstance(written, list) else [])


def title_from(text: str, limit: int = 48) -> str:
    """A conversation title from its first user message."""
    words = " ".join(text.split())
    return words if len(words) <= limit else words[:limit - 1].rstrip() + "…"
