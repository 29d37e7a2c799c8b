"""Sampling controls: `SamplingParams`, the logit filters and `sample_next`.

The filters are pure functions over a (rows, vocab) fp32 logits tensor with one parameter value per row (a
float for all rows, or an (n,) tensor), so one batch can mix requests with different settings. Removed tokens
get -inf. Definitions follow Hugging Face (top-k, top-p, min-p, repetition penalty) and OpenAI (frequency and
presence penalties); see `SamplingParams`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API allows


@dataclass
class SamplingParams:
    """How one request is decoded. Filters apply in this order: penalties, temperature, top-k, top-p, min-p.

    - temperature: logits / T before sampling; 0 = greedy (argmax of the penalized logits).
    - top_k: keep the k most likely tokens (ties with the k-th are kept too). None or 0 = off.
    - top_p: keep the smallest set of most likely tokens whose probabilities sum to >= top_p (nucleus).
      None or 1 = off.
    - min_p: keep tokens whose probability is >= min_p * (the top token's probability). None/0 = off.
    - repetition_penalty (Hugging Face / CTRL): for every token that occurs in the prompt or the output so
      far, a positive logit is divided by it and a negative one multiplied by it. 1 = off; > 1 discourages
      repeats.
    - frequency_penalty / presence_penalty (OpenAI): logit[j] -= count[j] * frequency + (count[j] > 0) *
      presence, where count[j] is how often token j was generated so far (the prompt is not counted).
      0 = off; OpenAI allows -2..2.
    - seed: the row's own torch.Generator is seeded with it (sample i of a request with seed + i mixed in), so
      the same seed gives the same text whatever else is in the batch. None = drawn from torch's global RNG.
    - stop: strings that end the row; the text up to (not including) the first one is returned.
    - stop_token_ids: token ids that end the row (the tokenizer's end-of-text is added unless ignore_eot).
    - logprobs: record each generated token's log-probability and the `logprobs` most likely alternatives
      (0..MAX_LOGPROBS; None = off). They are the model's own distribution (log-softmax of the raw logits),
      before penalties, temperature and filters, as vLLM reports them by default.
    - prompt_logprobs: also record the log-probability of every prompt token after the first (and as many
      alternatives as `logprobs` asks), e.g. to score a text.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eot: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool = False

    def __post_init__(self) -> None:
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""

        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise bad("max_new_tokens", "a non-negative integer")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", ">= 0")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise bad("top_k", "a non-negative integer")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise bad("min_p", "in [0, 1]")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", "> 0")
        for name in ("frequency_penalty", "presence_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise bad(name, "a finite number")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0


# ---------------------------------------------------------------------------------------------------------
# Logit filters: (n, V) fp32 logits, a float or an (n,) tensor per parameter; removed tokens become -inf
# ---------------------------------------------------------------------------------------------------------
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


def apply_top_p(logits: torch.Tensor, p: float | torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the fewest most likely tokens whose probability reaches p (p >= 1: all)."""
    p = _per_row(p, logits)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop = (mass_before >= p) & (p < 1)
    drop[:, 0] = False  # the top token always stays
    return logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float | torch.Tensor) -> torch.Tensor:
    """Keep tokens whose probability is at least min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * _per_row(min_p, logits)
    return logits.masked_fill(probs < threshold, float("-inf"))


def sample_next(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    counts: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
) -> list[int]:
    """One next token per row of `logits` (n, V), each row under its own params and generator; the sampling
    arithmetic runs in fp32 whatever the logits' dtype.

    Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token j with probability
    p_j, and lets each row draw its noise from its own generator, followed by one batched argmax.
    """
    logits = logits.float()  # (also for greedy: torch's bf16 argmax on CPU is 3x slower than cast + argmax)
    dev = logits.device
    if any(sp.penalized for sp in params):
        col = lambda name: torch.tensor([getattr(sp, name) for sp in params], device=dev)  # noqa: E731
        logits = apply_penalties(
            logits, counts, seen, col("repetition_penalty"), col("frequency_penalty"), col("presence_penalty")
        )
    if all(sp.greedy for sp in params):  # the common fast path: no softmax, no sort
        return logits.argmax(dim=-1).tolist()

    temps = torch.tensor([sp.temperature or 1.0 for sp in params], dtype=logits.dtype, device=dev)
    logits = logits / temps[:, None]
    if any(sp.top_k for sp in params):
        logits = apply_top_k(logits, torch.tensor([sp.top_k or 0 for sp in params], device=dev))
    if any(sp.top_p is not None and sp.top_p < 1 for sp in params):
        logits = apply_top_p(logits, torch.tensor([sp.top_p or 1.0 for sp in params], device=dev))
    if any(sp.min_p for sp in params):
        logits = apply_min_p(logits, torch.tensor([sp.min_p or 0.0 for sp in params], device=dev))
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, (sp, g) in enumerate(zip(params, generators, strict=True)):
        if sp.greedy:  # decided by argmax below; don't touch any random stream
            noise[i] = 1.0
        else:
            noise[i].exponential_(generator=g)
    sampled = (probs / noise).argmax(dim=-1)
    greedy = torch.tensor([sp.greedy for sp in params], device=dev)
    if greedy.any():
        sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)  # temperature 0 rows in a mixed batch
    return sampled.tolist()


@dataclass(frozen=True)
class TokenLogprob:
    """A token, its log-probability under the model, and the most likely alternatives (best first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, n_top: int) -> list[TokenLogprob]:
    """Log-probabilities of `token_ids` (n,) under the rows of `logits` (n, V), with each row's n_top best."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, token_ids.reshape(-1, 1).to(logp.device))[:, 0].tolist()
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(chosen)
    if n_top > 0:
        values, indices = logp.topk(min(n_top, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    return [TokenLogprob(int(t), lp, top) for t, lp, top in zip(token_ids.tolist(), chosen, tops, strict=True)]


def row_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request: `seed` itself for the first, a mix of both for the others."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index) & (2**64 - 1)  # splitmix64 finalizer: neighbours stay unrelated
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & (2**63 - 1)
