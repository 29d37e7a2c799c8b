"""The tokens of one optimizer step, and which of their targets count.

A data directory holds token ids, and for chat or prompt/completion data a loss mask beside them (1 = this token
is a target the model is trained to produce: an assistant's reply, not the user's prompt) and a window layout
(examples packed into windows of block_size + 1 tokens, padding masked out). The loss of a step is the mean over
every counted target of the *global* batch, whatever its split into micro-steps and processes: each micro-step
contributes its summed loss divided by the step's count of targets, so a micro-batch of short replies weighs as
little as it should, and gradient accumulation or more processes change nothing but rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptlab.data import batch_starts, load_mask, load_split, micro_batch, read_meta, windows
from gptlab.errors import GptlabError


def sequence_length(data_dir: str | Path, block_size: int) -> int:
    """How many tokens a training row holds: the model's block_size for a running text; for examples packed into
    windows, the window (whose length `prepare --block-size` chose), which must fit the model's context."""
    window = read_meta(data_dir).get("window_tokens")
    if not window:
        return block_size
    if int(window) - 1 > block_size:
        raise GptlabError(f"{data_dir} was prepared with --block-size {int(window) - 1}, longer than the model's "
                          f"context ({block_size}): prepare again with --block-size {block_size} or less")
    return int(window) - 1


@dataclass
class Split:
    """One split of a data directory: token ids, the loss mask (None: every target counts) and the window size
    examples were packed into (None: one running stream of text)."""

    tokens: np.ndarray
    mask: np.ndarray | None
    window_tokens: int | None

    @classmethod
    def load(cls, data_dir: str | Path, split: str) -> Split:
        window = read_meta(data_dir).get("window_tokens")
        return cls(load_split(data_dir, split), load_mask(data_dir, split), int(window) if window else None)


@dataclass
class StepBatch:
    """The global batch of one optimizer step: (B, T+1) token windows, their (B, T+1) 0/1 mask (None when all
    count) and how many targets count in total."""

    windows: np.ndarray
    mask: np.ndarray | None
    n_targets: int

    def micro(self, rank: int, world: int, micro: int, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one process's micro-step; targets that do not count are -1."""
        rows = torch.from_numpy(micro_batch(self.windows, rank, world, micro, grad_accum))
        x, y = rows[:, :-1], rows[:, 1:]
        if self.mask is not None:
            keep = torch.from_numpy(micro_batch(self.mask, rank, world, micro, grad_accum)[:, 1:] != 0)
            y = y.masked_fill(~keep, -1)
        return x, y


def step_batch(split: Split, seed: int, step: int, batch_size: int, block_size: int) -> StepBatch:
    """The windows of optimizer step `step`: a pure function of (seed, step), the same on every process."""
    starts = batch_starts(len(split.tokens), seed, step, batch_size, block_size, split.window_tokens)
    tokens = windows(split.tokens, starts, block_size)
    if split.mask is None:
        return StepBatch(tokens, None, batch_size * block_size)
    mask = windows(split.mask, starts, block_size)
    return StepBatch(tokens, mask, int((mask[:, 1:] != 0).sum()))
