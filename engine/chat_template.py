"""Rendering a conversation with the model's own chat template.

First choice is llama.cpp's ``llama_chat_apply_template``, which recognises the common
templates by their text.  When it does not (it returns an error for templates it does
not know), the GGUF's Jinja template is rendered with jinja2 in a sandbox.  A model with
no template at all gets a plain "User:/Assistant:" transcript.

A template that exists but cannot be rendered also falls back to the plain transcript —
the chat goes on, but the model answers worse — and :func:`template_problem` says why,
so the front ends can tell the user once instead of leaving the reason in a log.

A model that thinks before it answers (:func:`think_format`, read from its template) is
rendered with its Jinja template first: llama.cpp's built-in renderings know nothing of
thinking.  Each past answer goes in as its final text (``content``) and its thinking
(``reasoning_content``), as llama-server passes them; the template decides what of the
thinking goes back into the prompt (Qwen3's drops the thinking of answers before the
last user message).  An answer's stored text is what the model wrote, tags included
(engine.reasoning), so the split happens here, on every rendering, by the one rule.

Templates that write today's date (``strftime_now``: gpt-oss's system header, Llama 3's)
get the date the conversation began (``now``), not the day it is rendered: a conversation
continued the next day must render the same prompt, or its whole cache would be read
again from the date on.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence

from engine.reasoning import ThinkFormat, format_of, split

log = logging.getLogger("engine")

Message = tuple[str, str]  # (role, content)

# model -> why its template could not be used (weak: a closed model takes its entry along)
_problems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# model -> (its ThinkFormat or None,), read once from its template
_formats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def template_problem(model) -> str | None:
    """Why ``model``'s own chat template could not be used, or None (it could, or it has none)."""
    return _problems.get(model)


def think_format(model) -> ThinkFormat | None:
    """How ``model`` marks its thinking, from its chat template; None: it does not think."""
    known = _formats.get(model)
    if known is None:
        template = model.chat_template
        probe = render_jinja(template, [("user", "Hi")], True, quiet=True) if template else None
        known = _formats[model] = (format_of(template, probe),)
    return known[0]


def _message(role: str, content: str, think: ThinkFormat | None) -> dict:
    """One message as a template reads it; an answer's thinking apart from its text
    (``reasoning_content`` as llama-server names it, ``thinking`` as gpt-oss's template
    does), and its final text without the channel header it began with (gpt-oss)."""
    if think is None or role != "assistant":
        return {"role": role, "content": content}
    parts = split(content, think)
    if not parts.block and not parts.headed:
        return {"role": role, "content": content}
    if not parts.block:
        return {"role": role, "content": parts.answer}
    return {"role": role, "content": parts.answer, "reasoning_content": parts.thinking,
            "thinking": parts.thinking}


def render_jinja(template: str, messages: Sequence[Message], add_assistant: bool,
                 bos: str = "", eos: str = "", problems: list[str] | None = None, *,
                 think: ThinkFormat | None = None, quiet: bool = False,
                 now: float | None = None) -> str | None:
    """``messages`` rendered by the Jinja ``template``, or None when it fails (``problems``
    gets why; ``quiet``: nothing logged).  With ``think``, answers are split (_message).
    ``now``: the time ``strftime_now`` gives (the conversation's start; default: now)."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        when = time.localtime(time.time() if now is None else now)
        env.globals["strftime_now"] = lambda fmt: time.strftime(fmt, when)
        return env.from_string(template).render(
            messages=[_message(r, c, think) for r, c in messages],
            add_generation_prompt=add_assistant, bos_token=bos, eos_token=eos)
    except Exception as exc:  # a broken template must not break the chat
        if not quiet:
            log.warning("the model's chat template could not be rendered: %s", exc)
        if problems is not None:
            problems.append(f"{type(exc).__name__}: {exc}")
        return None


def render_plain(messages: Sequence[Message], add_assistant: bool) -> str:
    """A plain transcript.  An answer follows "Assistant:" exactly as the model wrote it
    (its leading space included), so the rendered conversation continues the text the
    model saw token for token (engine.generation keeps the tokens, not a re-tokenising)."""
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    text = "".join(f"Assistant:{c}\n\n" if r == "assistant" else f"{names.get(r, r.title())}: {c}\n\n"
                   for r, c in messages)
    return text + ("Assistant:" if add_assistant else "")


def render(model, messages: Sequence[Message], add_assistant: bool, *, now: float | None = None) -> str:
    """The prompt text for ``messages`` under ``model``'s template (``now``: the time a
    template's date comes from, the conversation's start: see the module docstring)."""
    problems: list[str] = []
    text = _render_template(model, messages, add_assistant, problems, now)
    if text is not None:
        return text
    if model.chat_template:
        _problems[model] = (f"the model's chat template could not be used ({problems[0]}); the "
                            "conversation is sent as a plain User:/Assistant: transcript, which "
                            "the model may answer worse")
    return render_plain(messages, add_assistant)


def render_quietly(model, messages: Sequence[Message], add_assistant: bool, *,
                   now: float | None = None) -> str | None:
    """:func:`render`'s text where the model's template renders ``messages``, else None:
    nothing logged or told to the user (a probe, e.g. engine.generation.turn_marks, may
    give a template messages it refuses, such as a system prompt without a user message)."""
    return _render_template(model, messages, add_assistant, None, now)


def _render_template(model, messages: Sequence[Message], add_assistant: bool,
                     problems: list[str] | None, now: float | None = None) -> str | None:
    """The template's text (the model's own Jinja where it thinks, then llama.cpp's
    built-in templates, then the Jinja), or the plain transcript when the model has no
    template; None when its template fails (``problems`` gets why, and it is logged; no
    list: a quiet probe)."""
    quiet = problems is None
    think = think_format(model)
    if think is not None:
        text = render_jinja(model.chat_template, messages, add_assistant, problems=problems, think=think,
                            quiet=quiet, now=now)
        if text is not None:
            return text
    text = model.apply_chat_template_native(messages, add_assistant)
    if text is not None:
        return text
    template = model.chat_template
    if not template:
        return render_plain(messages, add_assistant)
    if think is not None:
        return None   # its Jinja failed above already
    return render_jinja(template, messages, add_assistant, problems=problems, quiet=quiet, now=now)
