"""Any model path in, a model out: a run directory, a gptlab checkpoint or a Hugging Face model directory.

Every command that reads a model (`sample`, `eval`, `serve`, `convert`, training's `init_from`) comes through
`load_model`, so each of them takes all three kinds of path:

* a checkpoint directory: `model.safetensors` + `config.json` (gptlab's format, `gptlab.checkpoint`);
* a Hugging Face directory: a `config.json` with a `model_type` (read by `gptlab.interop`);
* a run directory (`gptlab train --out`): its best checkpoint, or its latest step (`prefer`).

`convert` moves a model between the two formats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from gptlab.checkpoint import (
    BEST_NAME,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    MODEL_FILE,
    list_step_checkpoints,
    load_gptlab_model,
    save_model,
)
from gptlab.errors import GptlabError
from gptlab.interop import from_hf, save_hf
from gptlab.model import GPT
from gptlab.tokenizer import Tokenizer, optional_tokenizer


def is_hf_dir(path: Path) -> bool:
    """True for a directory whose config.json names a Hugging Face `model_type`."""
    cfg = path / CONFIG_FILE
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False


def resolve_checkpoint(path: str | Path, prefer: str = "best") -> Path:
    """A checkpoint directory (or Hugging Face directory) from a run, checkpoint or HF path.

    For a run directory, `prefer="best"` picks the best-validation checkpoint when there is one, else the
    latest; `prefer="latest"` picks the latest step.
    """
    path = Path(path)
    if not path.exists():
        raise GptlabError(f"{path} does not exist: pass a run directory, a checkpoint directory or a "
                          "Hugging Face one")
    if path.is_file():
        if path.name == MODEL_FILE:
            return path.parent
        raise GptlabError(f"{path} is a file: pass the directory that holds {MODEL_FILE} and {CONFIG_FILE}")
    if (path / MODEL_FILE).is_file() and (path / CONFIG_FILE).is_file() or is_hf_dir(path):
        return path
    best = path / CHECKPOINTS_DIR / BEST_NAME
    steps = list_step_checkpoints(path)
    if prefer == "best" and (best / MODEL_FILE).is_file():
        return best
    if steps:
        return steps[-1]
    if (best / MODEL_FILE).is_file():
        return best
    raise GptlabError(f"no checkpoint found in {path}: expected {MODEL_FILE} + {CONFIG_FILE}, a run "
                      f"directory with {CHECKPOINTS_DIR}/step-*/, or a Hugging Face model directory")


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    prefer: str = "best",
) -> tuple[GPT, Tokenizer | None]:
    """Load (model, tokenizer) from a run, checkpoint or Hugging Face directory (tokenizer: None if none)."""
    directory = resolve_checkpoint(path, prefer=prefer)
    if is_hf_dir(directory):
        model = from_hf(directory, device=device, dtype=dtype)
    else:
        model = load_gptlab_model(directory, device=device, dtype=dtype)
    return model, optional_tokenizer(directory)[0]


# ------------------------------------------------------------------------------------------------------------
# Conversion between the formats
# ------------------------------------------------------------------------------------------------------------
@dataclass
class Conversion:
    """What `convert` wrote: the format, the model, its tokenizer (None, and why, when the source had none)."""

    to: str  # "hf" or "gptlab"
    destination: Path
    model: GPT
    tokenizer: Tokenizer | None
    no_tokenizer_reason: str = ""

    @property
    def architecture(self) -> str:
        """The Hugging Face class name written (hf), else "gptlab checkpoint"."""
        if self.to != "hf":
            return "gptlab checkpoint"
        return json.loads((self.destination / CONFIG_FILE).read_text())["architectures"][0]


def convert(src: str | Path, dst: str | Path, to: str | None = None, dtype: torch.dtype | None = None) -> Conversion:
    """A Hugging Face directory -> a gptlab checkpoint, or a gptlab checkpoint / run -> a Hugging Face directory
    (`to` overrides the direction, which otherwise follows from `src`). DST is replaced as a whole, atomically;
    the tokenizer comes along when SRC has one."""
    if to not in (None, "hf", "gptlab"):
        raise GptlabError(f"cannot convert to {to!r}: choose hf or gptlab")
    src = resolve_checkpoint(src)
    dst = Path(dst)
    _check_destination(src, dst)
    src_is_hf = is_hf_dir(src)
    to = to or ("gptlab" if src_is_hf else "hf")
    model = from_hf(src, dtype=dtype) if src_is_hf else load_gptlab_model(src, dtype=dtype)
    tokenizer, why_not = optional_tokenizer(src)
    if to == "hf":
        save_hf(model, dst, tokenizer)
    else:
        save_model(dst, model, tokenizer)
    return Conversion(to, dst, model, tokenizer, why_not)


def _check_destination(src: Path, dst: Path) -> None:
    """DST is replaced as a whole (atomically), so refuse anything that could lose unrelated files."""
    s, d = src.resolve(), dst.resolve()
    if s == d or s in d.parents or d in s.parents:
        raise GptlabError(f"DST {dst} overlaps SRC {src}: write the converted model somewhere else")
    if dst.exists() and not dst.is_dir():
        raise GptlabError(f"DST {dst} is a file: pass a directory to create")
    if dst.is_dir() and any(dst.iterdir()) and not (dst / CONFIG_FILE).is_file():
        raise GptlabError(f"DST {dst} is a non-empty directory that holds no model; refusing to replace it")
