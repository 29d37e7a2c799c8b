"""Plain-text documents from record inputs and Hugging Face datasets, as one token stream (pretraining data).

`gptlab prepare` reads record inputs without ``--block-size`` this way: each record's text is a document, ended
by the end-of-text token, and documents follow each other with no windows and no mask, like text files. Inputs:

* record files (``.jsonl``, ``.parquet``, a ``save_to_disk`` directory, ...: `gptlab.data.records`), the
  ``text`` column or ``--text-field``;
* ``hf://datasets/OWNER/NAME[/CONFIG]`` (or ``--hf-dataset``) and a local folder of parquet files (nanochat's and
  FineWeb's layout), both through ``datasets.load_dataset(NAME_OR_FOLDER, split=..., streaming=True)``: rows
  arrive as they are read, never the whole corpus, and a folder on disk goes through the very call a Hub name
  does.

The stream's length is unknown up front, so the validation split is spread through it: document i (from 0) goes
to val when ``floor((i + 1) * f) > floor(i * f)`` for ``f = --val-fraction``, exactly a fraction f of them.
Documents are grouped, per split, into batches of about a chunk's characters (`DocBatch`), the unit the encoder
pool takes and a resumed prepare skips by.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gptlab.data.records import RecordFile, first_line, need_extra, record_format
from gptlab.data.text_stream import CHUNK_CHARS
from gptlab.errors import GptlabError

HUB = "hf://datasets/"

DocBatch = tuple[str, ...]  # documents, each encoded and followed by the end-of-text token


def is_parquet_folder(path: Path) -> bool:
    return path.is_dir() and record_format(path) is None and any(path.rglob("*.parquet"))


def is_document_input(item: str | os.PathLike[str]) -> bool:
    """A Hub dataset name or a folder of parquet files: inputs only the document stream reads."""
    return str(item).startswith(HUB) or is_parquet_folder(Path(item).expanduser())


class StreamedDataset:
    """A dataset read with ``datasets.load_dataset(name, split, streaming=True)``: a Hub name or a local folder."""

    def __init__(self, name: str, split: str | None, text_field: str | None, config: str | None = None) -> None:
        self.name, self.split, self.field, self.config = name, split or "train", text_field or "text", config

    def describe(self) -> dict[str, Any]:
        return {"dataset": self.name, "config": self.config, "split": self.split, "field": self.field}

    def texts(self) -> Iterator[tuple[str, str]]:
        datasets = need_extra("datasets", f"dataset {self.name}")
        try:
            args = (self.name,) if self.config is None else (self.name, self.config)
            rows = datasets.load_dataset(*args, split=self.split, streaming=True)
            for n, row in enumerate(rows, 1):
                if self.field not in row:
                    raise GptlabError(f"{self.name} has no column {self.field!r} (--text-field; columns: "
                                      f"{', '.join(row)})")
                text = row[self.field]
                if not isinstance(text, str):
                    raise GptlabError(f"{self.name} row {n}: {self.field!r} is not a string")
                yield f"{self.name} row {n}", text
        except GptlabError:
            raise
        except Exception as e:  # datasets' own errors: a missing dataset, a split, a network failure
            raise GptlabError(f"{self.name}: datasets could not stream it ({first_line(e)})") from None


class LocalRecords:
    """Text records of a local record file (`RecordFile`); any other record shape is an error."""

    def __init__(self, path: Path, text_field: str | None, split_name: str | None) -> None:
        self.file = RecordFile(path, text_field, split_name)

    def describe(self) -> dict[str, Any]:
        size, sha = self.file.fingerprint()
        return {"path": str(self.file.path), "bytes": size, "sha256": sha}

    def texts(self) -> Iterator[tuple[str, str]]:
        try:
            for record in self.file.records():
                if record.shape != "text":
                    raise GptlabError(f"{record.where} is a {record.shape} record: record inputs need --block-size "
                                      "N (the model's block_size) unless they hold plain text documents, which are "
                                      "tokenized as one stream")
                yield record.where, record.text
        finally:
            self.file.close()


def document_sources(inputs: Sequence[str | os.PathLike[str]], text_field: str | None,
                     split_name: str | None) -> list[StreamedDataset | LocalRecords]:
    out: list[StreamedDataset | LocalRecords] = []
    for item in inputs:
        if str(item).startswith(HUB):
            parts = str(item)[len(HUB):].strip("/").split("/")
            if len(parts) < 2 or not all(parts):
                raise GptlabError(f"{item}: name a dataset as OWNER/NAME[/CONFIG], e.g. "
                                  "hf://datasets/HuggingFaceFW/fineweb-edu/sample-10BT")
            out.append(StreamedDataset("/".join(parts[:2]), split_name, text_field, "/".join(parts[2:]) or None))
        elif is_parquet_folder(Path(item).expanduser()):
            out.append(StreamedDataset(str(Path(item).expanduser()), split_name, text_field))
        else:
            out.append(LocalRecords(Path(item).expanduser(), text_field, split_name))
    return out


def is_val(index: int, val_fraction: float) -> bool:
    """Whether document `index` belongs to the validation split (see the module docstring)."""
    return math.floor((index + 1) * val_fraction + 1e-9) > math.floor(index * val_fraction + 1e-9)


def document_pieces(sources: Sequence[StreamedDataset | LocalRecords], val_fraction: float,
                    batch_chars: int = CHUNK_CHARS) -> Iterator[tuple[str, DocBatch]]:
    """("train" | "val", documents) in stream order, each batch about `batch_chars` characters of one split."""
    held: dict[str, list[str]] = {"train": [], "val": []}
    size = {"train": 0, "val": 0}
    index = 0
    for source in sources:
        for _, text in source.texts():
            split = "val" if is_val(index, val_fraction) else "train"
            index += 1
            held[split].append(text)
            size[split] += len(text)
            if size[split] >= batch_chars:
                yield split, tuple(held[split])
                held[split], size[split] = [], 0
    for split in ("train", "val"):
        if held[split]:
            yield split, tuple(held[split])
    if index == 0:
        raise GptlabError("the inputs hold no documents")
