"""A data directory's token and mask files damaged in every way their format allows, through the commands that read
them: `gptlab train`, `gptlab eval` and `gptlab train --resume` each refuse before any step, in one line naming the
file (for ids past the vocabulary, also the first bad offset and id), and exit 2. Never an internal error, a
traceback, or a run that trains on the damage.

The damages: a loss mask missing, empty, cut (by a byte, in half), longer, a directory, holding a byte other than
0 / 1; a shard whose bytes no longer match the manifest's sha256, a shard missing; token ids past the vocabulary in
train.bin, val.bin and a shard; the data's tokenizer_meta.json cut in half or empty. (Sizes of train.bin / val.bin
and meta.json's keys: test_damaged_files.)
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_outcome, corpus_text, one_line_error, write_jsonl, write_recipe

from gptlab.data import prepare

ROW_SECONDS = 120  # a bound per command, not a performance target: only a hang comes near it
RECORDS = [{"prompt": f"Q{i}: {corpus_text(4000)[i * 9: i * 9 + 8]}", "completion": f" answer {i}."}
           for i in range(80)]


def mask_damages() -> dict[str, Callable[[Path], None]]:
    def cut(p: Path) -> None:
        p.write_bytes(p.read_bytes()[:-1])

    def directory(p: Path) -> None:
        p.unlink()
        p.mkdir()

    def bad_value(p: Path) -> None:
        data = bytearray(p.read_bytes())
        data[3] = 7
        p.write_bytes(bytes(data))

    return {"missing": Path.unlink, "empty": lambda p: p.write_bytes(b""), "cut": cut,
            "half": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
            "longer": lambda p: p.write_bytes(p.read_bytes() + b"\x01\x01"), "directory": directory,
            "value-7": bad_value}


def past_vocab(path: Path, vocab_size: int, dtype: str, at: int = 5) -> None:
    """Token `at` of `path` set to vocab_size + 3 (the size unchanged)."""
    ids = np.fromfile(path, dtype=np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4"))
    ids[at] = vocab_size + 3
    ids.tofile(path)


def flip_a_byte(path: Path) -> None:
    """One token of `path` changed to another id inside the vocabulary: only the sha256 can tell."""
    ids = np.fromfile(path, dtype="<u2")
    ids[1] = ids[0] if ids[1] != ids[0] else ids[2]
    ids.tofile(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three good data directories (text, records with a loss mask, text in shards), a run trained 2 steps on each
    (to resume) and a recipe."""
    root = tmp_path_factory.mktemp("damaged_data")
    text = root / "text.txt"
    text.write_text(corpus_text(6000), encoding="utf-8")
    w = {"root": root}
    prepare([text], root / "text", tokenizer="char")
    prepare([write_jsonl(root / "records.jsonl", RECORDS)], root / "records", tokenizer="char", block_size=32,
            val_fraction=0.2)
    prepare([text], root / "shards", tokenizer="char", shard_tokens=1500, chunk_chars=500)
    w["recipe"] = write_recipe(root, max_steps=2, warmup_steps=1, log_interval=1, eval_interval=2, eval_tokens=64,
                               batch_size=2, block_size=32)
    for kind in ("text", "records", "shards"):
        w[kind] = root / kind
        w[f"{kind}-run"] = root / f"{kind}-run"
        rc, lines = cli_outcome(["train", str(w["recipe"]), "--data", str(w[kind]), "--out", str(w[f"{kind}-run"]),
                                 "--quiet"], ROW_SECONDS)
        assert rc == 0, lines
    return w


def shard_of(data: Path, split: str) -> Path:
    meta = json.loads((data / "meta.json").read_text())
    return data / meta["shards"][split][0]["file"]


def vocab_and_dtype(data: Path) -> tuple[int, str]:
    meta = json.loads((data / "meta.json").read_text())
    return meta["vocab_size"], meta["dtype"]


# (id, data kind, the file damaged (relative to the data directory, {shard} = the split's first shard), damage,
# what the error must name besides the file)
def cases() -> list[tuple[str, str, str, str, str]]:
    rows = []
    for split in ("train", "val"):
        rows += [(f"mask-{how}-{split}", "records", f"{split}.mask.bin", how, "") for how in mask_damages()]
        rows += [(f"ids-past-vocab-{split}", "text", f"{split}.bin", "past-vocab", "offset 5"),
                 (f"ids-past-vocab-shard-{split}", "shards", "{shard}", "past-vocab", "offset 5"),
                 (f"shard-sha256-{split}", "shards", "{shard}", "sha256", "sha256"),
                 (f"shard-missing-{split}", "shards", "{shard}", "missing", "")]
    # the data's tokenizer: a run would copy a damaged one into every checkpoint, which then cannot sample
    rows += [(f"tokenizer-{how}", "text", "tokenizer_meta.json", how, "damaged") for how in ("half", "empty")]
    return rows


def damage(data: Path, split: str, file: str, how: str) -> Path:
    path = shard_of(data, split) if file == "{shard}" else data / file
    if how in mask_damages():
        mask_damages()[how](path)
    elif how == "past-vocab":
        past_vocab(path, *vocab_and_dtype(data))
    elif how == "sha256":
        flip_a_byte(path)
    return path


def commands(world: dict[str, Path], kind: str, data: Path, split: str, tmp_path: Path) -> dict[str, list[str]]:
    recipe, run = str(world["recipe"]), tmp_path / "run"
    out = {"train": ["train", recipe, "--data", str(data), "--out", str(tmp_path / "fresh"), "--quiet"],
           "eval": ["eval", str(run), "--data", str(data), "--split", split],
           "resume": ["train", recipe, "--data", str(data), "--out", str(run), "--quiet", "--resume",
                      "--max-steps", "4"]}
    return out


@pytest.mark.parametrize(("case", "kind", "file", "how", "names"), cases(), ids=lambda x: str(x))
def test_a_damaged_data_file_is_refused_in_one_line_by_train_eval_and_resume(
    world: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str, kind: str, file: str,
    how: str, names: str
) -> None:
    monkeypatch.setenv("GPTLAB_DEBUG", "1")  # an internal error raises here instead of printing one line
    monkeypatch.setenv("GPTLAB_NO_KERNELS", "1")
    # the run resumes from the data directory it trained on: both copied, the copy damaged
    data = world["root"] / kind  # the run's recorded data path: damaged in place, put back afterwards
    backup = tmp_path / "good"
    shutil.copytree(data, backup)
    shutil.copytree(world[f"{kind}-run"], tmp_path / "run")
    split = "train" if "train" in case else "val"
    try:
        path = damage(data, split, file, how)
        for command, argv in commands(world, kind, data, split, tmp_path).items():
            rc, lines = cli_outcome(argv, ROW_SECONDS)
            assert rc == 2, f"{command}: exit {rc}, {lines[-3:]}"
            line = one_line_error(rc, "\n".join(lines))
            assert path.name in line, f"{command}: {line}"
            assert names in line, f"{command}: {line}"
            assert not (tmp_path / "fresh" / "checkpoints").exists(), f"{command} trained on damaged data"
    finally:
        shutil.rmtree(data)
        shutil.copytree(backup, data)
