"""Token shift: a vector moved toward the previous position's, by a learned share per channel.

    h_t <- h_t + mix * (h_{t-1} - h_t)        mix (C,), starting at 0: h unchanged

A model with `token_shift` does this at two kinds of points: the token embeddings, and each block's MLP input
(after its norm). The MLP then reads the previous position's features beside the current one's without attention
having to carry them (RWKV's token shift; modded-nanogpt's "smear" of the embeddings). On the CPU speedrun's 2-layer
character model it reaches the same whole-split validation loss on about half the tokens (32 x 120 rows against
48 x 180: `configs/speedrun_cpu.toml`). A position with no previous one (a sequence's first, or a packed document's)
mixes with zeros.

In a cached forward the previous position may be in an earlier step: the KV cache keeps each point's vectors at
every position, as it keeps keys (`KVCache.previous`), so rewinding a row (speculative decoding) or restoring a
cached prefix brings them along."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from gptlab.kv_cache import KVCache


class TokenShift(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mix = nn.Parameter(torch.zeros(dim))

    def forward(self, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """h (B, T, C), previous (B, T, C): the vectors at the positions before h's (zeros where none)."""
        return torch.lerp(h, previous, self.mix.to(h.dtype))


def previous_in_sequence(h: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """Each position's predecessor within the sequence h (B, T, C): zeros at position 0 and, given positions pos
    (B, T) that restart at 0 (packed documents), at every restart."""
    previous = nn.functional.pad(h[:, :-1], (0, 0, 1, 0))
    return previous if pos is None else zeros_at_starts(previous, pos)


def zeros_at_starts(previous: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """previous (B, T, C) with zeros where positions pos (B, T) are 0: those have no predecessor."""
    return previous * (pos > 0).unsqueeze(-1).to(previous.dtype)


class Shifts:
    """Where one forward finds each shift point's previous vectors: in the sequence itself (training, scoring,
    packed documents with their positions) or, for a cached forward, in the cache. Point 0 is the embeddings,
    point l + 1 layer l's MLP input."""

    def __init__(self, pos: torch.Tensor | None, kv_cache: KVCache | None) -> None:
        self.pos, self.kv_cache = pos, kv_cache

    def previous(self, point: int, h: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is not None:
            return self.kv_cache.previous(point, h)
        return previous_in_sequence(h, self.pos)
