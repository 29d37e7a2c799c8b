"""What every route shares: the model's tokenizer and name, the engine and its scheduler thread, and turning a
request into generations on it (`ServedModel.start`) and waiting for them (`ServedModel.wait`).

Request checks that need the model live here: the model name, prompt token ids, the context length (a prompt
must leave room for one token; max_tokens is capped to the room left), and the sampling settings, which
`SamplingParams` checks (its `InvalidSamplingParam` becomes a 400 naming the request's field).

Nothing slow runs on the event loop: prompts are tokenized in a worker thread (a 20 MB prompt took 12 s, during
which /health waited), and a text longer than `prompt_char_limit` characters cannot fit,
so it is refused before it is tokenized at all. A request whose client hangs up stops its generations (`wait`),
streamed or not, so its rows go to the next requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import Request

from gptlab.errors import GptlabError
from gptlab.generation.engine import Engine
from gptlab.generation.params import InvalidSamplingParam, SamplingParams
from gptlab.generation.prefix_cache import DEFAULT_PREFIX_CACHE_MB, PrefixCache
from gptlab.generation.prompts import EmptyPromptError, prompt_char_limit, start_ids
from gptlab.generation.speculative import DRAFT_TOKENS
from gptlab.serve.metrics import ServerMetrics
from gptlab.serve.scheduler import Job, QueueFull, Scheduler
from gptlab.serve.schemas import ApiError, SamplingFields
from gptlab.serve.steering import Direction, SteeringDirections
from gptlab.tokenizer import UnknownCharacters
from gptlab.tokenizer.chat_template import chat_template_for

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer


class ServedModel:
    """The model behind the routes: tokenizer (and its chat template), name, engine and scheduler."""

    def __init__(
        self,
        model: Any,
        tokenizer: TextTokenizer,
        model_name: str,
        max_batch: int,
        max_queue: int,
        prefill_chunk: int | None,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        speculate: Any = None,
        draft_tokens: int = DRAFT_TOKENS,
        steering: Mapping[str, Direction] | None = None,
        stream_interval: float = 0.0,
        max_len: int | None = None,
    ) -> None:
        self.tokenizer, self.model_name = tokenizer, model_name
        self.stream_interval = stream_interval  # seconds a stream waits after each write (`streaming`)
        self.steering = SteeringDirections(model, steering)  # the directions requests may name (None: refused)
        # one for the server's life: compiled, and its turn end found, on the first chat request, then kept
        self.chat_template = chat_template_for(tokenizer)
        # prompts' beginnings (a system prompt, a conversation so far) prefilled once, reused by later requests
        self.engine = Engine(model, max_batch=max_batch, tokenizer=tokenizer, prefill_chunk=prefill_chunk,
                             prefix_cache=PrefixCache.of_megabytes(prefix_cache_mb), speculate=speculate,
                             draft_tokens=draft_tokens, max_len=max_len)
        self.context_length = self.engine.max_len  # tokens a request's prompt and completion share
        engine = self.engine
        self.metrics = ServerMetrics(queue_length=lambda: self.scheduler.waiting,
                                     running_rows=lambda: len(engine.running),
                                     prefix_cache=lambda: getattr(engine, "prefix_cache", None),
                                     speculation=lambda: engine.speculator.stats if engine.speculator else None)
        self.scheduler = Scheduler(engine, max_queue=max_queue, metrics=self.metrics)
        self.created = int(time.time())

    def check_prompt_chars(self, chars: int, param: str = "prompt") -> None:
        """Refuse, before tokenizing it, a text too long to fit the context whatever its tokens."""
        if chars > prompt_char_limit(self.context_length):
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} tokens; the {param} has {chars} "
                "characters, more than that many tokens can hold.",
                param=param,
                code="context_length_exceeded",
            )

    def check_queue(self, generations: int) -> None:
        """Refuse at once (429) a request that asks for more generations than may ever wait."""
        if generations > self.scheduler.max_queue:
            raise ApiError(
                429, f"The request asks for {generations} generations; this server queues at most "
                f"{self.scheduler.max_queue}.", type="rate_limit_error", code="rate_limit_exceeded",
            )

    async def encode(self, texts: list[str], *, special: bool = False, param: str = "prompt") -> list[list[int]]:
        """Each text's token ids, tokenized in a worker thread (the event loop goes on serving others); `param`:
        the request's field the texts came from, for errors."""
        for text in texts:
            self.check_prompt_chars(len(text), param)
        try:
            return await asyncio.to_thread(lambda: [self.tokenizer.encode(t, allow_special=special) for t in texts])
        except UnknownCharacters as e:  # said of the field, without the advice to prepare other data
            raise ApiError(400, e.of(f"'{param}'"), param=param) from e
        except GptlabError as e:
            raise ApiError(400, str(e), param=param) from e
        except UnicodeError as e:  # JSON can spell a lone surrogate ("\ud800"): not text any tokenizer reads
            raise ApiError(400, f"the {param} is not valid Unicode text: {e}", param=param) from e

    def start(
        self,
        prompts: list[list[int]],
        req: SamplingFields,
        *,
        max_tokens: int | None,
        stops: Sequence[str],
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        grammar: str | None = None,
        param_names: Mapping[str, str] | None = None,
    ) -> Job:
        """Queue `req.n` generations of each prompt (max_tokens None: as many as the context leaves room for);
        `grammar`: a llguidance grammar the output must match (tool calls'). `param_names` maps SamplingParams
        fields (and "prompt") to the request's own names where they differ, for errors."""
        if req.stream_options is not None and not req.stream:  # never silently ignored (OpenAI's 400 too)
            raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                           param="stream_options")
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        fields = req.model_dump()
        names = {"json_schema": "response_format", **(param_names or {})}
        steering = self.steering.vectors(req.steering)
        gens = []
        for ids in prompts:
            ids = self._check_prompt(ids, names.get("prompt", "prompt"))
            room = self.context_length - len(ids)
            try:
                params = SamplingParams.from_fields(
                    fields,
                    max_new_tokens=room if max_tokens is None else min(max_tokens, room),
                    stop=stops,
                    ignore_eot=req.ignore_eos,
                    logprobs=logprobs,
                    prompt_logprobs=prompt_logprobs,
                    logit_bias={int(t): b for t, b in (req.logit_bias or {}).items()},
                    json_schema=req.json_schema() if grammar is None else None,  # else the grammar holds it
                    grammar=grammar,
                )
                gens += [self.engine.prepare(ids, params, sample_index=j, steering=steering) for j in range(req.n)]
            except InvalidSamplingParam as e:
                raise invalid_field(e, names) from e
        job = Job(gens, loop=asyncio.get_running_loop(), param_names=names)
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise ApiError(
                429, f"The server is busy ({e}); retry later.", type="rate_limit_error", code="rate_limit_exceeded"
            ) from e
        return job

    def _check_prompt(self, ids: list[int], param: str) -> list[int]:
        """The prompt's token ids (an empty prompt starts from end-of-text), if they fit the model (else a 400
        naming `param`, the request's field the prompt came from)."""
        try:
            ids = start_ids(ids, self.tokenizer.eot_id)
        except EmptyPromptError as e:
            raise ApiError(400, str(e), param=param) from e
        if any(not 0 <= t < self.engine.config.vocab_size for t in ids):
            raise ApiError(400, "prompt token ids must be in [0, vocab_size)", param=param)
        if len(ids) >= self.context_length:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.context_length} tokens; the prompt has {len(ids)} "
                "tokens, leaving no room for a completion.",
                param=param,
                code="context_length_exceeded",
            )
        return ids

    async def wait(self, job: Job, request: Request) -> None:
        """Until every generation of the job has finished; cancelled when the client hangs up (or the handler
        is cancelled) or one of them fails."""
        hangup = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({job.done, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if not job.done.done():  # the client is gone: nobody will read the answer
                raise ApiError(499, "The client closed the request.", code="client_closed_request")
        finally:
            hangup.cancel()
            if not job.done.done() or job.error is not None:
                self.scheduler.cancel(job)
        if job.error is not None:
            raise job_failure(job)


def invalid_field(e: InvalidSamplingParam, param_names: Mapping[str, str]) -> ApiError:
    """A 400 naming the request's field that SamplingParams' field `e.field` came from."""
    param = param_names.get(e.field, e.field)
    return ApiError(400, f"Invalid value for '{param}': {e.requirement}, got {e.value!r}", param=param,
                    code="invalid_value")


def job_failure(job: Job) -> ApiError:
    """What a failed job answers: a 400 where a row's own settings failed as it ran (a grammar past the grammar
    engine's limits), else a 500."""
    if isinstance(job.error, InvalidSamplingParam):
        return invalid_field(job.error, job.param_names)
    return ApiError(500, f"generation failed: {job.error}", type="server_error")


async def _disconnected(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: what comes next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def usage(job: Job, prompts: list[list[int]]) -> dict[str, int]:
    """OpenAI's usage object: prompt, completion and total tokens. A prompt counts as the model read it (an empty
    one as the end-of-text it starts from), once for its n generations."""
    n = len(job.gens) // len(prompts)
    prompt_tokens = sum(len(g.prompt_ids) for g in job.gens[::n])
    completion = sum(len(g.token_ids) for g in job.gens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
