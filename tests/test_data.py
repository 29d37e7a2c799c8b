"""`gptlab prepare` and the data readers: splits, token counts, streaming/chunking, atomic output, errors."""

from __future__ import annotations

import json
import shutil
import urllib.error
from pathlib import Path

import numpy as np
import pytest
from helpers import TINY_SHAKESPEARE, corpus_text, needs_shakespeare, one_line_error
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.cli import main
from gptlab.data import check_split_fits, corpora, load_split, preparation, prepare, read_meta
from gptlab.data.corpora import SHAKESPEARE_SHA256
from gptlab.data.text_stream import chunk_text, iter_file_text, resolve_inputs
from gptlab.errors import GptlabError
from gptlab.tokenizer import CharTokenizer, GPT2Tokenizer, HFTokenizer, load_tokenizer

CORPUS = corpus_text(200_000)  # the committed test corpus, extended
TEXT_A = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
TEXT_B = "Second Citizen:\nOne word, good citizens.\n\tIndented 😀 line\nend"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["prepare", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


# --- tiny Shakespeare: the reference figures (the real file, from shared/data) -----------------------------------


@needs_shakespeare
def test_char_shakespeare_matches_nanogpt(tmp_path: Path, capsys) -> None:
    rc, out, _ = cli(capsys, str(TINY_SHAKESPEARE), "--tokenizer", "char", "--out", str(tmp_path / "d"))
    assert rc == 0 and "1,003,854" in out
    meta = read_meta(tmp_path / "d")
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"], meta["dtype"]) == (
        "char",
        65,
        None,
        "uint16",
    )
    assert (meta["train_tokens"], meta["val_tokens"], meta["val_fraction"]) == (1_003_854, 111_540, 0.1)
    assert meta["sources"] == [
        {"path": str(TINY_SHAKESPEARE), "bytes": 1_115_394, "sha256": SHAKESPEARE_SHA256, "chars": 1_115_394}
    ]
    tok = load_tokenizer(tmp_path / "d")
    train, val = load_split(tmp_path / "d", "train"), load_split(tmp_path / "d", "val")
    assert train.dtype == np.dtype("<u2") and len(train) == 1_003_854
    shakespeare = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    assert tok.decode(train) == shakespeare[:1_003_854] and tok.decode(val) == shakespeare[1_003_854:]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        ".gptlab",
        "meta.json",
        "tokenizer_meta.json",
        "train.bin",
        "val.bin",
    ]


@needs_shakespeare
def test_gpt2_shakespeare_counts_and_chunking_invariance(tmp_path: Path, gpt2: GPT2Tokenizer) -> None:
    shakespeare = TINY_SHAKESPEARE.read_text(encoding="utf-8")
    meta = prepare([TINY_SHAKESPEARE], tmp_path / "big", tokenizer="gpt2")
    # the 90% cut splits a word, yet the total equals encoding the whole text (338,025)
    assert (meta["train_tokens"], meta["val_tokens"], meta["eot_id"]) == (301_966, 36_059, 50256)
    train = load_split(tmp_path / "big", "train")
    assert train[:8].tolist() == gpt2.encode(shakespeare[:1_003_854])[:8]
    assert np.array_equal(train, gpt2.encode(shakespeare[:1_003_854]))
    # 4,000-character chunks (~280 cuts) give byte-identical files
    prepare([TINY_SHAKESPEARE], tmp_path / "small", tokenizer="gpt2", chunk_chars=4000)
    for split in ("train", "val"):
        assert (tmp_path / "big" / f"{split}.bin").read_bytes() == (tmp_path / "small" / f"{split}.bin").read_bytes()


# --- chunking ---------------------------------------------------------------------------------------------------

WS_HEAVY = st.text(
    alphabet=st.sampled_from(list("ab.'1 \n\n\t\r") + ["\x0b", "\x1c", "\x85", "\xa0", "\u2028", "\u3000", "😀", "é"]),
    max_size=120,
)


@settings(max_examples=150, deadline=None)
@given(WS_HEAVY, st.integers(1, 12), st.integers(1, 9))
def test_chunked_encoding_equals_whole(gpt2, corpus_bpe, text: str, chunk: int, piece: int) -> None:
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    chunks = list(chunk_text(pieces, chunk, hard=False))
    assert "".join(chunks) == text
    for tok in (gpt2, corpus_bpe):
        assert [i for c in chunks for i in tok.encode(c)] == tok.encode(text)


def test_chunk_sizes_and_fallbacks() -> None:
    text = ("word " * 49 + "word\n") * 20
    chunks = list(chunk_text([text], 100))
    assert "".join(chunks) == text and all(c.endswith("\n") for c in chunks[:-1])  # cut after newlines
    no_newline = "word " * 500
    chunks = list(chunk_text([no_newline], 100))
    assert "".join(chunks) == no_newline and all(c[-1] != " " and len(c) >= 100 for c in chunks[:-1])
    solid = "x" * 1000
    assert [len(c) for c in chunk_text([solid], 100)] == [100] * 7 + [300]  # hard cuts bound memory
    assert list(chunk_text([solid], 100, hard=False)) == [solid]
    assert [len(c) for c in chunk_text(["abcdefg"], 3, cut="any")] == [3, 3, 1]


@pytest.mark.parametrize("tokenizer", ["gpt2", "bpe", "char"])
def test_process_pool_gives_same_files(tmp_path: Path, monkeypatch, request, tokenizer: str) -> None:
    if tokenizer == "gpt2":
        request.getfixturevalue("gpt2")  # skips where tiktoken's gpt2 files are not cached
    (tmp_path / "a.txt").write_text(CORPUS[:30_000])
    (tmp_path / "b.txt").write_text(CORPUS[30_000:50_000])
    kw = dict(tokenizer=tokenizer, vocab_size=300 if tokenizer == "bpe" else None, chunk_chars=3000)
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "one", workers=1, **kw)
    if tokenizer != "gpt2":  # spawning workers costs ~2 s each (they import gptlab): one kind is enough
        return
    monkeypatch.setattr(preparation, "PARALLEL_MIN_CHARS", 0)
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "pool", workers=2, **kw)
    for split in ("train", "val"):
        assert (tmp_path / "one" / f"{split}.bin").read_bytes() == (tmp_path / "pool" / f"{split}.bin").read_bytes()


# --- several inputs ---------------------------------------------------------------------------------------------


def test_documents_are_separated_by_eot_and_split_by_characters(tmp_path: Path, gpt2: GPT2Tokenizer) -> None:
    (tmp_path / "a.txt").write_text(TEXT_A)
    (tmp_path / "b.txt").write_text(TEXT_B)
    total = len(TEXT_A) + len(TEXT_B)
    meta = prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "d", tokenizer="gpt2", val_fraction=0.2)
    cut = int(total * 0.8) - len(TEXT_A)
    assert cut > 0  # the split falls inside the second document
    assert load_split(tmp_path / "d", "train").tolist() == gpt2.encode(TEXT_A) + [50256] + gpt2.encode(TEXT_B[:cut])
    assert load_split(tmp_path / "d", "val").tolist() == gpt2.encode(TEXT_B[cut:])
    assert meta["separator"] == "eot" and [s["chars"] for s in meta["sources"]] == [len(TEXT_A), len(TEXT_B)]


def test_eot_goes_with_the_document_it_ends(tmp_path: Path, gpt2: GPT2Tokenizer) -> None:
    (tmp_path / "a.txt").write_text("a" * 10)
    (tmp_path / "b.txt").write_text("b" * 10)
    prepare([tmp_path / "a.txt", tmp_path / "b.txt"], tmp_path / "d", tokenizer="gpt2", val_fraction=0.5)
    assert load_split(tmp_path / "d", "train").tolist() == gpt2.encode("a" * 10) + [50256]
    assert load_split(tmp_path / "d", "val").tolist() == gpt2.encode("b" * 10)


def test_directories_expand_to_sorted_txt_files_and_char_concatenates(tmp_path: Path) -> None:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "b.txt").write_text("bbbb")
    (root / "sub" / "c.txt").write_text("cccc")
    (root / "a.txt").write_text("aaaa")
    (root / "empty.txt").write_text("")
    (root / "notes.md").write_text("ignored")
    assert [p.relative_to(root).as_posix() for p in resolve_inputs([root])] == [
        "a.txt",
        "b.txt",
        "empty.txt",
        "sub/c.txt",
    ]
    meta = prepare([root], tmp_path / "d", tokenizer="char", val_fraction=0.25)
    tok = load_tokenizer(tmp_path / "d")
    assert tok.decode(load_split(tmp_path / "d", "train")) == "aaaabbbbc"  # no separator for char
    assert tok.decode(load_split(tmp_path / "d", "val")) == "ccc"
    assert meta["separator"] == "none" and len(meta["sources"]) == 4


def test_bpe_prepare_trains_on_train_split(tmp_path: Path, capsys) -> None:
    text = CORPUS[:200_000]
    (tmp_path / "in.txt").write_text(text)
    out = tmp_path / "d"
    rc, _, _ = cli(capsys, str(tmp_path / "in.txt"), "--tokenizer", "bpe", "--vocab-size", "512", "--out", str(out))
    assert rc == 0
    meta = read_meta(out)
    assert (meta["tokenizer"], meta["vocab_size"], meta["eot_id"]) == ("bpe", 512, 0)
    assert (out / "tokenizer.json").is_file()
    tok = load_tokenizer(out)
    train, val = load_split(out, "train"), load_split(out, "val")
    assert tok.decode(train) == text[:180_000] and tok.decode(val) == text[180_000:]
    assert meta["train_tokens"] + meta["val_tokens"] < len(text) / 1.8  # it compresses
    # trained on the train split only: the same tokenizer as training on that text directly
    assert tok.encode(text) == HFTokenizer.train([text[:180_000]], 512).encode(text)


def test_tokenizer_from_and_uint32(tmp_path: Path) -> None:
    """Reuse a Hugging Face tokenizer; a vocabulary over 65,536 is stored as uint32."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i + 1 for i in range(70_000)}}
    hf = HFTok(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "hf").mkdir()
    hf.save(str(tmp_path / "hf" / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("w1 w69999 w65536 w7\nw3 w4 w5 w6 w8 w9 w10")
    meta = prepare([tmp_path / "in.txt"], tmp_path / "d", tokenizer_from=tmp_path / "hf", val_fraction=0.3)
    assert (meta["tokenizer"], meta["dtype"], meta["vocab_size"]) == ("hf", "uint32", 70_001)
    train = load_split(tmp_path / "d", "train")
    assert train.dtype == np.dtype("<u4") and train[:3].tolist() == [2, 70_000, 65_537]


def test_tokenizer_from_hf_byte_level_bpe_equals_its_own_encode(tmp_path: Path, corpus_bpe) -> None:
    """A Hugging Face directory's byte-level BPE encodes 1 MiB chunks as ~16k-character pieces in one batch call:
    the ids of `tokenizers` encoding each split whole."""
    from tokenizers import Tokenizer as HFTok

    (tmp_path / "hf").mkdir()
    corpus_bpe._tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    reference = HFTok.from_file(str(tmp_path / "hf" / "tokenizer.json"))
    text = corpus_text(300_000)
    (tmp_path / "in.txt").write_text(text, encoding="utf-8")
    meta = prepare([tmp_path / "in.txt"], tmp_path / "d", tokenizer=None, tokenizer_from=tmp_path / "hf",
                   workers=1)
    assert meta["tokenizer"] == "hf" and load_tokenizer(tmp_path / "hf").byte_level
    cut = int(len(text) * 0.9)
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        assert load_split(tmp_path / "d", split).tolist() == reference.encode(part, add_special_tokens=False).ids


def test_tokenizer_from_char_dir_rejects_unknown_characters(tmp_path: Path, capsys) -> None:
    (tmp_path / "a.txt").write_text("abc" * 10)
    (tmp_path / "b.txt").write_text("abc" * 10 + "xyz")
    prepare([tmp_path / "a.txt"], tmp_path / "d1", tokenizer="char")
    rc, _, err = cli(
        capsys,
        str(tmp_path / "b.txt"),
        "--tokenizer-from",
        str(tmp_path / "d1"),
        "--out",
        str(tmp_path / "d2"),
    )
    assert "'x', 'y', 'z'" in one_line_error(rc, err)


# --- tiny Shakespeare download / cache --------------------------------------------------------------------------


@pytest.fixture
def stand_in(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Path:
    """The test corpus standing in for tiny Shakespeare: corpora checks its size and sha256 instead."""
    import hashlib

    path = tmp_path_factory.mktemp("stand_in") / "corpus.txt"
    path.write_text(CORPUS[:5000], encoding="utf-8")
    data = path.read_bytes()
    monkeypatch.setattr(corpora, "SHAKESPEARE_BYTES", len(data))
    monkeypatch.setattr(corpora, "SHAKESPEARE_SHA256", hashlib.sha256(data).hexdigest())
    return path


def test_shakespeare_name_uses_the_cache_without_network(tmp_path: Path, monkeypatch, stand_in: Path) -> None:
    shutil.copy(stand_in, tmp_path / "tinyshakespeare.txt")
    monkeypatch.setenv("GPTLAB_DATA_DIR", str(tmp_path))
    monkeypatch.chdir(tmp_path)  # no file called "shakespeare" here

    def no_network(url: str, dest: Path) -> None:
        raise AssertionError("must not download")

    monkeypatch.setattr(corpora, "_download", no_network)
    assert resolve_inputs(["shakespeare"]) == [tmp_path / "tinyshakespeare.txt"]


def test_shakespeare_bad_cached_copy_is_downloaded_again_atomically(tmp_path: Path, monkeypatch,
                                                                    stand_in: Path) -> None:
    (tmp_path / "tinyshakespeare.txt").write_text("truncated")
    monkeypatch.setenv("GPTLAB_DATA_DIR", str(tmp_path))
    calls = []

    def fake_download(url: str, dest: Path) -> None:
        calls.append(url)
        assert dest.parent == tmp_path and dest.name != "tinyshakespeare.txt"  # a temp name, renamed after
        shutil.copy(stand_in, dest)

    monkeypatch.setattr(corpora, "_download", fake_download)
    path = corpora.fetch_shakespeare()
    assert calls == [corpora.SHAKESPEARE_URL] and path.read_bytes() == stand_in.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tinyshakespeare.txt"]


def test_shakespeare_offline_is_a_one_line_error(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("GPTLAB_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)

    def offline(url: str, dest: Path) -> None:
        dest.write_bytes(b"partial")
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(corpora, "_download", offline)
    rc, _, err = cli(capsys, "shakespeare", "--tokenizer", "char", "--out", str(tmp_path / "d"))
    assert err.startswith("downloading tiny Shakespeare to ")
    line = one_line_error(rc, err, notes=1)
    assert "gptlab prepare path/to/input.txt" in line
    # README's other offline way: a folder holding the file, named by GPTLAB_DATA_DIR
    assert f"put tinyshakespeare.txt in {tmp_path / 'cache'} (GPTLAB_DATA_DIR names another folder)" in line, line
    assert list((tmp_path / "cache").iterdir()) == []  # no partial file left behind


def test_shakespeare_corrupt_download_is_rejected(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GPTLAB_DATA_DIR", str(tmp_path))
    monkeypatch.setattr(corpora, "_download", lambda url, dest: dest.write_text("<html>rate limited</html>"))
    with pytest.raises(GptlabError, match="sha256"):
        corpora.fetch_shakespeare()
    assert list(tmp_path.iterdir()) == []


# --- user errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "setup, args, expected",
    [
        (None, ["missing.txt", "--tokenizer", "char"], "does not exist"),
        ("dir", ["folder", "--tokenizer", "char"], "has no .txt files"),
        ("empty", ["empty.txt", "--tokenizer", "char"], "input is empty"),
        ("text", ["in.txt", "--tokenizer", "bpe"], "needs --vocab-size"),
        ("text", ["in.txt", "--tokenizer", "bpe", "--vocab-size", "100"], "at least 257"),
        ("text", ["in.txt", "--tokenizer", "char", "--vocab-size", "100"], "only applies to --tokenizer bpe"),
        ("text", ["in.txt", "--tokenizer", "gpt2", "--vocab-size", "100"], "only applies to --tokenizer bpe"),
        ("text", ["in.txt", "--tokenizer", "char", "--val-fraction", "0"], "between 0 and 1"),
        ("text", ["in.txt", "--tokenizer", "char", "--val-fraction", "1.5"], "between 0 and 1"),
        ("text", ["in.txt", "--tokenizer", "char", "--workers", "0"], "at least 1"),
        ("tiny", ["in.txt", "--tokenizer", "char"], "val split has 1 token(s)"),
        ("tiny", ["in.txt", "--tokenizer", "char", "--val-fraction", "0.9"], "train split has 1 token(s)"),
    ],
)
def test_user_errors(tmp_path: Path, monkeypatch, capsys, setup, args, expected) -> None:
    monkeypatch.chdir(tmp_path)
    if setup == "dir":
        (tmp_path / "folder").mkdir()
        (tmp_path / "folder" / "x.md").write_text("not txt")
    elif setup == "empty":
        (tmp_path / "empty.txt").write_text("")
    elif setup == "text":
        (tmp_path / "in.txt").write_text(TEXT_A)
    elif setup == "tiny":
        (tmp_path / "in.txt").write_text("abcdefghij")
    rc, _, err = cli(capsys, *args, "--out", "out")
    assert expected in one_line_error(rc, err)
    assert not (tmp_path / "out" / "meta.json").exists()
    assert not list(tmp_path.glob("out/.*"))  # no partial files


@pytest.mark.parametrize("offset", [0, 5, 4095, 4096, 4097, 9000])
def test_non_utf8_input_names_file_and_offset(tmp_path: Path, capsys, offset: int) -> None:
    good = ("é" * 5000).encode()[:offset]  # a multi-byte character may straddle the read blocks
    good = good[: len(good.decode("utf-8", "ignore").encode())]
    path = tmp_path / "latin1.txt"
    path.write_bytes(good + b"\xff rest")
    with pytest.raises(GptlabError, match=rf"latin1\.txt is not UTF-8 text \(bad byte at offset {len(good)}\)"):
        list(iter_file_text(path, read_bytes=4096))
    rc, _, err = cli(capsys, str(path), "--tokenizer", "char", "--out", str(tmp_path / "d"))
    assert f"offset {len(good)}" in one_line_error(rc, err)


def test_truncated_utf8_at_end_of_file(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(b"abc" + "😀".encode()[:2])
    with pytest.raises(GptlabError, match="offset 3"):
        list(iter_file_text(tmp_path / "t.txt", read_bytes=2))


def test_argparse_requires_a_tokenizer(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["prepare", "x.txt", "--out", "d"])
    assert e.value.code == 2 and "--tokenizer" in capsys.readouterr().err


# --- output directory and readers -------------------------------------------------------------------------------


def test_failed_rerun_leaves_the_previous_directory_whole(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "in.txt").write_text(TEXT_A * 20)
    out = tmp_path / "d"
    before = prepare([tmp_path / "in.txt"], out, tokenizer="bpe", vocab_size=300)
    files = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(preparation, "_encode_text", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "in.txt"], out, tokenizer="char")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files  # not a byte changed
    assert read_meta(out) == before and len(load_split(out, "train")) == before["train_tokens"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "in.txt"]  # no half-built directory beside it
    monkeypatch.undo()
    meta = prepare([tmp_path / "in.txt"], out, tokenizer="char")  # a rerun replaces it
    assert meta["tokenizer"] == "char" and not (out / "tokenizer.json").exists()  # no stale bpe file
    assert load_tokenizer(out).kind == "char"


def test_load_split_is_read_only_and_checked(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXT_A * 3)
    prepare([tmp_path / "in.txt"], tmp_path / "d", tokenizer="char")
    val = load_split(tmp_path / "d", "val")
    assert isinstance(val, np.memmap)
    with pytest.raises(ValueError):
        val[0] = 1
    with pytest.raises(GptlabError, match="unknown split"):
        load_split(tmp_path / "d", "test")
    with pytest.raises(GptlabError, match="does not exist.*gptlab prepare"):
        load_split(tmp_path / "nowhere", "train")
    with open(tmp_path / "d" / "train.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(GptlabError, match="meta.json says"):
        load_split(tmp_path / "d", "train")
    (tmp_path / "d" / "val.bin").unlink()
    with pytest.raises(GptlabError, match="val.bin is missing"):
        load_split(tmp_path / "d", "val")


def test_check_split_fits(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("x" * 100)
    prepare([tmp_path / "in.txt"], tmp_path / "d", tokenizer="char")
    assert check_split_fits(tmp_path / "d", "train", 89) == 90
    assert check_split_fits(tmp_path / "d", "val", 9) == 10
    with pytest.raises(GptlabError) as e:
        check_split_fits(tmp_path / "d", "val", 64)
    assert str(e.value) == (
        "the val split has 10 tokens, fewer than block_size+1=65; use a larger --val-fraction or more text "
        "(or a smaller block_size)"
    )


def test_out_must_not_be_a_file(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXT_A)
    with pytest.raises(GptlabError, match="is a file"):
        prepare([tmp_path / "in.txt"], tmp_path / "in.txt", tokenizer="char")


def test_meta_json_is_valid_and_written_last(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXT_A)
    prepare([tmp_path / "in.txt"], tmp_path / "d", tokenizer="char")
    meta = json.loads((tmp_path / "d" / "meta.json").read_text())
    mtimes = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "d").iterdir() if p.name != ".gptlab"}
    assert mtimes["meta.json"] >= max(mtimes.values())
    assert isinstance(load_tokenizer(tmp_path / "d"), CharTokenizer) and meta["vocab_size"] > 10


def test_out_is_replaced_whole_and_only_when_it_holds_data(tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text(TEXT_A * 3)
    old = tmp_path / "old"  # prepared in place by an older gptlab: no marker, only a DATA_DIR's files
    prepare([tmp_path / "in.txt"], old, tokenizer="char")
    (old / ".gptlab").unlink()
    assert prepare([tmp_path / "in.txt"], old, tokenizer="char")["tokenizer"] == "char"
    mine = tmp_path / "mine"  # someone's folder: never deleted
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(GptlabError, match="not written by gptlab"):
        prepare([tmp_path / "in.txt"], mine, tokenizer="char")
    assert (mine / "notes.txt").read_text() == "keep me"
