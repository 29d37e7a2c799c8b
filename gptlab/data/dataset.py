"""The read side of a DATA_DIR (written by `gptlab.data.preparation`), and the training batches cut from it.

`read_meta` / `load_split` / `check_split_fits` refuse a directory that is incomplete or inconsistent with a
one-line error saying how to make it. `global_batch` is the token windows of one optimizer step: a pure
function of (seed, step), so a resumed run, or one split over more processes or micro-steps, sees the same data.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.errors import GptlabError
from gptlab.fileio import read_json_object

SPLITS = ("train", "val")
META = "meta.json"


def _hint(data_dir: Path) -> str:
    return f"run `gptlab prepare INPUT --tokenizer char --out {data_dir}` first"


def read_meta(data_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """meta.json of a prepared DATA_DIR (GptlabError with a hint if it isn't one)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise GptlabError(f"data directory {d} does not exist; {_hint(d)}")
    if not (d / META).is_file():
        raise GptlabError(f"{d} has no {META} (never prepared, or preparation was interrupted); {_hint(d)}")
    meta = read_json_object(d / META, hint=_hint(d))
    missing = [k for k in ("vocab_size", "dtype", "train_tokens", "val_tokens") if k not in meta]
    if missing:
        raise GptlabError(f"{d / META} lacks {', '.join(missing)}; {_hint(d)}")
    return meta


def load_split(data_dir: str | os.PathLike[str], split: str) -> np.memmap:
    """Read-only memmap of train.bin / val.bin with the dtype from meta.json."""
    if split not in SPLITS:
        raise GptlabError(f"unknown split {split!r}: expected 'train' or 'val'")
    d = Path(data_dir)
    meta = read_meta(d)
    path = d / f"{split}.bin"
    if not path.is_file():
        raise GptlabError(f"{path} is missing; {_hint(d)}")
    dtype = np.dtype("<u2") if meta["dtype"] == "uint16" else np.dtype("<u4")
    expected = int(meta[f"{split}_tokens"]) * dtype.itemsize
    if path.stat().st_size != expected:
        raise GptlabError(f"{path} has {path.stat().st_size} bytes, meta.json says {expected}; {_hint(d)}")
    return np.memmap(path, dtype=dtype, mode="r")


def check_split_fits(data_dir: str | os.PathLike[str], split: str, block_size: int) -> int:
    """Raise unless `split` has at least block_size + 1 tokens (one input/target window); return its size."""
    if split not in SPLITS:
        raise GptlabError(f"unknown split {split!r}: expected 'train' or 'val'")
    n = int(read_meta(data_dir)[f"{split}_tokens"])
    if n < block_size + 1:
        more = "use a larger --val-fraction or more text" if split == "val" else "use more text"
        raise GptlabError(
            f"the {split} split has {n} tokens, fewer than block_size+1={block_size + 1}; {more} "
            "(or a smaller block_size)"
        )
    return n


# --- batches ----------------------------------------------------------------------------------------------------


def global_batch(data: np.ndarray, seed: int, step: int, batch_size: int, block_size: int) -> np.ndarray:
    """The (batch_size, block_size + 1) int64 token windows of optimizer step `step`: inputs are [:, :-1],
    targets [:, 1:].

    Offsets come from a generator seeded with (seed, step), so no RNG state needs saving and every process can
    cut its own rows out of the same global batch.
    """
    rng = np.random.Generator(np.random.PCG64([seed, step]))
    starts = rng.integers(0, len(data) - block_size, size=batch_size)
    return data[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)


def micro_batch(windows: np.ndarray, rank: int, world: int, micro: int, grad_accum: int) -> np.ndarray:
    """Rows of the global batch for process `rank`, micro-step `micro`: contiguous slices, rank-major."""
    per_micro = windows.shape[0] // (world * grad_accum)
    start = (rank * grad_accum + micro) * per_micro
    return windows[start : start + per_micro]
