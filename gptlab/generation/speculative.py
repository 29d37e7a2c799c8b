"""Speculative decoding: cheap guesses of the next tokens, checked by the target model in one forward.

A drafter proposes k tokens after a row's context; the target runs its last token and the k guesses as one
forward (k + 1 positions, the cost of about one decode step while decoding is memory-bound) and keeps the
longest run of guesses its own sampling accepts, plus one token of its own: 1 to k + 1 tokens per forward.

* Drafters: `ModelDrafter` (a smaller model with the same vocabulary, decoding in its own engine; `--draft`)
  and `NgramDrafter` (prompt lookup: the tokens that followed the earlier occurrence of the context's longest
  repeated ending; no model, good where the output repeats its input, e.g. editing).
* `accept`: the rule of Leviathan et al. (2023) / Chen et al. (2023). A greedy row keeps guesses while they are
  the target's argmax, so its output is the target's own. A sampled row keeps guess d (drafted with probability
  q(d)) with probability min(1, p(d) / q(d)) under the target's distribution p (after temperature and filters,
  `sampling.filtered_probs`), and at the first rejection samples from max(0, p - q) renormalized: every token is
  then distributed as p. A prompt-lookup guess is certain (q(d) = 1).
* The rows' KV cache rolls back: the target's row keeps the fed token and the accepted guesses (its length is
  set back over the rejected ones, whose entries are overwritten later); the draft's likewise.

In the continuous batch, speculation runs while one row decodes alone (batch 1): with several rows the batched
step already amortizes the weights' reads. A row with a grammar or penalties decodes normally (both change its
distribution token by token), and so does a row past the pretraining context of a RoPE scaling that depends on the
length (dynamic, longrope: a verify forward's frequencies would follow its last guess's position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gptlab.errors import GptlabError
from gptlab.generation.logit_filters import apply_logit_bias
from gptlab.generation.params import SamplingParams
from gptlab.generation.sampling import filtered_probs, inverse_cdf
from gptlab.model import GPT
from gptlab.rope import length_dependent

if TYPE_CHECKING:
    from gptlab.generation.engine import Engine
    from gptlab.generation.request import Generation

DRAFT_TOKENS = 4  # guesses per forward: more pay off only when most are accepted
NGRAM = "ngram"
MAX_NGRAM = 32  # prompt lookup matches up to the context's last 32 tokens
MIN_NGRAM = 3  # and guesses only from a match of 3 or more (a shorter one is as often chance as a copy)


# ---------------------------------------------------------------------------------------------------------
# The accept/reject rule
# ---------------------------------------------------------------------------------------------------------
def _biased(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits.float()
    return apply_logit_bias(logits, [params] * logits.shape[0]) if params.logit_bias else logits


def draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
    """One token from logits (V,) as `sample_next` would draw it, and the distribution (V,) it came from."""
    logits = _biased(logits[None], params)
    if params.greedy:
        token = int(logits[0].argmax())
        return token, torch.nn.functional.one_hot(torch.tensor(token), logits.shape[-1]).to(logits)
    probs = filtered_probs(logits, [params])[0]
    return _sample(probs, generator), probs


def _sample(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn with probability proportional to `weights` (V,), as sample_next draws one."""
    u = torch.rand(1, dtype=torch.float64, generator=generator, device=weights.device)
    return int(inverse_cdf(weights[None], u)[0])


def accept(
    logits: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    """The tokens a row takes from one verify forward: the accepted guesses, then one of the target's.

    logits (k + 1, V): the target's after its last token and after each guess; draft_probs (k, V): what each guess
    was drawn from (None: certain guesses, as prompt lookup's)."""
    logits = _biased(logits, params)
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == best[n]:
            n += 1
        return drafts[:n] + [best[n]]
    probs = filtered_probs(logits, [params] * logits.shape[0])
    for i, d in enumerate(drafts):
        p, q = probs[i], draft_probs[i] if draft_probs is not None else None
        q_d = 1.0 if q is None else float(q[d])
        p_d = float(p[d])
        if p_d >= q_d or float(torch.rand((), generator=generator, device=p.device)) * q_d < p_d:
            continue  # accepted with probability min(1, p(d) / q(d))
        if q is None:  # max(0, p - one_hot(d)): p without d
            residual = p.clone()
            residual[d] = 0
        else:
            residual = (p - q).clamp_min(0)
        return drafts[:i] + [_sample(residual, generator)]
    return drafts + [_sample(probs[len(drafts)], generator)]


# ---------------------------------------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------------------------------------
class NgramDrafter:
    """Prompt lookup: the tokens after the earlier occurrence of the context's longest repeated ending (up to
    MAX_NGRAM tokens; the latest of equally long ones, the most local repetition). The longest, not a fixed n: the
    last 3 tokens of a character vocabulary, or a common word, occur all over a text, and the place whose longer
    ending matches is the one the output is copying (a passage copied character by character: 98% of 4-token
    guesses held, against 74% for the latest match of the last 3).

    No guesses where the longest match is shorter than `min_match` tokens: the model then decodes alone, rather
    than checking guesses that mostly fail, each check a little dearer than a step (benchmarks/speculative.py's
    Shakespeare prompts: 1.3-1.8x with guesses after any match, 1.5-1.9x after 3 tokens, by their simulation)."""

    def __init__(self, min_match: int = MIN_NGRAM) -> None:
        if min_match < 1:
            raise GptlabError(f"prompt lookup's min_match must be at least 1, got {min_match}")
        self.min_match = min_match

    def propose(self, g: Generation, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        ids, end = np.asarray(context), len(context)
        if end <= self.min_match:
            return [], None
        ends = np.flatnonzero(ids[:-1] == ids[-1])  # where earlier matches of length 1 end
        n = 1
        while ends.size and n < MAX_NGRAM:  # lengthen the matches while some still match
            reach = ends[ends >= n]
            longer = reach[ids[reach - n] == ids[end - 1 - n]]
            if not longer.size:
                break
            ends, n = longer, n + 1
        if not ends.size or n < self.min_match:
            return [], None
        start = int(ends[-1]) + 1
        return context[start : start + k], None

    def rollback(self, held: int) -> None:
        """(Nothing is cached.)"""


Speculate = GPT | str | NgramDrafter  # what `speculate` takes: a draft model, "ngram", or prompt lookup's own


class ModelDrafter:
    """A draft model's guesses, sampled under the row's own params from its own engine's one row. That row reads
    what the target's row reads: the target's window (its cache's tokens; the whole context until a slide) and the
    newest token, so that the draft guesses from the target's own context; a draft of a shorter context reads its
    latest half. It holds a prefix of that from the last call, started again for another generation or where
    the target's window slid."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.owner: Generation | None = None
        self.window_start = self.start = 0  # where the target's window and the draft's row begin in the context

    def _follow(self, g: Generation, context: list[int], k: int) -> bool:
        """The draft's row set to a prefix of what it reads for g; False where k guesses do not fit in it."""
        window_start = len(context) - 1 - len(g.row.window)  # (the newest token is not in the target's window yet)
        if self.owner is not g or window_start != self.window_start:
            self.owner, self.window_start, self.start = g, window_start, window_start
            self.engine.cache.lengths[0] = 0
        max_len = self.engine.max_len
        if len(context) - self.start + k > max_len:  # past the draft's own context: its latest half
            self.start, self.engine.cache.lengths[0] = len(context) - max_len // 2, 0
        return len(context) - self.start + k <= max_len

    def propose(self, g: Generation, context: list[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        if not self._follow(g, context, k):  # more guesses than half the draft's context: the target decodes alone
            return [], None
        tail = context[self.start + int(self.engine.cache.lengths[0]) :]  # unseen: usually the target's last token
        if g.params.greedy and not g.params.logit_bias and tail:
            if len(tail) > 1:
                self.engine.forward_row(0, tail[:-1])
                tail = tail[-1:]
            picks = self.engine.greedy_row(tail[0], k)  # the last token and k - 1 guesses fed in one C++ call
            if picks is not None:
                return picks, None  # (a greedy guess is certain: q is one-hot, as prompt lookup's)
        logits = self.engine.forward_row(0, tail)[-1]
        tokens, probs = [], []
        for i in range(k):
            token, q = draw(logits, g.params, g.generator)
            tokens.append(token)
            probs.append(q)
            if i + 1 < k:
                logits = self.engine.forward_row(0, [token])[-1]
        return tokens, torch.stack(probs)

    def rollback(self, held: int) -> None:
        """The context's first `held` tokens are the row's: forget guesses past them."""
        lengths = self.engine.cache.lengths
        lengths[0] = min(int(lengths[0]), held - self.start)


# ---------------------------------------------------------------------------------------------------------
# One speculative step of the engine's one running row
# ---------------------------------------------------------------------------------------------------------
@dataclass
class SpeculationStats:
    """Guesses proposed and accepted, and verify forwards run, since the engine was made."""

    proposed: int = 0
    accepted: int = 0
    forwards: int = 0


class Speculator:
    """An engine's speculative step: a drafter (a draft model's, or prompt lookup's: "ngram" or an NgramDrafter)
    and the guesses per forward."""

    def __init__(self, engine: Engine, speculate: Speculate, draft_tokens: int = DRAFT_TOKENS) -> None:
        if draft_tokens < 1:
            raise GptlabError(f"draft tokens must be at least 1, got {draft_tokens}")
        self.engine, self.draft_tokens, self.stats = engine, draft_tokens, SpeculationStats()
        if isinstance(speculate, str):
            if speculate != NGRAM:
                raise GptlabError(f"speculate must be a draft model or {NGRAM!r}, got {speculate!r}")
            self.drafter: NgramDrafter | ModelDrafter = NgramDrafter()
        elif isinstance(speculate, NgramDrafter):  # prompt lookup with its own settings
            self.drafter = speculate
        elif not isinstance(speculate, GPT):
            raise GptlabError(f"speculate must be a draft model, {NGRAM!r} or an NgramDrafter, got {speculate!r:.80}")
        else:
            vocab, draft_vocab = engine.config.vocab_size, speculate.config.vocab_size
            if draft_vocab != vocab:
                raise GptlabError(f"the draft model's vocabulary has {draft_vocab} tokens, the target's {vocab}: "
                                  "a draft must share the target's tokenizer")
            speculate.eval()  # a draft serves inference alone: no dropout
            self.drafter = ModelDrafter(type(engine)(speculate, 1, max_len=engine.max_len))

    def step(self, g: Generation) -> bool:
        """Decode row g speculatively; False (nothing done) where it cannot: the engine's own step follows."""
        if g.grammar is not None or g.params.penalized:
            return False
        engine, window = self.engine, g.row.window
        room = engine.max_len - len(window) - 1  # the verify forward feeds 1 + k tokens
        if length_dependent(engine.config):
            # its frequencies follow the forward's last position: one verify forward rotates its tokens as a
            # token at a time would only while they stay within the pretraining context
            room = min(room, engine.config.rope_scaling.original_context - len(window) - 1)
        k = min(self.draft_tokens, room, g.params.max_new_tokens - len(g.token_ids))
        if k < 1:
            return False
        context = g.prompt_ids + g.token_ids
        drafts, draft_probs = self.drafter.propose(g, context, k)
        if not drafts:
            return False
        fed = [g.token_ids[-1], *drafts]
        logits = engine.forward_row(g.row.slot, fed)
        tokens = accept(logits, drafts, draft_probs, g.params, g.generator)
        kept = len(tokens) - 1  # guesses accepted; the last token is the target's own, fed next step
        engine.cache.lengths[g.row.slot] = len(window) + 1 + kept  # roll back over the rejected guesses
        window.extend(fed[: 1 + kept])
        self.drafter.rollback(len(context) + kept)
        self.stats.proposed += len(drafts)
        self.stats.accepted += kept
        self.stats.forwards += 1
        engine.record(g, logits, tokens)
        return True
