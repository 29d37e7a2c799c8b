"""The tokens of one optimizer step, and which of their targets count.

A data directory holds token ids, and for chat or prompt/completion data a loss mask beside them (1 = this token
is a target the model is trained to produce: an assistant's reply, not the user's prompt) and a window layout
(examples packed into windows of block_size + 1 tokens, padding masked out). The loss of a step is the mean over
every counted target of the *global* batch, whatever its split into micro-steps and processes: each micro-step
contributes its summed loss divided by the step's count of targets, so a micro-batch of short replies weighs as
little as it should, and gradient accumulation or more processes change nothing but rounding.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    """One split of a data directory: token ids, the loss mask (None: every target counts), the window size
    examples were packed into (None: one running stream of text), and whether windows come in preference pairs
    (chosen, then rejected)."""

    tokens: np.ndarray
    mask: np.ndarray | None
    window_tokens: int | None
    pairs: bool = False

    @classmethod
    def load(cls, data_dir: str | Path, split: str) -> Split:
        meta = read_meta(data_dir)
        window = meta.get("window_tokens")
        return cls(load_split(data_dir, split), load_mask(data_dir, split), int(window) if window else None,
                   meta.get("layout") == "pairs")


@dataclass
class StepBatch:
    """The global batch of one optimizer step: (B, T+1) token windows, their (B, T+1) 0/1 mask (None when all
    count) and how many targets count in total; for preference pairs 2B rows (chosen, rejected, ...) and the
    number of pairs, which a step's loss is the mean over."""

    windows: np.ndarray
    mask: np.ndarray | None
    n_targets: int
    pairs: bool = False

    def micro(self, rank: int, world: int, micro: int, grad_accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one process's micro-step; targets that do not count are -1. Pairs are padded
        replies: their rows are cut after the micro-step's last counted target."""
        if self.pairs:
            assert self.mask is not None
            return targets_of(micro_batch(self.windows, rank, world, micro, grad_accum),
                              micro_batch(self.mask, rank, world, micro, grad_accum))
        rows = torch.from_numpy(micro_batch(self.windows, rank, world, micro, grad_accum))
        x, y = rows[:, :-1], rows[:, 1:]
        if self.mask is not None:
            keep = torch.from_numpy(micro_batch(self.mask, rank, world, micro, grad_accum)[:, 1:] != 0)
            y = y.masked_fill(~keep, -1)
        return x, y


def step_batch(split: Split, seed: int, step: int, batch_size: int, block_size: int) -> StepBatch:
    """The windows of optimizer step `step`: a pure function of (seed, step), the same on every process."""
    starts = batch_starts(len(split.tokens), seed, step, batch_size, block_size, split.window_tokens, split.pairs)
    tokens = windows(split.tokens, starts, block_size)
    if split.mask is None:
        return StepBatch(tokens, None, batch_size * block_size)
    mask = windows(split.mask, starts, block_size)
    return StepBatch(tokens, mask, batch_size if split.pairs else int((mask[:, 1:] != 0).sum()), split.pairs)


def targets_of(rows: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of (N, W) rows, targets that do not count -1, cut after the last counted one."""
    counted = mask[:, 1:] != 0
    length = int(np.flatnonzero(counted.any(axis=0)).max(initial=0)) + 1
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :length]))
    y = torch.from_numpy(np.where(counted, rows[:, 1:], -1)[:, :length])
    return x, y


def rows_of_pairs(pairs: list[dict[str, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenized pairs, as trl's preference datasets hold them ("prompt_ids", "chosen_ids", "rejected_ids"), as
    the trainer's rows: prompt + chosen, prompt + rejected, ...; targets on the replies (`targets_of`)."""
    seqs = [(p["prompt_ids"], p[reply]) for p in pairs for reply in ("chosen_ids", "rejected_ids")]
    width = max(len(a) + len(b) for a, b in seqs) + 1
    ids, mask = np.zeros((len(seqs), width), np.int64), np.zeros((len(seqs), width), np.uint8)
    for i, (prompt, reply) in enumerate(seqs):
        ids[i, : len(prompt) + len(reply)] = prompt + reply
        mask[i, len(prompt) : len(prompt) + len(reply)] = 1
    return targets_of(ids, mask)


def pair_rows(split: Split, batch_pairs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Every preference pair of a split, `batch_pairs` at a time, as (inputs, targets) rows (`targets_of`)."""
    assert split.pairs and split.mask is not None and split.window_tokens is not None
    window, n = split.window_tokens, len(split.tokens) // split.window_tokens
    for start in range(0, n, 2 * batch_pairs):
        stop = min(n, start + 2 * batch_pairs)
        ids = np.asarray(split.tokens[start * window : stop * window], np.int64).reshape(-1, window)
        yield targets_of(ids, np.asarray(split.mask[start * window : stop * window]).reshape(-1, window))


def check_tokens(windows: np.ndarray, vocab_size: int) -> None:
    """The model's forward reads no token id back on the trainer's path (a host read per micro-step would stall
    a GPU), so the trainer checks each batch here, on the host, with the forward's one-line error."""
    if windows.size and int(windows.max()) >= vocab_size:  # token files hold unsigned ids: none below 0
        raise GptlabError(f"token id {int(windows.max())} is outside [0, {vocab_size}) (the model's vocab_size)")


@dataclass
class DeviceStep:
    """One optimizer step as this process runs it: its micro-steps' (inputs, targets) on the device, and how
    many targets count in the whole global batch."""

    step: int
    micro: list[tuple[torch.Tensor, torch.Tensor]]
    n_targets: int


class StepFeed:
    """This process's batches of each step, cut, checked and sent to the device one step ahead.

    `prefetch(s + 1)` is called while the device still runs step s: the host cuts the windows, checks them and
    queues the copies (from pinned memory with non_blocking=True on CUDA, so the host does not wait for the
    device), and `get(s + 1)` then has them ready. The batches are those of `step_batch`, a pure function of
    (seed, step): preparing them early changes nothing."""

    def __init__(self, split: Split, *, seed: int, batch_size: int, seq_len: int, rank: int, world: int,
                 grad_accum: int, vocab_size: int, device: str) -> None:
        self.split, self.seed, self.batch_size, self.seq_len = split, seed, batch_size, seq_len
        self.rank, self.world, self.grad_accum = rank, world, grad_accum
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._ahead: DeviceStep | None = None

    def get(self, step: int) -> DeviceStep:
        """The batches of `step`: those prepared ahead when they are this step's, else made now."""
        ready, self._ahead = self._ahead, None
        return ready if ready is not None and ready.step == step else self._prepare(step)

    def prefetch(self, step: int) -> None:
        """Prepare `step`'s batches now, for the coming `get(step)`."""
        self._ahead = self._prepare(step)

    def _prepare(self, step: int) -> DeviceStep:
        batch = step_batch(self.split, self.seed, step, self.batch_size, self.seq_len)
        check_tokens(batch.windows, self.vocab_size)
        micro = [tuple(self._to_device(t) for t in batch.micro(self.rank, self.world, m, self.grad_accum))
                 for m in range(self.grad_accum)]
        return DeviceStep(step, micro, batch.n_targets)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":  # nothing to overlap on a CPU: the tensor as `micro` made it
            return t.to(self.device)
        # a pageable copy would wait for the device to finish its queue; a pinned one is queued like a kernel
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)
