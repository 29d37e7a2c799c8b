"""Validation loss over a whole split (training's evaluation, and `gptlab eval`).

The split is cut into non-overlapping windows of block_size tokens; window w predicts tokens w*T+1 .. w*T+T
from the ones before it inside the window, so every token but the first is scored exactly once (the last,
shorter window included). Loss is the mean cross-entropy in nats over those targets.

Chat and prompt/completion data (a loss mask, examples packed into windows of `window_tokens`) is scored window
by window as it was trained: each window's first block_size + 1 tokens, counting only the masked-in targets.

Under torchrun each process scores a share of the windows (`window_share`) and one all-reduce sums the losses and
the counts, so evaluation gets faster with more GPUs instead of repeating the whole split on each; the losses stay
on the device until then (one host read per evaluation, not one per forward).

The forwards are a scoring pass (`gptlab.kernels.scoring`): on a CPU the training kernels serve them (fused norms,
the heads' split with RoPE, short attention), the loss within fp32 rounding of ATen's.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.data import document_end_id, load_mask, load_split, read_meta
from gptlab.errors import GptlabError
from gptlab.fileio import human_bytes
from gptlab.hardware import available_memory
from gptlab.hooks import eval_mode
from gptlab.kernels import scoring
from gptlab.kv_cache import document_ids
from gptlab.tokenizer import optional_tokenizer


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy (nats) per scored token
    tokens: int  # targets scored

    @property
    def perplexity(self) -> float:
        """exp(loss); infinite past a float's range (a loss over ~709 nats: a diverged model), as exp in floats."""
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf


@torch.no_grad()
def evaluate_loss(
    model: torch.nn.Module,
    data: np.ndarray,
    block_size: int,
    batch_size: int | None = None,
    max_tokens: int | None = None,
    device: str | torch.device = "cpu",
    autocast: contextlib.AbstractContextManager | None = None,
    mask: np.ndarray | None = None,
    window_tokens: int | None = None,
    *,
    rank: int = 0,
    world: int = 1,
    document_eot: int | None = None,
) -> EvalResult:
    """Mean loss of `model` over `data` (1-D token ids), scoring each target once; `max_tokens` scores a
    prefix. With `mask` (1 = the target counts) and `window_tokens`, data is scored in its packed windows.

    `batch_size` windows go through the model at once (default: `default_batch_size`). `autocast` is an optional
    context (e.g. torch.autocast) to run the forward passes under. `rank` of `world` processes (torchrun; every
    one must call this together): each scores its own share of the windows (`window_share`) and one all-reduce
    sums the losses and their counts, so each returns the loss over all of them, as one process would (up to the
    order of fp32 sums). The losses stay on the device until that sum: one host read per evaluation.
    `document_eot`: a model trained with a document mask (this end-of-text id ends documents) scores each window's
    documents each alone, as it trained.
    """
    for name, value in (("block_size", block_size), ("batch_size", batch_size), ("max_tokens", max_tokens)):
        if value is not None and value < 1:  # a window of 0 tokens scores nothing and reports a loss of 0
            raise GptlabError(f"{name} must be at least 1, got {value}")
    n_targets = len(data) - 1
    if max_tokens is not None:
        n_targets = min(n_targets, max_tokens)
    if n_targets < 1:
        raise GptlabError(f"cannot evaluate on {len(data)} token(s): need at least 2")
    if batch_size is None:
        vocab_size = getattr(getattr(model, "config", None), "vocab_size", 50257)
        device_type = torch.device(device).type
        free = available_memory(device) if device_type == "cuda" else None
        batch_size = default_batch_size(block_size, vocab_size, device_type, free)
    if window_tokens:
        n_full = len(data) // window_tokens  # packed windows, all of one length
        if max_tokens is not None:
            n_full = min(n_full, max(1, max_tokens // block_size))
        n_windows = n_full
        rows = _packed_rows(data, mask, n_full, window_tokens, block_size)
    else:  # windows of block_size targets, the last one maybe shorter
        n_full = n_targets // block_size
        n_windows = n_full + int(n_targets > n_full * block_size)
        rows = _split_rows(data, n_targets, block_size)
    batches = _batches(window_share(n_windows, rank, world), n_full, batch_size)
    # a sharded (FSDP) model gathers its weights in every forward: every process runs as many, a process whose
    # share ran out runs one-token forwards that score nothing
    passes = max(len(_batches(window_share(n_windows, r, world), n_full, batch_size)) for r in range(world))
    parts, count = [], 0
    with eval_mode(model), autocast or contextlib.nullcontext(), scoring():
        for windows in batches:
            x, y, counted = rows(windows)
            kw = {} if document_eot is None else {"documents": document_ids(x, document_eot).to(device)}
            _, loss = model(x.to(device), y.to(device), reduction="sum", **kw)
            parts.append(loss)
            count += counted
        for _ in range(passes - len(batches)):
            model(torch.from_numpy(np.asarray(data[:1]).astype(np.int64))[None].to(device))
    total, count = _sum_over_processes(parts, count, device, world)
    if count == 0:
        raise GptlabError("no target in the evaluated windows counts (the loss mask is all zeros)")
    return EvalResult(loss=total / count, tokens=count)


# windows -> inputs, targets (-1: not counted) and how many targets count, known on the host without reading a tensor
Rows = Callable[[range], tuple[torch.Tensor, torch.Tensor, int]]


def window_share(n_windows: int, rank: int, world: int) -> range:
    """The windows `rank` of `world` processes scores: a contiguous run, the shares differing by one window at
    most (with more processes than windows some get none); disjoint, and together every window once. A function
    of its arguments alone, so every process knows every share without asking."""
    return range(rank * n_windows // world, (rank + 1) * n_windows // world)


def _batches(share: range, n_full: int, batch_size: int) -> list[range]:
    """A share's forward passes: its full windows `batch_size` at a time, then the shorter last window (index
    `n_full`, when there is one and the share holds it) alone."""
    stop = min(share.stop, n_full)
    passes = [range(a, min(a + batch_size, stop)) for a in range(share.start, stop, batch_size)]
    return passes + ([range(n_full, n_full + 1)] if share.stop > n_full else [])


def _split_rows(data: np.ndarray, n_targets: int, T: int) -> Rows:
    """Full windows w (tokens w*T .. w*T+T) as (x, y) rows; window n_targets // T, past them, predicts the rest."""
    n_full = n_targets // T

    def rows(windows: range) -> tuple[torch.Tensor, torch.Tensor, int]:
        if windows.start == n_full:  # the shorter last window, alone
            tail = torch.from_numpy(np.asarray(data[n_full * T : n_targets + 1]).astype(np.int64))
            return tail[:-1][None], tail[1:][None], len(tail) - 1
        tokens = torch.from_numpy(np.asarray(data[windows.start * T : windows.stop * T + 1]).astype(np.int64))
        return tokens[:-1].reshape(-1, T), tokens[1:].reshape(-1, T), len(windows) * T

    return rows


def _packed_rows(data: np.ndarray, mask: np.ndarray | None, n_windows: int, window_tokens: int,
                 block_size: int) -> Rows:
    """Packed windows as (x, y) rows: each one's first block_size + 1 tokens, the targets the mask leaves out -1."""
    tokens = _window_rows(data, n_windows, window_tokens)[:, : block_size + 1]
    keep = None if mask is None else _window_rows(mask, n_windows, window_tokens)[:, 1 : block_size + 1]

    def rows(windows: range) -> tuple[torch.Tensor, torch.Tensor, int]:
        picked = torch.from_numpy(tokens[windows.start : windows.stop].astype(np.int64))
        x, y = picked[:, :-1], picked[:, 1:]
        if keep is None:
            return x, y, y.numel()
        dropped = keep[windows.start : windows.stop] == 0
        return x, y.masked_fill(torch.from_numpy(dropped), -1), int(dropped.size - dropped.sum())

    return rows


def _sum_over_processes(parts: list[torch.Tensor], count: int, device: str | torch.device,
                        world: int) -> tuple[float, int]:
    """The summed losses (0-dim tensors on the device) and counted targets of every process, in one host read."""
    acc = torch.float32 if torch.device(device).type == "mps" else torch.float64  # MPS has no float64
    total = torch.stack(parts).to(acc).sum() if parts else torch.zeros((), dtype=acc, device=device)
    both = torch.stack([total, torch.tensor(float(count), dtype=acc).to(device)])
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(both)
    total_sum, counted = both.tolist()
    return total_sum, round(counted)


def _window_rows(array: np.ndarray, n_windows: int, window_tokens: int) -> np.ndarray:
    """The first `n_windows` packed windows of a split (tokens or mask), one per row."""
    return np.asarray(array[: n_windows * window_tokens]).reshape(n_windows, window_tokens)


LOGITS_BYTES = 2**29  # fp32 logits per forward where the free memory is not consulted (CPU, MPS): 512 MB
LOGITS_SHARE = 4  # on a GPU, the fp32 logits may take a quarter of its free memory (the loss, activations: rest)


def default_batch_size(block_size: int, vocab_size: int, device_type: str = "cpu", free_memory: int | None = None
                       ) -> int:
    """Windows per forward pass: about 4k tokens on a CPU (activations stay in cache: twice as fast as 64k for the
    speedrun model), 64k on an accelerator; fewer for big vocabularies so that the fp32 logits stay under 512 MB,
    or on a CUDA GPU under a quarter of its `free_memory` where that is more (GPT-2 on an 80 GB H100: 2 windows
    of 1024 per forward at 512 MB, 64 with 60 GB free)."""
    tokens = 4096 if device_type == "cpu" else 65536
    budget = LOGITS_BYTES
    if device_type == "cuda" and free_memory is not None:
        budget = max(budget, free_memory // LOGITS_SHARE)
    return max(1, min(tokens, budget // (4 * vocab_size)) // block_size)


def batch_memory(vocab_size: int, n_embd: int, batch_size: int, block_size: int) -> int:
    """A lower bound on the bytes of one forward pass of `batch_size` windows: the fp32 logits and a few activations
    per token and channel (no backward: a layer's are freed before the next's)."""
    return 4 * batch_size * block_size * (vocab_size + 16 * n_embd)


def check_batch_memory(config: Any, batch_size: int, block_size: int, device: str | torch.device,
                       name: str = "batch_size") -> None:
    """Refuse before any work a batch whose forward pass cannot fit in the device's free memory (as training's
    check does): `name` is how the caller's user gave it (a flag)."""
    need, have = batch_memory(config.vocab_size, config.n_embd, batch_size, block_size), available_memory(device)
    if have is not None and need > have:
        raise GptlabError(f"{name} {batch_size} x block_size {block_size} needs at least {human_bytes(need)} of "
                          f"memory per forward pass, {device} has {human_bytes(have)} free: lower {name}")


def split_bytes(data_dir: str | Path, data: np.ndarray, separator: int | None = None) -> int | None:
    """UTF-8 bytes of a split's scored targets (tokens 1..N-1), by decoding them; None without a tokenizer. The
    `separator` token that preparation put between documents holds none of their text (decoded, it would add
    "<|endoftext|>"'s 13 bytes per document), so it counts no bytes; its loss still counts."""
    tok, _ = optional_tokenizer(data_dir)
    if tok is None:
        return None
    targets = np.asarray(data[1:])
    if separator is not None:
        targets = targets[targets != separator]
    return len(tok.decode_bytes(targets.tolist()))


def evaluate_split(
    model: torch.nn.Module,
    data_dir: str | Path,
    split: str = "val",
    *,
    block_size: int | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    document_eot: int | None = None,
) -> dict[str, Any]:
    """`gptlab eval`: loss, perplexity and bits per byte of a model over a whole split of a data directory.

    Returns {"<split>_loss", "perplexity", "bits_per_byte" (None without a tokenizer), "tokens", "bytes",
    "block_size", "split", "document_mask"}. A low-precision `dtype` runs the matmuls under autocast, attention in
    fp32. `document_eot`: each window's documents (ended by this id) scored alone, as a run with a document mask
    trained them (`evaluate_loss`)."""
    meta = read_meta(data_dir)
    data, mask = load_split(data_dir, split), load_mask(data_dir, split)
    window_tokens = int(meta["window_tokens"]) if meta.get("window_tokens") else None
    if model.config.vocab_size < int(meta["vocab_size"]):
        raise GptlabError(
            f"the model's vocabulary ({model.config.vocab_size}) is smaller than the data's "
            f"({meta['vocab_size']}): was it trained on another tokenizer?"
        )
    autocast = None
    if dtype != torch.float32:
        autocast = torch.autocast(torch.device(device).type, dtype=dtype)
        model.set_attention_dtype(torch.float32)
    block_size = model.config.block_size if block_size is None else block_size
    result = evaluate_loss(model, data, block_size, batch_size=batch_size, device=device, autocast=autocast,
                           mask=mask, window_tokens=window_tokens, document_eot=document_eot)
    if window_tokens:  # the scored targets: each window's tokens 1..block_size that the mask counts
        n = len(data) // window_tokens
        scored = _window_rows(data, n, window_tokens)[:, 1 : block_size + 1]
        if mask is not None:
            scored = scored[_window_rows(mask, n, window_tokens)[:, 1 : block_size + 1] != 0]
        n_bytes = split_bytes(data_dir, np.concatenate([[0], scored.ravel()]), document_end_id(meta))
    else:
        n_bytes = split_bytes(data_dir, data, document_end_id(meta))
    bpb = result.loss * result.tokens / (math.log(2) * n_bytes) if n_bytes else None
    return {
        f"{split}_loss": result.loss,
        "perplexity": result.perplexity,
        "bits_per_byte": bpb,
        "tokens": result.tokens,
        "bytes": n_bytes,
        "block_size": block_size,
        "split": split,
        "document_mask": document_eot is not None,
    }
