"""Hugging Face tokenizers: byte-level BPE trained by gptlab, and the tokenizer of a Hugging Face model directory
(tokenizer.json, or GPT-2 era vocab.json + merges.txt, with eos, bos and the chat template from its configs).
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
from gptlab.tokenizer.base import (
    _REPLACEMENT,
    EOT_TEXT,
    HF_FILE,
    MAX_BPE_VOCAB,
    MIN_BPE_VOCAB,
    DamagedTokenizer,
    Tokenizer,
    _as_int_list,
    checked_ids,
)
from gptlab.tokenizer.seams import CONTEXT, Continued, Seams, hf_seams

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
        chat_template_file: str | None = None,
    ):
        self.kind = kind
        self._tok = tok
        self._tok.encode_special_tokens = True  # plain-text encode: "<|endoftext|>" in user text stays text
        self._special_tok: Any = None  # a second instance for allow_special=True (the flag is not per call)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.eot_id, self.bos_id, self.chat_template = eot_id, bos_id, chat_template
        self.chat_template_file = chat_template_file
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

        if vocab_size > MAX_BPE_VOCAB:
            raise GptlabError(f"--vocab-size {vocab_size} is too large for bpe: at most {MAX_BPE_VOCAB:,}")
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

    def encode_np(self, text: str) -> np.ndarray:
        # through the batch call for its no-offsets path: `encode` tracks every token's offsets (slow, large)
        return np.asarray(self.encode_batch([text])[0], dtype=np.int64)

    @property
    def byte_level(self) -> bool:
        """GPT-2-style byte-level BPE (its decoder reads tokens as bytes). Where text may be cut is `seams`:
        with add_prefix_space it is not where other byte-level BPEs may be cut."""
        return self._byte_level

    @functools.cached_property
    def seams(self) -> Seams:
        return hf_seams(self._tok)

    @functools.cached_property
    def _context_ids(self) -> int:
        return len(self.encode_batch([CONTEXT])[0])

    def encode_chunks(self, texts: Sequence[str]) -> list[list[int]]:
        if not self.seams.prepend or not any(isinstance(t, Continued) for t in texts):
            return self.encode_batch(texts)
        # the normalizer prepends "▁" to every text, also to a chunk that continues one: encode it after a
        # context character instead, which takes the "▁", and drop the context's ids (the seam's space starts a
        # pre-token, or no token spans it: see `gptlab.tokenizer.seams`). Only after a space: a hard cut elsewhere
        # could merge the context into the chunk's first token
        k = self._context_ids
        after = [isinstance(t, Continued) and t.startswith(" ") for t in texts]
        ids = self.encode_batch([CONTEXT + t if a else t for t, a in zip(texts, after, strict=True)])
        return [x[k:] if a else x for a, x in zip(after, ids, strict=True)]

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
            return self.decode(ids, errors="replace").encode("utf-8")
        table, n = self._token_table(), self.vocab_size
        out = b"".join(table[i] if 0 <= i < n else _REPLACEMENT for i in ids)
        if self._strip_first_space and not self._byte_level and out.startswith(b" "):
            out = out[1:]
        return out

    @property
    def adds_bos(self) -> bool:
        """Whether this tokenizer's post-processor puts BOS first (Llama's does), as transformers encodes."""
        if self.bos_id is None:
            return False
        ids = self._tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_id

    def decode(self, ids: Iterable[int], *, errors: str = "strict") -> str:
        ids = checked_ids(ids, self.vocab_size, errors)
        if self._simple:
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        # the ids between those past the vocabulary decoded by `tokenizers` (its decoder joins words), each id past
        # it U+FFFD, as every other kind shows one
        n, pieces, run = self.vocab_size, [], []
        for i in ids:
            if 0 <= i < n:
                run.append(i)
                continue
            pieces += [self._tok.decode(run, skip_special_tokens=False), "\ufffd"]
            run = []
        return "".join(pieces) + self._tok.decode(run, skip_special_tokens=False)

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


def load_hf_dir(d: Path) -> HFTokenizer:
    from tokenizers import Tokenizer as HFTok

    if (d / HF_FILE).is_file():
        try:
            tok = HFTok.from_file(str(d / HF_FILE))
        except Exception as e:
            raise DamagedTokenizer(f"the tokenizer file {d / HF_FILE} is damaged (`tokenizers` cannot read it: "
                                   f"{e})") from None
    else:  # GPT-2 era HF directories: vocab.json + merges.txt of a byte-level BPE
        from tokenizers import decoders, models, pre_tokenizers

        try:
            tok = HFTok(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
        except Exception as e:
            raise DamagedTokenizer(f"the tokenizer files {d / 'vocab.json'} and merges.txt are damaged "
                                   f"(`tokenizers` cannot read them: {e})") from None
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(EOT_TEXT) is not None:
            tok.add_special_tokens([EOT_TEXT])
    cfg = read_json_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    template, template_file = _chat_template(d, cfg)
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
    return HFTokenizer(tok, "hf", eot_id, bos_id, template, template_file)


def _chat_template(d: Path, cfg: dict[str, Any]) -> tuple[str | None, str | None]:
    """The directory's chat template and the file it came from: chat_template.jinja (newer transformers save it on
    its own), else `chat_template` in tokenizer_config.json: a string, or Hugging Face's list of {name, template}
    of which gptlab takes the one named "default"."""
    jinja = d / "chat_template.jinja"
    if jinja.is_symlink() or jinja.is_file():
        if not jinja.resolve().is_relative_to(d.resolve()):  # a model directory may not make us read other files
            raise GptlabError(f"{jinja} is a link to {jinja.resolve()}, outside the model directory: refused")
        if not jinja.is_file():
            raise GptlabError(f"{jinja} is not a file")
        try:
            return jinja.read_text(encoding="utf-8"), str(jinja)
        except (OSError, UnicodeDecodeError) as e:
            raise GptlabError(f"cannot read {jinja}: {e}") from e
    where = f"{d / 'tokenizer_config.json'}: chat_template"
    template = cfg.get("chat_template")
    if template is None:
        return None, None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) for t in template):
            raise GptlabError(f"{where} is a list whose items are not all {{name, template}} objects")
        named = {t["name"]: t.get("template") for t in template}
        if "default" not in named:
            raise GptlabError(f"{where} lists templates named {', '.join(map(repr, named))} but none named "
                              "'default', the one gptlab would use")
        where, template = f"{where}[name='default']", named["default"]
    if not isinstance(template, str):
        raise GptlabError(f"{where} must be a Jinja template string, got {type(template).__name__}")
    return template, str(d / "tokenizer_config.json")
