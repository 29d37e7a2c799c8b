"""Turning logits into tokens: `sample_next` (the filters and penalties of `gptlab.generation.logit_filters`, then
one draw per row), and the log-probabilities reported back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from gptlab.generation.logit_filters import (
    PENALTIES,
    GrammarMasks,
    apply_grammars,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    grammar_masks,
    mask_probabilities,
)
from gptlab.generation.params import SamplingParams

if TYPE_CHECKING:
    from gptlab.generation.grammar import RowGrammar


def _column(params: Sequence[SamplingParams], name: str, device: torch.device) -> torch.Tensor:
    """One SamplingParams field as an (n,) tensor, one value per row."""
    return torch.tensor([getattr(sp, name) for sp in params], device=device)


def sample_next(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    counts: torch.Tensor | None = None,
    seen: torch.Tensor | None = None,
    grammars: Sequence[RowGrammar | None] = (),
) -> list[int]:
    """One next token per row of `logits` (n, V), each row under its own params and generator; the sampling
    arithmetic runs in fp32 whatever the logits' dtype.

    Each row draws one uniform from its own generator (`row_uniforms`) and takes the token where it falls in the
    row's cumulative distribution (`inverse_cdf`), batched over the rows: on a CPU with gptlab's kernels and no row
    filtering, in one C++ op (`native_sampler`) that reads each row once, greedy rows' argmax included.

    A row with a grammar (structured outputs) samples only among the tokens it allows. Where it filters (top-k,
    top-p, min-p), which act within the mask, it masks its logits first. Else its
    token is drawn as if it had no grammar, kept where the grammar allows it, and drawn again under the mask
    where not (`_draw_allowed`): a draw from p kept when it falls in the allowed set A, else a draw from p
    restricted to A, is a draw from p restricted to A; a greedy row's argmax, where allowed, is the allowed
    argmax. Only the rows that drew a forbidden token pay for a mask (llguidance walks the vocabulary for each:
    ~25 us a row of GPT-2's on a Zen 3 core), and a model that follows its schema seldom draws one. The logit
    bias and penalties act token by token, before either.
    """
    logits = logits.float()  # (also for greedy: torch's bf16 argmax on CPU is 3x slower than cast + argmax)
    dev = logits.device
    constrained = any(g is not None for g in grammars)
    # masked first: the constrained rows that filter themselves, never because another row does (a seeded row's
    # tokens would then depend on what shares its batch)
    first = [g if g is not None and _filters(sp) else None
             for g, sp in zip(grammars, params, strict=True)] if constrained else []
    masks = grammar_masks(first, logits.shape[-1], dev) if any(g is not None for g in first) else None
    if masks is not None:
        logits = apply_grammars(logits, first, masks)
    if any(sp.logit_bias for sp in params):
        logits = apply_logit_bias(logits, params)
    if any(sp.penalized for sp in params):
        rep, freq, pres = (_column(params, name, dev) for name in PENALTIES)
        logits = apply_penalties(logits, counts, seen, rep, freq, pres)
    tokens, probs = _draw(logits, params, generators)
    if masks is not None:
        tokens = _within(tokens, logits, masks)
    if constrained:
        redo = [i for i, g in enumerate(grammars) if g is not None and first[i] is None and not g.allows(tokens[i])]
        if redo:
            return _draw_allowed(tokens, logits, probs, redo, params, generators, grammars)
    return tokens


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams],
          generators: Sequence[torch.Generator | None]) -> tuple[list[int], torch.Tensor | None]:
    """Each row's token from its fp32 `logits` (n, V), and the probabilities the rows were drawn from where the ATen
    path drew them (None from gptlab's kernel, which keeps none, or where every row is greedy)."""
    if all(sp.greedy for sp in params):  # argmax alone: no uniforms, no kernel call (a batch-1 step's ~70 us)
        return logits.argmax(dim=-1).tolist(), None
    u = row_uniforms(params, generators, logits.device)
    sampler = None if any(_filters(sp) for sp in params) else native_sampler(logits)
    if sampler is None:
        return _aten_draw(logits, params, u)
    drawn = sampler(logits.contiguous(), torch.arange(len(params)), _scales(params), u, _NO_MASK)
    bad = (drawn < 0).nonzero()[:, 0].tolist()  # non-finite logits: the ATen path's rules
    if bad:
        drawn[bad] = torch.tensor(_aten_draw(logits[bad], [params[i] for i in bad], u[bad])[0])
    return drawn.tolist(), None


def _aten_draw(logits: torch.Tensor, params: Sequence[SamplingParams],
               u: torch.Tensor) -> tuple[list[int], torch.Tensor | None]:
    """`_draw` in ATen ops, from the rows' uniforms `u`."""
    if all(sp.greedy for sp in params):  # no softmax, no sort
        return logits.argmax(dim=-1).tolist(), None
    probs = filtered_probs(logits, params)
    sampled = inverse_cdf(probs, u)
    greedy = torch.tensor([sp.greedy for sp in params], device=logits.device)
    if greedy.any():
        sampled = torch.where(greedy, logits.argmax(dim=-1), sampled)  # temperature 0 rows in a mixed batch
    return sampled.tolist(), probs


def native_sampler(logits: torch.Tensor):  # noqa: ANN201 - the op, or None
    """gptlab's C++ sampler (`kernels/sampling.cpp`: the draw below, rows read once, in one op instead of ~17) for
    CPU logits on a machine whose kernels built, else None: the ATen path."""
    if logits.device.type != "cpu" or logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    from gptlab.kernels import widest_ops

    ops = widest_ops()
    return None if ops is None else ops.sample_rows


_NO_MASK = torch.empty(0, dtype=torch.int32)


def _filters(sp: SamplingParams) -> bool:
    return sp.top_k > 0 or sp.top_p < 1 or sp.min_p > 0


def _fp32_range(x: float) -> float:
    """x (> 0) within fp32's positive normal numbers: a temperature or its inverse past them would be inf or 0."""
    return min(max(x, _FP32.tiny), _FP32.max)


_FP32 = torch.finfo(torch.float32)


def _scales(params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's 1 / temperature for the kernel; 0 for a greedy row (its argmax)."""
    return torch.tensor([0.0 if sp.greedy else _fp32_range(1.0 / (sp.temperature or 1.0)) for sp in params],
                        dtype=torch.float32)


def _draw_allowed(tokens: list[int], logits: torch.Tensor, probs: torch.Tensor | None, rows: list[int],
                  params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                  grammars: Sequence[RowGrammar | None]) -> list[int]:
    """`tokens` with the unfiltered constrained `rows` drawn again among the tokens their grammars allow, from the
    batch's fp32 logits (n, V) and the probabilities of the first draw (the rows' copies written here). gptlab's
    kernel draws them from the logits and the grammars' bits, where it runs. Else the mask
    multiplies the probabilities where no row is greedy and each keeps some probability; else it goes on the
    logits (allowed tokens that all underflowed in the unmasked softmax still get theirs); `_within` has the last
    word."""
    from gptlab.generation.grammar import allowed_bits, unpack_bits

    whole = len(rows) == logits.shape[0]  # (every row: no copies)
    params, generators, grammars = ([seq[i] for i in rows] for seq in (params, generators, grammars))
    bits = allowed_bits(grammars, logits.shape[-1])
    sampler = native_sampler(logits)
    if sampler is not None:
        drawn = sampler(logits.contiguous(), torch.tensor(rows), _scales(params),
                        row_uniforms(params, generators, logits.device), torch.from_numpy(bits.view(np.int32)))
        if bool((drawn >= 0).all()):  # (else a row's allowed logits are not finite: the ATen path's rules)
            for i, token in zip(rows, drawn.tolist(), strict=True):
                tokens[i] = token
            return tokens
    allowed = unpack_bits(bits, logits.shape[-1]).to(logits.device, torch.float32)
    drawn = None
    if probs is not None and not any(sp.greedy for sp in params):
        probs = probs if whole else probs[rows]
        if mask_probabilities(probs, allowed):
            drawn = inverse_cdf(probs, row_uniforms(params, generators, logits.device)).tolist()
    if drawn is None:
        drawn = _draw(apply_grammars(logits if whole else logits[rows], grammars, (None, allowed)), params,
                      generators)[0]
    for i, token in zip(rows, drawn, strict=True):
        tokens[i] = token
    return _within(tokens, logits, (None if whole else torch.tensor(rows, device=logits.device), allowed))


def _within(tokens: list[int], logits: torch.Tensor, masks: GrammarMasks) -> list[int]:
    """`tokens`, each constrained row's (`masks`' rows of the batch's `logits`) replaced by its most likely allowed
    token where it is one the row's grammar forbids: what weights that are not finite draw (a penalty or a bias
    that overflowed the logits, whose softmax is NaN). A constrained row never leaves its grammar."""
    index, allowed = masks
    rows = torch.arange(len(tokens), device=logits.device) if index is None else index
    drawn = torch.tensor(tokens, device=logits.device)[rows]
    forbidden = allowed.gather(1, drawn[:, None])[:, 0] == 0
    if not bool(forbidden.any()):
        return tokens
    finite = logits[rows].nan_to_num(nan=-3e38, posinf=3e38, neginf=-3e38)  # NaN least likely, yet allowed
    best = torch.where(allowed > 0, finite, float("-inf")).argmax(dim=-1)
    for row, bad, token in zip(rows.tolist(), forbidden.tolist(), best.tolist(), strict=True):
        if bad:
            tokens[row] = token
    return tokens


def row_uniforms(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) (fp64) per row: a row with a generator of its own (a seeded request) draws it from
    that generator, so its tokens are the ones it would get alone; the rows on torch's global generator draw
    theirs in one call; a greedy row's is 0 and its stream is left untouched (argmax decides it)."""
    shared = [i for i, (sp, g) in enumerate(zip(params, generators, strict=True)) if g is None and not sp.greedy]
    if len(shared) == len(params):
        return torch.rand(len(params), dtype=torch.float64, device=device)
    u = torch.zeros(len(params), dtype=torch.float64, device=device)
    if shared:
        u[shared] = torch.rand(len(shared), dtype=torch.float64, device=device)
    for i, (sp, g) in enumerate(zip(params, generators, strict=True)):
        if g is not None and not sp.greedy:
            u[i] = torch.rand((), dtype=torch.float64, generator=g, device=device)
    return u


_BLOCK = 256  # tokens per block of inverse_cdf's first scan


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i of `weights` (n, V) (non-negative, with some positive) and its uniform u[i] in [0, 1): the token j
    whose cumulative weight brackets u[i] times the row's total, so token j with probability weight_j / total.

    The running sums are fp64. Over a vocabulary wider than _BLOCK they are two short scans: over the blocks'
    totals (each an fp32 sum, within ~1e-7 of the block's weight, as the fp32 weights themselves are), then inside
    the one block that holds the target; a target that close to a block's edge may take the token beside it. (The
    exponential race, argmax(p / E) over Exp(1) noise, drew V random numbers a row: 17 ms a step at 16 rows of
    GPT-2's 50,257 tokens on a Zen 3 core; one fp64 scan over the whole vocabulary took 5 ms.)"""
    n, V = weights.shape
    if V <= _BLOCK:
        cdf = weights.to(torch.float64).cumsum(-1)
        return _bracket(cdf, u.reshape(n, 1) * cdf[:, -1:])[:, 0]
    whole = V - V % _BLOCK  # the tokens in whole blocks; the rest make a last, shorter block
    sums = weights[:, :whole].reshape(n, -1, _BLOCK).sum(-1)  # (n, nb) each block's weight (a view: no copy)
    if whole < V:
        sums = torch.cat([sums, weights[:, whole:].sum(-1, keepdim=True)], dim=1)
    ends = sums.to(torch.float64).cumsum(-1)  # (n, nb) the weight up to each block's end (an fp32 sum of fp32
    # values costs a sixth of an fp64 one)
    target = u.reshape(n, 1) * ends[:, -1:]  # (n, 1)
    b = _bracket(ends, target)  # (n, 1) the block that holds the target
    before = torch.where(b > 0, ends.gather(1, (b - 1).clamp(min=0)), 0.0)
    ids = b * _BLOCK + torch.arange(_BLOCK, device=weights.device)  # (n, B) its tokens, past V in the last block
    inside = weights.gather(1, ids.clamp(max=V - 1)).to(torch.float64).masked_fill_(ids >= V, 0.0).cumsum(-1)
    return (b * _BLOCK + _bracket(inside, target - before))[:, 0].clamp_(max=V - 1)  # (a row of NaNs: its last)


def _bracket(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row of `cdf` (n, m), ascending, the first index whose value exceeds target (n, 1): where the target
    falls. A target rounded to the row's total or past it gets the last index of positive weight (where the total
    is first reached), never one of weight 0; a row whose sums are not finite (a penalty that overflowed its logits)
    gets an index in range all the same."""
    last = torch.searchsorted(cdf, cdf[:, -1:].contiguous()).clamp_(max=cdf.shape[-1] - 1)
    return torch.minimum(torch.searchsorted(cdf, target, right=True), last)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each row of fp32 `logits` (n, V) is sampled from: temperature, then top-k, top-p and
    min-p (a greedy row is divided by 1: its token is the argmax, which no filter removes). Speculative decoding
    reads it for its accept/reject rule, so both draw from the one distribution."""
    dev = logits.device
    temps = [_fp32_range(sp.temperature or 1.0) for sp in params]
    if any(t != 1.0 for t in temps):  # (temperature 1, the API's default, divides by nothing: a pass saved)
        # less the row's max first, as the kernel does: a tiny temperature's quotient then never overflows to inf
        # (whose softmax is NaN, and draws the last token) but goes to -inf beside the top token's 0
        top = logits.amax(dim=-1, keepdim=True)
        logits = (logits - top) / torch.tensor(temps, dtype=logits.dtype, device=dev)[:, None]
    # each filter runs only when some row uses it (sorting the vocabulary for top-p is not free); the rows that
    # don't pass their "off" value, which keeps every token
    if any(sp.top_k > 0 for sp in params):
        logits = apply_top_k(logits, _column(params, "top_k", dev))
    if any(sp.top_p < 1 for sp in params):
        logits = apply_top_p(logits, _column(params, "top_p", dev))
    if any(sp.min_p > 0 for sp in params):
        logits = apply_min_p(logits, _column(params, "min_p", dev))
    return logits.softmax(dim=-1)


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


