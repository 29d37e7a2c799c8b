"""`gptlab convert SRC DST`: a Hugging Face directory -> a gptlab checkpoint, or a gptlab checkpoint / run
-> a Hugging Face directory. The direction follows from SRC unless --to says otherwise."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from gptlab.errors import GptlabError
from gptlab.interop.hf import _dtype, from_hf, save_hf


def run_convert(args: argparse.Namespace) -> int:
    from gptlab.checkpoint import is_hf_dir, load_gptlab_model, resolve_checkpoint, save_model

    src = resolve_checkpoint(args.src)
    dst = Path(args.dst)
    _check_destination(src, dst)
    src_is_hf = is_hf_dir(src)
    to = args.to or ("gptlab" if src_is_hf else "hf")
    dtype = _dtype(args.dtype) if args.dtype else None
    model = from_hf(src, dtype=dtype) if src_is_hf else load_gptlab_model(src, dtype=dtype)
    tokenizer, why_not = _load_tokenizer(src)

    if to == "hf":
        save_hf(model, dst, tokenizer)
        what = f"Hugging Face {_architecture(dst)}"
    else:
        save_model(dst, model, tokenizer)
        what = "gptlab checkpoint"
    n, dtype_name = model.num_parameters(), str(model.lm_head.weight.dtype).removeprefix("torch.")
    print(f"wrote {what} ({n:,} parameters, {dtype_name}) to {dst}: "
          f"{', '.join(sorted(p.name for p in dst.iterdir()))}")
    if tokenizer is None:
        print(f"note: no tokenizer copied ({why_not})")
    elif to == "hf" and not (dst / "tokenizer.json").is_file():
        print(f"note: the {tokenizer.kind} tokenizer was saved in gptlab's format only (no tokenizer.json), "
              "so transformers cannot load it")
    return 0


def _check_destination(src: Path, dst: Path) -> None:
    """DST is replaced as a whole (atomically), so refuse anything that could lose unrelated files."""
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise GptlabError(f"DST {dst} overlaps SRC {src}: write the converted model somewhere else")
    if dst.exists() and not dst.is_dir():
        raise GptlabError(f"DST {dst} is a file: pass a directory to create")
    if dst.is_dir() and any(dst.iterdir()) and not (dst / "config.json").is_file():
        raise GptlabError(f"DST {dst} is a non-empty directory that holds no model; refusing to replace it")


def _load_tokenizer(directory: Path) -> tuple[Any, str]:
    from gptlab.tokenizer import load_tokenizer

    try:
        return load_tokenizer(directory), ""
    except GptlabError as e:
        return None, str(e)


def _architecture(directory: Path) -> str:
    import json

    return json.loads((directory / "config.json").read_text())["architectures"][0]
