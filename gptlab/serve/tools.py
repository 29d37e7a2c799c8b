"""Tool calls on /v1/chat/completions: a request's `tools`, `tool_choice` and `parallel_tool_calls` made into the
chat template's tools, the grammar of the reply (`generation.tool_calls`) and how it is read back, and the reply
as OpenAI's message: `tool_calls` [{id, type "function", function {name, arguments (JSON text)}}], streamed as
deltas (the call's id and name first, its arguments piece by piece), finish_reason "tool_calls".

Earlier turns go back through the template as transformers passes them: an assistant's `tool_calls` with their
arguments as objects, a `role: tool` message with its `tool_call_id` and the called function's `name`.

The rules a request must keep (a 400 naming the field otherwise): `tool_choice` and `parallel_tool_calls` only
with `tools`; a named choice among the tools; function names unique; a template that takes no tools is a 400
naming `tools`. parallel_tool_calls true permits several calls a turn (OpenAI's default): one where the template
renders only one (Llama 3.1's), as llama.cpp's server does. `response_format` with tools makes the reply's content
JSON of its schema (`tool_grammar`: that JSON or calls under "auto", as the OpenAI Agents SDK asks for an agent
with an output type); under "auto" it is a 400 where the template writes its calls as bare JSON, which such
content could begin like.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gptlab.generation.params import InvalidSamplingParam, checked_json_schema
from gptlab.generation.tool_calls import ContentLooksLikeCalls, InvalidToolError, tool_grammar
from gptlab.serve.schemas import ApiError, ChatRequest, NamedToolChoice
from gptlab.serve.state import invalid_field
from gptlab.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from gptlab.tokenizer.tool_syntax import Reply, ToolSyntax, final_reply, split_reply, tool_syntax

FINISH_TOOL_CALLS = "tool_calls"


@dataclass
class ToolPlan:
    """What a request's tools do: the tools the template shows, the grammar of the reply, and the syntax its calls
    are read back with (None: the reply is content only)."""

    tools: list[dict[str, Any]] | None = None
    grammar: str | None = None
    syntax: ToolSyntax | None = None
    forced: bool = False  # calls only (required, or a named function): the reply ends where its grammar does


def _choice(req: ChatRequest) -> str:
    if isinstance(req.tool_choice, NamedToolChoice):
        return req.tool_choice.function.name
    return req.tool_choice or "auto"


def _check_fields(req: ChatRequest) -> None:
    if req.tools is None:
        for name in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, name) is not None:
                raise ApiError(400, f"'{name}' is only allowed when 'tools' are given", param=name)
        return
    names = [t.function.name for t in req.tools]
    if len(set(names)) < len(names):
        raise ApiError(400, "each tool's function must have its own name", param="tools")
    choice = _choice(req)
    if isinstance(req.tool_choice, NamedToolChoice) and choice not in names:
        raise ApiError(400, f"tool_choice names function '{choice}', which is not among the tools", param="tool_choice")


def plan_tools(template: ChatTemplate, req: ChatRequest) -> ToolPlan:
    """The request's ToolPlan (renders the template the first time: run it off the event loop)."""
    _check_fields(req)
    if req.tools is None:
        return ToolPlan()
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    try:
        syntax = tool_syntax(template)
    except ChatTemplateError as e:  # one that takes no tools, or a broken one (as `messages` would find it)
        raise ApiError(400, f"tools cannot be used with this model: {e}", param="tools") from e
    choice = _choice(req)
    try:
        content = None if req.json_schema() is None else checked_json_schema(req.json_schema())
    except InvalidSamplingParam as e:
        raise invalid_field(e, {"json_schema": "response_format"}) from e
    try:
        grammar = tool_grammar(syntax, tools, choice, req.parallel_tool_calls is not False, content)
    except InvalidToolError as e:
        raise ApiError(400, str(e), param="tools") from e
    except ContentLooksLikeCalls as e:
        raise ApiError(400, f"{e}: set tool_choice to 'none' or 'required'", param="response_format") from e
    return ToolPlan(tools, grammar, None if choice == "none" else syntax, forced=choice not in ("none", "auto"))


def template_messages(req: ChatRequest, template: ChatTemplate) -> list[dict[str, Any]]:
    """The request's messages as the template reads them: an assistant's calls with their arguments as objects, a
    tool message with the name of the function whose call it answers, and a developer message (OpenAI's newer name
    for the system message) as a system message unless the template names that role itself: Qwen's drops a role
    it does not know, and Llama 3.1's takes it for the user's first turn."""
    developer = "developer" if "developer" in template.source else "system"
    called: dict[str, str] = {}  # call id -> function name
    out = []
    for i, m in enumerate(req.messages):
        message: dict[str, Any] = {"role": developer if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [_call_for_template(c, i) for c in m.tool_calls]
            called.update({c.id: c.function.name for c in m.tool_calls})
        if m.role == "tool":
            if m.tool_call_id not in called:
                raise ApiError(400, f"messages[{i}]: a tool message must answer a call of an earlier assistant "
                               "message, by its tool_call_id", param="messages")
            message.update(tool_call_id=m.tool_call_id, name=called[m.tool_call_id])
        out.append(message)
    return out


def _call_for_template(call: Any, index: int) -> dict[str, Any]:
    """A call fed back, its arguments as an object; empty arguments (some APIs write "" for a function that takes
    none) as {}."""
    try:
        arguments = json.loads(call.function.arguments.strip() or "{}")
    except ValueError as e:
        raise ApiError(400, f"messages[{index}]: the arguments of call '{call.id}' are not JSON ({e})",
                       param="messages") from e
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def finish_reason(reply: Reply, finish: str | None) -> str | None:
    """A reply that made calls and stopped between whole calls finishes with "tool_calls" (one a stop string cut
    inside a call stays "stop": its last call's arguments are not whole)."""
    return FINISH_TOOL_CALLS if finish == "stop" and reply.calls and not reply.cut else finish


def reply_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The answer's message and finish reason, for a finished reply `text`."""
    if plan.syntax is None:
        return {"role": "assistant", "content": text}, finish
    reply = final_reply(text, plan.syntax, forced=plan.forced)
    if reply.content or not text:
        return {"role": "assistant", "content": reply.content}, finish
    # calls, as OpenAI answers them: no content, and where max_tokens cut the reply short the calls whose name was
    # written (the last one's arguments cut), never the call syntax as text
    message: dict[str, Any] = {"role": "assistant", "content": None}
    if reply.calls:
        message["tool_calls"] = [{"id": _call_id(), "type": "function", "function": {
            "name": name, "arguments": arguments}} for name, arguments in reply.calls]
    return message, finish_reason(reply, finish)


@dataclass
class ToolDeltas:
    """One streamed choice read back as it grows: each text delta in, the chunk's delta out (content, or calls:
    a new call's id, type and name with its arguments so far, then its arguments' new text)."""

    syntax: ToolSyntax
    forced: bool = False  # the reply can only be calls (ToolPlan.forced)
    text: str = ""
    sent: Reply = field(default_factory=Reply)
    ids: list[str] = field(default_factory=list)
    finished: bool = False

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        if self.finished:  # (the usage chunk after the end asks again)
            return {}
        self.text, self.finished = self.text + text, finished
        reply = final_reply(self.text, self.syntax, self.forced) if finished else split_reply(self.text, self.syntax)
        out: dict[str, Any] = {}
        if len(reply.content) > len(self.sent.content):
            out["content"] = reply.content[len(self.sent.content):]
        calls = []
        for k, (name, arguments) in enumerate(reply.calls):
            if k >= len(self.sent.calls):
                self.ids.append(_call_id())
                calls.append({"index": k, "id": self.ids[k], "type": "function",
                              "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > len(self.sent.calls[k][1]):
                calls.append({"index": k, "function": {"arguments": arguments[len(self.sent.calls[k][1]):]}})
        if calls:
            out["tool_calls"] = calls
        self.sent = reply
        return out
