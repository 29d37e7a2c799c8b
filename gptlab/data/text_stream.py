"""Text inputs as one stream of chunks, for `gptlab.data.preparation` to encode.

* Inputs (files in the order given; directories expand to their ``*.txt`` files, recursively, sorted; the name
  ``shakespeare`` fetches tiny Shakespeare: `resolve_inputs`) are concatenated. Empty files are skipped.
* Files are read in 1 MiB blocks and decoded incrementally, so a bad byte is reported with its file and offset
  (`iter_file_text`), and never held whole. A first pass (`scan_sources`) takes each file's size, sha256 and
  character count (and, for char tokenizers, the character set) and validates the UTF-8 before anything is
  written.
* The split is by characters over the whole concatenation, like nanoGPT: train = the first
  ``int(N * (1 - val_fraction))`` characters, val = the rest (`iter_split_pieces`, which also marks where an
  end-of-text token goes between documents).
* Chunking never changes the ids (`chunk_text`): each tokenizer says where its text may be cut (its `seams`,
  see `gptlab.tokenizer.seams`). For char any cut is exact. For gpt2, trained bpe and regex pre-tokenizers
  (cl100k / Llama-3 style) chunks are cut right after a ``"\\n"`` that sits between two non-whitespace
  characters: the regex always ends a pre-token there and nothing before it depends on what follows. For
  tokenizers that treat the start of a text specially (SentencePiece-style Metaspace, Llama 2's
  ``Prepend("▁")`` normalizer, byte-level with add_prefix_space) they are cut right before a space that follows
  a non-space: the space starts a pre-token (or no token spans it) and a chunk starting with one gets no
  prefix of its own; a chunk after the first is marked `Continued` so that a normalizer that prepends "▁"
  regardless is undone. Tests check chunked == whole on random text for each kind. Only a stretch of 4 chunks'
  characters without such a place falls back: to a cut before a space (exact for the regexes too), and without
  any space to a plain cut (may differ there: e.g. long unspaced CJK text with the SentencePiece-style ones).
  A tokenizer whose seams are not known to be exact (`Seams.exact`) is cut at spaces and `prepare` says so.
  The one real difference is the train/val boundary itself, which cuts mid-word as nanoGPT does: tiny
  Shakespeare with gpt2 gives 301,966 + 36,059 = 338,025 ids, the same total as encoding it whole.
"""

from __future__ import annotations

import codecs
import glob
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from gptlab.data.common import progress as _progress
from gptlab.data.corpora import fetch_shakespeare
from gptlab.errors import GptlabError
from gptlab.tokenizer.seams import Continued, Cut

READ_BYTES = 1 << 20  # file read size
CHUNK_CHARS = 1 << 20  # characters per encoding task

_SAFE_NL = re.compile(r"(?<=\S)\n(?=\S)")  # cut after this newline: see the module docstring
_SAFE_SPACE = re.compile(r"(?<=[^\s\u2581])(?= )")  # before a space after a non-space (not "▁": see seams)

# --- inputs -----------------------------------------------------------------------------------------------------


def expand_globs(inputs: Sequence[str | os.PathLike[str]]) -> list[str | os.PathLike[str]]:
    """INPUT arguments with each quoted glob (``'data/*.parquet'``) replaced by its sorted matches; a pattern that
    matches nothing is an error, an existing file of that name is taken as it is."""
    out: list[str | os.PathLike[str]] = []
    for item in inputs:
        text = str(item)
        if not any(c in text for c in "*?[") or Path(text).expanduser().exists() or "://" in text:
            out.append(item)
            continue
        found = sorted(glob.glob(os.path.expanduser(text), recursive=True))
        if not found:
            raise GptlabError(f"input pattern {text} matches no file")
        out.extend(found)
    return out


def resolve_inputs(inputs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand INPUT arguments to files: files as given, directories to their sorted *.txt files."""
    if not inputs:
        raise GptlabError("no input given: pass text files, directories of .txt files, or `shakespeare`")
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if not p.exists() and str(item) == "shakespeare":  # a real file called "shakespeare" wins
            files.append(fetch_shakespeare())
        elif p.is_dir():
            found = sorted(f for f in p.rglob("*.txt") if f.is_file())
            if not found:
                raise GptlabError(
                    f"directory {p} has no .txt files (directories are searched for *.txt recursively; "
                    "pass other files by name)"
                )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise GptlabError(
                f"input {p} does not exist (give text files, directories of .txt files, or `shakespeare`)"
            )
    return files


def _iter_blocks(path: Path, read_bytes: int = READ_BYTES) -> Iterator[tuple[bytes, str]]:
    """(raw block, decoded text) pairs; GptlabError names the file and byte offset of bad UTF-8."""
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    offset = 0  # bytes read before the current block
    with open(path, "rb") as f:
        while True:
            block = f.read(read_bytes)
            pending = len(decoder.getstate()[0])  # bytes of a split character held from the last block
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise GptlabError(
                    f"{path} is not UTF-8 text (bad byte at offset {offset - pending + e.start}); "
                    "convert it, e.g. `iconv -f latin1 -t utf-8`"
                ) from None
            if not block:
                return
            offset += len(block)
            yield block, text


def iter_file_text(path: str | os.PathLike[str], read_bytes: int = READ_BYTES) -> Iterator[str]:
    """Stream a UTF-8 file as text, block by block, never holding the whole file."""
    for _, text in _iter_blocks(Path(path), read_bytes):
        if text:
            yield text


def chunk_text(
    pieces: Iterable[str], chunk_chars: int = CHUNK_CHARS, *, cut: Cut = "newline", hard: bool = True
) -> Iterator[str]:
    """Re-cut a stream of text into chunks of about `chunk_chars` characters; every chunk after the first is a
    `Continued` (it continues the text, it does not start one).

    cut="any" cuts at exactly chunk_chars (fine for char tokenizers). "newline" and "space" cut only where the
    tokenizer's `seams` say (see the module docstring), so that encoding the chunks one by one gives the same ids
    as encoding the whole text -- except, with hard=True, for a plain cut after 4 * chunk_chars characters
    without a place to cut (bounded memory wins there).
    """
    buf, first = "", True
    for piece in pieces:
        buf += piece
        while len(buf) >= chunk_chars:
            if cut == "any":
                at = chunk_chars
            elif cut == "newline" and (m := _SAFE_NL.search(buf, chunk_chars - 1)):
                at = m.end()
            elif cut == "space" and (m := _SAFE_SPACE.search(buf, chunk_chars)):
                at = m.start()
            elif len(buf) < 4 * chunk_chars:
                break  # wait for more text: a good place to cut will probably come
            elif m := _SAFE_SPACE.search(buf, chunk_chars):
                at = m.start()
            elif hard:
                at = chunk_chars  # no whitespace at all for 4 chunks: memory matters more here
            else:
                break
            yield buf[:at] if first else Continued(buf[:at])
            buf, first = buf[at:], False
    if buf:
        yield buf if first else Continued(buf)


# --- scanning ---------------------------------------------------------------------------------------------------


@dataclass
class Source:
    path: Path
    bytes: int = 0
    chars: int = 0
    sha256: str = ""


def scan_sources(paths: Sequence[Path], collect_chars: bool = False) -> tuple[list[Source], set[str]]:
    """First pass: sizes, hashes, character counts (and the character set); validates UTF-8 early."""
    sources, charset = [], set()
    with _progress(sum(p.stat().st_size for p in paths), "scan", "B") as bar:
        for p in paths:
            src, h = Source(p), hashlib.sha256()
            for block, text in _iter_blocks(p):
                h.update(block)
                src.bytes += len(block)
                src.chars += len(text)
                if collect_chars:
                    charset.update(text)
                bar.update(len(block))
            src.sha256 = h.hexdigest()
            sources.append(src)
    return sources, charset


def iter_split_pieces(
    sources: Sequence[Source], split_at: int, eot: bool, cut: Cut, chunk_chars: int
) -> Iterator[tuple[str, str | None]]:
    """Yield ("train" | "val", text) in order; text None stands for an end-of-text token. Each file's first
    chunk and val's first piece start a text; the other chunks are `Continued`."""
    docs = [s for s in sources if s.chars]
    pos = 0
    for k, src in enumerate(docs):
        for chunk in chunk_text(iter_file_text(src.path), chunk_chars, cut=cut):
            end = pos + len(chunk)
            if end <= split_at:
                yield "train", chunk
            elif pos >= split_at:
                yield "val", str(chunk) if pos == split_at else chunk  # val's first chunk starts its text
            else:  # the chunk straddles the split: cut it where nanoGPT would; val starts a text there
                head = chunk[: split_at - pos]
                yield "train", Continued(head) if isinstance(chunk, Continued) else head
                yield "val", chunk[split_at - pos :]
            pos = end
        if eot and k < len(docs) - 1:
            yield ("train" if pos <= split_at else "val"), None
