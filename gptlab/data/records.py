"""Record inputs -> validated records, streamed: what `gptlab prepare` reads besides text files.

Formats (by name; see `record_format`): ``.jsonl`` (one JSON object per line), ``.json`` (a list of objects, or
one object per line), ``.parquet`` (pyarrow, read in row batches), a directory written by `datasets`'
``save_to_disk`` (a DatasetDict gives its "train" split, or ``--split-name``), and ``.csv`` / ``.tsv`` /
``.arrow`` through ``datasets.load_dataset``. pyarrow and datasets are the optional extra ``gptlab[data]``,
imported only when such a file is read. Memory stays bounded: lines, array elements and row batches are read
one at a time, never the whole file.

Shapes, detected per record (text, prompt/completion, chat, preference pairs), are `gptlab.data.shapes`'.
One input holds one shape: a file that mixes them is more likely a mistake than a plan, so it is an error naming
the line. Every error is one line naming the file and the line (or row) at fault.
"""

from __future__ import annotations

import csv
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gptlab.data.common import show_progress
from gptlab.data.shapes import Record, parse_record
from gptlab.errors import GptlabError

RECORD_INPUTS = ".jsonl, .json, .parquet, .csv, .tsv, .arrow, saved datasets"
_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv",
             ".arrow": "arrow"}
_SAVED_DATASET = ("dataset_info.json", "state.json", "dataset_dict.json")  # what save_to_disk writes
_READ = 1 << 20
_BATCH_ROWS = 1024
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # JSON's \uD800-\uDFFF: text only as a high-low pair


def record_format(path: Path) -> str | None:
    """"jsonl", "json", "parquet", "csv", "arrow" or "dataset" (a save_to_disk directory); None for text."""
    if path.is_dir():
        return "dataset" if any((path / f).is_file() for f in _SAVED_DATASET) else None
    return _SUFFIXES.get(path.suffix.lower())


def are_records(inputs: Sequence[str | os.PathLike[str]]) -> bool:
    """True when every input holds records, False when none does; a mix is an error (text is one stream,
    records are examples: the two don't share a layout)."""
    kinds = [record_format(Path(i).expanduser()) is not None for i in inputs]
    if any(kinds) and not all(kinds):
        text = next(i for i, k in zip(inputs, kinds, strict=True) if not k)
        rec = next(i for i, k in zip(inputs, kinds, strict=True) if k)
        raise GptlabError(f"{text} is text and {rec} holds records: prepare text files and record files "
                          f"({RECORD_INPUTS}) in separate runs")
    return bool(kinds) and all(kinds)


def need_extra(module: str, what: str) -> Any:
    """Import an optional dependency of the `data` extra, or say in one line how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise GptlabError(f"reading {what} needs {package}: pip install 'gptlab[data]'") from None


def first_line(e: BaseException) -> str:
    """The root cause's name and first line (datasets wraps a parser's error in a generic one)."""
    while e.__cause__ is not None:
        e = e.__cause__
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


# --- rows -------------------------------------------------------------------------------------------------------


def _jsonl_rows(path: Path, hint: str = "") -> Iterator[tuple[str, Any]]:
    """(where, parsed object) per non-blank line."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if n == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]  # a UTF-8 byte-order mark
            if not raw.strip():
                continue
            where = f"{path} line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise GptlabError(f"{where}: not UTF-8 text (bad byte at column {e.start + 1})") from None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise GptlabError(f"{where}: invalid JSON: {e.msg} (column {e.colno}){hint}") from None
            except RecursionError:
                raise GptlabError(f"{where}: JSON nested too deeply to be a record") from None
            yield where, _text_only(row, line, where)


def _text_only(row: Any, raw: str, where: str) -> Any:
    """`row`, refused when a \\u escape of `raw` left an unpaired surrogate in it: no text holds one (a tokenizer
    failed on it without naming the record, a char vocabulary took it in)."""
    if _SURROGATE_ESCAPE.search(raw):  # rare: only then is the row walked
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise GptlabError(f"{where}: a \\u escape gives the unpaired surrogate {e.object[e.start]!r}, which is "
                              "not text (a UTF-16 pair cut in two?)") from None
    return row


class _Text:
    """A UTF-8 file read in growing blocks, with the line number of any position (for a streamed JSON list)."""

    def __init__(self, f: Any) -> None:
        self.f, self.buf, self.pos, self.lines_before = f, "", 0, 0

    def more(self) -> bool:
        """Append a block (at least as big as what is held, so re-parsing a huge element stays linear)."""
        try:
            block = self.f.read(max(_READ, len(self.buf) - self.pos))
        except UnicodeDecodeError as e:
            raise GptlabError(f"{self.f.name}: not UTF-8 text ({e.reason})") from None
        if not block:
            return False
        self.lines_before += self.buf.count("\n", 0, self.pos)
        self.buf, self.pos = self.buf[self.pos :] + block, 0
        return True

    def peek(self) -> str:
        """The next non-whitespace character ("" at the end of the file)."""
        while True:
            while self.pos < len(self.buf) and self.buf[self.pos] in " \t\r\n":
                self.pos += 1
            if self.pos < len(self.buf) or not self.more():
                return self.buf[self.pos : self.pos + 1]

    def line(self, at: int | None = None) -> int:
        return self.lines_before + self.buf.count("\n", 0, self.pos if at is None else at) + 1


def _json_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A .json file: a list of objects, streamed element by element; else one object per line."""
    with open(path, encoding="utf-8-sig") as f:
        text = _Text(f)
        first = text.peek()
        if first != "[":
            if first not in ("{", ""):
                raise GptlabError(f"{path}: expected a JSON list of objects, or one object per line")
            yield from _jsonl_rows(path, " (a .json file holds a list of objects, or one object per line)")
            return
        text.pos += 1
        decoder, n = json.JSONDecoder(), 0
        while True:
            c = text.peek()
            if c in ("]", ""):
                break
            if n:
                if c != ",":
                    raise GptlabError(f"{path} line {text.line()}: invalid JSON: expected ',' or ']' after record {n}")
                text.pos += 1
                text.peek()
            start_line, failed = text.line(), None
            while True:
                try:
                    obj, end = decoder.raw_decode(text.buf, text.pos)
                    break
                except RecursionError:
                    raise GptlabError(f"{path} line {text.line()}: JSON nested too deeply to be a record") from None
                except json.JSONDecodeError as e:
                    # the element may just be cut by the block end: read on, unless more text changed nothing
                    # (a real error: stop before reading the rest of a broken file; a long string moves nothing)
                    error = (e.msg, e.pos - text.pos)
                    if (error == failed and not e.msg.startswith("Unterminated string")) or not text.more():
                        raise GptlabError(f"{path} line {text.line(e.pos)}: invalid JSON: {e.msg}") from None
                    failed = error
            n += 1
            where = f"{path} record {n} (line {start_line})"
            yield where, _text_only(obj, text.buf[text.pos : end], where)
            text.pos = end
        if c != "]":
            raise GptlabError(f"{path} line {text.line()}: invalid JSON: the list is not closed (truncated file?)")
        text.pos += 1
        if text.peek():
            raise GptlabError(f"{path} line {text.line()}: invalid JSON: extra data after the list")


def _table_rows(path: Path, batches: Iterator[Any]) -> Iterator[tuple[str, Any]]:
    """Rows of Arrow record batches (or column dicts), numbered from 1."""
    n = 0
    for batch in batches:
        rows = batch.to_pylist() if hasattr(batch, "to_pylist") else [
            dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        for row in rows:
            n += 1
            yield f"{path} row {n}", row


class RecordFile:
    """One record input: `records()` streams it (as often as asked), `fingerprint()` sizes and hashes it."""

    def __init__(self, path: Path, text_field: str | None = None, split_name: str | None = None) -> None:
        fmt = record_format(path)
        if not path.exists():
            raise GptlabError(f"input {path} does not exist")
        if fmt is None:
            raise GptlabError(f"{path} is not a record file ({RECORD_INPUTS})")
        self.path, self.format, self.text_field, self.split_name = path, fmt, text_field, split_name
        self._dataset: Any = None
        self._cache: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        self._dataset = None
        if self._cache is not None:
            self._cache.cleanup()
            self._cache = None

    def _check_columns(self, columns: Sequence[str]) -> None:
        if self.text_field is not None and self.text_field not in columns:
            raise GptlabError(f"{self.path} has no column {self.text_field!r} (--text-field; columns: "
                              f"{', '.join(columns)})")

    def _parquet_rows(self) -> Iterator[tuple[str, Any]]:
        pa, pq = need_extra("pyarrow", ".parquet"), need_extra("pyarrow.parquet", ".parquet")
        try:
            pf = pq.ParquetFile(self.path)
            columns = pf.schema_arrow.names
            batches = pf.iter_batches(batch_size=_BATCH_ROWS)
        except (OSError, ValueError, pa.ArrowException) as e:
            raise GptlabError(f"{self.path} is not a readable parquet file (corrupt or truncated?): "
                              f"{first_line(e)}") from None
        self._check_columns(columns)
        try:
            yield from _table_rows(self.path, batches)
        except (OSError, ValueError, pa.ArrowException) as e:  # a damaged page shows up only when read
            raise GptlabError(f"{self.path} is not a readable parquet file (corrupt or truncated?): "
                              f"{first_line(e)}") from None

    def _load(self) -> Any:
        """The `datasets.Dataset` behind a saved-dataset directory or a .csv/.tsv/.arrow file (loaded once)."""
        if self._dataset is not None:
            return self._dataset
        what = "a saved dataset" if self.format == "dataset" else self.path.suffix
        datasets = need_extra("datasets", what)
        quiet = not show_progress() and not datasets.utils.are_progress_bars_disabled()
        if quiet:
            datasets.utils.disable_progress_bars()  # a one-line error must stay one line
        log = logging.getLogger("datasets")  # it logs a reader's failure before raising it: we report it once
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            if self.format == "dataset":
                ds = datasets.load_from_disk(str(self.path))
            else:  # converted to Arrow in a private cache, removed by close()
                self._cache = tempfile.TemporaryDirectory(prefix="gptlab-records-")
                kw = self._csv_options(datasets) if self.format == "csv" else {}
                ds = datasets.load_dataset(self.format, data_files=str(self.path), split="train",
                                           cache_dir=self._cache.name, **kw)
        except Exception as e:
            raise GptlabError(f"{self.path}: datasets could not read it ({first_line(e)})") from None
        finally:
            log.setLevel(level)
            if quiet:
                datasets.utils.enable_progress_bars()
        if isinstance(ds, datasets.DatasetDict):
            split = self.split_name or "train"
            if split not in ds:
                raise GptlabError(f"{self.path} has no split {split!r} (splits: {', '.join(ds)}); choose one with "
                                  "--split-name")
            ds = ds[split]
        self._check_columns(ds.column_names)
        self._dataset = ds
        return ds

    def _csv_options(self, datasets: Any) -> dict[str, Any]:
        """Every column read as a string: in text data " 4." is an answer, not the number 4.0."""
        delimiter = "\t" if self.path.suffix.lower() == ".tsv" else ","
        with open(self.path, encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f, delimiter=delimiter), [])
        features = datasets.Features({name: datasets.Value("string") for name in header})
        return {"delimiter": delimiter, "features": features}

    def rows(self) -> Iterator[tuple[str, Any]]:
        """(where, row) pairs in file order."""
        if self.format == "jsonl":
            return _jsonl_rows(self.path)
        if self.format == "json":
            return _json_rows(self.path)
        if self.format == "parquet":
            return self._parquet_rows()
        return _table_rows(self.path, self._load().iter(batch_size=_BATCH_ROWS))

    def records(self) -> Iterator[Record]:
        """Validated records; one shape per input (the first record's), else an error naming both lines."""
        first: Record | None = None
        for where, row in self.rows():
            record = parse_record(row, where, self.text_field)
            if first is None:
                first = record
            elif record.shape != first.shape:
                raise GptlabError(f"{where}: a {record.shape} record, but {first.where} is {first.shape}: one input "
                                  "holds one record shape (put the others in a file of their own)")
            yield record

    def fingerprint(self) -> tuple[int, str]:
        """(bytes, sha256) of the file, or of a directory's files (relative names and contents, sorted)."""
        h, size = hashlib.sha256(), 0
        files = sorted(p for p in self.path.rglob("*") if p.is_file()) if self.path.is_dir() else [self.path]
        for p in files:
            if self.path.is_dir():
                h.update(p.relative_to(self.path).as_posix().encode() + b"\0")
            with open(p, "rb") as f:
                while block := f.read(_READ):
                    h.update(block)
                    size += len(block)
        return size, h.hexdigest()
