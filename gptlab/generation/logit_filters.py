"""What a row's logits go through before its token is drawn (`gptlab.generation.sampling`): the filters (top-k,
top-p, min-p), the repetition / frequency / presence penalties and the counts they read, `logit_bias`, and the
masks of structured outputs' grammars.

A batch mixes requests with different settings, so each is a pure function over a (rows, vocab) fp32 logits tensor
with one parameter value per row (a float for all rows, or an (n,) tensor). Removed tokens get -inf. Definitions
follow Hugging Face (top-k, top-p, min-p, repetition penalty) and OpenAI (frequency and presence penalties); see
`gptlab.generation.params.SamplingParams`, whose "off" values (top_k 0, top_p 1, min_p 0) are also the filters'
"keep everything" values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from gptlab.generation.params import SamplingParams

if TYPE_CHECKING:
    from gptlab.generation.grammar import RowGrammar

PENALTIES = ("repetition_penalty", "frequency_penalty", "presence_penalty")

def _per_row(value: float | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A parameter as an (n, 1) column, one value per row."""
    t = torch.as_tensor(value, dtype=logits.dtype, device=logits.device)
    return t.reshape(-1, 1).expand(logits.shape[0], 1) if t.numel() == 1 else t.reshape(-1, 1)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    repetition: float | torch.Tensor = 1.0,
    frequency: float | torch.Tensor = 0.0,
    presence: float | torch.Tensor = 0.0,
) -> torch.Tensor:
    """Repetition penalty over `seen` (bool: in prompt or output), then frequency / presence penalties over
    `counts` (occurrences in the output)."""
    rep = _per_row(repetition, logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return (
        logits
        - counts * _per_row(frequency, logits)
        - (counts > 0).to(logits.dtype) * _per_row(presence, logits)
    )


def apply_top_k(logits: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (k <= 0 keeps all)."""
    V = logits.shape[-1]
    k = torch.as_tensor(k, device=logits.device).reshape(-1).expand(logits.shape[0]).long()
    k = torch.where((k <= 0) | (k > V), V, k)
    kmax = int(k.max())
    kth = torch.topk(logits, kmax, dim=-1).values.gather(-1, (k - 1)[:, None])  # (n, 1) the k-th largest
    return logits.masked_fill(logits < kth, float("-inf"))


# the most likely tokens searched for each row's nucleus before the whole vocabulary is sorted (sorting 16 rows of
# 50,257 took 33 ms on a Zen 3 core; the top 256 of them 1.5 ms)
NUCLEUS_CANDIDATES = (256, 4096)


def apply_top_p(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the fewest most likely tokens whose probability reaches p (p >= 1: all).

    The nucleus is looked for among the rows' most likely NUCLEUS_CANDIDATES tokens first: where those reach p in
    every row that filters, the rest could only be dropped, so the same tokens are kept as after sorting it all."""
    p = _per_row(p, logits)
    off = p >= 1
    probs = logits.softmax(dim=-1)
    for k in [k for k in NUCLEUS_CANDIDATES if k < logits.shape[-1]] + [logits.shape[-1]]:
        likely, order = probs.topk(k, dim=-1) if k < logits.shape[-1] else probs.sort(dim=-1, descending=True)
        reached = likely.cumsum(dim=-1)  # (n, k), most likely first
        if bool(((reached[:, -1:] >= p) | off).all()):
            break
    keep = (reached - likely < p) | off  # the probability of the strictly more likely tokens is still under p
    keep[:, 0] = True  # the top token always stays
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, keep) | off
    return logits.masked_fill(~kept, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * _per_row(min_p, logits)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's `logit_bias` added to its logits (n, V), in one scatter over every biased (row, token)."""
    rows = [i for i, sp in enumerate(params) for _ in sp.logit_bias]
    ids = [t for sp in params for t, _ in sp.logit_bias]
    bias = [b for sp in params for _, b in sp.logit_bias]
    dev = logits.device
    logits = logits.clone()  # the caller's logits (the engine's, also read for logprobs) stay as they are
    logits[torch.tensor(rows, device=dev), torch.tensor(ids, device=dev)] += torch.tensor(bias, device=dev)
    return logits


GrammarMasks = tuple[torch.Tensor | None, torch.Tensor]  # (the constrained rows' index, None: every row; their masks)


def grammar_masks(grammars: Sequence[RowGrammar | None], vocab_size: int, device: torch.device) -> GrammarMasks:
    """The constrained rows (None: every row is) and their (rows, vocab_size) fp32 masks: 1 where the row's grammar
    allows the token next, else 0 (one llguidance call for the batch)."""
    from gptlab.generation.grammar import allowed_tokens  # llguidance: loaded by the first constrained row

    rows = [i for i, g in enumerate(grammars) if g is not None]
    allowed = allowed_tokens([grammars[i] for i in rows], vocab_size).to(device, torch.float32)
    return (None if len(rows) == len(grammars) else torch.tensor(rows, device=device)), allowed


def apply_grammars(logits: torch.Tensor, grammars: Sequence[RowGrammar | None],
                   masks: GrammarMasks | None = None) -> torch.Tensor:
    """Each constrained row's logits (n, V) with the tokens its grammar forbids at -inf; rows without a grammar
    are left alone (a batch mixes both). `masks`: grammar_masks' for these rows, where the caller has them."""
    index, allowed = masks or grammar_masks(grammars, logits.shape[-1], logits.device)
    # 0 where allowed, -inf where not: (allowed - 1) * 3e38 is -3e38 or 0, and times 10 overflows to exactly -inf.
    # Three passes over fp32, where a masked_fill or where over a bool mask took 4x as long (~2 ns an element)
    bias = allowed.sub(1).mul_(3e38).mul_(10)

    def masked(x: torch.Tensor) -> torch.Tensor:  # (a forbidden +inf logit of a broken model, +inf - inf, is NaN)
        return (x + bias).nan_to_num_(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))

    if index is None:  # (a new tensor: the caller's logits, which logprobs read, stay as they are)
        return masked(logits)
    logits = logits.clone()
    logits[index] = masked(logits[index])
    return logits


def mask_probabilities(probs: torch.Tensor, allowed: torch.Tensor) -> bool:
    """Constrained rows' probabilities (n, V), written in place, with the tokens their `allowed` fp32 masks
    forbid at 0 (not renormalized); False where a row has no probability left (its allowed tokens all
    underflowed in the softmax: the caller then masks the logits first)."""
    probs.mul_(allowed)
    return bool((probs.sum(-1) > 0).all())


class TokenCounts:
    """Per row of an engine's cache, how often each token was generated and which tokens the prompt or output
    hold: what presence, frequency and repetition penalties read. Made on the first row that asks for a penalty
    (two (rows, vocab) tables are no small cost at batch 32 and a 150k vocabulary)."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(rows, vocab_size, device=device)  # (rows, V) output-token counts
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)  # (rows, V) prompt or output

    def reset(self, slot: int, prompt_ids: list[int]) -> None:
        """A new generation in `slot`: nothing generated yet, its prompt seen."""
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        self.seen[slot, torch.tensor(prompt_ids, device=self.seen.device)] = True

    def rows(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.counts[slots], self.seen[slots]

    def add(self, slots: torch.Tensor, new: list[int]) -> None:
        """Each row's new token, counted."""
        new_ids = torch.tensor(new, device=self.counts.device)
        self.counts[slots, new_ids] += 1
        self.seen[slots, new_ids] = True

