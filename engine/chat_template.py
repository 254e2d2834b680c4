"""Rendering a conversation with the model's own chat template.

First choice is llama.cpp's ``llama_chat_apply_template``, which recognises the common
templates by their text.  When it does not (it returns an error for templates it does
not know), the GGUF's Jinja template is rendered with jinja2 in a sandbox.  A model with
no template at all gets a plain "User:/Assistant:" transcript.
"""

from __future__ import annotations

import logging
from typing import Sequence

log = logging.getLogger("engine")

Message = tuple[str, str]  # (role, content)


def render_jinja(template: str, messages: Sequence[Message], add_assistant: bool,
                 bos: str = "", eos: str = "") -> str | None:
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
        return None


def render_plain(messages: Sequence[Message], add_assistant: bool) -> str:
    names = {"system": "System", "user": "User", "assistant": "Assistant"}
    text = "".join(f"{names.get(r, r.title())}: {c}\n\n" for r, c in messages)
    return text + ("Assistant:" if add_assistant else "")


def render(model, messages: Sequence[Message], add_assistant: bool) -> str:
    """The prompt text for ``messages`` under ``model``'s template."""
    text = model.apply_chat_template_native(messages, add_assistant)
    if text is not None:
        return text
    template = model.chat_template
    if template:
        text = render_jinja(template, messages, add_assistant)
        if text is not None:
            return text
    return render_plain(messages, add_assistant)
