"""One row of the generation engine: a prompt checked and set up for decoding, and its state as it goes.

* `prepare_generation` checks a prompt against the vocabulary and the context (or truncates it), works out its
  stop tokens, seeds its own random generator, and returns a `Generation`; `Engine.add` then prefills it.
* `Generation` is one request and its result: prompt, tokens so far, finish reason, and (with a tokenizer) its
  text. Text is decoded incrementally (`detokenize`): streamed deltas never split a UTF-8 character and never
  show the beginning of a stop string that may still complete. Where it runs (its row of the engine's cache, the
  tokens that row holds, prompt tokens still to prefill) is the engine's bookkeeping, `RowState`.

A prompt must leave room for one new token (at most context - 1 tokens): longer ones raise `PromptTooLongError`
unless `truncate_prompt=True`, which keeps the prompt's last context - max(1, min(max_new_tokens, context // 2))
tokens. The batching itself (which rows run, the forwards, sampling) is `engine`'s.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from gptlab.errors import GptlabError
from gptlab.generation.detokenize import TextState
from gptlab.generation.grammar import RowGrammar, row_grammar
from gptlab.generation.params import InvalidSamplingParam, SamplingParams
from gptlab.generation.sampling import TokenLogprob, row_seed

if TYPE_CHECKING:
    from gptlab.steering import SteeringVector
    from gptlab.tokenizer.base import TextTokenizer

FINISH_STOP, FINISH_LENGTH, FINISH_ERROR = "stop", "length", "error"


class PromptTooLongError(GptlabError, ValueError):
    """The prompt does not fit the model's context (and truncation was not asked for)."""


@dataclass
class RowState:
    """The engine's bookkeeping of the row a generation runs in (not the user's result: `Engine` alone reads it)."""

    slot: int = -1  # the row of the engine's cache
    window: list[int] = field(default_factory=list)  # the tokens the row's cache holds (sliding window)
    pending: list[int] = field(default_factory=list)  # prompt tokens not prefilled yet (chunked prefill)


@dataclass(eq=False)
class Generation:
    """One prompt being continued: what the user asked (prompt, params) and gets back (tokens, text, finish reason,
    logprobs, error). Where it runs in the engine is the engine's (`row`)."""

    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator | None
    text_state: TextState | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    truncated: int = 0  # prompt tokens dropped from the left by truncate_prompt
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token (params.logprobs)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # None for the first prompt token
    error: Exception | None = None  # why it finished with FINISH_ERROR (a failure of this row alone)
    grammar: RowGrammar | None = None  # params.constraint()'s: the tokens allowed next, whether the JSON is complete
    steering: tuple[SteeringVector, ...] = ()  # added to this row's residual stream (`row_steering`)
    row: RowState = field(default_factory=RowState, repr=False)  # the engine's, see RowState

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The generated text so far, without a stop string (needs a tokenizer)."""
        if self.text_state is None:
            raise ValueError("this generation has no tokenizer: use token_ids")
        return self.text_state.text

    def pop_delta(self) -> str:
        """Text that became final since the last call (complete characters; never part of a possible stop)."""
        return "" if self.text_state is None else self.text_state.pop_delta(final=self.finished)

    def _finish(self, reason: str) -> None:
        if self.text_state is not None:
            self.text_state.close()
            if self.text_state.stopped:  # a broken last character, flushed as U+FFFD, completed a stop string
                reason = FINISH_STOP if reason == FINISH_LENGTH else reason
        self.finish_reason = reason


def prompt_token_ids(prompt_ids: Any) -> list[int]:
    """A prompt as a list of ints; text, floats, bools or nested lists are refused by name rather than cast
    (int(1.5) would silently become another token)."""
    try:
        items = list(prompt_ids) if not isinstance(prompt_ids, (str, bytes)) else [prompt_ids]
        bad = next((t for t in items if isinstance(t, bool)), None)
        if bad is not None:
            raise TypeError
        return [operator.index(t) for t in items]
    except TypeError:
        shown = repr(prompt_ids)
        raise ValueError(f"prompt must be a sequence of integer token ids, got {shown[:60]}"
                         f"{'...' if len(shown) > 60 else ''}") from None


def prepare_generation(
    prompt_ids: Sequence[int],
    params: SamplingParams,
    *,
    vocab_size: int,
    context: int,
    tokenizer: TextTokenizer,
    device: torch.device,
    sample_index: int = 0,
    truncate_prompt: bool = False,
) -> Generation:
    """Check (or truncate) a prompt for a cache of `context` positions and build its row state."""
    ids = prompt_token_ids(prompt_ids)
    if not ids:
        raise ValueError("the prompt is empty: give at least one token (e.g. the end-of-text token)")
    V, ctx = vocab_size, context
    if any(t < 0 or t >= V for t in ids):
        raise ValueError(f"prompt token ids must be in [0, {V})")
    if any(t >= V for t, _ in params.logit_bias):
        raise InvalidSamplingParam("logit_bias", dict(params.logit_bias), f"must name token ids in [0, {V})")
    truncated = 0
    if len(ids) >= ctx:
        if not truncate_prompt:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens but the context holds {ctx}: "
                f"use at most {ctx - 1} (or truncate the prompt)"
            )
        keep = ctx - max(1, min(params.max_new_tokens, ctx // 2))
        truncated, ids = len(ids) - keep, ids[-keep:]
    stop_ids = set(params.stop_token_ids)
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None and not params.ignore_eot:
        stop_ids.add(eot)
    seed = params.seed
    if seed is None and not params.greedy:
        seed = int(torch.randint(0, 2**62, (1,)))  # from the global RNG: torch.manual_seed reproduces it
    generator = None
    if seed is not None:  # on the model's device: the noise is drawn where the logits are
        generator = torch.Generator(device=device).manual_seed(row_seed(seed, sample_index))
    text_state = None
    if tokenizer is not None:
        text_state = TextState(tokenizer, context_ids=ids, stop=params.stop)
    stop_ids = frozenset(stop_ids)
    constraint = params.constraint()
    grammar = None if constraint is None else row_grammar(constraint, tokenizer, stop_ids)
    return Generation(ids, params, stop_ids, generator, text_state, truncated=truncated, grammar=grammar)
