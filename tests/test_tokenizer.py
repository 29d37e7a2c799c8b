"""Tokenizers: known GPT-2 ids, round trips, byte-exact decoding, save/load, Hugging Face dirs, errors."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import TINY_SHAKESPEARE, corpus_text, gpt2_bpe_files, needs_gpt2_bpe, needs_shakespeare
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.errors import GptlabError
from gptlab.tokenizer import (
    CharTokenizer,
    DamagedTokenizer,
    GPT2Tokenizer,
    HFTokenizer,
    Tokenizer,
    fingerprint,
    load_tokenizer,
    optional_tokenizer,
)

FAST = settings(max_examples=60, deadline=None)
SAMPLE = "Hello, world! Héllo wörld 😀 — 你好\n\n  tabs\tand 'quotes' 12345\r\n<|endoftext|> end"
EMOJI = "I ❤ 🦙 and 👩‍👩‍👧 (family) ok"


@pytest.fixture(scope="module")
def bpe(corpus_bpe: HFTokenizer) -> HFTokenizer:
    return corpus_bpe


@pytest.fixture(scope="module")
def char() -> CharTokenizer:
    return CharTokenizer.from_text(corpus_text())


def _roundtrip_dir(tok: Tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp(f"tok-{tok.kind}")
    tok.save(d)
    return load_tokenizer(d)


# --- gpt2 -------------------------------------------------------------------------------------------------------


def test_gpt2_known_ids(gpt2: GPT2Tokenizer) -> None:
    assert (gpt2.kind, gpt2.vocab_size, gpt2.eot_id, gpt2.chat_template) == ("gpt2", 50257, 50256, None)
    assert gpt2.encode("hello world") == [31373, 995]
    assert gpt2.decode([31373, 995]) == "hello world"


@needs_shakespeare
def test_gpt2_tiny_shakespeare_token_count(gpt2: GPT2Tokenizer) -> None:
    assert len(gpt2.encode(TINY_SHAKESPEARE.read_text(encoding="utf-8"))) == 338_025


def test_endoftext_text_is_plain_text_unless_allowed(gpt2: GPT2Tokenizer, bpe: HFTokenizer) -> None:
    for tok in (gpt2, bpe):
        ids = tok.encode("a<|endoftext|>b")
        assert tok.eot_id not in ids and tok.encode_np("a<|endoftext|>b").tolist() == ids
        assert tok.decode(ids) == "a<|endoftext|>b"
        assert tok.encode("<|endoftext|>", allow_special=True) == [tok.eot_id]
        assert tok.decode([tok.eot_id]) == "<|endoftext|>"  # decode keeps special tokens


@FAST
@given(st.text())
def test_gpt2_roundtrip(gpt2: GPT2Tokenizer, s: str) -> None:
    assert gpt2.decode(gpt2.encode(s)) == s
    assert gpt2.encode_np(s).tolist() == gpt2.encode(s)
    assert gpt2.decode_bytes(gpt2.encode(s)) == s.encode("utf-8")


def test_gpt2_offline_error_is_one_helpful_line(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import tiktoken.load
    import tiktoken.registry

    from gptlab.tokenizer import base as tk

    def offline(url: str) -> bytes:
        raise ConnectionError(f"cannot reach {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setattr(tiktoken.load, "read_file", offline)
    tk._gpt2_encoding.cache_clear()
    try:
        with pytest.raises(GptlabError) as e:
            GPT2Tokenizer()
    finally:
        tk._gpt2_encoding.cache_clear()  # the next test loads the real files again
    msg = str(e.value)
    assert "\n" not in msg and "TIKTOKEN_CACHE_DIR" in msg and "internet" in msg


# --- char -------------------------------------------------------------------------------------------------------


def test_char_vocabulary_is_sorted_set(char: CharTokenizer) -> None:
    assert char.vocab_size == len(set(corpus_text())) and char.eot_id is None and char.kind == "char"
    assert char.chars == sorted(char.chars)
    assert char.encode("\n") == [0] and char.encode(" ") == [1]
    assert char.decode(char.encode("First Citizen:")) == "First Citizen:"


@FAST
@given(st.data())
def test_char_roundtrip(data: st.DataObject) -> None:
    vocab = data.draw(st.text(min_size=1, max_size=30))
    tok = CharTokenizer.from_text(vocab)
    s = data.draw(st.text(alphabet=sorted(set(vocab))))
    assert tok.decode(tok.encode(s)) == s
    assert tok.encode_np(s).tolist() == tok.encode(s)
    assert tok.decode_bytes(tok.encode(s)) == s.encode("utf-8")


@pytest.mark.parametrize("text", ["hé", "a much longer text with an é in it, past the short-prompt path"])
def test_char_unknown_character_names_it(text: str) -> None:
    tok = CharTokenizer.from_text("abcdefghijklmnopqrstuvwxyz ,-")
    with pytest.raises(GptlabError, match="'é'"):
        tok.encode(text)


def test_char_from_chunks_equals_from_text() -> None:
    text = "the quick brown fox\njumps 😀"
    assert CharTokenizer.from_text([text[:7], text[7:]]).chars == CharTokenizer.from_text(text).chars


# --- bpe --------------------------------------------------------------------------------------------------------


def test_bpe_trains_to_requested_size(bpe: HFTokenizer) -> None:
    assert (bpe.kind, bpe.vocab_size, bpe.eot_id) == ("bpe", 600, 0)
    assert len(bpe.encode("First Citizen:")) < len("First Citizen:")  # merges were learned


def test_bpe_vocab_too_small() -> None:
    with pytest.raises(GptlabError, match="at least 257"):
        HFTokenizer.train(["some text"], vocab_size=200)


@FAST
@given(st.text())
def test_bpe_roundtrip(bpe: HFTokenizer, s: str) -> None:
    ids = bpe.encode(s)
    assert bpe.decode(ids) == s
    assert bpe.decode_bytes(ids) == s.encode("utf-8")


# --- all kinds --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "bpe"])
def test_decode_bytes_keeps_partial_characters(name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(name)
    ids = tok.encode(EMOJI)
    pieces = [tok.decode_bytes([i]) for i in ids]
    assert b"".join(pieces) == EMOJI.encode("utf-8")

    def valid(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    assert not all(valid(p) for p in pieces)  # some token holds part of a character: bytes are needed


@pytest.mark.parametrize("name", ["gpt2", "bpe", "char"])
def test_save_load_roundtrip(name: str, request: pytest.FixtureRequest, tmp_path_factory) -> None:
    tok = request.getfixturevalue(name)
    again = _roundtrip_dir(tok, tmp_path_factory)
    assert type(again) is type(tok)
    assert (again.kind, again.vocab_size, again.eot_id, again.chat_template) == (
        tok.kind,
        tok.vocab_size,
        tok.eot_id,
        tok.chat_template,
    )
    text = corpus_text(20_000)
    assert again.encode(text) == tok.encode(text)
    if name != "char":
        assert again.encode(SAMPLE) == tok.encode(SAMPLE)


@pytest.mark.parametrize("name", ["gpt2", "bpe", "char"])
def test_encode_batch_matches_encode(name: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(name)
    texts = ["First Citizen:", "", "Before we proceed any further, hear me speak.\n", "All:\nSpeak, speak."]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


@pytest.mark.parametrize("name", ["gpt2", "bpe", "char"])
def test_ids_outside_the_vocabulary_raise_unless_replaced(name: str, request: pytest.FixtureRequest) -> None:
    """decode refuses an id the tokenizer lacks (a silent U+FFFD hides bugs); a model whose vocabulary is padded
    past the tokenizer's can emit such ids, so errors="replace" and the byte-level decode_bytes keep U+FFFD."""
    tok = request.getfixturevalue(name)
    for bad in (tok.vocab_size, tok.vocab_size + 3, -1):
        ids = tok.encode("To be") + [bad]
        with pytest.raises(ValueError, match=f"token id {bad} is outside"):
            tok.decode(ids)
        assert tok.decode(ids, errors="replace") == "To be\ufffd"
        assert tok.decode_bytes(ids) == "To be\ufffd".encode()


@pytest.fixture(scope="module")
def wordpiece() -> HFTokenizer:
    """A tokenizer whose decoder is not byte- or piece-wise (WordPiece's joins words with spaces): decoded by
    `tokenizers` itself."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTok(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([corpus_text(5000)], trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[UNK]"],
                                                                          show_progress=False))
    return HFTokenizer(tok)


def test_wordpiece_ids_outside_the_vocabulary_are_replaced_and_stream(wordpiece: HFTokenizer) -> None:
    """As every other kind: errors="replace" shows U+FFFD for an id past the vocabulary (it used to vanish), and
    decode_bytes, which streaming calls per token, keeps it (it used to raise)."""
    from gptlab.generation.detokenize import TextState

    tok, n = wordpiece, wordpiece.vocab_size
    first, second = tok.encode("To be"), tok.encode("or not")
    ids = [*first, n + 3, *second, n]
    expected = tok._tok.decode(first) + "\ufffd" + tok._tok.decode(second) + "\ufffd"
    with pytest.raises(ValueError, match=f"token id {n + 3} is outside"):
        tok.decode(ids)
    assert tok.decode(ids, errors="replace") == expected
    assert tok.decode_bytes(ids) == expected.encode()
    state = TextState(tok)
    streamed = ""
    for i in ids:
        state.push(i)
        streamed += state.pop_delta()
    state.close()
    assert streamed + state.pop_delta(final=True) == expected


def test_bpe_saved_file_is_plain_hugging_face(bpe: HFTokenizer, tmp_path) -> None:
    from tokenizers import Tokenizer as HFTok

    bpe.save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer_meta.json").read_text())
    assert meta["kind"] == "bpe" and meta["eot_id"] == 0
    plain = HFTok.from_file(str(tmp_path / "tokenizer.json"))
    assert plain.encode("First Citizen:").ids == bpe.encode("First Citizen:")


@pytest.mark.parametrize(("field", "value", "why"), [
    ("chat_template", ["not", "text"], "chat_template must be text"),
    ("chat_template", 7, "chat_template must be text"),
    ("eot_id", "0", "eot_id must be a token id"), ("bos_id", -1, "bos_id must be a token id"),
    ("eot_id", True, "eot_id must be a token id"),
])
def test_a_saved_tokenizer_with_mistyped_fields_is_named_damaged(bpe: HFTokenizer, tmp_path, field, value,
                                                                 why) -> None:
    """A chat template that is not text is not silently replaced by the built-in one: the file is named."""
    bpe.save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer_meta.json").read_text())
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps({**meta, field: value}))
    with pytest.raises(DamagedTokenizer, match=f"tokenizer_meta.json is damaged \\({why}"):
        load_tokenizer(tmp_path)


# --- Hugging Face model directories -----------------------------------------------------------------------------


def _gpt2_hf_dir(tmp_path, with_json: bool):
    """A Hugging Face GPT-2 style directory built from the original files (vocab.json = encoder.json)."""
    d = tmp_path / ("hf-json" if with_json else "hf-vocab")
    d.mkdir()
    encoder, merges = gpt2_bpe_files()
    shutil.copy(encoder, d / "vocab.json")
    shutil.copy(merges, d / "merges.txt")
    cfg = {
        "eos_token": {"content": "<|endoftext|>"},
        "bos_token": "<|endoftext|>",
        "chat_template": "{{ x }}",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    if with_json:  # turn it into a tokenizer.json directory, as modern HF repos ship
        tok = load_tokenizer(d)
        assert isinstance(tok, HFTokenizer)
        (d / "tokenizer.json").write_text(tok._json)
        (d / "vocab.json").unlink()
        (d / "merges.txt").unlink()
    return d


@pytest.mark.parametrize("with_json", [False, True])
def test_hf_directory_matches_tiktoken(with_json: bool, gpt2: GPT2Tokenizer, tmp_path) -> None:
    tok = load_tokenizer(_gpt2_hf_dir(tmp_path, with_json))
    assert (tok.kind, tok.vocab_size, tok.eot_id, tok.bos_id, tok.chat_template) == (
        "hf",
        50257,
        50256,
        50256,
        "{{ x }}",
    )
    text = corpus_text(5_000) + SAMPLE + EMOJI
    assert tok.encode(text) == gpt2.encode(text)
    ids = gpt2.encode(EMOJI)
    assert [tok.decode_bytes([i]) for i in ids] == [gpt2.decode_bytes([i]) for i in ids]
    assert tok.encode("<|endoftext|>", allow_special=True) == [50256]
    assert tok.encode("<|endoftext|>") != [50256]
    again = _roundtrip_dir(tok, _Factory(tmp_path))
    assert (again.kind, again.eot_id, again.bos_id, again.chat_template) == ("hf", 50256, 50256, "{{ x }}")
    assert again.encode(text) == gpt2.encode(text)


class _Factory:
    """Minimal stand-in for tmp_path_factory inside a function-scoped test."""

    def __init__(self, root) -> None:
        self.root, self.n = root, 0

    def mktemp(self, name: str):
        self.n += 1
        d = self.root / f"{name}{self.n}"
        d.mkdir()
        return d


@needs_gpt2_bpe
def test_hf_chat_template_file_and_eos_from_generation_config(tmp_path) -> None:
    d = _gpt2_hf_dir(tmp_path, with_json=True)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": "T"}]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [50256, 1]}))
    tok = load_tokenizer(d)
    assert tok.chat_template == "T" and tok.eot_id == 50256 and tok.bos_id is None
    (d / "chat_template.jinja").write_text("J")
    assert load_tokenizer(d / "tokenizer.json").chat_template == "J"  # a path to the file works too


def test_sentencepiece_style_byte_fallback(tmp_path) -> None:
    """Llama-style tokenizer.json (Metaspace + byte fallback): decode_bytes gives raw bytes per token."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["\u2581", "a", "b", "\u2581a", "\u2581b", "\u2581ab"]:
        vocab[piece] = len(vocab)
    merges = [("\u2581", "a"), ("\u2581", "b"), ("\u2581a", "b")]
    tok = HFTok(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    t = load_tokenizer(tmp_path)
    assert (t.eot_id, t.bos_id) == (2, 1)
    ids = t.encode("ab b é")
    assert t.decode(ids) == tok.decode(ids) == "ab b é"
    assert t.decode_bytes(ids) == "ab b é".encode()
    assert [t.decode_bytes([i]) for i in ids][-2:] == [b"\xc3", b"\xa9"]  # é as two byte-fallback tokens


def test_load_tokenizer_errors(tmp_path) -> None:
    with pytest.raises(GptlabError, match="no tokenizer in"):
        load_tokenizer(tmp_path)
    with pytest.raises(GptlabError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "tokenizer_meta.json").write_text(json.dumps({"kind": "sentencepiece"}))
    with pytest.raises(GptlabError, match="unknown tokenizer kind"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_meta.json").write_text("{not json")
    with pytest.raises(DamagedTokenizer, match="tokenizer_meta.json is damaged"):
        load_tokenizer(tmp_path)
    with pytest.raises(DamagedTokenizer):  # damaged is not "none": optional_tokenizer says so too
        optional_tokenizer(tmp_path)


# --- fingerprints -----------------------------------------------------------------------------------------------


@needs_gpt2_bpe
@pytest.mark.parametrize("with_json", [False, True])
def test_fingerprint_is_what_ids_mean_not_the_kind(tmp_path, gpt2: GPT2Tokenizer, char: CharTokenizer,
                                                   bpe: HFTokenizer, with_json: bool) -> None:
    hf = load_tokenizer(_gpt2_hf_dir(tmp_path, with_json))
    assert hf.kind == "hf" and fingerprint(hf) == fingerprint(gpt2)  # GPT-2 data fine-tunes a HF GPT-2
    assert len({fingerprint(gpt2), fingerprint(char), fingerprint(bpe)}) == 3
    assert fingerprint(char) == fingerprint(CharTokenizer(char.chars))
    assert fingerprint(char) != fingerprint(CharTokenizer(char.chars[1:] + ["\u2603"]))  # one symbol differs


def test_every_tokenizer_is_a_text_tokenizer(bpe: HFTokenizer) -> None:
    """The Protocol the rest of gptlab is typed against: gptlab's tokenizers and the tests' duck-typed one."""
    from helpers import ByteTokenizer

    from gptlab.tokenizer import TextTokenizer

    for tok in (CharTokenizer.from_text("abc"), bpe, ByteTokenizer()):
        assert isinstance(tok, TextTokenizer)
    assert not isinstance(object(), TextTokenizer)
