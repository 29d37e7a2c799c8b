"""Validation loss over a whole split (training's evaluation, and `gptlab eval`).

The split is cut into non-overlapping windows of block_size tokens; window w predicts tokens w*T+1 .. w*T+T
from the ones before it inside the window, so every token but the first is scored exactly once (the last,
shorter window included). Loss is the mean cross-entropy in nats over those targets.

Chat and prompt/completion data (a loss mask, examples packed into windows of `window_tokens`) is scored window
by window as it was trained: each window's first block_size + 1 tokens, counting only the masked-in targets.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gptlab.data import load_mask, load_split, read_meta
from gptlab.errors import GptlabError
from gptlab.fileio import human_bytes
from gptlab.hardware import available_memory
from gptlab.tokenizer import optional_tokenizer


@dataclass
class EvalResult:
    loss: float  # mean cross-entropy (nats) per scored token
    tokens: int  # targets scored

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


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
) -> EvalResult:
    """Mean loss of `model` over `data` (1-D token ids), scoring each target once; `max_tokens` scores a
    prefix. With `mask` (1 = the target counts) and `window_tokens`, data is scored in its packed windows.

    `batch_size` windows go through the model at once (default: `default_batch_size`). `autocast` is an optional
    context (e.g. torch.autocast) to run the forward passes under.
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
        batch_size = default_batch_size(block_size, vocab_size, torch.device(device).type)
    if window_tokens:
        return _evaluate_windows(model, data, mask, window_tokens, block_size, batch_size, max_tokens, device,
                                 autocast)
    was_training = model.training
    model.eval()
    T = block_size
    n_full = n_targets // T
    total = 0.0  # summed in float64 so 100k+ per-token losses add up exactly enough
    windows = np.asarray(data[: n_full * T + 1]).astype(np.int64)
    with autocast or contextlib.nullcontext():
        for start in range(0, n_full, batch_size):
            stop = min(start + batch_size, n_full)
            x = torch.from_numpy(windows[start * T : stop * T].reshape(-1, T))
            y = torch.from_numpy(windows[start * T + 1 : stop * T + 1].reshape(-1, T))
            _, loss = model(x.to(device), y.to(device))
            total += float(loss) * y.numel()
        rest = n_targets - n_full * T
        if rest:  # the last, shorter window
            tail = np.asarray(data[n_full * T : n_targets + 1]).astype(np.int64)
            x, y = torch.from_numpy(tail[:-1])[None], torch.from_numpy(tail[1:])[None]
            _, loss = model(x.to(device), y.to(device))
            total += float(loss) * rest
    model.train(was_training)
    return EvalResult(loss=total / n_targets, tokens=n_targets)


def _evaluate_windows(
    model: torch.nn.Module, data: np.ndarray, mask: np.ndarray | None, window_tokens: int, block_size: int,
    batch_size: int, max_tokens: int | None, device: str | torch.device,
    autocast: contextlib.AbstractContextManager | None,
) -> EvalResult:
    """Mean loss over the counted targets of every packed window (its first block_size + 1 tokens)."""
    n_windows = len(data) // window_tokens
    if max_tokens is not None:
        n_windows = min(n_windows, max(1, max_tokens // block_size))
    tokens = _window_rows(data, n_windows, window_tokens)[:, : block_size + 1]
    keep = None if mask is None else _window_rows(mask, n_windows, window_tokens)[:, 1 : block_size + 1]
    total, counted = 0.0, 0
    was_training = model.training
    model.eval()
    with autocast or contextlib.nullcontext():
        for start in range(0, n_windows, batch_size):
            rows = torch.from_numpy(tokens[start : start + batch_size].astype(np.int64))
            x, y = rows[:, :-1], rows[:, 1:]
            if keep is not None:
                y = y.masked_fill(torch.from_numpy(keep[start : start + batch_size] == 0), -1)
            _, loss = model(x.to(device), y.to(device), reduction="sum")
            total += float(loss)
            counted += int((y != -1).sum())
    model.train(was_training)
    if counted == 0:
        raise GptlabError("no target in the evaluated windows counts (the loss mask is all zeros)")
    return EvalResult(loss=total / counted, tokens=counted)


def _window_rows(array: np.ndarray, n_windows: int, window_tokens: int) -> np.ndarray:
    """The first `n_windows` packed windows of a split (tokens or mask), one per row."""
    return np.asarray(array[: n_windows * window_tokens]).reshape(n_windows, window_tokens)


def default_batch_size(block_size: int, vocab_size: int, device_type: str = "cpu") -> int:
    """Windows per forward pass: about 4k tokens on a CPU (activations stay in cache: twice as fast as 64k for the
    speedrun model), 64k on an accelerator; fewer for big vocabularies so that the fp32 logits stay under 512 MB."""
    tokens = 4096 if device_type == "cpu" else 65536
    return max(1, min(tokens, 2**27 // vocab_size) // block_size)


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


def split_bytes(data_dir: str | Path, data: np.ndarray) -> int | None:
    """UTF-8 bytes of a split's scored targets (tokens 1..N-1), by decoding them; None without a tokenizer."""
    tok, _ = optional_tokenizer(data_dir)
    if tok is None:
        return None
    return len(tok.decode_bytes(np.asarray(data[1:]).tolist()))


def evaluate_split(
    model: torch.nn.Module,
    data_dir: str | Path,
    split: str = "val",
    *,
    block_size: int | None = None,
    batch_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> dict[str, Any]:
    """`gptlab eval`: loss, perplexity and bits per byte of a model over a whole split of a data directory.

    Returns {"<split>_loss", "perplexity", "bits_per_byte" (None without a tokenizer), "tokens", "bytes",
    "block_size", "split"}. A low-precision `dtype` runs the matmuls under autocast, attention in fp32."""
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
                           mask=mask, window_tokens=window_tokens)
    if window_tokens:  # the scored targets: each window's tokens 1..block_size that the mask counts
        n = len(data) // window_tokens
        scored = _window_rows(data, n, window_tokens)[:, 1 : block_size + 1]
        if mask is not None:
            scored = scored[_window_rows(mask, n, window_tokens)[:, 1 : block_size + 1] != 0]
        n_bytes = split_bytes(data_dir, np.concatenate([[0], scored.ravel()]))
    else:
        n_bytes = split_bytes(data_dir, data)
    bpb = result.loss * result.tokens / (math.log(2) * n_bytes) if n_bytes else None
    return {
        f"{split}_loss": result.loss,
        "perplexity": result.perplexity,
        "bits_per_byte": bpb,
        "tokens": result.tokens,
        "bytes": n_bytes,
        "block_size": block_size,
        "split": split,
    }
