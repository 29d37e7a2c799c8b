"""Prompts prefilled together: one forward over any rows of the engine's cache, each row's next prompt tokens
after those it holds, right-padded to the longest.

A server admits requests as they come, into whichever rows are free. Prefilled one by one, each costs a forward
of its own (its framework time and its small matmuls) before the running rows' next step; together they cost one.
The rows need not be contiguous: their cached keys are gathered into a small cache of their own
(`KVCache.gather`), the forward runs there, and what it wrote goes back (`KVCache.scatter`).

Padding costs compute, so rows whose parts differ much in length go in separate forwards (`padded_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gptlab.kv_cache import KVCache
from gptlab.model import GPT

PADDING_WASTE = 2.0  # a forward may compute at most this many times its real tokens (the rest is padding)


def padded_groups(parts: Sequence[int], held: Sequence[int], max_len: int,
                  waste: float = PADDING_WASTE, unpadded: bool = False) -> list[list[int]]:
    """Indices of rows that each feed `parts[i]` tokens after the `held[i]` their cache row holds, grouped into
    forwards: the longest first, a group padded to its longest part computes at most `waste` x its real tokens,
    and every padded row fits the cache (its longest held + its longest part <= max_len). `unpadded`: only parts
    of one length share a forward (RoPE scalings that depend on the length read it off each row's last position,
    which padding would move)."""
    order = sorted(range(len(parts)), key=lambda i: -parts[i])
    groups: list[list[int]] = []
    for i in order:
        group = groups[-1] if groups else None
        if group is not None:
            longest, total = parts[group[0]], sum(parts[j] for j in group) + parts[i]
            fits = max(held[j] for j in [*group, i]) + longest <= max_len
            padding = parts[i] != longest
            if fits and (len(group) + 1) * longest <= waste * total and not (unpadded and padding):
                group.append(i)
                continue
        groups.append([i])
    return groups


def prefill_rows(model: GPT, cache: KVCache, slots: Sequence[int], parts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Feed row slots[i] of `cache` the tokens parts[i] after those it holds, in one forward (rows right-padded
    to the longest part; the caller checks they fit, see `padded_groups`): the hidden states (n, T, C). Each row
    then holds its part more tokens."""
    device = cache.lengths.device
    n, T = len(parts), max(len(p) for p in parts)
    idx = torch.zeros(n, T, dtype=torch.long)
    for i, p in enumerate(parts):
        idx[i, : len(p)] = torch.tensor(p)
    rows = torch.tensor(list(slots), device=device)
    held = cache.lengths[rows]
    first, last = int(held.min()), int(held.max())
    part = cache.gather(rows, last + T)
    hidden = model.hidden_states(idx.to(device), kv_cache=part)
    cache.scatter(rows, part, first, last + T)
    cache.lengths[rows] = held + torch.tensor([len(p) for p in parts], device=device)
    return hidden
