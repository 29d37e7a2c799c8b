"""How a chat template writes an assistant's tool calls, found by rendering it, and model output read back as calls.

A template that takes `tools` (Qwen's, Llama 3.1's, Hermes') also renders the assistant's earlier calls, in the
form the model was trained to write them. `tool_syntax` renders a probe conversation whose assistant calls a probe
function and reads that form off the text: what comes before the function's name (`prefix`, e.g. Qwen's
`<tool_call>\\n{"name": "`), between the name and the arguments' JSON (`middle`, `", "arguments": `), after the
arguments (`suffix`, `}\\n</tool_call>`), and between two calls (`separator`, `\\n`; `parallel` is False where the
template refuses two calls in one turn, as Llama 3.1's does). One mechanism for every template, no table per family:
the grammar that makes a model write calls (`generation.tool_calls`) and the parser that reads them back
(`split_reply`) are both built from these four strings.

`split_reply(text, syntax)` reads a reply: text that starts with the call prefix is calls (name, arguments' JSON
text), anything else is content. It reads any prefix of a reply as a prefix of what the whole reads as (an
unfinished call's arguments so far), so that a stream of replies' beginnings gives deltas that add up to the whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from gptlab.tokenizer.chat_template import (
    BrokenChatTemplateError,
    ChatTemplate,
    ChatTemplateError,
    turn_end_stops,
)

_NAMES = ("gptlab_probe_one", "gptlab_probe_two")
_ARG = "gptlab_probe_argument"


class NoToolSupportError(ChatTemplateError):
    """The chat template does not render tools, or renders an assistant's tool calls in a form gptlab cannot read
    back."""


@dataclass(frozen=True)
class ToolSyntax:
    """A call to NAME with arguments ARGS is written prefix + NAME + middle + ARGS (JSON) + suffix; calls of one
    turn are joined by `separator`, and only one is allowed where `parallel` is False."""

    prefix: str
    middle: str
    suffix: str
    separator: str = ""
    parallel: bool = True

    def call_text(self, name: str, arguments: str) -> str:
        return self.prefix + name + self.middle + arguments + self.suffix


@dataclass
class Reply:
    """A reply read back: its content (text) and its calls as [name, arguments' JSON text] (the last one perhaps
    unfinished: a name still being written is left out, arguments cut short are kept as they are)."""

    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)
    cut: bool = False  # the text ends inside a call (its name or arguments unfinished), not between whole calls


def _probe_tool(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {_ARG: {"type": "integer"}}}
    return {"type": "function", "function": {"name": name, "description": "a probe", "parameters": parameters}}


def _probe_calls(count: int) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": _NAMES[i], "arguments": {_ARG: i}}}
        for i in range(count)]}


def _syntax_of(template: ChatTemplate) -> ToolSyntax:
    label = template.label
    user = [{"role": "user", "content": "Hi"}]
    tools = [_probe_tool(n) for n in _NAMES]
    try:
        prompt, one = template.render_many([(user, True), (user + [_probe_calls(1)], False)], tools)
    except BrokenChatTemplateError:
        raise
    except ChatTemplateError as e:
        raise NoToolSupportError(f"{label} cannot render a conversation with tools ({e})") from e
    if _NAMES[0] not in prompt:
        raise NoToolSupportError(f"{label} does not render tools: this model was not trained to call them")
    rest = one[len(prompt):] if one.startswith(prompt) else ""
    args = json.dumps({_ARG: 0})
    at = rest.find(_NAMES[0])
    start = rest.find(args, at + len(_NAMES[0])) if at >= 0 else -1
    if start < 0:
        raise NoToolSupportError(f"{label} does not render an assistant's tool calls as a name and JSON arguments, "
                                 "the form gptlab reads back")
    tail = rest[start + len(args):]
    end = next((tail.find(stop) for stop in turn_end_stops(template) if stop in tail), len(tail))
    suffix = tail[:end] if end < len(tail) else tail.rstrip()  # (no turn end found: what follows, but whitespace)
    syntax = ToolSyntax(rest[:at], rest[at + len(_NAMES[0]):start], suffix)
    if not syntax.prefix.strip():
        raise NoToolSupportError(f"{label} writes tool calls without a marker that tells them from text")
    return _with_separator(template, syntax, user, tools, prompt)


def _with_separator(template: ChatTemplate, syntax: ToolSyntax, user: list, tools: list, prompt: str) -> ToolSyntax:
    """The syntax with what joins two calls of one turn, or parallel=False where the template refuses two."""
    try:
        (two,) = template.render_many([(user + [_probe_calls(2)], False)], tools)
    except ChatTemplateError:
        return ToolSyntax(syntax.prefix, syntax.middle, syntax.suffix, parallel=False)
    first = prompt + syntax.call_text(_NAMES[0], json.dumps({_ARG: 0}))
    second = syntax.call_text(_NAMES[1], json.dumps({_ARG: 1}))
    at = two.find(second, len(first))
    if not two.startswith(first) or at < 0:
        return ToolSyntax(syntax.prefix, syntax.middle, syntax.suffix, parallel=False)
    return ToolSyntax(syntax.prefix, syntax.middle, syntax.suffix, two[len(first):at], parallel=True)


_FOUND: dict[tuple[str, str, str], ToolSyntax | NoToolSupportError] = {}  # by template: (source, bos, eos)
_FOUND_KEPT = 8


def tool_syntax(template: ChatTemplate) -> ToolSyntax:
    """How `template` writes tool calls (rendered once per template); NoToolSupportError, naming the template, where
    it takes no tools or writes calls in a form gptlab cannot read back. A broken template's error goes on."""
    key = (template.source, template.bos_token, template.eos_token)
    if key not in _FOUND:
        try:
            found: ToolSyntax | NoToolSupportError = _syntax_of(template)
        except NoToolSupportError as e:
            found = e
        if len(_FOUND) >= _FOUND_KEPT:
            _FOUND.pop(next(iter(_FOUND)))
        _FOUND[key] = found
    if isinstance(_FOUND[key], NoToolSupportError):
        raise NoToolSupportError(str(_FOUND[key]))
    return _FOUND[key]


_JSON = json.JSONDecoder()


def split_reply(text: str, syntax: ToolSyntax) -> Reply:
    """`text` read as content or as calls (see the module docstring). Text that may still become the call prefix is
    neither yet; `final_reply` decides it."""
    if not text.startswith(syntax.prefix):
        return Reply() if syntax.prefix.startswith(text) else Reply(content=text)
    reply, at = Reply(), 0
    while text.startswith(syntax.prefix, at):
        name_at = at + len(syntax.prefix)
        middle = text.find(syntax.middle, name_at)
        if middle < 0:
            reply.cut = True  # the name is still being written
            break
        args_at = middle + len(syntax.middle)
        try:
            _, args_end = _JSON.raw_decode(text, args_at)
        except json.JSONDecodeError:  # unfinished: the arguments so far
            reply.calls.append((text[name_at:middle], text[args_at:]))
            reply.cut = True
            break
        reply.calls.append((text[name_at:middle], text[args_at:args_end]))
        at = args_end + len(syntax.suffix) + len(syntax.separator)
    reply.cut = reply.cut or at < len(text)  # (past the last whole call: the beginning of the next one's prefix)
    return reply


def final_reply(text: str, syntax: ToolSyntax, forced: bool = False) -> Reply:
    """A finished reply read back: text that was still undecided is content, unless the reply could only be calls
    (`forced`: tool_choice "required" or a function's name), where it is a call cut short before its name."""
    reply = split_reply(text, syntax)
    return Reply(content=text) if not (forced or reply.calls or text.startswith(syntax.prefix)) else reply

