"""The tokenizer interface, and the two tokenizers that need no Hugging Face file: char and GPT-2 (tiktoken).

See the package docstring for the contract and the on-disk format.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_text
from gptlab.tokenizer.seams import CHAR, REGEX, Seams

META_FILE = "tokenizer_meta.json"
HF_FILE = "tokenizer.json"
EOT_TEXT = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # 256 byte tokens + <|endoftext|>: anything smaller can't encode every byte
MAX_BPE_VOCAB = 1 << 24  # 64x the largest vocabularies in use; the tokenizers library aborts on absurd sizes
KINDS = ("char", "gpt2", "bpe", "hf")
_REPLACEMENT = "\ufffd".encode()


@runtime_checkable
class TextTokenizer(Protocol):
    """What generation, serving, export and inspection use of a tokenizer: every `Tokenizer` here has it, and so
    may any other object (a test's byte tokenizer, a wrapper of another library's). `eot_id` None: no end-of-text
    token; `bos_id`, `chat_template` and `kind` are read where present."""

    vocab_size: int
    eot_id: int | None

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]: ...

    def decode(self, ids: Iterable[int], *, errors: str = "strict") -> str:
        """errors="replace": an id past the vocabulary becomes U+FFFD (the server's echo and the harness ask it)."""
        ...

    def decode_bytes(self, ids: Iterable[int]) -> bytes: ...


def token_text(tokenizer: TextTokenizer, token_id: int) -> str:
    """One token as its own text: its bytes read as UTF-8, a byte-level token that holds part of a character
    showing U+FFFD (`decode` of it alone may refuse such a token)."""
    return tokenizer.decode_bytes([token_id]).decode("utf-8", errors="replace")


class DamagedTokenizer(GptlabError):
    """A tokenizer file that is there but unreadable (truncated, not JSON): an error even where a tokenizer is
    optional, so that a damaged one is never taken for none."""


def checked_ids(ids: Iterable[int], vocab_size: int, errors: str = "strict") -> list[int]:
    """`ids` as a list; with errors="strict" a ValueError for the first id outside [0, vocab_size)."""
    ids = _as_int_list(ids)
    if errors == "strict":
        bad = next((i for i in ids if not 0 <= i < vocab_size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the tokenizer's vocabulary (0..{vocab_size - 1}); pass "
                             "errors='replace' to decode it as U+FFFD")
    elif errors != "replace":
        raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
    return ids


def _as_int_list(ids: Iterable[int]) -> list[int]:
    # numpy arrays and torch tensors both have tolist(); avoids a slow per-element conversion
    if hasattr(ids, "tolist"):
        out = ids.tolist()  # type: ignore[union-attr]
        return out if isinstance(out, list) else [out]
    return [int(i) for i in ids]


class Tokenizer:
    """Base class; see the module docstring for the contract."""

    kind: str = ""
    vocab_size: int = 0
    eot_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None
    chat_template_file: str | None = None  # where chat_template was read from: its errors name it

    @property
    def adds_bos(self) -> bool:
        """Whether the model's own tokenizer (transformers' default encoding) puts BOS first; `encode` never does."""
        return False

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int], *, errors: str = "strict") -> str:
        """The text of `ids`. An id outside the vocabulary is a ValueError (errors="strict"), or U+FFFD with
        errors="replace" (a model whose vocabulary is padded past the tokenizer's can emit such ids)."""
        ids = checked_ids(ids, self.vocab_size, errors)
        # "replace" here too: a token's bytes need not be valid UTF-8 on their own
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_np(self, text: str) -> np.ndarray:
        """Encode plain text to an integer array (used by data preparation)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    @property
    def seams(self) -> Seams:
        """Where text may be cut so that its pieces encode to the ids of the whole (`gptlab.tokenizer.seams`)."""
        return REGEX

    def encode_chunks(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode_batch`, with each `Continued` text (cut at one of `seams`) encoded as the rest of a text."""
        return self.encode_batch(texts)  # here the start of a text is nothing special

    def _meta(self) -> dict[str, Any]:
        return {
            "format": "gptlab-tokenizer",
            "version": 1,
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "bos_id": self.bos_id,
            "chat_template": self.chat_template,
        }

    def save(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / META_FILE, json.dumps(self._meta(), indent=1) + "\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def fingerprint(tok: Tokenizer, samples: int = 4096) -> str:
    """A short hash of what the ids mean: the vocabulary size and the bytes of up to `samples` evenly spaced ids
    (and the last). Two tokenizers with equal fingerprints encode text to the same ids, whatever their kind (a
    gptlab gpt2 and a Hugging Face GPT-2 tokenizer agree); a char vocabulary and a BPE one never do."""
    n = tok.vocab_size
    h = hashlib.sha256(f"{n}".encode())
    for i in sorted({*range(0, n, max(1, n // samples)), n - 1} - {-1}):
        piece = tok.decode_bytes([i])
        h.update(len(piece).to_bytes(4, "little") + piece)
    return h.hexdigest()[:12]


# --- char -------------------------------------------------------------------------------------------------------


class UnknownCharacters(GptlabError):
    """Text with characters a char vocabulary lacks; `shown` lists them as the message does, for callers that name
    where the text came from (a flag) in their own words."""

    def __init__(self, unknown: Sequence[str]) -> None:
        self.count = len(unknown)
        self.shown = ", ".join(repr(c) for c in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
        super().__init__(f"text has {self.count} character(s) not in the char tokenizer's vocabulary: {self.shown}; "
                         "prepare the data from text that contains them, or use --tokenizer gpt2 or bpe")

    def of(self, where: str) -> str:
        """The message said of where the text came from (a flag, a request's field, "the message"), without the
        advice to prepare other data, which a user of a trained model cannot take."""
        return f"{where} has {self.count} character(s) not in the model's char vocabulary: {self.shown}"


class CharTokenizer(Tokenizer):
    """One id per distinct character of the training text, sorted by code point (as in nanoGPT)."""

    kind = "char"

    def __init__(self, chars: Iterable[str]):
        chars = sorted(set(chars))
        if not chars or any(len(c) != 1 for c in chars):
            raise GptlabError("a char tokenizer needs a non-empty list of single characters")
        self.chars = chars
        self.vocab_size = len(chars)
        self._stoi = {c: i for i, c in enumerate(chars)}
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)
        self._bytes = [c.encode("utf-8", "surrogatepass") for c in chars]

    @classmethod
    def from_text(cls, text: str | Iterable[str]) -> CharTokenizer:
        """Vocabulary = the set of characters of `text` (a string or an iterable of string chunks)."""
        if isinstance(text, str):
            return cls(set(text))
        seen: set[str] = set()
        for chunk in text:
            seen.update(chunk)
        return cls(seen)

    def encode_np(self, text: str) -> np.ndarray:
        # vectorised lookup: code points -> position in the sorted vocabulary
        cps = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")
        idx = np.searchsorted(self._codepoints, cps)
        idx_clipped = np.minimum(idx, self.vocab_size - 1)
        bad = self._codepoints[idx_clipped] != cps
        if bad.any():
            raise UnknownCharacters(sorted({chr(c) for c in cps[bad].tolist()}))
        return idx.astype(np.int64)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if len(text) < 64:  # the dict is faster than numpy for the short prompts of sampling
            try:
                return [self._stoi[c] for c in text]
            except KeyError:
                pass  # fall through to the numpy path for its error message
        return self.encode_np(text).tolist()

    def decode(self, ids: Iterable[int], *, errors: str = "strict") -> str:
        n, chars = self.vocab_size, self.chars
        return "".join(chars[i] if 0 <= i < n else "\ufffd" for i in checked_ids(ids, n, errors))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        n, table = self.vocab_size, self._bytes
        return b"".join(table[i] if 0 <= i < n else _REPLACEMENT for i in _as_int_list(ids))

    @property
    def seams(self) -> Seams:
        return CHAR

    def _meta(self) -> dict[str, Any]:
        return {**super()._meta(), "chars": self.chars}


# --- gpt2 (tiktoken) --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _gpt2_encoding() -> Any:
    import tiktoken  # deferred: loading the BPE ranks costs ~0.3 s

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises requests/OS/hash errors when it can't fetch its files
        where = os.environ.get("TIKTOKEN_CACHE_DIR")
        got = f" (TIKTOKEN_CACHE_DIR={where} has no usable copy)" if where else ""
        raise GptlabError(
            f"could not load tiktoken's gpt2 files{got} [{type(e).__name__}]: set TIKTOKEN_CACHE_DIR to a "
            "folder holding tiktoken's cached gpt2 files, or connect to the internet"
        ) from e


class GPT2Tokenizer(Tokenizer):
    """OpenAI's GPT-2 BPE via tiktoken: 50,257 ids, ``<|endoftext|>`` = 50256."""

    kind = "gpt2"

    def __init__(self) -> None:
        self._enc = _gpt2_encoding()
        self.vocab_size = self._enc.n_vocab
        self.eot_id = self._enc.eot_token

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def encode_np(self, text: str) -> np.ndarray:
        # straight into a numpy buffer; nothing allowed and nothing disallowed = encode_ordinary
        return self._enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = _as_int_list(ids)
        n = self.vocab_size
        if all(0 <= i < n for i in ids):
            return self._enc.decode_bytes(ids)
        return b"".join(self._enc.decode_bytes([i]) if 0 <= i < n else _REPLACEMENT for i in ids)

    def _meta(self) -> dict[str, Any]:
        return {**super()._meta(), "encoding": "gpt2"}
