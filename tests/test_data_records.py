"""`gptlab prepare` on records: formats, shapes, chat rendering and loss masks, windows (packed / padded), the val
split, one-line errors naming the file and line; and the read side (`load_mask`, `batch_starts`, `windows`)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import GPT2_SKIP_REASON, gpt2_bpe_files, needs_tiktoken_gpt2, one_line_error, write_jsonl

from gptlab.cli import main
from gptlab.data import (
    batch_starts,
    check_split_fits,
    global_batch,
    load_mask,
    load_split,
    prepare,
    read_meta,
    records,
    windows,
)
from gptlab.errors import GptlabError
from gptlab.tokenizer import load_tokenizer
from gptlab.tokenizer.chat_template import chat_template_for

SYSTEM = {"role": "system", "content": "Answer in one word."}
CHATS = [
    {"messages": [SYSTEM, {"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris."}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6, of course."}]},
    {"messages": [{"role": "user", "content": "Nobody answers this."}]},  # no reply: nothing to train on
    {"messages": [{"role": "user", "content": "Colour of the sky?"}, {"role": "assistant", "content": "Blue."}]},
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]},
]
PAIRS = [{"prompt": f"Question {i}: what is {i} squared?", "completion": f" {i * i}."} for i in range(6)]
QWEN_LIKE = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REJECT_SYSTEM = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system role') }}" \
    "{% endif %}{{ m.content }}{% endfor %}"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(["prepare", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def hf_chat_dir(root: Path, template: str, eos: str = "<|im_end|>") -> Path:
    """A Hugging Face tokenizer directory: GPT-2's BPE with ChatML's special tokens, and `template`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    files = gpt2_bpe_files()
    if files is None:
        pytest.skip(GPT2_SKIP_REASON)
    tok = Tokenizer(models.BPE.from_file(*map(str, files)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "chat_template": template}))
    return root


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_chat_dir(tmp_path_factory.mktemp("qwen"), QWEN_LIKE)


def rows_of(d: Path, split: str) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) of each window of a split."""
    w = read_meta(d)["window_tokens"]
    ids, mask = load_split(d, split), load_mask(d, split)
    assert mask is not None and mask.dtype == np.uint8 and len(mask) == len(ids) and len(ids) % w == 0
    return [(ids[i : i + w].tolist(), mask[i : i + w].tolist()) for i in range(0, len(ids), w)]


def outputs(d: Path) -> list[bytes]:
    return [(d / f).read_bytes() for f in ("train.bin", "train.mask.bin", "val.bin", "val.mask.bin")]


# --- chats ------------------------------------------------------------------------------------------------------


def test_chats_get_the_tokenizer_template_and_a_mask_on_the_replies(tmp_path: Path, capsys, qwen_dir: Path) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    rc, out, _ = cli(capsys, str(path), "--tokenizer-from", str(qwen_dir), "--out", str(tmp_path / "d"),
                     "--block-size", "63", "--no-pack", "--val-fraction", "0.2")
    assert rc == 0 and "1 dropped" in out and "0 truncated" in out and "tokenizer chat template" in out
    meta = read_meta(tmp_path / "d")
    tok = load_tokenizer(tmp_path / "d")
    im_end = tok.encode("<|im_end|>", allow_special=True)  # also the eos, so the pad id
    assert {k: meta[k] for k in ("mask", "window_tokens", "layout", "examples", "truncated", "dropped", "pad_id",
                                 "chat_template", "train_on_prompt", "tokenizer")} == {
        "mask": True, "window_tokens": 64, "layout": "padded", "examples": {"train": 3, "val": 1}, "truncated": 0,
        "dropped": 1, "pad_id": im_end[0], "chat_template": "tokenizer", "train_on_prompt": False, "tokenizer": "hf"}
    assert meta["sources"][0]["records"] == 5 and meta["sources"][0]["shape"] == "chat"
    template = chat_template_for(tok)
    assert len(im_end) == 1
    kept = [c["messages"] for c in CHATS if c["messages"][-1]["role"] == "assistant"]
    rows = rows_of(tmp_path / "d", "train") + rows_of(tmp_path / "d", "val")
    assert len(rows) == len(kept) == 4  # the last record (of 5) is the val split; one window each
    for messages, (ids, mask) in zip(kept, rows, strict=True):
        n = 64 - mask[::-1].index(1) + 1  # the last reply's "<|im_end|>", then the template's "\n", then padding
        assert ids[n - 1] == tok.encode("\n")[0] and ids[n:] == im_end * (64 - n) and not any(mask[n:])
        first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = tok.encode(template.render(messages[:first], add_generation_prompt=True), allow_special=True)
        assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])  # what inference sees, not trained
        assert tok.decode(ids[: len(prompt)]).count("<|im_start|>") == first + 1  # specials became their ids
        targets = [i for i, m in zip(ids, mask, strict=True) if m]
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert tok.decode(targets) == "".join(replies)
        assert targets.count(im_end[0]) == len(replies)


def test_builtin_templates_and_train_on_prompt(tmp_path: Path, gpt2) -> None:
    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    meta = prepare([path], tmp_path / "plain", tokenizer="gpt2", block_size=127, pack=False)
    assert meta["chat_template"] == "plain"
    ids, mask = rows_of(tmp_path / "plain", "train")[0]
    assert gpt2.decode([i for i, m in zip(ids, mask, strict=True) if m]) == " Paris.\n"
    assert gpt2.decode(ids).startswith("System: Answer in one word.\nUser: Capital of France?\nAssistant: Paris.\n")

    meta = prepare([path], tmp_path / "all", tokenizer="gpt2", block_size=127, pack=False, chat_template="chatml",
                   train_on_prompt=True)
    assert (meta["chat_template"], meta["train_on_prompt"], meta["dropped"]) == ("chatml", True, 0)
    for ids, mask in rows_of(tmp_path / "all", "train"):
        n = sum(mask) + 1  # a window's first token is never a target
        assert mask == [0] + [1] * (n - 1) + [0] * (128 - n) and ids[n:] == [50256] * (128 - n)
        assert gpt2.decode(ids[:n]).startswith("<|im_start|>")


def test_sharegpt_equals_messages_and_prompt_completion_is_one_exchange(tmp_path: Path, gpt2) -> None:
    sharegpt = [{"conversations": [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]],
                                    "value": m["content"]} for m in c["messages"]]} for c in CHATS]
    prepare([write_jsonl(tmp_path / "a.jsonl", CHATS)], tmp_path / "a", tokenizer="gpt2", block_size=64)
    prepare([write_jsonl(tmp_path / "b.jsonl", sharegpt)], tmp_path / "b", tokenizer="gpt2", block_size=64)
    assert outputs(tmp_path / "a") == outputs(tmp_path / "b")

    pairs = [{"messages": [{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p["completion"]}]}
             for p in PAIRS]
    prepare([write_jsonl(tmp_path / "p.jsonl", PAIRS)], tmp_path / "p", tokenizer="gpt2", block_size=64)
    prepare([write_jsonl(tmp_path / "m.jsonl", pairs)], tmp_path / "m", tokenizer="gpt2", block_size=64)
    assert outputs(tmp_path / "p") == outputs(tmp_path / "m")
    targets = [i for ids, mask in rows_of(tmp_path / "p", "train") for i, m in zip(ids, mask, strict=True) if m]
    assert gpt2.decode(targets) == "".join(" " + p["completion"] + "\n" for p in PAIRS[:5])


# --- windows ----------------------------------------------------------------------------------------------------

TEXTS = ["abcd", "efghijk", "lm", "n", "opqrstuvwxyz", "AB", "CD", "EF"]


@pytest.mark.parametrize("pack", [True, False])
def test_windows_packing_padding_truncation_and_drops(tmp_path: Path, pack: bool) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TEXTS])
    meta = prepare([path], tmp_path / "d", tokenizer="char", block_size=7, pack=pack)
    tok = load_tokenizer(tmp_path / "d")
    # "n" has no target after its first token (dropped); the 12 letters are cut to the window (truncated)
    if pack:
        expected = [["abcd"], ["efghijk"], ["lm"], ["opqrstuv"], ["AB", "CD"]]
    else:
        expected = [["abcd"], ["efghijk"], ["lm"], ["opqrstuv"], ["AB"], ["CD"]]
    assert [tok.decode(ids[: sum(mask) + 1]) for ids, mask in rows_of(tmp_path / "d", "train")] == [
        "".join(w) for w in expected
    ]
    for ids, mask in rows_of(tmp_path / "d", "train"):
        n = sum(mask) + 1  # every token a target but the window's first, which nothing predicts
        assert mask == [0] + [1] * (n - 1) + [0] * (8 - n) and ids[n:] == [0] * (8 - n)  # no eot in char: pad 0
    assert [tok.decode(ids[:2]) for ids, _ in rows_of(tmp_path / "d", "val")] == ["EF"]  # the last record
    assert meta["examples"] == {"train": 6, "val": 1}
    assert (meta["truncated"], meta["dropped"], meta["window_tokens"]) == (1, 1, 8)
    assert (meta["train_tokens"], meta["val_tokens"]) == (8 * len(expected), 8)
    assert meta["layout"] == ("packed" if pack else "padded") and meta["chat_template"] is None


def test_text_records_end_with_eot_and_text_field(tmp_path: Path, gpt2) -> None:
    rows = [{"body": f"Document number {i}.", "text": 7} for i in range(5)]
    path = write_jsonl(tmp_path / "docs.jsonl", rows)
    meta = prepare([path], tmp_path / "d", tokenizer="gpt2", block_size=31, text_field="body")
    ids, mask = rows_of(tmp_path / "d", "train")[0]
    one = gpt2.encode("Document number 0.") + [50256]
    assert ids[: 4 * len(one)] == one + [i for k in (1, 2, 3) for i in gpt2.encode(f"Document number {k}.") + [50256]]
    assert sum(mask) == 4 * len(one) - 1 and meta["separator"] == "eot"


def test_chats_are_not_documents_ended_by_eot(tmp_path: Path, qwen_dir: Path) -> None:
    """Chat examples are not ended by end-of-text, and their eos (ChatML's <|im_end|>) ends every turn: meta.json
    must not claim an end-of-text separator, or `document_mask = true` would cut each reply off from its prompt."""
    from gptlab.train.batches import document_eot

    path = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    meta = prepare([path], tmp_path / "d", tokenizer_from=qwen_dir, block_size=63)
    assert meta["eot_id"] is not None and meta["separator"] == "none"
    with pytest.raises(GptlabError, match="needs documents ended by end-of-text"):
        document_eot(True, [(tmp_path / "d", 1.0)])


# --- formats ----------------------------------------------------------------------------------------------------


@needs_tiktoken_gpt2
def test_every_format_gives_the_same_files(tmp_path: Path) -> None:
    pa, pq, datasets = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet"), \
        pytest.importorskip("datasets")
    reference = tmp_path / "ref"
    prepare([write_jsonl(tmp_path / "p.jsonl", PAIRS)], reference, tokenizer="gpt2", block_size=40)
    (tmp_path / "list.json").write_text(json.dumps(PAIRS, indent=2))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(p) for p in PAIRS))
    pq.write_table(pa.Table.from_pylist(PAIRS), tmp_path / "p.parquet")
    (tmp_path / "p.csv").write_text("prompt,completion\n" + "".join(f'"{p["prompt"]}","{p["completion"]}"\n'
                                                                   for p in PAIRS))
    ds = datasets.Dataset.from_list(PAIRS)
    ds.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": ds.select([0]), "sft": ds}).save_to_disk(str(tmp_path / "dict"))
    for name, extra in [("list.json", {}), ("lines.json", {}), ("p.parquet", {}), ("p.csv", {}), ("saved", {}),
                        ("dict", {"split_name": "sft"})]:
        meta = prepare([tmp_path / name], tmp_path / f"out-{name}", tokenizer="gpt2", block_size=40, **extra)
        assert outputs(tmp_path / f"out-{name}") == outputs(reference), name
        assert meta["sources"][0]["records"] == 6 and meta["sources"][0]["sha256"]
    # nested chats survive parquet and datasets too
    prepare([write_jsonl(tmp_path / "c.jsonl", CHATS)], tmp_path / "c", tokenizer="gpt2", block_size=64)
    pq.write_table(pa.Table.from_pylist(CHATS), tmp_path / "c.parquet")
    prepare([tmp_path / "c.parquet"], tmp_path / "cp", tokenizer="gpt2", block_size=64)
    assert outputs(tmp_path / "cp") == outputs(tmp_path / "c")


def test_json_list_streams_in_small_blocks(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(records, "_READ", 5)  # every element straddles reads
    (tmp_path / "list.json").write_text(json.dumps(CHATS, indent=1))
    got = list(records.RecordFile(tmp_path / "list.json").records())
    assert [list(r.messages) for r in got] == [c["messages"] for c in CHATS]
    assert got[1].where == f"{tmp_path / 'list.json'} record 2 (line 18)"
    broken = json.dumps(CHATS, indent=1).replace('"4"', '"4",,', 1)
    (tmp_path / "broken.json").write_text(broken)
    line = broken[: broken.index(",,")].count("\n") + 1
    with pytest.raises(GptlabError, match=rf"broken\.json line {line}: invalid JSON"):
        list(records.RecordFile(tmp_path / "broken.json").records())


# --- errors -----------------------------------------------------------------------------------------------------


def _parquet(path: Path, rows: list[dict]) -> Path:
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _truncated_parquet(path: Path) -> Path:
    _parquet(path, PAIRS * 50)
    path.write_bytes(path.read_bytes()[:-300])
    return path


GOOD = json.dumps(CHATS[0])
ERRORS = [
    ("chats.jsonl", [GOOD] * 6 + ['{"messages": [}'], [], r"chats\.jsonl line 7: invalid JSON: "),
    ("chats.jsonl", [GOOD, '{"prompt": "only a prompt"}'], [],
     r"chats\.jsonl line 2: has 'prompt' but no 'completion'"),
    ("chats.jsonl", [GOOD, '{"question": "?", "answer": "!"}'], [],
     r"line 2: matches no record shape.*question, answer"),
    ("chats.jsonl", [GOOD, '{"messages": [{"role": "robot", "content": "beep"}]}'], [],
     r"line 2: messages\[0\]: unknown role 'robot'"),
    ("chats.jsonl", [GOOD, '{"conversations": [{"from": "bard", "value": "hi"}]}'], [],
     r"line 2: conversations\[0\]: unknown speaker 'bard'"),
    ("chats.jsonl", [GOOD, '{"conversations": [{"from": ["human"], "value": "hi"}]}'], [],
     r"chats\.jsonl line 2: conversations\[0\]: field 'from' must be a string, got list"),
    ("chats.jsonl", [GOOD, '{"conversations": [{"from": {"a": 1}, "value": "hi"}]}'], [],
     r"line 2: conversations\[0\]: field 'from' must be a string, got dict"),
    ("chats.jsonl", [GOOD, '{"conversations": [{"from": "human", "value": 1}]}'], [],
     r"line 2: conversations\[0\]: field 'value' must be a string, got int"),
    ("chats.jsonl", [GOOD, '{"conversations": [{"from": "human", "text": "hi"}]}'], [],
     r"line 2: conversations\[0\]: has 'from' but no 'value'"),
    ("chats.jsonl", [GOOD, '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"], [],
     r"chats\.jsonl line 2: JSON nested too deeply"),
    ("chats.json", ["[" + GOOD + ", " + "[" * 100_000 + "]" * 100_000 + "]"], [],
     r"chats\.json line 1: JSON nested too deeply"),
    ("chats.json", [GOOD, '{"a": ' * 100_000 + "1" + "}" * 100_000], [], r"chats\.json line 2: JSON nested too deeply"),
    ("chats.jsonl", [GOOD, '{"messages": []}'], [], r"line 2: messages: the conversation is empty"),
    ("chats.jsonl", [GOOD, '{"messages": [{"role": "user", "content": ["a", "b"]}]}'], [],
     r"line 2: messages\[0\]: content must be a string, got list"),
    ("chats.jsonl", [GOOD, '{"text": 5}'], [], r"line 2: field 'text' must be a string, got int"),
    ("chats.jsonl", [GOOD, GOOD.replace('"content": "', '"content": "\\ud83d', 1)], [],
     r"chats\.jsonl line 2: a \\u escape gives the unpaired surrogate '\\ud83d', which is not text"),
    ("chats.json", ["[" + GOOD + ", " + GOOD.replace('"content": "', '"content": "\\ude00', 1) + "]"], [],
     r"chats\.json record 2 \(line 1\): a \\u escape gives the unpaired surrogate '\\ude00'"),
    ("chats.jsonl", [GOOD, "[1, 2]"], [], r"line 2: expected a JSON object, got list"),
    ("chats.jsonl", [GOOD, '{"text": "plain"}'], [], r"line 2: a text record, but .*line 1 is chat: one input"),
    ("chats.jsonl", [GOOD, GOOD], ["--text-field", "body"], r"line 1: no field 'body' \(--text-field"),
    ("chats.jsonl", ["", "  "], [], r"the input is empty \(.*chats\.jsonl has no records\)"),
    ("chats.jsonl", [GOOD], [], r"only 1 record in .*chats\.jsonl: need at least 2"),
    ("chats.json", ['"a string"'], [], r"chats\.json: expected a JSON list of objects, or one object per line"),
    ("chats.json", [GOOD, "{"], [], r"chats\.json line 2: invalid JSON: .* \(a \.json file holds a list"),
    ("chats.json", ["[" + GOOD + "," + GOOD], [], r"chats\.json line 2: invalid JSON: the list is not closed"),
    ("chats.jsonl", [GOOD, GOOD], ["--chat-template-from-tokenizer"],
     r"line 1: the chat template in \S+tokenizer_config\.json could not render this conversation: no system role"),
    ("chats.jsonl", [GOOD, GOOD], ["--no-block-size"], r"record inputs need --block-size N"),
    ("bad.csv", ["prompt,completion", '"a'], [], r"bad\.csv: datasets could not read it \(ParserError: "),
    ("p.parquet", "truncated", [], r"p\.parquet is not a readable parquet file \(corrupt or truncated\?\)"),
    ("p.parquet", "garbage", [], r"p\.parquet is not a readable parquet file"),
    ("p.parquet", "pairs", ["--text-field", "body"], r"p\.parquet has no column 'body' \(--text-field; columns: "
     r"prompt, completion\)"),
    ("p.parquet", "pairs", ["--no-pyarrow"], r"reading \.parquet needs pyarrow: pip install 'gptlab\[data\]'"),
    ("in.txt", "text", ["--block-size", "8"], r"--block-size only applies to record inputs"),
    ("in.txt", "text", ["--block-size", "8", "--no-pack"], r"--block-size, --no-pack only apply to record inputs"),
    ("in.txt", "text+jsonl", [], r"in\.txt is text and .*chats\.jsonl holds records"),
]


@needs_tiktoken_gpt2
@pytest.mark.parametrize("name, content, args, expected", ERRORS, ids=[e[3][:40] for e in ERRORS])
def test_user_errors_are_one_line(tmp_path: Path, monkeypatch, capsys, name, content, args, expected) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / name
    inputs = [name]
    if isinstance(content, list):
        path.write_text("\n".join(content) + "\n")
    elif content == "truncated":
        _truncated_parquet(path)
    elif content == "garbage":
        path.write_bytes(b"PAR1 this is not a parquet file")
    elif content == "pairs":
        _parquet(path, PAIRS)
    elif content.startswith("text"):
        path.write_text("some text\n" * 10)
        if content == "text+jsonl":
            inputs.append(str(write_jsonl(tmp_path / "chats.jsonl", CHATS)))
    tokenizer = ["--tokenizer", "gpt2"]
    block = ["--block-size", "32"] if name != "in.txt" else []
    if "--chat-template-from-tokenizer" in args:
        tokenizer, args = ["--tokenizer-from", str(hf_chat_dir(tmp_path / "tok", REJECT_SYSTEM))], []
    if "--no-block-size" in args:
        block, args = [], []
    if "--no-pyarrow" in args:
        monkeypatch.setitem(sys.modules, "pyarrow", None)
        monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
        args = []
    rc, _, err = cli(capsys, *inputs, *tokenizer, *block, *args, "--out", "out")
    assert re.search(expected, one_line_error(rc, err)), err
    assert not (tmp_path / "out" / "meta.json").exists()
    assert not list(tmp_path.glob("out/.*"))  # no partial files


@needs_tiktoken_gpt2
def test_missing_split_and_empty_val(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(PAIRS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(GptlabError, match=r"has no split 'train' \(splits: test\); choose one with --split-name"):
        prepare([tmp_path / "dict"], tmp_path / "d", tokenizer="gpt2", block_size=32)
    # the last record (the val split) has no reply
    path = write_jsonl(tmp_path / "c.jsonl", [CHATS[0], CHATS[1], CHATS[2]])
    with pytest.raises(GptlabError, match="the val split has no example left: its 1 record"):
        prepare([path], tmp_path / "d", tokenizer="gpt2", block_size=32)


def test_escaped_surrogate_pairs_are_text_and_lone_ones_are_refused(tmp_path: Path) -> None:
    """A char vocabulary took a lone surrogate in as a character (and GPT-2's BPE failed on it naming no file);
    a pair, as json.dumps writes an emoji, is the one character it stands for."""
    pair = tmp_path / "pair.jsonl"
    pair.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("smile \U0001F600", "ok", "more")))
    assert "\\ud83d\\ude00" in pair.read_text()
    prepare([pair], tmp_path / "d", tokenizer="char", block_size=8)
    assert "\U0001F600" in load_tokenizer(tmp_path / "d").chars
    lone = tmp_path / "lone.jsonl"
    lone.write_text('{"text": "ok"}\n{"text": "cut \\ud83d"}\n{"text": "more"}\n')
    with pytest.raises(GptlabError, match=r"lone\.jsonl line 2: a \\u escape gives the unpaired surrogate"):
        prepare([lone], tmp_path / "d2", tokenizer="char", block_size=8)


def test_replies_cut_off_by_the_window_ask_for_a_larger_block_size(tmp_path: Path) -> None:
    """Records whose replies lie past --block-size are not records without replies: the error says what to raise
    (it said "no assistant reply, or empty text; check the records")."""
    chats = [{"messages": [{"role": "user", "content": f"a question of some length {i}"},
                           {"role": "assistant", "content": "yes"}]} for i in range(4)]
    pairs = [{"prompt": f"a question of some length {i}", "chosen": "yes", "rejected": "no"} for i in range(4)]
    for name, rows in (("chats", chats), ("pairs", pairs)):
        path = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        with pytest.raises(GptlabError, match=r"the train split has no example left: 3 of its 3 record\(s\) have "
                           r"their target tokens only past --block-size 8, which cuts them off; raise --block-size"):
            prepare([path], tmp_path / name, tokenizer="char", block_size=8)
        assert prepare([path], tmp_path / name, tokenizer="char", block_size=64)["dropped"] == 0


# --- the read side ----------------------------------------------------------------------------------------------


def test_load_mask_and_windowed_batches(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "x" * (5 + i % 7)} for i in range(40)])
    d = tmp_path / "d"
    meta = prepare([path], d, tokenizer="char", block_size=15)
    data, mask = load_split(d, "train"), load_mask(d, "train")
    starts = batch_starts(len(data), 3, 5, 64, 15, window_tokens=16)
    assert starts.dtype == np.int64 and (starts % 16 == 0).all() and starts.max() + 16 <= len(data)
    rows, mrows = windows(data, starts, 15), windows(mask, starts, 15)
    assert rows.shape == mrows.shape == (64, 16) and rows.dtype == np.int64
    assert (global_batch(data, 3, 5, 64, 15, window_tokens=16) == rows).all()
    assert (windows(data, starts, 7) == rows[:, :8]).all()  # a smaller model reads each window's start
    assert (mrows[:, 1:].sum(1) > 0).all()
    with pytest.raises(GptlabError, match="prepare it again with --block-size 16"):
        batch_starts(len(data), 3, 5, 64, 16, window_tokens=16)
    assert check_split_fits(d, "train", 15) == meta["train_tokens"]
    assert check_split_fits(d, "train", 8) == meta["train_tokens"]
    with pytest.raises(GptlabError) as e:
        check_split_fits(d, "val", 16)
    assert str(e.value) == f"{d} was prepared with --block-size 15; the model's block_size is 16: prepare again " \
        "with --block-size 16"
    with open(d / "val.mask.bin", "ab") as f:
        f.write(b"\0")
    with pytest.raises(GptlabError, match=r"val\.mask\.bin has .* bytes, meta\.json says"):
        load_mask(d, "val")
    (d / "val.mask.bin").unlink()
    with pytest.raises(GptlabError, match=r"val\.mask\.bin is missing"):
        load_mask(d, "val")


def test_text_data_is_unchanged(tmp_path: Path) -> None:
    """No mask, no windows, and global_batch draws exactly what it drew before windows existed."""
    (tmp_path / "in.txt").write_text("hello world, " * 50)
    d = tmp_path / "d"
    meta = prepare([tmp_path / "in.txt"], d, tokenizer="char")
    assert load_mask(d, "train") is None and "mask" not in meta and "window_tokens" not in meta
    data = load_split(d, "train")
    rng = np.random.Generator(np.random.PCG64([7, 3]))
    old = rng.integers(0, len(data) - 16, size=8)
    assert (batch_starts(len(data), 7, 3, 8, 16) == old).all()
    assert (global_batch(data, 7, 3, 8, 16) == data[old[:, None] + np.arange(17)].astype(np.int64)).all()
    # a record run over the same directory, then a text run again: no stale mask is left
    prepare([write_jsonl(tmp_path / "r.jsonl", [{"text": "hello"}] * 3)], d, tokenizer="char", block_size=8)
    assert (d / "train.mask.bin").exists()
    prepare([tmp_path / "in.txt"], d, tokenizer="char")
    assert not (d / "train.mask.bin").exists() and load_mask(d, "train") is None
