"""What both ways of preparing data share: option checks, the token dtype, progress bars, and starting an output
directory (text files: `gptlab.data.preparation`; records: `gptlab.data.examples`).

Kept apart so the two preparers import it rather than each other.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.dataset import META, SPLITS
from gptlab.data.shards import SHARD_NAME
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_dir, check_out_dir
from gptlab.tokenizer import MAX_BPE_VOCAB, MIN_BPE_VOCAB, GPT2Tokenizer, Tokenizer, load_tokenizer


def show_progress() -> bool:
    """Progress bars only for a person watching: stderr is a terminal, and not CI or GPTLAB_NO_PROGRESS."""
    return sys.stderr.isatty() and not (os.environ.get("GPTLAB_NO_PROGRESS") or os.environ.get("CI"))


def progress(total: int | None, desc: str, unit: str) -> Any:
    """A tqdm bar on stderr (disabled unless `show_progress()`)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=True, disable=not show_progress(), file=sys.stderr)


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (half the disk and page cache), else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


def dtype_name(vocab_size: int) -> str:
    return "uint16" if dtype_for(vocab_size).itemsize == 2 else "uint32"


def check_options(
    tokenizer: str | None, vocab_size: int | None, val_fraction: float, workers: int, from_dir: bool
) -> None:
    """The option errors both preparers share, raised before any input is read."""
    if not from_dir and tokenizer not in ("char", "gpt2", "bpe"):
        raise GptlabError(f"unknown tokenizer {tokenizer!r}: choose char, gpt2 or bpe (or --tokenizer-from DIR)")
    if tokenizer == "bpe" and not from_dir and vocab_size is None:
        raise GptlabError(f"--tokenizer bpe needs --vocab-size N (at least {MIN_BPE_VOCAB}; e.g. 4096)")
    if (from_dir or tokenizer != "bpe") and vocab_size is not None:
        what = "--tokenizer-from" if from_dir else f"--tokenizer {tokenizer}"
        raise GptlabError(f"--vocab-size only applies to --tokenizer bpe ({what} has a fixed vocabulary)")
    if vocab_size is not None and vocab_size < MIN_BPE_VOCAB:
        raise GptlabError(f"--vocab-size {vocab_size} is too small for bpe: it needs at least {MIN_BPE_VOCAB}")
    if vocab_size is not None and vocab_size > MAX_BPE_VOCAB:
        raise GptlabError(f"--vocab-size {vocab_size} is too large: at most {MAX_BPE_VOCAB:,}")
    if not 0.0 < val_fraction < 1.0:
        raise GptlabError(f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}")
    if not 1 <= workers <= 4 * (os.cpu_count() or 1):
        raise GptlabError(f"--workers must be at least 1 and at most {4 * (os.cpu_count() or 1)} (4 per CPU), "
                          f"got {workers}")


def early_tokenizer(tokenizer: str | None, tokenizer_from: str | os.PathLike[str] | None) -> Tokenizer | None:
    """The tokenizer when it needs no data (--tokenizer-from, gpt2): loaded before the long scan so that a
    missing file fails first. None for char and bpe, which are built from the data."""
    if tokenizer_from is not None:
        return load_tokenizer(tokenizer_from)
    if tokenizer == "gpt2":
        return GPT2Tokenizer()
    return None


def output_dir(out_dir: str | os.PathLike[str]) -> Path:
    return check_out_dir(out_dir, "--out")


# what a DATA_DIR holds: a directory of nothing else may be replaced even without the marker (older gptlab)
DATA_FILES = frozenset({META, "tokenizer_meta.json", "tokenizer.json", *(f"{s}.bin" for s in SPLITS),
                        *(f"{s}.mask.bin" for s in SPLITS), *(f".{s}.bin.partial" for s in SPLITS),
                        *(f".{s}.mask.bin.partial" for s in SPLITS)})


def write_output(out: Path, write: Callable[[Path], None]) -> None:
    """Have `write(tmp)` build the whole DATA_DIR in a fresh directory beside `out`, swapped in only when
    complete: a failure (a full disk, a bad record, a kill) leaves the previous `out` as it was.

    A directory gptlab did not write is refused unless it holds only a DATA_DIR's files (one an older gptlab
    prepared, in place); what a killed run left beside `out` is removed first."""
    for leftover in (*out.parent.glob(f".{out.name}.tmp-*"), *out.parent.glob(f".{out.name}.old-*")):
        shutil.rmtree(leftover, ignore_errors=True)
    data_only = out.is_dir() and all(p.name in DATA_FILES or SHARD_NAME.match(p.name) for p in out.iterdir())
    atomic_write_dir(out, write, replace_unmarked=data_only)


def base_meta(tok: Tokenizer, tokens: dict[str, int], chars: dict[str, int], val_fraction: float,
              separator: bool) -> dict[str, Any]:
    """The meta.json keys every DATA_DIR has, whatever its inputs were."""
    return {
        "format": "gptlab-data",
        "version": 1,
        "tokenizer": tok.kind,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype_name(tok.vocab_size),
        "train_tokens": tokens["train"],
        "val_tokens": tokens["val"],
        "train_chars": chars["train"],
        "val_chars": chars["val"],
        "val_fraction": val_fraction,
        "separator": "eot" if separator else "none",
    }
