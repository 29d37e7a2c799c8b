"""Reading back what `Tokenizer.save` wrote, or the tokenizer of a plain Hugging Face model directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError
from gptlab.fileio import parse_json, read_utf8
from gptlab.tokenizer.base import (
    HF_FILE,
    KINDS,
    META_FILE,
    CharTokenizer,
    DamagedTokenizer,
    GPT2Tokenizer,
    Tokenizer,
)
from gptlab.tokenizer.huggingface import HFTokenizer, load_hf_dir


def load_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """Load what :meth:`Tokenizer.save` wrote, or the tokenizer of a Hugging Face model directory."""
    d = Path(directory)
    if d.is_file() and d.name in (META_FILE, HF_FILE):
        d = d.parent
    if d.is_file():
        raise GptlabError(f"{d} is a file, not a tokenizer directory (a GGUF file's tokenizer is read by the model "
                          f"commands: `gptlab convert {d} DIR` writes it as a directory)")
    if not d.is_dir():
        raise GptlabError(f"tokenizer directory {d} does not exist")
    if (d / META_FILE).is_file():
        meta = _read_meta(d / META_FILE)
        kind = meta.get("kind")
        if kind == "char":
            chars = meta.get("chars")
            if not isinstance(chars, list) or not all(isinstance(c, str) for c in chars):
                raise GptlabError(f"{d / META_FILE} has kind 'char' but no 'chars' list; re-run gptlab prepare")
            return CharTokenizer(chars)
        if kind == "gpt2":
            return GPT2Tokenizer()
        if kind in ("bpe", "hf"):
            if not (d / HF_FILE).is_file():
                raise GptlabError(f"{d} has a {kind} tokenizer_meta.json but no {HF_FILE}; re-save the tokenizer")
            from tokenizers import Tokenizer as HFTok

            try:
                tok = HFTok.from_file(str(d / HF_FILE))
            except Exception as e:  # the tokenizers library raises a bare Exception for a file it can't parse
                raise damaged(d / HF_FILE, f"`tokenizers` cannot read it: {e}") from None
            _check_meta_fields(d / META_FILE, meta)
            return HFTokenizer(tok, kind, meta.get("eot_id"), meta.get("bos_id"), meta.get("chat_template"),
                               str(d / META_FILE))
        raise GptlabError(f"{d / META_FILE} has unknown tokenizer kind {kind!r} (expected one of {KINDS})")
    if (d / HF_FILE).is_file() or ((d / "vocab.json").is_file() and (d / "merges.txt").is_file()):
        return load_hf_dir(d)
    held = _held_by_model(d)
    if held is not None:
        return load_tokenizer(held)
    raise GptlabError(
        f"no tokenizer in {d}: expected {META_FILE} (written by gptlab) or a Hugging Face {HF_FILE} "
        "(or vocab.json + merges.txt)"
    )


def _check_meta_fields(path: Path, meta: dict) -> None:
    """tokenizer_meta.json's optional fields have their types (a damaged file is named, never half-used: a chat
    template that is not text would otherwise be replaced by the built-in one without a word)."""
    for key in ("eot_id", "bos_id"):
        value = meta.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise damaged(path, f"{key} must be a token id (an integer >= 0) or null, got {value!r}")
    template = meta.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise damaged(path, f"chat_template must be text (a Jinja template) or null, got {type(template).__name__}")


def _held_by_model(d: Path) -> Path | None:
    """Where a run's or a LoRA checkpoint's tokenizer is: a run's checkpoints (best, else the newest step, which
    all copied the tokenizer of the run's data), a LoRA checkpoint's base. Its layout is spelt out here, not
    imported from gptlab.checkpoint: tokenizers never import torch."""
    root = d / "checkpoints"
    if root.is_dir():
        steps = sorted((p for p in root.glob("step-*") if p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
        for candidate in (root / "best", *reversed(steps)):
            if (candidate / META_FILE).is_file() or (candidate / HF_FILE).is_file():
                return candidate
    if (d / "lora.json").is_file():
        try:
            base = parse_json(read_utf8(d / "lora.json"))["base"]["path"]
        except (GptlabError, ValueError, KeyError, TypeError):
            return None
        if isinstance(base, str) and Path(base).is_dir() and Path(base).resolve() != d.resolve():
            return Path(base)
    return None


def damaged(path: Path, why: str) -> DamagedTokenizer:
    return DamagedTokenizer(f"the tokenizer file {path} is damaged ({why}): copy it again from where it came "
                            "from, or re-run gptlab prepare")


def _read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = parse_json(read_utf8(path))
    except ValueError as e:
        raise damaged(path, f"not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise damaged(path, f"a JSON {type(meta).__name__}, not an object")
    return meta


def optional_tokenizer(directory: str | os.PathLike[str]) -> tuple[Tokenizer | None, str]:
    """The tokenizer saved in `directory`, or (None, why not) when it has none: a model directory need not
    carry one. A damaged one is an error (DamagedTokenizer), not none."""
    try:
        return load_tokenizer(directory), ""
    except DamagedTokenizer:
        raise
    except GptlabError as e:
        return None, str(e)
