"""Tokenizers behind one small interface: char, GPT-2 (tiktoken), byte-level BPE and Hugging Face.

Every tokenizer has ``kind``, ``vocab_size``, ``eot_id`` (end-of-text id or None), ``bos_id``,
``chat_template`` (Jinja text or None), ``encode``, ``decode``, ``decode_bytes``, ``encode_batch`` and
``save``; :func:`load_tokenizer` reads back what ``save`` wrote, or a plain Hugging Face model directory.

Plain text in, plain text out: ``encode(text)`` never turns the *text* ``<|endoftext|>`` (or any other
special-token string) into a special id, so user data can't inject control tokens or crash the encoder.
Pass ``allow_special=True`` (e.g. for a rendered chat template) to map special-token strings to their ids.
``decode`` keeps special tokens (``decode(encode(s)) == s`` for every string the tokenizer can encode).
Ids at or above ``vocab_size`` (a model's padded vocabulary, e.g. 50304 for GPT-2) decode to U+FFFD.

On-disk format (one directory; written with every checkpoint and data directory):

* ``tokenizer_meta.json`` -- always: ``{"format": "gptlab-tokenizer", "version": 1, "kind": ...,
  "vocab_size": int, "eot_id": int | null, "bos_id": int | null, "chat_template": str | null}`` plus, for
  ``char``, ``"chars"``: the vocabulary as a list of one-character strings, id = index (sorted); for
  ``gpt2``, ``"encoding": "gpt2"`` (the BPE tables come from tiktoken, not from the directory).
* ``tokenizer.json`` -- for ``bpe`` and ``hf`` only: the Hugging Face ``tokenizers`` file, so the directory
  also loads with ``tokenizers.Tokenizer.from_file`` (and in transformers).

:func:`load_tokenizer` reads ``tokenizer_meta.json`` when present; otherwise it treats the directory as a
Hugging Face model directory: ``tokenizer.json`` (+ ``tokenizer_config.json`` / ``chat_template.jinja`` /
``generation_config.json`` for eos, bos and the chat template), or GPT-2 style ``vocab.json`` +
``merges.txt``.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from gptlab.errors import GptlabError
from gptlab.fileio import atomic_write_text, read_json_object

META_FILE = "tokenizer_meta.json"
HF_FILE = "tokenizer.json"
EOT_TEXT = "<|endoftext|>"
MIN_BPE_VOCAB = 257  # 256 byte tokens + <|endoftext|>: anything smaller can't encode every byte
KINDS = ("char", "gpt2", "bpe", "hf")
_REPLACEMENT = "\ufffd".encode()


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

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        # errors="replace": a model can emit ids whose bytes are not valid UTF-8 on their own
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def encode_np(self, text: str) -> np.ndarray:
        """Encode plain text to an integer array (used by data preparation)."""
        return np.asarray(self.encode(text), dtype=np.int64)

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


# --- char -------------------------------------------------------------------------------------------------------


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
            unknown = sorted({chr(c) for c in cps[bad].tolist()})
            shown = ", ".join(repr(c) for c in unknown[:10]) + (", ..." if len(unknown) > 10 else "")
            raise GptlabError(
                f"text has {len(unknown)} character(s) not in the char tokenizer's vocabulary: {shown}; "
                "prepare the data from text that contains them, or use --tokenizer gpt2 or bpe"
            )
        return idx.astype(np.int64)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        if len(text) < 64:  # the dict is faster than numpy for the short prompts of sampling
            try:
                return [self._stoi[c] for c in text]
            except KeyError:
                pass  # fall through to the numpy path for its error message
        return self.encode_np(text).tolist()

    def decode(self, ids: Iterable[int]) -> str:
        n, chars = self.vocab_size, self.chars
        return "".join(chars[i] if 0 <= i < n else "\ufffd" for i in _as_int_list(ids))

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        n, table = self.vocab_size, self._bytes
        return b"".join(table[i] if 0 <= i < n else _REPLACEMENT for i in _as_int_list(ids))

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


# --- Hugging Face tokenizers (trained byte-level BPE, and imported models) --------------------------------------


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode map, which ByteLevel vocabularies are written in
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _decoder_types(node: Any) -> list[dict[str, Any]]:
    """Flatten a tokenizer.json "decoder" (possibly a Sequence) into its steps."""
    if not isinstance(node, dict):
        return []
    if node.get("type") == "Sequence":
        return [s for d in node.get("decoders", []) for s in _decoder_types(d)]
    return [node]


class HFTokenizer(Tokenizer):
    """Any Hugging Face ``tokenizers`` tokenizer; ``kind`` is "bpe" (trained by gptlab) or "hf" (imported)."""

    def __init__(
        self,
        tok: Any,
        kind: str = "hf",
        eot_id: int | None = None,
        bos_id: int | None = None,
        chat_template: str | None = None,
    ):
        self.kind = kind
        self._tok = tok
        self._tok.encode_special_tokens = True  # plain-text encode: "<|endoftext|>" in user text stays text
        self._special_tok: Any = None  # a second instance for allow_special=True (the flag is not per call)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot_id, self.bos_id, self.chat_template = eot_id, bos_id, chat_template
        # only the decoder's JSON: parsing the whole tokenizer.json (MBs) would cost ~0.1 s per load
        decoder = tok.decoder
        steps = _decoder_types(json.loads(decoder.__getstate__()) if decoder is not None else None)
        types = {s.get("type") for s in steps}
        self._byte_level = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        # sentencepiece-style decoders drop the space that "▁" puts before the first word
        self._strip_first_space = any(
            (s.get("type") == "Strip" and s.get("start", 0) >= 1)
            or (s.get("type") == "Metaspace" and s.get("prepend_scheme", "always") != "never")
            for s in steps
        )
        self._simple = self._byte_level or self._byte_fallback or "Metaspace" in types or "Replace" in types
        self._table: list[bytes] | None = None

    @classmethod
    def train(cls, chunks: Iterable[str], vocab_size: int, progress: bool = False) -> HFTokenizer:
        """Train a byte-level BPE (GPT-2 style pre-tokenization) from an iterator of text chunks."""
        from tokenizers import Tokenizer as HFTok
        from tokenizers import decoders, models, pre_tokenizers, trainers

        if vocab_size < MIN_BPE_VOCAB:
            raise GptlabError(
                f"--vocab-size {vocab_size} is too small for bpe: it needs at least {MIN_BPE_VOCAB} "
                "(256 byte tokens + <|endoftext|>)"
            )
        tok = HFTok(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT_TEXT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable, even unseen ones
            show_progress=progress,
        )
        tok.train_from_iterator(chunks, trainer)
        return cls(tok, kind="bpe", eot_id=tok.token_to_id(EOT_TEXT))

    @property
    def _json(self) -> str:
        return self._tok.to_str()

    def _special(self) -> Any:
        if self._special_tok is None:
            from tokenizers import Tokenizer as HFTok

            self._special_tok = HFTok.from_str(self._json)
            self._special_tok.encode_special_tokens = False
        return self._special_tok

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        tok = self._special() if allow_special else self._tok
        return tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        fast = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: ~3x faster
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]

    def _token_table(self) -> list[bytes]:
        if self._table is None:
            added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
            bdec = _byte_decoder()
            hexbyte = re.compile(r"<0x([0-9A-Fa-f]{2})>")
            table = []
            for i in range(self.vocab_size):
                s = added.get(i)
                if s is not None:
                    table.append(s.encode("utf-8"))
                    continue
                s = self._tok.id_to_token(i)
                if s is None:
                    table.append(_REPLACEMENT)
                elif self._byte_level and all(c in bdec for c in s):
                    table.append(bytes(bdec[c] for c in s))
                elif self._byte_fallback and (m := hexbyte.fullmatch(s)):
                    table.append(bytes([int(m.group(1), 16)]))
                else:
                    table.append(s.replace("\u2581", " ").encode("utf-8"))
            self._table = table
        return self._table

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        ids = _as_int_list(ids)
        if not self._simple:  # e.g. WordPiece: tokens are whole characters, so text -> bytes is exact enough
            return self.decode(ids).encode("utf-8")
        table, n = self._token_table(), self.vocab_size
        out = b"".join(table[i] if 0 <= i < n else _REPLACEMENT for i in ids)
        if self._strip_first_space and not self._byte_level and out.startswith(b" "):
            out = out[1:]
        return out

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_int_list(ids)
        if self._simple:
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        n = self.vocab_size
        return self._tok.decode([i for i in ids if 0 <= i < n], skip_special_tokens=False)

    def save(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / HF_FILE, self._json)
        super().save(d)


# --- loading ----------------------------------------------------------------------------------------------------


def _token_content(tok: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as {"content": ...} objects
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _first_int(v: Any) -> int | None:
    if isinstance(v, list):
        v = v[0] if v else None
    return v if isinstance(v, int) else None


def _load_hf_dir(d: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as HFTok

    if (d / HF_FILE).is_file():
        try:
            tok = HFTok.from_file(str(d / HF_FILE))
        except Exception as e:
            raise GptlabError(f"{d / HF_FILE} is not a tokenizer.json that `tokenizers` can read: {e}") from e
    else:  # GPT-2 era HF directories: vocab.json + merges.txt of a byte-level BPE
        from tokenizers import decoders, models, pre_tokenizers

        tok = HFTok(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOT_TEXT) is not None:
            tok.add_special_tokens([EOT_TEXT])
    cfg = read_json_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    if (d / "chat_template.jinja").is_file():  # newer transformers save the template on its own
        template = (d / "chat_template.jinja").read_text(encoding="utf-8")
    eos = _token_content(cfg.get("eos_token"))
    eot_id = tok.token_to_id(eos) if eos else None
    if eot_id is None:
        for f in ("generation_config.json", "config.json"):
            if eot_id is None and (d / f).is_file():
                eot_id = _first_int(read_json_object(d / f).get("eos_token_id"))
    if eot_id is None:
        eot_id = tok.token_to_id(EOT_TEXT)
    bos = _token_content(cfg.get("bos_token"))
    bos_id = tok.token_to_id(bos) if bos else None
    return HFTokenizer(tok, "hf", eot_id, bos_id, template if isinstance(template, str) else None)


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """Load what :meth:`Tokenizer.save` wrote, or the tokenizer of a Hugging Face model directory."""
    d = Path(directory)
    if d.is_file() and d.name in (META_FILE, HF_FILE):
        d = d.parent
    if not d.is_dir():
        raise GptlabError(f"tokenizer directory {d} does not exist")
    if (d / META_FILE).is_file():
        meta = read_json_object(d / META_FILE)
        kind = meta.get("kind")
        if kind == "char":
            chars = meta.get("chars")
            if not isinstance(chars, list):
                raise GptlabError(f"{d / META_FILE} has kind 'char' but no 'chars' list; re-run gptlab prepare")
            return CharTokenizer(chars)
        if kind == "gpt2":
            return GPT2Tokenizer()
        if kind in ("bpe", "hf"):
            if not (d / HF_FILE).is_file():
                raise GptlabError(f"{d} has a {kind} tokenizer_meta.json but no {HF_FILE}; re-save the tokenizer")
            from tokenizers import Tokenizer as HFTok

            tok = HFTok.from_file(str(d / HF_FILE))
            return HFTokenizer(tok, kind, meta.get("eot_id"), meta.get("bos_id"), meta.get("chat_template"))
        raise GptlabError(f"{d / META_FILE} has unknown tokenizer kind {kind!r} (expected one of {KINDS})")
    if (d / HF_FILE).is_file() or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file()):
        return _load_hf_dir(d)
    raise GptlabError(
        f"no tokenizer in {d}: expected {META_FILE} (written by gptlab) or a Hugging Face {HF_FILE} "
        "(or vocab.json + merges.txt)"
    )


def optional_tokenizer(directory: str | os.PathLike[str]) -> tuple[Tokenizer | None, str]:
    """The tokenizer saved in `directory`, or (None, why not) when it has none: a model directory need not
    carry one."""
    try:
        return load_tokenizer(directory), ""
    except GptlabError as e:
        return None, str(e)
