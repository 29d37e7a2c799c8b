"""Every JSON file gptlab reads from a model or data directory, damaged in every way JSON allows, and every
safetensors header cut or edited: each load either works or fails in one line naming the file (a GptlabError or
ValueError: `gptlab` exits 2), never with another exception (an "internal error") or a hang.

The damage is systematic: the whole file (empty, cut in half, not JSON, another JSON type, nested 100,000 deep)
and each of its top-level keys removed or set to each value of VALUES (wrong types, 0, -1, huge, nan, inf).
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import corpus_text, hf_llama_dir, make_data, tiny_model

from gptlab import save_model
from gptlab.errors import GptlabError
from gptlab.tokenizer import CharTokenizer

VALUES = {"null": None, "text": "x", "list": [1], "object": {"a": 1}, "true": True, "zero": 0, "minus-one": -1,
          "huge": 2**63, "huge-float": 1e308, "nan": math.nan, "inf": math.inf}
WHOLE = {"empty": b"", "cut": None, "not-json": b"{ torn", "list": b"[1, 2]", "number": b"7", "string": b'"x"',
         "deep": b"[" * 100_000 + b"]" * 100_000, "not-utf8": b'{"a": "\xff\xfe"}', "binary": bytes(range(256)) * 4,
         "nan": b"NaN", "huge": b"1" * 5000, "directory": None}


@pytest.fixture(scope="module")
def originals(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One good directory of each kind gptlab reads."""
    import torch

    from gptlab.loading import base_reference
    from gptlab.lora import LoRASpec, add_lora

    root = tmp_path_factory.mktemp("damaged")
    tok = CharTokenizer.from_text(corpus_text(2000))
    base = save_model(root / "ckpt", tiny_model(vocab_size=tok.vocab_size), tok)
    lora_model = add_lora(tiny_model(vocab_size=tok.vocab_size), LoRASpec(rank=2), base=base_reference(base))
    with torch.no_grad():
        for name, p in lora_model.named_parameters():
            if "lora" in name:
                p.normal_()
    lora = save_model(root / "lora", lora_model, tok)
    return {"ckpt": base, "lora": lora, "hf": hf_llama_dir(root / "hf", corpus_text(2000)),
            "data": make_data(root, chars=4000)}


def load_model_dir(d: Path) -> None:
    from gptlab.loading import load_model

    load_model(d)


def load_data_dir(d: Path) -> None:
    from gptlab.data.dataset import check_split_fits, load_mask, read_meta
    from gptlab.tokenizer import load_tokenizer

    read_meta(d)
    load_tokenizer(d)
    for split in ("train", "val"):
        check_split_fits(d, split, 8)
        load_mask(d, split)


# (directory kind, file, loader)
FILES: list[tuple[str, str, Callable[[Path], None]]] = [
    ("ckpt", "config.json", load_model_dir),
    ("ckpt", "tokenizer_meta.json", load_model_dir),
    ("lora", "lora.json", load_model_dir),
    ("lora", "config.json", load_model_dir),
    ("hf", "config.json", load_model_dir),
    ("hf", "tokenizer_config.json", load_model_dir),
    ("hf", "tokenizer.json", load_model_dir),
    ("data", "meta.json", load_data_dir),
    ("data", "tokenizer_meta.json", load_data_dir),
]


def damaged_copy(originals: dict[str, Path], tmp_path: Path, kind: str) -> Path:
    d = tmp_path / kind
    shutil.copytree(originals[kind], d)
    return d


def assert_one_line_or_loads(load: Callable[[Path], None], d: Path, name: str) -> None:
    try:
        load(d)
    except (GptlabError, ValueError, OSError) as e:
        message = str(e)
        assert "\n" not in message.strip(), message
        assert name in message or str(d) in message, f"the error does not name {name}: {message}"


def cases() -> list[tuple[str, str, str, str]]:
    out = []
    for kind, name, _ in FILES:
        out += [(kind, name, "whole", w) for w in WHOLE]
    return out


@pytest.mark.parametrize(("kind", "name", "part", "how"), cases(), ids=lambda x: str(x))
def test_a_damaged_json_file_is_one_line(originals, tmp_path: Path, kind: str, name: str, part: str,
                                         how: str) -> None:
    load = next(f for k, n, f in FILES if (k, n) == (kind, name))
    d = damaged_copy(originals, tmp_path, kind)
    damage_whole(d / name, how)
    assert_one_line_or_loads(load, d, name)


def damage_whole(path: Path, how: str) -> None:
    """`path` replaced by one of WHOLE's damages ("cut": its first half; "directory": an empty directory)."""
    if how == "directory":
        path.unlink()
        path.mkdir()
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2] if how == "cut" else WHOLE[how])


@pytest.mark.parametrize(("kind", "name"), [(k, n) for k, n, _ in FILES], ids=lambda x: str(x))
def test_every_key_of_a_json_file_at_every_value_is_one_line(originals, tmp_path: Path, kind: str,
                                                             name: str) -> None:
    load = next(f for k, n, f in FILES if (k, n) == (kind, name))
    d = damaged_copy(originals, tmp_path, kind)
    path = d / name
    good = json.loads(path.read_text())
    if name == "tokenizer.json":  # Hugging Face's own file: its keys are the tokenizers library's
        good = {k: good[k] for k in ("model", "added_tokens", "pre_tokenizer")}
    failures = []
    for key in good:
        for label, value in [("removed", ...), *VALUES.items()]:
            changed = json.loads(path.read_text()) if name == "tokenizer.json" else dict(good)
            if value is ...:
                changed.pop(key)
            else:
                changed[key] = value
            path.write_text(json.dumps(changed))
            try:
                assert_one_line_or_loads(load, d, name)
            except BaseException as e:  # noqa: BLE001 - collected: one report lists every key that fails
                failures.append(f"{key}={label}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
    path.write_text(json.dumps(good) if name != "tokenizer.json" else path.read_text())
    assert not failures, "\n".join(failures)


# --- safetensors: an 8-byte header length, a JSON header, the bytes ----------------------------------------------
def header_edits(header: dict) -> dict[str, Callable[[bytes], bytes]]:
    first = next(k for k in header if k != "__metadata__")

    def with_header(h: dict) -> Callable[[bytes], bytes]:
        def edit(data: bytes) -> bytes:
            n = struct.unpack("<Q", data[:8])[0]
            text = json.dumps(h).encode()
            text += b" " * (-len(text) % 8)
            return struct.pack("<Q", len(text)) + text + data[8 + n:]
        return edit

    def entry(**change: object) -> Callable[[bytes], bytes]:
        return with_header({**header, first: {**header[first], **change}})

    return {
        "length-huge": lambda data: struct.pack("<Q", 2**63) + data[8:],
        "length-past-end": lambda data: struct.pack("<Q", len(data)) + data[8:],
        "length-zero": lambda data: struct.pack("<Q", 0) + data[8:],
        "cut-in-header": lambda data: data[:12],
        "cut-in-data": lambda data: data[: len(data) - 8],
        "header-list": with_header([1]),  # type: ignore[arg-type]
        "dtype-unknown": entry(dtype="Q9"),
        "dtype-other": entry(dtype="I64"),
        "shape-wrong": entry(shape=[1, 2, 3]),
        "shape-negative": entry(shape=[-1]),
        "shape-text": entry(shape="x"),
        "offsets-past-end": entry(data_offsets=[0, 2**40]),
        "offsets-reversed": entry(data_offsets=[8, 0]),
        "offsets-text": entry(data_offsets="x"),
        "entry-removed": with_header({k: v for k, v in header.items() if k != first}),
        "metadata-list": with_header({**header, "__metadata__": [1]}),
    }


def safetensors_cases() -> list[tuple[str, str, str]]:
    sample = {"__metadata__": {}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    return [(kind, file, edit) for kind, file in (("ckpt", "model.safetensors"), ("lora", "lora.safetensors"),
                                                 ("hf", "model.safetensors"))
            for edit in header_edits(sample)]


@pytest.mark.parametrize(("kind", "name", "edit"), safetensors_cases(), ids=lambda x: str(x))
def test_a_damaged_safetensors_header_is_one_line(originals, tmp_path: Path, kind: str, name: str,
                                                  edit: str) -> None:
    d = damaged_copy(originals, tmp_path, kind)
    path = d / name
    data = path.read_bytes()
    header = json.loads(data[8: 8 + struct.unpack("<Q", data[:8])[0]])
    path.write_bytes(header_edits(header)[edit](data))
    assert_one_line_or_loads(load_model_dir, d, name)


# --- token files: any size --------------------------------------------------------------------------------------
@pytest.mark.parametrize("split", ["train", "val"])
@pytest.mark.parametrize("size", ["empty", "odd", "short", "longer"])
def test_a_token_file_of_any_size_is_one_line(originals, tmp_path: Path, split: str, size: str) -> None:
    d = damaged_copy(originals, tmp_path, "data")
    for suffix in (".bin",):
        path = d / f"{split}{suffix}"
        data = path.read_bytes()
        path.write_bytes({"empty": b"", "odd": data[:-1], "short": data[:2],
                          "longer": data + np.zeros(3, np.uint16).tobytes()}[size])
    assert_one_line_or_loads(load_data_dir, d, f"{split}.bin")


# --- well-formed weights of the wrong kind ----------------------------------------------------------------------
@pytest.mark.parametrize(("kind", "name"), [("ckpt", "model.safetensors"), ("lora", "lora.safetensors"),
                                            ("hf", "model.safetensors")])
@pytest.mark.parametrize("dtype", ["int8", "int32", "bool"])
def test_integer_weights_are_one_line(originals, tmp_path: Path, kind: str, name: str, dtype: str) -> None:
    """A whole, readable file whose weights (one of them, or all) are integers: a quantized or foreign file. It is
    refused naming the file, not cast to other numbers nor left to torch's page-long load_state_dict error."""
    import torch
    from safetensors.torch import load_file, save_file

    for which in ("one", "all"):
        d = damaged_copy(originals, tmp_path / which, kind)
        state = load_file(d / name)
        first = sorted(k for k, t in state.items() if t.dim() == 2 and ".0." in k)[0]  # a block's: always read
        state = {k: (t * 100).to(getattr(torch, dtype)) if which == "all" or k == first else t
                 for k, t in state.items()}
        save_file(state, d / name, metadata={"format": "pt"})
        with pytest.raises(GptlabError, match=f"holds {dtype} values") as e:
            load_model_dir(d)
        assert "\n" not in str(e.value) and str(d) in str(e.value), str(e.value)
