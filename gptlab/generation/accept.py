"""What the engine does with a step's logits, one job per function: sample each row's token (`sample_rows`),
record its log-probabilities (`record_logprobs`), and append it and finish the rows that are done
(`finish_rows`). `Engine._accept` runs them in that order, with the penalties' token counts between the last two.
A prompt's own log-probabilities, when asked for, are scored as its chunks are prefilled (`score_prompt`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gptlab.config import GPTConfig
from gptlab.generation.request import FINISH_ERROR, FINISH_LENGTH, FINISH_STOP, Generation
from gptlab.generation.sampling import TokenLogprob, sample_next, token_logprobs

if TYPE_CHECKING:
    from gptlab.model import GPT

Release = Callable[[Generation], None]  # frees a finished row's slot


def sample_rows(gens: list[Generation], logits: torch.Tensor, counts: torch.Tensor | None,
                seen: torch.Tensor | None, release: Release) -> list[int | None]:
    """sample_next over the rows; if that fails, each row alone, so that a failing row ends alone (None:
    finished with FINISH_ERROR) and the others go on (noise is drawn last: their generators have not moved)."""
    try:
        return sample_next(logits, [g.params for g in gens], [g.generator for g in gens], counts, seen,
                           [g.grammar for g in gens])
    except Exception:
        if len(gens) == 1:
            raise
    new: list[int | None] = []
    for i, g in enumerate(gens):
        rows = slice(i, i + 1)
        try:
            new += sample_next(logits[rows], [g.params], [g.generator], *(
                None if t is None else t[rows] for t in (counts, seen)), [g.grammar])
        except Exception as e:  # noqa: BLE001 - this row's failure, reported on it
            g.error = e
            g._finish(FINISH_ERROR)
            release(g)
            new.append(None)
    return new


def record_logprobs(gens: list[Generation], logits: torch.Tensor, new: list[int]) -> None:
    """Each row that asked for logprobs gets its new token's, with its top alternatives."""
    scored = [i for i, g in enumerate(gens) if g.params.logprobs is not None]
    if not scored:
        return
    n_top = max(gens[i].params.logprobs for i in scored)
    rows = torch.tensor(scored, device=logits.device)
    entries = token_logprobs(logits[rows], torch.tensor([new[i] for i in scored]), n_top)
    for i, entry in zip(scored, entries, strict=True):
        k = gens[i].params.logprobs
        gens[i].logprobs.append(TokenLogprob(entry.token_id, entry.logprob, entry.top[:k]))


def finish_rows(gens: list[Generation], new: list[int], config: GPTConfig, max_len: int, release: Release) -> None:
    """The new tokens appended; rows that stopped (a stop token or string, their length, the learned positions'
    end) finish and free their slot."""
    for g, tok in zip(gens, new, strict=True):
        g.token_ids.append(tok)
        stopped = tok in g.stop_ids
        if not stopped:
            if g.text_state is not None:
                stopped = g.text_state.push(tok)
            if g.grammar is not None:  # a complete JSON output ends the row, whether or not the model has an EOS
                try:
                    stopped = g.grammar.advance(tok) or stopped
                except Exception as e:  # noqa: BLE001 - past llguidance's limits mid-answer: this row ends alone
                    g.error = e
                    g._finish(FINISH_ERROR)
                    release(g)
                    continue
        if stopped:
            g._finish(FINISH_STOP)
        elif len(g.token_ids) >= g.params.max_new_tokens:
            g._finish(FINISH_LENGTH)
        elif config.position == "learned" and len(g.prompt_ids) + len(g.token_ids) >= max_len:
            g._finish(FINISH_LENGTH)  # the next token would need a position past the learned table
        if g.finished:
            release(g)


def score_prompt(model: GPT, g: Generation, hidden: torch.Tensor, start: int) -> None:
    """With params.prompt_logprobs: score the prompt tokens that hidden states (T, C) of prompt positions
    start.. predict (position t's logits score prompt token t + 1)."""
    if not g.params.prompt_logprobs:
        return
    targets = g.prompt_ids[start + 1 : start + 1 + hidden.shape[0]]
    if targets:
        ids = torch.tensor(targets, device=hidden.device)
        logits = model.logits(hidden[: len(targets)])
        g.prompt_logprobs.extend(token_logprobs(logits, ids, g.params.logprobs or 0))
