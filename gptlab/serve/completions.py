"""POST /v1/completions: continue a prompt (text, a list of texts, or token ids).

Answers in OpenAI's legacy completions format, streamed or whole. A text prompt is encoded as the model's own
tokenizer encodes it (Llama's BOS first, `generation.prompts.with_bos`); token ids are the caller's. max_tokens
defaults to 16 and is capped by the room the context leaves. `logprobs` = N reports each token's log-probability
and its N likeliest alternatives; `echo` returns the prompt (as the engine saw it: with that BOS) before the
completion, its tokens scored too when logprobs are asked (the first one, which nothing predicts, as null).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from gptlab.generation.prompts import with_bos
from gptlab.serve.schemas import CompletionRequest, completion_logprobs
from gptlab.serve.state import ServedModel, usage
from gptlab.serve.streaming import event_stream

PARAM_NAMES = {"max_new_tokens": "max_tokens"}  # SamplingParams fields named otherwise in this request


async def create_completion(server: ServedModel, req: CompletionRequest, request: Request) -> Any:
    tokenizer = server.tokenizer
    texts = req.texts()
    server.check_queue(len(texts or [()]) * req.n)  # before tokenizing what could never be queued
    if texts is None:  # token ids: the caller's, left as they are
        prompts = [list(req.prompt)]
    else:  # text: as the model's own tokenizer encodes it (Llama's BOS first)
        prompts = [with_bos(ids, tokenizer) for ids in (await server.encode(texts) or [[]])]
    scored = req.logprobs is not None
    job = server.start(
        prompts, req, max_tokens=req.max_tokens, stops=req.stop_list(), logprobs=req.logprobs,
        prompt_logprobs=req.echo and scored, param_names=PARAM_NAMES,
    )
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    sent = [0] * len(job.gens)  # tokens of each choice whose logprobs went out
    offsets = [0] * len(job.gens)  # and their text's length: where the next chunk's text_offset starts
    started: set[int] = set()  # choices whose first chunk (which carries the echoed prompt) went out

    def choice(i: int, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
        g, prefix, ids, entries = job.gens[i], "", [], []
        if i not in started:
            started.add(i)
            if req.echo:  # the prompt as the engine saw it, and its logprobs (none for the first token)
                prefix, ids = tokenizer.decode(g.prompt_ids, errors="replace"), list(g.prompt_ids)
                entries = g.prompt_logprobs or [None] * len(ids)
        logprobs = None
        if scored:
            ids, entries = ids + g.token_ids[sent[i] : tokens], entries + g.logprobs[sent[i] : tokens]
            logprobs, sent[i] = completion_logprobs(tokenizer, ids, entries, offsets[i]), max(sent[i], tokens)
            offsets[i] += sum(len(t) for t in logprobs["tokens"])
        return {"index": i, "text": prefix + text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(i: int, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": server.model_name,
            "choices": [choice(i, text, finish, tokens)],
        }

    if req.stream:
        return event_stream(server, job, prompts, chunk, req, request)
    await server.wait(job, request)
    choices = [choice(i, g.text, g.finish_reason, len(g.token_ids)) for i, g in enumerate(job.gens)]
    return {**chunk(0, "", None, 0), "choices": choices, "usage": usage(job, prompts)}
