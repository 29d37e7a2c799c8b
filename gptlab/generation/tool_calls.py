"""Tool calls: the grammar that lets a model call only the functions it was given, with arguments that satisfy
each function's JSON schema, written in its chat template's own call syntax (`tokenizer.tool_syntax`).

`tool_grammar(syntax, tools, choice, parallel)` is a llguidance grammar (Lark) for `SamplingParams.grammar`, by
OpenAI's `tool_choice`:

* "auto": text, or calls: a reply that starts with the call prefix is calls, so text never starts with it;
* "none": text only (never the call prefix), the tools still shown to the model by the template;
* "required": one or more calls; a function's name: exactly one call, to it.

A `content_schema` (response_format's JSON schema) makes the text JSON of that schema: the reply is that JSON or
calls under "auto", that JSON under "none"; calls have no content, so "required" and a name ignore it. Under
"auto" a reply is read as calls when it starts with the call prefix, so a template whose calls are bare JSON
(Llama 3.1's `{"name": ...`) cannot tell the two apart: `ContentLooksLikeCalls`.

Calls of one turn are joined by the template's separator; one at most where `parallel` is False or the template
renders only one per turn. A call's arguments are the function's `parameters` schema (an object) through
llguidance's JSON schema support, with the separators `tojson` writes (", " and ": "), as the template renders
calls fed back. The grammar ends after the last call allowed, or where the row's end-of-text token is taken.

`generate_tool_reply` is the Python API's one turn: messages (transformers' shape) and tools through the template,
the reply generated under that grammar and read back (`tokenizer.tool_syntax.final_reply`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from gptlab.errors import GptlabError
from gptlab.generation.api import generate_batch
from gptlab.generation.params import SamplingParams, checked_json_schema
from gptlab.tokenizer.chat_template import ChatTemplate, chat_template_for, reply_stops
from gptlab.tokenizer.tool_syntax import Reply, ToolSyntax, final_reply, tool_syntax

if TYPE_CHECKING:
    from gptlab.generation.request import Generation
    from gptlab.model import GPT
    from gptlab.tokenizer.base import TextTokenizer

CHOICES = ("none", "auto", "required")  # or a function's name
# the JSON a template's `tojson` writes: what the model saw of earlier calls
_SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class InvalidToolError(GptlabError):
    """A function's schema that cannot constrain its arguments (not an object's), or a choice of no given tool."""


class ContentLooksLikeCalls(GptlabError):
    """JSON content and calls under "auto" where the template's calls are written as JSON: no reader tells them
    apart."""


# what compact JSON may start with: a reply read as calls when it starts with the call prefix
_JSON_STARTS = frozenset('{["-0123456789tfn')


def arguments_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters` (an object schema; none: an object of any keys), with tojson's separators."""
    schema = dict(function.get("parameters") or {"type": "object"})
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise InvalidToolError(f"function {function.get('name')!r}: parameters must be an object's schema "
                               f"(type \"object\"), got type {kind!r}")
    return {**schema, "x-guidance": _SEPARATORS}


def _literal(text: str) -> str:
    """A Lark string for `text` (nothing for the empty string, which Lark has no literal for)."""
    return json.dumps(text) if text else ""


def _excluded(prefix: str) -> str:
    """A regex (llguidance's, between /.../) of text that does not start with `prefix`."""
    escaped = "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in prefix)
    return f"/(?s:.*)/ & ~/(?s:{escaped}.*)/"


def tool_grammar(syntax: ToolSyntax, tools: Sequence[dict[str, Any]], choice: str, parallel: bool = True,
                 content_schema: dict[str, Any] | None = None) -> str:
    """The Lark grammar of a reply under `choice` ("none", "auto", "required" or a function's name) whose text, if
    `content_schema` is given, is JSON of that (checked) schema (see the module docstring); InvalidToolError for a
    name no tool has or parameters that are no object's schema, ContentLooksLikeCalls (above)."""
    if content_schema is not None and choice == "auto" and syntax.prefix[:1] in _JSON_STARTS:
        raise ContentLooksLikeCalls(f"this chat template writes tool calls as JSON ({syntax.prefix!r}...), which "
                                    "JSON content could begin like: under tool_choice 'auto' a reply could not be "
                                    "read as the one or the other")
    functions = [t["function"] for t in tools]
    names = [f["name"] for f in functions]
    if choice not in CHOICES and choice not in names:
        raise InvalidToolError(f"tool_choice names function {choice!r}, which is not among the tools "
                               f"({', '.join(names)})")
    rules = [f"call_{i}: {_literal(syntax.prefix)} {_literal(f['name'])} {_literal(syntax.middle)} "
             f"%json {json.dumps(arguments_schema(f))} {_literal(syntax.suffix)}" for i, f in enumerate(functions)]
    several = parallel and syntax.parallel
    text = "TEXT"
    if content_schema is not None:  # with the separators json_schema's grammar writes
        rules.append(f"content: %json {json.dumps({**content_schema, 'x-guidance': {'whitespace_flexible': False}})}")
        text = "content"
    top = {"none": f"start: {text}", "auto": f"start: {text} | calls", "required": "start: calls"}.get(choice) or \
        f"start: call_{names.index(choice)}"
    lines = [
        "%llguidance {}",
        top,
        f"calls: call ({_literal(syntax.separator)} call)*" if several else "calls: call",
        "call: " + " | ".join(f"call_{i}" for i in range(len(functions))),
        *rules,
    ]
    if text == "TEXT":
        lines.append(f"TEXT: {_excluded(syntax.prefix)}")
    return "\n".join(lines) + "\n"


def generate_tool_reply(
    model: GPT,
    tokenizer: TextTokenizer,
    messages: Sequence[dict[str, Any]],
    tools: Sequence[dict[str, Any]],
    *,
    tool_choice: str = "auto",
    parallel: bool = True,
    params: SamplingParams | None = None,
    template: ChatTemplate | str | None = None,
    json_schema: Mapping[str, Any] | str | None = None,
) -> tuple[Reply, Generation]:
    """The assistant's next turn after `messages`, able to call `tools` (OpenAI's function tools): the reply read
    back (content, or calls as (name, arguments' JSON text)) and its generation (finish reason, tokens).
    `messages` are as transformers' templates read them: an assistant's `tool_calls` with arguments as objects,
    `role: tool` messages with the result. `template`: a built-in's name or a ChatTemplate (None: the tokenizer's).
    `json_schema`: the form of the reply's content (response_format's), see `tool_grammar`."""
    template = template if isinstance(template, ChatTemplate) else chat_template_for(tokenizer, template)
    syntax = tool_syntax(template)
    params = params or SamplingParams()
    forced = tool_choice not in ("none", "auto")  # calls only: the grammar ends the reply, as a JSON schema does
    content = None if json_schema is None else checked_json_schema(json_schema)
    grammar = tool_grammar(syntax, tools, tool_choice, parallel, content)
    ends = forced or content is not None  # the grammar ends the reply: only the caller's stops
    params = dataclasses.replace(params, grammar=grammar, stop=params.stop if ends else reply_stops(template,
                                                                                                   params.stop))
    text = template.render(messages, add_generation_prompt=True, tools=tools)
    ids = tokenizer.encode(text, allow_special=template.name == "tokenizer")
    (gen,) = generate_batch(model, [ids], params, tokenizer=tokenizer)
    return (Reply(content=gen.text) if tool_choice == "none" else final_reply(gen.text, syntax, forced)), gen
