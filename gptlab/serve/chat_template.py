"""Chat messages -> one prompt text.

A tokenizer with a chat template (Jinja, as Hugging Face tokenizers ship them) renders the messages itself,
sandboxed, with add_generation_prompt. A base model has none: its prompt is one "Role: content" line per
message ("System: ...", "User: ...", "Assistant: ...") and then "Assistant:", and since nothing in such a model
marks the end of its turn, generation also stops where it starts writing the user's next line
(DEFAULT_CHAT_STOP).
"""

from __future__ import annotations

import time
from typing import Any

from gptlab.serve.schemas import ApiError

DEFAULT_CHAT_STOP = "\nUser:"


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text for `messages`, and whether it came from the tokenizer's own template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        lines = [f"{m['role'].capitalize()}: {m['content']}\n" for m in messages]
        return "".join(lines) + "Assistant:", False
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:  # templates call it to reject a conversation
        raise TemplateError(message)

    def token(i: int | None) -> str:
        return tokenizer.decode([i]) if i is not None else ""

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: time.strftime(fmt))
    try:
        text = env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=token(getattr(tokenizer, "bos_id", None)),
            eos_token=token(getattr(tokenizer, "eot_id", None)),
        )
    except TemplateError as e:
        raise ApiError(400, f"the chat template could not render these messages: {e}", param="messages") from e
    return text, True
