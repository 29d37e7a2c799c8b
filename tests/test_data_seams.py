"""Chunked encoding equals whole-text encoding for every kind of tokenizer `prepare` accepts: where each one's
text may be cut (`gptlab.tokenizer.seams`) and how a chunk that continues a text is encoded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import corpus_text
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.data import load_split, preparation, prepare
from gptlab.data.text_stream import chunk_text
from gptlab.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from gptlab.tokenizer.seams import Continued

CORPUS = corpus_text(20_000)
SPM = ("metaspace-first", "metaspace-always", "metaspace-one-word", "prepend")
HF_KINDS = (*SPM, "byte-level", "byte-level-prefix-space")


def _train(pre: Any, vocab_size: int = 500) -> Any:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre
    alphabet = pre_tokenizers.ByteLevel.alphabet() if "ByteLevel" in type(pre).__name__ else []
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "</s>"],
                                                          initial_alphabet=alphabet))
    return tok


def _sentencepiece_like(kind: str) -> Any:
    """A BPE trained word by word (as SentencePiece's are), with byte fallback, in the tokenizer.json shapes of
    real Llama 2 / Mistral / TinyLlama files."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import pre_tokenizers

    spec = json.loads(_train(pre_tokenizers.Metaspace(prepend_scheme="first")).to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):  # byte fallback: a character the vocabulary lacks becomes its UTF-8 bytes
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    meta = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}
    if kind == "metaspace-always":
        meta["prepend_scheme"] = "always"
    elif kind == "metaspace-one-word":  # transformers' LlamaConverter with legacy=False
        meta["split"] = False
    spec["pre_tokenizer"] = meta
    if kind == "prepend":  # Llama 2's own file: no pre-tokenizer, the whole text is one word
        spec["pre_tokenizer"] = None
        spec["normalizer"] = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    return HFTok.from_str(json.dumps(spec))


def _hf(kind: str) -> HFTokenizer:
    from tokenizers import pre_tokenizers

    if kind in SPM:
        return HFTokenizer(_sentencepiece_like(kind), eot_id=1)
    return HFTokenizer(_train(pre_tokenizers.ByteLevel(add_prefix_space=kind.endswith("prefix-space"))), eot_id=1)


@pytest.fixture(scope="module")
def tokenizers(request: pytest.FixtureRequest) -> dict[str, Tokenizer]:
    toks: dict[str, Tokenizer] = {kind: _hf(kind) for kind in HF_KINDS}
    toks["char"] = CharTokenizer(set(CORPUS) | set(TEXT_ALPHABET))
    try:
        toks["gpt2"] = request.getfixturevalue("gpt2")
    except pytest.skip.Exception:  # no cached tiktoken files here: the others still run
        pass
    return toks


TEXT_ALPHABET = list("abte st.,'1  \n\n\t\r") + ["\u2581", "\xa0", "\u3000", "é", "😀"]  # "▁" too: it is text
TEXTS = st.one_of(
    st.text(alphabet=TEXT_ALPHABET, max_size=150),
    st.builds(lambda start, n: CORPUS[start : start + n], st.integers(0, len(CORPUS)), st.integers(0, 300)),
)


def test_seams_of_each_kind(tokenizers: dict[str, Tokenizer]) -> None:
    cuts = {kind: (tok.seams.cut, tok.seams.prepend, tok.seams.exact) for kind, tok in tokenizers.items()}
    assert cuts["char"] == ("any", False, True) and cuts["byte-level"] == ("newline", False, True)
    assert cuts["prepend"] == ("space", True, True)
    for kind in ("metaspace-first", "metaspace-always", "metaspace-one-word", "byte-level-prefix-space"):
        assert cuts[kind] == ("space", False, True), kind
    if "gpt2" in cuts:
        assert cuts["gpt2"] == ("newline", False, True)


def test_a_one_word_tokenizer_whose_tokens_span_spaces_is_inexact(tmp_path: Path, capsys) -> None:
    """Trained with no pre-tokenizer, BPE merges across spaces: no cut is known to be exact, and prepare says so."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, normalizers, trainers

    tok = HFTok(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"]))
    hf = HFTokenizer(tok, eot_id=0)
    assert (hf.seams.cut, hf.seams.exact) == ("space", False) and "across a space" in hf.seams.why
    hf.save(tmp_path / "tok")
    (tmp_path / "a.txt").write_text(CORPUS[:2000], encoding="utf-8")
    prepare([tmp_path / "a.txt"], tmp_path / "d", tokenizer=None, tokenizer_from=tmp_path / "tok", workers=1)
    err = capsys.readouterr().err
    assert "may differ from encoding each file whole: its vocabulary has tokens across a space" in err


@settings(max_examples=60, deadline=None)
@given(TEXTS, st.integers(1, 12), st.integers(1, 9))
def test_chunked_encoding_equals_whole(tokenizers: dict[str, Tokenizer], text: str, chunk: int, piece: int) -> None:
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for kind, tok in tokenizers.items():
        chunks = list(chunk_text(pieces, chunk, cut=tok.seams.cut, hard=False))
        assert "".join(chunks) == text
        assert [isinstance(c, Continued) for c in chunks] == [i > 0 for i in range(len(chunks))]
        assert [i for ids in tok.encode_chunks(chunks) for i in ids] == tok.encode(text), kind


@pytest.mark.parametrize("kind", HF_KINDS)
def test_encode_text_sub_chunks_a_continued_chunk_exactly(tokenizers: dict[str, Tokenizer], kind: str) -> None:
    """`_encode_text` cuts a long chunk again for one batch call: a continuing chunk stays continuing."""
    tok, text = tokenizers[kind], corpus_text(100_000)
    chunks = list(chunk_text([text], 60_000, cut=tok.seams.cut))
    assert len(chunks) == 2 and len(chunks[1]) > 1 << 15
    ids = [preparation._encode_text(tok, c, np.dtype(np.int64)) for c in chunks]
    assert np.concatenate(ids).tolist() == tok.encode(text)


@pytest.mark.parametrize("kind", ["prepend", "metaspace-first", "byte-level-prefix-space", "char"])
def test_prepare_in_small_chunks_equals_encoding_each_file_whole(tmp_path: Path, tokenizers: dict[str, Tokenizer],
                                                                 kind: str) -> None:
    tok = tokenizers[kind]
    tok.save(tmp_path / "tok")
    a, b = corpus_text(9_000), "  Second file:\n starts with spaces,\nand ends with one "
    (tmp_path / "a.txt").write_text(a, encoding="utf-8")
    (tmp_path / "b.txt").write_text(b, encoding="utf-8")
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "d", tokenizer=None,
                   tokenizer_from=tmp_path / "tok", chunk_chars=200, workers=1)
    cut = int((len(a) + len(b)) * 0.9)  # inside a: val is the rest of a, then b
    eot = [tok.eot_id] if kind != "char" else []
    loaded = load_tokenizer(tmp_path / "tok")
    assert load_split(tmp_path / "d", "train").tolist() == loaded.encode(a[:cut])
    assert load_split(tmp_path / "d", "val").tolist() == loaded.encode(a[cut:]) + eot + loaded.encode(b)
    assert meta["train_tokens"] + meta["val_tokens"] > 2_000
