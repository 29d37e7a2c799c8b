"""Where a tokenizer's input may be cut so that encoding the pieces one by one gives the ids of the whole text.

`gptlab prepare` encodes long text in chunks (`gptlab.data.text_stream.chunk_text`), never holding a whole file;
each tokenizer's `Seams` says where those cuts are exact:

* ``"any"`` -- char: every character is its own id.
* ``"newline"`` -- right after a ``"\\n"`` between two non-whitespace characters: GPT-2 / cl100k / Llama-3 style
  regex pre-tokenizers (and whitespace splitters) always end a pre-token there, nothing before it depends on what
  follows, and the next chunk's start is not treated as the start of a text.
* ``"space"`` -- right before a ``" "`` that follows a character other than whitespace and ``"▁"``: for
  tokenizers that treat the start of a text specially (SentencePiece-style Metaspace with prepend_scheme
  "first"/"always", a ``Prepend("▁")`` normalizer, byte-level with add_prefix_space). A chunk that begins with a
  space gets no "▁"/space prepended (Metaspace and ByteLevel only prepend to text that does not already begin
  with one), and a space begins a pre-token (Metaspace splits before each "▁", the GPT-2 regex before each space
  after a non-space). A ``Prepend("▁")`` normalizer prepends regardless, so a chunk that continues a text is
  encoded after a one-character context whose tokens are dropped (`Seams.prepend`).

With no pre-tokenizer (Llama 2's ``Sequence[Prepend("▁"), Replace(" ", "▁")]`` normalizer; Metaspace with
split=False) the model sees the whole text as one word, and a cut is exact only because no BPE token can span
it: `one_word_problem` checks the vocabulary has no token with "▁" after another character (SentencePiece BPE
vocabularies have none). BPE's merges then never cross such a "▁", and BPE on a word that the final tokens split
at a point equals BPE on the two sides (each side's merges happen in the same order alone).

Anything else (a Strip normalizer, a one-word tokenizer whose vocabulary spans spaces, a model other than BPE)
is marked inexact: prepare still cuts at spaces, and says that ids at chunk seams may differ.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

Cut = Literal["any", "newline", "space"]
CONTEXT = "a"  # encoded before a continuing chunk when the normalizer prepends "▁" (its tokens are dropped)
_LOCAL_NORMALIZERS = {"NFC", "NFKC", "NFD", "NFKD", "Lowercase"}  # per character: no effect across a space


class Continued(str):
    """A chunk of text that continues the text before it (cut at a seam), not the start of a text."""

    __slots__ = ()


@dataclass(frozen=True)
class Seams:
    """Where `chunk_text` may cut for this tokenizer (see the module docstring)."""

    cut: Cut = "newline"
    prepend: bool = False  # a normalizer prepends "▁" to every text: continuing chunks need the context trick
    exact: bool = True  # False: best effort, ids at seams may differ from encoding the whole
    why: str = ""  # what makes it inexact


CHAR = Seams("any")
REGEX = Seams("newline")


def _steps(component: Any, key: str) -> list[dict[str, Any]]:
    """A normalizer or pre-tokenizer of `tokenizers` as its flattened list of JSON steps."""
    if component is None:
        return []
    node = json.loads(component.__getstate__())

    def flat(n: Any) -> list[dict[str, Any]]:
        if not isinstance(n, dict):
            return []
        if n.get("type") == "Sequence":
            return [s for c in n.get(key, []) for s in flat(c)]
        return [n]

    return flat(node)


def hf_seams(tok: Any) -> Seams:
    """The seams of a `tokenizers.Tokenizer`, from its normalizer, pre-tokenizer and model."""
    norm = _steps(tok.normalizer, "normalizers")
    pre = _steps(tok.pre_tokenizer, "pretokenizers")
    types = {s.get("type") for s in norm}
    if "Strip" in types:  # strips each chunk's ends, not just the text's
        return Seams("space", exact=False, why="its Strip normalizer strips each chunk's ends")
    prepend = "Prepend" in types
    metaspace = [s for s in pre if s.get("type") == "Metaspace"]
    prefix_space = any(s.get("type") == "ByteLevel" and s.get("add_prefix_space") for s in pre)
    if pre and not all(s.get("type") == "Metaspace" and s.get("split") is False for s in pre):
        # pre-tokenizers that split the text: a newline ends a pre-token unless Metaspace keeps it inside one
        cut: Cut = "space" if metaspace or prefix_space or prepend else "newline"
        return Seams(cut, prepend)
    space = metaspace[0].get("replacement", "\u2581") if metaspace else " "
    for s in norm:
        if s.get("type") == "Replace" and s.get("pattern") == {"String": " "}:
            space = s.get("content", " ")
    why = one_word_problem(tok.model, norm, space, lambda: tok.get_vocab(with_added_tokens=False))
    return Seams("space", prepend, exact=why is None, why=why or "")


def one_word_problem(model: Any, norm: list[dict[str, Any]], space: str,
                     vocab: Callable[[], Iterable[str]]) -> str | None:
    """Why cutting before a space is not exact for a tokenizer that sees the whole text as one word (None: it is)."""
    if type(model).__name__ != "BPE":
        return f"its {type(model).__name__} model sees the whole text as one word"
    if model.dropout or model.continuing_subword_prefix or model.end_of_word_suffix:
        return "its BPE has dropout or word-position affixes"
    if getattr(model, "ignore_merges", False):  # a chunk that is a vocabulary token skips the merges
        return "its BPE ignores merges for whole-word tokens"
    for s in norm:
        kind = s.get("type")
        if kind == "Prepend" and s.get("prepend") != space or kind == "Replace" and s.get("pattern") != {
                "String": " "} or kind not in _LOCAL_NORMALIZERS | {"Prepend", "Replace"}:
            return f"its normalizer step {kind} may act across a chunk seam"
    tokens = set(vocab())
    if space not in tokens:
        return f"its vocabulary has no {space!r} token"
    for t in tokens:
        i = t.find(space, 1)
        while i > 0:
            if t[i - 1] != space:  # a token spanning "x▁": merges may cross the seam
                return f"its vocabulary has tokens across a space ({t!r})"
            i = t.find(space, i + 1)
    return None
