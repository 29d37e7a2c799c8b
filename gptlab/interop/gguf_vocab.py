"""A gptlab tokenizer as GGUF's byte-level BPE vocabulary (`tokenizer.ggml.*`): tokens, merges, token types and
the name of the pre-tokenizer, the regex that splits text into words before BPE runs on each.

llama.cpp does not read a regex from the file: it knows a fixed set of splits by name (`tokenizer.ggml.pre`).
A tokenizer.json's split is matched against the ones written here by its exact regex, so a tokenizer whose
split llama.cpp does not know is refused rather than written under a name that would tokenize differently.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from gptlab.errors import GptlabError
from gptlab.tokenizer.huggingface import HFTokenizer

if TYPE_CHECKING:
    from gptlab.tokenizer.base import TextTokenizer

# llama.cpp's name for each split (its `tokenizer.ggml.pre`), keyed by the regex a tokenizer.json spells it with
_LLAMA3_WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_LLAMA3_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_TOKENIZERS = {
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+": "gpt-2",
    _LLAMA3_WORDS + r"\p{N}{1,3}" + _LLAMA3_TAIL: "llama-bpe",  # Llama 3: digits in groups of up to three
    _LLAMA3_WORDS + r"\p{N}" + _LLAMA3_TAIL: "qwen2",  # Qwen2 and Qwen3: each digit alone
}
# llama.cpp's llama-bpe also takes a word the vocabulary holds whole before any merge (Llama 3's tokenizer.json
# says "ignore_merges": true); its smaug-bpe is the same split with every word merged, as other BPEs are
IGNORES_MERGES = {"llama-bpe": "smaug-bpe"}
ADDS_BOS_BY_DEFAULT = {"llama-bpe"}  # llama.cpp's split that starts text with BOS where add_bos_token is absent


@functools.cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell their tokens."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _spell(token: bytes) -> str:
    table = byte_to_unicode()
    return "".join(table[b] for b in token)


def gguf_vocabulary(tokenizer: TextTokenizer, vocab_size: int) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, token types) of a tokenizer as byte-level BPE, padded to the model's vocab_size."""
    kind = getattr(tokenizer, "kind", None)
    if kind == "gpt2":
        tokens, merges, kinds = _tiktoken_vocabulary(tokenizer)
    elif kind in ("hf", "bpe"):  # a Hugging Face tokenizer.json (loaded, or trained by `gptlab prepare`)
        tokens, merges, kinds = _hf_vocabulary(tokenizer)
    elif kind == "char":
        tokens, merges, kinds = _char_vocabulary(tokenizer)
    else:
        raise GptlabError(f"GGUF export cannot write a {kind!r} tokenizer")
    if len(tokens) > vocab_size:
        raise GptlabError(f"the tokenizer has {len(tokens)} tokens but the model only {vocab_size} embeddings")
    types = [kinds.get(i, NORMAL) for i in range(len(tokens))]
    for i in range(len(tokens), vocab_size):  # rows the model has beyond the tokenizer (padded vocabularies)
        tokens.append(f"[PAD{i}]")
        types.append(UNUSED)
    return tokens, merges, types


def pre_tokenizer_name(tokenizer: TextTokenizer) -> str:
    """llama.cpp's name for how the tokenizer splits text (`tokenizer.ggml.pre`): GPT-2's split for tiktoken's
    GPT-2 and for characters (a character vocabulary has no merges, so any split gives the same tokens)."""
    if getattr(tokenizer, "kind", None) not in ("hf", "bpe"):
        return "gpt-2"
    pre = json.loads(tokenizer._json).get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if any(step.get("type") == "ByteLevel" and step.get("add_prefix_space") for step in steps):
        raise GptlabError("GGUF export: this tokenizer's ByteLevel pre-tokenizer puts a space before the text "
                          "(add_prefix_space), which llama.cpp's byte-level BPE never does, so it would tokenize "
                          "text differently: export --to hf instead")
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # ByteLevel's own regex is GPT-2's
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    kinds = [step.get("type") for step in steps]
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert"):
        name = PRE_TOKENIZERS.get((steps[0].get("pattern") or {}).get("Regex"))
        if name in IGNORES_MERGES and not json.loads(tokenizer._json).get("model", {}).get("ignore_merges"):
            return IGNORES_MERGES[name]
        if name is not None:
            return name
    what = "a Split regex" if kinds[:1] == ["Split"] else repr(pre.get("type") or kinds)
    raise GptlabError(f"GGUF export writes tokenizers that split text as llama.cpp's "
                      f"{', '.join(sorted(set(PRE_TOKENIZERS.values())))} pre-tokenizers do (a ByteLevel "
                      f"pre-tokenizer, or Llama 3's or Qwen2's Split regex); this one's is {what} llama.cpp does "
                      "not know: export --to hf instead")


def _tiktoken_vocabulary(tokenizer: TextTokenizer) -> tuple[list[str], list[str], dict[int, int]]:
    """GPT-2's tokens from tiktoken's ranks; each merge is recovered by running BPE on the token's bytes with
    only the ranks below its own, which leaves exactly the two parts it was merged from."""
    encoding = tokenizer._enc  # tiktoken.Encoding
    ranks: dict[bytes, int] = encoding._mergeable_ranks
    tokens = [""] * encoding.n_vocab
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        tokens[rank] = _spell(token)
        if len(token) > 1:
            left, right = _split_by_rank(ranks, token, rank)
            merges.append(f"{_spell(left)} {_spell(right)}")
    for text, i in encoding._special_tokens.items():
        tokens[i] = text
    return tokens, merges, {i: CONTROL for i in encoding._special_tokens.values()}


def _split_by_rank(ranks: dict[bytes, int], token: bytes, rank: int) -> tuple[bytes, bytes]:
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best = min(range(len(parts) - 1), key=lambda i: ranks.get(parts[i] + parts[i + 1], rank))
        if ranks.get(parts[best] + parts[best + 1], rank) >= rank:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    if len(parts) != 2:
        raise GptlabError(f"cannot recover the BPE merge of token {token!r} from tiktoken's ranks")
    return parts[0], parts[1]


def _hf_vocabulary(tokenizer: TextTokenizer) -> tuple[list[str], list[str], dict[int, int]]:
    """A tokenizer.json's byte-level BPE, once its split is one llama.cpp knows (`pre_tokenizer_name`). Added
    tokens go in as control tokens when special, else as user-defined ones: llama.cpp, like `tokenizers`, matches
    those in any text before BPE runs (as normal tokens they would be split into pieces)."""
    data = json.loads(tokenizer._json)
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise GptlabError(f"GGUF export writes BPE tokenizers; this one is {model.get('type')!r}")
    pre_tokenizer_name(tokenizer)
    vocab: dict[str, int] = dict(model["vocab"])
    kinds = {}
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    tokens = [""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, merges, kinds


# llama.cpp refuses a BPE vocabulary without merges, and `gguf` writes no empty array: a character vocabulary gets
# this one merge, which never fires (its parts are two-symbol strings, and no other merge ever forms one)
NEVER_MERGES = "ĠĠ ĠĠ"


def _char_vocabulary(tokenizer: TextTokenizer) -> tuple[list[str], list[str], dict[int, int]]:
    """Single-byte characters spelled as byte-level BPE tokens: each character its own token, nothing merged."""
    chars = tokenizer.chars
    wide = [c for c in chars if len(c.encode("utf-8")) != 1]
    if wide:
        raise GptlabError(f"GGUF export of a character tokenizer needs single-byte characters; {wide[0]!r} is not")
    return [_spell(c.encode("utf-8")) for c in chars], [NEVER_MERGES], {}


# --- import: the file's vocabulary as a `tokenizers` BPE ----------------------------------------------------------
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama.cpp's token types


def tokenizer_from_gguf(meta: Any, vocab_size: int) -> HFTokenizer:
    """The byte-level BPE a GGUF file holds (`meta`: gguf_read's typed metadata), with its special tokens, BOS rule
    and chat template; refused in one line where it is another kind of tokenizer or splits text in a way gptlab
    does not know by name."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    where = meta.path
    model = meta.get("tokenizer.ggml.model", str)
    if model != "gpt2":
        raise GptlabError(f"{where}: tokenizer.ggml.model is {model!r}; gptlab reads byte-level BPE ('gpt2') "
                          "vocabularies: load the model's Hugging Face directory instead")
    split = meta.get("tokenizer.ggml.pre", str, "gpt-2")
    regexes = {name: pattern for pattern, name in PRE_TOKENIZERS.items()}
    regexes.update({merged: regexes[name] for name, merged in IGNORES_MERGES.items()})
    regex = regexes.get(split)
    if regex is None:
        raise GptlabError(f"{where}: tokenizer.ggml.pre {split!r} is a split gptlab does not know; it reads "
                          f"{', '.join(sorted(regexes))}")
    tokens = meta.get("tokenizer.ggml.tokens", list)
    types = meta.get("tokenizer.ggml.token_type", list, [NORMAL] * len(tokens))
    if len(types) != len(tokens) or not 0 < len(tokens) <= vocab_size:
        raise GptlabError(f"{where}: tokenizer.ggml.tokens holds {len(tokens)} tokens and token_type {len(types)} "
                          f"types; both should be one per token, at most the model's {vocab_size} embeddings")
    vocab = {text: i for i, (text, kind) in enumerate(zip(tokens, types, strict=True)) if kind != UNUSED}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", list, []) if isinstance(m, str)]
    merges = [(a, b) for a, b in merges if a in vocab and b in vocab and a + b in vocab]  # others never fire
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=split in IGNORES_MERGES))
    if split == "gpt-2":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, kind in enumerate(types) if kind == CONTROL])
    tok.add_tokens([AddedToken(tokens[i], normalized=False) for i, kind in enumerate(types) if kind == USER_DEFINED])
    eos, bos = (_token_id(meta, f"tokenizer.ggml.{k}_token_id", len(tokens)) for k in ("eos", "bos"))
    # a spare row named as the end only so that llama.cpp's default (token 11) is not (export's, for a tokenizer
    # without end-of-text): no text spells it, so the tokenizer has none
    eos, bos = (None if i is not None and types[i] == UNUSED else i for i in (eos, bos))
    # a file that does not say starts text with BOS as llama.cpp then does: by the split's default
    adds_bos = bos is not None and meta.get("tokenizer.ggml.add_bos_token", bool, split in ADDS_BOS_BY_DEFAULT)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                           special_tokens=[(tokens[bos], bos)])
    template = meta.get("tokenizer.chat_template", str, None)
    return HFTokenizer(tok, "hf", eot_id=eos, bos_id=bos if adds_bos or bos != eos else None,
                       chat_template=template, chat_template_file=f"{where} (tokenizer.chat_template)")


def _token_id(meta: Any, key: str, n_tokens: int) -> int | None:
    i = meta.get(key, int, None)
    if i is not None and not 0 <= i < n_tokens:
        raise GptlabError(f"{meta.path}: {key} is {i}, outside the {n_tokens} tokens")
    return i
