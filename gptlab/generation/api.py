"""One-call generation over a throwaway `Engine`: the library's front door.

* `generate(model, idx, max_new_tokens, ...)`: nanoGPT's `model.generate` as a function, (B, T) token ids in,
  (B, T + new) out.
* `generate_batch(model, prompts, params)`: prompts of any lengths in one batch, one finished `Generation`
  each (token ids, finish reason, text, logprobs).
* `generate_stream(model, tokenizer, prompt, params)`: one continuation's text as it is generated.
* `stream_deltas(engine, gen)`: the same over an engine the caller keeps (e.g. `gptlab sample`, which reuses
  one cache for every sample).

Each one runs the model in eval mode (dropout off, as nanoGPT's sample.py does) and gives the caller's mode
back afterwards, and allocates a cache only as long as the run can use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from gptlab.generation.engine import Engine
from gptlab.generation.params import SamplingParams
from gptlab.generation.request import Generation, prompt_token_ids
from gptlab.generation.speculative import Speculate
from gptlab.hooks import eval_mode
from gptlab.kv_cache import cache_length
from gptlab.model import GPT
from gptlab.steering import SteeringVector
from gptlab.tokenizer.base import TextTokenizer

PACK_MIN_TOKENS = 16  # re-laying the weights out (`packed_linear`) pays off only over enough decoding steps


def _check_arguments(params: Any, tokenizer: Any) -> None:
    """The keyword arguments' types, refused by name here rather than as an AttributeError deep in the engine
    (`speculate` and `steering` are checked where the engine takes them: `Speculator`, `check_vectors`)."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if tokenizer is not None and not callable(getattr(tokenizer, "decode_bytes", None)):
        raise ValueError(f"tokenizer must be a gptlab tokenizer (or None), got {type(tokenizer).__name__}")


def _engine(model: GPT, prompts: Sequence[Sequence[int]], params: SamplingParams, tokenizer: TextTokenizer,
            speculate: Speculate | None = None) -> Engine:
    _check_arguments(params, tokenizer)
    return Engine(
        model,
        max_batch=max(1, len(prompts)),
        tokenizer=tokenizer,
        max_len=cache_length(prompts, params.max_new_tokens),
        pack_weights=params.max_new_tokens >= PACK_MIN_TOKENS,
        speculate=speculate,
    )


def generate_batch(
    model: GPT,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    *,
    tokenizer: TextTokenizer | None = None,
    truncate_prompt: bool = False,
    speculate: Speculate | None = None,
    steering: Sequence[SteeringVector] = (),
) -> list[Generation]:
    """Continue each prompt (token ids; lengths may differ) in one batch: one finished `Generation` each.
    With a tokenizer, each one's `text` is decoded (and `params.stop` strings end rows). `speculate`: a draft
    model, "ngram" or an `NgramDrafter` (prompt lookup) for speculative decoding of a row decoding alone
    (`speculative`).
    `steering`: vectors added to every row's residual stream (`gptlab.steering`) at every step."""
    params = params or SamplingParams()
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a list of prompts (each a sequence of token ids), got {prompts!r:.60}")
    prompts = [prompt_token_ids(p) for p in prompts]
    engine = _engine(model, prompts, params, tokenizer, speculate)
    gens = [
        engine.prepare(p, params, sample_index=i, truncate_prompt=truncate_prompt, steering=steering)
        for i, p in enumerate(prompts)
    ]
    with eval_mode(model):
        return engine.run(gens)


def stream_deltas(engine: Engine, gen: Generation) -> Iterator[str]:
    """Prefill `gen` (from `engine.prepare`, steered as it says) and yield its text as it is generated, in deltas
    of whole characters that never hold part of a possible stop string, until it finishes. Other rows of the
    engine advance with it. The model is in eval mode while the engine works, as the caller left it between
    deltas."""
    with eval_mode(engine.model):
        engine.add([gen])
    while True:
        delta = gen.pop_delta()
        if delta:
            yield delta
        if gen.finished:
            return
        # not held across the yield: the caller may use the model in between
        with eval_mode(engine.model):
            engine.step()


def generate_stream(
    model: GPT,
    tokenizer: TextTokenizer,
    prompt: str | Sequence[int],
    params: SamplingParams | None = None,
    *,
    truncate_prompt: bool = False,
    result: list[Generation] | None = None,
    speculate: Speculate | None = None,
    steering: Sequence[SteeringVector] = (),
) -> Iterator[str]:
    """Yield the text of one continuation as it is generated, in deltas of whole characters.

    `prompt` is text (encoded with the tokenizer) or token ids. Pass a list as `result` to get the finished
    `Generation` (finish reason, token ids) appended to it. `speculate`, `steering`: as `generate_batch`'s.
    """
    params = params or SamplingParams()
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    engine = _engine(model, [ids], params, tokenizer, speculate)
    gen = engine.prepare(ids, params, truncate_prompt=truncate_prompt, steering=steering)
    yield from stream_deltas(engine, gen)
    if result is not None:
        result.append(gen)


def _check_idx(idx: Any, pad_id: Any) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] == 0:
        raise ValueError("idx must be a (batch, time) tensor of token ids with at least one row")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise ValueError(f"idx must hold integer token ids, got dtype {idx.dtype}")
    bounds = torch.iinfo(idx.dtype)
    if pad_id is not None and not (isinstance(pad_id, int) and not isinstance(pad_id, bool)
                                   and bounds.min <= pad_id <= bounds.max):
        raise ValueError(f"pad_id must be an integer that fits idx's {idx.dtype}, got {pad_id!r}")


@torch.no_grad()  # not inference_mode: the returned tensor may be used in autograd later (e.g. as data)
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    *,
    pad_id: int | None = None,
    truncate_prompt: bool = False,
    speculate: Speculate | None = None,
    steering: Sequence[SteeringVector] = (),
    **controls: Any,
) -> torch.Tensor:
    """Continue idx (B, T) by max_new_tokens tokens: (B, T + max_new_tokens), KV-cached and batched, as
    nanoGPT's `model.generate(idx, max_new_tokens, temperature, top_k)`.

    temperature 0 is greedy; top_k / top_p None (or 0 / 1) are off. `controls` are the other `SamplingParams`
    fields (min_p, repetition_penalty, frequency_penalty, presence_penalty, seed, stop_token_ids, ...). Without
    stop tokens every row gets max_new_tokens (unless learned positions run out); rows that stop early keep
    their stop token and are right-padded with `pad_id` (default: the first stop token id, else 0) up to the
    longest row. A prompt of block_size tokens or more raises `PromptTooLongError` (a ValueError) unless
    truncate_prompt=True. `speculate`: a draft model, "ngram" or an NgramDrafter (prompt lookup): speculative
    decoding of a single row, with greedy output identical to the model's alone and sampling from its
    distribution.
    `steering`: `SteeringVector`s added to the residual stream at every step (`gptlab.steering`).
    """
    _check_idx(idx, pad_id)
    unknown = sorted(set(controls) - {f.name for f in dataclasses.fields(SamplingParams)})
    if unknown:
        raise ValueError(f"{unknown[0]} is not a generate() argument nor a SamplingParams field")
    params = SamplingParams(
        max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, **controls
    )
    gens = generate_batch(model, idx.tolist(), params, truncate_prompt=truncate_prompt, speculate=speculate,
                          steering=steering)
    rows = [g.prompt_ids + g.token_ids for g in gens]  # prompts after truncation, if any
    pad = pad_id if pad_id is not None else (params.stop_token_ids[0] if params.stop_token_ids else 0)
    out = torch.full((len(rows), max(map(len, rows))), pad, dtype=idx.dtype, device=idx.device)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=idx.dtype)
    return out
