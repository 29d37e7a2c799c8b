"""Sharded token data: shards equal the single-file layout, the manifest's hashes, a killed prepare resumed at its
shard, text documents streamed from records, a saved dataset and a parquet folder (the Hub's code path), and the
sharded split read as one array."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from helpers import corpus_text, hf_tokenizer_dir, one_line_error, write_jsonl

from gptlab.cli import main
from gptlab.data import load_split, prepare, read_meta
from gptlab.data.documents import is_val
from gptlab.data.shards import ShardedTokens, ShardWriter, building_dir, verify_shards
from gptlab.tokenizer import load_tokenizer


def _split(d: Path, split: str) -> np.ndarray:
    tokens = load_split(d, split)
    return np.asarray(tokens[0 : len(tokens)])


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shards") / "a.txt"
    path.write_text(corpus_text(120_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_tokenizer_dir(tmp_path_factory.mktemp("tok"), {})


def test_shards_hold_the_single_file_tokens_and_their_hashes(tmp_path: Path, text: Path) -> None:
    one = prepare([text], tmp_path / "one", tokenizer="char")
    meta = prepare([text], tmp_path / "sh", tokenizer="char", shard_tokens=5000, chunk_chars=1000)
    for split in ("train", "val"):
        assert np.array_equal(_split(tmp_path / "sh", split), _split(tmp_path / "one", split))
        entries = meta["shards"][split]
        assert [e["tokens"] for e in entries[:-1]] == [5000] * (len(entries) - 1)  # fixed size but the last
        assert sum(e["tokens"] for e in entries) == one[f"{split}_tokens"] == meta[f"{split}_tokens"]
        for e in entries:
            assert e["sha256"] == hashlib.sha256((tmp_path / "sh" / e["file"]).read_bytes()).hexdigest()
    assert read_meta(tmp_path / "sh")["shards"] == meta["shards"]
    verify_shards(tmp_path / "sh", meta["shards"])
    assert not building_dir(tmp_path / "sh").exists()


def test_sharded_tokens_index_like_one_array() -> None:
    rng = np.random.default_rng(0)
    whole = rng.integers(0, 60000, size=1000).astype(np.uint16)
    cuts = [0, 7, 300, 301, 1000]
    sharded = ShardedTokens([whole[a:b] for a, b in zip(cuts, cuts[1:], strict=False)])
    assert len(sharded) == 1000
    idx = rng.integers(0, 1000 - 17, size=(9, 1))[:, :] + np.arange(17)
    assert np.array_equal(sharded[idx], whole[idx])
    for a, b in [(0, 1000), (5, 9), (6, 8), (299, 302), (300, 301), (990, 2000), (10, 10)]:
        assert np.array_equal(sharded[a:b], whole[a:b])
    assert sharded[999] == whole[999] and sharded[-1] == whole[-1]
    with pytest.raises(IndexError):
        sharded[np.array([1000])]


class _Killed(Exception):
    pass


def _kill_after(monkeypatch: pytest.MonkeyPatch, shards: int) -> None:
    """Stop a prepare as a kill would, right after `shards` shards were closed; leave bytes a killed run had
    written past its last saved state in the open shard."""
    original = ShardWriter._save_progress
    calls = {"n": 0}

    def save(self: ShardWriter) -> None:
        original(self)
        calls["n"] += 1
        if calls["n"] == shards:
            split = next(s for s in self.open_tokens if self.open_tokens[s]) if any(self.open_tokens.values()) \
                else "train"
            with open(self._partial(split), "ab") as f:
                f.write(b"\x07\x00" * 11)
            raise _Killed

    monkeypatch.setattr(ShardWriter, "_save_progress", save)


def test_a_killed_prepare_resumes_at_its_shard(tmp_path: Path, text: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ref = prepare([text], tmp_path / "ref", tokenizer="char", shard_tokens=4999, chunk_chars=1000)
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _kill_after(m, 6)
        with pytest.raises(_Killed):
            prepare([text], out, tokenizer="char", shard_tokens=4999, chunk_chars=1000)
    state = json.loads((building_dir(out) / "progress.json").read_text())
    assert len(state["shards"]["train"]) == 6 and state["pieces"] > 0 and not out.exists()
    skipped: list[int] = []
    import gptlab.data.preparation as preparation

    real = preparation.skipping
    monkeypatch.setattr(preparation, "skipping", lambda pieces, skip: (skipped.append(skip), real(pieces, skip))[1])
    meta = prepare([text], out, tokenizer="char", shard_tokens=4999, chunk_chars=1000)
    assert skipped == [state["pieces"]]  # went on from the stream position, not from the start
    assert meta["shards"] == ref["shards"] and meta["train_chars"] == ref["train_chars"]
    for split in ("train", "val"):
        assert np.array_equal(_split(out, split), _split(tmp_path / "ref", split))


def test_the_saved_state_never_counts_bytes_a_kill_would_lose(tmp_path: Path) -> None:
    """A SIGKILL loses what sits in Python's write buffers (no `finally` runs): when progress.json is written, the
    other split's open shard must already hold on disk every token the state counts, else the rerun finds it short
    and starts over (documents interleave val with train; text keeps train's last shard open while val is written)."""
    writer = ShardWriter(tmp_path, 10, np.dtype("<u2"), {})
    saved: list[dict[str, int]] = []
    original = writer._save_progress

    def save() -> None:
        original()
        saved.append({s: writer._partial(s).stat().st_size // 2 if writer._partial(s).is_file() else 0
                      for s in ("train", "val")})

    writer._save_progress = save  # type: ignore[method-assign]
    writer.write("val", np.arange(3))
    writer.write("train", np.arange(10))  # closes a train shard: the state counts val's 3 open tokens
    assert saved == [{"train": 0, "val": 3}] and writer.open_tokens == {"train": 0, "val": 3}
    writer.write("train", np.arange(4))
    writer.write("val", np.arange(7))  # closes a val shard: train's 4 open tokens counted
    assert saved[1] == {"train": 4, "val": 0}
    writer.close()


def test_a_changed_input_starts_the_shards_over(tmp_path: Path, text: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        _kill_after(m, 2)
        with pytest.raises(_Killed):
            prepare([text], out, tokenizer="char", shard_tokens=3000)
    other = tmp_path / "b.txt"
    other.write_text(corpus_text(50_000), encoding="utf-8")
    prepare([other], out, tokenizer="char", shard_tokens=3000)
    prepare([other], tmp_path / "ref", tokenizer="char")
    assert np.array_equal(_split(out, "train"), _split(tmp_path / "ref", "train"))


# --- documents ----------------------------------------------------------------------------------------------------
DOCS = [{"text": corpus_text(3000)[i * 97 : i * 97 + 50 + i]} for i in range(30)]


def _expected(tok_dir: Path, docs: list[dict], val_fraction: float) -> dict[str, np.ndarray]:
    """Each document's ids then end-of-text, val every document `is_val` picks: encoded one by one here."""
    tok = load_tokenizer(tok_dir)
    out: dict[str, list[int]] = {"train": [], "val": []}
    for i, d in enumerate(docs):
        out["val" if is_val(i, val_fraction) else "train"] += tok.encode(d["text"]) + [tok.eot_id]
    return {k: np.array(v) for k, v in out.items()}


def test_text_records_stream_as_documents(tmp_path: Path, tok_dir: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    meta = prepare([path], tmp_path / "d", tokenizer=None, tokenizer_from=tok_dir, val_fraction=0.2,
                   shard_tokens=300)
    expected = _expected(tok_dir, DOCS, 0.2)
    assert sum(is_val(i, 0.2) for i in range(30)) == 6
    for split in ("train", "val"):
        assert np.array_equal(_split(tmp_path / "d", split), expected[split])
    assert meta["separator"] == "eot" and len(meta["shards"]["train"]) > 1
    assert "window_tokens" not in meta and not meta.get("mask")


def test_a_saved_dataset_and_a_parquet_folder_stream_alike(tmp_path: Path, tok_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(DOCS).save_to_disk(str(saved))
    folder = tmp_path / "parquet" / "data"
    folder.mkdir(parents=True)
    for k in range(3):  # three shards of a corpus, read in name order
        pq.write_table(pa.Table.from_pylist(DOCS[k * 10 : (k + 1) * 10]), folder / f"train-{k:05d}.parquet")
    expected = _expected(tok_dir, DOCS, 0.1)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    for name, inputs in (("saved", [saved]), ("folder", [tmp_path / "parquet"])):
        prepare(inputs, tmp_path / name / "d", tokenizer=None, tokenizer_from=tok_dir, shard_tokens=500)
        for split in ("train", "val"):
            assert np.array_equal(_split(tmp_path / name / "d", split), expected[split]), name
    # hf://datasets/NAME takes the folder's path through the same call, by name
    calls = []
    real = datasets.load_dataset

    def load_dataset(name: str, **kw: object) -> object:
        calls.append((name, kw))
        return real(str(tmp_path / "parquet"), **kw)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    assert main(["prepare", "--hf-dataset", "someone/corpus", "--tokenizer-from", str(tok_dir), "--split", "train",
                 "--out", str(tmp_path / "hub")]) == 0
    assert calls == [("someone/corpus", {"split": "train", "streaming": True})]
    assert np.array_equal(_split(tmp_path / "hub", "train"), expected["train"])
    calls.clear()
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, **kw: (calls.append((name, config, kw)),
                                                                              real(str(tmp_path / "parquet"), **kw))[1])
    prepare(["hf://datasets/someone/corpus/sample-10BT"], tmp_path / "hub2", tokenizer=None, tokenizer_from=tok_dir)
    assert calls == [("someone/corpus", "sample-10BT", {"split": "train", "streaming": True})]


def test_a_killed_document_stream_resumes(tmp_path: Path, tok_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    docs = DOCS * 4
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    import gptlab.data.documents as documents

    kw = {"tokenizer": None, "tokenizer_from": tok_dir, "shard_tokens": 250}
    with monkeypatch.context() as m:
        m.setattr(documents.document_pieces, "__defaults__", (200,))
        ref = prepare([path], tmp_path / "ref", **kw)
        _kill_after(m, 5)
        with pytest.raises(_Killed):
            prepare([path], tmp_path / "out", **kw)
        meta = prepare([path], tmp_path / "out", **kw)
    assert meta["shards"] == ref["shards"]
    expected = _expected(tok_dir, docs, 0.1)
    assert np.array_equal(_split(tmp_path / "out", "train"), expected["train"])


@pytest.mark.parametrize("args, expected", [
    (["docs.jsonl", "--tokenizer", "char"], r"text documents are streamed: they need a tokenizer fixed in advance"),
    (["chats.jsonl", "--tokenizer-from", "TOK"], r"chats\.jsonl line 1 is a chat record: record inputs need "
     r"--block-size N"),
    (["'nothing-*.txt'", "--tokenizer", "char"], r"input pattern nothing-\*\.txt matches no file"),
    (["a.txt", "--tokenizer", "char", "--shard-tokens", "1"], r"--shard-tokens must be at least 2, got 1"),
    (["--tokenizer", "char"], r"no input given"),
    # records packed as examples are written whole with their loss masks: the flag used to be ignored
    (["chats.jsonl", "--tokenizer-from", "TOK", "--block-size", "16", "--shard-tokens", "8"],
     r"--shard-tokens applies to text files and streamed documents"),
    (["hf://datasets/lonely", "--tokenizer-from", "TOK"], r"hf://datasets/lonely: name a dataset as OWNER/NAME"),
])
def test_shard_and_stream_errors_are_one_line(tmp_path: Path, tok_dir: Path, capsys, monkeypatch, args,
                                             expected) -> None:
    import re

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "docs.jsonl", DOCS)
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    (tmp_path / "a.txt").write_text("some text\n" * 20)
    args = [a.strip("'").replace("TOK", str(tok_dir)) for a in args]
    rc = main(["prepare", *args, "--out", str(tmp_path / "out")])
    assert re.search(expected, one_line_error(rc, capsys.readouterr().err))


def test_globs_expand_in_name_order(tmp_path: Path) -> None:
    for k in (2, 0, 1):
        (tmp_path / f"part-{k}.txt").write_text(f"part {k} " * 200)
    meta = prepare([str(tmp_path / "part-*.txt")], tmp_path / "d", tokenizer="char")
    assert [Path(s["path"]).name for s in meta["sources"]] == ["part-0.txt", "part-1.txt", "part-2.txt"]


def test_eval_scores_shards_as_the_single_file(tmp_path: Path, text: Path) -> None:
    from helpers import tiny_model

    from gptlab.evaluation.loss import evaluate_split

    prepare([text], tmp_path / "one", tokenizer="char")
    meta = prepare([text], tmp_path / "sh", tokenizer="char", shard_tokens=3001)
    model = tiny_model("learned", block_size=32, vocab_size=meta["vocab_size"])
    a, b = evaluate_split(model, tmp_path / "one"), evaluate_split(model, tmp_path / "sh")
    assert a == b and len(meta["shards"]["val"]) > 1
