"""POST /v1/chat/completions: answer a conversation.

The messages become one prompt through `gptlab.tokenizer.chat_template` (the tokenizer's own Jinja template, or
the built-in "plain" one for a base model), and the answer stops where `gptlab chat`'s does (`reply_stops`: the
request's stop strings, the template's own, and what the template writes after a reply; under "plain", where
nothing in the model marks the end of its turn, DEFAULT_CHAT_STOP: the user's next line). Without max_tokens (or
max_completion_tokens) the answer may run to the end of the context. `logprobs: true` reports each token's
log-probability, `top_logprobs` = N its N likeliest alternatives too. `tools` go to the template and the reply
is read back as calls (`serve.tools`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request

from gptlab.serve.schemas import ApiError, ChatRequest, chat_logprobs
from gptlab.serve.state import ServedModel, usage
from gptlab.serve.streaming import event_stream
from gptlab.serve.tools import ToolDeltas, plan_tools, reply_message, template_messages
from gptlab.serve.tools import finish_reason as tool_finish
from gptlab.tokenizer.chat_template import (
    BUILTIN_STOPS,
    ChatTemplate,
    ChatTemplateError,
    chat_template_for,
    reply_stops,
)

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

DEFAULT_CHAT_STOP = BUILTIN_STOPS["plain"][0]


def render_chat(tokenizer: TextTokenizer, messages: list[dict[str, str]]) -> tuple[str, bool]:
    """The prompt text for `messages`, and whether it came from the tokenizer's own template."""
    text, templated, _ = _render(chat_template_for(tokenizer), messages, [])
    return text, templated


def _render(template: ChatTemplate, messages: list[dict[str, Any]], user_stops: list[str],
            tools: list[dict[str, Any]] | None = None) -> tuple[str, bool, tuple]:
    """The prompt text, whether the tokenizer's own template made it, and where the reply stops (a 400 naming
    the messages where the template cannot render them)."""
    try:
        text = template.render(messages, add_generation_prompt=True, tools=tools)
        stops = reply_stops(template, user_stops)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), param="messages") from e
    return text, template.name == "tokenizer", stops


async def create_chat_completion(server: ServedModel, req: ChatRequest, request: Request) -> Any:
    tokenizer = server.tokenizer
    n_top = req.logprobs_count()
    messages = template_messages(req, server.chat_template)
    server.check_prompt_chars(sum(len(m["content"]) for m in messages), param="messages")
    server.check_queue(req.n)
    # Jinja, off the event loop
    # (finding a template's call syntax renders it: off the event loop too)
    plan = plan_tools(server.chat_template, req) if req.tools is None else await asyncio.to_thread(
        plan_tools, server.chat_template, req)
    text, templated, stops = await asyncio.to_thread(_render, server.chat_template, messages, req.stop_list(),
                                                     plan.tools)
    if req.json_schema() is not None or plan.forced:  # the grammar ends the reply: only the caller's stops
        stops = tuple(req.stop_list())
    prompts = await server.encode([text], special=templated, param="messages")
    limit = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    job = server.start(
        prompts, req, max_tokens=getattr(req, limit), stops=stops, logprobs=n_top, grammar=plan.grammar,
        param_names={"max_new_tokens": limit, "logprobs": "top_logprobs", "grammar": "tools", "prompt": "messages"},
    )
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    started: set[int] = set()  # choices whose first chunk (which names the role) went out
    sent = [0] * len(job.gens)  # tokens of each choice whose logprobs went out

    def logprobs(i: int, tokens: int) -> dict[str, Any] | None:
        if n_top is None:
            return None
        entries, sent[i] = job.gens[i].logprobs[sent[i] : tokens], max(sent[i], tokens)
        return chat_logprobs(tokenizer, entries)

    streams = [ToolDeltas(plan.syntax, plan.forced) for _ in job.gens] if plan.syntax is not None else None

    def chunk(i: int, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": text} if text or finish is None else {}
        if streams is not None:
            delta = streams[i].delta(text, finish is not None)
            finish = tool_finish(streams[i].sent, finish)
        if i not in started:
            started.add(i)
            delta = {"role": "assistant", **delta}
        return {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": server.model_name,
            "choices": [{"index": i, "delta": delta, "logprobs": logprobs(i, tokens), "finish_reason": finish}],
        }

    if req.stream:
        return event_stream(server, job, prompts, chunk, req, request)
    await server.wait(job, request)
    replies = [reply_message(plan, g.text, g.finish_reason) for g in job.gens]
    choices = [
        {"index": i, "message": message, "logprobs": logprobs(i, len(g.token_ids)), "finish_reason": finish}
        for i, (g, (message, finish)) in enumerate(zip(job.gens, replies, strict=True))
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": server.model_name,
        "choices": choices,
        "usage": usage(job, prompts),
    }
