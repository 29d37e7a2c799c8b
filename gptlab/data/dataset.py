"""The read side of a DATA_DIR (written by `gptlab.data.preparation`), and the training batches cut from it.

`read_meta` / `load_split` / `load_mask` / `check_split_fits` refuse a directory that is incomplete or
inconsistent with a one-line error saying how to make it. `global_batch` is the token windows of one optimizer
step: a pure function of (seed, step), so a resumed run, or one split over more processes or micro-steps, sees
the same data. It is `windows(data, batch_starts(...))`, and the trainer cuts the loss masks of record data
(`load_mask`) with the same starts.

Data prepared from records (meta.json has ``"window_tokens": W``) is laid out in windows of W tokens, each
beginning with an example: rows start only at multiples of W, so every row begins where an example does. Plain
text data has no windows: a row may start anywhere.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.shards import ShardedTokens, load_shards
from gptlab.data.verify import check_mask_file, check_token_file
from gptlab.errors import GptlabError
from gptlab.fileio import read_json_object, read_toml

SPLITS = ("train", "val")
META = "meta.json"
DATA_TABLE = "data"  # a recipe's table of data directories and their weights (`recipe_sources`)


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
    for key in ("vocab_size", "train_tokens", "val_tokens", "window_tokens"):
        if key == "window_tokens" and meta.get(key) is None:
            continue
        if not isinstance(meta[key], int) or isinstance(meta[key], bool) or meta[key] < (key == "vocab_size"):
            raise GptlabError(f"{d / META}: {key} must be a whole number of tokens, got {meta[key]!r}; {_hint(d)}")
    return meta


def document_end_id(meta: dict[str, Any]) -> int | None:
    """The end-of-text id that ends the documents of a DATA_DIR's meta.json (its separator "eot"); None where its
    documents are not ended by one (a char vocabulary, chat records)."""
    return int(meta["eot_id"]) if meta.get("separator") == "eot" and meta.get("eot_id") is not None else None


def parse_sources(spec: str) -> list[tuple[Path, float]]:
    """``DIR`` or a mixture ``A:0.7,B:0.3`` (weights relative, > 0; a DIR without one weighs 1) as (directory,
    weight) pairs. A directory whose own name ends in ``:number`` is taken whole when it exists."""
    sources = []
    for item in spec.split(","):
        path, sep, weight = item.rpartition(":")
        if not sep or Path(item).exists():
            path, weight = item, "1"
        try:
            w = float(weight)
        except ValueError:
            path, w = item, 1.0
        sources.append((path, w))
    return _checked_sources(sources, f"--data {spec!r}")


def recipe_sources(recipe: str | os.PathLike[str]) -> list[tuple[Path, float]] | None:
    """A recipe's ``[data]`` table (``"DIR" = weight`` lines) as `parse_sources`' pairs; None without one."""
    table = read_toml(recipe).get(DATA_TABLE)
    if table is None:
        return None
    where = f"{recipe}: [{DATA_TABLE}]"
    if not isinstance(table, dict) or not table:
        raise GptlabError(f"{where} must be a table of data directories and weights, e.g. \"data/web\" = 0.7")
    for path, weight in table.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            raise GptlabError(f"{where}: the weight of {path} must be a number, got {weight!r}")
    return _checked_sources(list(table.items()), where)


def _checked_sources(sources: list[tuple[str, float]], where: str) -> list[tuple[Path, float]]:
    """What every mixture must be, however it was written: named directories, positive weights, none twice."""
    for path, w in sources:
        if not path.strip():
            raise GptlabError(f"{where}: an empty directory name (write DIR or A:0.7,B:0.3)")
        if not (w > 0 and w < float("inf")):
            raise GptlabError(f"{where}: the weight of {path} must be a positive number, got {w:g}")
    if len({Path(d) for d, _ in sources}) < len(sources):
        raise GptlabError(f"{where} names a directory twice")
    return [(Path(d), float(w)) for d, w in sources]


def format_sources(sources: Sequence[Sequence[Any]]) -> str:
    """(directory, weight) pairs as --data writes them."""
    return ",".join(f"{d}:{w:g}" for d, w in sources)


def tokenizer_identity(data_dir: str | os.PathLike[str]) -> tuple[Any, ...]:
    """What decides a DATA_DIR's ids: meta.json's tokenizer, vocabulary and end-of-text id, and the bytes of its
    tokenizer files (two directories with equal identities hold ids of the same tokens)."""
    d = Path(data_dir)
    meta = read_meta(d)
    files = tuple((d / name).read_bytes() if (d / name).is_file() else None
                  for name in ("tokenizer_meta.json", "tokenizer.json"))
    return meta.get("tokenizer"), meta["vocab_size"], meta.get("eot_id"), files


def load_split(data_dir: str | os.PathLike[str], split: str) -> np.memmap | ShardedTokens:
    """Read-only memmap of train.bin / val.bin with the dtype from meta.json, or of a sharded split's shards
    read as one array (`gptlab.data.shards`)."""
    if split not in SPLITS:
        raise GptlabError(f"unknown split {split!r}: expected 'train' or 'val'")
    d = Path(data_dir)
    meta = read_meta(d)
    dtype = np.dtype("<u2") if meta["dtype"] == "uint16" else np.dtype("<u4")
    if meta.get("shards") is not None:
        return load_shards(d, meta, split, dtype, _hint(d))
    path = d / f"{split}.bin"
    if not path.is_file():
        raise GptlabError(f"{path} is missing; {_hint(d)}")
    expected = int(meta[f"{split}_tokens"]) * dtype.itemsize
    if path.stat().st_size != expected:
        raise GptlabError(f"{path} has {path.stat().st_size} bytes, meta.json says {expected}; {_hint(d)}")
    ids = np.memmap(path, dtype=dtype, mode="r")
    check_token_file(path, ids, meta["vocab_size"], _hint(d))
    return ids


def load_mask(data_dir: str | os.PathLike[str], split: str) -> np.memmap | None:
    """Read-only uint8 memmap of train.mask.bin / val.mask.bin (1 = that token is a training target), or None
    when the data has no mask (prepared from text: every token is a target)."""
    if split not in SPLITS:
        raise GptlabError(f"unknown split {split!r}: expected 'train' or 'val'")
    d = Path(data_dir)
    meta = read_meta(d)
    if not meta.get("mask"):
        return None
    path = d / f"{split}.mask.bin"
    if not path.is_file():
        raise GptlabError(f"{path} is missing; {_hint(d)}")
    expected = int(meta[f"{split}_tokens"])
    if path.stat().st_size != expected:
        raise GptlabError(f"{path} has {path.stat().st_size} bytes, meta.json says {expected}; {_hint(d)}")
    mask = np.memmap(path, dtype=np.uint8, mode="r")
    check_mask_file(path, mask, _hint(d))
    return mask


def check_split_fits(data_dir: str | os.PathLike[str], split: str, block_size: int) -> int:
    """Raise unless `split` has at least block_size + 1 tokens (one input/target window) and, for data laid out
    in windows, unless a window holds block_size + 1 tokens; return the split's size in tokens."""
    if split not in SPLITS:
        raise GptlabError(f"unknown split {split!r}: expected 'train' or 'val'")
    d = Path(data_dir)
    meta = read_meta(d)
    n = len(load_split(d, split))  # its size checked against meta.json's count
    window = meta.get("window_tokens")
    if window is not None and block_size + 1 > int(window):
        raise GptlabError(
            f"{d} was prepared with --block-size {int(window) - 1}; the model's block_size is {block_size}: "
            f"prepare again with --block-size {block_size}"
        )
    if n < block_size + 1:
        more = "use a larger --val-fraction or more text" if split == "val" else "use more text"
        raise GptlabError(
            f"the {split} split has {n} tokens, fewer than block_size+1={block_size + 1}; {more} "
            "(or a smaller block_size)"
        )
    return n


# --- batches ----------------------------------------------------------------------------------------------------


def batch_starts(
    n_tokens: int, seed: int, step: int, batch_size: int, block_size: int, window_tokens: int | None = None,
    pairs: bool = False, *, stream: int = 0,
) -> np.ndarray:
    """The int64 start offsets of the rows of optimizer step `step` in a split of `n_tokens` tokens.

    Drawn by a generator seeded with (seed, step), so no RNG state needs saving and every process can cut its own
    rows out of the same global batch. Without windows any offset with block_size + 1 tokens after it; with
    windows (record data) the start of a random window, whose first block_size + 1 tokens are the row; with
    `pairs` (preference data: windows chosen, rejected, chosen, ...) 2 x batch_size starts, a random pair's two
    windows side by side. A nonzero `stream` draws from another generator (one per source of a mixture).
    """
    rng = np.random.Generator(np.random.PCG64([seed, step] if not stream else [seed, step, stream]))
    if window_tokens is None:
        return rng.integers(0, n_tokens - block_size, size=batch_size)
    if block_size + 1 > window_tokens:
        raise GptlabError(f"block_size {block_size} needs windows of {block_size + 1} tokens, the data has "
                          f"{window_tokens}: prepare it again with --block-size {block_size}")
    if not pairs:
        return rng.integers(0, n_tokens // window_tokens, size=batch_size) * window_tokens
    chosen = rng.integers(0, n_tokens // (2 * window_tokens), size=batch_size) * (2 * window_tokens)
    return np.stack([chosen, chosen + window_tokens], axis=1).reshape(-1)


def windows(array: np.ndarray, starts: np.ndarray, block_size: int) -> np.ndarray:
    """The (len(starts), block_size + 1) int64 rows of `array` (tokens or mask) beginning at `starts`."""
    return array[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)


def global_batch(
    data: np.ndarray, seed: int, step: int, batch_size: int, block_size: int, *, window_tokens: int | None = None
) -> np.ndarray:
    """The (batch_size, block_size + 1) int64 token windows of optimizer step `step`: inputs are [:, :-1],
    targets [:, 1:]. The mask rows of the same step are `windows(mask, batch_starts(...), block_size)`."""
    return windows(data, batch_starts(len(data), seed, step, batch_size, block_size, window_tokens), block_size)


def micro_batch(windows: np.ndarray, rank: int, world: int, micro: int, grad_accum: int) -> np.ndarray:
    """Rows of the global batch for process `rank`, micro-step `micro`: contiguous slices, rank-major."""
    per_micro = windows.shape[0] // (world * grad_accum)
    start = (rank * grad_accum + micro) * per_micro
    return windows[start : start + per_micro]
