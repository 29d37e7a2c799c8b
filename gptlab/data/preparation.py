"""Data preparation: text files -> a DATA_DIR the trainer reads with memmaps.

``gptlab prepare INPUT... --tokenizer {char,gpt2,bpe} --out DATA_DIR`` writes into DATA_DIR:

* ``train.bin`` / ``val.bin`` -- token ids, raw little-endian uint16 (vocab_size <= 65536) or uint32;
* the tokenizer (``tokenizer_meta.json`` [+ ``tokenizer.json``], see :mod:`gptlab.tokenizer`);
* ``meta.json`` -- ``{"tokenizer", "vocab_size", "eot_id", "dtype", "train_tokens", "val_tokens",
  "sources": [{"path", "bytes", "sha256", "chars"}], "val_fraction", "separator", ...}``.
  A DATA_DIR without it is incomplete, and readers refuse it. The whole directory is built beside DATA_DIR
  (``.NAME.tmp-*``) and swapped in only when complete, so a failure leaves the previous DATA_DIR as it was.

How the text becomes tokens:

* The inputs are read as one stream, split into train and val by characters as nanoGPT does, and cut into
  ~1 MiB-character chunks that encode to the same ids as the whole text: :mod:`gptlab.data.text_stream`.
  Between documents the ``<|endoftext|>`` id is inserted for gpt2/bpe (it belongs to the document it ends);
  char has no such token and concatenates the texts as they are. Train and val are encoded separately.
* The chunks are encoded (in a process pool for big inputs, whose workers end with a killed `prepare`) and
  appended to hidden ``.partial`` files, renamed into place only when both splits are good. Memory stays
  bounded by a few chunks per worker.
* ``--vocab-size`` is an error except with ``--tokenizer bpe`` (char and gpt2 have fixed vocabularies).
  bpe is trained on the train split only, so val stays unseen text.

Records (.jsonl, .json, .parquet, .csv, saved datasets: text, prompt/completion or chat) are not one stream but
examples, each with a loss mask, packed into fixed windows: see :mod:`gptlab.data.examples`.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack, contextmanager
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.data.common import base_meta, check_options, dtype_for, early_tokenizer, output_dir, write_output
from gptlab.data.common import progress as _progress
from gptlab.data.common import show_progress as _show_progress
from gptlab.data.dataset import META, SPLITS
from gptlab.data.documents import DocBatch, document_pieces, document_sources, is_document_input
from gptlab.data.examples import RecordOptions, prepare_records
from gptlab.data.records import RECORD_INPUTS, are_records
from gptlab.data.shards import ShardWriter, building_dir, remove_building, resumable, skipping, write_shards
from gptlab.data.text_stream import (
    CHUNK_CHARS,
    chunk_text,
    expand_globs,
    iter_split_pieces,
    resolve_inputs,
    scan_sources,
)
from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_json, write_error
from gptlab.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from gptlab.tokenizer.seams import Continued

PARALLEL_MIN_CHARS = 16 << 20  # below this a process pool costs more to start than it saves
AUTO_SHARD_CHARS = 1 << 30  # text this long is written in shards even without --shard-tokens
DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16 ids per shard


# --- encoding ---------------------------------------------------------------------------------------------------

_WORKER: dict[str, Any] = {}


def _encode_text(tok: Tokenizer, text: str | DocBatch, dtype: np.dtype) -> np.ndarray:
    if isinstance(text, tuple):  # documents: each one's ids, then the end-of-text token
        eot = np.array([tok.eot_id], dtype=dtype)
        return np.concatenate([part for ids in tok.encode_batch(list(text))
                               for part in (np.asarray(ids, dtype=dtype), eot)])
    seams = tok.seams
    if isinstance(tok, HFTokenizer) and seams.exact and len(text) > (1 << 15):
        # sub-chunks cut at the tokenizer's seams through one batch call: same ids, ~1.5x faster than the whole
        # chunk in one call, and on all cores where `tokenizers` may use them
        parts = list(chunk_text([text], 1 << 14, cut=seams.cut, hard=False))
        if isinstance(text, Continued):  # the first part continues the text too
            parts[0] = Continued(parts[0])
        return np.concatenate([np.asarray(x, dtype=dtype) for x in tok.encode_chunks(parts)])
    if seams.prepend and isinstance(text, Continued):
        return np.asarray(tok.encode_chunks([text])[0], dtype=dtype)
    return tok.encode_np(text).astype(dtype, copy=False)


def _exit_with(main_pid: int) -> None:
    """End this worker as soon as the main process is gone, even killed with SIGKILL (no `finally` runs there).

    Nothing else would: a pool's workers hold both ends of its task queue, so they never see it close, and a
    forkserver lives as long as its children do; without this a killed `prepare` leaves them all running."""

    def watch() -> None:
        try:
            fd = os.pidfd_open(main_pid)  # Linux: readable once the process has exited
        except (AttributeError, OSError):  # elsewhere, or already gone (ProcessLookupError)
            while True:
                try:
                    os.kill(main_pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(1.0)
        else:
            select.select([fd], [], [])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-main", daemon=True).start()


def _worker_init(tok_dir: str, dtype: str, env: dict[str, str], main_pid: int) -> None:
    _exit_with(main_pid)
    os.environ.update(env)  # a forkserver child has the server's environment, not the caller's
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool already uses every core
    _WORKER["tok"] = load_tokenizer(tok_dir)
    _WORKER["dtype"] = np.dtype(dtype)


def _worker_encode(text: str | DocBatch) -> np.ndarray:
    return _encode_text(_WORKER["tok"], text, _WORKER["dtype"])


def _encode_stream(
    pieces: Iterable[tuple[str, str | DocBatch | None]], tok: Tokenizer, tok_dir: Path, dtype: np.dtype,
    workers: int
) -> Iterator[tuple[str, np.ndarray, int]]:
    """Encode pieces in order; yields (split, ids, characters consumed)."""
    eot = np.array([tok.eot_id if tok.eot_id is not None else 0], dtype=dtype)
    if workers <= 1:
        for split, text in pieces:
            yield (split, eot, 0) if text is None else (split, _encode_text(tok, text, dtype), _chars(text))
        return
    # not fork: the parent may hold Rust thread pools (tokenizers) that a fork can't copy. A forkserver
    # that has imported this module once starts workers fast; spawn elsewhere.
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload([__name__])
    else:
        ctx = multiprocessing.get_context("spawn")
    init = (str(tok_dir), dtype.str, dict(os.environ), os.getpid())
    # ProcessPoolExecutor rather than Pool: a worker that dies (or fails to start) raises instead of hanging
    pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_worker_init, initargs=init)
    pending: deque[tuple[str, Future | None, int]] = deque()

    def done() -> tuple[str, np.ndarray, int]:
        split, fut, n = pending.popleft()
        try:
            return split, (eot if fut is None else fut.result()), n
        except BrokenProcessPool as e:
            raise GptlabError(f"the tokenizer worker processes failed ({e}); rerun with --workers 1") from e

    try:
        for split, text in pieces:
            fut = None if text is None else pool.submit(_worker_encode, text)
            pending.append((split, fut, _chars(text)))
            while len(pending) > 2 * workers:  # bounded queue: never read far ahead of the encoders
                yield done()
        while pending:
            yield done()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _chars(piece: str | DocBatch | None) -> int:
    return 0 if piece is None else len(piece) if isinstance(piece, str) else sum(map(len, piece))


# --- prepare ----------------------------------------------------------------------------------------------------


@contextmanager
def _full_disk_message(out: Path, needed: int) -> Iterator[None]:
    """An OSError while writing the token files (a full disk) as one line: what it needed, what is free."""
    try:
        yield
    except OSError as e:
        raise write_error(out / "train.bin", e, needed) from None


def _write_bins(
    out: Path, tok: Tokenizer, pieces: Iterable[tuple[str, str | None]], total: int, workers: int, target: Path
) -> dict[str, int]:
    """Encode into hidden .partial files in `out` (the directory being built), renamed into place only when both
    splits are good; a full disk is reported against `target`, the DATA_DIR the user named."""
    dtype = dtype_for(tok.vocab_size)
    partial = {s: out / f".{s}.bin.partial" for s in SPLITS}
    counts = dict.fromkeys(SPLITS, 0)
    try:
        with ExitStack() as stack, _full_disk_message(target, total * dtype.itemsize):
            files = {s: stack.enter_context(open(partial[s], "wb")) for s in SPLITS}
            bar = stack.enter_context(_progress(total, f"tokenize ({tok.kind})", "char"))
            for split, ids, n in _encode_stream(pieces, tok, out, dtype, workers):
                files[split].write(ids.tobytes())
                counts[split] += len(ids)
                bar.update(n)
        for split in SPLITS:
            if counts[split] < 2:
                more = "use a larger --val-fraction or more text" if split == "val" else "use more text"
                raise GptlabError(f"the {split} split has {counts[split]} token(s), need at least 2: {more}")
        for split in SPLITS:
            os.replace(partial[split], out / f"{split}.bin")
    finally:
        for p in partial.values():
            p.unlink(missing_ok=True)
    return counts


def prepare(
    inputs: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    *,
    tokenizer: str | None = "char",
    vocab_size: int | None = None,
    val_fraction: float = 0.1,
    workers: int | None = None,
    tokenizer_from: str | os.PathLike[str] | None = None,
    chunk_chars: int = CHUNK_CHARS,
    block_size: int | None = None,
    pack: bool = True,
    chat_template: str | None = None,
    train_on_prompt: bool = False,
    text_field: str | None = None,
    split_name: str | None = None,
    shard_tokens: int | None = None,
) -> dict[str, Any]:
    """Tokenize `inputs` into `out_dir` (train.bin, val.bin or shards, tokenizer, meta.json); returns the meta dict.

    Record inputs (.jsonl, .json, .parquet, .csv, saved datasets) with `block_size` go to
    `gptlab.data.examples.prepare_records`, which also writes loss masks; the options from `block_size` on apply to
    them only (see `RecordOptions`). Without `block_size` their text documents, Hub datasets (``hf://datasets/``)
    and parquet folders are one token stream (`gptlab.data.documents`), always in shards. Text files are written
    in shards of `shard_tokens` when it is given or the text passes AUTO_SHARD_CHARS.
    """
    workers = min(4, os.cpu_count() or 1) if workers is None else workers
    check_options(tokenizer, vocab_size, val_fraction, workers, tokenizer_from is not None)
    if any(not str(i).strip() for i in inputs):  # Path("") is ".": everything under the current directory
        raise GptlabError("an INPUT is empty: name text files, directories of .txt files, record files or "
                          "`shakespeare`")
    if shard_tokens is not None and shard_tokens < 2:
        raise GptlabError(f"--shard-tokens must be at least 2, got {shard_tokens}")
    out = output_dir(out_dir)
    inputs = expand_globs(inputs)
    options = RecordOptions(block_size, pack, chat_template, train_on_prompt, text_field, split_name)
    documents = [i for i in inputs if is_document_input(i)]
    if documents or are_records(inputs):
        if block_size is None and not (set(options.given()) - {"--text-field", "--split-name"}):
            return _prepare_documents(inputs, out, tokenizer, tokenizer_from, val_fraction, workers, shard_tokens,
                                      text_field, split_name)
        if documents:
            raise GptlabError(f"{documents[0]} is read as a stream of text documents: --block-size and the chat "
                              "options apply to record files")
        if shard_tokens is not None:  # examples and their loss masks are written whole, as train.bin / val.bin
            raise GptlabError("--shard-tokens applies to text files and streamed documents, not to records packed "
                              "as examples (--block-size): those are written as train.bin / val.bin")
        return prepare_records(inputs, out, options, tokenizer=tokenizer, vocab_size=vocab_size,
                               val_fraction=val_fraction, tokenizer_from=tokenizer_from)
    if given := options.given():
        verb = "applies" if len(given) == 1 else "apply"
        raise GptlabError(f"{', '.join(given)} only {verb} to record inputs ({RECORD_INPUTS}); text files are "
                          "tokenized as one stream")
    tok = early_tokenizer(tokenizer, tokenizer_from)

    paths = resolve_inputs(inputs)
    sources, charset = scan_sources(paths, collect_chars=tok is None and tokenizer == "char")
    total = sum(s.chars for s in sources)
    if total == 0:
        raise GptlabError(f"the input is empty ({', '.join(str(p) for p in paths[:3])} has no text)")
    split_at = int(total * (1 - val_fraction) + 1e-6)  # nanoGPT's int(n * 0.9), minus float noise
    if split_at == 0:
        raise GptlabError(f"the train split would be empty ({total} characters in all); use more text")
    if shard_tokens is None and total >= AUTO_SHARD_CHARS:
        shard_tokens = DEFAULT_SHARD_TOKENS
    fingerprint = {"inputs": [[str(s.path), s.sha256] for s in sources], "tokenizer": tokenizer,
                   "tokenizer_from": None if tokenizer_from is None else str(tokenizer_from),
                   "vocab_size": vocab_size, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
                   "chunk_chars": chunk_chars}
    if shard_tokens is not None and resumable(building_dir(out), fingerprint):
        tok = load_tokenizer(building_dir(out))  # the killed run's (a bpe trained once)

    if tok is None and tokenizer == "char":
        tok = CharTokenizer(charset)
    elif tok is None:  # bpe: learn the merges from the train split only, so val stays unseen text
        assert vocab_size is not None
        pieces = iter_split_pieces(sources, split_at, False, "newline", chunk_chars)  # the trainer's own chunks
        tok = HFTokenizer.train(
            (t for _, t in takewhile(lambda p: p[0] == "train", pieces) if t), vocab_size, _show_progress()
        )
        if tok.vocab_size < vocab_size:
            print(f"note: the text only supports {tok.vocab_size} bpe tokens, not {vocab_size}", file=sys.stderr)
    cut = tok.seams.cut  # where chunks encode to the ids of the whole (see text_stream)
    if not tok.seams.exact:
        print(f"note: chunks of about {chunk_chars:,} characters are encoded one by one, and this tokenizer's ids "
              f"at their seams may differ from encoding each file whole: {tok.seams.why}", file=sys.stderr)
    sep = tok.kind != "char" and tok.eot_id is not None  # separate documents with eot

    source_rows = [{"path": str(s.path), "bytes": s.bytes, "sha256": s.sha256, "chars": s.chars} for s in sources]
    if shard_tokens is not None:
        return _write_sharded(out, tok, lambda: iter_split_pieces(sources, split_at, sep, cut, chunk_chars),
                              fingerprint, shard_tokens, workers if total >= PARALLEL_MIN_CHARS else 1, total,
                              {"val_fraction": val_fraction, "separator": sep, "sources": source_rows})
    pieces = iter_split_pieces(sources, split_at, sep, cut, chunk_chars)
    meta: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        tok.save(tmp)  # before encoding: the pool's workers load it from here
        counts = _write_bins(tmp, tok, pieces, total, workers if total >= PARALLEL_MIN_CHARS else 1, out)
        meta.update(base_meta(tok, counts, {"train": split_at, "val": total - split_at}, val_fraction, sep))
        meta["sources"] = source_rows
        atomic_write_json(tmp / META, meta)

    write_output(out, write)
    return meta


def _prepare_documents(
    inputs: Sequence[str | os.PathLike[str]], out: Path, tokenizer: str | None,
    tokenizer_from: str | os.PathLike[str] | None, val_fraction: float, workers: int, shard_tokens: int | None,
    text_field: str | None, split_name: str | None,
) -> dict[str, Any]:
    """Text documents (records, Hub datasets, parquet folders) -> shards, each document ended by end-of-text."""
    tok = early_tokenizer(tokenizer, tokenizer_from)
    if tok is None:
        raise GptlabError("text documents are streamed: they need a tokenizer fixed in advance, --tokenizer gpt2 or "
                          "--tokenizer-from DIR (or give --block-size to pack them as examples)")
    if tok.eot_id is None:
        raise GptlabError("this tokenizer has no end-of-text token to end each document with: use one that has")
    sources = document_sources(inputs, text_field, split_name)
    shard_tokens = shard_tokens or DEFAULT_SHARD_TOKENS
    fingerprint = {"inputs": [s.describe() for s in sources], "tokenizer": tokenizer,
                   "tokenizer_from": None if tokenizer_from is None else str(tokenizer_from),
                   "val_fraction": val_fraction, "shard_tokens": shard_tokens, "documents": True}
    if resumable(building_dir(out), fingerprint):
        tok = load_tokenizer(building_dir(out))
    return _write_sharded(out, tok, lambda: document_pieces(sources, val_fraction), fingerprint, shard_tokens,
                          workers, None, {"val_fraction": val_fraction, "separator": True,
                                          "sources": fingerprint["inputs"]})


def _write_sharded(
    out: Path, tok: Tokenizer, make_pieces: Callable[[], Iterator[tuple[str, str | DocBatch | None]]],
    fingerprint: dict[str, Any], shard_tokens: int, workers: int, total_chars: int | None, about: dict[str, Any],
) -> dict[str, Any]:
    """Encode the pieces into shards built in `building_dir(out)` (resuming a killed run of the same
    `fingerprint`), then swap the finished directory in for `out`."""
    build, dtype = building_dir(out), dtype_for(tok.vocab_size)
    writer = ShardWriter(build, shard_tokens, dtype, fingerprint)
    if not (build.is_dir() and writer.resume()):
        remove_building(build)
        build.mkdir(parents=True)
        writer = ShardWriter(build, shard_tokens, dtype, fingerprint)
        tok.save(build)  # before encoding: the pool's workers load it from here; a resumed run reuses it

    def encoded(skip: int) -> Iterator[tuple[str, np.ndarray, int]]:
        return _encode_stream(skipping(make_pieces(), skip), tok, build, dtype, workers)

    needed = None if total_chars is None else total_chars * dtype.itemsize
    with _full_disk_message(out, needed or 0), _progress(total_chars, f"tokenize ({tok.kind})", "char") as bar:
        manifest = write_shards(writer, encoded, bar.update)
    counts = {s: sum(e["tokens"] for e in manifest[s]) for s in SPLITS}
    for split in SPLITS:
        if counts[split] < 2:
            remove_building(build)
            more = "use a larger --val-fraction or more data" if split == "val" else "use more data"
            raise GptlabError(f"the {split} split has {counts[split]} token(s), need at least 2: {more}")
    meta = base_meta(tok, counts, writer.chars, about["val_fraction"], about["separator"])
    meta.update({"sources": about["sources"], "shard_tokens": shard_tokens, "shards": manifest})

    def write(tmp: Path) -> None:  # hard links: the build stays whole until the swap is done
        for f in build.iterdir():
            if f.is_file():
                os.link(f, tmp / f.name)
        atomic_write_json(tmp / META, meta)

    write_output(out, write)
    remove_building(build)
    return meta
