"""The tokens of one optimizer step, and which of their targets count.

A data directory holds token ids, and for chat or prompt/completion data a loss mask beside them (1 = this token
is a target the model is trained to produce: an assistant's reply, not the user's prompt) and a window layout
(examples packed into windows of block_size + 1 tokens, padding masked out). The loss of a step is the mean over
every counted target of the *global* batch, whatever its split into micro-steps and processes: each micro-step
contributes its summed loss divided by the step's count of targets, so a micro-batch of short replies weighs as
little as it should, and gradient accumulation or more processes change nothing but rounding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gptlab.data import (
    batch_starts,
    check_split_fits,
    document_end_id,
    load_mask,
    load_split,
    micro_batch,
    read_meta,
    windows,
)
from gptlab.data.dataset import tokenizer_identity
from gptlab.errors import GptlabError
from gptlab.kv_cache import document_ids


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
class TokenSplit:
    """One split of a data directory: token ids, the loss mask (None: every target counts), the window size
    examples were packed into (None: one running stream of text), and whether windows come in preference pairs
    (chosen, then rejected)."""

    tokens: np.ndarray
    mask: np.ndarray | None
    window_tokens: int | None
    pairs: bool = False

    @classmethod
    def load(cls, data_dir: str | Path, split: str) -> TokenSplit:
        meta = read_meta(data_dir)
        window = meta.get("window_tokens")
        return cls(load_split(data_dir, split), load_mask(data_dir, split), int(window) if window else None,
                   meta.get("layout") == "pairs")


@dataclass
class Mixture:
    """The train splits of several data directories, each row of a step drawn from one of them by `weights`
    (which sum to 1). Like a single split's, a step's rows are a pure function of (seed, step): which source each
    row comes from and where it starts are drawn by generators seeded with them, so the loader's position in
    every source and the sampler's state are the step a checkpoint records, and a resumed run (or one over more
    processes) draws the same rows."""

    sources: list[TokenSplit]
    weights: np.ndarray
    pairs: bool = False


def load_train_data(sources: list[tuple[Path, float]], block_size: int) -> tuple[TokenSplit | Mixture, int]:
    """The train split of one data directory, or the mixture of several (same tokenizer: checked), and the tokens
    of a row: the shortest any source allows (`sequence_length`), each source checked to hold one."""
    seq_len = min(sequence_length(d, block_size) for d, _ in sources)
    for d, _ in sources:
        check_split_fits(d, "train", seq_len)
    if len(sources) == 1:
        return TokenSplit.load(sources[0][0], "train"), seq_len
    first = tokenizer_identity(sources[0][0])
    for d, _ in sources[1:]:
        if tokenizer_identity(d) != first:
            raise GptlabError(f"--data mixes {sources[0][0]} and {d}, prepared with different tokenizers: prepare "
                              f"them with the same one (--tokenizer-from {sources[0][0]})")
    splits = [TokenSplit.load(d, "train") for d, _ in sources]
    if any(s.pairs for s in splits):
        raise GptlabError("preference pairs cannot be mixed with other data: train on their directory alone")
    weights = np.array([w for _, w in sources], dtype=np.float64)
    return Mixture(splits, weights / weights.sum()), seq_len


def document_eot(document_mask: bool, sources: list[tuple[Path, float]]) -> int | None:
    """The end-of-text id that ends documents, when the recipe's document_mask asks for one (None when not); every
    source of a mixture must end its documents with it (one of chats would have its turns cut apart)."""
    if not document_mask:
        return None
    ends = [document_end_id(read_meta(data_dir)) for data_dir, _ in sources]
    for (data_dir, _), end in zip(sources, ends, strict=True):
        if end is None:
            raise GptlabError(f"document_mask = true needs documents ended by end-of-text tokens; {data_dir} has "
                              "none (prepare it with a tokenizer that has one: gpt2, bpe, --tokenizer-from)")
    return ends[0]  # the sources share one tokenizer (`load_train_data`)


def mixture_batch(mix: Mixture, seed: int, step: int, batch_size: int, block_size: int) -> StepBatch:
    """The windows of step `step` drawn from a mixture: each row's source by weight, then its start in that
    source as `batch_starts` draws starts, from a stream of its own per source."""
    rng = np.random.Generator(np.random.PCG64([seed, step, 0]))  # the sources draw from streams 1, 2, ...
    which = rng.choice(len(mix.sources), size=batch_size, p=mix.weights)
    tokens = np.empty((batch_size, block_size + 1), np.int64)
    masked = any(s.mask is not None for s in mix.sources)
    mask = np.ones((batch_size, block_size + 1), np.uint8) if masked else None
    for k, source in enumerate(mix.sources):
        rows = np.flatnonzero(which == k)
        if not rows.size:
            continue
        starts = batch_starts(len(source.tokens), seed, step, rows.size, block_size, source.window_tokens,
                              stream=k + 1)
        tokens[rows] = windows(source.tokens, starts, block_size)
        if mask is not None and source.mask is not None:
            mask[rows] = windows(source.mask, starts, block_size)
    n_targets = batch_size * block_size if mask is None else int((mask[:, 1:] != 0).sum())
    return StepBatch(tokens, mask, n_targets)


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

    def tokens(self, world: int, grad_accum: int) -> int:
        """The input tokens of every process's micro-steps together: what tokens/s counts. Pairs' rows are cut
        after each micro-step's last counted target, so they hold fewer than their windows."""
        if not self.pairs:
            return self.windows.shape[0] * (self.windows.shape[1] - 1)
        assert self.mask is not None
        cuts = (micro_batch(self.mask, r, world, m, grad_accum) for r in range(world) for m in range(grad_accum))
        return sum(len(rows) * _cut_length(rows) for rows in cuts)


def step_batch(split: TokenSplit | Mixture, seed: int, step: int, batch_size: int, block_size: int) -> StepBatch:
    """The windows of optimizer step `step`: a pure function of (seed, step), the same on every process."""
    if isinstance(split, Mixture):
        return mixture_batch(split, seed, step, batch_size, block_size)
    starts = batch_starts(len(split.tokens), seed, step, batch_size, block_size, split.window_tokens, split.pairs)
    tokens = windows(split.tokens, starts, block_size)
    if split.mask is None:
        return StepBatch(tokens, None, batch_size * block_size)
    mask = windows(split.mask, starts, block_size)
    return StepBatch(tokens, mask, batch_size if split.pairs else int((mask[:, 1:] != 0).sum()), split.pairs)


def targets_of(rows: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of (N, W) rows, targets that do not count -1, cut after the last counted one."""
    counted = mask[:, 1:] != 0
    length = _cut_length(mask)
    x = torch.from_numpy(np.ascontiguousarray(rows[:, :length]))
    y = torch.from_numpy(np.where(counted, rows[:, 1:], -1)[:, :length])
    return x, y


def _cut_length(mask: np.ndarray) -> int:
    """How many positions `targets_of` keeps of (N, W) rows with this mask: up to the last counted target."""
    return int(np.flatnonzero((mask[:, 1:] != 0).any(axis=0)).max(initial=0)) + 1


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


def pair_rows(split: TokenSplit, batch_pairs: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
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
    documents: list[torch.Tensor | None]  # per micro-step, with a document mask: each input's document
    tokens: int = 0  # the input tokens of the step over all processes (`StepBatch.tokens`)


class StepFeed:
    """This process's batches of each step, cut, checked and sent to the device one step ahead.

    `prefetch(s + 1)` is called while the device still runs step s: the host cuts the windows, checks them and
    queues the copies (from pinned memory with non_blocking=True on CUDA, so the host does not wait for the
    device), and `get(s + 1)` then has them ready. The batches are those of `step_batch`, a pure function of
    (seed, step): preparing them early changes nothing."""

    def __init__(self, split: TokenSplit, *, seed: int, batch_size: int, seq_len: int, rank: int, world: int,
                 grad_accum: int, vocab_size: int, device: str, document_eot: int | None = None,
                 count_tokens: bool = True) -> None:
        self.split, self.seed, self.batch_size, self.seq_len = split, seed, batch_size, seq_len
        self.rank, self.world, self.grad_accum = rank, world, grad_accum
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self.document_eot = document_eot  # set: each micro-step also gets its inputs' document ids
        self._ahead: DeviceStep | None = None
        # seconds a step waited for batches not made ahead, and seconds the host spent making them ahead
        self.wait_sec, self.host_sec = 0.0, 0.0
        # input tokens of every step of the run (state.json's and metrics.jsonl's tokens_seen, and tokens/s over
        # the steps between two rows): a sum kept, not steps x a window's tokens, which pairs' cut rows do not
        # fill; a resumed run sets its checkpoint's. `count_tokens` False: the rows trained on are made later, per
        # process (GRPO's rollouts), and the trainer adds those instead of the prompt windows fed here
        self.seen_tokens, self.count_tokens = 0, count_tokens

    def get(self, step: int) -> DeviceStep:
        """The batches of `step`: those prepared ahead when they are this step's, else made now."""
        ready, self._ahead = self._ahead, None
        if ready is None or ready.step != step:
            t0 = time.perf_counter()
            ready = self._prepare(step)
            self.wait_sec += time.perf_counter() - t0
        if self.count_tokens:
            self.seen_tokens += ready.tokens
        return ready

    def prefetch(self, step: int) -> None:
        """Prepare `step`'s batches now, for the coming `get(step)`."""
        t0 = time.perf_counter()
        self._ahead = self._prepare(step)
        self.host_sec += time.perf_counter() - t0

    def per_step_ms(self, steps: int) -> float:
        """Milliseconds per step the host spent on batches over the last `steps` steps (counted from here on):
        what a step waited for its own plus what it spent making the next one ahead."""
        total, self.wait_sec, self.host_sec = self.wait_sec + self.host_sec, 0.0, 0.0
        return 1000.0 * total / max(steps, 1)

    def _prepare(self, step: int) -> DeviceStep:
        batch = step_batch(self.split, self.seed, step, self.batch_size, self.seq_len)
        check_tokens(batch.windows, self.vocab_size)
        micro = [batch.micro(self.rank, self.world, m, self.grad_accum) for m in range(self.grad_accum)]
        documents = [None if self.document_eot is None else self._to_device(document_ids(x, self.document_eot))
                     for x, _ in micro]
        micro = [(self._to_device(x), self._to_device(y)) for x, y in micro]
        return DeviceStep(step, micro, batch.n_targets, documents, batch.tokens(self.world, self.grad_accum))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":  # nothing to overlap on a CPU: the tensor as `micro` made it
            return t.to(self.device)
        # a pageable copy would wait for the device to finish its queue; a pinned one is queued like a kernel
        return t.contiguous().pin_memory().to(self.device, non_blocking=True)
