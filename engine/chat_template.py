"""Rendering a conversation with the model's own chat template.

First choice is llama.cpp's ``llama_chat_apply_template``, which recognises the common
templates by their text.  When it does not (it returns an error for templates it does
not know), the GGUF's Jinja template is rendered with jinja2 in a sandbox.  A model with
no template at all gets a plain "User:/Assistant:" transcript.

A template that exists but cannot be rendered also falls back to the plain transcript —
the chat goes on, but the model answers worse — and :func:`template_problem` says why,
so the front ends can tell the user once instead of leaving the reason in a log.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

log = logging.getLogger("engine")

Message = tuple[str, str]  # (role, content)

# model -> why its template could not be used (weak: a closed model takes its entry along)
_problems: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def template_problem(model) -> str | None:
    """Why ``model``'s own chat template could not be used, or None (it could, or it has none)."""
    return _problems.get(model)


def render_jinja(template: str, messages: Sequence[Message], add_assistant: bool,
                 bos: str = "", eos: str = "", problems: list[str] | None = None) -> str | None:
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(template).render(
            messages=[{"role": r, "content": c} for r, c in messages],
            add_generation_prompt=add_assistant, bos_token=bos, eos_token=eos)
    except Exception as exc:  # a broken template must not break the chat
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


def render(model, messages: Sequence[Message], add_assistant: bool) -> str:
    """The prompt text for ``messages`` under ``model``'s template."""
    text = model.apply_chat_template_native(messages, add_assistant)
    if text is not None:
        return text
    template = model.chat_template
    if template:
        problems: list[str] = []
        text = render_jinja(template, messages, add_assistant, problems=problems)
        if text is not None:
            return text
        _problems[model] = (f"the model's chat template could not be used ({problems[0]}); the "
                            "conversation is sent as a plain User:/Assistant: transcript, which "
                            "the model may answer worse")
    return render_plain(messages, add_assistant)
