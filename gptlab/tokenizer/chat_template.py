"""Chat messages -> text, the way the model was (or will be) trained to read them.

A Hugging Face tokenizer ships its chat format as a Jinja template (`chat_template` in tokenizer_config.json or
chat_template.jinja). gptlab renders it as transformers' `apply_chat_template` does: a sandboxed environment with
trim_blocks and lstrip_blocks, the loop-control extension, `raise_exception` and `strftime_now`, `tojson` that
keeps non-ASCII text, and the special tokens as strings. A tokenizer without one (char, GPT-2, a base model) gets
a built-in template by name: "plain" ("User: ..." lines, what a base model continues most naturally) or "chatml"
(`<|im_start|>role ... <|im_end|>`).

The rendered text is encoded with `allow_special=True`, so the template's special-token strings become their ids.

Training on chats needs more than the text: a loss mask that counts only what the assistant says. `segments`
finds it by rendering prefixes of the conversation: the span from the prompt for turn i (the messages before it
plus the generation prompt) to the conversation through turn i is the assistant's reply, its end-of-turn marker
included, exactly the text a model must produce at inference after the same prompt. What a template writes after
that marker (ChatML's newline after <|im_end|>) is never generated, since generation stops at the marker, so it
is not part of the reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gptlab.errors import GptlabError
from gptlab.tokenizer.template_sandbox import TemplateFault, compile_template, render_all
from gptlab.tokenizer.template_worker import render_isolated

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

ROLES = ("system", "user", "assistant", "tool")

BUILTIN_TEMPLATES: dict[str, str] = {
    # a base model's view of a chat: one "Role: content" line each, then "Assistant:" to continue
    "plain": (
        "{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}Assistant:{% endif %}"
    ),
    "chatml": (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
}
# where generation stops under a built-in template: nothing in a base model's vocabulary ends a turn
BUILTIN_STOPS: dict[str, list[str]] = {"plain": ["\nUser:"], "chatml": ["<|im_end|>"]}


_ISOLATED = "compiled in the worker process"  # ChatTemplate._compiled of a template that runs there


class ChatTemplateError(GptlabError):
    """A conversation the template cannot render (it raised, or it is not made of prefix-stable turns)."""


class BrokenChatTemplateError(ChatTemplateError):
    """A template that cannot render any conversation: not valid Jinja, loading other templates, or running past
    the bounds on time or size (`template_sandbox`)."""


@dataclass
class ChatTemplate:
    """A Jinja chat template with the special-token strings it renders; `stop` are the strings that end the
    assistant's turn when the model has no end-of-turn token of its own (built-in templates); `origin` is the
    file it was read from, named in its errors."""

    source: str
    name: str = "tokenizer"
    bos_token: str = ""
    eos_token: str = ""
    stop: list[str] = field(default_factory=list)
    origin: str | None = None
    _compiled: Any = field(default=None, repr=False, compare=False)
    _turn_end: list[str] | None = field(default=None, repr=False, compare=False)  # `turn_end_stops`, found once

    def render(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = False,
               tools: Sequence[dict[str, Any]] | None = None) -> str:
        """The text of `messages`, plus the assistant's opening when `add_generation_prompt`; `tools` are the
        functions the model may call (OpenAI's {"type": "function", "function": {...}} objects), as transformers
        passes them."""
        return self.render_many([(messages, add_generation_prompt)], tools)[0]

    def render_many(self, conversations: Sequence[tuple[Sequence[dict[str, Any]], bool]],
                    tools: Sequence[dict[str, Any]] | None = None) -> list[str]:
        """`render` of each (messages, add_generation_prompt), with the same tools, in one trip to the worker
        process."""
        self.compile()
        tools = None if tools is None else list(tools)
        contexts = [dict(messages=list(messages), add_generation_prompt=add_generation_prompt, tools=tools,
                         documents=None, bos_token=self.bos_token, eos_token=self.eos_token)
                    for messages, add_generation_prompt in conversations]
        try:
            if self._compiled is _ISOLATED:
                return render_isolated(self.source, contexts)
            return render_all(self._compiled, contexts)
        except TemplateFault as e:
            raise (BrokenChatTemplateError if e.broken else ChatTemplateError)(f"{self.label} {e}") from e

    def compile(self) -> None:
        """Compile the template once; BrokenChatTemplateError naming its file when it is not one gptlab runs. A
        built-in template is trusted and runs here; any other runs in a worker process (`template_worker`)."""
        if self._compiled is None:
            try:
                if self.source in BUILTIN_TEMPLATES.values():
                    self._compiled = compile_template(self.source)
                else:
                    render_isolated(self.source, [])
                    self._compiled = _ISOLATED
            except TemplateFault as e:
                raise BrokenChatTemplateError(f"{self.label} {e}") from e

    @property
    def label(self) -> str:
        """How errors name this template: its file where it has one."""
        return f"the chat template in {self.origin}" if self.origin else f"the {self.name} chat template"

    def segments(self, messages: Sequence[dict[str, Any]]) -> list[tuple[str, bool]]:
        """The whole conversation as (text, is_assistant_reply) pieces that concatenate to `render(messages)`."""
        # every text needed, in one rendering: the whole, then each reply's prompt (the one before an opening reply
        # is `_first_prompt`'s) and the conversation through it
        replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        texts = iter(self.render_many([(messages, False)] + [c for i in replies for c in (
            [(messages[:i], True)] if i else []) + [(messages[: i + 1], False)]]))
        full = next(texts)
        rendered = {i: (next(texts) if i else self._first_prompt(full), next(texts)) for i in replies}
        pieces: list[tuple[str, bool]] = []
        done = 0  # characters of `full` already assigned to a piece

        def add(end: int, is_reply: bool) -> None:
            nonlocal done
            if end > done:
                if pieces and pieces[-1][1] == is_reply:
                    pieces[-1] = (pieces[-1][0] + full[done:end], is_reply)
                else:
                    pieces.append((full[done:end], is_reply))
                done = end

        for i, (prompt, through) in rendered.items():
            message = messages[i]
            if not (full.startswith(prompt) and full.startswith(through) and done <= len(prompt) <= len(through)):
                raise ChatTemplateError(
                    f"{self.label} renders turn {i + 1} differently inside the conversation than "
                    "on its own (it rewrites earlier turns), so the assistant's tokens cannot be located"
                )
            add(len(prompt), False)
            add(self._reply_end(full, len(prompt), len(through), message["content"]), True)
            add(len(through), False)  # what the template writes after the end-of-turn marker (e.g. "\n")
        add(len(full), False)
        return pieces

    def _first_prompt(self, full: str) -> str:
        """The prompt before a conversation's opening assistant turn: the generation prompt of no messages when
        the template renders one that the conversation starts with, else nothing."""
        try:
            prompt = self.render([], add_generation_prompt=True)
        except ChatTemplateError:
            return ""
        return prompt if full.startswith(prompt) else ""

    def _reply_end(self, full: str, start: int, end: int, content: str) -> int:
        """Where the reply in full[start:end] ends: right after its end-of-turn marker, since generation stops
        there and what a template writes after it (ChatML's newline after <|im_end|>) is never generated. The
        marker is the eos token or a stop string when one follows the content, else the text the template
        writes after the content, trailing whitespace dropped (as `generation.chat` finds its stop strings). A
        template that writes only whitespace there ("plain": "\\n") ends the turn with it: the reply keeps it."""
        at = full.find(content, start, end) if content else -1
        after = at + len(content) if at >= 0 else start
        markers = [m for m in (self.eos_token, *self.stop) if m]
        ends = [i + len(m) for m in markers if (i := full.find(m, after, end)) >= 0]
        if ends:
            return min(ends)
        tail = full[after:end].rstrip()
        return after + len(tail) if tail else end


def check_messages(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """`messages` as a list of {"role", "content"} dicts, or a one-line error naming `where` and the fault."""
    if not isinstance(messages, list):
        raise GptlabError(f"{where}: expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise GptlabError(f"{where}: the conversation is empty")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise GptlabError(f"{where}[{i}]: expected an object with role and content")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise GptlabError(f"{where}[{i}]: unknown role {role!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise GptlabError(f"{where}[{i}]: content must be a string, got {type(content).__name__}")
        checked.append({"role": role, "content": content})
    return checked


def chat_template_for(tokenizer: TextTokenizer, name: str | None = None) -> ChatTemplate:
    """The template to use with `tokenizer`: the built-in `name` if given, else the tokenizer's own, else
    "plain"."""
    if name is not None and name not in BUILTIN_TEMPLATES:
        raise GptlabError(f"unknown chat template {name!r}: choose {' or '.join(BUILTIN_TEMPLATES)}, or leave it "
                          "out to use the tokenizer's own")
    own = getattr(tokenizer, "chat_template", None)
    if name is None and own:
        source, stop = own, []
    else:
        name = name or "plain"
        source, stop = BUILTIN_TEMPLATES[name], list(BUILTIN_STOPS[name])

    def token(i: int | None) -> str:
        return tokenizer.decode([i]) if i is not None else ""

    origin = getattr(tokenizer, "chat_template_file", None) if name is None else None
    return ChatTemplate(source=source, name=name or "tokenizer", bos_token=token(getattr(tokenizer, "bos_id", None)),
                        eos_token=token(getattr(tokenizer, "eot_id", None)), stop=stop, origin=origin)


_PROBE = "GPTLAB-END-OF-REPLY-PROBE"  # a reply text no template changes, to find what follows a reply


def turn_end_stops(template: ChatTemplate) -> list[str]:
    """The text `template` writes after an assistant message (whitespace stripped), as a stop string: a model
    trained on the template writes it to end its turn. Empty when the template writes only whitespace there
    (e.g. "plain") or rejects the sample conversation; a broken template's error (not Jinja, too slow) goes on.
    Rendered once per template: a server asks on every chat request."""
    if template._turn_end is None:
        try:
            text = template.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}])
        except BrokenChatTemplateError:
            raise
        except ChatTemplateError:
            text = ""
        at = text.rfind(_PROBE)
        tail = text[at + len(_PROBE) :].strip() if at >= 0 else ""
        template._turn_end = [tail] if tail else []
    return list(template._turn_end)


def reply_stops(template: ChatTemplate, user_stops: Sequence[str] = ()) -> tuple[str, ...]:
    """Where a reply under `template` stops: the user's stop strings, then the template's own (a built-in's, e.g.
    "plain"'s "\nUser:"), then what it writes after a reply (`turn_end_stops`), each once. The one policy of
    `gptlab chat`, `/v1/chat/completions` and the web page's chat."""
    return tuple(dict.fromkeys([*user_stops, *template.stop, *turn_end_stops(template)]))

