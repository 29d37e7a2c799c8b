"""A split's files read through once before a run uses them, a block at a time: every token id below the vocabulary
(past it, an id would index past the embedding, or train on a token no tokenizer wrote), every loss-mask byte 0 or 1,
and a shard's bytes against its sha256 in the manifest. Each answers in one line naming the file (and, for an id, the
first bad offset and id). A file checked by this process and unchanged since (size, modification time, inode) is
not read again: `load_split` runs many times per command."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from gptlab.errors import GptlabError

BLOCK_ITEMS = 1 << 24  # items read at a time: memory stays one block, whatever the file's size
_checked: set[tuple[object, ...]] = set()


def _unchanged_key(path: Path, *rule: object) -> tuple[object, ...]:
    st = path.stat()
    return (str(path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino, *rule)


def check_token_file(path: Path, ids: np.ndarray, vocab_size: int | None, hint: str,
                     sha256: str | None = None) -> None:
    """Every id of `ids` (the memmap of `path`) below `vocab_size` (None: not checked), and the file's sha256 equal
    to `sha256` when given."""
    key = _unchanged_key(path, "ids", vocab_size, sha256)
    if key in _checked:
        return
    digest = hashlib.sha256() if sha256 is not None else None
    for start in range(0, len(ids), BLOCK_ITEMS):
        block = np.ascontiguousarray(ids[start : start + BLOCK_ITEMS])
        if digest is not None:
            digest.update(block)
        if vocab_size is not None and block.size and int(block.max()) >= vocab_size:
            at = int(np.argmax(block >= vocab_size))
            raise GptlabError(f"{path}: token id {int(block[at])} at offset {start + at} is past the vocabulary "
                              f"({vocab_size} ids): damaged, or written with another tokenizer; {hint}")
    if digest is not None and digest.hexdigest() != sha256:
        raise GptlabError(f"{path} does not match its sha256 in meta.json's manifest (damaged or replaced); {hint}")
    _checked.add(key)


def check_mask_file(path: Path, mask: np.ndarray, hint: str) -> None:
    """Every byte of the loss mask `mask` (the memmap of `path`) 0 or 1."""
    key = _unchanged_key(path, "mask")
    if key in _checked:
        return
    for start in range(0, len(mask), BLOCK_ITEMS):
        block = np.asarray(mask[start : start + BLOCK_ITEMS])
        if block.size and int(block.max()) > 1:
            at = int(np.argmax(block > 1))
            raise GptlabError(f"{path}: byte {start + at} is {int(block[at])}, a loss mask holds 0 or 1; {hint}")
    _checked.add(key)
