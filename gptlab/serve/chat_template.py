"""Chat messages -> one prompt text, through `gptlab.tokenizer.chat_template` (the tokenizer's own Jinja template,
or the built-in "plain" one for a base model). Under "plain" nothing in the model marks the end of its turn, so
generation also stops where it starts writing the user's next line (DEFAULT_CHAT_STOP)."""

from __future__ import annotations

from typing import Any

from gptlab.serve.schemas import ApiError
from gptlab.tokenizer.chat_template import BUILTIN_STOPS, ChatTemplateError, chat_template_for

DEFAULT_CHAT_STOP = BUILTIN_STOPS["plain"][0]


def render_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text for `messages`, and whether it came from the tokenizer's own template."""
    template = chat_template_for(tokenizer)
    try:
        text = template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from e
    return text, template.name == "tokenizer"
