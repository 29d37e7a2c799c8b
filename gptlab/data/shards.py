"""Token data in fixed-size shards: the writer `gptlab prepare` streams into, and the split read back as one array.

A sharded DATA_DIR holds ``train-000000.bin``, ``train-000001.bin``, ..., ``val-000000.bin``, ... (raw token ids,
the dtype of meta.json), every shard `shard_tokens` long but the last of its split. meta.json's ``"shards"`` is
the manifest: per split, each shard's file, token count and sha256. Readers check every shard's size, sha256 and
ids against it (`gptlab.data.verify`; `ShardedTokens` reads them as one array, so a row may run from one shard into
the next, as it runs through one file); `verify_shards` checks the hashes alone.

Resuming: the shards are built in a fixed hidden directory beside DATA_DIR (``.NAME.building``) with a state
file, ``progress.json``, rewritten (atomically, after the shard's bytes are fsynced) each time a shard is closed.
It records the stream position: how many pieces (`gptlab.data.text_stream` chunks, or documents) were consumed,
how many tokens of the piece in flight were written, and how long each split's open shard was. A killed prepare
run again with the same inputs and options (`fingerprint`) cuts the open shards back to those lengths, skips the
pieces already written and goes on from there; anything else starts over. When the stream ends the directory is
swapped in for DATA_DIR in one step, like any DATA_DIR.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from gptlab.data.verify import check_token_file
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_json, fsync_dir

SHARD_NAME = re.compile(r"^\.?(train|val)-\d{6}\.bin(\.partial)?$")
PROGRESS = "progress.json"
_HASH_READ = 1 << 22


def shard_file(split: str, index: int) -> str:
    return f"{split}-{index:06d}.bin"


def _sha256(path: Path, limit: int | None = None) -> Any:
    """A hashlib sha256 fed with the first `limit` bytes of `path` (all of it by default)."""
    h, left = hashlib.sha256(), limit
    with open(path, "rb") as f:
        while left is None or left > 0:
            block = f.read(_HASH_READ if left is None else min(_HASH_READ, left))
            if not block:
                break
            h.update(block)
            left = None if left is None else left - len(block)
    return h


# --- reading ----------------------------------------------------------------------------------------------------


class ShardedTokens:
    """The shards of one split as one read-only array: `len`, slices (a copy) and integer-array indexing, the
    way the trainer and the evaluation read a single memmapped file."""

    def __init__(self, arrays: list[np.ndarray]) -> None:
        if not arrays:
            raise ValueError("no shards")
        self.arrays = arrays
        self.bounds = np.cumsum([0, *(len(a) for a in arrays)])
        self.dtype = arrays[0].dtype

    def __len__(self) -> int:
        return int(self.bounds[-1])

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                return self[np.arange(start, stop, step)]
            first = int(np.searchsorted(self.bounds, start, "right")) - 1
            parts = []
            for k in range(max(first, 0), len(self.arrays)):
                lo, hi = max(start - self.bounds[k], 0), min(stop - self.bounds[k], len(self.arrays[k]))
                if hi <= 0 or lo >= hi:
                    break
                parts.append(np.asarray(self.arrays[k][lo:hi]))
            return np.concatenate(parts) if parts else np.empty(0, self.dtype)
        index = np.asarray(key)
        if index.ndim == 0:
            return self[int(index) : int(index) + 1][0] if int(index) >= 0 else self[len(self) + int(index)]
        flat = index.ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= len(self)):
            raise IndexError(f"index out of range for {len(self)} tokens")
        which = np.searchsorted(self.bounds, flat, "right") - 1
        out = np.empty(flat.shape, self.dtype)
        for k in np.unique(which):
            picked = which == k
            out[picked] = self.arrays[k][flat[picked] - self.bounds[k]]
        return out.reshape(index.shape)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        whole = self[0 : len(self)]
        return whole if dtype is None else whole.astype(dtype)


def shard_entries(data_dir: Path, meta: dict[str, Any], split: str, hint: str) -> list[dict[str, Any]]:
    """The manifest's shards of `split`, checked to be a list of {file, tokens, sha256} summing to the split."""
    entries = meta["shards"].get(split) if isinstance(meta["shards"], dict) else None
    if not isinstance(entries, list) or not entries or not all(
        isinstance(e, dict) and isinstance(e.get("file"), str) and SHARD_NAME.match(e["file"])
        and isinstance(e.get("tokens"), int) and e["tokens"] > 0 and isinstance(e.get("sha256"), str) for e in entries
    ):
        raise GptlabError(f"{data_dir / 'meta.json'}: \"shards\" has no valid list of {split} shards; {hint}")
    if sum(e["tokens"] for e in entries) != meta[f"{split}_tokens"]:
        raise GptlabError(f"{data_dir / 'meta.json'}: the {split} shards hold {sum(e['tokens'] for e in entries)} "
                          f"tokens, {split}_tokens says {meta[f'{split}_tokens']}; {hint}")
    return entries


def load_shards(data_dir: Path, meta: dict[str, Any], split: str, dtype: np.dtype, hint: str) -> ShardedTokens:
    """A split's shards, memmapped, each one's size checked against the manifest."""
    arrays = []
    for entry in shard_entries(data_dir, meta, split, hint):
        path = data_dir / entry["file"]
        if not path.is_file():
            raise GptlabError(f"{path} is missing; {hint}")
        if path.stat().st_size != entry["tokens"] * dtype.itemsize:
            raise GptlabError(f"{path} has {path.stat().st_size} bytes, meta.json says "
                              f"{entry['tokens'] * dtype.itemsize}; {hint}")
        arrays.append(np.memmap(path, dtype=dtype, mode="r"))
        check_token_file(path, arrays[-1], meta["vocab_size"], hint, sha256=entry["sha256"])
    return ShardedTokens(arrays)


def verify_shards(data_dir: str | os.PathLike[str], manifest: dict[str, list[dict[str, Any]]]) -> None:
    """Every shard's sha256 against the manifest (a GptlabError naming the first that differs)."""
    for entries in manifest.values():
        for entry in entries:
            path = Path(data_dir) / entry["file"]
            check_token_file(path, np.memmap(path, dtype=np.uint8, mode="r"), None, "prepare it again",
                             sha256=entry["sha256"])


# --- writing ----------------------------------------------------------------------------------------------------


class ShardWriter:
    """Appends each split's tokens to its open shard, closing it (fsync, rename, sha256 into the manifest, the
    stream position into progress.json) every `shard_tokens` tokens. See the module docstring for resuming."""

    def __init__(self, build: Path, shard_tokens: int, dtype: np.dtype, fingerprint: dict[str, Any]) -> None:
        if shard_tokens < 2:
            raise GptlabError(f"--shard-tokens must be at least 2, got {shard_tokens}")
        self.build, self.shard_tokens, self.dtype, self.fingerprint = build, shard_tokens, dtype, fingerprint
        self.manifest: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
        self.open_tokens = {"train": 0, "val": 0}
        self.pieces, self.piece_offset = 0, 0  # pieces consumed; tokens of the one in flight already written
        self.chars = {"train": 0, "val": 0}  # characters of the pieces consumed
        self._files: dict[str, BinaryIO] = {}
        self._hashes: dict[str, Any] = {}

    # the stream position --------------------------------------------------------------------------------------
    def resume(self) -> bool:
        """Pick up a killed run's shards when progress.json matches this run's fingerprint; else start empty."""
        state = _read_progress(self.build / PROGRESS)
        if state is None or state.get("fingerprint") != self.fingerprint:
            return False
        self.manifest, self.open_tokens = state["shards"], state["open_tokens"]
        self.pieces, self.piece_offset, self.chars = state["pieces"], state["piece_offset"], state["chars"]
        for entries in self.manifest.values():
            for entry in entries:  # closed shards were fsynced before the state that lists them was written
                path = self.build / entry["file"]
                if not path.is_file() or path.stat().st_size != entry["tokens"] * self.dtype.itemsize:
                    return False
        for split, n in self.open_tokens.items():
            path = self._partial(split)
            if n and (not path.is_file() or path.stat().st_size < n * self.dtype.itemsize):
                return False
        return True

    def _partial(self, split: str) -> Path:
        return self.build / f".{shard_file(split, len(self.manifest[split]))}.partial"

    def _save_progress(self) -> None:
        for f in self._files.values():  # the other split's open shard: a kill loses what Python's buffer holds
            f.flush()
        atomic_write_json(self.build / PROGRESS, {
            "fingerprint": self.fingerprint, "shards": self.manifest, "open_tokens": self.open_tokens,
            "pieces": self.pieces, "piece_offset": self.piece_offset, "chars": self.chars})

    # writing --------------------------------------------------------------------------------------------------
    def _open(self, split: str) -> BinaryIO:
        if split not in self._files:
            path, n = self._partial(split), self.open_tokens[split] * self.dtype.itemsize
            f = open(path, "r+b" if path.is_file() else "w+b")  # noqa: SIM115 - closed in _close / close
            f.truncate(n)  # past the recorded length is what a killed run wrote after its last state
            self._hashes[split] = _sha256(path, n)
            f.seek(n)
            self._files[split] = f
        return self._files[split]

    def write(self, split: str, ids: np.ndarray) -> None:
        """Append `ids` (the tokens of the current piece) to `split`'s shards."""
        while len(ids):
            f = self._open(split)
            room = self.shard_tokens - self.open_tokens[split]
            part = np.ascontiguousarray(ids[:room], dtype=self.dtype).tobytes()
            f.write(part)
            self._hashes[split].update(part)
            written = min(room, len(ids))
            self.open_tokens[split] += written
            self.piece_offset += written
            ids = ids[written:]
            if self.open_tokens[split] == self.shard_tokens:
                self._close(split)
                self._save_progress()

    def end_piece(self, split: str, n_chars: int) -> None:
        self.pieces, self.piece_offset = self.pieces + 1, 0
        self.chars[split] += n_chars

    def _close(self, split: str) -> None:
        f = self._files.pop(split)
        f.flush()
        os.fsync(f.fileno())
        f.close()
        name = shard_file(split, len(self.manifest[split]))
        os.replace(self._partial(split), self.build / name)
        fsync_dir(self.build)
        self.manifest[split].append({"file": name, "tokens": self.open_tokens[split],
                                     "sha256": self._hashes.pop(split).hexdigest()})
        self.open_tokens[split] = 0

    def finish(self) -> dict[str, list[dict[str, Any]]]:
        """Close the last shard of each split; the manifest."""
        for split in self.manifest:
            if self.open_tokens[split]:
                self._open(split)
                self._close(split)
        (self.build / PROGRESS).unlink(missing_ok=True)
        return self.manifest

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


def _read_progress(path: Path) -> dict[str, Any] | None:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    keys = ("fingerprint", "shards", "open_tokens", "pieces", "piece_offset", "chars")
    return state if isinstance(state, dict) and all(k in state for k in keys) else None


def write_shards(
    writer: ShardWriter, encoded: Callable[[int], Iterable[tuple[str, np.ndarray, int]]],
    on_chars: Callable[[int], None] = lambda n: None,
) -> dict[str, list[dict[str, Any]]]:
    """Run `encoded(skip)` (the encoded pieces from piece `skip` on) into `writer`; returns the manifest. The
    first piece after a resume drops the tokens the killed run had written of it."""
    skip_tokens = writer.piece_offset
    try:
        for split, ids, n_chars in encoded(writer.pieces):
            if skip_tokens:  # writer.piece_offset already counts them
                ids, skip_tokens = ids[skip_tokens:], 0
            writer.write(split, ids)
            writer.end_piece(split, n_chars)
            on_chars(n_chars)
        return writer.finish()
    finally:
        writer.close()


def building_dir(out: Path) -> Path:
    """Where the shards of DATA_DIR `out` are built, kept across a killed run (see the module docstring)."""
    return out.with_name(f".{out.name}.building")


def resumable(build: Path, fingerprint: dict[str, Any]) -> bool:
    """Whether `build` holds a killed run of the same inputs and options (its tokenizer is then reused)."""
    state = _read_progress(build / PROGRESS)
    return state is not None and state["fingerprint"] == fingerprint


def skipping(pieces: Iterator[Any], skip: int) -> Iterator[Any]:
    """`pieces` from index `skip` on (the ones before are read, not encoded)."""
    for i, piece in enumerate(pieces):
        if i >= skip:
            yield piece


def remove_building(build: Path) -> None:
    shutil.rmtree(build, ignore_errors=True)
